"""rollout.match_training through `rlloom train` on the CPU: every sampled token's rollout logprob
equals the training forward's bit for bit (`rollout/logp_gap_max` == 0.0 at every step) for the three
tiny families, and with what makes a token's batch differ between the two engines: shared-prompt
packing (on by default: the rollout shares prompt blocks, training packs prompt trees), several
micro-batches, mixed lengths, preemption, multi-turn episodes and the asynchronous stream.

lr 3e-2 moves the weights in one step, so the second step checks the synced weights too. The single
pass (one mini-batch) is where the loss compares its own forward with the rollout's logprobs."""

from __future__ import annotations

import importlib.util
import json
import string
from pathlib import Path

import pytest
import torch
from test_trainer_loop import read_metrics, tiny_args, tiny_cfg

from rlloom.cli import main
from rlloom.config import ConfigError
from rlloom.engines.rollout.native import scheduler as scheduler_mod
from rlloom.models.tiny import write_tiny_model

STEPS = ["trainer.total_steps=2", "train.lr=3e-2", "data.num_eval=0", "trainer.save_hf_every=-1"]
STOP_ANY = "rollout.stop_strings=" + json.dumps(list(string.ascii_letters + string.digits))
EPISODES = Path(__file__).parents[1] / "episodes"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gaps(ckpt: Path, run_dir: Path, *extra: str) -> list[float]:
    """`rollout/logp_gap_max` of each step of a `rlloom train` run."""
    assert main(["train", "arithmetic_smoke", *tiny_args(ckpt, run_dir, *STEPS, *extra)]) == 0
    found = [m["rollout/logp_gap_max"] for m in read_metrics(run_dir) if "rollout/logp_gap_max" in m]
    assert len(found) == 2
    return found


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe", "tiny-mla"])
def test_rollout_logprobs_equal_training_bit_for_bit(tmp_path, kind):
    ckpt = write_tiny_model(kind, tmp_path / "ckpt", seed=0, hidden=32, layers=2)
    assert gaps(ckpt, tmp_path / "exact", "rollout.match_training=true") == [0.0, 0.0]
    if kind == "tiny-dense":  # the default kernels round differently: the check can fail
        assert max(gaps(ckpt, tmp_path / "default")) > 0.0


def test_exact_with_mixed_lengths_preemption_and_micro_batches(tiny_checkpoint, tmp_path, monkeypatch):
    preempted = []
    real = scheduler_mod.Scheduler._preempt

    def count(self, seq):  # noqa: ANN001, ANN202
        preempted.append(seq)
        return real(self, seq)

    monkeypatch.setattr(scheduler_mod.Scheduler, "_preempt", count)
    extra = [
        "rollout.match_training=true",
        STOP_ANY,  # the random model's responses end at different lengths
        "rollout.max_new_tokens=12",
        "rollout.num_blocks=10",  # too few blocks for every sequence at once: preemption
        "train.max_tokens_per_micro_batch=96",
    ]
    assert gaps(tiny_checkpoint, tmp_path / "run", *extra) == [0.0, 0.0]
    assert preempted


def test_exact_multi_turn_episodes(tiny_checkpoint, tmp_path):
    extra = [
        "rollout.match_training=true",
        f"reward.import_dir={EPISODES}",
        STOP_ANY,
        "rollout.max_new_tokens=8",
        "rollout.env=episode_envs:Turns",
    ]
    assert gaps(tiny_checkpoint, tmp_path / "run", *extra) == [0.0, 0.0]


def test_exact_on_the_asynchronous_stream(tiny_moe_checkpoint, tmp_path):
    # staleness 0: every sample is trained by the policy that generated it, so the gap is a mismatch
    extra = ["rollout.match_training=true", "trainer.mode=async", "trainer.max_staleness=0"]
    assert gaps(tiny_moe_checkpoint, tmp_path / "run", *extra) == [0.0, 0.0]


def test_exact_under_data_parallelism_on_ray(ray_cluster, tiny_checkpoint, tmp_path):
    """Two training ranks (FSDP over gloo) and two colocated rollout replicas: each rank's forward
    is one process's numerics, so the gap stays 0.0 with the synced weights of step 2."""
    ray = ["rollout.match_training=true", "cluster.mode=ray", "cluster.num_workers=2"]
    assert gaps(tiny_checkpoint, tmp_path / "dp", *ray) == [0.0, 0.0]


