"""`rlloom export` and the run's own Hugging Face folders, for dense, Qwen3-MoE and DeepSeek-V3 models.

Each case trains 2 steps at lr 3e-2 (weights move far from the start), exports the newest
checkpoint with the CLI, and loads the folder with transformers' AutoModelForCausalLM: its fp32
logits must equal the trained engine's (the live one, captured from the run) within 1e-5, and the
weights must differ from the starting ones. The folder the run wrote at its end must hold the same
tensors as the export from the checkpoint.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    LlamaConfig,
    MixtralConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

import rlloom.trainer.loop as loop_module
import rlloom.trainer.run as run_module
from rlloom.cli import main
from rlloom.config import TrainEngineConfig, load_config
from rlloom.engines.train.hf_folder import save_hf_folder
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.trainer.export import hf_dir

_SIZES = dict(hidden_size=32, num_attention_heads=4, max_position_embeddings=512, tie_word_embeddings=False)
CONFIGS = {
    "dense": lambda: Qwen3Config(
        **_SIZES, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2, head_dim=8
    ),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_SIZES,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "deepseek_v3_q_lora": lambda: DeepseekV3Config(
        **_SIZES,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
    ),
}


# Architectures whose export is also checked without training (the engine's weights at the start).
MORE_CONFIGS = {
    "llama": lambda: LlamaConfig(**_SIZES, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2),
    "mixtral": lambda: MixtralConfig(
        **_SIZES, intermediate_size=24, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4
    ),
    "deepseek_v3_no_q_lora": lambda: DeepseekV3Config(
        **{**CONFIGS["deepseek_v3_q_lora"]().to_dict(), "q_lora_rank": None}
    ),
}


def build_model_dir(kind: str, tokenizer_dir: Path, out: Path) -> Path:
    """A tiny random HF model of `kind` with the character tokenizer of `tokenizer_dir`."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = (CONFIGS | MORE_CONFIGS)[kind]()
    cfg.vocab_size, cfg.eos_token_id, cfg.pad_token_id = len(tok), tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg.to_dict()), dtype=torch.float32)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def train_two_steps(model_dir: Path, run_dir: Path, monkeypatch, *extra: str):
    """Run 2 RL steps and return the live worker group (its training engine is the trained policy)."""
    groups = []
    build = run_module.build_groups
    monkeypatch.setattr(run_module, "build_groups", lambda cfg: groups.append(build(cfg)) or groups[-1])
    cfg = load_config(
        "arithmetic_smoke",
        [
            f"model.path={model_dir}",
            f"trainer.run_dir={run_dir}",
            "train.lr=3e-2",
            "algorithm.entropy_coef=0.01",  # a gradient even when every reward is equal
            "data.num_eval=0",
            "data.num_train=8",
            "trainer.prompts_per_step=2",
            "rollout.n_samples=2",
            "rollout.max_new_tokens=4",
            "rollout.num_blocks=16",
            "logging.console=false",
            *extra,
        ],
    )
    run_module.run(cfg)
    return groups[0]


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_export_round_trip_matches_trained_engine(kind, tiny_checkpoint, tmp_path, monkeypatch, capsys):
    model_dir = build_model_dir(kind, tiny_checkpoint, tmp_path / "start")
    run_dir = tmp_path / "run"
    group = train_two_steps(model_dir, run_dir, monkeypatch)
    out = tmp_path / "exported"
    assert main(["export", str(run_dir), str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(out)

    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.float32 and (out / "tokenizer.json").is_file()
    ids = torch.randint(0, hf.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = group.train.worker.engine.model(ids)
        actual = hf(ids).logits
    assert (actual - expected).abs().max().item() <= 1e-5

    exported, start = tensors(out), tensors(model_dir)
    assert exported.keys() == start.keys()
    moved = max((exported[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-2, "the export holds the starting weights, not the trained ones"
    # The run's own folder (written at its end from the live engine) holds the same tensors.
    at_end = tensors(hf_dir(run_dir, 2))
    assert all(torch.equal(at_end[k], exported[k]) for k in exported)


@pytest.mark.parametrize("kind", list(MORE_CONFIGS))
def test_engine_weights_round_trip_for_every_architecture(kind, tiny_checkpoint, tmp_path):
    model_dir = build_model_dir(kind, tiny_checkpoint, tmp_path / "start")
    engine = NativeTrainEngine.build(TrainEngineConfig(), str(model_dir))
    out = save_hf_folder(engine, str(model_dir), tmp_path / "out")
    exported, start = tensors(out), tensors(model_dir)
    assert exported.keys() == start.keys()
    assert all(torch.equal(exported[k], start[k]) for k in start)
    assert (
        type(AutoModelForCausalLM.from_pretrained(out)).__name__
        == type(AutoModelForCausalLM.from_pretrained(model_dir)).__name__
    )


def test_save_hf_every_export_bf16_and_eval_the_run(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    train_two_steps(tiny_checkpoint, run_dir, monkeypatch, "trainer.save_hf_every=1")
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step_000001", "step_000002"]
    step1, step2 = tensors(hf_dir(run_dir, 1)), tensors(hf_dir(run_dir, 2))
    assert any(not torch.equal(step1[k], step2[k]) for k in step1)

    out = tmp_path / "bf16"
    assert (
        main(["export", str(run_dir / "checkpoints" / "step_000002"), str(out), "--dtype", "bfloat16"]) == 0
    )
    assert {t.dtype for t in tensors(out).values()} == {torch.bfloat16}
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16

    # `rlloom eval RUN_DIR`: the run's settings (max_new_tokens=4) and its newest weights, read from
    # RUN_DIR/hf/step_2 or, once that is gone, from an export of the checkpoint: the same report.
    capsys.readouterr()
    reports = []
    for _ in range(2):
        assert main(["eval", str(run_dir), "arithmetic", "data.num_eval=6", "rollout.num_blocks=16"]) == 0
        reports.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
        shutil.rmtree(run_dir / "hf", ignore_errors=True)
    assert reports[0] == reports[1] and reports[0]["prompts"] == 6 and reports[0]["length_mean"] <= 4


def test_save_hf_every_schedule():
    cfg = load_config("arithmetic_smoke", ["trainer.total_steps=4"])
    due = lambda every: [
        s
        for s in range(1, 5)
        if loop_module._hf_due(replace(cfg, trainer=replace(cfg.trainer, save_hf_every=every)), s, s == 4)
    ]
    assert due(0) == [4] and due(-1) == [] and due(2) == [2, 4] and due(3) == [3, 4]


def _error(capsys, *argv: str) -> str:
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlloom: error: ") and err.count("\n") == 1, err
    return err


def test_export_errors_are_one_line(tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    assert "not an empty folder" in _error(capsys, str(tmp_path), str(busy))
    assert (busy / "notes.txt").read_text() == "keep me"

    out = str(tmp_path / "out")
    assert "does not exist" in _error(capsys, str(tmp_path / "missing"), out)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)  # no checkpoint files in it
    assert "has no complete checkpoint" in _error(capsys, str(run_dir), out)
    interrupted = run_dir / "checkpoints" / "step_000004.tmp-123"
    (interrupted / "engine").mkdir(parents=True)
    (interrupted / "config.yaml").write_text("{}\n")
    assert "interrupted checkpoint save" in _error(capsys, str(interrupted), out)
    assert not Path(out).exists()
    # an output that cannot be created is refused before the checkpoint is read (an errno before)
    step = run_dir / "checkpoints" / "step_000002"
    (step / "engine").mkdir()
    (step / "config.yaml").write_text("{}\n")
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "out"
    assert f"export output '{out}' cannot be created: Not a directory" in _error(capsys, str(step), str(out))
