"""Context parallelism's FlashAttention varlen path (parallel/cp.py) on one GPU: each cp rank's
queries over the gathered keys and values, against per-document causal attention in fp32 over the
whole stream. The gather is done here by hand (a fake process group stands for the cp ranks, whose
collectives do nothing), so one GPU checks every rank's runs. Skipped without a GPU."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Documents cross rank boundaries; one token long; longer than a rank's share (at cp=4).
LENS = [37, 1, 300, 5, 129, 64, 1, 211]


def _reference(q, k, v, lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention within each document, fp32, over the full stream [N, H, D]."""
    reps = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start : start + n].float().transpose(0, 1) for x in (q, k, v))
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        att = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        outs.append(att.transpose(0, 1))
        start += n
    return torch.cat(outs)


def _gathered(shard, x_N: torch.Tensor) -> torch.Tensor:
    """What the cp all-gather builds: every rank's local rows in its slots, padding slots zero."""
    out = x_N.new_zeros(shard.cp * shard.n, *x_N.shape[1:])
    real = shard.stream_slot >= 0
    out[real.nonzero().squeeze(1).to(x_N.device)] = x_N[shard.stream_slot[real].to(x_N.device)]
    return out


@pytest.mark.parametrize(
    "cp, heads, dims", list(itertools.product([2, 4], [(8, 8), (8, 2)], [(64, 64), (96, 64)]))
)
def test_cp_varlen_kernel_matches_per_document_attention(cp, heads, dims):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from rlloom.parallel.cp import CPShard

    (hq, hkv), (dqk, dv) = heads, dims
    n = sum(LENS)
    g = torch.Generator(device="cuda").manual_seed(cp * 100 + hkv + dqk)
    q = torch.randn(n, hq, dqk, device="cuda", generator=g).bfloat16()
    k = torch.randn(n, hkv, dqk, device="cuda", generator=g).bfloat16()
    v = torch.randn(n, hkv, dv, device="cuda", generator=g).bfloat16()
    scale = 1 / math.sqrt(dqk)
    want = _reference(q, k, v, LENS, scale)
    cu = [0, *itertools.accumulate(LENS)]
    covered = torch.zeros(n, dtype=torch.bool)
    for rank in range(cp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
        try:
            shard = CPShard(cu, device="cuda", pad_multiple=2)
            assert shard.use_varlen(q)
            got = shard._varlen_attention(shard.take(q), _gathered(shard, k), _gathered(shard, v), scale)
        finally:
            dist.destroy_process_group()
        mine = shard.index[: shard.num_real].cpu()
        err = (got[: shard.num_real].float() - want[mine.cuda()]).abs().max().item()
        assert err < 2e-2, f"cp={cp} rank {rank}: max error {err}"
        covered[mine] = True
    assert covered.all(), "every stream position is some rank's query"


DEVICE = "cuda"


@pytest.mark.parametrize("cp, heads, dims", [(2, (8, 2), (64, 64)), (4, (8, 8), (96, 64))])
def test_cp_varlen_gradients_match_per_document_attention(cp, heads, dims):
    # The backward too: the runs whose queries start inside a document (fewer queries than keys,
    # causal aligned to the bottom right) are where a kernel's backward could go wrong while its
    # forward is right. Each rank's gradients on the gathered keys and values flow back to their
    # stream rows (what the all-gather's reduce-scatter does); summed over the ranks they must be
    # the whole stream's gradients.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from rlloom.parallel.cp import CPShard

    (hq, hkv), (dqk, dv) = heads, dims
    n = sum(LENS)
    g = torch.Generator(device=DEVICE).manual_seed(cp * 10 + hkv)
    q, k, v = (
        torch.randn(n, h, d, device=DEVICE, generator=g).bfloat16()
        for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv))
    )
    w = torch.randn(n, hq, dv, device=DEVICE, generator=g)
    scale = 1 / math.sqrt(dqk)
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    (_reference(*ref, LENS, scale) * w).sum().backward()
    cu = [0, *itertools.accumulate(LENS)]
    got = [torch.zeros_like(x) for x in ref]
    for rank in range(cp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
        try:
            shard = CPShard(cu, device=DEVICE, pad_multiple=2)
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            out = shard._varlen_attention(
                shard.take(leaves[0]), _gathered(shard, leaves[1]), _gathered(shard, leaves[2]), scale
            )
        finally:
            dist.destroy_process_group()
        mine = shard.index[: shard.num_real].to(DEVICE)
        (out[: shard.num_real].float() * w[mine]).sum().backward()
        for total, leaf in zip(got, leaves):
            total += leaf.grad.float()
    for name, mine_grad, x in zip("qkv", got, ref):
        err = ((mine_grad - x.grad).norm() / x.grad.norm()).item()
        assert err < 2e-2, f"cp={cp} d{name}: relative error {err}"
