"""benchmarks/bench_e2e.py --modes (issue 42): the GRPO step in the default mode, trainer.deterministic
and rollout.match_training, each in its own process, in one table with the measured logprob gap; a
mode listed twice says whether its repeat gave the same metrics and weights."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from bench_e2e import mode_summary, parse_modes, repeat_verdict, without_modes  # noqa: E402


def record(step_s: float, gap: float, error: float) -> dict[str, float]:
    parts = {"time/generate_s": step_s / 2, "time/train_s": step_s / 4, "time/sync_s": step_s / 8}
    return {
        "time/step_s": step_s,
        **parts,
        "rollout/logp_gap_max": gap,
        "rollout/token_mult_prob_error": error,
    }


def test_mode_summary_medians_after_the_first_step_and_the_largest_gap_of_all() -> None:
    records = [record(30.0, 0.5, 1.3), record(4.0, 0.1, 1.1), record(6.0, 0.2, 1.2), record(5.0, 0.0, 1.0)]
    r = mode_summary(records, gen_tokens=1000)
    assert r["time/step_s"] == 5.0 and r["time/generate_s"] == 2.5  # the compile step left out
    assert r["rollout_tok_s"] == 1000 / 2.5
    assert r["logp_gap_max"] == 0.5  # every step counts for the gap
    assert r["token_mult_prob_error"] == pytest.approx(1.15)


def test_a_repeated_mode_is_identical_only_with_every_metric_but_timings_and_the_weights() -> None:
    def result(loss: float, step_s: float, weights: str = "w") -> list[dict]:
        return [{"train/loss": 1.0, "time/step_s": 9.0},
                {"train/loss": loss, "time/step_s": step_s, "weights_sha256": weights}]  # fmt: skip

    first = result(0.5, 2.0)
    assert repeat_verdict(first, result(0.5, 3.0)) == "identical"  # timings may differ
    assert repeat_verdict(first, result(0.5000001, 2.0)) == "differs: step 1 train/loss"
    assert repeat_verdict(first, result(0.5, 2.0, weights="v")) == "differs: step 1 weights_sha256"


def test_each_mode_runs_the_command_line_without_modes_out_and_timeout() -> None:
    argv = [
        "--tiny",
        "--modes",
        "default,deterministic",
        "--steps",
        "2",
        "--out=x.json",
        "--mode-timeout-s",
        "9",
    ]
    assert without_modes(argv + ["--set", "a=b"]) == ["--tiny", "--steps", "2", "--set", "a=b"]
    assert parse_modes("default, match_training") == ["default", "match_training"]
    with pytest.raises(Exception, match="comma-separated list of default, deterministic, match_training"):
        parse_modes("default,exact")


@pytest.mark.slow
def test_modes_table_on_cpu_match_training_row_reads_a_zero_gap() -> None:
    """The CLI at the tiny shape: one table, a row for the mode, whose override reached its process
    (match_training's gap is exactly 0; the default's at this shape is 9.5e-07), and a mode listed
    twice says its repeat was identical (weights included)."""
    env = os.environ | {"PYTHONPATH": str(BENCH.parent)}
    cmd = [
        sys.executable,
        str(BENCH / "bench_e2e.py"),
        "--tiny",
        "--steps",
        "1",
        "--modes",
        "default,match_training,deterministic,deterministic",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("| stage |") == 0  # the modes' own tables are not shown: one table
    rows = {line.split(" | ")[0].lstrip("| ").split(" (")[0]: line.split(" | ") for line in out.stdout.splitlines()
            if line.startswith("| match_training")}  # fmt: skip
    assert set(rows) == {"match_training"}
    assert rows["match_training"][6] == "0"
    repeats = [
        line.split(" | ")[-1] for line in out.stdout.splitlines() if line.startswith("| deterministic")
    ]
    assert repeats == [" |", "identical |"]


def test_a_variant_past_its_time_limit_is_killed_with_the_processes_it_started(tmp_path) -> None:
    """A mode's child starts a local Ray instance; killing only the child would leave its processes on
    the GPUs while the next mode runs. The grandchild here stands in for them."""
    from bounded import run_bounded

    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],\n"
        "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    assert run_bounded([sys.executable, "-c", script], 3, stdout=subprocess.PIPE, text=True) is None
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is asynchronous: give the kernel a moment
        if not alive(grandchild):
            break
        time.sleep(0.1)
    else:
        os.kill(grandchild, 9)
        pytest.fail("the grandchild outlived its time-limited parent")
    done = run_bounded([sys.executable, "-c", "print('ok')"], 30, stdout=subprocess.PIPE, text=True)
    assert done is not None and done.returncode == 0 and done.stdout == "ok\n"


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and not yet reaped by a subreaper, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
