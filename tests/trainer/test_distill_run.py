"""On-policy distillation as a user runs it (`teacher.path`, algorithm.estimator=opd,
algorithm.distill_coef): the metric against transformers on the very tokens the step trained on
(single- and multi-turn, whose tool output the loss mask leaves out), the student pulled toward a
different teacher with no reward configured (the task's default reward scores 0 throughout and
plays no part), and a teacher with another tokenizer refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_trainer_loop import read_metrics, tiny_args, tiny_cfg

import rlloom.trainer.policy as policy_module
from rlloom.cli import main
from rlloom.config import load_config
from rlloom.data.types import RolloutBatch
from rlloom.trainer.run import run
from tests.conftest import build_tiny_checkpoint

OPD = ("algorithm.estimator=opd", "rollout.temperature=1.0", "data.num_eval=0")


def favouring_teacher(path: Path, *, token: str = "7") -> Path:
    """A tiny teacher unlike the student (another seed, an untied head) that wants `token` almost
    everywhere: every input embedding carries a large constant along one dimension, which the
    final norm turns into a near-constant direction that the head maps onto `token`'s logit (~17
    above the others). A near-uniform student starts ~12 nats per token from it (reverse KL)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tiny_checkpoint(path, seed=7)
    token_id = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(token)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    embedding = model.model.embed_tokens.weight
    with torch.no_grad():
        head = embedding.detach().clone()
        embedding[:, 0] += 10.0
        head[token_id, 0] += 3.0
    model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return favouring_teacher(tmp_path_factory.mktemp("teacher") / "ckpt")


def transformers_logprobs(path: Path, batch: RolloutBatch) -> list[torch.Tensor]:
    """Per sample, transformers' logprobs (temperature 1) of its response tokens given what precedes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in batch.samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logp = model(ids).logits[0].double().log_softmax(-1)
            n = len(s.prompt_ids)
            targets = torch.tensor(s.response_ids)
            out.append(logp[n - 1 : n - 1 + len(targets)].gather(1, targets[:, None])[:, 0])
    return out


@pytest.mark.parametrize("recipe", ["arithmetic_smoke", "arithmetic_retry"])
def test_reverse_kl_equals_transformers_on_the_trained_tokens(
    recipe, tiny_checkpoint, teacher, tmp_path, monkeypatch
):
    batches: list[RolloutBatch] = []
    real = policy_module.distill_advantages

    def recording(algo, batch, *args):
        batches.append(batch)
        return real(algo, batch, *args)

    monkeypatch.setattr(policy_module, "distill_advantages", recording)
    run_dir = tmp_path / "run"
    cfg = load_config(
        recipe, tiny_args(tiny_checkpoint, run_dir, *OPD, f"teacher.path={teacher}", "trainer.total_steps=1")
    )
    run(cfg)
    [batch] = batches
    if recipe == "arithmetic_retry":  # the environment's feedback is in the samples and masked out
        assert any(s.loss_mask is not None and 0 in s.loss_mask for s in batch.samples)
    student = transformers_logprobs(tiny_checkpoint, batch)
    teacher_logp = transformers_logprobs(teacher, batch)
    diffs = [
        (s_lp - t_lp)[torch.tensor(s.loss_mask or [1] * len(s.response_ids), dtype=torch.bool)]
        for s, s_lp, t_lp in zip(batch.samples, student, teacher_logp)
    ]
    expected = float(torch.cat(diffs).mean())
    [row] = read_metrics(run_dir)
    assert expected > 5  # the teacher is far from the student: a wrong token would show
    assert row["distill/reverse_kl"] == pytest.approx(expected, rel=1e-4)


def test_pure_opd_pulls_the_student_toward_the_teacher(tiny_checkpoint, teacher, tmp_path):
    """Estimator opd, reward.name unset, at a high learning rate: the reverse KL per token falls by
    more than half in 20 steps (from ~12 nats to ~0 at this rate); the rewards (all 0 for the random
    student: GRPO would not move) play no part."""
    run_dir = tmp_path / "run"
    run(
        tiny_cfg(
            tiny_checkpoint,
            run_dir,
            *OPD,
            f"teacher.path={teacher}",
            "train.lr=3e-2",
            "trainer.total_steps=20",
            "trainer.save_every=0",
        )
    )
    kl = [row["distill/reverse_kl"] for row in read_metrics(run_dir)]
    assert len(kl) == 20
    assert kl[0] > 5 and sum(kl[-3:]) / 3 < kl[0] / 2, kl
    assert all(row["reward/mean"] == 0 for row in read_metrics(run_dir))


def test_distill_coef_adds_the_term_to_grpo(tiny_checkpoint, teacher, tmp_path):
    """algorithm.distill_coef with GRPO: the teacher's term moves the advantages, which GRPO alone
    leaves at 0 for the random student (every reward 0: no group varies)."""
    grpo, distilled = tmp_path / "grpo", tmp_path / "distilled"
    run(tiny_cfg(tiny_checkpoint, grpo, "trainer.total_steps=1", "data.num_eval=0"))
    run(tiny_cfg(tiny_checkpoint, distilled, "trainer.total_steps=1", "data.num_eval=0",
                 f"teacher.path={teacher}", "algorithm.distill_coef=0.5"))  # fmt: skip
    [plain], [row] = read_metrics(grpo), read_metrics(distilled)
    assert plain["advantage/abs_mean"] == 0.0
    assert row["distill/reverse_kl"] > 5
    assert row["advantage/mean"] == pytest.approx(-0.5 * row["distill/reverse_kl"], rel=1e-4)


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tiny_checkpoint, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # the same tokens under other ids
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    args = tiny_args(tiny_checkpoint, tmp_path / "run", *OPD, f"teacher.path={other}")
    assert main(["train", "arithmetic_smoke", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlloom: error: teacher.path={str(other)!r} is invalid: its tokenizer differs")
    assert err.count("\n") == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_teacher_without_distillation_and_distillation_without_a_teacher_are_refused(
    tiny_checkpoint, tmp_path, capsys
):
    for extra, says in (
        ((f"teacher.path={tiny_checkpoint}",), "a teacher is used only by algorithm.estimator=opd"),
        (("algorithm.estimator=opd",), "distills from a teacher"),
    ):
        assert main(["train", "arithmetic_smoke", *tiny_args(tiny_checkpoint, tmp_path / "run", *extra)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("rlloom: error: teacher.path=") and says in err and err.count("\n") == 1
