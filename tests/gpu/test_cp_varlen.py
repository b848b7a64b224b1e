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
    out[real.nonzero().squeeze(1).cuda()] = x_N[shard.stream_slot[real].cuda()]
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
