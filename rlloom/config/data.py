"""The `data` section: the task or dataset file the prompts come from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlloom.config.checks import check, check_seed


@dataclass(kw_only=True, slots=True)
class DataConfig:
    task: Literal["arithmetic", "countdown", "visual_compare", "visual_colour", "jsonl", "parquet"] = (
        "arithmetic"
    )
    """Built-in procedural task, or a dataset file (`path`) of prompts and ground truths."""
    path: str = ""
    """Dataset file for task=jsonl/parquet."""
    prompt_key: str = "prompt"
    """Field holding the prompt: a string or a list of chat messages."""
    answer_key: str = "answer"
    """Field holding the ground truth."""
    messages_key: str = "messages"
    """`rlloom sft`: the field holding each row's conversation, a list of {role, content} chat messages
    with at least one assistant message (the tokens trained on)."""
    max_prompt_length: int = 256
    """Prompts longer than this (in tokens, after templating) are skipped and counted."""
    chat_template: bool = True
    """Apply the tokenizer's chat template to the prompt."""
    system_prompt: str = ""
    """Optional system message put before every prompt when chat_template is on."""
    num_digits: int = 2
    """Arithmetic: digits per operand; visual_compare: digits per number in the picture."""
    operators: str = "+"
    """Arithmetic: operators drawn from, e.g. `+-*`."""
    num_train: int = 10000
    """Procedural tasks: number of training prompts generated."""
    num_eval: int = 200
    """Held-out prompts for evaluation (procedural tasks: generated with a different seed)."""
    seed: int = 0
    """Seed for shuffling and procedural generation."""

    def __post_init__(self) -> None:
        check(
            self.max_prompt_length >= 1,
            "data.max_prompt_length",
            self.max_prompt_length,
            "must be >= 1",
            "use a positive token count",
        )
        check(
            1 <= self.num_digits <= 9,
            "data.num_digits",
            self.num_digits,
            "must be in [1, 9]",
            "pick 1..9 digits",
        )
        bad = set(self.operators) - set("+-*")
        check(
            bool(self.operators) and not bad,
            "data.operators",
            self.operators,
            "must be a non-empty string of + - *",
            "e.g. data.operators='+-'",
        )
        check(
            self.num_eval >= 0, "data.num_eval", self.num_eval, "must be >= 0", "use 0 to disable evaluation"
        )
        check(self.num_train >= 1, "data.num_train", self.num_train, "must be >= 1", "use a positive count")
        check_seed("data.seed", self.seed)
        check(
            not self.path or self.task in ("jsonl", "parquet"),
            "data.path",
            self.path,
            f"is read only by data.task=jsonl or parquet, and data.task={self.task} generates its own prompts",
            "set data.task=jsonl (or parquet) to train on the file, or leave data.path out",
        )
