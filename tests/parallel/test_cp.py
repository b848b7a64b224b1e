"""Context parallelism on 2 gloo processes equals the one-process run in fp32: the attention alone
(outputs and q/k/v gradients) and whole models (logits, logprobs through `gather_selected` with a
sequence-level loss, every parameter's gradient), on packed streams whose documents cross the rank
boundary, outgrow a rank's share, or hold a single token. Each runs with the CPU reference kernel
and with the varlen runs the CUDA path builds, fed to a CPU stand-in of FlashAttention varlen."""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_helpers import packed_inputs, run_gloo, tiny_model

from rlloom.models.attention_ops import packed_attention
from rlloom.models.logprobs import token_logprobs
from rlloom.parallel import cp
from rlloom.parallel.cp import CPShard
from rlloom.parallel.distributed import all_gather_rows

TOL = dict(atol=1e-5, rtol=1e-5)
# [37, 1, ...]: a document longer than a rank's share, single-token documents; [3]: ranks of
# different token counts (rank 0 holds one token, its K/V block is padded); pad_multiple=4 (as
# under sequence parallelism) puts pad tokens into the local streams.
CASES = [([37, 1, 5, 1, 12, 3], 1), ([3], 1), ([random.Random(7).randint(1, 30) for _ in range(9)], 4)]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _summed(grad: torch.Tensor) -> torch.Tensor:
    """The sum over the cp ranks (each rank's backward covers the loss of the tokens it holds)."""
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad


