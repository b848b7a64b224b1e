"""Exact numerics (rollout.match_training) under training's tensor parallelism, on 2 gloo processes:
DTensor splits each sharded op into local ops before they reach the mode, so on CUDA its Triton
kernels get plain tensors: never a DTensor (a kernel would read the whole-tensor shape of a shard)
nor the FakeTensors DTensor propagates shapes with (no memory to read). The CPU stands in for CUDA:
the mode is told it runs the kernels, which are the CPU's tree sums behind a type check."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from parallel_helpers import packed_inputs, run_gloo, tiny_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from rlloom.models import exact
from rlloom.parallel.tp import apply_tp


def _plain_only(fn, seen: list[type]):  # noqa: ANN001, ANN202
    def kernel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.extend(type(a) for a in args if isinstance(a, torch.Tensor))
        return fn(*args, **kwargs)

    return kernel


def _sdpa_on_the_cpu(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
    if func is F.scaled_dot_product_attention:  # on CUDA attention_ops routes it; here the CPU's
        return exact.exact_attention(*args, **(kwargs or {}))
    return func(*args, **(kwargs or {}))


def kernels_worker(rank: int) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    inputs = packed_inputs([5, 9, 2], vocab=64)
    ref = tiny_model("qwen3")
    model = apply_tp(copy.deepcopy(ref), mesh)
    seen: list[type] = []
    cpu = exact._CPU
    exact._cuda = lambda: exact._Numerics(*(_plain_only(f, seen) for f in (cpu.mm, cpu.sum_last)),
                                          _plain_only(cpu.logsumexp_last, seen), cpu.exp)  # fmt: skip
    exact.uses_kernels = lambda x: True
    exact._ExactAttention.__torch_function__ = _sdpa_on_the_cpu
    with torch.no_grad(), exact.exact_numerics():  # first: DTensor caches the shapes it propagates
        hidden = model.hidden_states(**inputs)
    exact.uses_kernels = lambda x: x.is_cuda
    with torch.no_grad(), exact.exact_numerics():
        on_cpu = model.hidden_states(**inputs).full_tensor()
    assert isinstance(hidden, DTensor) and seen
    assert set(seen) <= {torch.Tensor, torch.nn.Parameter}, set(seen)
    # the "CUDA" path takes torch's elementwise kernels where the CPU's evaluates them in float64
    torch.testing.assert_close(hidden.full_tensor(), on_cpu, rtol=1e-5, atol=1e-6)


def test_exact_kernels_under_tensor_parallelism_get_plain_local_tensors():
    run_gloo(kernels_worker, 2)
