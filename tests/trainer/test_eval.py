"""`rlloom eval` through the CLI on a tiny model and a tiny jsonl, against transformers' greedy answers.

The dataset's answers are transformers' own greedy continuations of its prompts for half of the
rows and wrong for the other half; with an exact-match plug-in reward the greedy accuracy must be
exactly 0.5, whatever the model says. Sampling reports pass@k. (Evaluating a run folder is tested in
test_export.py, which has a trained run at hand.)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.data.chat import tokenize_prompts
from rlloom.data.dataset import RawPrompt
from rlloom.trainer.eval_model import eval_data_overrides

PROMPTS = ["What is 2 + 3?", "Name a color.", "Say hi.", "Count to three.", "12 * 4 =", "Spell cat."]
FAST = ["rollout.max_new_tokens=6", "rollout.num_blocks=16", "reward.name=exact_reward:exact"]


@pytest.fixture(scope="module")
def lively_model(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with O(1) logits, so greedy choices are far from ties."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else noise / math.sqrt(p.shape[-1]))
    out = tmp_path_factory.mktemp("lively") / "model"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_checkpoint).save_pretrained(out)
    return out


def hf_greedy(model_dir: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """transformers' greedy answers to the prompts, templated as rlloom's data builder does."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    raws = [RawPrompt(prompt=p, ground_truth="", index=i) for i, p in enumerate(prompts)]
    items = tokenize_prompts(raws, tok, chat_template=True, max_prompt_length=256).items
    answers = []
    for it in items:
        ids = torch.tensor([it.prompt_ids])
        out = hf.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=0
        )
        answers.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


@pytest.fixture
def dataset(lively_model, tmp_path, monkeypatch):
    """A jsonl whose first half of answers is right, and an exact-match reward module on sys.path."""
    (tmp_path / "exact_reward.py").write_text(
        "def exact(response_text, ground_truth):\n    return float(response_text == ground_truth)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # for inline scoring, and for worker processes:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    greedy = hf_greedy(lively_model, PROMPTS, max_new_tokens=6)
    assert len(set(greedy)) > 1, greedy  # a model with one answer for everything proves little
    half = len(PROMPTS) // 2
    # empty greedy answers (an end of turn first) go to the wrong half: a row with an empty answer is skipped
    prompts, greedy = zip(*sorted(zip(PROMPTS, greedy), key=lambda pair: pair[1] == ""))
    assert all(greedy[:half]), greedy
    answers = list(greedy[:half]) + [g + "#" for g in greedy[half:]]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(prompts, answers)))
    return path


def run_eval(capsys, *argv: str) -> tuple[str, dict]:
    assert main(["eval", *argv]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    return "\n".join(out[:-1]), json.loads(out[-1])


def test_greedy_accuracy_matches_transformers(lively_model, dataset, tmp_path, capsys):
    out = tmp_path / "responses.jsonl"
    table, report = run_eval(capsys, str(lively_model), str(dataset), *FAST, "--responses", str(out))
    assert report["accuracy"] == 0.5 and report["prompts"] == len(PROMPTS) and report["samples"] == 1
    assert "pass@1" not in report and report["temperature"] == 0.0
    assert "accuracy" in table and "0.5000" in table
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    answers = [json.loads(line)["answer"] for line in dataset.read_text().splitlines()]
    assert [r["ground_truth"] for r in rows] == answers and [r["index"] for r in rows] == list(range(6))
    assert [r["responses"][0] == r["ground_truth"] for r in rows] == [True] * 3 + [False] * 3
    assert [r["scores"] for r in rows] == [[1.0]] * 3 + [[0.0]] * 3


def test_sampling_reports_pass_at_k(lively_model, dataset, capsys):
    _, report = run_eval(
        capsys, str(lively_model), str(dataset), *FAST, "--samples", "4", "--temperature", "1.0"
    )
    assert report["samples"] == 4 and 0 <= report["accuracy"] <= report["pass@4"] <= 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["missing_model", "arithmetic"], "does not exist"),
        (["{tmp}", "arithmetic"], "neither a Hugging Face folder"),
        (["{model}", "missing.jsonl"], "neither a file nor a task"),
        (["{model}", "arithmetic", "--samples", "3"], "identical answers"),
        (["{model}", "arithmetic", "--samples", "0"], "must be >= 1"),
        # checked before the evaluation: a bad path used to fail after it, losing every answer
        (["{model}", "arithmetic", "--responses", "/proc/version/x.jsonl"], "cannot be written"),
        (["{model}", "arithmetic", "--responses", "{tmp}"], "--responses='{tmp}' already exists"),
    ],
)
def test_errors_are_one_line(argv, message, tiny_checkpoint, tmp_path, capsys):
    argv = [a.format(model=tiny_checkpoint, tmp=tmp_path) for a in argv]
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    message = message.format(tmp=tmp_path)
    assert err.startswith("rlloom: error: ") and err.count("\n") == 1 and message in err, err


