"""A benchmark's child process with a time limit that takes its whole process tree with it.

`subprocess.run(timeout=...)` kills only the child: a GRPO step's child starts a local Ray instance
(raylet, GCS, one actor per GPU) whose processes may outlive it and hold the GPUs while the next
variant runs. The child here starts its own session, and a time-out kills every process of it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence


def run_bounded(cmd: Sequence[str], timeout_s: float | None, **popen) -> subprocess.CompletedProcess | None:  # noqa: ANN003
    """Run `cmd` to its end (`popen`: Popen's keywords, e.g. stdout=subprocess.PIPE, text=True) and
    return what `subprocess.run` would; None when it ran past `timeout_s` (None or 0: no limit), after
    SIGKILL to its whole session."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, **popen)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s or None)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended between the time-out and the kill
            pass
        proc.communicate()
        return None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
