"""Weight sync completeness, the on-policy ratio, and every algorithm option reachable from config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlloom.cluster.build import build_groups
from rlloom.config import load_config
from rlloom.data.control_tokens import ResponseDecoder
from rlloom.models.adapter import hf_named_tensors
from rlloom.models.checkpoint import load_tokenizer
from rlloom.rewards.build import build_reward_runner
from rlloom.tasks.build import build_task_source
from rlloom.trainer.step import StepContext, rl_step
from rlloom.weight_sync.checksum import digest

sys.path.insert(0, str(Path(__file__).parents[1]))
from tests.conftest import build_tiny_checkpoint  # noqa: E402


def tiny_cfg(ckpt: Path, tmp: Path, *extra: str):
    return load_config(
        "arithmetic_smoke",
        [
            f"model.path={ckpt}",
            f"trainer.run_dir={tmp}",
            "rollout.max_new_tokens=5",
            "data.num_train=64",
            *extra,
        ],
    )


def make_ctx(cfg) -> StepContext:
    tok = load_tokenizer(cfg.model.path)
    groups = build_groups(cfg)
    return StepContext(
        cfg=cfg,
        train_group=groups.train,
        rollout_group=groups.rollout,
        weight_sync=groups.sync,
        source=build_task_source(cfg.data, tok, "train"),
        runner=build_reward_runner(cfg.reward, task=cfg.data.task),
        decode=ResponseDecoder.of(tok),
        stop_token_ids=[tok.eos_token_id],
    )


class Recorder:
    """Wraps the rollout engine's update_weights to record what each sync delivered."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []
        self._orig = engine.update_weights

    def __call__(self, named, version):
        named = list(named)
        self.calls.append((version, [(n, tuple(t.shape), digest(t)) for n, t in named]))
        return self._orig(named, version)


@pytest.mark.parametrize("tied", [True, False])
def test_every_rollout_parameter_receives_exactly_one_tensor(tiny_checkpoint, tmp_path, tied):
    ckpt = tiny_checkpoint if tied else _untied_checkpoint(tmp_path)
    cfg = tiny_cfg(ckpt, tmp_path)
    ctx = make_ctx(cfg)
    engine = ctx.rollout_group.worker.engine
    rec = Recorder(engine)
    engine.update_weights = rec
    expected = {n: tuple(t.shape) for n, t in hf_named_tensors(engine.model)}
    assert ("lm_head.weight" in expected) == (not tied)
    for step in range(2):
        rl_step(ctx, step)
        version, sent = rec.calls[-1]
        assert version == step + 1 == engine.policy_version == ctx.rollout_group.version
        names = [n for n, _, _ in sent]
        assert len(names) == len(set(names)), "a tensor was sent twice"
        assert {n: s for n, s, _ in sent} == expected
        # What the rollout engine now holds is exactly what the trainer sent, tensor by tensor.
        held = {n: digest(t) for n, t in hf_named_tensors(engine.model)}
        assert held == {n: c for n, _, c in sent}
    assert len(rec.calls) == 2


def _untied_checkpoint(tmp_path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    src = build_tiny_checkpoint(tmp_path / "tied_src")
    config = AutoConfig.from_pretrained(src)
    config.tie_word_embeddings = False
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    out = tmp_path / "untied"
    model.save_pretrained(out)
    for f in src.glob("tokenizer*"):
        (out / f.name).write_bytes(f.read_bytes())
    for f in src.glob("*.jinja"):
        (out / f.name).write_bytes(f.read_bytes())
    return out


def test_first_minibatch_of_on_policy_step_has_ratio_exactly_one(tiny_checkpoint, tmp_path):
    cfg = tiny_cfg(tiny_checkpoint, tmp_path, "trainer.num_mini_batches=2", "rollout.temperature=0.7")
    ctx = make_ctx(cfg)
    seen = []
    orig = ctx.train_group.update_policy
    ctx.train_group.update_policy = lambda update: seen.append(orig(update)) or seen[-1]
    rl_step(ctx, 0)
    assert len(seen) == 2
    first = {k: m.value for k, m in seen[0].result().items()}
    assert first["loss/ratio_mean"] == 1.0
    assert first["loss/clipfrac_low"] == 0.0 and first["loss/clipfrac_high"] == 0.0
    assert first["loss/approx_kl"] == 0.0


def test_single_pass_step_skips_old_logprob_forward(tiny_checkpoint, tmp_path):
    ctx = make_ctx(tiny_cfg(tiny_checkpoint, tmp_path))
    calls = []
    ctx.train_group.old_logprobs = lambda batch: calls.append(batch)
    m = rl_step(ctx, 0)
    assert calls == [] and m["loss/ratio_mean"] == 1.0


OPTIONS = [
    ["algorithm.estimator=dr_grpo", "algorithm.agg_mode=seq-mean-token-sum-norm"],
    ["algorithm.estimator=rloo", "algorithm.agg_mode=seq-mean-token-mean"],
    ["algorithm.estimator=reinforce_pp", "algorithm.agg_mode=token-sum"],
    ["algorithm.estimator=reinforce_pp_baseline", "algorithm.agg_mode=seq-mean-token-sum"],
    [
        "algorithm.loss=gspo",
        "algorithm.eps_low=0.0003",
        "algorithm.eps_high=0.0004",
        "trainer.num_mini_batches=2",
    ],
    ["algorithm.loss=cispo", "algorithm.eps_high=0.28", "trainer.ppo_epochs=2"],
    ["algorithm.dual_clip_c=3.0", "algorithm.eps_high=0.28", "trainer.num_mini_batches=2"],
    ["algorithm.kl_coef=0.01", "algorithm.kl_kind=k3", "algorithm.entropy_coef=0.001"],
    ["algorithm.is_correction=tis", "algorithm.is_level=sequence"],
    ["algorithm.is_correction=mis", "algorithm.is_low=0.5"],
    ["algorithm.use_rollout_logprobs=true", "trainer.num_mini_batches=2"],
    ["algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=2", "algorithm.overlong_buffer=2"],
]


def test_every_algorithm_option_trains(tiny_checkpoint, tmp_path):
    base = tiny_cfg(tiny_checkpoint, tmp_path, "algorithm.kl_coef=0.01")  # builds the reference once
    ctx = make_ctx(base)
    for step, extra in enumerate(OPTIONS):
        cfg = tiny_cfg(tiny_checkpoint, tmp_path, *extra)
        ctx.cfg = ctx.train_group.worker.cfg = cfg
        m = rl_step(ctx, step)
        assert m.get("train/skipped_step", 0.0) == 0.0 or "algorithm.dynamic_sampling=true" in extra, extra
        if "train/loss" in m:
            assert torch.isfinite(torch.tensor(m["train/loss"])), extra
        if cfg.algorithm.kl_coef > 0:
            assert "loss/kl" in m and m["loss/kl"] >= 0
        if cfg.algorithm.is_correction != "none":
            assert "is/weight_mean" in m and "rollout/logp_gap_abs" in m
        if cfg.algorithm.dynamic_sampling:
            assert m["rollout/groups_kept"] <= cfg.trainer.prompts_per_step


def test_rollout_batch_logprobs_match_trainer_recompute(tiny_checkpoint, tmp_path):
    """Same model code on both sides: the train-vs-rollout logprob gap is ~0 in fp32."""
    cfg = tiny_cfg(tiny_checkpoint, tmp_path, "algorithm.is_correction=tis")
    ctx = make_ctx(cfg)
    m = rl_step(ctx, 0)
    assert m["rollout/logp_gap_abs"] < 1e-5
