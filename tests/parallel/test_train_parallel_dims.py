"""ParallelDims validation and meshes (at world 256 on a fake process group), activation-checkpoint wrapping and the global gradient norm."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rlloom.models.args import ModelArgs, MoEArgs, RopeArgs
from rlloom.parallel import ParallelDims, apply_ac, clip_grad_norm_


def test_parallel_dims_infers_and_validates():
    assert ParallelDims(world_size=8).dp_shard == 8
    dims = ParallelDims(world_size=8, dp_replicate=2, tp=2)
    assert dims.dp_shard == 2 and dims.dp_size == 4 and dims.dp_enabled
    assert dims.degrees() == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2, "ep": 1}
    dims = ParallelDims(world_size=16, tp=2, cp=2, ep=8)  # ep borrows dp_shard 4 x cp 2 x tp 2 = 16
    assert (dims.dp_shard, dims.fsdp_size, dims.ep_pool, dims.efsdp) == (4, 8, 16, 2)
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by .* = 3.*Fix: use 9 workers"):
        ParallelDims(world_size=8, tp=3)
    with pytest.raises(ValueError, match="multiply to 2, not the world size 4"):
        ParallelDims(world_size=4, dp_shard=2)
    with pytest.raises(ValueError, match=r"parallel.tp=0 is invalid"):
        ParallelDims(world_size=2, tp=0)
    with pytest.raises(ValueError, match=r"parallel.ep=3 does not divide dp_shard x cp x tp = 2 x 1 x 2 = 4"):
        ParallelDims(world_size=8, pp=2, tp=2, ep=3)
    with pytest.raises(ValueError, match="build_mesh"):
        _ = ParallelDims(world_size=1).mesh


def _args(**overrides) -> ModelArgs:
    base = dict(
        model_type="qwen3_moe",
        vocab_size=96,
        hidden_size=32,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        intermediate_size=48,
        rope=RopeArgs(dim=8),
        moe=MoEArgs(num_experts=8, top_k=2, intermediate_size=16, sparse_layers=(1, 2, 3)),
    )
    return ModelArgs(**{**base, **overrides})


def test_check_model_names_the_shape_and_every_factor():
    ParallelDims(world_size=8, tp=4, ep=8).check_model(_args())
    cases = [
        (dict(tp=8), {}, r"parallel.tp=8 does not divide the model's num_key_value_heads=4"),
        (dict(tp=2), dict(vocab_size=97), r"vocab_size=97"),
        (dict(tp=4), dict(num_heads=6, num_kv_heads=6), r"num_attention_heads=6"),
        (dict(tp=2), dict(moe=None, intermediate_size=33), r"intermediate_size=33"),
        (dict(ep=16), {}, r"parallel.ep=16 does not divide the model's num_experts=8"),
        (dict(ep=2), dict(moe=None), r"parallel.ep=2 needs a mixture-of-experts model"),
        (dict(pp=8), {}, r"parallel.pp=8 is larger than the model's num_hidden_layers=4"),
    ]
    for degrees, model, message in cases:
        with pytest.raises(ValueError, match=message + r".*Fix: .*\(world=16: pp=.*ep="):
            ParallelDims(world_size=16, **degrees).check_model(_args(**model))


@pytest.fixture
def fake_world():
    """A 256-rank fake process group in this one process (collectives are no-ops); rank 37."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=37, world_size=256)
    try:
        yield 37
    finally:
        dist.destroy_process_group()


def _ranks(mesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


def test_meshes_at_world_256(fake_world):
    # world 256 = pp 2 x dp_replicate 2 x dp_shard 8 x cp 2 x tp 4; ep 16 of dp_shard x cp x tp = 64.
    dims = ParallelDims(world_size=256, pp=2, dp_replicate=2, cp=2, tp=4, ep=16)
    assert (dims.dp_shard, dims.efsdp) == (8, 4)
    dense = dims.build_mesh("cpu")
    assert dense.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert tuple(dense.mesh.shape) == (2, 2, 8, 2, 4)
    rank = fake_world  # 37 = 4 * 8 + 1 * 4 + 1: pp 0, dp_replicate 0, dp_shard 4, cp 1, tp 1
    assert _ranks(dims.tp_mesh()) == [36, 37, 38, 39]
    assert _ranks(dims.cp_mesh()) == [33, 37]
    assert _ranks(dims.pp_mesh()) == [37, 165]
    assert _ranks(dims.mesh["dp_shard"]) == [5 + 8 * i for i in range(8)]
    assert _ranks(dims.dp_mesh()) == [5 + 8 * i for i in range(8)] + [69 + 8 * i for i in range(8)]
    loss = _ranks(dims.loss_mesh())  # every rank with tp rank 1 in pipeline stage 0
    assert loss == [r for r in range(128) if r % 4 == 1] and dims.loss_mesh().size() == 32
    fsdp = dims.dp_shard_mesh()  # HSDP: (dp_replicate 2, dp_shard x cp 16)
    assert fsdp.mesh_dim_names == ("dp_replicate", "fsdp") and tuple(fsdp.mesh.shape) == (2, 16)
    assert _ranks(fsdp["fsdp"]) == [1 + 4 * i for i in range(16)]
    # Sparse view: EP takes the 16 innermost ranks of dp_shard x cp x tp, FSDP of experts the rest.
    sparse = dims.sparse_mesh()
    assert sparse.mesh_dim_names == ("pp", "dp_replicate", "efsdp", "ep")
    assert tuple(sparse.mesh.shape) == (2, 2, 4, 16)
    assert _ranks(dims.ep_mesh()) == list(range(32, 48))
    assert _ranks(dims.efsdp_mesh()["efsdp"]) == [5, 21, 37, 53]
    assert dims.efsdp_mesh().mesh_dim_names == ("dp_replicate", "efsdp")
    assert rank in _ranks(dims.ep_mesh()) and set(_ranks(dims.tp_mesh())) <= set(_ranks(dims.ep_mesh()))


def test_world_mismatch_is_a_clear_error(fake_world):
    with pytest.raises(ValueError, match=r"ParallelDims\(world_size=8\) does not match .* 256"):
        ParallelDims(world_size=8).build_mesh("cpu")


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


def test_clipping_under_max_norm_makes_no_pass(monkeypatch):
    torch.manual_seed(0)
    a = nn.Linear(5, 3)
    (a(torch.randn(4, 5)) ** 2).sum().backward()
    before = [p.grad.clone() for p in a.parameters()]
    calls = []
    real = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *x, **k: calls.append(1) or real(*x, **k))
    norm = clip_grad_norm_(a.parameters(), 1e6)
    assert calls == [] and all(torch.equal(p.grad, b) for p, b in zip(a.parameters(), before))
    clip_grad_norm_(a.parameters(), norm.item() / 2)
    assert calls == [1]
