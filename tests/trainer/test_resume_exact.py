"""Exact resume: a run continued from a checkpoint equals the uninterrupted run, bit for bit on CPU,
after training longer and after a kill -9 at every stage of a step and during a save.

The settings make a wrong resume visible: lr 3e-2 (after a 6-step warmup, so the schedule position
matters) with a dense reward (resume_reward.py) changes the sampled completions after one step, so a
rollout engine left on the initial weights samples other tokens; a KL term, so a reference model
taken from the checkpoint instead of the initial policy changes the loss; two mini-batches, so old
logprobs are computed and a crash can fall between two optimizer steps of one RL step; 3 training
prompts with 2 per step, so the prompt source wraps an epoch inside step 2 and step 3's checkpoint
sits exactly at an epoch end.

The crashing runs are forked from a launcher process that has imported rlloom once, so each costs
only its steps; `RLLOOM_FAULT` kills them with SIGKILL (rlloom/faults.py).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch
from test_trainer_loop import ALL_SAMPLES, final_weights, prompts_per_step, read_metrics, tiny_args, tiny_cfg

from rlloom.cli import main
from rlloom.cluster.build import build_groups
from rlloom.config import ConfigError
from rlloom.faults import parse_fault
from rlloom.models.adapter import hf_named_tensors
from rlloom.trainer.checkpoint import checkpoint_dir, complete_checkpoints, load_checkpoint
from rlloom.trainer.run import run

TOTAL = 4
EXACT = [
    "reward.name=resume_reward:digit_share",
    f"reward.import_dir={Path(__file__).parent}",
    "reward.num_workers=1",
    "train.lr=3e-2",
    "train.warmup_steps=6",
    "algorithm.kl_coef=0.1",
    "trainer.num_mini_batches=2",
    "data.num_train=3",
    "data.num_eval=0",
    "rollout.num_blocks=64",
    "trainer.save_every=1",
]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread costs a third of the CPU time of two on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def straight(one_thread, tiny_checkpoint, tmp_path_factory) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Metrics and final weights of the uninterrupted run."""
    tmp = tmp_path_factory.mktemp("straight")
    run(tiny_cfg(tiny_checkpoint, tmp / "run", *EXACT, f"trainer.total_steps={TOTAL}"))
    metrics = read_metrics(tmp / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["policy/version"] for m in metrics] == [2.0, 4.0, 6.0, 8.0]  # two optimizer steps per RL step
    assert all(m["rollout/logp_gap_abs"] < 1e-4 for m in metrics)
    return metrics, final_weights(tmp / "run", TOTAL, tmp)


def assert_matches(straight, run_dir: Path, tmp_path: Path) -> None:
    metrics = read_metrics(run_dir)
    # The rollout samples from the trained policy on the first resumed step too.
    assert all(m["rollout/logp_gap_abs"] < 1e-4 for m in metrics)
    assert metrics == straight[0]
    assert_same_weights(final_weights(run_dir, TOTAL, tmp_path), straight[1])


def test_train_longer_after_resume_equals_straight_run(straight, tiny_checkpoint, tmp_path):
    longer = tmp_path / "longer"
    run(tiny_cfg(tiny_checkpoint, longer, *EXACT, "trainer.total_steps=2"))
    run(tiny_cfg(tiny_checkpoint, longer, *EXACT, f"trainer.total_steps={TOTAL}", "trainer.resume=auto"))
    assert_matches(straight, longer, tmp_path)


