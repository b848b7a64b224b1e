"""rollout.match_training on a GPU: the batch-invariant Triton kernels (models/exact_kernels.py,
models/exact_attention.py, models/exact_fused.py) against torch's kernels (within bf16 tolerance) and against themselves
with the same rows in another batch (bit for bit), and `rlloom train` on a tiny dense, Qwen3-MoE and
DeepSeek-V3 (MLA) model in bf16 whose `rollout/logp_gap_max` reads 0.0 at every step (the default
kernels' gap is > 0 on the same run, so the check can fail). Skipped without a GPU.

The shapes are Qwen3-0.6B's (hidden 1024, 16 query / 8 kv heads of 128, vocabulary 151936), where
cuBLAS and FlashAttention pick different kernels for different row counts."""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))

from test_trainer_loop import read_metrics, tiny_args  # noqa: E402

from rlloom.cli import main  # noqa: E402
from rlloom.models.attention_ops import TreePlan, packed_attention  # noqa: E402
from rlloom.models.tiny import write_tiny_model  # noqa: E402

CUDA, BF16 = torch.device("cuda"), torch.bfloat16


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=CUDA) * scale).to(BF16)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 2e-2) -> None:
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= rel * ref.float().abs().max().item(), err


def test_matmul_is_torchs_product_and_batch_invariant():
    from rlloom.models.exact_kernels import matmul

    a, w, bias = randn(1000, 1024, seed=0), randn(3072, 1024, seed=1, scale=0.03), randn(3072, seed=2)
    full = matmul(a, w.t(), bias)
    assert full.dtype == BF16
    assert_close(full, F.linear(a, w, bias))
    for rows in (slice(0, 1), slice(7, 8), slice(3, 70), slice(500, 1000)):
        assert torch.equal(matmul(a[rows], w.t(), bias), full[rows]), rows
    # row 7 among other rows, at another place in the tile
    mixed = torch.cat([randn(37, 1024, seed=3), a[7:8], randn(200, 1024, seed=4)])
    assert torch.equal(matmul(mixed, w.t(), bias)[37], full[7])
    # the rollout's fused projections (one product over stacked weights) equal training's separate ones
    fused = matmul(a, torch.cat([w, w[:512]]).t())
    assert torch.equal(fused[:, :3072], matmul(a, w.t())) and torch.equal(
        fused[:, 3072:], matmul(a, w[:512].t())
    )
    # the lm head's shape
    head = randn(151936, 1024, seed=5, scale=0.03)
    logits = matmul(a[:64], head.t())
    assert_close(logits, a[:64] @ head.t())
    assert torch.equal(matmul(a[5:6], head.t()), logits[5:6])


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_row_reductions_match_torch_and_are_batch_invariant(dtype):
    from rlloom.models.exact_kernels import row_logsumexp, row_sum

    x = (torch.randn(300, 151936, device=CUDA) * 4).to(dtype)
    for op, ref in ((row_sum, x.float().sum(-1)), (row_logsumexp, x.float().logsumexp(-1))):
        full = op(x)
        assert full.dtype == dtype
        assert_close(full, ref, rel=1e-2 if dtype == BF16 else 1e-5)
        assert torch.equal(op(x[9:10]), full[9:10]) and torch.equal(op(x[100:300]), full[100:300])


def test_grouped_matmul_is_grouped_mm_and_batch_invariant():
    """The experts' products at Qwen3-30B-A3B's widths (hidden 2048, 128 experts of width 768): the
    values of torch._grouped_mm, and a token's row the same bits alone in its expert (decode), among
    few rows and among many (training), at another offset."""
    from rlloom.models.exact_kernels import grouped_matmul

    E, D, inter = 128, 2048, 768
    counts = torch.arange(E, device=CUDA) % 41  # 0 to 40 rows an expert, 2470 in all
    offsets = counts.cumsum(0).to(torch.int32)
    for w, width in (
        (randn(E, inter, D, seed=20, scale=0.03), D),
        (randn(E, D, inter, seed=21, scale=0.03), inter),
    ):
        x = randn(int(offsets[-1]), width, seed=22)
        full = grouped_matmul(x, w, offsets)
        assert full.dtype == BF16
        assert_close(full, torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets))
        e, row = 40, int(offsets[39]) + 17  # expert 40 has 40 rows; its 18th
        alone = grouped_matmul(x[row : row + 1], w, (torch.arange(E, device=CUDA) >= e).to(torch.int32))
        assert torch.equal(alone[0], full[row])
        many = torch.cat([randn(300, width, seed=23), x[row : row + 1], randn(700, width, seed=24)])
        counts2 = torch.zeros(E, dtype=torch.int64, device=CUDA)
        counts2[e - 1], counts2[e], counts2[e + 1] = 300, 301, 700  # the row is expert e's last of 301
        got = grouped_matmul(many, w, counts2.cumsum(0).to(torch.int32))
        assert torch.equal(got[300], full[row])


