"""MoE rollout and training against transformers, in one run (one table).

GPU (default): random bf16 weights of Qwen3-30B-A3B's width with 8 of its 48 layers (hidden 2048,
128 experts of width 768, 8 per token, 32 query / 4 KV heads of 128, vocab 151936, untied head):
  - rollout: 128 prompts x 128 tokens -> 256 new tokens, ignore_eos, sampling at T = 1: output
    tokens/s, the memory-bandwidth bound of the decode steps (decode_bound.py: each step reads the
    weights every token uses, the routed experts its tokens chose in this run, each once, and every
    cached key/value), and whether the decode ran as compiled CUDA graphs; transformers' `generate`
    on the same prompts;
  - train: one optimizer step over 4 micro-batches of <= 4096 packed tokens (fp32 master weights,
    bf16 compute, activation checkpointing off), the same batch as one micro-batch of <= 16384, and
    a 4x larger batch as 4 micro-batches of <= 16384 (one GPU: no FSDP, bf16 copies of the fp32
    masters, rlloom/parallel/mixed_precision.py): tokens/s, MFU on active parameters, peak memory; transformers' forward + backward over the same
    number of tokens as 4 x 4096 sequences, one at a time and as one batch.
  - start: seconds from engine construction to the first generated token (compilation included).
  - with `--fp8`, the rollout again with rollout.quantization=fp8 (routed experts in fp8): the same
    columns (its bound counts the fp8 bytes) and the sampled tokens' logprob gap to the unquantized
    model's full forward (mean |gap| and token_mult_prob_error, 16 completions).
With `--model deepseek_v3`: DeepSeek-V3's width with 2 layers (1 dense + 1 MoE of 256 experts, MLA
with the latent KV cache), rollout 64 x 128 -> 128 against transformers, and the KV-cache capacity
(tokens per GiB per layer) beside what caching expanded keys and values would give; no train rows
(fp32 master weights of one DeepSeek-V3 MoE layer do not fit one GPU).

    python benchmarks/bench_moe.py                  # needs a CUDA device
    python benchmarks/bench_moe.py --skip-train     # rollout rows only
    python benchmarks/bench_moe.py --skip-train --fp8   # and the same rollout with fp8 experts
    python benchmarks/bench_moe.py --smoke          # the code path with a tiny MoE on CPU
    python benchmarks/bench_moe.py --model deepseek_v3 [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_rollout import completion_gaps, copy_bandwidth, hf_generate, print_table, row, run_engine  # noqa: E402
from bench_train import make_batch, print_profile  # noqa: E402
from decode_bound import decode_bound_s, weight_bytes  # noqa: E402

from rlloom.algorithms.losses import aggregate_loss_sum, loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.engines.rollout.native import NativeEngine, SamplingParams
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.engines.train.native.flops import step_flops
from rlloom.engines.train.native.plan import plan_batch
from rlloom.models import load_hf_tensors
from rlloom.models.checkpoint import build_model
from rlloom.observability.mfu import H100_BF16_PEAK_FLOPS

QWEN3_30B_A3B_8L = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
}
DEEPSEEK_V3_2L = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
}
TINY_DEEPSEEK = DEEPSEEK_V3_2L | {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
}
TINY = QWEN3_30B_A3B_8L | {
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}


def hf_model(config: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg).eval()
    torch.set_default_dtype(previous)
    return model


def checkpoint_tensors(hf: torch.nn.Module):
    """HF's in-memory weights under checkpoint names: transformers 5 keeps a layer's experts fused
    (gate_up_proj [E, 2I, D] = [gate; up], down_proj [E, D, I]) and splits them only when saving."""
    for name, t in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", t[e, :inter]
                yield f"{prefix}{e}.up_proj.weight", t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", t[e]
        else:
            yield name, t


def write_random_checkpoint(path: Path, config: dict) -> Path:
    """Random bf16 weights of `config` as a Hugging Face checkpoint folder (config.json and one
    model.safetensors) without initialising a model: transformers' model, built on the meta device,
    gives the tensors' names and shapes in the checkpoint layout (one tensor per expert); norm weights
    are 1, the others stretches of one seeded N(0, 0.02) pool (random_fill). On a 2-core CPU, per 1.2B
    parameters: 4.5 s to fill (drawing every value: 12 s), 12 s to save; the 8-layer Qwen3-30B-A3B
    width has 5.6B (11 GB)."""
    from safetensors.torch import save_file

    hf = hf_model(config, torch.device("meta"), torch.bfloat16)
    hf.config.dtype = torch.bfloat16
    torch.manual_seed(0)
    pool = torch.empty(1 << 24, dtype=torch.bfloat16).normal_(0.0, 0.02)
    tensors = {
        name: torch.ones(t.shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight")
        else random_fill(t.shape, pool)
        for name, t in checkpoint_tensors(hf)
    }
    path.mkdir(parents=True, exist_ok=True)
    hf.config.save_pretrained(path)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def random_fill(shape: torch.Size, pool: torch.Tensor) -> torch.Tensor:
    """A new tensor of `shape` made of stretches (at most half the pool each) of `pool` copied from
    random offsets: distinct for every tensor and expert, at the cost of a copy."""
    out = torch.empty(shape.numel(), dtype=pool.dtype)
    step = pool.numel() // 2
    for start in range(0, out.numel(), step):
        length = min(step, out.numel() - start)
        offset = int(torch.randint(pool.numel() - length + 1, ()))
        out[start : start + length] = pool[offset : offset + length]
    return out.view(shape)


def native_from(
    hf: torch.nn.Module, config: dict, dtype: torch.dtype, device: torch.device | None = None, **kw: object
) -> torch.nn.Module:
    device = device or next(hf.parameters()).device
    native = build_model(config, dtype=dtype, device=device, **kw)
    load_hf_tensors(native, checkpoint_tensors(hf))
    return native.eval()


def check_logits(hf: torch.nn.Module, config: dict) -> float:
    """Relative error of the native forward against transformers' on one random sequence (same weights)."""
    device, dtype = next(hf.parameters()).device, next(hf.parameters()).dtype
    native = native_from(hf, config, dtype)
    ids = torch.randint(0, config["vocab_size"], (1, 64), device=device)
    with torch.no_grad():
        want, got = hf(input_ids=ids).logits.float(), native(ids).float()
    del native
    return float((got - want).norm() / want.norm())


