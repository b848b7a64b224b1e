"""Two processes with FSDP2 on gloo give the same results as one process on the same global batch:
logprobs, parameters after three steps (shared-prompt groups, uneven micro-batch counts, a rank with
no sample, CPU optimizer offload of sharded parameters), weight export, and a sharded checkpoint round
trip (also loaded into one unsharded process)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from procs import free_port, spawn
from train_engine_helpers import PolicyLoss, load_tiny, make_batch, make_tiny_checkpoint

from rlloom.algorithms.losses import loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.data.types import RolloutBatch, Sample
from rlloom.engines.train.native import NativeTrainEngine

MODE = "seq-mean-token-sum"


def batches() -> list[RolloutBatch]:
    long = Sample(prompt_ids=list(range(40)), response_ids=[5] * 30)  # 70 tokens: a micro-batch of its own
    uneven = RolloutBatch([long, *make_batch(5, seed=11).samples])
    # The first has groups of two sharing a prompt (shared-prompt packing, on by default); the last
    # leaves a rank empty.
    base = make_batch(8, seed=10).samples
    paired = [
        dataclasses.replace(s, prompt_ids=base[i - i % 2].prompt_ids, group_id=i // 2)
        for i, s in enumerate(base)
    ]
    return [RolloutBatch(paired), uneven, make_batch(1, seed=12)]


def cfg(**kwargs) -> TrainEngineConfig:
    return TrainEngineConfig(
        lr=1e-3, weight_decay=0.1, grad_clip=0.5, max_tokens_per_micro_batch=48, **kwargs
    )


def train(engine, batch):
    loss = PolicyLoss(batch, MODE)
    return engine.train_step(batch, loss, loss_normalizer=loss_normalizer(batch.response_mask(), MODE))


def full_weights(engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in engine.named_weights() for name, t in bucket}


def worker(rank: int, port: int, ckpt: str, tmp: str, expected: dict) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2"}
    torch.manual_seed(0)
    try:
        engine = NativeTrainEngine(
            cfg(optimizer_offload=True, optimizer_offload_fraction=0.5), load_tiny(ckpt)
        )
        assert engine.sharded and engine.dp_size == 2 and engine.dp_rank == rank
        logp, _ = engine.forward_logprobs(batches()[0])
        torch.testing.assert_close(logp, expected["logp"], atol=1e-6, rtol=0)
        losses = []
        for i, batch in enumerate(batches()):
            if i == 2:
                engine.save(os.path.join(tmp, "ckpt"))
            losses.append(train(engine, batch)["train/loss"])
        assert torch.allclose(torch.tensor(losses), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6), (
            losses
        )
        after_three = full_weights(engine)
        for name, t in expected["weights"].items():
            torch.testing.assert_close(after_three[name], t, atol=1e-6, rtol=0, msg=name)
        engine.offload()
        engine.onload()
        for name, t in full_weights(engine).items():
            assert torch.equal(t, after_three[name]), name
        engine.load(os.path.join(tmp, "ckpt"))  # back to step 2; redoing step 3 is bit-identical
        assert engine.version == 2
        train(engine, batches()[2])
        for name, t in full_weights(engine).items():
            assert torch.equal(t, after_three[name]), name
        # A rank handed another batch than the others is refused on every rank, not a hang.
        with pytest.raises(ValueError, match="different batches"):
            engine.forward_logprobs(batches()[rank])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_process_fsdp_equals_one_process(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    single = NativeTrainEngine(cfg(), load_tiny(ckpt))
    assert not single.sharded
    logp, _ = single.forward_logprobs(batches()[0])
    losses = [train(single, b)["train/loss"] for b in batches()]
    expected = {"logp": logp, "losses": losses, "weights": full_weights(single)}
    spawn(worker, args=(free_port(), ckpt, str(tmp_path), expected), nprocs=2, join=True)

    # The two ranks' checkpoint (after step 2) loads into one unsharded process; redoing step 3 there
    # gives the weights of the uninterrupted run.
    resharded = NativeTrainEngine(
        cfg(optimizer_offload=True, optimizer_offload_fraction=0.5), load_tiny(ckpt)
    )
    resharded.load(str(tmp_path / "ckpt"))
    assert resharded.version == 2
    train(resharded, batches()[2])
    for name, t in full_weights(resharded).items():
        torch.testing.assert_close(t, expected["weights"][name], atol=1e-6, rtol=0, msg=name)


def gather_once_worker(rank: int, ckpt: str, expected: dict) -> None:
    from rlloom.parallel import ParallelDims

    try:
        for gather_once in (False, True):
            engine = NativeTrainEngine(
                cfg(gather_once_per_step=gather_once),
                load_tiny(ckpt),
                parallel_dims=ParallelDims(world_size=1),
            )
            assert engine.sharded
            metrics = [train(engine, b) for b in batches()]
            assert metrics[1]["train/num_micro_batches"] > 1
            losses = [m["train/loss"] for m in metrics]
            assert torch.allclose(
                torch.tensor(losses), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6
            )
            for name, t in full_weights(engine).items():
                torch.testing.assert_close(t, expected["weights"][name], atol=1e-6, rtol=0, msg=name)
            # FSDP's settings are back to per-micro-batch gathering after the step.
            group = engine.model.layers[0]._get_fsdp_state()._fsdp_param_group
            assert (
                group.reduce_grads
                and group.reshard_after_backward
                and group.post_forward_mesh_info is not None
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_gathering_once_per_step_equals_gathering_per_micro_batch(tmp_path):
    # FSDP on one rank with several micro-batches per step: keeping the layers gathered and the
    # gradients unsharded across micro-batches gives the unsharded engine's losses and weights.
    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    single = NativeTrainEngine(cfg(), load_tiny(ckpt))
    losses = [train(single, b)["train/loss"] for b in batches()]
    spawn(gather_once_worker, args=(ckpt, {"losses": losses, "weights": full_weights(single)}), nprocs=1)
