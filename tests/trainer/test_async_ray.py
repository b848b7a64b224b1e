"""The asynchronous modes on Ray actors (CPU): one_step_off and partial=abort_resume with separate
placement (1 training + 1 rollout actor: the next batch generates on the rollout actor while the step
trains), partial=drop with colocated placement (the rollout generates in a thread of the training
actor). One Ray start for the module."""

from __future__ import annotations

import pytest
import torch
from test_async_loop import ABORT_RESUME, FAST, check_versions_and_logprobs, spy_on_versions
from test_trainer_loop import read_metrics, tiny_cfg

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")

from rlloom.trainer.run import run  # noqa: E402

SEPARATE = ["cluster.mode=ray", "cluster.placement=separate", "cluster.rollout_workers=1"]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _weights(slot_actor, role: str) -> tuple[int | None, dict[str, torch.Tensor]]:
    """(rollout policy version or None, the Hugging Face-named weights) of a slot actor's `role` worker."""

    def read(actor, role):
        from rlloom.models.adapter import hf_named_tensors

        worker = getattr(actor, role)
        model = worker.engine.model
        version = worker.engine.policy_version if role == "rollout" else None
        return version, {k: v.detach().clone() for k, v in hf_named_tensors(model)}

    return ray.get(slot_actor.__ray_call__.remote(read, role))


def slow_rollout(monkeypatch, seconds: float) -> None:
    """Each decode step of the rollout actors takes `seconds` more, so that a job is still generating
    when the training step before it ends and its weight update arrives (on 2 cores the tiny model's
    rollout actor would otherwise finish every response while the controller trains)."""
    import rlloom.trainer.async_loop as loop_mod

    real = loop_mod._build_producer

    def slow_steps(actor, seconds: float) -> None:  # runs in the actor (nested: pickled by value)
        import time

        step = actor.rollout.engine.step

        def slow():
            time.sleep(seconds)
            return step()

        actor.rollout.engine.step = slow

    def build(ctx):
        group = ctx.rollout_group
        ray.get([group.actors.slots[r[0]].__ray_call__.remote(slow_steps, seconds) for r in group.replicas])
        return real(ctx)

    monkeypatch.setattr(loop_mod, "_build_producer", build)


def _ray_weights_of(ctx):
    rollout, train = ctx.rollout_group, ctx.train_group
    version, held = _weights(rollout.actors.slots[rollout.replicas[0][0]], "rollout")
    return version, held, _weights(train.actors.slots[train.slots[0]], "train")[1]


@pytest.mark.slow  # a Ray start: 30-90 s on 2 cores
def test_one_step_off_on_separate_ray_actors(ray_cluster, tiny_checkpoint, tmp_path):
    cfg = tiny_cfg(
        tiny_checkpoint,
        tmp_path / "r",
        *FAST,
        *SEPARATE,
        "trainer.total_steps=3",
        "trainer.mode=one_step_off",
    )
    run(cfg)
    records = read_metrics(tmp_path / "r")
    assert [m["step"] for m in records] == [1, 2, 3]
    for k, m in enumerate(records):
        assert m["async/version_min"] == m["async/version_max"] == max(k - 1, 0), (k, m)
        gap = m["is/mean_abs_logp_diff"]  # the behaviour policy is older than the trained one
        assert (gap > 1e-3) if k else (gap < 1e-4), (k, gap)


@pytest.mark.slow
def test_abort_resume_on_separate_ray_actors(ray_cluster, tiny_checkpoint, tmp_path, monkeypatch):
    """The rollout actor's requests in flight are aborted at the weight update (a broadcast into its
    process), and resumed under the new weights: each token keeps its version and behaviour logprob."""
    seen = spy_on_versions(monkeypatch, _ray_weights_of)
    slow_rollout(monkeypatch, 0.05)
    run(tiny_cfg(tiny_checkpoint, tmp_path / "r", *FAST, *ABORT_RESUME, *SEPARATE))
    records = read_metrics(tmp_path / "r")
    assert [m["step"] for m in records] == [1, 2, 3]
    assert sum(m["async/tokens_interrupted"] for m in records) > 0
    assert check_versions_and_logprobs(seen, tiny_checkpoint) > 0  # some responses were resumed


@pytest.mark.slow
def test_partial_drop_on_a_colocated_ray_actor(ray_cluster, tiny_checkpoint, tmp_path, monkeypatch):
    """partial=drop: the samples in flight restart under the new weights (synced in place inside the
    actor), so every trained response comes from one policy version, within the staleness bound."""
    seen = spy_on_versions(monkeypatch, _ray_weights_of)
    slow_rollout(monkeypatch, 0.05)
    extra = [*ABORT_RESUME, "rollout.partial=drop", "cluster.mode=ray", "cluster.placement=colocated"]
    run(tiny_cfg(tiny_checkpoint, tmp_path / "r", *FAST, *extra))
    records = read_metrics(tmp_path / "r")
    assert [m["step"] for m in records] == [1, 2, 3]
    assert sum(m["async/tokens_discarded"] for m in records) > 0
    assert check_versions_and_logprobs(seen, tiny_checkpoint) == 0  # none mixes two versions
