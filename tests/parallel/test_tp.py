"""Tensor + sequence parallelism on 2 gloo processes equals the one-process model in fp32, for every
model family: logits, every parameter's gradient (in its parameter's layout) and the gradient norm."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from parallel_helpers import packed_inputs, run_gloo, tiny_args, tiny_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from rlloom.parallel import grad_norm
from rlloom.parallel.tp import apply_tp

FAMILIES = ["qwen3", "qwen2", "llama", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v3_nolora"]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(logits: torch.Tensor) -> torch.Tensor:
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    return (logits * weights).mean()


def tp_worker(rank: int, families: list[str]) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    inputs = packed_inputs([5, 9, 2], vocab=64)  # 16 tokens: 8 per rank
    for family in families:
        ref = tiny_model(family)
        model = apply_tp(copy.deepcopy(ref), mesh)
        hidden = model.hidden_states(**inputs)
        assert isinstance(hidden, DTensor) and hidden.placements == (Shard(0),), family  # token shards
        assert hidden.to_local().shape == (8, 32)
        expected = ref(**inputs)
        _loss(expected).backward()
        logits = _full(model(**inputs))
        _loss(logits).backward()
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5, msg=family)
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            grad = param.grad
            if isinstance(param, DTensor):
                assert grad.placements == param.placements, (family, name, grad.placements)
            torch.testing.assert_close(
                _full(grad), ref_params[name].grad, atol=1e-5, rtol=1e-5, msg=f"{family} {name}"
            )
        torch.testing.assert_close(
            grad_norm(model.parameters()), grad_norm(ref.parameters()), rtol=1e-5, atol=0
        )


def test_tp_sp_parity_every_family():
    run_gloo(tp_worker, 2, FAMILIES)


def test_apply_tp_refuses_the_rollout_layout():
    model = tiny_model("qwen3")
    model.args = dataclasses.replace(tiny_args("qwen3"), fused_projections=True)
    with pytest.raises(ValueError, match="fused_projections=True"):
        apply_tp(model, None)