def bench_rollout(
    config: dict, hf: torch.nn.Module, table: list, *, prompts_n: int, prompt_len: int, new: int,
    quantization: str = "none", with_hf: bool = True,
):  # fmt: skip
    device = next(hf.parameters()).device
    dtype = next(hf.parameters()).dtype
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config["vocab_size"], (prompts_n, prompt_len), generator=gen).tolist()
    max_len = prompt_len + new
    start = time.perf_counter()
    native = native_from(hf, config, dtype, fused_projections=True)
    engine = NativeEngine(
        native, max_model_len=max_len, num_blocks=prompts_n * -(-max_len // 16) + 64,
        max_num_seqs=prompts_n, eos_token_ids=[], quantization=quantization,
    )  # fmt: skip
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=2, ignore_eos=True))
    first_token_s = time.perf_counter() - start
    # Warm-up at the full batch, so the timed pass replays CUDA graphs captured for every batch size
    # it meets instead of capturing them (an RL run generates many times; the first token's time is
    # reported apart).
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True))
    bandwidth = copy_bandwidth(device)
    r = run_engine(engine, prompts, SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True))
    bound = decode_bound_s(engine.model, engine.runner.dtype, r["decode_rows"], r["completions"], bandwidth)
    mode = (
        "compiled CUDA graphs"
        if engine.runner.graphs is not None and engine.runner.compiled_forward is not None
        else ("CUDA graphs" if engine.runner.graphs is not None else "eager")
    )
    name = f"rollout {prompts_n}x{prompt_len} -> {new}"
    gap = ""
    if quantization != "none":
        gap = f"; {logp_gap(engine, hf, config, prompts[:16], new)}"
    row(table, name, f"rlloom ({quantization})" if quantization != "none" else "rlloom", r,
        f"decode {r['decode_s']:.2f}s ({mode}), bound {bound:.2f}s at {bandwidth / 1e12:.2f} TB/s, ratio "
        f"{bound / max(r['decode_s'], 1e-9):.2f}; first token {first_token_s:.1f}s after build; "
        f"weights {weight_bytes(engine.model) / 2**30:.1f} GiB; {kv_capacity(native.args, dtype)}{gap}")  # fmt: skip
    engine.sleep()
    del engine, native
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if with_hf:
        row(table, name, "transformers generate", hf_generate(hf, prompts, new, pad_id=0))


