"""Agents trained as a user starts them: `rlloom train` with `rollout.agent` naming a function that
talks to its session through the official `openai` client; the ledger's tokens are exact (training's
logprobs equal the rollout's), also across a weight update in the asynchronous mode; agents that fail
cost only their trajectory; and on Ray, a rollout actor killed under the sessions costs nothing but
its wait (the run ends as the uninterrupted one)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from rlloom.cli import main

HERE = Path(__file__).parent


def _train(ckpt: Path, run_dir: Path, *extra: str) -> list[dict]:
    args = [
        f"model.path={ckpt}",
        f"trainer.run_dir={run_dir}",
        "data.num_train=64",
        "data.num_eval=0",
        "rollout.max_new_tokens=8",
        "logging.console=false",
        "trainer.save_hf_every=-1",
        f"reward.import_dir={HERE}",
        *extra,
    ]
    assert main(["train", "arithmetic_smoke", *args]) == 0
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


THREADS = "rollout.env_workers=0"
"""Agents in threads of the trainer, for the tests that do not check where an agent runs: a worker
process per agent imports openai, more CPU than such a run (the workers' isolation is
test_failing_agents_cost_only_their_trajectory's)."""


def test_an_openai_client_agent_trains_on_its_exact_tokens(tiny_checkpoint, tmp_path):
    run = tmp_path / "run"
    metrics = _train(
        tiny_checkpoint,
        run,
        "rollout.agent=agent_fns:two_turns",
        "trainer.total_steps=2",
        "train.lr=1e-2",
        THREADS,
        "trainer.seed=1",
    )
    assert len(metrics) == 2
    for m in metrics:
        assert m["rollout/turns_mean"] == 2.0 and m["rollout/agent_errors"] == 0.0
        # one sample per session: the second request extended the first (the tool message masked)
        assert m["rollout/env_tokens_mean"] > 0
        # training's logprobs of the sampled tokens equal the rollout's: the ledger is exact
        assert abs(m["rollout/token_mult_prob_error"] - 1.0) < 1e-5
    records = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    for r in records:
        assert r["turns"] == 2
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert r["messages"][2]["content"] == "42" and r["response"] == r["messages"][3]["content"]


def test_per_turn_samples_are_exact_too(tiny_checkpoint, tmp_path):
    metrics = _train(
        tiny_checkpoint,
        tmp_path / "run",
        "rollout.agent=agent_fns:two_turns",
        "rollout.multi_turn_samples=per_turn",
        THREADS,
        "trainer.total_steps=1",
    )
    assert metrics[0]["rollout/turns_mean"] == 2.0
    assert metrics[0]["rollout/env_tokens_mean"] == 0.0  # each request its own sample: nothing masked
    assert abs(metrics[0]["rollout/token_mult_prob_error"] - 1.0) < 1e-5


def test_a_streamed_turn_is_sent_while_it_is_sampled_and_trains_exactly(
    tiny_checkpoint, tmp_path, monkeypatch
):
    import rlloom.agents.driver as driver

    deltas = []  # what the driver sent from the engine's progress, before the answers
    delta = driver.Delta
    monkeypatch.setattr(driver, "Delta", lambda **kw: deltas.append(kw) or delta(**kw))
    m = _train(
        tiny_checkpoint,
        tmp_path / "run",
        "rollout.agent=agent_fns:streamed_then_whole",
        "trainer.total_steps=1",
        THREADS,
    )[0]
    assert len(deltas) > 1 and m["env/chunks"] > 1
    assert m["rollout/turns_mean"] == 2.0 and m["rollout/agent_errors"] == 0.0
    assert m["rollout/env_tokens_mean"] > 0  # the streamed content, sent back, extends the session
    assert abs(m["rollout/token_mult_prob_error"] - 1.0) < 1e-5


def test_streamed_turns_interrupted_by_a_weight_update_resume_from_what_the_agents_read(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """trainer.mode=async with rollout.partial=drop: a weight update aborts the agents' streamed turns
    in flight; they resume from the tokens their agents have read (none of them discarded, where
    before they were sampled again under the new weights: the agent had read other tokens than those
    trained), and training's logprobs still equal the rollout's."""
    from rlloom.engines.rollout.native.engine import NativeEngine

    step = NativeEngine.step
    # 20 ms a decode step: turns are still being sampled when the weights change, on any machine
    monkeypatch.setattr(NativeEngine, "step", lambda engine: time.sleep(0.02) or step(engine))
    metrics = _train(
        tiny_checkpoint,
        tmp_path / "run",
        "rollout.agent=agent_fns:streamed_turns",
        "trainer.mode=async",
        "rollout.partial=drop",
        "trainer.total_steps=3",
    )
    assert sum(m["async/tokens_interrupted"] for m in metrics) > 0
    for m in metrics:
        assert m["async/tokens_discarded"] == 0.0
        assert m["rollout/turns_mean"] == 2.0 and m["rollout/agent_errors"] == 0.0
        assert abs(m["rollout/token_mult_prob_error"] - 1.0) < 1e-5


def test_an_agent_prefills_and_samples_what_the_environment_path_does(tiny_checkpoint, tmp_path, monkeypatch):
    """A group's n sessions send the same first request: the engine prefills it once and forks the
    samples, as for an environment's first turn; the tokens and logprobs are the environment path's."""
    import rlloom.agents.driver as driver
    from rlloom.engines.rollout.native.model_runner import ModelRunner

    # Every agent has a thread here (THREADS: 8 of them): its group's first requests are waited for
    # whatever the load.
    monkeypatch.setattr(driver, "HOLD_S", 600.0)
    prefilled = []  # tokens each prefill computed (those the prefix cache held are not)
    prefill = ModelRunner._prefill
    monkeypatch.setattr(
        ModelRunner,
        "_prefill",
        lambda self, seqs: (
            prefilled.append(sum(s.num_tokens - s.num_cached_tokens for s in seqs)) or prefill(self, seqs)
        ),
    )
    runs = {}
    for kind in ("env", "agent"):
        prefilled.clear()
        run = tmp_path / kind
        plugin = (
            "rollout.env=agent_fns:ToolThenDone"
            if kind == "env"
            else "rollout.agent=agent_fns:tool_then_done"
        )
        m = _train(
            tiny_checkpoint,
            run,
            plugin,
            "rollout.max_new_tokens=24",
            'rollout.stop_strings=["a","e","i","o"]',
            "rollout.n_samples=4",
            "trainer.total_steps=1",
            THREADS,
        )[0]
        records = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
        runs[kind] = (sum(prefilled), m, [(r["response"], r["turns"]) for r in records])
    (env_tokens, env, env_records), (agent_tokens, agent, agent_records) = runs["env"], runs["agent"]
    assert agent_tokens == env_tokens  # before: each session's first request prefilled on its own
    assert agent["rollout/turns_mean"] == env["rollout/turns_mean"] > 1.0
    for k in (
        "response/length_mean",
        "rollout/env_tokens_mean",
        "rollout/token_mult_prob_error",
        "reward/mean",
    ):
        assert agent[k] == env[k], k
    assert agent_records == env_records


def test_failing_agents_cost_only_their_trajectory(tiny_checkpoint, tmp_path):
    kinds = ["ok", "hang", "exit", "crash", "raise", "garbage"]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"row {k}", "answer": k}) + "\n" for k in kinds))
    metrics = _train(
        tiny_checkpoint,
        tmp_path / "run",
        "rollout.agent=agent_fns:faulty",
        "rollout.agent_timeout_s=10",
        "rollout.n_samples=2",
        "rollout.env_workers=6",
        "trainer.prompts_per_step=6",
        "trainer.total_steps=1",
        "data.task=jsonl",
        f"data.path={data}",
        "data.num_train=6",
        "reward.default_score=-1",
    )
    m = metrics[0]
    assert m["rollout/agent_errors"] == 10.0 and m["env/calls"] == 2 / 12
    assert m["reward/mean"] == (2.0 - 10.0) / 12  # the good agents' 1.0, default_score for the rest


