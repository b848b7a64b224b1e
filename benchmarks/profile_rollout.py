"""Where a native-engine decode step's time goes (GPU): host phases, top kernels, attention variants.

Builds bench_rollout's random bf16 Qwen3-0.6B, checks the fast paths (engine logprobs against a full
forward; the same seeded tokens eagerly and through CUDA graphs), runs 256 prompts x 128 tokens into
steady decode, then prints:
  (a) per decode step, the wall time of each phase (each ends with a device sync, so host-only
      phases show host cost and the rest host + GPU), and the captured forward's GPU time alone;
  (b) torch.profiler over a few steps: top kernels by CUDA time, top ops by CPU time, and the GPU's
      idle fraction (1 - kernel time / wall time);
  (c) the paged-decode kernel per layer in several tile / split / warp configurations against the
      bandwidth bound of the KV bytes it must read;
and one summary table last.

    python benchmarks/profile_rollout.py [--decode-steps 250] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_rollout import (  # noqa: E402
    QWEN3_06B,
    copy_bandwidth,
    logprob_gap,
    random_model,
    run_engine,
)
from decode_bound import decode_bound_s, every_step_bytes  # noqa: E402

from rlloom.engines.rollout.native import NativeEngine, SamplingParams  # noqa: E402
from rlloom.engines.rollout.native import paged_decode as paged_decode_module  # noqa: E402
from rlloom.engines.rollout.native.paged_decode import paged_decode, reference_decode  # noqa: E402
from rlloom.engines.rollout.native.scheduler import Batch  # noqa: E402


def cuda_ms(fn, repeat: int = 20) -> float:
    """Median GPU milliseconds of fn() (CUDA events, after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_consistency(engine: NativeEngine, prompts: list[list[int]]) -> bool:
    """Seeded tokens through the CUDA graphs equal those of the eager forward."""
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=5)
    graphs = engine.runner.graphs
    with_graphs = engine.generate(prompts, params)
    engine.runner.graphs = None
    eager = engine.generate(prompts, params)
    engine.runner.graphs = graphs
    return all(a.token_ids == b.token_ids for a, b in zip(with_graphs, eager))


def sampler_checks() -> str:
    """The fused CUDA sampler against the torch path: greedy tokens, logprobs, frequencies, and the
    same seeded draw whether or not another row of the batch forces the top-k/top-p path."""
    from rlloom.engines.rollout.native.sampler import Sampler, SamplingRows, noise_key

    dev = torch.device("cuda")
    logits = torch.randn(64, 151936, device=dev).to(torch.bfloat16) * 3
    keys = [noise_key(1, i, 7) for i in range(64)]
    temps = [0.0] * 8 + [1.0] * 28 + [0.7] * 28
    fused = Sampler(dev, 0)
    torch_path = Sampler(dev, 0)
    torch_path.use_triton = False
    tok_f, lp_f = fused(logits, SamplingRows.build(temps, [1.0] * 64, [-1] * 64, keys, dev))
    tok_t, lp_t = torch_path(logits, SamplingRows.build(temps, [1.0] * 64, [-1] * 64, keys, dev))
    ref = torch.log_softmax(logits.float() / torch.tensor([t or 1.0 for t in temps], device=dev)[:, None], -1)
    lp_gap = (lp_f - ref.gather(1, tok_f[:, None])[:, 0]).abs().max().item()
    greedy_same = bool((tok_f[:8] == tok_t[:8]).all())
    mixed = SamplingRows.build(temps + [1.0], [1.0] * 64 + [0.5], [-1] * 65, keys + [None], dev)
    tok_m, _ = fused(torch.cat([logits, logits[:1]]), mixed)
    seeded_same = bool((tok_m[:64] == tok_f).all())
    small = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], device=dev)
    n = 200000
    toks, _ = fused(small.expand(n, -1), SamplingRows.build([0.7] * n, [1.0] * n, [-1] * n, [None] * n, dev))
    freq = torch.bincount(toks, minlength=5).float() / n
    freq_gap = (freq - torch.softmax(small / 0.7, -1)).abs().max().item()
    return (
        f"fused sampler: greedy == torch {greedy_same}, logprob gap {lp_gap:.1e}, seeded draw same on "
        f"the top-p path {seeded_same}, frequency gap {freq_gap:.4f}"
    )


