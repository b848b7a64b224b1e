"""Block-wise FP8 checkpoints (DeepSeek-V3's and Qwen3-FP8's format) read into a bf16/fp32 model.

Each test checkpoint is written here as the publishers write theirs: the linear weights in float8
e4m3 with one fp32 `weight_scale_inv` per block (partial blocks at the edges: 12 x 20 blocks over
tiny shapes), embeddings, norms, routers and the lm head left as they are, a weight and its scale in
different shard files. Reference: a naive per-element loop of w[i, j] = q[i, j] *
scale_inv[i // 12, j // 20] over the stored fp8 values; and through the CLI, `rlloom eval` of the
FP8 folder equals `rlloom eval` of an fp32 folder holding those dequantized values.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models_testutil import randomize_
from safetensors.torch import load_file, save_file

import rlloom.models as models
from rlloom.cli import main
from rlloom.engines.rollout.native.tp_weights import from_pretrained_sharded
from rlloom.models.adapter import hf_named_tensors
from rlloom.models.checkpoint import build_model
from rlloom.models.fp8_checkpoint import dequantize_blocks
from rlloom.parallel import init_distributed

BLOCK = (12, 20)
QUANT = {
    "quant_method": "fp8",
    "weight_block_size": list(BLOCK),
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
}
DEEPSEEK = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64,
    "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 2,
    "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16,
    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip


def quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 q, fp32 scale_inv) of a 2-D weight in BLOCK blocks: scale = the block's max |w| / 448."""
    rows, cols = (math.ceil(n / b) for n, b in zip(w.shape, BLOCK))
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            cut = (slice(r * BLOCK[0], (r + 1) * BLOCK[0]), slice(c * BLOCK[1], (c + 1) * BLOCK[1]))
            scale[r, c] = w[cut].abs().max().clamp(min=1e-12) / 448.0
            q[cut] = (w[cut] / scale[r, c]).to(torch.float8_e4m3fn)
    return q, scale


def naive_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            out[i, j] = q[i, j].float() * scale_inv[i // BLOCK[0], j // BLOCK[1]]
    return out


def is_quantized(name: str, t: torch.Tensor) -> bool:
    """The publishers' choice: linear weights, not the embedding, the lm head or the routers."""
    return t.dim() == 2 and not any(s in name for s in ("embed_tokens", "lm_head", "mlp.gate.weight"))


def write_fp8(source: Path, out: Path) -> dict[str, torch.Tensor]:
    """Write `source` (an fp32 checkpoint folder) as a block-FP8 one in two shards, scales in the
    first and their weights in the second; return the fp32 tensors it stands for."""
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors |= load_file(file)
    first, second, meant = {}, {}, {}
    for name, t in tensors.items():
        if is_quantized(name, t):
            q, scale = quantized(t)
            first[name + "_scale_inv"], second[name] = scale, q
            meant[name] = naive_dequantize(q, scale)
        else:
            second[name] = t
            meant[name] = t
    save_file(first, out / "model-00001-of-00002.safetensors")
    save_file(second, out / "model-00002-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in second}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"quantization_config": QUANT}))
    return meant


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory):
    """(an fp32 DeepSeek-V3 checkpoint, its block-FP8 version, the fp32 tensors the latter stands for)."""
    root = tmp_path_factory.mktemp("fp8")
    model = build_model(DEEPSEEK, dtype=torch.float32, device="cpu")
    randomize_(model, seed=0)
    models.save_pretrained(model, root / "fp32")
    meant = write_fp8(root / "fp32", root / "fp8")
    return root / "fp32", root / "fp8", meant


def test_dequantize_blocks_equals_the_per_element_rule():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(30, 45, generator=gen)  # partial blocks in both directions
    q, scale = quantized(w)
    assert torch.equal(dequantize_blocks(q, scale, BLOCK), naive_dequantize(q, scale))


def test_fp8_deepseek_checkpoint_loads_its_dequantized_values(deepseek_dirs, tmp_path):
    fp32_dir, fp8_dir, meant = deepseek_dirs
    model = models.from_pretrained(fp8_dir)
    original = models.from_pretrained(fp32_dir)
    ours = dict(hf_named_tensors(model))
    assert ours.keys() == meant.keys()
    quantized_names = [n for n, t in meant.items() if is_quantized(n, t)]
    assert len(quantized_names) > 20  # attention, dense and shared MLPs, every routed expert
    for name, want in meant.items():
        assert torch.equal(ours[name], want), name
    # and close to the unquantized weights: e4m3 keeps 3 mantissa bits
    reference = dict(hf_named_tensors(original))
    for name in quantized_names:
        scale = reference[name].abs().max()
        assert (ours[name] - reference[name]).abs().max() <= 0.07 * scale, name
    # what the loaded model saves is unquantized, and loads again as the same model
    assert "quantization_config" not in model.hf_config
    models.save_pretrained(model, tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    again = dict(hf_named_tensors(models.from_pretrained(tmp_path / "saved")))
    assert all(torch.equal(again[n], t) for n, t in ours.items())


def _one_line_error(path: Path) -> str:
    with pytest.raises(ValueError) as info:
        models.from_pretrained(path)
    message = str(info.value)
    assert "\n" not in message and "Fix:" in message, message
    return message


def test_fp8_checkpoint_errors_name_the_problem(deepseek_dirs, tmp_path):
    _, fp8_dir, _ = deepseek_dirs
    broken = tmp_path / "no_scale"
    shutil.copytree(fp8_dir, broken)
    first = broken / "model-00001-of-00002.safetensors"
    scales = load_file(first)
    dropped = sorted(scales)[0]
    del scales[dropped]
    save_file(scales, first)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"][dropped]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    message = _one_line_error(broken)
    assert "without their pair" in message and dropped.removesuffix("_scale_inv") in message

    other = tmp_path / "gptq"
    shutil.copytree(fp8_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "gptq"}}))
    assert "quant_method: 'gptq'" in _one_line_error(other)

    blocks = tmp_path / "blocks"
    shutil.copytree(fp8_dir, blocks)
    wrong = cfg | {"quantization_config": QUANT | {"weight_block_size": [16, 16]}}
    (blocks / "config.json").write_text(json.dumps(wrong))
    assert "weight_block_size" in _one_line_error(blocks)


