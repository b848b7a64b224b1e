"""Multi-turn rollout on the native engine: the same sampled tokens generated in 4 turns with a tool
call of 50 ms between turns, against one single-turn generation of them (one table).

GPU (default): a random bf16 model of Qwen3-0.6B's shape; 64 prompts x n = 8 of 128 tokens; each
trajectory generates 4 turns of 128 tokens (ignore_eos), and after each of the first 3 its tool
"runs" for 50 ms and returns 32 observation tokens, while the other trajectories keep decoding. The
single-turn row generates 512 tokens per sample from the same prompts. Rows: output (sampled)
tokens/s, the ratio to single-turn, and the share of the later turns' prompt tokens that the prefix
cache served instead of a prefill (prefix caching on, as multi-turn runs build the engine, and off).
CPU (`--cpu`): a tiny random model, for a smoke run of the same code.

    python benchmarks/bench_multiturn.py          # needs a CUDA device
    python benchmarks/bench_multiturn.py --cpu
"""

from __future__ import annotations

import argparse
import heapq
import time

import torch

from rlloom.engines.rollout.native import NativeEngine, SamplingParams

QWEN3_06B = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "attention_bias": False,
}  # fmt: skip
TINY = QWEN3_06B | {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(config: dict, device: torch.device, *, caching: bool, max_len: int, num_seqs: int) -> NativeEngine:
    from rlloom.models.checkpoint import build_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = build_model(config, dtype=dtype, device=device, fused_projections=True)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)
    model.init_buffers()
    blocks = num_seqs * (-(-max_len // 16)) * 5 // 4 + 64  # some room for the cached blocks of finished turns
    return NativeEngine(model.eval(), max_model_len=max_len, num_blocks=blocks, max_num_seqs=num_seqs,
                        eos_token_ids=[], enable_prefix_caching=caching)  # fmt: skip


def single_turn(engine: NativeEngine, prompts: list[list[int]], n: int, new: int) -> dict[str, float]:
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=1)
    sync(engine.device)
    start, tokens = time.perf_counter(), 0
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    while engine.has_unfinished():
        tokens += sum(len(c.token_ids) for c in engine.step())
    sync(engine.device)
    return {"s": time.perf_counter() - start, "tokens": tokens, "saved": 0.0}


def multi_turn(
    engine: NativeEngine, prompts: list[list[int]], n: int, new: int, turns: int, obs: int, tool_s: float
) -> dict[str, float]:
    """Each trajectory: `turns` turns of `new` tokens; after a turn, `tool_s` later, `obs` tokens join
    its context and its next turn is a request of its own (the engine keeps decoding the others)."""
    gen = torch.Generator().manual_seed(2)
    vocab = engine.model.args.vocab_size
    contexts: dict[tuple[int, int], list[int]] = {}
    done_turns: dict[tuple[int, int], int] = {}
    ready: list[tuple[float, tuple[int, int]]] = []
    later_prompt_tokens, hits_before = 0, engine.block_manager.num_cached_hits
    sync(engine.device)
    start, tokens = time.perf_counter(), 0
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(n=n, temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=1),
                           request_id=f"{i}")  # fmt: skip
    while engine.has_unfinished() or ready:
        now = time.perf_counter()
        while ready and ready[0][0] <= now:
            _, key = heapq.heappop(ready)
            later_prompt_tokens += len(contexts[key])
            params = SamplingParams(
                temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=hash(key) % 10**6
            )
            engine.add_request(contexts[key], params, request_id=f"{key[0]}/{key[1]}/{done_turns[key]}")
        if not engine.has_unfinished():
            time.sleep(max(0.0, ready[0][0] - time.perf_counter()))
            continue
        for c in engine.step():
            key = (
                int(c.request_id.split("/")[0]),
                c.sample_index if "/" not in c.request_id else int(c.request_id.split("/")[1]),
            )
            tokens += len(c.token_ids)
            base = contexts.get(key, prompts[key[0]])
            done_turns[key] = done_turns.get(key, 0) + 1
            if done_turns[key] < turns:
                observation = torch.randint(0, vocab, (obs,), generator=gen).tolist()
                contexts[key] = base + list(c.token_ids) + observation
                heapq.heappush(ready, (time.perf_counter() + tool_s, key))
    sync(engine.device)
    saved = (engine.block_manager.num_cached_hits - hits_before) / max(later_prompt_tokens, 1)
    return {"s": time.perf_counter() - start, "tokens": tokens, "saved": saved}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="a tiny random model on the CPU (smoke run)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    config = TINY if args.cpu else QWEN3_06B
    num_prompts, n, prompt_len, new, turns, obs = (
        (4, 4, 32, 16, 4, 8) if args.cpu else (64, 8, 128, 128, 4, 32)
    )
    max_len = prompt_len + turns * new + (turns - 1) * obs + 16
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config["vocab_size"], (num_prompts, prompt_len), generator=gen).tolist()
    rows = []
    for caching in (True, False):
        engine = build(config, device, caching=caching, max_len=max_len, num_seqs=num_prompts * n)
        single_turn(engine, prompts[:4], 2, 16)  # warm-up
        if caching:
            rows.append(("single turn", single_turn(engine, prompts, n, turns * new)))
        rows.append((f"{turns} turns, cache {'on' if caching else 'off'}",
                     multi_turn(engine, prompts, n, new, turns, obs, 0.05)))  # fmt: skip
        del engine
    base = rows[0][1]["tokens"] / rows[0][1]["s"]
    what = f"{num_prompts} prompts x n={n}, {prompt_len} prompt tokens, {turns} x {new} sampled, tool 50 ms + {obs} tokens"
    print(
        f"\n### Multi-turn rollout ({'CPU tiny' if args.cpu else 'Qwen3-0.6B shape, ' + torch.cuda.get_device_name()}): {what}\n"
    )
    print("| workload | seconds | sampled tok/s | vs single turn | later turns' prompt served by cache |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        rate = r["tokens"] / r["s"]
        print(f"| {name} | {r['s']:.2f} | {rate:,.0f} | {rate / base:.2f}x | {r['saved']:.0%} |")


if __name__ == "__main__":
    main()
