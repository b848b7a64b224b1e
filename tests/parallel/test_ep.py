"""Expert parallelism on 2 gloo processes equals the one-process MoE layer over both ranks' tokens:
outputs, token counts, and gradients of the local experts, the router, shared experts and inputs;
with skewed routing (uneven all-to-all splits, an expert no token chooses) and uneven token counts.
Then EP borrowing the TP ranks (tp=2, ep=2 on the same two ranks) on whole Qwen3-MoE and
DeepSeek-V3 models equals the one-process model: logits and every gradient. Last, `parallelize`
(TP -> EP -> activation checkpointing -> FSDP) with ep=2 over the data-parallel ranks, and with
tp=2 x ep=2, gives the gradients of one process over the data-parallel ranks' batches."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from parallel_helpers import packed_inputs, run_gloo, tiny_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from rlloom.models.args import MoEArgs
from rlloom.models.moe import MoE
from rlloom.parallel import ParallelDims, apply_ep, apply_tp
from rlloom.parallel.parallelize import parallelize

TOKENS = (7, 4)  # tokens on rank 0 and rank 1
SOFTMAX = MoEArgs(num_experts=6, top_k=2, intermediate_size=8, norm_topk_prob=True)
SIGMOID = MoEArgs(
    num_experts=8, top_k=3, intermediate_size=8, score_func="sigmoid", num_groups=4, topk_groups=2,
    routed_scaling_factor=2.5, score_bias=True, num_shared_experts=1,
)  # fmt: skip
ALL_ON_RANK_0 = MoEArgs(num_experts=4, top_k=2, intermediate_size=8)  # rank 1's experts get nothing


def skewed_moe(args: MoEArgs) -> MoE:
    """With positive inputs, expert 0 (experts 0 and 1 with 4 experts) wins most tokens and the last
    expert never wins."""
    torch.manual_seed(0)
    moe = MoE(16, args)
    with torch.no_grad():
        gate = moe.router.gate.weight
        gate.normal_(std=0.3)
        gate[: 2 if args.num_experts == 4 else 1] += 0.5
        gate[-1] = -1.0
        if moe.router.expert_bias is not None:
            moe.router.expert_bias.uniform_(-0.1, 0.1)
    return moe


def check_layer(rank: int, mesh, args: MoEArgs) -> None:
    ref = skewed_moe(args)
    model = copy.deepcopy(ref)
    assert apply_ep(model, mesh) == 1
    per_rank = args.num_experts // 2
    start = rank * per_rank
    assert model.experts.ep_range == (start, start + per_rank) and model.experts.w1.shape[0] == per_rank
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 16, generator=g).abs() for n in TOKENS]
    out_weights = [torch.randn(n, 16, generator=g) for n in TOKENS]
    x_all = torch.cat(xs).requires_grad_()
    out_all = ref(x_all)
    sum((o * w).sum() for o, w in zip(out_all.split(TOKENS), out_weights)).backward()
    ref_counts = ref.last_token_counts
    half = args.num_experts // 2
    assert (
        ref_counts[-1] == 0 and ref_counts[:half].sum() > ref_counts[half:].sum()
    )  # skewed, one expert idle
    assert (ref_counts[half:].sum() == 0) == (args is ALL_ON_RANK_0)

    x = xs[rank].clone().requires_grad_()
    out = model(x)
    (out * out_weights[rank]).sum().backward()
    mine = slice(sum(TOKENS[:rank]), sum(TOKENS[: rank + 1]))
    torch.testing.assert_close(out, out_all[mine], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, x_all.grad[mine], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        model.last_token_counts, torch.bincount(ref_routes(ref, xs[rank]), minlength=args.num_experts)
    )
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name  # zero, not None, for experts no token reached
        grad = param.grad
        if name.startswith("experts."):  # local experts: complete already
            expected = ref_params[name].grad[start : start + per_rank]
        else:  # replicated weights: the data-parallel sum over the EP ranks
            dist.all_reduce(grad)
            expected = ref_params[name].grad
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5, msg=name)


def ref_routes(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return moe.router(x)[1].flatten()


def check_tp_ep_model(dims: ParallelDims, family: str) -> None:
    """EP borrowing the TP ranks on a whole model: each TP rank routes its own token shard."""
    inputs = packed_inputs([5, 9, 2], vocab=64)
    ref = tiny_model(family)
    model = apply_tp(copy.deepcopy(ref), dims.tp_mesh(), experts_parallel=True)
    assert apply_ep(model, dims.ep_mesh()) == 1
    expected = ref(**inputs)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3))
    (expected * weights).mean().backward()
    logits = model(**inputs).full_tensor()
    (logits * weights).mean().backward()
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5, msg=family)
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        expected_grad = ref_params[name].grad
        if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            start, end = dict(model.named_modules())[name.rsplit(".", 1)[0]].ep_range
            expected_grad = expected_grad[start:end]
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5, msg=f"{family} {name}")


def check_parallelize(dims: ParallelDims, family: str, param_dtype: torch.dtype = torch.float32) -> None:
    """`parallelize` (TP -> EP -> activation checkpointing -> FSDP) with each data-parallel rank on
    its own batch gives the gradients of one process over all the batches (in bf16 compute: within
    bf16's error; there FSDP once cast the experts' fp32 routing weights in the forward but not in
    the checkpoint's recompute, a CheckpointError)."""
    dims.build_mesh("cpu")
    batches = [packed_inputs([5, 9, 2], vocab=64, seed=1), packed_inputs([8, 8], vocab=64, seed=2)]
    weights = [torch.randn(16, 64, generator=torch.Generator().manual_seed(3 + i)) for i in range(2)]
    ref = tiny_model(family)
    for inputs, w in list(zip(batches, weights))[: dims.dp_size]:
        (ref(**inputs) * w).mean().backward()
    model = copy.deepcopy(ref)
    parallelize(model, dims, param_dtype=param_dtype, ac_mode="full")
    dp_rank = dims.dp_mesh().get_local_rank()
    logits = model(**batches[dp_rank])
    (_full(logits) * weights[dp_rank]).mean().backward()
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        expected = ref_params[name].grad
        if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            per_rank = expected.shape[0] // dims.ep
            start = dims.ep_mesh().get_local_rank() * per_rank
            expected = expected[start : start + per_rank]
        if param_dtype == torch.float32:
            torch.testing.assert_close(
                _full(param.grad), expected, atol=1e-5, rtol=1e-5, msg=f"{dims} {name}"
            )
        else:
            error = (_full(param.grad) - expected).norm() / expected.norm().clamp(min=1e-6)
            assert error < 0.05, (dims, name, float(error))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def worker(rank: int) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    for args in (SOFTMAX, SIGMOID, ALL_ON_RANK_0):
        check_layer(rank, mesh, args)
    dims = ParallelDims(world_size=2, tp=2, ep=2)
    dims.build_mesh("cpu")
    for family in ("qwen3_moe", "deepseek_v3"):
        check_tp_ep_model(dims, family)
    check_parallelize(ParallelDims(world_size=2, ep=2), "qwen3_moe")  # EP over the 2 data-parallel ranks
    check_parallelize(ParallelDims(world_size=2, tp=2, ep=2), "qwen3_moe")  # EP borrows the TP ranks
    check_parallelize(ParallelDims(world_size=2, ep=2), "qwen3_moe", torch.bfloat16)


def test_ep_parity_with_skewed_routing_and_with_tp():
    run_gloo(worker, 2)