def test_rlloom_eval_of_an_fp8_checkpoint_equals_its_dequantized_fp32_one(tiny_checkpoint, tmp_path, capsys):
    lively = tmp_path / "lively"  # O(1) logits: greedy answers that weights can change
    models.save_pretrained(randomize_(models.from_pretrained(tiny_checkpoint), seed=1), lively)
    fp8 = tmp_path / "fp8"
    meant = write_fp8(lively, fp8)
    dequantized = tmp_path / "dequantized"
    shutil.copytree(lively, dequantized)
    for file in dequantized.glob("*.safetensors"):
        file.unlink()
    (dequantized / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(meant, dequantized / "model.safetensors")
    answers = []
    for path in (fp8, dequantized, lively):
        out = tmp_path / f"{path.name}.jsonl"
        argv = [
            "eval",
            str(path),
            "arithmetic",
            "data.num_eval=6",
            "rollout.num_blocks=16",
            "--responses",
            str(out),
        ]
        assert main(argv) == 0
        capsys.readouterr()
        answers.append([json.loads(line)["responses"] for line in out.read_text().splitlines()])
    assert len(answers[0]) == 6 and answers[0] == answers[1]
    assert answers[0] != answers[2]  # the FP8 rounding shows in greedy answers: the check can see weights


def test_rlloom_train_starts_from_an_fp8_checkpoint_and_saves_unquantized(tiny_checkpoint, tmp_path, capsys):
    fp8 = tmp_path / "fp8"
    write_fp8(tiny_checkpoint, fp8)
    run = tmp_path / "run"
    argv = [
        "train",
        "arithmetic_smoke",
        f"model.path={fp8}",
        "trainer.total_steps=1",
        f"trainer.run_dir={run}",
        "data.num_train=16",  # not the recipe's 10000 prompts to tokenize
    ]
    assert main(argv) == 0
    capsys.readouterr()
    saved = run / "hf" / "step_000001"
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    assert {t.dtype for t in load_file(saved / "model.safetensors").values()} == {torch.float32}
    models.from_pretrained(saved)  # loads as the plain checkpoint it is


def test_tensor_parallel_rollout_loader_reads_fp8_checkpoints(deepseek_dirs):
    _, fp8_dir, _ = deepseek_dirs
    started = not dist.is_initialized()
    init_distributed("cpu")  # one rank: the whole model is this rank's shard
    try:
        sharded = from_pretrained_sharded(
            str(fp8_dir), dist.group.WORLD, dtype=torch.float32, device=torch.device("cpu")
        )
    finally:
        if started:  # later tests start process groups of their own
            dist.destroy_process_group()
    whole = models.from_pretrained(fp8_dir, fused_projections=True)
    ours = dict(hf_named_tensors(sharded))
    for name, tensor in hf_named_tensors(whole):
        assert torch.equal(ours[name], tensor), name
