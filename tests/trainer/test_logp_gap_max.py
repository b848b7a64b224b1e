"""`rollout/logp_gap_max`: the largest |logp_train - logp_rollout| over a step's sampled tokens (the
tokens of `rollout/token_mult_prob_error`), through `rlloom train`. Its other modes (sync single
pass, several mini-batches, multi-turn) are checked beside the other gap metrics in
test_trainer_loop.py and tests/episodes/test_episodes_run.py."""

from __future__ import annotations

import pytest
import torch
from test_async_loop import FAST
from test_trainer_loop import read_metrics, tiny_args

from rlloom.cli import main


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_gap_max_is_the_max_over_micro_batches_and_mini_batches(tiny_checkpoint, tmp_path, monkeypatch):
    """trainer.mode=async trains on stale samples, so the gap is not 0. In a single pass the loss
    takes it per micro-batch (several here), and the max of maxes must equal the whole batch's max
    that a separate old-logprob forward gives."""
    import rlloom.trainer.step as step

    args = [*FAST, "trainer.total_steps=3", "trainer.mode=async", "train.max_tokens_per_micro_batch=24"]
    assert main(["train", "arithmetic_smoke", *tiny_args(tiny_checkpoint, tmp_path / "in_loss", *args)]) == 0
    monkeypatch.setattr(step, "is_single_pass", lambda cfg: False)  # the old forward, every step
    assert main(["train", "arithmetic_smoke", *tiny_args(tiny_checkpoint, tmp_path / "forward", *args)]) == 0
    in_loss, forward = read_metrics(tmp_path / "in_loss")[1:], read_metrics(tmp_path / "forward")[1:]
    assert max(m["rollout/logp_gap_max"] for m in in_loss) > 1e-3  # stale samples
    for a, b in zip(in_loss, forward, strict=True):
        assert a["train/num_micro_batches"] > 1
        assert a["rollout/logp_gap_max"] >= a["rollout/logp_gap_abs"]
        assert a["rollout/logp_gap_max"] == pytest.approx(b["rollout/logp_gap_max"], rel=1e-5, abs=1e-7)
