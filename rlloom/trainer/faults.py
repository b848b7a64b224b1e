"""Fault injection for tests of crash recovery: `RLLOOM_FAULT=stage:step[:rank]` makes the process
that reaches `stage` at `step` (on `rank`, when given) exit at once with status 17, as a crash would.

Stages: `after_checkpoint` (driver, after the step's checkpoint is written) and `update_policy`
(a worker, before its optimizer step). Unset in normal runs; reading one variable costs nothing.
"""

from __future__ import annotations

import os

EXIT_CODE = 17


def maybe_fail(stage: str, step: int, rank: int = 0) -> None:
    spec = os.environ.get("RLLOOM_FAULT", "")
    if not spec:
        return
    parts = spec.split(":")
    want_stage, want_step = parts[0], int(parts[1])
    want_rank = int(parts[2]) if len(parts) > 2 else None
    if stage == want_stage and step == want_step and (want_rank is None or want_rank == rank):
        os._exit(EXIT_CODE)