def logp_gap(
    engine: NativeEngine, hf: torch.nn.Module, config: dict, prompts: list[list[int]], new: int
) -> str:
    """What training would see of a quantized rollout: the sampled tokens' logprobs under the
    unquantized model (a full forward) against the rollout's, as mean |gap| and NeMo-RL's
    token_mult_prob_error (mean exp|gap|)."""
    reference = native_from(hf, config, next(hf.parameters()).dtype)
    gap = completion_gaps(engine, prompts, new, reference, seed=1)
    del reference
    return f"logp gap to unquantized {gap.mean():.4f} (token_mult_prob_error {gap.exp().mean():.4f})"


def kv_capacity(args, dtype: torch.dtype) -> str:
    """KV-cache tokens per GiB and layer, and what caching expanded per-head keys/values would hold."""
    cached = args.kv_cache.values_per_token * dtype.itemsize
    text = f"KV cache {2**30 // cached / 1e3:.0f}k tokens/GiB/layer"
    if args.mla is not None:
        expanded = args.num_heads * (args.head_dim + args.v_head_dim) * dtype.itemsize
        text += f" (expanded k/v: {2**30 // expanded / 1e3:.1f}k)"
    return text


def bench_train(
    config: dict,
    hf: torch.nn.Module,
    table: list,
    *,
    budget: int,
    micro_batches: int,
    profile: bool = False,
):
    """The same packed batch through rlloom's train_step as `micro_batches` micro-batches of <=
    `budget` tokens and as one micro-batch; transformers' forward+backward per sequence and as one
    batch."""
    device = next(hf.parameters()).device
    batch = make_batch(budget // 16, budget, budget, micro_batches, config["vocab_size"], seed=0)
    for mb_budget in (budget, budget * micro_batches):
        on = profile and mb_budget == budget
        train_row(config, hf, table, batch, mb_budget, profile=on)
    # An RL-sized step: micro_batches micro-batches of the large budget, gathered once per step.
    big_budget = budget * micro_batches
    big = make_batch(budget // 16, budget, big_budget, micro_batches, config["vocab_size"], seed=0)
    hf.to("cpu")  # the bf16 transformers model (11 GB at this width) makes room for the larger step
    free(device)
    try:
        train_row(config, hf, table, big, big_budget, profile=False, device=device)
    except torch.OutOfMemoryError:
        row(table, f"train {micro_batches} x <= {big_budget} packed", "rlloom train_step",
            {"tokens": big.num_tokens, "s": float("nan")}, "out of memory")  # fmt: skip
    free(device)
    hf.to(device)

    # transformers: forward + backward of the bf16 model over micro_batches x budget tokens
    hf.train()
    ids = torch.randint(0, config["vocab_size"], (micro_batches, budget), device=device)
    hf_flops = step_flops(build_model(config, dtype=torch.float32, device="meta"), [budget] * micro_batches,
                          micro_batches * budget, body_params=engine_body_params(config))  # fmt: skip
    for rows in (1, micro_batches):
        name = f"fwd+bwd {micro_batches} x {budget}" + (" in one batch" if rows > 1 else "")
        try:
            secs = time_hf_train(hf, ids, rows, device)
        except torch.OutOfMemoryError:
            row(table, name, "transformers (bf16, no optimizer)", {"tokens": ids.numel(), "s": float("nan")},
                "out of memory")  # fmt: skip
            free(device)
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        row(table, name, "transformers (bf16, no optimizer)", {"tokens": ids.numel(), "s": secs},
            f"MFU(active) {hf_flops / (secs * H100_BF16_PEAK_FLOPS):.3f}, peak {peak:.1f} GiB")  # fmt: skip
        free(device)
    hf.eval()


def train_row(
    config: dict,
    hf: torch.nn.Module,
    table: list,
    batch,
    mb_budget: int,
    *,
    profile: bool,
    device: torch.device | None = None,
) -> None:
    """rlloom's train_step (fp32 master weights, AdamW) with micro-batches of <= mb_budget tokens, on
    `device` (default: the transformers model's), with the transformers model's weights."""
    device = device or next(hf.parameters()).device
    model = native_from(hf, config, torch.float32, device)
    engine = NativeTrainEngine(
        TrainEngineConfig(
            lr=1e-6,
            max_tokens_per_micro_batch=mb_budget,
            compile=device.type == "cuda",
        ),
        model,
        device=device,
    )
    mask = batch.response_mask()
    adv_B = torch.randn(len(batch))

    def loss_fn(logp_bT, entropy_bT, rows):
        adv = adv_B[rows].to(logp_bT.device)[:, None]
        return aggregate_loss_sum(-adv * logp_bT, mask[rows].to(logp_bT.device), "token-mean"), {}

    normalizer = loss_normalizer(mask, "token-mean")
    metrics = [engine.train_step(batch, loss_fn, loss_normalizer=normalizer) for _ in range(3)][1:]
    seconds = sum(m["time/train_step_s"] for m in metrics) / len(metrics)
    seq_lens = [s.num_tokens for s in batch.samples]
    flops = step_flops(engine.model, seq_lens, int(mask.sum()), body_params=engine._body_params)
    peak = metrics[-1].get("memory/peak_allocated_gib", float("nan"))
    num_mb = len(plan_batch(batch, engine.cfg, engine.layout, engine.device)[0])
    name = f"train {num_mb} x <= {mb_budget} packed"
    row(table, name, "rlloom train_step", {"tokens": batch.num_tokens, "s": seconds},
        f"MFU(active) {flops / (seconds * H100_BF16_PEAK_FLOPS):.3f}, peak {peak:.1f} GiB (fp32 master + Adam), "
        f"grad norm {metrics[-1]['train/grad_norm']:.3g}")  # fmt: skip
    if profile:
        print_profile(engine, batch, loss_fn, normalizer, device)
    del engine, model
    free(device)


def time_hf_train(hf: torch.nn.Module, ids: torch.Tensor, rows: int, device: torch.device) -> float:
    """Seconds of forward + backward over `ids` in chunks of `rows` sequences (mean of 2 after 1)."""
    times = []
    for i in range(3):
        torch.cuda.synchronize() if device.type == "cuda" else None
        start = time.perf_counter()
        for lo in range(0, len(ids), rows):
            hf(input_ids=ids[lo : lo + rows], labels=ids[lo : lo + rows]).loss.backward()
        torch.cuda.synchronize() if device.type == "cuda" else None
        if i:
            times.append(time.perf_counter() - start)
    hf.zero_grad(set_to_none=True)
    return sum(times) / len(times)


def free(device: torch.device) -> None:
    gc.collect()  # an out-of-memory error's frames hold the engine until collected
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def engine_body_params(config: dict) -> float:
    from rlloom.engines.train.native.flops import active_body_params

    return active_body_params(build_model(config, dtype=torch.float32, device="meta"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny MoE on CPU (checks the script runs)")
    parser.add_argument("--model", choices=["qwen3_moe", "deepseek_v3"], default="qwen3_moe")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-rollout", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="also print the top operators of one train step"
    )
    parser.add_argument(
        "--fp8", action="store_true", help="also a rollout row with rollout.quantization=fp8 (same prompts)"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    deepseek = args.model == "deepseek_v3"
    if args.smoke:
        config, device, dtype = (TINY_DEEPSEEK if deepseek else TINY), torch.device("cpu"), torch.float32
        shape = {"prompts_n": 8, "prompt_len": 8, "new": 8}
        train_shape = {"budget": 128, "micro_batches": 2}
    elif torch.cuda.is_available():
        config, device, dtype = (
            (DEEPSEEK_V3_2L if deepseek else QWEN3_30B_A3B_8L),
            torch.device("cuda"),
            torch.bfloat16,
        )
        shape = (
            {"prompts_n": 64, "prompt_len": 128, "new": 128}
            if deepseek
            else {"prompts_n": 128, "prompt_len": 128, "new": 256}
        )
        train_shape = {"budget": 4096, "micro_batches": 4}
    else:
        raise SystemExit("bench_moe: no CUDA device; run with --smoke for the CPU check")
    if deepseek:
        args.skip_train = True
    hf = hf_model(config, device, dtype)
    err = check_logits(hf, config)
    print(
        f"native vs transformers logits: relative error {err:.1e}, transformers experts "
        f"implementation {getattr(hf.config, '_experts_implementation', 'n/a')}"
    )
    table: list[tuple[str, ...]] = []
    if not args.skip_rollout:
        bench_rollout(config, hf, table, **shape)
        if args.fp8:
            bench_rollout(config, hf, table, **shape, quantization="fp8", with_hf=False)
    if not args.skip_train:
        bench_train(config, hf, table, **train_shape, profile=args.profile)
    title = torch.cuda.get_device_name() if device.type == "cuda" else "CPU smoke run"
    width = "DeepSeek-V3" if deepseek else "Qwen3-30B-A3B"
    print_table(f"bench_moe ({title}, {width} width, {config['num_hidden_layers']} layers, {dtype})", table)


if __name__ == "__main__":
    main()
