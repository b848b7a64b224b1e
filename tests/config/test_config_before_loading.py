"""Errors before loading, through the `rlloom` CLI: a bad data file, data.num_eval against its rows,
a logging backend that is not installed and bad resume values each give one `rlloom: error:` line
naming the setting and exit 2, before the model loads (the run folder gets no config.yaml). And a
dataset config's `config show` leaves out the fields only procedural tasks read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlloom.cli import main
from rlloom.config import load_config


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_error(capsys: pytest.CaptureFixture, run_dir: Path, *args: str) -> str:
    """The one error line of `rlloom train` with these args; the run must stop before loading."""
    assert main(["train", *args, f"trainer.run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlloom: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not (run_dir / "config.yaml").exists()  # written first thing after the start-up checks
    assert "start-up: model and engines" not in err
    return lines[0]


ROWS = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]


@pytest.mark.parametrize(
    ("setup", "overrides", "expected"),
    [
        ("none", [], "data.path='{path}' is not a file"),
        ("rows", ["data.task=parquet"], "data.task=parquet is invalid for data.path='{path}': a .jsonl file"),
        (
            "rows",
            ["data.num_eval=5"],
            "data.num_eval=5 leaves no training rows in a dataset of 5 usable rows",
        ),
        ("rows", ["data.answer_key=solution"], "all 5 rows are unusable"),
        ("text", [], "all 2 rows are unusable"),
    ],
)
def test_bad_data_stops_before_loading(tiny_checkpoint, tmp_path, capsys, setup, overrides, expected):
    path = tmp_path / "data.jsonl"
    if setup == "rows":
        write_jsonl(path, ROWS)
    elif setup == "text":
        path.write_text("question,answer\n1 + 1,2\n")
    args = ["arithmetic_smoke", f"model.path={tiny_checkpoint}", "data.task=jsonl", f"data.path={path}"]
    args += ["data.prompt_key=question", "data.num_eval=1", *overrides]
    line = train_error(capsys, tmp_path / "run", *args)
    assert expected.format(path=path) in line, line


@pytest.mark.parametrize("backend", ["tensorboard", "wandb"])
def test_a_logging_backend_that_is_not_installed_stops_before_loading(
    tiny_checkpoint, tmp_path, capsys, monkeypatch, backend
):
    import rlloom.trainer.preflight as preflight

    monkeypatch.setattr(preflight, "is_installed", lambda package: package != backend)
    args = ["arithmetic_smoke", f"model.path={tiny_checkpoint}", f"logging.{backend}=true"]
    line = train_error(capsys, tmp_path / "run", *args)
    assert f"logging.{backend}=true is invalid: it needs the {backend} package" in line
    assert f"pip install 'rlloom[{backend}]', or set logging.{backend}=false" in line


def test_bad_resume_values(tiny_checkpoint, tmp_path, capsys):
    # A word that is neither never, auto nor a path fails in `config show` too.
    assert main(["config", "show", "arithmetic_smoke", "trainer.resume=sometimes"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlloom: error: trainer.resume='sometimes' is invalid: must be never, auto or")
    assert "\n" not in err
    # A path that is not a checkpoint stops `rlloom train` before loading.
    missing = tmp_path / "runs" / "x" / "checkpoints" / "step_000002"
    args = ["arithmetic_smoke", f"model.path={tiny_checkpoint}", f"trainer.resume={missing}"]
    line = train_error(capsys, tmp_path / "run", *args)
    assert f"trainer.resume='{missing}' is not a complete checkpoint" in line


def test_overlong_buffer_longer_than_the_responses_is_refused_at_start_up(capsys):
    # Found by running the README's commands with short responses: it used to raise mid-step.
    assert main(["config", "show", "dapo_arithmetic", "rollout.max_new_tokens=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "rlloom: error: algorithm.overlong_buffer=8 is invalid: must be at most rollout.max_new_tokens=4"
    )


def test_config_show_of_a_dataset_config_leaves_out_procedural_fields(tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    (tmp_path / "mine.yaml").write_text(
        f"recipe: arithmetic_demo\ndata: {{task: jsonl, path: {data.name}, prompt_key: question, num_eval: 1}}\n"
    )
    assert main(["config", "show", str(tmp_path / "mine.yaml")]) == 0
    shown = capsys.readouterr().out
    data_section = shown[shown.index("data:") : shown.index("rollout:")]
    assert "prompt_key: question" in data_section
    for field in ("num_digits", "operators", "num_train"):
        assert field not in data_section
    # The shown config loads back to the same run (resuming with it changes nothing).
    (tmp_path / "shown.yaml").write_text(shown)
    from rlloom.config.resume import run_changing_differences

    again = load_config(tmp_path / "shown.yaml")
    assert run_changing_differences(load_config(tmp_path / "mine.yaml"), again) == []
    # Procedural tasks keep theirs (countdown reads num_train only).
    assert main(["config", "show", "arithmetic_smoke"]) == 0
    assert "num_digits: 2" in capsys.readouterr().out
    assert main(["config", "show", "arithmetic_smoke", "data.task=countdown"]) == 0
    countdown = capsys.readouterr().out
    assert "num_train:" in countdown and "num_digits" not in countdown
