"""Pipeline parallelism composed with tensor parallelism: the training engine at pp=2 x tp=2 on 4
gloo processes equals the one-process engine in fp32 (tiny dense Qwen3 with tied embeddings: the
last stage's vocabulary-parallel head is the embedding's copy): logprobs and entropies, every
gradient, the losses and grad norms of two steps whose batches differ in token count, and the
weights `named_weights` gives (full tensors on every rank). A checkpoint saved at pp=2 x tp=2
resumes in one process (pp=1, tp=1) and continues as the uninterrupted run (so does one saved at
pp=2 x ep=2). In the same process
group, pp=2 x ep=2 (the 4 ranks: 2 stages x 2 data-parallel ranks that split the experts) on a tiny
Mixtral (every layer MoE, so both stages exchange tokens between their EP ranks; rollout routes
replayed, then compared: moe/route_mismatch_frac and the expert-load metrics must match too) equals
one process the same way, as does pp=2 x dp=2 on a tiny DeepSeek-V3 whose correction bias is
updated from the loads, and so does pp=2 x cp=2 (each micro-batch cut into two equal shares of the padded
budget, `cp.fixed_shares`; the last stage gathers the selected logprobs over the cp ranks). On 8
processes, pp=2 x cp=2 x tp=2 with ep=2 over the cp x tp ranks of a stage (Mixtral: stages send
[1, budget / (cp x tp), D], each TP rank routes its token shard) equals one process too."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "train"))
from parallel_helpers import run_gloo, tiny_model  # noqa: E402
from test_pp_engine import KEYS, TOL, cfg, run, step  # noqa: E402
from test_train_parallel_gloo import MODE, batches, full_grads, full_weights  # noqa: E402
from train_engine_helpers import PolicyLoss  # noqa: E402

from rlloom.algorithms.losses import loss_normalizer  # noqa: E402
from rlloom.config import (  # noqa: E402
    ConfigError,
    ParallelConfig,
    load_config,  # noqa: E402
)
from rlloom.data.types import RolloutBatch  # noqa: E402
from rlloom.engines.train.base import ForwardOptions
from rlloom.engines.train.native import NativeTrainEngine  # noqa: E402
from rlloom.parallel import ParallelDims  # noqa: E402
from rlloom.parallel.cp import balance_chunks, fixed_shares  # noqa: E402

WEIGHT_TOL = dict(atol=1e-3, rtol=0)
"""After two Adam steps at lr 3e-2: TP sums in another order, and Adam's division by sqrt(v) turns
the last bits of a gradient element near 0 into up to ~lr x 1e-2 of its weight (2e-4 seen); a wrong
gradient moves a weight by ~lr a step."""


def compare_weights(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for name, t in expected.items():
        torch.testing.assert_close(
            got[name], t, **WEIGHT_TOL, msg=lambda m, n=name: f"{what} weight {n}: {m}"
        )


def routed(batch: RolloutBatch) -> RolloutBatch:
    """`batch` with rollout routes for both MoE layers of the tiny Mixtral (test_train_parallel_gloo's
    routes, skewed so that some experts get no token, the second layer's shifted by one expert)."""
    samples = []
    for s in batch.samples:
        routes = s.routed_experts.long()
        samples.append(
            dataclasses.replace(
                s, routed_experts=torch.cat([routes, (routes + 1) % 4], dim=1).to(torch.uint8)
            )
        )
    return RolloutBatch(samples)


def step_routed(engine: NativeTrainEngine, i: int, replay: bool = False) -> dict[str, float]:
    batch = routed(batches(True)[i])
    loss, normalizer = PolicyLoss(batch, MODE), loss_normalizer(batch.response_mask(), MODE)
    return engine.train_step(
        batch,
        loss,
        loss_normalizer=normalizer,
        options=ForwardOptions(with_entropy=True, routing_replay=replay),
    )


def run_routed(engine: NativeTrainEngine) -> dict:
    """`test_pp_engine.run` on batches with rollout routes: logprobs and the first step with the
    routes replayed, the second comparing them (moe/route_mismatch_frac)."""
    data = [routed(b) for b in batches(True)]
    logp, entropy = engine.forward_logprobs(
        data[0], options=ForwardOptions(with_entropy=True, routing_replay=True)
    )
    normalizer = loss_normalizer(data[0].response_mask(), MODE)
    loss = PolicyLoss(data[0], MODE)
    engine.forward_backward(
        data[0],
        loss,
        loss_normalizer=normalizer,
        options=ForwardOptions(with_entropy=True, routing_replay=True),
    )
    if engine.pipe is not None:
        engine.pipe.clip_grad_norm_(0.0)
    grads = full_grads(engine)
    steps = [step_routed(engine, 0, replay=True), step_routed(engine, 1)]
    keys = (*KEYS, "moe/route_mismatch_frac")
    metrics = [{k: m[k] for k in keys} for m in steps]
    out = {"last": steps[-1], "logp": logp, "entropy": entropy, "grads": grads, "metrics": metrics}
    return out | {"weights": full_weights(engine)}


def check(got: dict, expected: dict, what: str) -> None:
    """`test_pp_engine.run`'s results against one process's (its weights at WEIGHT_TOL)."""
    torch.testing.assert_close(got["logp"], expected["logp"], **TOL, msg=lambda m: f"{what} logp: {m}")
    torch.testing.assert_close(
        got["entropy"], expected["entropy"], **TOL, msg=lambda m: f"{what} entropy: {m}"
    )
    assert 0 < len(got["grads"]) < len(expected["grads"])  # this rank's stages only
    for name, grad in got["grads"].items():
        torch.testing.assert_close(
            grad, expected["grads"][name], **TOL, msg=lambda m, n=name: f"{what} grad {n}: {m}"
        )
    for i, (a, b) in enumerate(zip(got["metrics"], expected["metrics"], strict=True)):
        assert a.keys() == b.keys(), what
        for k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (what, i, k, a[k], b[k])
    moe = {k: v for k, v in expected["last"].items() if k.startswith("moe/")}
    assert moe.keys() == {k for k in got["last"] if k.startswith("moe/")}, what
    for k, v in moe.items():  # expert loads of the real tokens (padding not counted), bias
        assert got["last"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (what, k, got["last"][k], v)
    compare_weights(got["weights"], expected["weights"], what)


def engine_for(family: str, world: int = 4, **degrees: int) -> NativeTrainEngine:
    model = tiny_model(family)
    # DeepSeek-V3's correction bias moves with the loads (a wrong count moves it the wrong way).
    changes = {"moe_bias_update_rate": 0.05} if family == "deepseek_v3" else {}
    # Mixtral runs with routes: without shared prompts every recorded route is compared once, so
    # moe/route_mismatch_frac is a ratio of sums, whatever the micro-batch split (it differs with dp).
    # CP splits plain packed documents only.
    share_prompts = family != "mixtral" and degrees.get("cp", 1) == 1
    if not degrees:
        return NativeTrainEngine(cfg(share_prompts=share_prompts, **changes), model)
    return NativeTrainEngine(
        cfg(share_prompts=share_prompts, **changes),
        model,
        parallel_dims=ParallelDims(world_size=world, **degrees),
        pipeline=ParallelConfig(**degrees),
    )


def worker(rank: int, expected: dict, tmp: str) -> None:
    torch.manual_seed(0)
    engine = engine_for("qwen3", pp=2, tp=2)
    assert (engine.dp_size, engine.layout.tp) == (1, 2)
    check(run(engine), expected["qwen3"], "pp=2 x tp=2")
    engine.save(os.path.join(tmp, "pp2tp2"))
    engine = engine_for("mixtral", pp=2, ep=2)  # every layer MoE: experts split on both stages
    assert (engine.dp_size, engine.layout.ep) == (2, 2)
    check(run_routed(engine), expected["mixtral"], "pp=2 x ep=2")
    engine.save(os.path.join(tmp, "pp2ep2"))
    engine = engine_for("deepseek_v3", pp=2)  # the MoE layer on stage 1 only; its bias updated
    check(run(engine), expected["deepseek_v3"], "pp=2 x dp=2, bias update")
    engine = engine_for("qwen3", pp=2, cp=2)
    assert (engine.dp_size, engine.layout.cp) == (1, 2)
    check(run(engine), expected["qwen3"], "pp=2 x cp=2")


def worker_8(rank: int, expected: dict) -> None:
    torch.manual_seed(0)
    engine = engine_for("mixtral", world=8, pp=2, tp=2, cp=2, ep=2)
    assert (engine.dp_size, engine.layout.ep, engine.layout.tokens_split_over_tp) == (1, 2, True)
    check(run_routed(engine), expected["mixtral"], "pp=2 x cp=2 x tp=2, ep=2")


@pytest.mark.slow
def test_pp_composes_with_tp_ep_cp_and_checkpoints_cross_layout(tmp_path):
    expected = {"deepseek_v3": run(engine_for("deepseek_v3"))}
    engine = engine_for("qwen3")
    expected["qwen3"] = run(engine)
    step(engine, 2)
    step3 = full_weights(engine)
    engine = engine_for("mixtral")
    expected["mixtral"] = run_routed(engine)
    step_routed(engine, 2)
    moe_step3 = full_weights(engine)
    run_gloo(worker, 4, expected, str(tmp_path))
    # Everything at once (8 processes: more than the 4 of the other tests, about 10 s on 2 cores).
    run_gloo(worker_8, 8, expected)
    # pp=2 x tp=2 -> one process: step 3 after the resume gives the uninterrupted run's weights.
    single = engine_for("qwen3")
    single.load(str(tmp_path / "pp2tp2"))
    assert single.version == 2
    step(single, 2)
    compare_weights(full_weights(single), step3, "pp=2 x tp=2 -> one process")
    # pp=2 x ep=2 -> one process: the experts each EP rank of each stage held, placed whole.
    single = engine_for("mixtral")
    single.load(str(tmp_path / "pp2ep2"))
    assert single.version == 2
    step_routed(single, 2)
    compare_weights(full_weights(single), moe_step3, "pp=2 x ep=2 -> one process")


def test_pp_with_tp_needs_a_budget_that_splits_into_tp_shards():
    with pytest.raises(
        ConfigError,
        match=r"train.max_tokens_per_micro_batch=265 is invalid: parallel.pp=2 .* = 1 x 2 equal .*=266",
    ):
        load_config(
            "arithmetic_smoke",
            [
                "cluster.mode=ray",
                "cluster.num_workers=4",
                "parallel.pp=2",
                "parallel.tp=2",
                "train.max_tokens_per_micro_batch=265",
            ],
        )


def _tokens(shares: list, seq_lens: list[int]) -> list[list[int]]:
    starts = [sum(seq_lens[:s]) for s in range(len(seq_lens))]
    return [[starts[c.doc] + p for c in share for p in range(c.start, c.end)] for share in shares]


def test_fixed_shares_give_every_cp_rank_the_same_token_count():
    # Balanced: the real documents as balance_chunks cuts them, the padding (last) fills each share.
    lens = [9, 14, 3, 14]  # 26 real tokens + 14 padding = 40 = 2 x 20
    shares = fixed_shares(lens, 2, padded=True)
    assert shares[:-1] and [c for c in shares[0] if c.doc < 3] == balance_chunks(lens[:-1], 2)[0]
    tokens = _tokens(shares, lens)
    assert [len(t) for t in tokens] == [20, 20] and sorted(tokens[0] + tokens[1]) == list(range(40))
    # Many short documents in a full budget: a balanced share would not fit, contiguous halves instead.
    lens = [3, 1, 3, 1, 2]  # 8 real tokens, 2 padding: balanced shares of 2 and 6 tokens, over 5
    assert [sum(c.end - c.start for c in share) for share in balance_chunks(lens[:-1], 2)] == [2, 6]
    shares = fixed_shares(lens, 2, padded=True)
    assert _tokens(shares, lens) == [list(range(5)), list(range(5, 10))]
    with pytest.raises(ValueError, match=r"33 tokens does not split into parallel.cp=2 .*multiple of 2"):
        fixed_shares([30, 3], 2, padded=True)
