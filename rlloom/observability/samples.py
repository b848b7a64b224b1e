"""Sample completions of each step: `logging.samples_per_step` of them, to the console and a file.

A few completions show what the numbers mean (TRL prints a completions table, verl logs its
validation generations). Each step the trainer picks `logging.samples_per_step` samples spread over
the batch (`pick_samples`: evenly spaced, so they come from different prompts), and `SamplesLogger`
appends them as JSON lines to RUN_DIR/samples.jsonl:

    {"step": 3, "prompt": "What is 12 + 35?...", "response": "47", "reward": 1.0, "ground_truth": "47"}

and prints each as one line on the console, e.g.

    [rlloom] sample 3.1 | reward 1.000 | prompt 'What is 12 + 35?' | response '12 + 35 = 47'

On resume from step s, lines of step >= s are dropped first, as in metrics.jsonl.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from rlloom.observability.jsonl import append_line, truncate_metrics_jsonl
from rlloom.observability.logger import Logger, SampleRecord
from rlloom.run_files import open_text

SAMPLES_FILE = "samples.jsonl"
"""File name of the sample completions inside a run folder."""
CONSOLE_CHARS = 160
"""Characters of a prompt or response shown on the console (the file keeps the whole text)."""


def prompt_text(prompt: object) -> str:
    """A row's prompt as text: chat messages become one `role: content` line each."""
    if isinstance(prompt, list):
        return "\n".join(
            f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict)
        )
    return str(prompt)


def pick_samples(samples: Sequence[Any], count: int) -> list[Any]:
    """`count` samples evenly spaced over the batch (groups are contiguous, so they come from
    different prompts when there are enough); all of them when there are fewer."""
    if count <= 0 or not samples:
        return []
    if count >= len(samples):
        return list(samples)
    return [samples[i * len(samples) // count] for i in range(count)]


def sample_records(step: int, samples: Sequence[Any]) -> list[SampleRecord]:
    """Records of `rlloom.data.types.Sample`s that rollout scored (their metadata holds the texts)."""
    return [
        SampleRecord(
            step=step,
            prompt=prompt_text(s.metadata.get("prompt", "")),
            response=str(s.metadata.get("response_text", "")),
            reward=float(s.reward),
            ground_truth=str(s.metadata.get("ground_truth", "")),
            finish_reason=str(s.finish_reason),
        )
        for s in samples
    ]


def console_line(record: SampleRecord, number: int) -> str:
    """One console line for a record (texts shortened to CONSOLE_CHARS, newlines shown as ⏎)."""

    def short(text: str) -> str:
        text = text.replace("\n", " ⏎ ")
        return text if len(text) <= CONSOLE_CHARS else text[: CONSOLE_CHARS - 3] + "..."

    return (
        f"[rlloom] sample {record.step}.{number} | reward {record.reward:.3f} | "
        f"prompt {short(record.prompt)!r} | response {short(record.response)!r}"
    )


class SamplesLogger(Logger):
    """Appends sample records to RUN_DIR/samples.jsonl and, with `console`, prints them (metrics are
    the other loggers' business)."""

    def __init__(
        self,
        path: str | Path,
        *,
        resume_from_step: int | None = None,
        console: bool = True,
        file: TextIO | None = None,
    ) -> None:
        """`resume_from_step=None` starts a fresh file; an int keeps the lines before that step."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None:
            truncate_metrics_jsonl(self.path, resume_from_step)
        self._file = open_text(self.path, append=resume_from_step is not None)
        self._console = console
        self._out = file

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        return None

    def log_samples(self, step: int, records: Sequence[SampleRecord]) -> None:
        append_line(self._file, self.path, "".join(json.dumps(asdict(r)) + "\n" for r in records))
        if self._console:
            for number, record in enumerate(records, start=1):
                print(console_line(record, number), file=self._out or sys.stdout, flush=True)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
