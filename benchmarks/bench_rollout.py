"""Rollout throughput of the native engine against Hugging Face transformers' generate (one table).

GPU (default): a random bf16 model of Qwen3-0.6B's shape (28 layers, hidden 1024, intermediate 3072,
16 heads, 8 KV heads, head dim 128, vocab 151936, tied embeddings):
  - 256 prompts x 128 tokens, 512 new tokens, ignore_eos, full-vocabulary sampling (T = 1): output
    tokens/s, the memory-bandwidth lower bound of the decode steps (the bytes each step must read,
    decode_bound.py, over the measured device-to-device copy bandwidth) and the engine's ratio to it, and HF
    generate on the same workload;
  - the GRPO pattern, 32 prompts x n = 8, with prefix sharing on and off (peak KV blocks in use).
CPU (`--cpu`): the embedded SmolLM2-135M-Instruct, 64 chat prompts, 32 new tokens, sampling at
T = 1 with ignore_eos, against HF generate on the left-padded batch.

    python benchmarks/bench_rollout.py           # needs a CUDA device
    python benchmarks/bench_rollout.py --model 8b --skip-hf   # the larger shapes, native only
    python benchmarks/bench_rollout.py --cpu [--threads 1]   # 1 thread is steadier on a busy machine
    python benchmarks/bench_rollout.py --model 8b --skip-hf --tp 2   # one engine over 2 GPUs (rollout.tp)

`--tp N` starts N processes (one per GPU, NCCL; gloo with --smoke on CPU) that build the same random
model and run one tensor-parallel engine; rank 0 prints. The bandwidth bound is per rank: the bytes
one rank reads per decode step (its weight shard and its KV heads) over one GPU's copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from decode_bound import decode_bound_s

from rlloom.engines.rollout.native import NativeEngine, SamplingParams

QWEN3_06B = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
}


QWEN3_17B = QWEN3_06B | {"hidden_size": 2048, "intermediate_size": 6144}
QWEN3_8B = QWEN3_06B | {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "tie_word_embeddings": False,
}
SHAPES = {"0.6b": QWEN3_06B, "1.7b": QWEN3_17B, "8b": QWEN3_8B}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_engine(engine: NativeEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """Step loop with timing: total and decode-step seconds, output tokens, peak KV blocks; and for the
    decode bound (decode_bound.py), what each decode step fed ("decode_rows": (prompt index, sample
    index, position) per sequence) and the completions (with an MoE model's routes)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i), prompt_index=i)
    sync(engine.device)
    start = time.perf_counter()
    decode_s, peak_blocks, tokens = 0.0, 0, 0
    completions, decode_rows = [], []
    waits_for = None  # the batch whose tokens the next step() reads back (it launches the one after)
    while engine.has_unfinished():
        t0 = time.perf_counter()
        done = engine.step()
        if waits_for is not None and not waits_for.is_prefill:
            decode_s += time.perf_counter() - t0
        waits_for = engine.last_batch
        if waits_for is not None and not waits_for.is_prefill:
            # Launched: each sequence's fed token sits at the position before its cached count.
            decode_rows.append(
                [(s.prompt_index, s.sample_index, s.num_cached_tokens - 1) for s in waits_for.seqs]
            )
        peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks)
        tokens += sum(len(c.token_ids) for c in done)
        completions += done
    total_s = time.perf_counter() - start
    return {"s": total_s, "decode_s": decode_s, "tokens": tokens, "peak_blocks": peak_blocks,
            "decode_rows": decode_rows, "completions": completions}  # fmt: skip


def hf_generate(
    hf_model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, pad_id: int
) -> dict[str, float]:
    """HF sampling at T = 1 over the full vocabulary on the left-padded batch, exactly max_new_tokens."""
    device = next(hf_model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=pad_id,
        )  # fmt: skip
    sync(device)
    return {"s": time.perf_counter() - start, "tokens": (out.shape[1] - width) * out.shape[0]}