def timed_step(engine: NativeEngine) -> dict[str, float]:
    """One engine step run without overlap, split into phases, each closed by a device sync (ms):
    the host-only phases are what the engine overlaps with the previous step's device work."""
    engine._drain()
    torch.cuda.synchronize()
    times, t0 = {}, time.perf_counter()

    def mark(name: str, sync: bool = False) -> None:
        nonlocal t0
        if sync:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        times[name] = (t1 - t0) * 1e3
        t0 = t1

    batch = engine.scheduler.schedule()
    mark("schedule (host)")
    step = engine._launch(batch, None)
    mark("inputs + forward + sample enqueue (host)")
    torch.cuda.synchronize()
    mark("forward + sample wait (GPU)")
    engine._resolve(step)
    mark("resolve (host)")
    return times


def profile_steps(engine: NativeEngine, num_steps: int, out: Path | None) -> float:
    """Print the top kernels and CPU ops over num_steps engine.step() calls; return GPU idle fraction."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    averages = prof.key_averages()
    print(f"\n(b) top kernels by CUDA time over {num_steps} decode steps")
    print(averages.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70))
    print(f"\n(b) top ops by CPU time over {num_steps} decode steps")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70))
    if out is not None:
        prof.export_chrome_trace(str(out / "decode_trace.json"))
    # Kernel rows have no CPU time of their own; ops that launch them would count them twice.
    kernel_us = sum(
        e.self_device_time_total for e in averages if e.cpu_time_total == 0 and "Memcpy" not in e.key
    )
    return 1 - kernel_us / wall_us


def attention_variants(engine: NativeEngine, bandwidth: float) -> list[tuple[dict, float, float, float]]:
    """(config, us per layer, fraction of bandwidth, max error) of the paged-decode kernel on random
    data shaped like the benchmark's middle decode step: 256 sequences of 128..640 keys."""
    a, bs = engine.model.args, engine.runner.block_size
    S, width = 256, engine.runner.max_blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_keys = torch.randint(128, width * bs + 1, (S,), device="cuda", generator=gen)
    tables = torch.randperm(S * width, device="cuda", generator=gen).view(S, width)
    k = torch.randn(S * width * bs, a.num_kv_heads, a.head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(S * width * bs, a.num_kv_heads, a.v_head_dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(S, a.num_heads, a.head_dim, device="cuda", dtype=torch.bfloat16)
    kv_bytes = int(num_keys.sum()) * a.num_kv_heads * (a.head_dim + a.v_head_dim) * 2
    want = reference_decode(q.float(), k.float(), v.float(), tables, num_keys, a.head_dim**-0.5, bs)
    configs = [{}]  # the engine's default
    configs += [dict(tile=t, num_splits=sp, num_warps=w) for t in (32, 64) for sp in (1, 2) for w in (4, 8)]
    configs += [dict(tile=64, num_splits=1, num_warps=4, num_stages=st) for st in (2, 3)]
    results = []
    for kw in configs:
        run = lambda kw=kw: paged_decode(q, k, v, tables, num_keys, a.head_dim**-0.5, bs, **kw)  # noqa: E731
        err = (run().float() - want).abs().max().item()
        ms = cuda_ms(run)
        results.append((kw, ms * 1e3, kv_bytes / (ms / 1e3) / bandwidth, err))
    return results


def end_to_end(engine: NativeEngine, prompts: list[list[int]], new: int, bandwidth: float) -> str:
    """bench_rollout's main workload: output tok/s and decode time against the bandwidth bound."""
    r = run_engine(engine, prompts, SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True))
    bound = decode_bound_s(engine.model, engine.runner.dtype, r["decode_rows"], r["completions"], bandwidth)
    return (
        f"{len(prompts)}x{len(prompts[0])} -> {new}: {r['tokens'] / r['s']:,.0f} tok/s, {r['s']:.2f} s; "
        f"decode {r['decode_s']:.2f} s, bound {bound:.2f} s, ratio {bound / r['decode_s']:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decode-steps", type=int, default=250, help="decode steps before measuring")
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--profiled-steps", type=int, default=5)
    parser.add_argument("--use-best", action="store_true", help="run the engine with the fastest kernel")
    parser.add_argument("--out", type=Path, default=None, help="folder for the chrome trace")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    num_prompts, prompt_len, new = 256, 128, 512
    native, _ = random_model(QWEN3_06B, device, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, QWEN3_06B["vocab_size"], (num_prompts, prompt_len), generator=gen).tolist()
    max_len = prompt_len + new
    engine = NativeEngine(
        native, max_model_len=max_len, num_blocks=num_prompts * -(-max_len // 16) + 64,
        max_num_seqs=num_prompts, eos_token_ids=[],
    )  # fmt: skip
    bandwidth = copy_bandwidth(device)
    attn = attention_variants(engine, bandwidth)
    default_tile, default_splits = paged_decode_module.decode_config(256, 8, max_len)
    best = min((r for r in attn if r[3] < 3e-2), key=lambda r: r[1])
    print(f"\n(c) paged decode, one layer, bound {attn[0][1] * attn[0][2]:.0f} us "
          f"(default tile {default_tile}, splits {default_splits})")  # fmt: skip
    for kw, us, frac, err in attn:
        print(f"  {str(kw):75s} {us:7.1f} us  {frac:5.2f} of bandwidth  err {err:.1e}")
    if args.use_best:
        print(f"using the best configuration from now on: {best[0]}")
        kernel = paged_decode_module.paged_decode
        paged_decode_module.paged_decode = lambda *a, **kw: kernel(*a, **(best[0] | kw))
        import rlloom.engines.rollout.native.attention as attention_module

        attention_module.paged_decode = paged_decode_module.paged_decode
    gap = logprob_gap(engine, prompts[:8], 32)
    same = graph_consistency(engine, prompts[:8])
    print(
        f"checks: max logprob gap vs full forward {gap:.1e}; graph tokens == eager tokens: {same}; triton decode: {engine.runner.backend.use_decode_kernel}"
    )
    print(sampler_checks())

    params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i), prompt_index=i)
    decode_steps = 0
    while decode_steps < args.decode_steps:
        engine.step()
        decode_steps += not engine.last_batch.is_prefill
    phases: dict[str, list[float]] = {}
    for _ in range(args.timed_steps):
        for name, ms in timed_step(engine).items():
            phases.setdefault(name, []).append(ms)
    median = {name: sorted(v)[len(v) // 2] for name, v in phases.items()}
    engine._drain()
    seqs = list(engine.scheduler.running)
    graphs = engine.runner.graphs
    key = next(k for k in sorted(graphs.graphs) if k[0] >= len(seqs))
    forward_ms = cuda_ms(graphs.graphs[key].replay)
    hidden = graphs.outputs[key][: len(seqs)]
    head_ms = cuda_ms(lambda: hidden @ engine.model.lm_head_weight.T)
    logits = hidden @ engine.model.lm_head_weight.T
    batch = Batch(seqs, False, seqs, list(range(len(seqs))))  # the live decode batch, for the sampler
    sample_ms = cuda_ms(lambda: engine.sampler(logits, engine._sampling_rows(batch)))
    engine.sampler.use_triton = False
    sample_torch_ms = cuda_ms(lambda: engine.sampler(logits, engine._sampling_rows(batch)))
    engine.sampler.use_triton = True
    idle = profile_steps(engine, args.profiled_steps, args.out)

    a = engine.model.args
    weights = every_step_bytes(engine.model)  # what every decode step reads (decode_bound.py)
    kv_bytes = (
        sum(s.num_tokens for s in seqs) * a.num_layers * a.num_kv_heads * (a.head_dim + a.v_head_dim) * 2
    )
    bound_ms = (weights + kv_bytes) / bandwidth * 1e3
    while engine.has_unfinished():
        engine.step()
    e2e = end_to_end(engine, prompts, new, bandwidth)

    print(f"\nprofile_rollout ({torch.cuda.get_device_name()}, {len(seqs)} seqs, "
          f"~{kv_bytes // max(len(seqs), 1) // (a.num_layers * a.num_kv_heads * 512)} keys each)")  # fmt: skip
    rows = [(name, ms) for name, ms in median.items()]
    rows += [("step total (sum of phases)", sum(median.values()))]
    rows += [("forward graph replay alone (GPU)", forward_ms), ("lm head (GPU)", head_ms)]
    rows += [("sampler alone (host+GPU)", sample_ms), ("sampler, torch path (host+GPU)", sample_torch_ms)]
    chosen = best if args.use_best else attn[0]
    rows += [(f"attention x{a.num_layers} layers, chosen config (GPU)", chosen[1] * a.num_layers / 1e3)]
    rows += [(f"bound: weights + KV at {bandwidth / 1e12:.2f} TB/s", bound_ms)]
    for name, ms in rows:
        print(f"  {name:52s} {ms:8.2f} ms")
    print(f"  {'GPU idle fraction during steps':52s} {idle:8.2f}")
    print(f"  end to end: {e2e}")


if __name__ == "__main__":
    main()
