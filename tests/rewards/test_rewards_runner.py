"""RewardRunner: inline and worker modes, timeouts, errors, invalid scores, order, metrics."""

import time

import pytest
from reward_fns_for_tests import echo_score, misbehave, modules_loaded

from rlloom.rewards import RewardRunner, get_reward_fn


def test_inline_scores_and_counts_bad_outputs():
    runner = RewardRunner(misbehave, num_workers=0, default_score=-1.0)
    result = runner.score(
        [("good", "2"), ("raise", "0"), ("none", "0"), ("nan", "0"), ("abc", "0"), ("x", "0.5")]
    )
    assert result.scores == [2.0, -1.0, -1.0, -1.0, -1.0, 0.5]
    assert result.metrics() == {"reward/timeouts": 0.0, "reward/errors": 1.0, "reward/invalid": 3.0}
    assert runner.totals["reward/invalid"] == 3.0


def test_workers_survive_hang_raise_crash_and_bad_values_in_one_call():
    pairs = [
        ("good", "1"),
        ("hang", "0"),
        ("raise", "0"),
        ("good", "2"),
        ("none", "0"),
        ("nan", "0"),
        ("inf", "0"),
        ("abc", "0"),
        ("crash", "0"),
        ("good", "3"),
    ]
    with RewardRunner(misbehave, num_workers=2, timeout_s=0.5, default_score=0.0) as runner:
        start = time.monotonic()
        result = runner.score(pairs)
        elapsed = time.monotonic() - start
        assert result.scores == [1.0, 0, 0, 2.0, 0, 0, 0, 0, 0, 3.0]
        assert (result.num_timeouts, result.num_errors, result.num_invalid) == (1, 2, 4)
        assert elapsed < 2.5, f"score() took {elapsed:.2f}s with a 0.5s timeout"
        # The hung and crashed workers were replaced: the pool keeps working, in order.
        again = runner.score([("good", str(i)) for i in range(8)])
        assert again.scores == [float(i) for i in range(8)]
        assert again.metrics()["reward/timeouts"] == 0.0
        assert runner.totals["reward/timeouts"] == 1.0


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


def test_empty_batch_and_bad_settings():
    assert RewardRunner(echo_score).score([]).scores == []
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner(echo_score, timeout_s=0)
    runner = RewardRunner(echo_score, num_workers=1)
    runner.close()
    with pytest.raises(RuntimeError, match="close"):
        runner.score([("ok", "1")])


def test_worker_that_died_between_calls_is_replaced():
    with RewardRunner(echo_score, num_workers=1, timeout_s=5.0) as runner:
        assert runner.score([("ok", "1")]).scores == [1.0]
        dead = runner._workers[0].process
        dead.kill()
        dead.join()
        assert runner.score([("ok", "2"), ("ok", "3")]).scores == [2.0, 3.0]
        assert runner._workers[0].process is not dead
