"""Exact resume: a run continued from a checkpoint equals the uninterrupted run, bit for bit on CPU.

The settings make a wrong resume visible: lr 3e-2 changes the sampled completions after one step
(with a dense reward, `digit_share`; a rollout engine left on the initial weights samples other tokens), a KL term (so a reference
model loaded from the checkpoint instead of the initial policy changes the loss), two mini-batches
(old logprobs and two optimizer steps per RL step) and 3 training prompts with 2 per step (the
prompt source wraps an epoch between checkpoints).
"""

from __future__ import annotations

import torch
from test_trainer_loop import final_weights, read_metrics, tiny_cfg

from rlloom.cluster.inline import InlineGroup
from rlloom.models.adapter import hf_named_tensors
from rlloom.trainer.checkpoint import checkpoint_dir
from rlloom.trainer.run import run


def digit_share(response_text: str, ground_truth: str) -> float:
    """A dense test reward (the tiny random model never answers right): the share of digits."""
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)


EXACT = [
    "reward.name=test_resume_exact:digit_share",
    "train.lr=3e-2",
    "algorithm.kl_coef=0.1",
    "trainer.num_mini_batches=2",
    "data.num_train=3",
    "data.num_eval=0",
    "rollout.num_blocks=64",
    "trainer.save_every=1",
]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_train_longer_after_resume_equals_straight_run(tiny_checkpoint, tmp_path):
    straight, longer = tmp_path / "straight", tmp_path / "longer"
    run(tiny_cfg(tiny_checkpoint, straight, *EXACT, "trainer.total_steps=4"))
    run(tiny_cfg(tiny_checkpoint, longer, *EXACT, "trainer.total_steps=2"))
    run(tiny_cfg(tiny_checkpoint, longer, *EXACT, "trainer.total_steps=4", "trainer.resume=auto"))

    want, got = read_metrics(straight), read_metrics(longer)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert [m["policy/version"] for m in got] == [2.0, 4.0, 6.0, 8.0]  # two optimizer steps per RL step
    assert all(m["rollout/logp_gap_abs"] < 1e-4 for m in got)  # the rollout samples from the trained policy
    assert got == want
    assert_same_weights(final_weights(straight, 4, tmp_path), final_weights(longer, 4, tmp_path))


def test_load_refreshes_rollout_and_keeps_reference_initial(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_cfg(tiny_checkpoint, run_dir, *EXACT, "trainer.total_steps=1")
    run(cfg)
    worker = InlineGroup(cfg).worker
    initial = {n: p.detach().clone() for n, p in worker.train.model.named_parameters()}
    worker.load(str(checkpoint_dir(run_dir, 1) / "engine"))

    assert worker.version == 2 and worker.rollout.policy_version == 2
    trained = dict(worker.train.model.named_parameters())
    assert any(not torch.equal(trained[n], initial[n]) for n in initial)  # lr 3e-2 moved the weights
    for n, p in worker.ref.model.named_parameters():  # the reference stays the initial policy
        assert torch.equal(p, initial[n]), n
    sent = dict(pair for bucket in worker.train.named_weights() for pair in bucket)
    assert_same_weights(sent, dict(hf_named_tensors(worker.rollout.model)))
