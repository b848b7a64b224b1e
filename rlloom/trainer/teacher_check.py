"""The start-up check of on-policy distillation's teacher (`teacher.path`), before any model loads.

The teacher scores the student's sampled token ids, so it must read them as the same tokens: its
tokenizer maps every token to the id the student's does (a model of another family, or the same one
with added tokens, would score other tokens and train the student on noise). Its vocab_size may be
padded past the student's (Qwen2.5-7B's 152064 rows against 0.5B's 151936) but not below it: every id
the student can sample needs a teacher row. Its sizes must split over the run's parallel degrees as
the policy's do. Each failure is one `ConfigError` naming teacher.path.
"""

from __future__ import annotations

from typing import Any

from rlloom.config import ConfigError, RunConfig
from rlloom.engines.train.build import check_parallel
from rlloom.models.checkpoint import VALUE_MODEL_SUFFIXES, load_tokenizer
from rlloom.trainer.model_folder import check_model_folder, check_tokenizer


def check_teacher(cfg: RunConfig, student_hf_config: dict[str, Any]) -> None:
    """The teacher folder holds a causal LM with the student's tokenizer, in the run's layout."""
    if not cfg.uses_teacher:
        return
    path = cfg.teacher.path
    where = f"teacher.path={path!r}"
    teacher = check_model_folder(path, "teacher.path")
    arch = (teacher.get("architectures") or [""])[0]
    if arch.endswith(VALUE_MODEL_SUFFIXES):
        raise ConfigError(
            f"{where} is invalid: it is a {arch}, a value or reward model without a vocabulary head, and the "
            "teacher gives logprobs of tokens. Fix: pass a causal LM (a reward model goes in reward.model_path)."
        )
    check_tokenizer(path, "teacher.path", chat_template=False)
    student_vocab, teacher_vocab = (
        load_tokenizer(cfg.model.path).get_vocab(),
        load_tokenizer(path).get_vocab(),
    )
    if student_vocab != teacher_vocab:
        differ = sorted(set(student_vocab.items()) ^ set(teacher_vocab.items()), key=lambda kv: kv[1])
        raise ConfigError(
            f"{where} is invalid: its tokenizer differs from the student's (model.path={cfg.model.path!r}): "
            f"{len(teacher_vocab)} against {len(student_vocab)} tokens, e.g. {differ[0][0]!r} is "
            f"{teacher_vocab.get(differ[0][0])} against {student_vocab.get(differ[0][0])}, and the teacher scores "
            "the student's token ids. Fix: pick a teacher of the student's family with the same tokenizer."
        )
    rows, student_rows = teacher.get("vocab_size"), student_hf_config.get("vocab_size")
    if isinstance(rows, int) and isinstance(student_rows, int) and rows < student_rows:
        raise ConfigError(
            f"{where} is invalid: its vocab_size {rows} is smaller than the student's {student_rows}, and every "
            "token id the student samples needs a teacher logit. Fix: pick a teacher whose vocab_size is at least "
            f"{student_rows}."
        )
    check_parallel(cfg, teacher, "teacher.path")