def test_load_refreshes_rollout_and_keeps_reference_initial(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_cfg(tiny_checkpoint, run_dir, *EXACT, "trainer.total_steps=1")
    run(cfg)
    groups = build_groups(cfg)
    train, rollout = groups.train.worker, groups.rollout.worker
    initial = {n: p.detach().clone() for n, p in train.engine.model.named_parameters()}
    load_checkpoint(groups.train, groups.sync, checkpoint_dir(run_dir, 1))

    assert groups.train.version == 2 and groups.rollout.version == rollout.engine.policy_version == 2
    trained = dict(train.engine.model.named_parameters())
    assert any(not torch.equal(trained[n], initial[n]) for n in initial)  # lr 3e-2 moved the weights
    for n, p in train.ref.model.named_parameters():  # the reference stays the initial policy
        assert torch.equal(p, initial[n]), n
    sent = dict(pair for bucket in train.named_weights(bucket_bytes=1 << 29) for pair in bucket)
    assert_same_weights(sent, dict(hf_named_tensors(rollout.engine.model)))


# ---- kill -9 at every stage, then trainer.resume=auto -------------------------------------------


def _launcher(conn) -> None:
    """A process that has imported rlloom (and run no torch op): forks one crashing run per request
    and answers with its wait status. Like a forkserver, but private to this module (the global one
    belongs to the reward runner, which wants it free of torch)."""
    # What a run imports lazily, so that no child pays for it (a first run in a process costs 20x more).
    import torch._dynamo  # noqa: F401
    import torch.onnx  # noqa: F401
    import transformers.models.auto.tokenization_auto  # noqa: F401

    while (request := conn.recv()) is not None:
        checkpoint, run_dir, env, extra, closed = request
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ.update(env)
                torch.set_num_threads(1)  # as in the test process (see `one_thread`)
                stderr = os.open(f"{run_dir}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(stderr, 2)  # what the user would read
                for fd in closed:  # a pipe whose reader is gone, as `| tee` after Ctrl-C
                    reader, writer = os.pipe()
                    os.close(reader)
                    os.dup2(writer, fd)
                args = tiny_args(
                    Path(checkpoint), Path(run_dir), *EXACT, f"trainer.total_steps={TOTAL}", *extra
                )
                code = main(["train", "arithmetic_smoke", *args])
            finally:
                os._exit(code)
        conn.send(os.waitpid(pid, 0)[1])


def launch(
    launcher,
    tiny_checkpoint: Path,
    run_dir: Path,
    env: dict[str, str],
    *extra: str,
    closed: tuple[int, ...] = (),
) -> tuple[int, str]:
    """The wait status of `rlloom train` on the tiny run with `env` and `extra` overrides, and its
    stderr; the file descriptors in `closed` (1, 2) write into a pipe nobody reads."""
    launcher.send((str(tiny_checkpoint), str(run_dir), env, list(extra), closed))
    assert launcher.poll(300), f"{env}: the run neither stopped nor finished within 300 s"
    return launcher.recv(), Path(f"{run_dir}.stderr").read_text()


@pytest.fixture(scope="module")
def launcher():
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_launcher, args=(there,), daemon=True)
    proc.start()
    yield here
    here.send(None)
    proc.join(timeout=30)


# STAGE:STEP with STEP = steps completed. update_policy counts optimizer steps (two per RL step):
# 5 dies between the two mini-batch updates of step 3. save_engine:2 dies with step 2's engine state
# written but no manifest (resume from step 1); after_checkpoint:3 sits at an epoch end.
FAST = ["update_policy:5", "save_engine:2", "after_checkpoint:3"]
FULL = ["generate:1", "rewards:2", "old_logprobs:2", "ref_logprobs:2", "advantages:1", "train:2", "sync:1"]


def crash_then_resume(launcher, straight, tiny_checkpoint, tmp_path: Path, fault: str) -> None:
    run_dir = tmp_path / fault.replace(":", "_")
    status, _ = launch(launcher, tiny_checkpoint, run_dir, {"RLLOOM_FAULT": fault})
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"{fault}: wait status {status}"
    stage, step = fault.split(":")
    done = int(step) // 2 if stage == "update_policy" else int(step)
    assert not checkpoint_dir(run_dir, done + 1).exists(), fault  # died before the next checkpoint

    result = run(
        tiny_cfg(tiny_checkpoint, run_dir, *EXACT, f"trainer.total_steps={TOTAL}", "trainer.resume=auto")
    )
    assert result.steps == TOTAL
    assert_matches(straight, run_dir, tmp_path)


@pytest.mark.parametrize("fault", FAST)
def test_kill_at_stage_then_resume_equals_straight_run(launcher, straight, tiny_checkpoint, tmp_path, fault):
    crash_then_resume(launcher, straight, tiny_checkpoint, tmp_path, fault)


@pytest.mark.slow
@pytest.mark.parametrize("fault", FULL)
def test_kill_at_every_step_stage_then_resume_equals_straight_run(
    launcher, straight, tiny_checkpoint, tmp_path, fault
):
    crash_then_resume(launcher, straight, tiny_checkpoint, tmp_path, fault)


@pytest.mark.parametrize("spec", ["generate", "generate:x", "nope:1", "sync:1:2:3", "sync:-1"])
def test_bad_fault_spec_is_a_one_line_error(spec):
    with pytest.raises(ConfigError, match=r"RLLOOM_FAULT=.* is not STAGE:STEP\[:RANK\].* generate, rewards"):
        parse_fault(spec)


def test_bad_fault_env_stops_the_cli_with_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("RLLOOM_FAULT", "after_checkpoint")
    assert main(["train", "arithmetic_smoke", "trainer.total_steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlloom: error: RLLOOM_FAULT='after_checkpoint' is not") and "Traceback" not in err


# ---- Ctrl-C / SIGTERM: the step under way finishes and is checkpointed, then resume ----------------

SIGNALLING = ["reward.name=resume_reward:digit_share_signalling", "trainer.save_every=0"]


def signal_in_job(
    tiny_checkpoint: Path, tmp_path: Path, signum: int, job: int = 1, count: int = 1
) -> dict[str, str]:
    """The environment that has the reward worker send `count` `signum`s to the trainer while it
    scores the first sample of batch `job` (0-based; without dynamic sampling's extra rounds):
    in step 2 for job 1 in the synchronous mode."""
    cfg = tiny_cfg(tiny_checkpoint, tmp_path, *EXACT)
    call = job * cfg.trainer.prompts_per_step * cfg.rollout.n_samples + 1
    return {"RESUME_REWARD_SIGNAL": f"{signum}:{call}:{count}"}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_a_signal_mid_step_checkpoints_that_step_and_resume_equals_straight_run(
    launcher, straight, tiny_checkpoint, tmp_path, signum
):
    # The reward worker signals the trainer while it scores step 2's first sample. No checkpoint
    # is due (save_every=0): the stop writes step 2's, and the run continues from it exactly.
    run_dir = tmp_path / "stopped"
    env = signal_in_job(tiny_checkpoint, tmp_path, signum)
    status, err = launch(launcher, tiny_checkpoint, run_dir, env, *SIGNALLING)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signum, (status, err)
    assert (
        "Traceback" not in err and f"{signal.Signals(signum).name}: stopping after the step under way" in err
    )
    assert err.strip().splitlines()[-1] == (
        f"rlloom: stopped by {signal.Signals(signum).name} after step 2; its checkpoint is "
        f"{checkpoint_dir(run_dir, 2)}. Continue with the same command and trainer.resume=auto."
    )
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_000002"]

    run(
        tiny_cfg(
            tiny_checkpoint,
            run_dir,
            *EXACT,
            f"trainer.total_steps={TOTAL}",
            *SIGNALLING,
            "trainer.resume=auto",
        )
    )
    assert_matches(straight, run_dir, tmp_path)


def test_a_second_ctrl_c_stops_at_once_with_one_line(launcher, tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "interrupted"
    env = signal_in_job(tiny_checkpoint, tmp_path, signal.SIGINT, count=2)
    status, err = launch(launcher, tiny_checkpoint, run_dir, env, *SIGNALLING)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 130, (status, err)
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "rlloom: interrupted (Ctrl-C); "
    )
    assert complete_checkpoints(run_dir) == []  # step 2 never finished; none was due before it


@pytest.mark.parametrize("closed", [(1,), (1, 2)], ids=["stdout", "stdout_and_stderr"])
def test_ctrl_c_with_the_console_piped_into_a_closed_reader_checkpoints_and_resumes(
    launcher, straight, tiny_checkpoint, tmp_path, closed
):
    # `rlloom train ... | tee log`, then Ctrl-C: tee is gone before rlloom prints its next line.
    # Before, that line's BrokenPipeError ended the run: exit 141, no message, no checkpoint.
    run_dir = tmp_path / "piped"
    env = signal_in_job(tiny_checkpoint, tmp_path, signal.SIGINT)
    console = ["logging.console=true", "logging.samples_per_step=2"]  # a line a step, and samples
    status, err = launch(launcher, tiny_checkpoint, run_dir, env, *SIGNALLING, *console, closed=closed)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 130, (status, err)
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_000002"]  # although save_every=0
    if 2 not in closed:
        assert err.strip().splitlines()[-1].startswith("rlloom: stopped by SIGINT after step 2;"), err

    run(
        tiny_cfg(
            tiny_checkpoint,
            run_dir,
            *EXACT,
            f"trainer.total_steps={TOTAL}",
            *SIGNALLING,
            "trainer.resume=auto",
        )
    )
    assert_matches(straight, run_dir, tmp_path)


# The asynchronous modes: what is in flight when the signal comes is dropped and its prompts given
# back before the stop's checkpoint, as before a scheduled one. Before, the checkpoint held a prompt
# cursor past the jobs in flight, and the resumed run never trained them (1 batch lost at
# max_staleness 1, 3 at 3). The reference is the uninterrupted run with a checkpoint at the step
# the stop follows: a drain makes the next step train on-policy, so it must be there too.
ASYNC_STOPS = {  # overrides, the batch whose first scored sample signals, the step that is under way then
    "one_step_off": (["trainer.mode=one_step_off"], 2, 2),  # batch 2 is admitted when step 2 starts
    "async_1": (["trainer.mode=async", "trainer.max_staleness=1"], 2, 2),
    "async_3": (["trainer.mode=async", "trainer.max_staleness=3"], 1, 1),  # all 4 batches admitted at step 1
    "async_2_dynamic": (  # dynamic sampling: extra rounds (the reward ties in most groups) drawn in flight
        [
            "trainer.mode=async",
            "trainer.max_staleness=2",
            "reward.name=resume_reward:starts_with_digit_signalling",
            "algorithm.dynamic_sampling=true",
        ],
        1,
        None,  # wherever batch 1's first sample lands after batch 0's extra rounds
    ),
    "async_1_multi_turn": (  # trajectories' next turns sent while the step trains (the stream's pump)
        [
            "trainer.mode=async",
            "trainer.max_staleness=1",
            "rollout.env=resume_env:ThreeTurns",
            "rollout.stop_strings=[a,e,o,'1','2']",  # turns that end with "stop": the episode goes on
            "rollout.max_new_tokens=8",
        ],
        2,
        None,  # wherever batch 2's first trajectory ends
    ),
}


@pytest.mark.parametrize(
    "case",  # async_3 is async_1's path with more in flight: ~12 s more of the suite's time, so slow
    [pytest.param(c, marks=pytest.mark.slow) if c == "async_3" else c for c in ASYNC_STOPS],
)
def test_a_signal_in_an_async_mode_drains_then_resume_equals_the_run_checkpointed_there(
    launcher, tiny_checkpoint, tmp_path, case
):
    mode, job, expected_step = ASYNC_STOPS[case]
    signum = signal.SIGTERM if case.startswith("async") else signal.SIGINT
    run_dir = tmp_path / "stopped"
    env = signal_in_job(tiny_checkpoint, tmp_path, signum, job=job)
    status, err = launch(launcher, tiny_checkpoint, run_dir, env, *SIGNALLING, ALL_SAMPLES, *mode)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signum, (status, err)
    stopped = [p.name for p in complete_checkpoints(run_dir)]
    assert len(stopped) == 1 and "Traceback" not in err, (stopped, err)
    step = int(stopped[0][5:])
    assert step == expected_step if expected_step else 1 <= step < TOTAL
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"rlloom: stopped by {signal.Signals(signum).name} after step {step};")
    )

    scheduled = [*SIGNALLING, f"trainer.save_every={step}", ALL_SAMPLES, *mode]
    reference = tmp_path / "reference"
    run(tiny_cfg(tiny_checkpoint, reference, *EXACT, f"trainer.total_steps={TOTAL}", *scheduled))
    run(
        tiny_cfg(
            tiny_checkpoint,
            run_dir,
            *EXACT,
            f"trainer.total_steps={TOTAL}",
            *scheduled,
            "trainer.resume=auto",
        )
    )
    expected = read_metrics(reference)
    if "dynamic" in case:
        assert sum(m["rollout/groups_dropped"] for m in expected) > 0  # extra rounds were drawn
    assert prompts_per_step(run_dir) == prompts_per_step(reference)
    resumed = read_metrics(run_dir)
    weights = final_weights(run_dir, TOTAL, tmp_path), final_weights(reference, TOTAL, tmp_path)
    if "multi_turn" not in case:
        assert resumed == expected
        assert_same_weights(*weights)
        return
    # Later turns join the decode batch as their environments return, so batches (and the last bits of
    # their float sums) differ from run to run: the same samples, metrics within float noise (which
    # Adam's normalised steps at lr 3e-2 carry into the weights: 3e-5 seen after 4 steps).
    assert max(m["rollout/turns_mean"] for m in expected) > 1  # trajectories went past one turn
    assert [m.keys() for m in resumed] == [m.keys() for m in expected]
    for a, b in zip(resumed, expected):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), a["step"]
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k], weights[1][k], rtol=0, atol=3e-4)