def test_a_task_replaces_the_dataset_file_of_a_run_trained_on_one():
    # a run's config.yaml names its dataset file; evaluating it on a task must not keep that path
    # (data.path is refused beside a procedural task)
    run_config = ["data.task=jsonl", "data.path=/runs/data.jsonl"]
    cfg = load_config("arithmetic_smoke", [*run_config, *eval_data_overrides("arithmetic")])
    assert (cfg.data.task, cfg.data.path) == ("arithmetic", "")


def test_an_exported_model_is_scored_as_its_run_scored(lively_model, dataset, tmp_path, capsys):
    """`rlloom export` writes the run's task settings (system prompt, lengths, reward) beside the
    weights, so `rlloom eval EXPORTED DATA` scores as `rlloom eval RUN_DIR DATA` does, no setting repeated."""
    run_dir, exported = tmp_path / "run", tmp_path / "exported"
    task = [
        "data.system_prompt=Answer in one word.",
        "rollout.max_new_tokens=3",
        "reward.name=exact_reward:exact",
    ]
    quick = ["trainer.total_steps=1", "data.num_eval=0", "rollout.n_samples=2", "logging.console=false"]
    argv = [
        "train",
        "arithmetic_smoke",
        f"model.path={lively_model}",
        f"trainer.run_dir={run_dir}",
        *task,
        *quick,
    ]
    assert main([*argv, "rollout.num_blocks=16", "trainer.save_hf_every=-1"]) == 0
    assert main(["export", str(run_dir), str(exported)]) == 0
    reports, rows = [], []
    for model in (run_dir, exported):
        responses = tmp_path / f"{model.name}.jsonl"
        reports.append(
            run_eval(
                capsys, str(model), str(dataset), "rollout.num_blocks=16", "--responses", str(responses)
            )[1]
        )
        rows.append([json.loads(line) for line in responses.read_text().splitlines()])
    assert {k: v for k, v in reports[1].items() if k != "model"} == {
        k: v for k, v in reports[0].items() if k != "model"
    }
    assert rows[1] == rows[0]
    assert all("Answer in one word." in r["prompt"] and len(r["responses"][0]) <= 3 for r in rows[1])
    assert all(r["scores"][0] == float(r["responses"][0] == r["ground_truth"]) for r in rows[1])


def test_responses_never_overwrite_an_existing_file(tiny_checkpoint, tmp_path, capsys):
    # Before: `--responses` overwrote whatever was there, the data file evaluated or a run's metrics.
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1 =", "answer": "2"}) + "\n")
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 1}\n')
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "nothing-yet.jsonl")  # a dangling link would be written through
    fast = ["data.num_eval=2", "rollout.max_new_tokens=2"]
    for target, source in ((data, str(data)), (metrics, "arithmetic"), (link, "arithmetic")):
        before = target.read_text() if target.exists() else None
        assert main(["eval", str(tiny_checkpoint), source, *fast, "--responses", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("rlloom: error: ") and err.count("\n") == 1, err
        assert f"--responses={str(target)!r} already exists" in err and "Fix: pass a new file name" in err
        assert (target.read_text() if target.exists() else None) == before
    assert not (tmp_path / "nothing-yet.jsonl").exists()
    # The new file is made before the evaluation (a bad path fails first) and removed if it fails.
    new = tmp_path / "new.jsonl"
    assert main(["eval", str(tiny_checkpoint), "arithmetic", "--samples", "3", "--responses", str(new)]) == 2
    assert "identical answers" in capsys.readouterr().err and not new.exists()
