"""Reward functions as TRL users write them, and what a score may be.

TRL's GRPOTrainer calls `f(completions, **kwargs)` (or `f(prompts, completions, **kwargs)`) with
every dataset column under its own name; `completions` are strings for a standard dataset and
`[{"role": "assistant", "content": ...}]` for a conversational one. The functions below are the
examples of TRL's documentation (GRPO Trainer: quick start and "Using a custom reward function"),
copied as they are; rlloom refused them at start-up ("missing a required argument: 'completions'").
"""

import json

import numpy
import pytest
from reward_fns_for_tests import batched_lengths

from rlloom.cli import main as cli_main
from rlloom.rewards import RewardInput, RewardRunner
from rlloom.rewards.calling import as_score, score_items

TRL_EXAMPLES = r'''
import re


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def prompts_first(prompts, completions, **kwargs):
    return [float(p[-1]["role"] == "user") for p in prompts]


def solution_as_the_row_has_it(response_text, ground_truth, solution):
    # per sample, the answer column under its own name: a number stays a number
    return 1.0 if isinstance(solution, int) and str(solution) == ground_truth else -100.0
'''


@pytest.fixture
def trl(tmp_path, monkeypatch):
    (tmp_path / "trl_examples.py").write_text(TRL_EXAMPLES)
    monkeypatch.syspath_prepend(str(tmp_path))
    import trl_examples

    return trl_examples


def test_trl_examples_score_standard_and_conversational_rows(trl):
    text = RewardInput("<think>a</think><answer>7</answer> \\boxed{7}", "7", prompt="2+5?", columns={"x": 1})
    chat = RewardInput(
        "<think>a</think><answer>7</answer>", "7", prompt=[{"role": "user", "content": "2+5?"}]
    )
    assert score_items(trl.reward_len, [text]) == [("ok", -abs(20 - len(text.response_text)))]
    assert score_items(trl.format_reward_func, [chat]) == [("ok", 1.0)]  # completions as messages
    assert score_items(trl.prompts_first, [chat]) == [("ok", 1.0)]
    truth = RewardInput("\\boxed{7}", "7", columns={"ground_truth": "7"})  # the answer column's own name
    assert score_items(trl.reward_func, [truth]) == [("ok", 1.0)]


def test_what_a_score_may_be():
    assert as_score(numpy.True_) == 1.0 and as_score(numpy.float32(0.5)) == 0.5  # numpy bool: valid now
    assert as_score(-1e15) == -1e15 and as_score(-3e38) is None and as_score(1e16) is None
    items = [RewardInput("a", "1", columns={"level": 1}), RewardInput("b", "1", columns={"level": 2})]
    as_dict = lambda completions, **kw: {0: 1.0, 1: 2.0}  # noqa: E731  (it was scored by its keys)
    as_set = lambda completions, **kw: {3.0, 4.0}  # noqa: E731
    for fn in (as_dict, as_set):
        assert [kind for kind, _ in score_items(fn, items)] == ["invalid", "invalid"]
    as_array = lambda completions, **kw: numpy.array([True, False])  # noqa: E731
    assert score_items(as_array, items) == [("ok", 1.0), ("ok", 0.0)]
    assert RewardRunner(batched_lengths, num_workers=0).score(items).scores == [2.0, 3.0]


def _train(tmp_path, rows, answer_key, reward):
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "trl_examples_e2e.py").write_text(TRL_EXAMPLES)
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "run.yaml").write_text(
        "recipe: arithmetic_smoke\n"
        f"data: {{task: jsonl, path: data.jsonl, answer_key: {answer_key}, num_eval: 2}}\n"
        f"reward: {{name: '{reward}'}}\n"
        "rollout: {max_new_tokens: 3}\n"
        f"trainer: {{total_steps: 1, run_dir: {tmp_path / 'run'}}}\n"
        "logging: {console: false}\n"
    )
    return folder / "run.yaml"


@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
def test_trl_reward_functions_run_unchanged_through_the_cli(tiny_checkpoint, tmp_path, conversational):
    if conversational:  # completions are messages; `solution` (an int) reaches a per-sample function
        rows = [{"prompt": [{"role": "user", "content": f"1+{i}?"}], "solution": 1 + i} for i in range(10)]
        yaml_path = _train(
            tmp_path,
            rows,
            "solution",
            "trl_examples_e2e:format_reward_func + trl_examples_e2e:prompts_first"
            " + trl_examples_e2e:solution_as_the_row_has_it",
        )
    else:  # completions are strings; the answer column reaches reward_func as `ground_truth`
        rows = [{"prompt": f"1+{i}?", "ground_truth": str(1 + i)} for i in range(10)]
        yaml_path = _train(
            tmp_path, rows, "ground_truth", "trl_examples_e2e:reward_len + 100*trl_examples_e2e:reward_func"
        )
    assert cli_main(["train", str(yaml_path), f"model.path={tiny_checkpoint}"]) == 0
    step = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1]
    assert step["reward/errors"] == 0 and step["reward/invalid"] == 0
    if conversational:
        assert step["reward/mean"] == 2.0  # format 0 (random text), prompts_first 1, solution 1
    else:
        assert -20 <= step["reward/mean"] <= -16  # 3 new tokens at most: 17 to 20 short of 20


def test_huge_scores_are_invalid_and_numpy_bools_valid_through_the_cli(tiny_checkpoint, tmp_path):
    """-3e38 (a float32) crashed the step with a traceback: the group std overflowed."""
    argv = ["train", "arithmetic_smoke", f"model.path={tiny_checkpoint}", f"trainer.run_dir={tmp_path}"]
    argv += ["data.num_train=16", "data.num_eval=2", "trainer.total_steps=1", "rollout.max_new_tokens=3"]
    argv += ["logging.console=false", "reward.name=reward_fns_for_tests:huge_or_numpy_true"]
    assert cli_main(argv) == 0
    step = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][1]
    invalid = step["reward/invalid"]  # 2 prompts x 4 samples: each worker alternates between the two
    assert 0 < invalid < 8 and step["reward/mean"] == (8 - invalid) / 8  # numpy.True_ scores 1.0
