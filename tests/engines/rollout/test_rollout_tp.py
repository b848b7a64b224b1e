"""rollout.tp = 2 (two gloo processes on CPU, fp32) against rollout.tp = 1: the same greedy tokens, the
same seeded (and engine-seeded) samples, logprobs within 1e-5, with prefix sharing (n > 1), prompts of
different lengths, top-k/top-p, a dense model with split KV heads, a tied-embedding Qwen3-MoE with a
replicated KV head and a padded vocabulary, DeepSeek-V3 MLA (these two built by build_rollout_engine,
each rank loading only its shard), and weight updates (full and sliced)."""

from __future__ import annotations

import pytest
import torch
from procs import spawn
from rollout_testutil import prompts, save, tiny_dense, tiny_mla, tiny_moe_tied
from tp_testutil import run_job, run_rank

from rlloom.config import ConfigError, RolloutConfig
from rlloom.engines.rollout.native import SamplingParams

MIXED = [
    SamplingParams(n=1, temperature=0.0, max_new_tokens=8),
    SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=11),
    SamplingParams(n=2, temperature=0.7, max_new_tokens=8, seed=12),
]


def _jobs(tmp_path) -> dict[str, dict]:
    dense, moe, mla = (
        save(m, tmp_path / n) for m, n in [(tiny_dense(0), "d"), (tiny_moe_tied(0), "m"), (tiny_mla(0), "a")]
    )
    dense_1, dense_2 = save(tiny_dense(1), tmp_path / "d1"), save(tiny_dense(2), tmp_path / "d2")
    batch = prompts(6, max_len=20, seed=3)
    mixed = [MIXED[i % 3] for i in range(len(batch))]
    unseeded = SamplingParams(n=3, temperature=1.0, max_new_tokens=6)
    truncated = SamplingParams(n=2, temperature=0.9, top_k=5, top_p=0.8, max_new_tokens=6, seed=5)
    return {
        "dense": {
            "path": dense,
            "steps": [
                ("generate", batch, mixed),
                ("generate", batch[:3], unseeded),
                ("generate", batch[:3], truncated),
                ("dims",),
            ],
        },
        "moe": {
            "path": moe,
            "build": True,
            "steps": [("generate", [[min(t, 99) for t in p] for p in batch], mixed)],
        },
        "mla": {"path": mla, "build": True, "steps": [("generate", batch, mixed)]},
        "update": {
            "path": dense,
            "steps": [
                ("update", dense_1, False),
                ("generate", batch, mixed),
                ("update", dense_2, True),
                ("generate", batch, mixed),
            ],
        },
    }


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    jobs = _jobs(tmp)
    ranks = spawn(run_rank, args=(2, str(tmp / "rendezvous"), jobs, str(tmp / "out")), nprocs=2, join=False)
    reference = {name: run_job(job, None) for name, job in jobs.items()}  # while the ranks run
    while not ranks.join():
        pass
    return reference, [torch.load(tmp / f"out.{r}", weights_only=False) for r in range(2)]


def _assert_same(got, want, atol=1e-5):
    assert [(p, s, t, f) for p, s, t, _, f in got] == [(p, s, t, f) for p, s, t, _, f in want]
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[3], w[3]))
    assert worst <= atol, worst


@pytest.mark.slow
@pytest.mark.parametrize("job", ["dense", "moe", "mla", "update"])
def test_tp2_matches_tp1(tp_runs, job):
    reference, ranks = tp_runs
    want_runs = [r for r in reference[job] if isinstance(r, list)]
    for rank in ranks:  # every rank of the replica returns the same completions
        got_runs = [r for r in rank[job] if isinstance(r, list)]
        assert len(got_runs) == len(want_runs)
        for got, want in zip(got_runs, want_runs):
            _assert_same(got, want)


@pytest.mark.slow
def test_update_changes_outputs(tp_runs):
    """The weight updates change the samples, so the update job's agreement is not the old model's."""
    reference, _ = tp_runs
    before = [t for _, _, t, _, _ in reference["dense"][0]]
    after_full, after_sliced = ([t for _, _, t, _, _ in r] for r in reference["update"])
    assert before != after_full and after_full != after_sliced


@pytest.mark.slow
def test_shard_spec(tp_runs):
    reference, ranks = tp_runs
    assert set(reference["dense"][-1].values()) == {None}  # tp = 1: every rank holds every tensor
    dims = ranks[0]["dense"][-1]
    assert dims.keys() == reference["dense"][-1].keys()
    assert dims["model.layers.0.self_attn.q_proj.weight"] == 0
    assert dims["model.layers.0.self_attn.o_proj.weight"] == 1
    assert dims["model.layers.1.mlp.down_proj.weight"] == 1
    assert dims["model.embed_tokens.weight"] == 0 and dims["lm_head.weight"] == 0
    assert dims["model.layers.0.input_layernorm.weight"] is None
    assert dims["model.layers.0.self_attn.q_norm.weight"] is None


def test_rollout_tp_config():
    assert RolloutConfig(tp=2).tp == 2
    with pytest.raises(ConfigError, match=r"rollout.tp=0 is invalid: must be >= 1"):
        RolloutConfig(tp=0)


def test_build_refuses_a_group_of_another_size():
    from rlloom.config.loading import load_config
    from rlloom.engines.rollout.build import build_rollout_engine

    cfg = load_config("arithmetic_smoke", ["rollout.tp=2", "cluster.mode=ray", "cluster.num_workers=2"])
    with pytest.raises(ValueError, match=r"rollout.tp=2 but the rollout engine was given .* of 1 ranks"):
        build_rollout_engine(cfg, device=torch.device("cpu"), dtype=torch.float32)


def test_tp_problem_names_the_setting():
    from rlloom.engines.rollout.native.tensor_parallel import tp_problem
    from rlloom.models import ModelArgs

    def args(heads: int, kv_heads: int) -> ModelArgs:
        return ModelArgs.from_hf_config(
            {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 8, "intermediate_size": 96}
        )  # fmt: skip

    assert tp_problem(args(8, 4), 2) is None and tp_problem(args(8, 4), 8) is None  # 8 > 4: KV replicated
    assert tp_problem(args(8, 4), 3) == (
        "rollout.tp=3 must divide num_attention_heads=8. Fix: choose a rollout.tp that divides them (e.g. 1 or 2)."
    )
    assert "must divide num_key_value_heads=3 or be a multiple of it" in tp_problem(args(6, 3), 2)


def test_run_refuses_a_degree_that_does_not_split_the_model(tiny_checkpoint, tmp_path):
    from rlloom.config.loading import load_config
    from rlloom.trainer.run import run

    cfg = load_config(
        "arithmetic_smoke",
        [
            f"model.path={tiny_checkpoint}",
            f"trainer.run_dir={tmp_path}",
            "rollout.tp=3",
            "cluster.mode=ray",
            "cluster.num_workers=3",
        ],
    )
    with pytest.raises(ConfigError, match=r"^rollout.tp=3 must divide num_attention_heads=4\. Fix: "):
        run(cfg)
