"""The agent endpoint's overhead: the same 4-turn trajectories sampled through `rollout.agent` (an
agent with the official `openai` client, each turn an HTTP request to its session) and through
`rollout.env` (an environment that appends the same user message after each turn), one table.

Each run is `rlloom train arithmetic_smoke` on a random tiny model (`rlloom init-model tiny-dense`;
`--hidden`, `--layers`); a turn ends at one of 4 stop characters (about 25 tokens on the random
model) or at `--new` tokens, and a turn that ends by length ends the trajectory on both paths (as
the environment driver does). The rate is the sampled tokens (response tokens less the masked ones)
over the rollout stage's time (`time/generate_s`), steps after the first (which starts the worker
processes); the training steps between are not timed.

    python benchmarks/bench_agent.py               # CPU, a few minutes on 2 cores
    python benchmarks/bench_agent.py --device cuda --hidden 1024 --layers 8 --new 128
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

TURNS = 4


class FourTurns:
    """The environment row: a user message after each of the first 3 turns, then done."""

    def step(self, messages, state):
        state["n"] = state.get("n", 0) + 1
        if state["n"] >= TURNS:
            return {"done": True, "reward": float(len(messages[-1]["content"]) % 2)}
        return {"observations": [{"role": "user", "content": f"observation {state['n']}"}]}


async def four_turns(base_url, row, sampling):
    """The agent row: the same conversation, each turn one request through the openai client."""
    from openai import AsyncOpenAI

    messages = [{"role": "user", "content": row["prompt"]}]
    async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        for turn in range(1, TURNS + 1):
            reply = await client.chat.completions.create(messages=messages, **sampling)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            if reply.choices[0].finish_reason == "length":
                break  # as the environment driver ends a trajectory whose turn hit the length limit
            if turn < TURNS:
                messages.append({"role": "user", "content": f"observation {turn}"})
    return float(len(messages[-1]["content"]) % 2)


def run(kind: str, model: Path, out: Path, args: argparse.Namespace) -> dict[str, float]:
    from rlloom.cli import main

    plugin = "rollout.env=bench_agent:FourTurns" if kind == "env" else "rollout.agent=bench_agent:four_turns"
    overrides = [
        f"model.path={model}",
        f"trainer.run_dir={out / kind}",
        f"reward.import_dir={Path(__file__).parent}",
        plugin,
        f"rollout.max_new_tokens={args.new}",
        'rollout.stop_strings=["q","z","Q","Z"]',
        f"rollout.max_turns={TURNS}",
        f"rollout.n_samples={args.n}",
        f"trainer.prompts_per_step={args.prompts}",
        f"trainer.total_steps={args.steps}",
        f"rollout.env_workers={args.prompts * args.n}",
        f"cluster.device={args.device}",
        "data.num_eval=0",
        "logging.console=false",
        "trainer.save_hf_every=-1",
    ]
    assert main(["train", "arithmetic_smoke", *overrides]) == 0
    rows = [json.loads(x) for x in (out / kind / "metrics.jsonl").read_text().splitlines()][1:]
    trajectories = args.prompts * args.n  # one sample each: every turn extends the conversation
    sampled = sum((r["response/length_mean"] - r["rollout/env_tokens_mean"]) * trajectories for r in rows)
    return {
        "s": sum(r["time/generate_s"] for r in rows),
        "tokens": sampled,
        "turns": sum(r["rollout/turns_mean"] for r in rows) / len(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new", type=int, default=64, help="most sampled tokens per turn")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is not timed)")
    args = ap.parse_args()
    from rlloom.models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        model = write_tiny_model("tiny-dense", Path(tmp) / "model", hidden=args.hidden, layers=args.layers)
        results = {kind: run(kind, model, Path(tmp), args) for kind in ("env", "agent")}
    base = results["env"]["tokens"] / results["env"]["s"]
    print(
        f"\n### Agent endpoint vs environment ({args.device}; tiny-dense hidden {args.hidden}, {args.layers} layers; "
        f"{args.prompts} prompts x n={args.n}, {TURNS} turns x {args.new} tokens, {args.steps - 1} timed steps)\n"
    )
    print("| path | turns (mean) | sampled tokens | rollout seconds | sampled tok/s | vs rollout.env |")
    print("|---|---|---|---|---|---|")
    for kind, name in (
        ("env", "rollout.env (environment workers)"),
        ("agent", "rollout.agent (HTTP, openai client)"),
    ):
        r = results[kind]
        rate = r["tokens"] / r["s"]
        print(
            f"| {name} | {r['turns']:.2f} | {r['tokens']:,.0f} | {r['s']:.2f} | {rate:,.0f} | {rate / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
