"""benchmarks/bench_e2e.py --multiturn (issue 49): bench_multiturn.py's episodes through the GRPO step
(multiturn_env.py), and --placements, each placement in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from bench_e2e import parse_placements, variants, without_modes  # noqa: E402
from multiturn_env import (  # noqa: E402
    FixedLengthTurns,
    ToolTurns,
    bench_tokenizer,
    chat_prompts,
    observation_text,
)

from rlloom.engines.rollout import Completion  # noqa: E402
from rlloom.episodes.render import encode, extension_ids, render_conversation  # noqa: E402


def test_an_observation_adds_exactly_its_tokens_and_a_prompt_has_exactly_its_own() -> None:
    tokenizer = bench_tokenizer()
    (item,) = chat_prompts(tokenizer, 1, 128)
    assert len(item.prompt_ids) == 128
    assert item.prompt_ids == encode(
        tokenizer, render_conversation(tokenizer, [{"role": "user", "content": item.prompt}], tools=None)
    )
    sampled = [
        7,
        100_000,
        9,
        150_000,
    ]  # ids beyond the tokenizer's decode to nothing, as the model samples them
    messages = [
        {"role": "user", "content": item.prompt},
        {"role": "assistant", "content": tokenizer.decode(sampled)},
        {"role": "user", "content": observation_text(tokenizer, 32)},
    ]
    ext = extension_ids(
        tokenizer, item.prompt_ids + sampled, render_conversation(tokenizer, messages, tools=None)
    )
    assert ext is not None and len(ext) == 32  # the trajectory goes on in one sample, 32 tokens longer
    with pytest.raises(ValueError, match="turn markers alone are 10"):
        observation_text(tokenizer, 10)


def test_the_environment_waits_after_each_turn_but_the_last_and_gives_no_reward() -> None:
    env, state = ToolTurns(turns=3, tool_s=0.0, observation="00"), {}
    steps = [env.step([], state) for _ in range(3)]
    assert [s.done for s in steps] == [False, False, True]
    assert steps[0].observations == [{"role": "user", "content": "00"}] and steps[2].reward is None


def test_a_turn_cut_at_max_new_tokens_goes_on_to_the_environment() -> None:
    seen = []

    class Driver:
        def on_turn(self, key, j, c, versions):
            seen.append(c.finish_reason)

        waiting = True

    driver = FixedLengthTurns(Driver())
    c = Completion(request_id="r", prompt_index=0, sample_index=0, token_ids=[1], logprobs=[0.0],
                   finish_reason="length", policy_version=0)  # fmt: skip
    driver.on_turn("k", 0, c, [0])
    assert seen == ["stop"] and c.finish_reason == "length" and driver.waiting


def test_placements_run_the_command_line_with_their_workers() -> None:
    argv = ["--multiturn", "--placements", "colocated,separate", "--gpus=4", "--steps", "2"]
    assert without_modes(argv) == ["--multiturn", "--steps", "2"]
    args = type("Args", (), {"modes": None, "placements": parse_placements("colocated,separate"), "gpus": 4})
    (_, colocated), (_, separate) = variants(args)
    assert colocated == ["--workers", "4", "--rollout-workers", "0"]
    assert separate == ["--workers", "3", "--rollout-workers", "1"]
    with pytest.raises(Exception, match="comma-separated list of colocated, separate"):
        parse_placements("inline")


@pytest.mark.slow
def test_multiturn_step_on_cpu_runs_every_turn_in_one_exact_sample(tmp_path: Path) -> None:
    """The CLI at the tiny shape, inline: every trajectory runs its 4 turns, its 3 observations of 12
    tokens join it (one sample, not a sample per turn), and training's logprobs equal the rollout's."""
    env = os.environ | {"PYTHONPATH": str(BENCH.parent)}
    out = tmp_path / "records.json"
    cmd = [sys.executable, str(BENCH / "bench_e2e.py"), "--tiny", "--multiturn", "--eager", "--steps", "1",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (m,) = json.loads(out.read_text())
    assert m["rollout/turns_mean"] == 4.0 and m["rollout/env_errors"] == 0.0
    assert m["rollout/env_tokens_mean"] == 3 * 12
    assert abs(m["rollout/token_mult_prob_error"] - 1.0) < 1e-5
    assert "| rollout/turns_mean | 4.00 |" in proc.stdout
