"""rlloom/models/exact.py: each batch-invariant op against torch's (values within rounding) and
against itself under another batch composition: other rows, another position, padded keys, masked
keys in the middle (bitwise)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlloom.models.exact import exact_numerics, tree_sum

G = torch.Generator().manual_seed(0)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G)


def test_tree_sum_ignores_zero_padding():
    x = rand(3, 37)
    padded = torch.cat([x, torch.zeros(3, 91)], dim=1)
    assert torch.equal(tree_sum(x, 1), tree_sum(padded, 1))
    torch.testing.assert_close(tree_sum(x, 1), x.sum(1))


def test_linear_is_invariant_to_batch_and_fusion():
    x, w1, w2 = rand(53, 64), rand(48, 64), rand(16, 64)
    with exact_numerics():
        whole = F.linear(x, torch.cat([w1, w2]))  # fused projections, as the rollout's
        alone = F.linear(x[17:18], w1)
        shuffled = F.linear(x.flip(0), w1)
        batched = torch.bmm(x[None], w1.T[None])[0]
    assert torch.equal(whole[17, :48], alone[0])
    assert torch.equal(whole[:, :48], shuffled.flip(0)) and torch.equal(whole[:, :48], batched)
    torch.testing.assert_close(whole, F.linear(x, torch.cat([w1, w2])))


def test_norms_and_softmaxes_are_row_wise():
    z = rand(9, 100)
    with exact_numerics():
        rms = torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)
        rms_row = torch.rsqrt(z[4:5].pow(2).mean(-1, keepdim=True) + 1e-6)
        logp, logp_row = torch.log_softmax(z, -1), torch.log_softmax(z[4:5], -1)
        lse = z.logsumexp(-1)
        silu, silu_tail = F.silu(z), F.silu(z[:, -3:])
    assert torch.equal(rms[4], rms_row[0]) and torch.equal(logp[4], logp_row[0])
    # the sampler's log-softmax at a token is the training head's z[t] - logsumexp(z)
    assert torch.equal(logp[:, 7], z[:, 7] - lse)
    assert torch.equal(silu[:, -3:], silu_tail)
    torch.testing.assert_close(logp, torch.log_softmax(z, -1))
    torch.testing.assert_close(rms, torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_attention_sees_only_its_own_keys():
    q, k, v = rand(1, 4, 12, 8), rand(1, 2, 12, 8), rand(1, 2, 12, 8)
    with exact_numerics():
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        # token 5 as the rollout's decode sees it: its 6 keys, then a padded cache of garbage
        keys = torch.cat([k[:, :, :6], torch.full((1, 2, 10, 8), float("nan"))], dim=2)
        values = torch.cat([v[:, :, :6], torch.full((1, 2, 10, 8), float("nan"))], dim=2)
        mask = (torch.arange(16) < 6)[None, None, None, :]
        decode = F.scaled_dot_product_attention(q[:, :, 5:6], keys, values, attn_mask=mask, enable_gqa=True)
        # ... and as a shared-prompt tree packs it: another branch's keys in the middle
        other = torch.cat([k[:, :, :3], rand(1, 2, 4, 8), k[:, :, 3:6]], dim=2)
        other_v = torch.cat([v[:, :, :3], rand(1, 2, 4, 8), v[:, :, 3:6]], dim=2)
        tree_mask = torch.ones(10, dtype=torch.bool)
        tree_mask[3:7] = False
        tree = F.scaled_dot_product_attention(
            q[:, :, 5:6], other, other_v, attn_mask=tree_mask[None, None, None, :], enable_gqa=True
        )
    assert torch.equal(causal[:, :, 5], decode[:, :, 0]) and torch.equal(causal[:, :, 5], tree[:, :, 0])
    torch.testing.assert_close(
        causal, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )
