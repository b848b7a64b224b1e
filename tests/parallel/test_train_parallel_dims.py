"""ParallelDims validation, activation-checkpoint wrapping and the global gradient norm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlloom.parallel import ParallelDims, apply_ac, clip_grad_norm_


def test_parallel_dims_infers_and_validates():
    assert ParallelDims(world_size=8).dp_shard == 8
    dims = ParallelDims(world_size=8, dp_replicate=2, tp=2)
    assert dims.dp_shard == 2 and dims.dp_size == 4 and dims.dp_enabled
    assert dims.degrees() == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    with pytest.raises(ValueError, match="= 3.*divides"):
        ParallelDims(world_size=8, tp=3)
    with pytest.raises(ValueError, match="dp_shard 2 \\* cp 1 \\* tp 1 = 2, but world_size=4"):
        ParallelDims(world_size=4, dp_shard=2)
    with pytest.raises(ValueError, match="tp=0"):
        ParallelDims(world_size=2, tp=0)
    with pytest.raises(ValueError, match="build_mesh"):
        _ = ParallelDims(world_size=1).mesh


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(5))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize(("mode", "k", "wrapped"), [("off", 1, 0), ("full", 1, 5), ("every_k", 2, 3)])
def test_apply_ac(mode, k, wrapped):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 4)
    state = {k_: v.clone() for k_, v in model.state_dict().items()}
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert apply_ac(model, mode, k) == wrapped
    assert model.state_dict().keys() == state.keys()  # checkpoint names unchanged
    model(x).sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g)
    with pytest.raises(ValueError, match="activation_checkpointing='some'"):
        apply_ac(model, "some")
    with pytest.raises(ValueError, match="no `layers`"):
        apply_ac(nn.Linear(2, 2), "full")


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    a, b = nn.Linear(5, 3), nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 5)
    for m in (a, b):
        (m(x) ** 2).sum().backward()
    ours = clip_grad_norm_(a.parameters(), 0.1)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    torch.testing.assert_close(ours, theirs)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    a.weight.grad[0, 0] = float("inf")
    before = a.bias.grad.clone()
    assert not torch.isfinite(clip_grad_norm_(a.parameters(), 0.1))
    assert torch.equal(a.bias.grad, before)  # a non-finite norm leaves gradients alone