def test_bad_agents_are_one_line_before_the_model_loads(tiny_checkpoint, tmp_path, capsys):
    for setting, expected in [
        ("rollout.agent=agent_fns:missing", "has no 'missing'"),
        ("rollout.agent=agent_fns:one_argument", "wrong signature"),
        ("rollout.agent=no_such_module:run", "cannot import module"),
        ("rollout.agent=agent_fns", "is not 'module:name'"),
    ]:
        args = [
            f"model.path={tiny_checkpoint}",
            f"trainer.run_dir={tmp_path / 'run'}",
            f"reward.import_dir={HERE}",
        ]
        assert main(["train", "arithmetic_smoke", *args, setting]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("rlloom: error: rollout.agent=") and expected in err[0], (
            err
        )
    both = ["rollout.agent=agent_fns:two_turns", "rollout.env=x:Y", f"model.path={tiny_checkpoint}"]
    assert main(["train", "arithmetic_smoke", *both]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "excludes rollout.env" in err[0]


def test_an_agent_on_rows_with_pictures_is_one_line_before_the_model_loads(tmp_path, capsys):
    """The agent's requests would carry no pictures (the OpenAI endpoint takes chat text)."""
    from rlloom.models.tiny import write_tiny_model

    model = write_tiny_model("tiny-vl", tmp_path / "model")
    capsys.readouterr()  # the writer's progress bar
    args = [f"model.path={model}", f"reward.import_dir={HERE}", "rollout.agent=agent_fns:two_turns"]
    assert main(["train", "visual_colour", *args, f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlloom: error: rollout.agent=") and "pictures" in err[0], err


RAY_ARGS = ("rollout.agent=agent_fns:two_turns", "trainer.total_steps=2", "train.lr=3e-2")


@pytest.fixture(scope="module")
def inline_two_turns(tiny_checkpoint, tmp_path_factory) -> list[dict]:
    """The one-process run the Ray runs are compared with."""
    return _train(tiny_checkpoint, tmp_path_factory.mktemp("inline"), *RAY_ARGS, THREADS)


@pytest.mark.slow  # a Ray start and a replacement: 60-150 s on 2 cores
def test_a_killed_rollout_actor_sends_the_sessions_requests_again_and_the_run_equals_inline(
    ray_cluster, tiny_checkpoint, inline_two_turns, tmp_path, monkeypatch, capsys
):
    """kill -9 of the rollout actor while a session's streamed second turn is being sampled (step 2,
    separate placement): the replica is replaced in place and the requests it held, that turn's among
    them, are sent again with their seeds, so the agents get the answers of the uninterrupted run
    (the inline one, whose agents do not stream: the same tokens), one restart counted."""
    on_ray = _train_killing(
        tiny_checkpoint, tmp_path, monkeypatch, "cluster.placement=separate", "cluster.rollout_workers=1"
    )
    _, pid = (tmp_path / "killed-rollout-0").read_text().split()
    assert int(pid) not in {a["pid"] for a in json.loads((tmp_path / "actors.json").read_text())}
    assert [m.get("cluster/rollout_restarts") for m in on_ray] == [None, 1.0]
    sent_again = re.search(r"replica 0 replaced in .* s, (\d+) requests sent again", capsys.readouterr().err)
    assert sent_again and int(sent_again[1]) >= 1, "requests were in flight at the kill"
    _assert_same_run(inline_two_turns, on_ray)


@pytest.mark.slow  # a Ray start and a restart: 60-150 s on 2 cores
def test_a_killed_colocated_actor_restarts_the_sessions_from_the_checkpoint_and_the_run_equals_inline(
    ray_cluster, tiny_checkpoint, inline_two_turns, tmp_path, monkeypatch
):
    """The same kill with colocated placement (the default), where the dead actor also trained: the
    run starts again from step 1's checkpoint by itself, its agents and endpoint with it (the killed
    step's sessions are dropped, their agents' workers stopped), and ends as the uninterrupted run
    (step 1 on Ray as inline, step 2 after the restart as inline)."""
    on_ray = _train_killing(tiny_checkpoint, tmp_path, monkeypatch, "trainer.save_every=1")
    assert [m.get("cluster/train_restarts") for m in on_ray] == [None, 1.0]
    _assert_same_run(inline_two_turns, on_ray)


@pytest.mark.slow  # a Ray start and a replacement: 60-150 s on 2 cores
def test_a_replacement_that_samples_other_tokens_trains_what_the_agents_read(
    ray_cluster, tiny_checkpoint, tmp_path, monkeypatch
):
    """The separate placement's kill with a replacement actor that draws other tokens for the same
    seeds (`RLLOOM_FAULT_RESEED`), as a GPU replay in another batch may: the streamed turn in flight
    goes on from the tokens its agent was sent, so every trained conversation is the one its agent
    read (before: that turn was sampled again from its start, and the agent had read other tokens
    than those trained), and training's logprobs still equal the rollout's."""
    monkeypatch.setenv("RLLOOM_FAULT_RESEED", str(tmp_path / "killed-rollout-0"))
    on_ray = _train_killing(
        tiny_checkpoint,
        tmp_path,
        monkeypatch,
        "cluster.placement=separate",
        "cluster.rollout_workers=1",
        "logging.samples_per_step=64",
    )
    assert [m.get("cluster/rollout_restarts") for m in on_ray] == [None, 1.0]
    assert all(abs(m["rollout/token_mult_prob_error"] - 1.0) < 1e-5 for m in on_ray)
    read = [json.loads(x) for x in (tmp_path / "read.jsonl").read_text().splitlines()]
    # each session's whole conversation (a first answer the template does not read back as sampled
    # is a sample of its own besides)
    trained = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    trained = [r for r in trained if len(r["messages"]) == 4]
    assert len(trained) == len(read) > 0
    for r in trained:
        asked, answer = [m["content"] for m in r["messages"][:3]], r["messages"][3]["content"]
        assert {"asked": asked, "read": answer} in read, (r["step"], asked, answer)


def _train_killing(ckpt: Path, run_dir: Path, monkeypatch, *extra: str) -> list[dict]:
    """A Ray run whose agents kill the rollout actor in step 2 (`agent_fns.two_turns_killing`)."""
    monkeypatch.setenv("KILL_ACTOR_DIR", str(run_dir))
    return _train(
        ckpt,
        run_dir,
        *RAY_ARGS[1:],
        "rollout.agent=agent_fns:two_turns_killing",
        "cluster.mode=ray",
        "cluster.num_workers=1",
        "cluster.timeout_s=300",  # actors start slowly on a busy 2-core machine; a death is seen at once
        *extra,
    )


def _assert_same_run(a: list[dict], b: list[dict]) -> None:
    """Metrics of two runs equal, up to float32 rounding (the timings aside)."""
    for ra, rb in zip(a, b, strict=True):
        for k, v in ra.items():
            if k.startswith(("time/", "perf/", "memory/", "sync/")):
                continue
            # the train-rollout gap is float32 rounding (~1e-7 either way): an absolute bound
            tol = 2e-6 if k.startswith("rollout/logp_gap") else 1e-5 * abs(v) + 1e-7
            assert abs(v - rb[k]) <= tol, (ra["step"], k, v, rb[k])
