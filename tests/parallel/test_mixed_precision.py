"""One device below fp32 without FSDP (`parallel.mixed_precision`): compute copies stand in for the
fp32 masters inside `computing()`, their gradients accumulate into the masters' fp32 `.grad`, and an
engine built this way trains bit for bit like FSDP2 at world size 1 (which it replaces there, unless
the optimizer is offloaded)."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from procs import spawn
from torch import nn

from rlloom.algorithms.losses import loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.models import from_pretrained
from rlloom.parallel.mixed_precision import ComputeCopies, accumulate_grad_

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "train"))
from train_engine_helpers import PolicyLoss, make_batch  # noqa: E402

MODE = "seq-mean-token-sum"


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # one parameter, two modules

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def test_copies_stand_in_and_gradients_accumulate_in_fp32():
    torch.manual_seed(0)
    model = Tied()
    masters = dict(model.named_parameters())
    reference = copy.deepcopy(model).to(torch.bfloat16)  # what the copies compute
    copies = ComputeCopies(model, torch.bfloat16)
    inputs = [torch.randint(0, 11, (5,)) for _ in range(3)]
    expected = {name: torch.zeros_like(p) for name, p in masters.items()}
    for ids in inputs:
        reference.zero_grad()
        reference(ids).float().square().mean().backward()
        for name, p in reference.named_parameters():
            expected[name] += p.grad.float()
    with copies.computing():
        assert model.head.weight is model.embed.weight  # still tied, to one copy
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        for ids in inputs:
            model(ids).float().square().mean().backward()
    assert dict(model.named_parameters()) == masters  # the masters are back, the same objects
    for name, p in masters.items():
        assert p.dtype == torch.float32
        assert torch.equal(p.grad, expected[name]), name
    assert all(c.numel() == 0 and c.grad is None for _, c, _ in copies._entries)  # copies freed


def test_accumulate_equals_the_fp32_sum():
    acc = nn.Parameter(torch.randn(37))
    g1, g2 = torch.randn(37).bfloat16(), torch.randn(37).bfloat16()
    accumulate_grad_(acc, g1)
    accumulate_grad_(acc, g2)
    assert acc.grad.dtype == torch.float32
    assert torch.equal(acc.grad, g1.float() + g2.float())


def _load(path: str) -> nn.Module:
    return from_pretrained(path, dtype=torch.float32, device="cpu")


def _cfg(gather_once: bool) -> TrainEngineConfig:
    # lr high enough that the second and third steps see different samples' logprobs.
    return TrainEngineConfig(
        lr=1e-2, grad_clip=1.0, max_tokens_per_micro_batch=40, gather_once_per_step=gather_once
    )


def _run(engine: NativeTrainEngine) -> tuple[list[float], torch.Tensor, dict[str, torch.Tensor]]:
    losses = []
    for seed in (1, 2, 3):
        batch = make_batch(6, seed=seed)
        loss = PolicyLoss(batch, MODE)
        m = engine.train_step(batch, loss, loss_normalizer=loss_normalizer(batch.response_mask(), MODE))
        assert m["train/num_micro_batches"] > 1
        losses.append(m["train/loss"])
    logp, _ = engine.forward_logprobs(make_batch(4, seed=9))
    weights = {name: t.clone() for bucket in engine.named_weights() for name, t in bucket}
    return losses, logp, weights


def fsdp_worker(rank: int, ckpt: str, expected: dict) -> None:
    from rlloom.parallel import ParallelDims

    try:
        # A run that offloads its optimizer saves GPU memory: FSDP2 on its one rank (one layer's
        # bf16 copies at a time), not the copies of the whole model.
        offloading = dataclasses.replace(_cfg(False), optimizer_offload=True, optimizer_offload_fraction=0.5)
        assert NativeTrainEngine(offloading, _load(ckpt), dtype=torch.bfloat16).sharded
        # A frozen reference (weights in bf16, no masters): the same logprobs unsharded and under FSDP.
        reference = NativeTrainEngine(
            _cfg(False),
            _load(ckpt),
            dtype=torch.bfloat16,
            parallel_dims=ParallelDims(world_size=1),
            frozen=True,
        )
        assert torch.equal(reference.forward_logprobs(make_batch(4, seed=9))[0], expected["reference_logp"])
        for gather_once in (False, True):
            engine = NativeTrainEngine(
                _cfg(gather_once), _load(ckpt), dtype=torch.bfloat16,
                parallel_dims=ParallelDims(world_size=1),
            )  # fmt: skip
            assert engine.sharded
            losses, logp, weights = _run(engine)
            assert losses == expected["losses"]
            assert torch.equal(logp, expected["logp"])
            for name, t in weights.items():
                assert torch.equal(t, expected["weights"][name]), name
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_one_device_bf16_trains_like_fsdp_at_world_size_one(tiny_moe_checkpoint):
    # A tiny Qwen3-MoE in bf16 on the CPU, three steps of several micro-batches: the unsharded engine
    # on compute copies and FSDP2 on one rank (per micro-batch, and gathered once per step) give the
    # same losses, logprobs and fp32 weights bit for bit; a frozen bf16 reference the same logprobs.
    torch.manual_seed(0)
    engine = NativeTrainEngine(_cfg(False), _load(str(tiny_moe_checkpoint)), dtype=torch.bfloat16)
    assert not engine.sharded and not dist.is_initialized()
    losses, logp, weights = _run(engine)
    assert all(t.dtype == torch.float32 for t in weights.values())
    reference = NativeTrainEngine(
        _cfg(False), _load(str(tiny_moe_checkpoint)), dtype=torch.bfloat16, frozen=True
    )
    assert not reference.sharded
    expected = {"losses": losses, "logp": logp, "weights": weights}
    expected["reference_logp"] = reference.forward_logprobs(make_batch(4, seed=9))[0]
    spawn(fsdp_worker, args=(str(tiny_moe_checkpoint), expected))