def _varlen_on_cpu(q, k, v, scale, cu_q, cu_k, max_q, max_k):  # noqa: ANN001, ANN202
    """FlashAttention varlen's semantics: run u's queries are the last of its keys (causal aligned to
    the bottom right)."""
    assert v.shape[-1] == q.shape[-1], "the kernel takes one head width"
    outs = []
    for u in range(len(cu_q) - 1):
        qu, ku, vu = q[cu_q[u] : cu_q[u + 1]], k[cu_k[u] : cu_k[u + 1]], v[cu_k[u] : cu_k[u + 1]]
        assert len(qu) <= max_q and len(ku) <= max_k
        mask = torch.ones(len(qu), len(ku), dtype=torch.bool).tril(diagonal=len(ku) - len(qu))
        out = F.scaled_dot_product_attention(
            *(x.transpose(0, 1) for x in (qu, ku, vu)), attn_mask=mask, scale=scale, enable_gqa=True
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def _use_kernel(kernel: str) -> None:
    varlen = kernel == "varlen"
    CPShard.use_varlen = lambda self, q: varlen
    cp.varlen_causal = _varlen_on_cpu


def attention_worker(kernel: str) -> None:
    gather_padded = model_padded = False
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
        gather_padded |= shard.local_len < shard.n
        model_padded |= shard.num_real < shard.local_len
        real = shard.index[: shard.num_real]
        out = shard.attn(shard.take(q), shard.take(k), shard.take(v), 0.3)
        assert out.isfinite().all()  # pads included
        torch.testing.assert_close(out[: shard.num_real], expected[real].detach(), **TOL)
        torch.testing.assert_close(shard.unshard(out), expected.detach(), **TOL)
        (out[: shard.num_real] * weights[real]).sum().backward()
        for name, x, ref in zip("qkv", (q, k, v), ref_grads):
            torch.testing.assert_close(_summed(x.grad), ref, **TOL, msg=f"{kernel} {lengths} d{name}")
    assert gather_padded and model_padded


def _sequence_loss(logp_K: torch.Tensor, doc_K: torch.Tensor, num_docs: int) -> torch.Tensor:
    """A sequence-level loss (as GSPO's): it needs every token of a sequence, wherever it was computed."""
    means = torch.zeros(num_docs).index_add(0, doc_K, logp_K) / torch.bincount(
        doc_K, minlength=num_docs
    ).clamp(min=1)
    return (means**2).sum()


def model_worker(kernel: str, families: list[str]) -> None:
    lengths = CASES[0][0]
    n, num_docs = sum(lengths), len(lengths)
    inputs = packed_inputs(lengths, vocab=64)
    # A mean over the full stream, as test_tp's loss: gradients of order 1e-2, not 1e2.
    weights = torch.randn(n, 64, generator=torch.Generator().manual_seed(3)) / (n * 64)
    doc_N = torch.repeat_interleave(torch.arange(num_docs), torch.tensor(lengths))
    positions_K = torch.arange(n)[
        torch.cat([doc_N[1:] == doc_N[:-1], torch.tensor([False])])
    ]  # not a last token
    targets_K, doc_K = inputs["input_ids"][positions_K + 1], doc_N[positions_K]
    shard = CPShard(inputs["cu_seqlens"])
    real = shard.index[: shard.num_real]
    mine_K, local_K = shard.localize(positions_K)
    for family in families:
        ref = tiny_model(family)
        model = copy.deepcopy(ref)
        hidden = ref.hidden_states(**inputs)
        expected = hidden @ ref.lm_head_weight.T
        expected_logp, _ = token_logprobs(hidden[positions_K], ref.lm_head_weight, targets_K)
        ((expected * weights).sum() + _sequence_loss(expected_logp, doc_K, num_docs)).backward()

        hidden = model.hidden_states(
            shard.take(inputs["input_ids"]), position_ids=shard.take(inputs["position_ids"]), attn=shard
        )
        logits = hidden @ model.lm_head_weight.T
        logp_k, _ = token_logprobs(hidden[local_K[mine_K]], model.lm_head_weight, targets_K[mine_K])
        logp_K = shard.gather_selected(logp_k, mine_K)
        msg = f"{kernel} {family}"
        torch.testing.assert_close(shard.unshard(logits), expected.detach(), **TOL, msg=msg)
        torch.testing.assert_close(logp_K, expected_logp.detach(), **TOL, msg=msg)
        (
            (logits[: shard.num_real] * weights[real]).sum() + _sequence_loss(logp_K, doc_K, num_docs)
        ).backward()
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            grad = _summed(param.grad if param.grad is not None else torch.zeros_like(param))
            ref_grad = ref_params[name].grad
            ref_grad = ref_grad if ref_grad is not None else torch.zeros_like(param)
            # atol scaled to the tensor: wv's gradient reaches 33, where fp32 summation order alone
            # (torch 2.11 against 2.13) moves an element by 1.1e-5
            scale = max(1.0, ref_grad.abs().max().item())
            torch.testing.assert_close(
                grad, ref_grad, atol=TOL["atol"] * scale, rtol=TOL["rtol"], msg=f"{msg} {name}"
            )


def all_gather_rows_worker(rank: int) -> None:
    """The K/V all-gather's custom op: the gathered rows in rank order, each rank's gradient the sum
    over ranks of its rows' (every rank weights them differently here), and torch's op checks
    (schema, fake shapes, autograd registration, tracing): the fake's gathered size must be the
    group's, or compiled layers are built for another layout."""
    world, group = dist.get_world_size(), dist.group.WORLD
    x = torch.arange(6.0).reshape(3, 2).add(10 * rank).requires_grad_()
    gathered = all_gather_rows(x, group)
    want = torch.cat([torch.arange(6.0).reshape(3, 2) + 10 * r for r in range(world)])
    torch.testing.assert_close(gathered, want)
    weights = torch.arange(float(world * 6)).reshape(world * 3, 2) * (rank + 1)
    (gathered * weights).sum().backward()
    per_rank_sum = sum(r + 1 for r in range(world))
    torch.testing.assert_close(
        x.grad, torch.arange(float(world * 6)).reshape(world * 3, 2)[3 * rank : 3 * rank + 3] * per_rank_sum
    )
    op = torch.ops.rlloom.all_gather_rows.default
    torch.library.opcheck(op, (torch.randn(3, 2, requires_grad=True), world, group.group_name))


def cp_worker(rank: int, families: list[str]) -> None:
    all_gather_rows_worker(rank)
    for kernel in ("reference", "varlen"):
        _use_kernel(kernel)
        attention_worker(kernel)
        model_worker(kernel, families)


def test_cp_attention_and_models_equal_one_process():
    """One spawn for every part (starting the processes costs more than the checks)."""
    run_gloo(cp_worker, 2, ["qwen3", "deepseek_v3"])
