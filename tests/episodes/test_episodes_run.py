"""Multi-turn RL as a user starts it: `rlloom train` with `rollout.env` / `rollout.tools` on the tiny
model, against the plain single-turn run and across trainer modes and Ray; bad settings refused in
one line before the model loads; and the loss masks (observation tokens never reach the gradient)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

from rlloom.cli import main
from rlloom.cluster.build import build_groups
from rlloom.config import load_config
from rlloom.data.types import RolloutBatch, Sample
from rlloom.observability.metrics import MetricsAccumulator
from rlloom.trainer.policy import build_update

HERE = Path(__file__).parent


def tiny_args(ckpt: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.path={ckpt}",
        f"trainer.run_dir={run_dir}",
        "data.num_train=64",
        "rollout.max_new_tokens=5",
        "logging.console=false",
        "rollout.kv_cache_memory_gb=0.05",  # 200k tokens of the tiny model; zeroing 1 GiB cost 14% of a run
        "trainer.save_hf_every=-1",
        *extra,
    ]


def read_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "perf/", "memory/"))}
        for x in lines
    ]


# Every printable character stops a turn: the random tiny model's turns end with "stop", not "length".
STOP_ANY = "rollout.stop_strings=" + json.dumps([c for c in string.ascii_letters + string.digits])
ENV = [f"reward.import_dir={HERE}", STOP_ANY, "rollout.max_new_tokens=8", "data.num_eval=0"]


def _train(ckpt, run_dir, *extra) -> list[dict]:
    assert main(["train", "arithmetic_smoke", *tiny_args(ckpt, run_dir, *extra)]) == 0
    return read_metrics(run_dir)


def _close(a: list[dict], b: list[dict], rel: float = 1e-6) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for k, v in ra.items():
            if k.startswith(("sync/", "rollout/turns", "rollout/tool", "rollout/env", "env/")):
                continue
            assert k in rb, k
            # rel, plus 1e-7 absolute for near-zero differences of logprobs (the prefill batches differ)
            assert abs(v - rb[k]) <= rel * abs(v) + 1e-7, (ra["step"], k, v, rb[k])


def test_three_turn_environment_through_the_cli(tiny_checkpoint, tmp_path):
    run = tmp_path / "run"
    metrics = _train(
        tiny_checkpoint,
        run,
        *ENV,
        "rollout.env=episode_envs:Turns",
        "trainer.total_steps=2",
        "trainer.num_mini_batches=2",
        "train.lr=1e-2",
    )
    for m in metrics[1:]:
        assert m["rollout/turns_mean"] == 3.0 and m["rollout/env_errors"] == 0.0
        assert m["rollout/env_tokens_mean"] > 0 and m["env/steps"] == 3.0 and m["reward/mean"] == 1.0
        # training's logprobs of the sampled tokens equal the rollout's: the bookkeeping is exact
        assert abs(m["rollout/token_mult_prob_error"] - 1.0) < 1e-5
        assert m["rollout/logp_gap_max"] < 1e-5  # over the loss-masked tokens only: env tokens have none
    records = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    for r in records:
        assert r["turns"] == 3
        texts = [m["content"] for m in r["messages"]]
        assert "observation 1" in texts and "observation 2" in texts
        assert [m["role"] for m in r["messages"]] == [
            "user",
            "assistant",
            "user",
            "assistant",
            "user",
            "assistant",
        ]


def test_a_one_turn_environment_is_the_single_turn_run(tiny_checkpoint, tmp_path):
    common = ["trainer.total_steps=3", "train.lr=3e-2", "data.num_eval=0"]
    plain = _train(tiny_checkpoint, tmp_path / "plain", *common)
    env = _train(
        tiny_checkpoint,
        tmp_path / "env",
        *common,
        f"reward.import_dir={HERE}",
        "rollout.env=episode_envs:Turns",
        "rollout.env_kwargs={turns: 1, reward: null}",
        "rollout.env_workers=0",
    )
    assert env[1]["rollout/turns_mean"] == 1.0
    _close(plain, env)


def test_the_environment_in_async_mode_equals_sync(tiny_checkpoint, tmp_path):
    args = [*ENV, "rollout.env=episode_envs:Turns", "trainer.total_steps=2", "train.lr=3e-2"]
    sync = _train(tiny_checkpoint, tmp_path / "sync", *args)
    async_ = _train(
        tiny_checkpoint,
        tmp_path / "async",
        *args,
        "trainer.mode=async",
        "trainer.max_staleness=0",
        "algorithm.is_correction=tis",
    )
    _close(sync, async_, rel=1e-5)


@pytest.mark.slow  # a Ray start: 30-90 s on 2 cores
def test_the_environment_on_ray_equals_inline(ray_cluster, tiny_checkpoint, tmp_path):
    args = [*ENV, "rollout.env=episode_envs:Turns", "trainer.total_steps=2", "train.lr=3e-2"]
    inline = _train(tiny_checkpoint, tmp_path / "inline", *args)
    colocated = _train(
        tiny_checkpoint, tmp_path / "colocated", *args, "cluster.mode=ray", "cluster.num_workers=1"
    )
    _close(inline, colocated, rel=1e-5)
    separate = _train(
        tiny_checkpoint,
        tmp_path / "separate",
        *args,
        "cluster.mode=ray",
        "cluster.num_workers=1",
        "cluster.placement=separate",
        "cluster.rollout_workers=1",
    )
    _close(inline, separate, rel=1e-5)


@pytest.mark.parametrize(
    "setting, message",
    [
        ("rollout.env=no_such_module:Env", "cannot import module 'no_such_module'"),
        ("rollout.env=episode_envs:Nope", "has no 'Nope'"),
        ("rollout.env=episode_envs:WrongSignature", "step has the wrong signature"),
        ("rollout.env=episode_envs:add", "is not a class"),
        ("rollout.tools=[episode_envs:no_docstring]", "cannot derive the JSON schema of 'no_docstring'"),
    ],
)
def test_bad_environments_and_tools_are_one_line_before_the_model_loads(
    tiny_checkpoint, tmp_path, capsys, setting, message, monkeypatch
):
    import rlloom.cluster.build as cluster_build

    monkeypatch.setattr(cluster_build, "build_groups", lambda cfg: pytest.fail("the model was loaded"))
    rc = main(
        [
            "train",
            "arithmetic_smoke",
            *tiny_args(tiny_checkpoint, tmp_path / "run", f"reward.import_dir={HERE}", setting),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("rlloom: error:") and message in err[0], err


def test_observation_tokens_never_reach_the_gradient(tiny_checkpoint, tmp_path):
    """Two batches that differ only in masked (observation) tokens after the last sampled one, and in
    the rollout logprobs of masked tokens, give the same loss and gradient; unmasked, they differ."""
    cfg = load_config("arithmetic_smoke", tiny_args(tiny_checkpoint, tmp_path, "train.lr=1e-9"))
    train = build_groups(cfg).train

    def grad_norm(obs: list[int], mask_obs: bool) -> float:
        samples = []
        for reward, sampled in ((0.0, [5, 9, 11]), (1.0, [6, 8, 12])):  # different tokens: no cancelling
            response = sampled[:2] + [20, 21] + sampled[2:] + obs
            mask = [1, 1, 0, 0, 1] + [0 if mask_obs else 1] * len(obs)
            logprobs = [-1.0, -2.0, 3.0 * len(obs), -7.0, -1.5] + [float(len(obs))] * len(obs)
            samples.append(Sample(prompt_ids=[3, 4, 5], response_ids=response, rollout_logprobs=logprobs,
                                  loss_mask=mask, reward=reward, group_id=0))  # fmt: skip
        update, _ = build_update(
            cfg.algorithm, RolloutBatch(samples), norm_constant=8, old_logp_BT=None, ref_logp_BT=None
        )
        acc = MetricsAccumulator()
        acc.add(train.update_policy(update).result())
        return acc.summary()["train/grad_norm"]

    a, b = grad_norm([30, 31], True), grad_norm([40, 41, 42, 43], True)
    assert abs(a - b) <= 1e-6 * a
    c, d = grad_norm([30, 31], False), grad_norm([40, 41, 42, 43], False)
    assert abs(c - d) > 1e-3 * c  # unmasked, the same change moves the gradient: the test can fail


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_calculator_recipe_runs_on_a_template_that_renders_tools(tmp_path):
    from tests.conftest import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    (ckpt / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    run = tmp_path / "run"
    args = [
        f"model.path={ckpt}",
        f"trainer.run_dir={run}",
        "data.num_train=16",
        "data.num_eval=0",
        "trainer.total_steps=1",
        "trainer.prompts_per_step=2",
        "rollout.n_samples=2",
        "rollout.max_new_tokens=8",
        "logging.console=false",
        "trainer.save_hf_every=-1",
        "data.max_prompt_length=512",
    ]
    assert main(["train", "calculator_tools", *args]) == 0
    [step] = read_metrics(run)  # no evaluation: no step-0 line
    assert step["rollout/turns_mean"] >= 1.0 and "rollout/tool_calls_mean" in step


def test_tools_need_a_template_that_renders_them(tiny_checkpoint, tmp_path, capsys):
    # found once the prompts are built: 18 prompts, not the recipe's 10200 (which took 2/3 of the test)
    args = [
        f"model.path={tiny_checkpoint}",
        f"trainer.run_dir={tmp_path}/run",
        "data.num_train=16",
        "data.num_eval=2",
    ]
    rc = main(["train", "calculator_tools", *args])
    err = capsys.readouterr().err
    assert rc == 2 and "does not render tools" in err


@pytest.mark.parametrize("kind", ["tiny-moe", "tiny-mla"])
def test_moe_multi_turn_with_routing_replay_is_exact(tmp_path, kind):
    """Qwen3-MoE and DeepSeek-V3 (MLA): a trajectory's routes are those of its last turn's request,
    which covers every token it fed (prefix caching is off for MoE), so routing replay trains on them."""
    from rlloom.models.tiny import write_tiny_model

    ckpt = write_tiny_model(kind, tmp_path / "ckpt")
    metrics = _train(ckpt, tmp_path / "run", *ENV, "rollout.env=episode_envs:Turns", "trainer.total_steps=2",
                     "trainer.num_mini_batches=2", "algorithm.routing_replay=rollout")  # fmt: skip
    for m in metrics:
        assert m["rollout/turns_mean"] == 3.0
        assert abs(m["rollout/token_mult_prob_error"] - 1.0) < 1e-5
        assert m["moe/route_mismatch_frac"] == 0.0


def test_a_multi_turn_run_on_pictures_reads_them_and_caches_its_turns(tmp_path, monkeypatch):
    """`rlloom train visual_colour` with a two-turn environment on a tiny Qwen2.5-VL: every turn's
    request carries its row's picture (the vision tower runs for each) and so does every sample
    (training's logprobs equal the rollout's), the second turns reuse the first turns' cached blocks
    (keyed on the pictures: the prompts' token ids are all the same), and the run equals one whose
    prefill recomputes every turn."""
    from rlloom.engines.rollout.native import block_manager, engine, vision
    from rlloom.models.tiny import write_tiny_model

    model = write_tiny_model("tiny-vl", tmp_path / "model", hidden=64)
    towers, cached_tokens = [], []
    encode, allocate = vision.encode_images, block_manager.BlockManager.allocate

    def counted_encode(*args, **kwargs):
        towers.append(1)
        return encode(*args, **kwargs)

    def counted_allocate(self, seq, prefix=None):
        allocate(self, seq, prefix)
        cached_tokens.append(seq.num_cached_tokens)

    monkeypatch.setattr(vision, "encode_images", counted_encode)
    monkeypatch.setattr(block_manager.BlockManager, "allocate", counted_allocate)

    def train(run_dir: Path) -> list[dict]:
        args = [
            f"model.path={model}", f"trainer.run_dir={run_dir}", "trainer.total_steps=2",
            "trainer.prompts_per_step=4", "rollout.n_samples=2", "data.num_eval=0", "logging.console=false",
            "rollout.kv_cache_memory_gb=0.05", "trainer.save_hf_every=-1", f"reward.import_dir={HERE}",
            "rollout.env=episode_envs:Turns", "rollout.env_kwargs={turns: 2}", "rollout.env_workers=0",
            STOP_ANY, "rollout.max_new_tokens=4", "rollout.block_size=4",
        ]  # fmt: skip
        assert main(["train", "visual_colour", *args]) == 0
        return read_metrics(run_dir)

    cached = train(tmp_path / "cached")
    for m in cached[1:]:
        assert m["rollout/turns_mean"] == 2.0 and m["rollout/env_errors"] == 0.0
        assert m["rollout/logp_gap_max"] < 1e-5  # training saw each sample's picture as the rollout did
    assert len(towers) == 2 * 4 * (1 + 2)  # per step and prompt: the first turn's request, two second turns
    assert sum(cached_tokens) > 0
    towers.clear(), cached_tokens.clear()
    monkeypatch.setattr(engine, "caches_prefixes", lambda runner: False)
    plain = train(tmp_path / "plain")
    assert sum(cached_tokens) == 0 and len(towers) == 2 * 4 * 3
    _close(cached, plain, rel=1e-5)
