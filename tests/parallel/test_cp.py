"""Context parallelism on 2 gloo processes equals the one-process run in fp32: the attention alone
(outputs and q/k/v gradients) and whole models (logits and every parameter's gradient), on packed
streams whose documents cross the rank boundary, outgrow a rank's share, or hold a single token."""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist
from parallel_helpers import packed_inputs, run_gloo, tiny_model

from rlloom.models.attention_ops import packed_attention
from rlloom.parallel.cp import CPShard

TOL = dict(atol=1e-5, rtol=1e-5)
# [37, 1, ...]: a document longer than a rank's share, single-token documents; [3]: ranks of
# different token counts (rank 0 holds one token and a pad); pad_multiple=4 pads both ranks.
CASES = [([37, 1, 5, 1, 12, 3], 1), ([3], 1), ([random.Random(7).randint(1, 30) for _ in range(9)], 4)]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _summed(grad: torch.Tensor) -> torch.Tensor:
    """The sum over the cp ranks (each rank's backward covers the loss of the tokens it holds)."""
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad


def attention_worker(rank: int) -> None:
    padded_somewhere = False
    for lengths, pad_multiple in CASES:
        cu, n = _cu(lengths), sum(lengths)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(n, h, 8, generator=g).requires_grad_() for h in (4, 2, 2))  # GQA
        weights = torch.randn(n, 4, 8, generator=g)
        expected = packed_attention(q, k, v, 0.3, cu)
        (expected * weights).sum().backward()
        ref_grads = [x.grad for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None

        shard = CPShard(cu, pad_multiple=pad_multiple)
        padded_somewhere |= shard.num_real < shard.n
        real = shard.index[: shard.num_real]
        out = shard.attn(0, shard.take(q), shard.take(k), shard.take(v), 0.3)
        torch.testing.assert_close(out[: shard.num_real], expected[real].detach(), **TOL)
        torch.testing.assert_close(shard.unshard(out), expected.detach(), **TOL)
        (out[: shard.num_real] * weights[real]).sum().backward()
        for name, x, ref in zip("qkv", (q, k, v), ref_grads):
            torch.testing.assert_close(_summed(x.grad), ref, **TOL, msg=f"{lengths} d{name}")
    assert padded_somewhere


def model_worker(rank: int, families: list[str]) -> None:
    lengths = CASES[0][0]
    inputs = packed_inputs(lengths, vocab=64)
    # A mean over the full stream, as test_tp's loss: gradients of order 1e-2, not 1e2.
    weights = torch.randn(sum(lengths), 64, generator=torch.Generator().manual_seed(3)) / (sum(lengths) * 64)
    shard = CPShard(inputs["cu_seqlens"])
    real = shard.index[: shard.num_real]
    for family in families:
        ref = tiny_model(family)
        model = copy.deepcopy(ref)
        expected = ref(**inputs)
        (expected * weights).sum().backward()

        hidden = model.hidden_states(
            shard.take(inputs["input_ids"]), position_ids=shard.take(inputs["position_ids"]), attn=shard
        )
        logits = hidden @ model.lm_head_weight.T
        torch.testing.assert_close(shard.unshard(logits), expected.detach(), **TOL, msg=family)
        (logits[: shard.num_real] * weights[real]).sum().backward()
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            grad = _summed(param.grad if param.grad is not None else torch.zeros_like(param))
            ref_grad = ref_params[name].grad
            ref_grad = ref_grad if ref_grad is not None else torch.zeros_like(param)
            torch.testing.assert_close(grad, ref_grad, **TOL, msg=f"{family} {name}")


def cp_worker(rank: int, families: list[str]) -> None:
    attention_worker(rank)
    model_worker(rank, families)


def test_cp_attention_and_models_equal_one_process():
    """One spawn for both parts (starting the processes costs more than the checks)."""
    run_gloo(cp_worker, 2, ["qwen3", "deepseek_v3"])
