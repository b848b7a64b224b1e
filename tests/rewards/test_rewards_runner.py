"""RewardRunner: inline and worker modes, timeouts, errors, invalid scores, order, metrics."""

import pytest
from reward_fns_for_tests import echo_score, misbehave, modules_loaded

from rlloom.rewards import RewardRunner, get_reward_fn


def test_inline_scores_and_counts_bad_outputs():
    runner = RewardRunner(misbehave, num_workers=0, default_score=-1.0)
    result = runner.score(
        [
            ("good", "2"),
            ("raise", "0"),
            ("exit", "0"),
            ("none", "0"),
            ("nan", "0"),
            ("big", "0"),
            ("x", "0.5"),
        ]
    )
    assert result.scores == [2.0, -1.0, -1.0, -1.0, -1.0, -1.0, 0.5]
    assert result.metrics() == {"reward/timeouts": 0.0, "reward/errors": 2.0, "reward/invalid": 3.0}
    assert runner.totals["reward/invalid"] == 3.0


def test_worker_matches_inline_on_builtin_reward():
    fn = get_reward_fn("number + 0.1*format_number")
    pairs = [("47", "47"), ("12 + 35 = 47", "47"), ("46", "47"), ("", "47")]
    inline = RewardRunner(fn, num_workers=0).score(pairs).scores
    with RewardRunner(fn, num_workers=1, timeout_s=5.0) as runner:
        assert runner.score(pairs).scores == pytest.approx(inline)
    assert inline == pytest.approx([1.1, 1.0, 0.1, 0.0])


def test_worker_process_does_not_import_torch():
    with RewardRunner(modules_loaded, num_workers=1, timeout_s=5.0) as runner:
        result = runner.score([("torch", ""), ("rlloom.rewards.worker", "")])
    assert result.scores == [0.0, 1.0]


def test_unpicklable_function_is_refused_with_a_fix():
    with pytest.raises(ValueError, match="module level"):
        RewardRunner(lambda r, g: 1.0, num_workers=1)


def test_function_that_cannot_load_in_a_worker_is_reported_with_a_fix(monkeypatch, tmp_path):
    module = tmp_path / "vanishing_reward.py"
    module.write_text("def score(response_text, ground_truth):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from vanishing_reward import score

    module.unlink()  # the worker cannot import it any more
    with pytest.raises(RuntimeError, match="cannot be loaded in a worker process .*ModuleNotFoundError"):
        RewardRunner(score, num_workers=1).score([("a", "b")])


def test_empty_batch_and_bad_settings():
    assert RewardRunner(echo_score).score([]).scores == []
    for timeout in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeout_s"):
            RewardRunner(echo_score, timeout_s=timeout)
    runner = RewardRunner(echo_score, num_workers=1)
    runner.close()
    with pytest.raises(RuntimeError, match="close"):
        runner.score([("ok", "1")])


def test_worker_that_died_between_calls_is_replaced():
    with RewardRunner(echo_score, num_workers=1, timeout_s=5.0) as runner:
        assert runner.score([("ok", "1")]).scores == [1.0]
        dead = runner._workers[0].popen
        dead.kill()
        dead.wait()
        assert runner.score([("ok", "2"), ("ok", "3")]).scores == [2.0, 3.0]
        assert runner._workers[0].popen is not dead
