"""The calling contract of reward functions: the prompt and dataset columns as keyword arguments,
the batched form, backward compatibility with `(response, ground_truth)` functions, and a reward
module next to the YAML config (end to end through the CLI, with a jsonl dataset's extra column)."""

import json
import time

import pytest
from reward_fns_for_tests import (
    batched_lengths,
    batched_needs_level,
    batched_wrong_length,
    echo_score,
    needs_difficulty,
    uses_all_columns,
    uses_columns,
)

from rlloom.cli import main as cli_main
from rlloom.rewards import RewardInput, RewardRunner, get_reward_fn
from rlloom.rewards.calling import call_form, missing_arguments, score_items


def items(*levels, prompt="level {}"):
    return [RewardInput("r", "1", prompt=prompt.format(lv), columns={"level": lv, "x": 0}) for lv in levels]


def test_signature_decides_the_form():
    assert call_form(echo_score).batched is False and call_form(echo_score).keywords == frozenset()
    assert call_form(uses_columns).keywords == {"prompt", "level"}
    assert call_form(uses_all_columns).keywords is None
    assert call_form(batched_lengths).batched is True


def test_columns_and_prompt_reach_per_sample_functions():
    assert score_items(uses_columns, items(2, 3)) == [("ok", 2.0), ("ok", 3.0)]
    assert score_items(uses_all_columns, items(1)) == [("ok", 3.0)]  # prompt, level, x
    # A column named like a positional parameter does not collide with it.
    clash = RewardInput("r", "1", columns={"truth": "other", "response": 1})
    assert score_items(uses_all_columns, [clash]) == [("ok", 1.0)]  # only prompt
    assert score_items(echo_score, [RewardInput("ok", "4", columns={"level": 1})]) == [("ok", 4.0)]
    missing = score_items(uses_columns, [RewardInput("r", "1")])
    assert missing[0][0] == "error" and "level" in missing[0][1]


def test_batched_function_gets_lists_and_is_checked():
    assert score_items(batched_lengths, items(1, 2)) == [("ok", 2.0), ("ok", 3.0)]
    assert [k for k, _ in score_items(batched_wrong_length, items(1, 2))] == ["invalid", "invalid"]
    weighted = get_reward_fn("reward_fns_for_tests:batched_lengths + 0.5*format_number")
    assert score_items(weighted, [RewardInput("7", "", columns={"level": 1})]) == [("ok", 2.5)]
    runner = RewardRunner(batched_lengths, num_workers=0)
    assert runner.score(items(*range(5))).scores == [1.0 + i for i in range(5)]


def test_batched_function_in_workers_with_a_hung_call():
    with RewardRunner(batched_lengths, num_workers=2, timeout_s=1.0) as runner:
        assert runner.batched
        start = time.monotonic()
        batch = items(*range(8))
        batch[1] = RewardInput("hang", "1", columns={"level": 0})  # hangs its whole call (samples 0-3)
        result = runner.score(batch)
        assert time.monotonic() - start < 6.0
        assert result.scores == [0.0] * 4 + [1.0 + i for i in range(4, 8)] and result.num_timeouts == 4
        assert runner.score(items(*range(100))).scores == [1.0 + i for i in range(100)]


def test_yaml_reward_module_and_dataset_columns_end_to_end(tiny_checkpoint, tmp_path, monkeypatch):
    """`rlloom train run.yaml` with a reward module next to the YAML (no PYTHONPATH) that reads the
    prompt and an extra jsonl column, per sample and batched, in worker processes."""
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "column_rewards_e2e.py").write_text(
        "def bonus(response_text, ground_truth, prompt, bonus):\n"
        "    return bonus if prompt.startswith('Q') else -1.0\n\n"
        "def batched_level(completions, prompts, level):\n"
        "    return [0.5 * lv for lv in level]\n"
    )
    rows = [{"prompt": f"Q{i}: 1+{i}?", "answer": str(1 + i), "bonus": 0.25, "level": 2} for i in range(10)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "run.yaml").write_text(
        "recipe: arithmetic_smoke\n"
        f"model: {{path: {tiny_checkpoint}}}\n"
        f"data: {{task: jsonl, path: {folder / 'data.jsonl'}, num_eval: 2}}\n"
        "reward: {name: 'column_rewards_e2e:bonus + column_rewards_e2e:batched_level'}\n"
        "rollout: {max_new_tokens: 3}\n"
        f"trainer: {{total_steps: 1, run_dir: {tmp_path / 'run'}}}\n"
        "logging: {console: false}\n"
    )
    monkeypatch.chdir(tmp_path)  # not the YAML's folder: the module is found through reward.import_dir
    assert cli_main(["train", str(folder / "run.yaml")]) == 0
    step = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1]
    assert step["reward/errors"] == 0 and step["reward/invalid"] == 0
    assert step["reward/mean"] == pytest.approx(1.25) and step["train/accuracy"] == 1.0