def copy_bandwidth(device: torch.device) -> float:
    """Device memory bandwidth in bytes/s from a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 2 * src.nbytes * 10 / (time.perf_counter() - start)


def row(table: list[tuple[str, ...]], name: str, engine: str, r: dict[str, float], note: str = "") -> None:
    table.append((name, engine, f"{r['tokens'] / r['s']:,.0f}", f"{r['s']:.2f}", note))


def print_table(title: str, table: list[tuple[str, ...]]) -> None:
    header = ("workload", "engine", "out tok/s", "time s", "notes")
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    print(f"\n{title}")
    for r in [header, tuple("-" * w for w in widths), *table]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def random_model(
    config: dict, device: torch.device, dtype: torch.dtype, *, with_hf: bool = True
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """(native model, HF model) with the same random weights (HF's own initialisation); without HF,
    the native model alone with N(0, 0.02) matrices and unit norms."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rlloom.models import load_hf_tensors
    from rlloom.models.checkpoint import build_model

    if not with_hf:
        native = build_model(config, dtype=dtype, device=device, fused_projections=True)
        with torch.no_grad():
            for p in native.parameters():
                p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)
        native.init_buffers()
        return native.eval(), None

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        hf = Qwen3ForCausalLM(Qwen3Config(**config)).eval()
    torch.set_default_dtype(previous)
    native = build_model(config, dtype=dtype, device=device, fused_projections=True)
    load_hf_tensors(native, hf.state_dict().items())
    return native.eval(), hf


def completion_gaps(
    engine: NativeEngine,
    prompts: list[list[int]],
    new: int,
    model: torch.nn.Module | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """|engine logprob - full-forward logprob| of every token the engine samples from `prompts`
    (T = 1, `seed`), the full forward by `model` (default: the engine's own, which checks the fast
    paths)."""
    from rlloom.models.logprobs import token_logprobs

    model = model or engine.model
    gaps = []
    params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=seed)
    for c in engine.generate(prompts, params):
        ids = torch.tensor(prompts[c.prompt_index] + c.token_ids, device=engine.device)
        with torch.no_grad():
            hidden = model.hidden_states(ids[None])[0, len(prompts[c.prompt_index]) - 1 : -1]
            ref, _ = token_logprobs(hidden, model.lm_head_weight, ids[len(prompts[c.prompt_index]) :])
        gaps.append((ref.float().cpu() - torch.tensor(c.logprobs)).abs())
    return torch.cat(gaps)


def logprob_gap(engine: NativeEngine, prompts: list[list[int]], new: int) -> float:
    """Largest |engine logprob - full-forward logprob| over sampled completions (checks the fast paths)."""
    return completion_gaps(engine, prompts, new).max().item()


def bench_gpu(
    config: dict,
    device: torch.device,
    num_prompts: int,
    prompt_len: int,
    new: int,
    *,
    with_hf: bool = True,
    tp_group: dist.ProcessGroup | None = None,
) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    native, hf = random_model(config, device, dtype, with_hf=with_hf and tp == 1)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config["vocab_size"], (num_prompts, prompt_len), generator=gen).tolist()
    max_len = prompt_len + new
    blocks_per_seq = -(-max_len // 16)
    engine = NativeEngine(
        native, max_model_len=max_len, num_blocks=num_prompts * blocks_per_seq + 64, max_num_seqs=num_prompts,
        eos_token_ids=[], tp_group=tp_group,
    )  # fmt: skip
    if tp == 1:
        gap = f"{logprob_gap(engine, prompts[:8], 32):.1e}"  # also the warm-up
    else:  # the model's lm head holds this rank's vocabulary rows only: warm up without the check
        engine.generate(prompts[:8], SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True))
        gap = "n/a at tp > 1"
    table: list[tuple[str, ...]] = []
    bandwidth = copy_bandwidth(device)
    r = run_engine(engine, prompts, SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True))
    bound = decode_bound_s(engine.model, engine.runner.dtype, r["decode_rows"], r["completions"], bandwidth)
    name = f"{num_prompts}x{prompt_len} -> {new}"
    row(table, name, "native", r,
        f"decode {r['decode_s']:.2f}s, bound {bound:.2f}s at {bandwidth / 1e12:.2f} TB/s, ratio "
        f"{bound / r['decode_s']:.2f} (per rank, tp={tp}); max logprob gap vs forward {gap}; decode attention "
        f"{'triton' if engine.runner.backend.use_decode_kernel else 'torch gather+SDPA'}")  # fmt: skip
    groups = num_prompts // 8
    for sharing in (True, False):
        engine.enable_prefix_sharing = sharing
        grpo = run_engine(
            engine,
            prompts[:groups],
            SamplingParams(n=8, temperature=1.0, max_new_tokens=new, ignore_eos=True),
        )
        row(table, f"GRPO {groups}x8, {prompt_len} -> {new}", f"native sharing={'on' if sharing else 'off'}",
            grpo, f"peak KV blocks {grpo['peak_blocks']}, preemptions {engine.num_preemptions}")  # fmt: skip
    engine.sleep()
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if hf is not None:
        row(table, name, "HF generate", hf_generate(hf, prompts, new, pad_id=0))
    title = torch.cuda.get_device_name() if device.type == "cuda" else "CPU smoke run of the GPU workload"
    title += f", {config['num_hidden_layers']} layers x hidden {config['hidden_size']}, rollout.tp={tp}"
    if tp_group is None or dist.get_rank(tp_group) == 0:
        print_table(f"bench_rollout ({title}, {dtype})", table)