def test_router_logits_are_a_batch_invariant_fp32_product():
    """A MoE router's fp32 logits of bf16 operands (torch.mm's out_dtype) under exact numerics."""
    from rlloom.models.exact import exact_numerics
    from rlloom.models.moe import router_logits

    x, w = randn(3000, 2048, seed=30), randn(128, 2048, seed=31, scale=0.03)
    with exact_numerics():
        full = router_logits(x, w)
        assert full.dtype == torch.float32
        assert torch.equal(router_logits(x[5:6], w), full[5:6])
        assert torch.equal(router_logits(x[100:1100], w), full[100:1100])
    assert_close(full, x.float() @ w.float().t(), rel=1e-2)


def test_attention_mla_latent_paged_equals_packed():
    """MLA's absorbed form at DeepSeek-V2-Lite's latent widths (16 heads, latent 512 + rope 64; the
    values the keys' first 512 channels, read in place): FlashAttention-free reference values, and
    the rollout's decode and prefill chunks over a latent cache give the packed forward's bits."""
    from rlloom.models.exact_attention import Runs, attend_runs, packed_runs

    length, bs, H, R, Dr = 300, 16, 16, 512, 64
    q, k = randn(length, H, R + Dr, seed=40), randn(length, 1, R + Dr, seed=41)
    one = torch.tensor([0, length], device=CUDA)
    packed = attend_runs(q, k, k[..., :R], 0.07, packed_runs(one, length, length))
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), k[..., :R].transpose(0, 1).float(),
        is_causal=True, scale=0.07, enable_gqa=True,
    )  # fmt: skip
    assert_close(packed, ref.transpose(0, 1))
    blocks = torch.randperm(64, device=CUDA)[: length // bs + 1]
    slots = (blocks[:, None] * bs + torch.arange(bs, device=CUDA)).flatten()
    cache = torch.full((64 * bs, 1, R + Dr), float("nan"), dtype=BF16, device=CUDA)
    cache[slots[:length]] = k
    for first, n in ((length - 1, 1), (100, 1), (0, 37), (37, 200)):
        z = torch.tensor([0], device=CUDA)
        runs = Runs(z, z + n, z, z + first + n, slots, n)
        out = attend_runs(q[first : first + n], cache, cache[..., :R], 0.07, runs)
        assert torch.equal(out, packed[first : first + n]), (first, n)


def packed_qkv(lens: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    n = sum(lens)
    q, k, v = randn(n, 16, 128, seed=seed), randn(n, 8, 128, seed=seed + 1), randn(n, 8, 128, seed=seed + 2)
    cu = torch.tensor([0, *lens], device=CUDA).cumsum(0).to(torch.int32)
    return q, k, v, cu


def test_attention_packed_is_flash_attention_and_batch_invariant():
    from rlloom.models.exact_attention import attend_runs, packed_runs

    lens = [300, 1, 77, 1024, 16]
    q, k, v, cu = packed_qkv(lens, seed=0)
    out = attend_runs(q, k, v, 0.088, packed_runs(cu, max(lens), q.shape[0]))
    assert_close(out, packed_attention(q, k, v, 0.088, cu, max(lens)))
    # the 77-token sequence alone, and behind other sequences
    s = slice(301, 378)
    alone = attend_runs(q[s], k[s], v[s], 0.088, packed_runs(cu.new_tensor([0, 77]), 77, 77))
    assert torch.equal(alone, out[s])
    q2, k2, v2, _ = packed_qkv([500], seed=9)
    cat = [torch.cat([x2, x[s]]) for x, x2 in ((q, q2), (k, k2), (v, v2))]
    behind = attend_runs(*cat, 0.088, packed_runs(cu.new_tensor([0, 500, 577]), 500, 577))
    assert torch.equal(behind[500:], out[s])


def test_attention_paged_prefill_and_decode_equal_the_packed_forward():
    """A sequence's queries through a block table (prefill in chunks, then decode steps in batches
    with other sequences) give the packed forward's bits."""
    from rlloom.models.exact_attention import Runs, attend_runs, packed_runs

    length, bs = 200, 16
    q, k, v, cu = packed_qkv([length], seed=3)
    packed = attend_runs(q, k, v, 0.088, packed_runs(cu, length, length))
    blocks = torch.randperm(64, device=CUDA)[: length // bs + 1]
    slots = (blocks[:, None] * bs + torch.arange(bs, device=CUDA)).flatten()
    k_cache = torch.full((64 * bs, 8, 128), float("nan"), dtype=BF16, device=CUDA)  # unwritten: NaN
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[slots[:length]], v_cache[slots[:length]] = k, v
    # a second sequence's table: the written cache rows in another order
    other = torch.cat([slots[:length].flip(0), slots[length:]])
    for first, n in ((0, length), (0, 37), (37, 100), (150, 50), (length - 1, 1), (63, 1), (64, 1)):
        runs = Runs(
            q_start=torch.tensor([0, n], device=CUDA),
            q_len=torch.tensor([n, 1], device=CUDA),
            k_base=torch.tensor([0, slots.numel()], device=CUDA),
            k_len=torch.tensor([first + n, 5], device=CUDA),
            kv_index=torch.cat([slots, other]),
            max_q=n,
        )
        qs = torch.cat([q[first : first + n], q[:1]])
        out = attend_runs(qs, k_cache, v_cache, 0.088, runs)
        assert not out.isnan().any()
        assert torch.equal(out[:n], packed[first : first + n]), (first, n)


def test_attention_tree_branches_equal_their_own_sequences():
    """Shared-prompt packing (training) gives each branch the bits of prompt + branch alone."""
    from rlloom.models.attention_ops import AttnLayout, exact_cuda_attention
    from rlloom.models.exact_attention import attend_runs, packed_runs

    prompt, branches = 90, [40, 1, 130]
    q, k, v, _ = packed_qkv([prompt + sum(branches)], seed=5)
    tree = TreePlan(
        torch.tensor([0, prompt + sum(branches)], dtype=torch.int32),
        torch.tensor([prompt]),
        torch.tensor(branches),
        device=CUDA,
    )
    out = exact_cuda_attention(q, k, v, 0.088, AttnLayout("tree", tree=tree))
    start = prompt
    for r in branches:
        rows = torch.cat([torch.arange(prompt), torch.arange(start, start + r)]).to(CUDA)
        n = prompt + r
        alone = attend_runs(
            q[rows], k[rows], v[rows], 0.088, packed_runs(torch.tensor([0, n], device=CUDA), n, n)
        )
        assert torch.equal(alone[prompt:], out[start : start + r])
        assert torch.equal(alone[:prompt], out[:prompt])
        start += r


def test_attention_backward_is_flash_attentions_gradient():
    from rlloom.models.attention_ops import AttnLayout, exact_cuda_attention

    lens = [100, 33]
    q, k, v, cu = packed_qkv(lens, seed=7)
    grad = randn(*q.shape, seed=11)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = exact_cuda_attention(*leaves, 0.088, AttnLayout("packed", cu_seqlens=cu, max_seqlen=100))
    out.backward(grad)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    packed_attention(*ref_leaves, 0.088, cu, 100).backward(grad)
    for got, ref in zip(leaves, ref_leaves):
        assert_close(got.grad, ref.grad)


def test_fused_kernels_match_torch_and_are_batch_invariant():
    """models/exact_fused.py at Qwen3-0.6B's widths in bf16: RMSNorm (hidden 1024 and the per-head
    128), silu(gate) * up on the rollout's fused halves, rope on 16 heads of 128, the head's
    statistics; each against torch's formula, a row alone equal to the row in its batch, and
    RMSNorm's weight gradient the same bits on a repeat."""
    from rlloom.models import exact_fused as ef
    from rlloom.models import logprobs
    from rlloom.models.exact import exact_numerics
    from rlloom.models.layers import _rotate_half

    def norm_ref(x, w):  # noqa: ANN001, ANN202
        return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    for width in (1024, 128):
        x, w = randn(3000, width, seed=0, scale=3.0), randn(width, seed=1)
        full = ef.rms_norm(x, w, 1e-6)
        assert_close(full, norm_ref(x, w))
        for rows in (slice(0, 1), slice(7, 8), slice(100, 2900)):
            assert torch.equal(ef.rms_norm(x[rows], w, 1e-6), full[rows]), rows
        dy = randn(3000, width, seed=2)
        dws = []
        for _ in range(2):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            ef.rms_norm(xg, wg, 1e-6).backward(dy)
            dws.append(wg.grad)
        assert torch.equal(dws[0], dws[1])
        xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
        norm_ref(xr, wr).backward(dy.float())
        assert_close(xg.grad, xr.grad)
        assert_close(dws[0], wr.grad)
    gate_up = randn(3000, 2 * 3072, seed=3)
    gate, up = gate_up.split(3072, dim=-1)
    out = ef.silu_mul(gate, up)
    assert_close(out, F.silu(gate) * up)
    assert torch.equal(ef.silu_mul(gate.contiguous()[5:6], up.contiguous()[5:6]), out[5:6])
    q = randn(3000, 16, 128, seed=4)
    angles = torch.rand(3000, 64, device=CUDA) * 100
    cos, sin = (f(torch.cat([angles, angles], -1)).to(BF16) for f in (torch.cos, torch.sin))
    rot = ef.rope(q, cos, sin, False)
    assert_close(rot, q * cos[:, None] + _rotate_half(q) * sin[:, None])
    assert torch.equal(ef.rope(q[9:10], cos[9:10], sin[9:10], False), rot[9:10])
    pairs = ef.rope(q, cos, sin, True)  # DeepSeek-V3's interleaved pairs, de-interleaved first
    q_split = q.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    assert_close(pairs, q_split * cos[:, None] + _rotate_half(q_split) * sin[:, None])
    logits, targets = randn(64, 151936, seed=5, scale=3.0), torch.randint(0, 151936, (64,), device=CUDA)
    with exact_numerics():
        got, want = (
            ef.chunk_stats(logits, targets, 1.0, True),
            logprobs.chunk_stats(logits, targets, 1.0, True),
        )
        alone = ef.chunk_stats(logits[3:4], targets[3:4], 1.0, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert_close(got[2], want[2], rel=1e-4)
    assert all(torch.equal(a[0], g[3]) for a, g in zip(alone, got))


@pytest.mark.parametrize("kind", ["tiny-dense", "tiny-moe", "tiny-mla"])
def test_exact_decode_replays_cuda_graphs_with_the_eager_bits(tmp_path, kind):
    """Under the mode the decode replays CUDA graphs of the plain forward (no compiled layers),
    and a replay gives the eager forward's bits: tokens and logprobs equal, also for a batch the
    graphs pad (7 prompts x 2 = 14 sequences run in the graph of 16; MoE: the padding rows are
    routed too, and the experts' grouped product keeps a row's bits whatever else its expert got)."""
    from rlloom.engines.rollout.native import NativeEngine, SamplingParams

    ckpt = write_tiny_model(kind, tmp_path / "ckpt", seed=0, hidden=128, layers=2)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (3, 17, 40, 5, 90, 33, 8)]
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=7, ignore_eos=True)
    kw = dict(dtype=BF16, device="cuda", max_model_len=256, kv_cache_memory_gb=0.5, exact=True)
    engine = NativeEngine.from_pretrained(ckpt, **kw)
    replayed = engine.generate(prompts, sp)
    assert engine.runner.compiled_forward is None  # the plain forward: compiled layers fuse
    graphs = engine.runner.graphs
    assert graphs is not None and any(bs == 16 for bs, _ in graphs.graphs), "no padded decode graph"
    eager = NativeEngine.from_pretrained(ckpt, enforce_eager=True, **kw).generate(prompts, sp)
    assert [c.token_ids for c in replayed] == [c.token_ids for c in eager]
    assert [c.logprobs for c in replayed] == [c.logprobs for c in eager]


STOP_ANY = "rollout.stop_strings=" + json.dumps(list(string.ascii_letters + string.digits))
RUN = [
    "cluster.device=cuda",
    "trainer.total_steps=2",
    "train.lr=3e-2",
    "data.num_eval=0",
    "trainer.save_hf_every=-1",
    "rollout.max_new_tokens=12",
    STOP_ANY,  # the random model's responses end at different lengths
    "train.max_tokens_per_micro_batch=256",  # several micro-batches
]


def gaps(ckpt: Path, run_dir: Path, *extra: str) -> list[float]:
    assert main(["train", "arithmetic_smoke", *tiny_args(ckpt, run_dir, *RUN, *extra)]) == 0
    found = [m["rollout/logp_gap_max"] for m in read_metrics(run_dir) if "rollout/logp_gap_max" in m]
    assert len(found) == 2
    return found


def test_match_training_on_cuda_gives_a_zero_gap_at_every_step(tmp_path):
    ckpt = write_tiny_model("tiny-dense", tmp_path / "ckpt", seed=0, hidden=128, layers=2)
    assert gaps(ckpt, tmp_path / "exact", "rollout.match_training=true") == [0.0, 0.0]
    assert max(gaps(ckpt, tmp_path / "default")) > 0.0


@pytest.mark.parametrize("kind", ["tiny-moe", "tiny-mla"])
def test_match_training_on_cuda_gives_moe_and_mla_models_a_zero_gap(tmp_path, kind):
    """A Qwen3-MoE (softmax routing) and a DeepSeek-V3 (MLA with its latent cache in the rollout, a
    dense layer, then sigmoid group routing with a shared expert): 0.0 at both steps."""
    ckpt = write_tiny_model(kind, tmp_path / "ckpt", seed=0, hidden=128, layers=2)
    assert gaps(ckpt, tmp_path / "exact", "rollout.match_training=true") == [0.0, 0.0]
    assert max(gaps(ckpt, tmp_path / "default")) > 0.0