def test_unknown_reward_module_is_a_one_line_cli_error(tiny_checkpoint, tmp_path, capsys):
    argv = ["train", "arithmetic_smoke", f"model.path={tiny_checkpoint}", f"trainer.run_dir={tmp_path}"]
    argv += ["data.num_train=16", "data.num_eval=2"]
    assert cli_main([*argv, "reward.name=no_such_reward_module:score"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlloom: error: reward.name='no_such_reward_module:score' is invalid")
    assert "next to the YAML config" in err and err.count("\n") == 1


def test_arguments_no_sample_can_fill_are_found():
    # a required parameter that is neither a column nor an argument of the form: every call fails
    assert missing_arguments(needs_difficulty, {"level"}) == ["difficulty"]
    assert missing_arguments(needs_difficulty, {"difficulty"}) == []  # `bonus` has a default
    assert missing_arguments(batched_needs_level, set()) == ["level"]
    assert missing_arguments(batched_needs_level, {"level"}) == []
    assert missing_arguments(get_reward_fn("number + reward_fns_for_tests:needs_difficulty"), set()) == [
        "difficulty"
    ]


def test_a_reward_needing_a_column_the_data_lacks_stops_the_run_at_start_up(
    tiny_checkpoint, tmp_path, capsys
):
    # it ran before, every sample scoring reward.default_score and counted in reward/errors
    argv = [
        "train",
        "arithmetic_smoke",
        f"model.path={tiny_checkpoint}",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    argv += ["data.num_train=16", "data.num_eval=2", "reward.name=reward_fns_for_tests:needs_difficulty"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("rlloom: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(
        "rlloom: error: reward.name='reward_fns_for_tests:needs_difficulty' is invalid: it needs 'difficulty'"
    )
    assert "(the data's columns: a, b, op, task)" in errors[0]  # arithmetic's columns
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_recipe_run_finds_a_reward_module_in_the_current_folder(tiny_checkpoint, tmp_path, monkeypatch):
    """docs/config.md: an empty reward.import_dir is the current folder. With a recipe and a
    reward.name override the start-up check looked elsewhere and refused the module."""
    (tmp_path / "here_rewards_train.py").write_text(
        "def score(response_text, ground_truth):\n    return 0.5\n"
    )
    monkeypatch.chdir(tmp_path)
    argv = ["train", "arithmetic_smoke", f"model.path={tiny_checkpoint}", "trainer.run_dir=run"]
    argv += ["data.num_train=16", "data.num_eval=2", "trainer.total_steps=1", "rollout.max_new_tokens=3"]
    assert cli_main([*argv, "logging.console=false", "reward.name=here_rewards_train:score"]) == 0
    step = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1]
    assert step["reward/mean"] == 0.5


def test_rlloom_eval_finds_a_reward_module_in_the_current_folder(
    tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    """`rlloom eval MODEL DATA reward.name=...` looked in a temporary folder of its own instead."""
    (tmp_path / "here_rewards_eval.py").write_text(
        "def score(response_text, ground_truth):\n    return 1.0\n"
    )
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    monkeypatch.chdir(tmp_path)
    argv = ["eval", str(tiny_checkpoint), "d.jsonl", "reward.name=here_rewards_eval:score"]
    assert cli_main([*argv, "rollout.max_new_tokens=2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["accuracy"] == 1.0
