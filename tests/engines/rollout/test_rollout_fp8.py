"""FP8 rollout (`rollout.quantization=fp8`, rlloom/models/fp8.py) on the CPU: the quantization
against a loop over rows and groups, the grouped product against a loop over rows, an fp8 engine
that samples exactly from the model with its experts rounded (and not from the unquantized one),
weight syncs that quantize what they copy (checksum included), the whole RL loop as `rlloom train`
runs it, and dense models refused. The Triton kernel is tested on a GPU (tests/gpu/test_fp8_gpu.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from rollout_testutil import full_forward_logprobs, prompts, save, tiny_deepseek, tiny_dense, tiny_moe

import rlloom.models as models
from rlloom.config import ConfigError, load_config
from rlloom.engines.rollout.native import NativeEngine, SamplingParams
from rlloom.models import fp8
from rlloom.models.adapter import hf_slots
from rlloom.models.fp8 import (
    FP8,
    Fp8GroupedExperts,
    Fp8Rows,
    dequantize_rows,
    fp8_linear,
    quantize_rows,
    roundtrip,
)
from rlloom.models.moe import GroupedExperts
from rlloom.weight_sync.inplace import sync_inplace
from tests.weight_sync.sync_helpers import TrainSide, rollout_engine


def test_quantize_rows_matches_a_loop_over_rows_and_groups():
    g = torch.Generator().manual_seed(0)
    # 200 columns: one full group of 128 and a partial one; rows and groups at different scales.
    w = torch.randn(2, 6, 200, generator=g) * torch.logspace(-4, 2, 6).view(1, 6, 1)
    w[1, 2, 128:] = 0.0  # an all-zero group
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and q.shape == w.shape and scale.shape == (2, 6, 2)
    for e in range(2):
        for n in range(6):
            for grp, cols in enumerate((slice(0, 128), slice(128, 200))):
                amax = w[e, n, cols].abs().max()
                want_scale = amax / 448 if amax > 0 else torch.tensor(1.0)
                assert scale[e, n, grp] == want_scale
                assert torch.equal(q[e, n, cols], (w[e, n, cols] / want_scale).to(FP8))
    back = dequantize_rows(q, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, or of the group's smallest normal step.
    err = (back - w).abs()
    bound = torch.maximum(w.abs() / 16, scale.repeat_interleave(128, dim=-1)[..., :200] * 2**-9)
    assert (err <= bound * (1 + 1e-6)).all()
    assert (back[1, 2, 128:] == 0).all()


def test_grouped_product_is_each_rows_expert():
    g = torch.Generator().manual_seed(1)
    counts = [3, 0, 5, 1]
    w = torch.randn(4, 12, 150, generator=g)
    q, scale = quantize_rows(w)
    x = torch.randn(sum(counts), 150, generator=g)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = fp8_linear(x, q, scale, offsets)
    experts = [e for e, n in enumerate(counts) for _ in range(n)]
    deq = dequantize_rows(q, scale, torch.float32)
    want = torch.stack([deq[e] @ x[p] for p, e in enumerate(experts)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_batched_loading_equals_one_expert_at_a_time(monkeypatch):
    """`load_rows` (a sync's experts quantized a run of consecutive experts at a time) leaves the
    same bits as one `copy_` per expert: experts out of order, with gaps, runs cut by the batch
    size, the gate and up halves of one stacked weight, and a whole-matrix slot."""
    monkeypatch.setattr(fp8, "_BATCH_BYTES", 4 * 6 * 200 * 4)  # 4 experts of [6, 200] a batch
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(9, 12, 200, generator=g)
    matrix = torch.randn(5, 200, generator=g)

    def slots():
        q, s = torch.zeros(9, 12, 200, dtype=FP8), torch.zeros(9, 12, 2)
        halves = Fp8Rows(q[:, :6], s[:, :6], torch.float32), Fp8Rows(q[:, 6:], s[:, 6:], torch.float32)
        whole = Fp8Rows(torch.zeros(5, 200, dtype=FP8), torch.zeros(5, 2), torch.float32)
        return q, s, halves, whole

    experts = [7, 0, 1, 2, 3, 4, 8, 5]  # 6 is not sent
    q_a, s_a, halves_a, whole_a = slots()
    for e in experts:
        halves_a[0][e].copy_(w13[e, :6])
        halves_a[1][e].copy_(w13[e, 6:])
    whole_a.copy_(matrix)
    q_b, s_b, halves_b, whole_b = slots()
    pairs = [(halves_b[h][e], w13[e, 6 * h : 6 * h + 6]) for e in experts for h in (1, 0)]
    fp8.load_rows([*pairs, (whole_b, matrix)])
    assert torch.equal(q_a.view(torch.uint8), q_b.view(torch.uint8)) and torch.equal(s_a, s_b)
    assert torch.equal(whole_a.q.view(torch.uint8), whole_b.q.view(torch.uint8))
    assert (q_b[6].view(torch.uint8) == 0).all()  # untouched


def _engine(path: str, **kwargs) -> NativeEngine:
    kwargs = {"max_model_len": 64, "num_blocks": 256, "block_size": 4, "seed": 0} | kwargs
    return NativeEngine(models.from_pretrained(path, fused_projections=True), **kwargs)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def moe_path(request, tmp_path_factory):
    hf = tiny_moe(seed=2) if request.param == "qwen3_moe" else tiny_deepseek(seed=2)
    return save(hf, tmp_path_factory.mktemp(request.param))


def test_engine_samples_from_the_model_with_rounded_experts(moe_path):
    """Only the routed experts are fp8; the engine's logprobs are a full forward's of the model whose
    experts hold the quantized values, and differ from the unquantized model's."""
    engine = _engine(moe_path, quantization="fp8")
    kinds = {type(m) for m in engine.model.modules()}
    assert Fp8GroupedExperts in kinds and GroupedExperts not in kinds
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())  # the rest unquantized
    rounded = models.from_pretrained(moe_path, fused_projections=True)
    models.load_hf_tensors(rounded, models.hf_named_tensors(engine.model))
    plain = models.from_pretrained(moe_path, fused_projections=True)
    batch = prompts(6, max_len=14, seed=4)
    out = engine.generate(batch, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5))
    to_rounded, to_plain = [], []
    for c in out:
        p = batch[c.prompt_index]
        to_rounded += [
            abs(a - b) for a, b in zip(c.logprobs, full_forward_logprobs(rounded, p, c.token_ids, 1.0))
        ]
        to_plain += [
            abs(a - b) for a, b in zip(c.logprobs, full_forward_logprobs(plain, p, c.token_ids, 1.0))
        ]
    assert max(to_rounded) <= 1e-5
    assert max(to_plain) > 1e-3


