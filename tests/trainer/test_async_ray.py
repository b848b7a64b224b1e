"""The asynchronous modes on Ray actors (CPU), all through the one producer (rollout_stream.py) and
a rollout replica of two tensor-parallel actors (rollout.tp=2, both ranks following their rank 0's
steps): one_step_off (partial=finish) and partial=abort_resume with separate placement (the next
batch generates on the rollout actors while the step trains), partial=drop with colocated placement
(two training ranks; the rollout ranks generate in threads of the training actors). One Ray start
for the session (conftest's `ray_cluster`)."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import pytest
import torch
from test_async_loop import ABORT_RESUME, FAST, check_versions_and_logprobs, spy_on_versions
from test_trainer_loop import ALL_SAMPLES, prompts_per_step, read_metrics, tiny_cfg

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

from rlloom.trainer.checkpoint import checkpoint_dir, checkpoint_model_tensors  # noqa: E402
from rlloom.trainer.run import run  # noqa: E402
from rlloom.trainer.stop import RunStopped  # noqa: E402

SEPARATE_TP2 = [
    "cluster.mode=ray",
    "cluster.placement=separate",
    "cluster.rollout_workers=2",
    "rollout.tp=2",
    "cluster.timeout_s=60",  # a replica's ranks out of step fail the run within a minute
]


def slow_rollout(monkeypatch, seconds: float) -> None:
    """Each decode step of the rollout actors takes `seconds` more, so that a job is still generating
    when the training step before it ends and its weight update arrives (on 2 cores the tiny model's
    rollout actor would otherwise finish every response while the controller trains)."""
    import rlloom.trainer.async_loop as loop_mod

    real = loop_mod.AsyncLoop.__init__

    def slow_steps(actor, seconds: float) -> None:  # runs in the actor (nested: pickled by value)
        import time

        step = actor.rollout.engine.step

        def slow():
            time.sleep(seconds)
            return step()

        actor.rollout.engine.step = slow

    def build(self, ctx):
        group = ctx.rollout_group
        ray.get([group.actors.slots[r[0]].__ray_call__.remote(slow_steps, seconds) for r in group.replicas])
        return real(self, ctx)

    monkeypatch.setattr(loop_mod.AsyncLoop, "__init__", build)


def _ray_weights_of(ctx):
    """(rollout version, its weights, training weights) for `spy_on_versions`. The training weights
    come from a Hugging Face folder the training ranks write (gathered across data-parallel ranks).
    The replica's tensor-parallel ranks hold shards: every rank must hold the training version, and
    the training weights stand for the replica's (the logprob check then shows that it computed under
    exactly them)."""
    from safetensors.torch import load_file

    rollout = ctx.rollout_group
    with tempfile.TemporaryDirectory() as folder:
        ctx.train_group.save_hf(folder).result()
        sent = {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}
    versions = {ray.get(rollout.actors.slots[s].versions.remote())[1] for s in rollout.replicas[0]}
    assert len(versions) == 1, versions
    return versions.pop(), sent, sent


@pytest.mark.slow  # a Ray start: 30-90 s on 2 cores
def test_one_step_off_on_separate_ray_actors(ray_cluster, tiny_checkpoint, tmp_path):
    """partial=finish on a tensor-parallel replica gives exactly the one-process run."""
    common = [*FAST, "trainer.total_steps=3", "trainer.mode=one_step_off"]
    run(tiny_cfg(tiny_checkpoint, tmp_path / "inline", *common))
    run(tiny_cfg(tiny_checkpoint, tmp_path / "r", *common, *SEPARATE_TP2))
    inline, records = read_metrics(tmp_path / "inline"), read_metrics(tmp_path / "r")
    assert [m["step"] for m in records] == [1, 2, 3]
    for k, (a, b) in enumerate(zip(inline, records)):
        assert a.keys() == b.keys(), a.keys() ^ b.keys()
        # The same tokens and rewards; tp=2 logprobs agree with tp=1 within 1e-5 (the vocabulary-
        # parallel log-softmax adds in another order), which the importance weights carry into the
        # loss (3e-5 relative by step 3). The sync metrics count the transport's pieces.
        for key in [key for key in a if not key.startswith("sync/")]:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (k, key)
        assert b["async/version_min"] == b["async/version_max"] == max(k - 1, 0), (k, b)
        gap = b["is/mean_abs_logp_diff"]  # the behaviour policy is older than the trained one
        assert (gap > 1e-3) if k else (gap < 1e-4), (k, gap)


@pytest.mark.slow
def test_abort_resume_on_separate_ray_actors(ray_cluster, tiny_checkpoint, tmp_path, monkeypatch):
    """The tensor-parallel replica's requests in flight are aborted at the weight update (both ranks
    at the step their rank 0 chose; a broadcast into their processes), and resumed under the new
    weights: each token keeps its version and behaviour logprob (the producing policy's forward)."""
    seen = spy_on_versions(monkeypatch, _ray_weights_of)
    slow_rollout(monkeypatch, 0.05)
    run(tiny_cfg(tiny_checkpoint, tmp_path / "r", *FAST, *ABORT_RESUME, *SEPARATE_TP2))
    records = read_metrics(tmp_path / "r")
    assert [m["step"] for m in records] == [1, 2, 3]
    assert sum(m["async/tokens_interrupted"] for m in records) > 0
    assert check_versions_and_logprobs(seen, tiny_checkpoint) > 0  # some responses were resumed


@pytest.mark.slow
def test_partial_drop_on_colocated_ray_actors(ray_cluster, tiny_checkpoint, tmp_path, monkeypatch):
    """partial=drop on two colocated actors (two data-parallel training ranks, one rollout replica of
    two tensor-parallel ranks whose stream threads run beside training): the samples in flight
    restart under the new weights (synced in place inside each actor), so every trained response
    comes from one policy version, within the staleness bound."""
    seen = spy_on_versions(monkeypatch, _ray_weights_of)
    slow_rollout(monkeypatch, 0.05)
    extra = [
        *ABORT_RESUME,
        "rollout.partial=drop",
        "cluster.mode=ray",
        "cluster.num_workers=2",
        "rollout.tp=2",
        "cluster.timeout_s=60",
    ]
    run(tiny_cfg(tiny_checkpoint, tmp_path / "r", *FAST, *extra))
    records = read_metrics(tmp_path / "r")
    assert [m["step"] for m in records] == [1, 2, 3]
    assert sum(m["async/tokens_discarded"] for m in records) > 0
    assert check_versions_and_logprobs(seen, tiny_checkpoint) == 0  # none mixes two versions


@pytest.mark.slow
def test_sigterm_in_one_step_off_on_ray_drains_then_resume_equals_the_run_checkpointed_there(
    ray_cluster, tiny_checkpoint, tmp_path, monkeypatch
):
    """A scheduler's SIGTERM to the driver while batch 2 (admitted at step 2) is scored, on one Ray
    actor hosting training and rollout: the step finishes, the batch in flight is dropped and its
    prompts given back, step 2's checkpoint is written although save_every=0, and the resumed run on
    Ray equals the one-process run checkpointed at step 2 (before: batch 2 was never trained)."""
    common = [
        *FAST,
        "trainer.mode=one_step_off",
        "trainer.total_steps=4",
        "reward.name=resume_reward:digit_share_signalling",
        ALL_SAMPLES,
    ]
    on_ray = ["cluster.mode=ray", "cluster.timeout_s=60"]
    run(tiny_cfg(tiny_checkpoint, tmp_path / "inline", *common, "trainer.save_every=2"))
    cfg = tiny_cfg(tiny_checkpoint, tmp_path / "x", *common)
    batch = cfg.trainer.prompts_per_step * cfg.rollout.n_samples
    monkeypatch.setenv("RESUME_REWARD_SIGNAL", f"{int(signal.SIGTERM)}:{2 * batch + 1}")
    with pytest.raises(RunStopped) as stopped:
        run(tiny_cfg(tiny_checkpoint, tmp_path / "r", *common, *on_ray))
    assert stopped.value.step == 2 and stopped.value.checkpoint == checkpoint_dir(tmp_path / "r", 2)
    monkeypatch.delenv("RESUME_REWARD_SIGNAL")
    run(
        tiny_cfg(
            tiny_checkpoint, tmp_path / "r", *common, *on_ray, "trainer.save_every=2", "trainer.resume=auto"
        )
    )

    assert prompts_per_step(tmp_path / "r") == prompts_per_step(tmp_path / "inline")
    inline, records = read_metrics(tmp_path / "inline"), read_metrics(tmp_path / "r")
    assert [m["step"] for m in records] == [1, 2, 3, 4]
    for a, b in zip(inline, records):
        assert a.keys() == b.keys(), a.keys() ^ b.keys()
        for key in [key for key in a if not key.startswith("sync/")]:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    want = checkpoint_model_tensors(checkpoint_dir(tmp_path / "inline", 4))
    got = checkpoint_model_tensors(checkpoint_dir(tmp_path / "r", 4))
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=5e-5, msg=name)
