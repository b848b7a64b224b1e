"""Rollout routing replay (R3) end to end on tiny MoE models (Qwen3-MoE softmax routing and DeepSeek-V3
sigmoid group-limited routing): the rollout engine records the experts of every token it feeds to the
model (prompt and response, with prefix sharing and under preemption), the records pack into the
training stream in both layouts, replayed routing gives training logprobs equal to a forward that
uses the rollout's experts, and the replay holds across micro-batches and shared prompts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "rollout"))
from rollout_testutil import prompts, save, tiny_deepseek, tiny_moe  # noqa: E402

from rlloom import models  # noqa: E402
from rlloom.config import TrainEngineConfig  # noqa: E402
from rlloom.data.types import RolloutBatch, Sample  # noqa: E402
from rlloom.engines.rollout.native import NativeEngine, SamplingParams  # noqa: E402
from rlloom.engines.train.base import ForwardOptions
from rlloom.engines.train.native import NativeTrainEngine  # noqa: E402


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def moe_path(request, tmp_path_factory) -> str:
    hf = tiny_moe(seed=2) if request.param == "qwen3_moe" else tiny_deepseek(seed=2)
    return save(hf, tmp_path_factory.mktemp(request.param))


def forward_routes(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        model(torch.tensor(ids))
    return model.last_routes().to(torch.int64)


def generate(path: str, **kwargs) -> tuple[NativeEngine, list, list[list[int]]]:
    engine = NativeEngine(
        models.from_pretrained(path, fused_projections=True),
        **({"max_model_len": 64, "num_blocks": 256, "block_size": 4, "seed": 0} | kwargs),
    )
    batch = prompts(6, max_len=16, seed=7)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=5)
    return engine, engine.generate(batch, params), batch


@pytest.fixture(scope="module")
def rollout(moe_path):
    """One generation per model, shared by the tests below: (engine, completions, prompts)."""
    return generate(moe_path)


def assert_routes_of_a_full_forward(engine: NativeEngine, out: list, batch: list[list[int]]) -> None:
    args = engine.model.args
    for c in out:
        ids = batch[c.prompt_index] + c.token_ids
        assert c.routed_experts is not None and c.routed_experts.dtype == torch.uint8
        assert c.routed_experts.shape == (len(ids) - 1, len(engine.model.moe_layers()), args.moe.top_k)
        want = forward_routes(engine.model, ids[:-1])
        got = c.routed_experts.to(torch.int64)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values), c.prompt_index


def test_rollout_records_the_routes_a_full_forward_takes(rollout):
    assert_routes_of_a_full_forward(*rollout)


def test_routes_survive_preemption(tmp_path):
    """20 blocks of 4 tokens: sequences are preempted and recomputed; the routes stay those of the
    forward that produced each token (the recomputed prefill adds only the positions not recorded)."""
    engine, out, batch = generate(save(tiny_moe(seed=2), tmp_path), num_blocks=20)
    assert engine.num_preemptions > 0
    assert_routes_of_a_full_forward(engine, out, batch)


def test_dense_models_record_nothing(tmp_path):
    from rollout_testutil import tiny_dense

    _, out, _ = generate(save(tiny_dense(), tmp_path))
    assert all(c.routed_experts is None for c in out)


def samples_from(out, batch) -> list[Sample]:
    return [
        Sample(
            prompt_ids=batch[c.prompt_index],
            response_ids=c.token_ids,
            rollout_logprobs=c.logprobs,
            group_id=c.prompt_index,
            routed_experts=c.routed_experts,
        )
        for c in out
    ]


@pytest.mark.parametrize("share_prompts", [False, True])
def test_packed_routes_line_up_with_the_stream(rollout, share_prompts):
    _, out, batch = rollout
    rb = RolloutBatch(samples_from(out, batch))
    packed = rb.packed(share_prompts=share_prompts)
    assert packed.routes_NLK.shape[0] == packed.input_ids_N.shape[0]
    # Every position but each sample's last response token carries the route recorded for it.
    missing = (packed.routes_NLK < 0).all(-1).all(-1)
    assert int(missing.sum()) == len(rb)
    assert bool(((packed.routes_NLK >= 0).all(-1) | (packed.routes_NLK < 0).all(-1)).all())


def scrambled(samples: list[Sample], num_experts: int) -> list[Sample]:
    """The same samples with other (valid, distinct) experts: replay must follow them. A group's
    samples keep one set of prompt routes, as the rollout's shared prefill gives them."""
    gen = torch.Generator().manual_seed(0)
    out, prompt_routes = [], {}
    for s in samples:
        r = s.routed_experts
        picks = (
            torch.rand(*r.shape[:2], num_experts, generator=gen).argsort(-1)[..., : r.shape[2]].to(r.dtype)
        )
        p = len(s.prompt_ids)
        picks[:p] = prompt_routes.setdefault(s.group_id, picks[:p])
        out.append(Sample(**{**{f: getattr(s, f) for f in s.__slots__}, "routed_experts": picks}))
    return out


def forced_logprobs(model: torch.nn.Module, sample: Sample) -> torch.Tensor:
    """A per-sample forward whose routers are forced, by patching, to the sample's recorded experts."""
    routes = sample.routed_experts.to(torch.int64)
    ids = torch.tensor(sample.token_ids)
    full = torch.cat([routes, routes.new_full((1, *routes.shape[1:]), -1)])
    with torch.no_grad():
        logits = model(ids, routes_NLK=full, replay_routes=True)
    logp = torch.log_softmax(logits.float(), -1)[len(sample.prompt_ids) - 1 : -1]
    return logp.gather(1, torch.tensor(sample.response_ids)[:, None])[:, 0]