def test_a_sync_quantizes_what_it_copies_and_its_checksum_holds():
    """The in-place sync (every expert, the gate and up halves of the stacked fp8 weight) leaves each
    expert tensor equal to the training tensor quantized and read back, and every other tensor
    equal to the training one, after the 1st and the 3rd step; sync.checksum compares them so."""
    train, engine = TrainSide("moe"), rollout_engine("moe", quantization="fp8")
    for _ in range(3):
        train.step()
        sync_inplace(train, engine, bucket_bytes=4 << 10, checksum=True)
        sent = train.weights()
        held = dict(hf_slots(engine.model))
        assert set(held) == set(sent)
        experts = [n for n, slot in held.items() if isinstance(slot, Fp8Rows)]
        assert len(experts) == 2 * 4 * 3  # layers x experts x (gate, up, down)
        for name, slot in held.items():
            want = roundtrip(sent[name], torch.float32) if name in experts else sent[name]
            assert torch.equal(slot.detach(), want), name


def test_a_partial_update_changes_only_its_rows(moe_path):
    engine = _engine(moe_path, quantization="fp8")
    before = {n: t.clone() for n, t in models.hf_named_tensors(engine.model)}
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    new = torch.randn(before[name].shape, generator=torch.Generator().manual_seed(9))
    engine.update_weights([(name, new)], version=7)
    after = dict(models.hf_named_tensors(engine.model))
    assert torch.equal(after[name], roundtrip(new, torch.float32))
    assert all(torch.equal(after[n], before[n]) for n in before if n != name)
    assert engine.policy_version == 7


def test_dense_models_are_refused(tmp_path, tiny_checkpoint):
    path = save(tiny_dense(seed=0), tmp_path / "dense")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # a complete folder
        shutil.copy(tiny_checkpoint / name, Path(path) / name)
    with pytest.raises(ValueError, match=r"quantization='fp8' is invalid: fp8 quantizes the routed experts"):
        _engine(path, quantization="fp8")
    cfg = load_config(
        "arithmetic_smoke",
        [f"model.path={path}", f"trainer.run_dir={tmp_path / 'run'}", "rollout.quantization=fp8"],
    )
    from rlloom.trainer.preflight import check_before_loading

    with pytest.raises(ConfigError, match=r"rollout.quantization='fp8' is invalid for .*: fp8 quantizes"):
        check_before_loading(cfg)


def test_rl_run_with_fp8_rollout(tiny_moe_checkpoint, tmp_path):
    """The whole loop on a tiny Qwen3-MoE, as `rlloom train` runs it, with rollout.quantization=fp8
    and the none run beside it: both train; the fp8 run's rollout logprobs differ from training's
    (the unquantized model's) where the none run's agree, and TIS corrects with its ratios."""
    from rlloom.trainer.run import run

    gaps = {}
    for quantization in ("none", "fp8"):
        run_dir = tmp_path / quantization
        cfg = load_config(
            "arithmetic_smoke",
            [
                f"model.path={tiny_moe_checkpoint}", f"trainer.run_dir={run_dir}", "data.num_eval=0",
                "data.num_train=32", "rollout.max_new_tokens=6", "logging.console=false", "train.lr=3e-2",
                "trainer.total_steps=2", f"rollout.quantization={quantization}", "algorithm.is_correction=tis",
                "cluster.device=cpu",
            ],
        )  # fmt: skip
        run(cfg)
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if r["step"] > 0]
        assert len(steps) == 2 and all(r["train/skipped_step"] == 0.0 for r in steps)
        gaps[quantization] = [r["rollout/logp_gap_abs"] for r in steps]
    # This checkpoint's small weights give near-uniform logits: gaps of ~2e-7 (none) and ~1e-4 (fp8).
    assert max(gaps["none"]) < 1e-5
    assert min(gaps["fp8"]) > 3e-5