def test_match_training_refuses_what_it_cannot_make_exact(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    import rlloom.engines.rollout.build as rollout_build

    base = [
        "train",
        "arithmetic_smoke",
        *tiny_args(tiny_checkpoint, tmp_path / "run", "rollout.match_training=true"),
    ]
    assert main([*base, "rollout.temperature=0.7"]) == 2
    assert "rlloom: error: rollout.temperature=0.7" in capsys.readouterr().err
    ray = ["cluster.mode=ray", "cluster.num_workers=2"]
    assert main([*base, *ray, "parallel.tp=2"]) == 2  # into rollout.tp=1: the partial sums differ
    err = capsys.readouterr().err
    assert err.startswith(
        "rlloom: error: rollout.match_training=True is invalid: its exact numerics cover data and expert "
        "parallelism and parallel.tp=2 into rollout.tp=2"
    )
    monkeypatch.setattr(rollout_build, "resolve_device", lambda cfg: torch.device("mps"))
    assert main(base) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlloom: error: rollout.match_training=true is exact on the CPU and on CUDA GPUs")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_exact_tensor_parallelism_refuses_moe_models_in_one_line(tiny_moe_checkpoint, tmp_path, capsys):
    """The rollout splits each expert's width over its tensor-parallel ranks, training runs whole
    experts: parallel.tp=2 is exact for dense models only (parallel.ep=2 for MoE ones)."""
    layout = ["cluster.mode=ray", "cluster.num_workers=2", "parallel.tp=2", "rollout.tp=2"]
    args = tiny_args(tiny_moe_checkpoint, tmp_path / "run", "rollout.match_training=true", *layout)
    assert main(["train", "arithmetic_smoke", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "rlloom: error: rollout.match_training=true covers parallel.tp=2 for dense models only"
    )
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_match_training_on_cuda_takes_moe_models(tiny_checkpoint, tiny_moe_checkpoint, tmp_path, monkeypatch):
    """CUDA has batch-invariant kernels for dense, MoE and MLA models (tests/gpu/test_exact_gpu.py
    runs them); what it needs is Triton: one line before anything loads where it is missing."""
    import rlloom.engines.rollout.build as rollout_build

    monkeypatch.setattr(rollout_build, "resolve_device", lambda cfg: torch.device("cuda", 0))
    for ckpt in (tiny_checkpoint, tiny_moe_checkpoint):
        cfg = tiny_cfg(ckpt, tmp_path / ckpt.name, "rollout.match_training=true")
        if importlib.util.find_spec("triton") is None:  # CPU-only installs
            with pytest.raises(ConfigError, match=r"^rollout.match_training=true needs Triton on CUDA"):
                rollout_build.check_match_training(cfg, {})
        else:
            rollout_build.check_match_training(cfg, {})


def test_match_training_refuses_vision_language_models_in_one_line(tmp_path, capsys):
    from rlloom.models.tiny import write_tiny_model

    ckpt = write_tiny_model("tiny-vl", tmp_path / "vl", seed=0)
    capsys.readouterr()  # the writer's progress bar
    assert (
        main(["train", "arithmetic_smoke", *tiny_args(ckpt, tmp_path / "run", "rollout.match_training=true")])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("rlloom: error: rollout.match_training=true does not cover vision-language models")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_old_logprob_forward_is_skipped(tiny_checkpoint, tmp_path, monkeypatch):
    """Two mini-batches need old logprobs; under match_training they are the rollout's, exactly."""
    from rlloom.cluster.local import LocalTrainGroup

    def no_forward(self, batch):  # noqa: ANN001, ANN202
        raise AssertionError("old-logprob forward under rollout.match_training")

    monkeypatch.setattr(LocalTrainGroup, "old_logprobs", no_forward)
    extra = ["rollout.match_training=true", "trainer.num_mini_batches=2", "trainer.total_steps=1"]
    assert main(["train", "arithmetic_smoke", *tiny_args(tiny_checkpoint, tmp_path / "run", *extra)]) == 0
    with pytest.raises(AssertionError, match="old-logprob forward"):
        main(["train", "arithmetic_smoke", *tiny_args(tiny_checkpoint, tmp_path / "off", *extra[1:])])
