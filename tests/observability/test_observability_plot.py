"""plot_run writes a PNG of the curves from a synthetic metrics.jsonl."""

import json

import pytest

from rlloom.observability.plot import plot_run, series_by_key

pytest.importorskip("matplotlib")


def write_run(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_writes_a_png(tmp_path):
    records = []
    for step in range(1, 21):
        record = {
            "step": step,
            "reward/mean": step / 20,
            "response/length_mean": 30 + step,
            "loss/kl": 0.001 * step,
            "time/step_s": 2.0,
            "train/accuracy": step / 25,
        }
        records.append(record)
        if step % 5 == 0:
            records.append({"step": step, "eval/accuracy": step / 30})
    write_run(tmp_path / "run", records)
    out = plot_run(tmp_path / "run")
    assert out == tmp_path / "run" / "curves.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)
    write_run(tmp_path / "odd", [{"step": 1, "foo/bar": 1.0}])
    with pytest.raises(ValueError, match="none of the plotted metrics"):
        plot_run(tmp_path / "odd")


def test_series_merges_lines_of_one_step_and_skips_nulls():
    records = [
        {"step": 2, "reward/mean": 1.0},
        {"step": 1, "reward/mean": None},
        {"step": 2, "eval/accuracy": 0.5},
    ]
    assert series_by_key(records) == {"reward/mean": ([2], [1.0]), "eval/accuracy": ([2], [0.5])}


def test_plot_never_writes_through_a_link(tmp_path, capsys):
    # Before (71f07fb): `rlloom plot` wrote the PNG into whatever curves.png linked to.
    from rlloom.cli import main

    write_run(tmp_path / "run", [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.7}])
    victim = tmp_path / "notes.txt"
    victim.write_text("mine")
    (tmp_path / "run" / "curves.png").symlink_to(victim)
    assert main(["plot", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlloom: error: ") and err.count("\n") == 1 and "is a symbolic link" in err, err
    assert victim.read_text() == "mine"
