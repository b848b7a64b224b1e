"""The README's commands work: every `rlloom ...` line of its shell blocks runs, in order, on the tiny
model (training shortened by overrides appended to the README's own), `make demo`'s command parses,
the install section names every extra of pyproject.toml, and its relative links exist."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from rlloom.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

SHORT_RUN = (
    "trainer.total_steps=1",
    "trainer.prompts_per_step=2",
    "rollout.n_samples=2",
    "rollout.max_new_tokens=8",  # dapo_arithmetic's overlong_buffer is 8
    "data.num_eval=0",
    "data.num_train=16",
    "logging.samples_per_step=0",
)
"""Appended to the README's `rlloom train` commands (later overrides win), with the tiny model."""


def readme_commands() -> list[list[str]]:
    """The argv (after `rlloom`) of each `rlloom` line of the README's sh blocks, comments dropped;
    a `> FILE` redirection stays at the end as two items."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", README, flags=re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words and Path(words[0]).name == "rlloom":
                commands.append(words[1:])
    return commands


@pytest.mark.slow
def test_readme_commands_run_on_the_tiny_model(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    commands = readme_commands()
    assert [c[:2] for c in commands][:3] == [
        ["train", "arithmetic_demo"],
        ["config", "show"],
        ["train", "my_run.yaml"],
    ]
    assert {c[0] for c in commands} >= {"train", "config", "plot", "export", "eval", "plan"}
    monkeypatch.chdir(tmp_path)
    Path("data").mkdir()
    rows = [{"prompt": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(3)]
    Path("data/test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for argv in commands:
        out_file = None
        if ">" in argv:
            argv, out_file = argv[: argv.index(">")], argv[argv.index(">") + 1]
        if argv[0] == "train":
            argv += [f"model.path={tiny_checkpoint}", *SHORT_RUN]
        capsys.readouterr()
        code = main(argv)
        captured = capsys.readouterr()
        # `rlloom plan` exits 1 when no layout fits (Qwen3-30B-A3B's shipped config fits 8 x 80 GB).
        assert code == 0, (argv, captured.err[-2000:])
        if out_file:
            Path(out_file).write_text(captured.out)
    # What the commands promise: the runs, the plot, the exported folder.
    assert (tmp_path / "runs/arithmetic_demo/checkpoints/step_000001").is_dir()
    assert (tmp_path / "runs/my_run/checkpoints/step_000001").is_dir()
    assert (tmp_path / "runs/arithmetic_demo/curves.png").is_file()
    assert (tmp_path / "out/my_model/config.json").is_file()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_command_parses(capsys):
    dry = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    (line,) = [x for x in dry.splitlines() if "rlloom train" in x]
    line = re.sub(r"\$\(date [^)]*\)", "20260101-000000", line)
    words = shlex.split(line)
    argv = words[words.index("train") + 1 :]
    assert argv[0] == "arithmetic_demo" and "logging.run_name=demo" in argv
    assert main(["config", "show", *argv]) == 0  # every override is a valid setting
    shown = capsys.readouterr().out
    assert "run_dir: runs/arithmetic_demo-20260101-000000" in shown and "run_name: demo" in shown


def test_install_section_names_every_extra_and_links_exist():
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject[pyproject.index("[project.optional-dependencies]") :].split("\n[", 1)[0]
    extras = re.findall(r"^([a-z_-]+) = \[", section, flags=re.M)  # (tomllib is Python 3.11+)
    assert {"plot", "wandb", "ray"} <= set(extras)
    install = README[README.index("### Installing into your own environment") :]
    install = install[: install.index("\n## ")] if "\n## " in install else install
    for extra in set(extras) - {"dev"}:
        assert f"`{extra}`" in install, extra
    assert "download.pytorch.org/whl/cpu" in install and "download.pytorch.org/whl/cu" in install
    links = re.findall(r"\]\(([^)#\s]+)\)", README)
    assert "docs/architecture.md" in links
    for link in links:
        if not link.startswith(("http://", "https://")):
            assert (ROOT / link).exists(), link


def test_makefile_targets_exist():
    targets = re.findall(r"^([a-z]+):", (ROOT / "Makefile").read_text(), flags=re.M)
    assert {"demo", "test", "install", "lint"} <= set(targets)