def chat_prompts(tokenizer: object, num: int) -> list[list[int]]:
    subjects = ["the moon", "a river", "prime numbers", "bread", "volcanoes", "the ocean", "bees", "chess"]
    asks = ["Explain {} in one sentence.", "Write a short poem about {}.", "Give three facts about {}.",
            "What is surprising about {}?", "Describe {} to a child.", "Why does {} matter?",
            "Tell a story about {}.", "List questions about {}."]  # fmt: skip
    texts = [asks[i % len(asks)].format(subjects[(i // len(asks)) % len(subjects)]) for i in range(num)]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True
        )
        for t in texts
    ]


def bench_cpu(repeats: int) -> None:
    from transformers import AutoModelForCausalLM

    from rlloom.models import load_tokenizer
    from rlloom.models.checkpoint import resolve_path

    folder = resolve_path("smollm2-135m-instruct")
    tokenizer = load_tokenizer(folder)
    prompts = chat_prompts(tokenizer, 64)
    prompts = [p if isinstance(p, list) else list(p["input_ids"]) for p in prompts]
    new = 32
    engine = NativeEngine.from_pretrained(folder, max_model_len=512)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    run_engine(engine, prompts[:4], SamplingParams(max_new_tokens=4))  # warm-up
    params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True)
    # Interleaved repeats, best of each: on a shared machine the load changes from run to run.
    runs = [
        (run_engine(engine, prompts, params), hf_generate(hf, prompts, new, pad_id=pad))
        for _ in range(repeats)
    ]
    r = min((n for n, _ in runs), key=lambda x: x["s"])
    h = min((h for _, h in runs), key=lambda x: x["s"])
    native_runs = ", ".join(f"{n['s']:.1f}" for n, _ in runs)
    hf_runs = ", ".join(f"{x['s']:.1f}" for _, x in runs)
    table: list[tuple[str, ...]] = []
    row(table, f"64 chat prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tok) -> {new}", "native", r,
        f"decode {r['decode_s']:.2f}s; all runs {native_runs} s")  # fmt: skip
    row(table, "same", "HF generate (padded)", h,
        f"native speed-up {h['s'] / r['s']:.2f}x; all runs {hf_runs} s")  # fmt: skip
    print_table(
        f"bench_rollout (CPU, SmolLM2-135M-Instruct, fp32, {torch.get_num_threads()} threads, best of {repeats})",
        table,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU mode: SmolLM2-135M, 64 chat prompts")
    parser.add_argument("--smoke", action="store_true", help="the GPU workload's code path, tiny, on CPU")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--repeats", type=int, default=2, help="CPU mode: interleaved runs, best of each")
    parser.add_argument("--model", choices=sorted(SHAPES), default="0.6b", help="GPU: the Qwen3 shape")
    parser.add_argument("--skip-hf", action="store_true", help="GPU: leave out transformers' generate")
    parser.add_argument("--tp", type=int, default=1, help="GPU (or --smoke): one engine over N ranks")
    args = parser.parse_args()
    if args.tp > 1 and args.cpu:
        parser.error("--tp is for the GPU workload (or --smoke), not --cpu")
    if args.tp > 1:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(tp_rank, args=(args, os.path.join(tmp, "rendezvous")), nprocs=args.tp, join=True)
        return
    run(args)


def tp_rank(rank: int, args: argparse.Namespace, rendezvous: str) -> None:
    """One rank of `--tp N`: NCCL on GPU `rank`, gloo on CPU (--smoke)."""
    backend = "gloo" if args.smoke else "nccl"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=args.tp)
    try:
        run(args, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, tp_group: dist.ProcessGroup | None = None) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.cpu:
        bench_cpu(args.repeats)
    elif args.smoke:
        tiny = QWEN3_06B | {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "vocab_size": 512,
        }
        bench_gpu(
            tiny | {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
            torch.device("cpu"),
            16,
            8,
            16,
            tp_group=tp_group,
        )
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        bench_gpu(SHAPES[args.model], device, 256, 128, 512, with_hf=not args.skip_hf, tp_group=tp_group)
    else:
        raise SystemExit("bench_rollout: no CUDA device; run with --cpu for the CPU benchmark")


if __name__ == "__main__":
    main()
