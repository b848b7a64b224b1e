"""LoRA (train.lora_rank) on 2 gloo processes equals the one-process engine in fp32: FSDP (dp=2,
the frozen base weights and the adapters sharded in the same units; also gathered once a step),
context parallelism (cp=2) and tensor parallelism (tp=2: A replicated and B sharded beside a
column-parallel weight, A sharded and B replicated beside a row-parallel one). With bf16 compute (as on GPUs) the frozen base is sharded in bf16
beside fp32 adapters in the same FSDP units and equals the one-process bf16 engine.
Two steps (the first moves only B, which starts at zero; the second A too), then the logprobs and
the adapters' gradients of a third batch, the adapters, and the merged weights the weight sync
and the Hugging Face export read (`named_weights`)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "train"))
from parallel_helpers import run_gloo, tiny_model  # noqa: E402
from test_train_parallel_gloo import MODE, TOL, WEIGHT_TOL, batches, cfg  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from train_engine_helpers import PolicyLoss  # noqa: E402

from rlloom.algorithms.losses import loss_normalizer  # noqa: E402
from rlloom.engines.train.native import NativeTrainEngine  # noqa: E402
from rlloom.parallel import ParallelDims  # noqa: E402

LAYOUTS = {  # (degrees, engine settings)
    "dp=2": (dict(world_size=2), {}),
    "dp=2 gathered once a step": (dict(world_size=2), {"gather_once_per_step": True}),
    "cp=2": (dict(world_size=2, cp=2), {}),
    # the adapters laid out like their column- and row-parallel weights (parallel/tp.py)
    "tp=2": (dict(world_size=2, tp=2), {}),
    # each stage's adapted weights merged where they live, then broadcast to every pp rank
    "pp=2": (dict(world_size=2, pp=2), {"max_tokens_per_micro_batch": 128}),  # PP pads to the budget
}


def adapter_grads(engine: NativeTrainEngine) -> dict[str, torch.Tensor]:
    """The gradients there are (the adapters': the base is frozen), as full tensors."""
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        for name, p in engine.module.named_parameters()
        if p.grad is not None
    }


def run(
    dims: ParallelDims | None, dtype: torch.dtype = torch.float32, family: str = "qwen3", **settings
) -> dict:
    config = dataclasses.replace(cfg(), share_prompts=False, lora_rank=4, lora_alpha=8.0, lr=3e-2, **settings)
    engine = NativeTrainEngine(config, tiny_model(family), parallel_dims=dims, dtype=dtype)
    stored = {(p.dtype, p.requires_grad) for p in engine.module.parameters()}
    data = batches(False)
    metrics = []
    for batch in data[:2]:
        normalizer = loss_normalizer(batch.response_mask(), MODE)
        m = engine.train_step(batch, PolicyLoss(batch, MODE), loss_normalizer=normalizer)
        metrics.append({k: m[k] for k in ("train/loss", "train/grad_norm")})
    logp, _ = engine.forward_logprobs(data[2])
    normalizer = loss_normalizer(data[2].response_mask(), MODE)
    engine.forward_backward(data[2], PolicyLoss(data[2], MODE), loss_normalizer=normalizer)
    return {
        "metrics": metrics,
        "logp": logp,
        "grads": adapter_grads(engine),
        "exported": {n: t.clone() for bucket in engine.named_weights() for n, t in bucket},
        "stored": stored,
        # what each rank sends a rollout pool of its own (separate placement): its TP shards
        "owned": {n: t.clone() for bucket in engine.named_weights(owned_only=True) for n, t in bucket},
        "layouts": engine.weight_layouts(),
    }


def worker(rank: int, expected: dict, expected_bf16: dict) -> None:
    # bf16 compute: the frozen base stored in bf16 (2 bytes a parameter, no fp32 master), the
    # adapters' fp32 masters beside it in the same FSDP units
    got = run(ParallelDims(world_size=2), torch.bfloat16)
    assert got["stored"] == expected_bf16["stored"] == {(torch.bfloat16, False), (torch.float32, True)}
    for a, b in zip(got["metrics"], expected_bf16["metrics"]):
        for k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-3), ("bf16", k)
    for name, weight in expected_bf16["exported"].items():
        torch.testing.assert_close(got["exported"][name], weight, atol=2e-2, rtol=0, msg=f"bf16 {name}")
    for what, (dims, settings) in LAYOUTS.items():
        check(what, run(ParallelDims(**dims), **settings), expected, rank)


def check(what: str, got: dict, expected: dict, rank: int) -> None:
    """`got` (a layout's `run`) equals the one-process `expected`; each rank's owner-only export
    holds its share of the merged weights: its TP shards, its experts."""
    for i, (a, b) in enumerate(zip(got["metrics"], expected["metrics"])):
        for k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (what, i, k)
    torch.testing.assert_close(got["logp"], expected["logp"], **TOL, msg=f"{what} logp")
    # under PP a rank holds its stages' adapters only
    assert got["grads"].keys() == expected["grads"].keys() or what.startswith("pp")
    assert got["grads"] and got["grads"].keys() <= expected["grads"].keys()
    for name, grad in got["grads"].items():
        # gradients of ~10 per element after two steps at lr 3e-2: a relative tolerance
        want = expected["grads"][name]
        torch.testing.assert_close(grad, want, atol=1e-4, rtol=1e-4, msg=f"{what} grad {name}")
    assert got["exported"].keys() == expected["exported"].keys()
    layouts = got["layouts"]
    assert got["owned"].keys() == {n for n, lay in layouts.items() if lay.ep_rank in (None, rank)}
    for name, weight in expected["exported"].items():
        torch.testing.assert_close(got["exported"][name], weight, **WEIGHT_TOL, msg=f"{what} {name}")
        if name in got["owned"]:
            shard = layouts[name].tp_shard  # the merged weight keeps W's layout
            part = weight if shard is None else torch.chunk(weight, shard[1], shard[0])[rank]
            torch.testing.assert_close(got["owned"][name], part, **WEIGHT_TOL, msg=f"{what} owned {name}")


def ep_worker(rank: int, expected: dict) -> None:
    check("ep=2", run(ParallelDims(world_size=2, ep=2), family="qwen3_moe"), expected, rank)


def test_lora_under_fsdp_and_cp_equals_one_process():
    expected = run(None)
    # the owner-only sync (separate placement) describes exactly what named_weights yields: no adapters
    layouts = NativeTrainEngine(dataclasses.replace(cfg(), lora_rank=4), tiny_model("qwen3")).weight_layouts()
    assert layouts.keys() == expected["exported"].keys()
    assert set(expected["grads"]) == {n for n in expected["grads"] if "lora_" in n}  # adapters only
    assert len(expected["grads"]) == 2 * 7 * 2
    run_gloo(worker, 2, expected, run(None, torch.bfloat16))


def test_lora_under_expert_parallelism_equals_one_process():
    """ep=2 on a tiny Qwen3-MoE: the routed experts, split over the two ranks, stay frozen (no
    adapters); each rank's owner-only export holds its experts."""
    expected = run(None, family="qwen3_moe")
    assert expected["grads"] and all("lora_" in n for n in expected["grads"])
    run_gloo(ep_worker, 2, expected)
