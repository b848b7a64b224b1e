"""A test reward that kills a Ray actor with kill -9 in the middle of a step, in a module that
imports nothing of rlloom (reward plug-ins run in worker processes, which import it).

With KILL_ACTOR=ROLE:RANK:STEP and KILL_ACTOR_DIR=RUN_DIR set, the first reward call after step
STEP is logged in RUN_DIR/metrics.jsonl (the next step's first scored group, while its other
prompts may still be in flight) sends SIGKILL to the pid that RUN_DIR/actors.json gives the actor
of that role and rank, once per run folder (RUN_DIR/killed-ROLE-RANK holds the kill's time.time()
and pid). KILL_ACTOR may name several kills, comma-separated: "rollout:0:1,train:0:2".

With HOLD_DIR=RUN_DIR set instead, the first reward call after step 1 is logged writes RUN_DIR/held
and waits (up to 600 s) for RUN_DIR/go: the run stays in step 2 while a test stops a node.
"""


def digit_share_killing(response_text: str, ground_truth: str) -> float:
    """The share of digits in the response (tests/trainer/resume_reward.py), killing as KILL_ACTOR says."""
    _maybe_kill()
    _maybe_hold()
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)


def _maybe_kill() -> None:
    import json
    import os
    import signal
    import time
    from pathlib import Path

    specs, run_dir = os.environ.get("KILL_ACTOR", ""), Path(os.environ.get("KILL_ACTOR_DIR", "."))
    if not specs or not (run_dir / "metrics.jsonl").exists():
        return
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    for spec in specs.split(","):
        role, rank, step = spec.split(":")
        marker = run_dir / f"killed-{role}-{rank}"
        if marker.exists() or not any(r["step"] == int(step) for r in rows):
            continue
        actors = json.loads((run_dir / "actors.json").read_text())
        pid = next(a["pid"] for a in actors if a["role"] == role and a["rank"] == int(rank))
        marker.write_text(f"{time.time()} {pid}\n")
        os.kill(pid, signal.SIGKILL)
        return


def _maybe_hold() -> None:
    import json
    import os
    import time
    from pathlib import Path

    run_dir = Path(os.environ.get("HOLD_DIR", "."))
    if (
        "HOLD_DIR" not in os.environ
        or (run_dir / "held").exists()
        or not (run_dir / "metrics.jsonl").exists()
    ):
        return
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if not any(r["step"] == 1 for r in rows):
        return
    (run_dir / "held").write_text("")
    deadline = time.monotonic() + 600
    while not (run_dir / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
