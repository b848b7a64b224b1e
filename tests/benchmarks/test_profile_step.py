"""benchmarks/profile_step.py (issue 48): one table of where the GRPO step's time goes, its labels
reaching the rollout engine's thread and the training engine, run at the tiny shape on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import profile_step  # noqa: E402

from rlloom.engines.rollout.native.model_runner import ModelRunner  # noqa: E402


@pytest.mark.slow
def test_profile_step_table_names_the_parts_of_generate_and_train(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run, backward = ModelRunner.run, torch.Tensor.backward
    monkeypatch.setattr(
        sys, "argv", ["profile_step.py", "--tiny", "--steps", "2", "--trace", str(tmp_path / "t.json")]
    )
    profile_step.main()
    table = capsys.readouterr().out.split("| part (")[1]
    ms = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("&nbsp;"):
            ms[cells[0].removeprefix("&nbsp;&nbsp;").removesuffix(" (host)")] = float(cells[1])
    for part in ("generate: prefill forward", "generate: decode forward", "generate: sampling",
                 "train: forward", "train: backward", "train: optimizer"):  # fmt: skip
        assert ms.get(part, 0.0) > 0.0, (part, ms)
    assert "| GPU idle fraction of the step |" in table and "op (self CPU): aten::" in table
    assert (tmp_path / "t.json").stat().st_size > 0
    assert ModelRunner.run is run and torch.Tensor.backward is backward  # the labels are undone


def test_busy_time_counts_overlapping_kernels_once_and_clips_to_the_window() -> None:
    spans = [(0.0, 1000.0), (500.0, 1500.0), (3000.0, 4000.0), (3200.0, 3300.0)]
    assert profile_step.busy_ms(spans, float("-inf"), float("inf")) == 2.5
    assert profile_step.busy_ms(spans, 1200.0, 3500.0) == 0.3 + 0.5
    assert profile_step.busy_ms(spans, 1500.0, 3000.0) == 0.0