@pytest.mark.parametrize("share_prompts, budget", [(False, 4096), (True, 40)])
def test_replayed_training_logprobs_follow_the_recorded_experts(rollout, moe_path, share_prompts, budget):
    engine, out, batch = rollout
    samples = scrambled(samples_from(out, batch), engine.model.args.moe.num_experts)
    rb = RolloutBatch(samples)
    train = NativeTrainEngine(
        TrainEngineConfig(share_prompts=share_prompts, max_tokens_per_micro_batch=budget),
        models.from_pretrained(moe_path),
    )
    replayed, _ = train.forward_logprobs(rb, options=ForwardOptions(routing_replay=True))
    own, _ = train.forward_logprobs(rb)
    reference = models.from_pretrained(moe_path)
    for b, s in enumerate(samples):
        want = forced_logprobs(reference, s)
        torch.testing.assert_close(replayed[b, : len(want)], want, atol=1e-5, rtol=0)
    assert (replayed - own).abs().max() > 1e-3  # other experts, other logprobs: the replay is used


def test_training_with_the_rollout_routes_matches_the_rollout(rollout, moe_path):
    """Own routes replayed: training logprobs equal the rollout's, and the mismatch metric is 0."""
    _, out, batch = rollout
    rb = RolloutBatch(samples_from(out, batch))
    train = NativeTrainEngine(
        TrainEngineConfig(max_tokens_per_micro_batch=64), models.from_pretrained(moe_path)
    )
    logp, _ = train.forward_logprobs(rb, options=ForwardOptions(routing_replay=True))
    mask = rb.response_mask()
    assert (logp - rb.rollout_logprobs())[mask].abs().max() < 1e-5
    zero = lambda logp_bT, ent, rows: ((logp_bT * 0.0).sum(), {})
    metrics = train.train_step(rb, zero, loss_normalizer=1.0, options=ForwardOptions(routing_replay=True))
    assert metrics["moe/route_mismatch_frac"] == pytest.approx(0.0, abs=1e-9)
    scrambled_batch = RolloutBatch(scrambled(rb.samples, train.model.args.moe.num_experts))
    metrics = train.train_step(scrambled_batch, zero, loss_normalizer=1.0)
    assert metrics["moe/route_mismatch_frac"] > 0.5


def test_replay_without_routes_is_refused(tmp_path):
    from rollout_testutil import tiny_dense

    train = NativeTrainEngine(TrainEngineConfig(), models.from_pretrained(save(tiny_dense(), tmp_path)))
    rb = RolloutBatch([Sample(prompt_ids=[1, 2], response_ids=[3])])
    with pytest.raises(ValueError, match="routing_replay"):
        train.forward_logprobs(rb, options=ForwardOptions(routing_replay=True))


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_replayed_moe_layer_equals_a_per_token_loop(kind, tmp_path):
    """The MoE layer under replay against a naive loop: each token through its forced experts, weighted
    by the current router's scores of those experts (renormalised, scaled), plus shared experts."""
    hf = tiny_moe(seed=3) if kind == "qwen3_moe" else tiny_deepseek(seed=3)
    model = models.from_pretrained(save(hf, tmp_path))
    moe = next(iter(model.moe_layers().values()))
    a = moe.router.args
    gen = torch.Generator().manual_seed(1)
    x_TD = torch.randn(7, model.args.hidden_size, generator=gen)
    forced_TK = torch.rand(7, a.num_experts, generator=gen).argsort(-1)[:, : a.top_k]
    forced_TK[2] = -1  # no recorded route: the router's own choice
    with torch.no_grad():
        got = moe(x_TD, forced_TK, True)
        own_TK = moe.last_experts_TK[2]
        logits_TE = x_TD @ moe.router.gate.weight.T
        scores_TE = logits_TE.softmax(-1) if a.score_func == "softmax" else logits_TE.sigmoid()
        want = torch.zeros_like(x_TD)
        for t in range(7):
            experts = own_TK if t == 2 else forced_TK[t]
            w = scores_TE[t, experts]
            if a.norm_topk_prob:
                w = w / w.sum()
            if a.score_func == "sigmoid":
                w = w * a.routed_scaling_factor
            for e, we in zip(experts.tolist(), w):
                ex = moe.experts
                h = torch.nn.functional.silu(x_TD[t] @ ex.w1[e].T) * (x_TD[t] @ ex.w3[e].T)
                want[t] += we * (h @ ex.w2[e].T)
        if moe.shared_experts is not None:
            want += moe.shared_experts(x_TD)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("replay", ["none", "rollout"])
def test_rl_run_on_a_tiny_moe_with_and_without_replay(tiny_moe_checkpoint, tmp_path, replay):
    """The whole loop on a tiny Qwen3-MoE, as `rlloom train` runs it: the rollout's routes reach the
    trainer, the mismatch is reported, and with replay (fp32, CPU) training sees the rollout's
    experts: mismatch 0, train-vs-rollout logprob gap ~0."""
    import json

    from rlloom.config import load_config
    from rlloom.trainer.run import run

    cfg = load_config(
        "arithmetic_smoke",
        [
            f"model.path={tiny_moe_checkpoint}", f"trainer.run_dir={tmp_path / 'run'}", "data.num_eval=0",
            "data.num_train=32", "rollout.max_new_tokens=6", "logging.console=false", "train.lr=3e-2",
            "trainer.total_steps=2", f"algorithm.routing_replay={replay}", "trainer.num_mini_batches=2",
            "cluster.device=cpu",
        ],
    )  # fmt: skip
    run(cfg)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert len(steps) == 2
    for r in steps:
        assert "moe/route_mismatch_frac" in r and "moe/load_max_over_mean" in r
        assert r["rollout/logp_gap_abs"] < 1e-4
        if replay == "rollout":
            assert r["moe/route_mismatch_frac"] < 1e-9
