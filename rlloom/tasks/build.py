"""Build the prompts of a run from its `DataConfig`: a procedural task or a dataset file.

`build_task_source(data_cfg, tokenizer, split)` is the one way in. The train split is shuffled
by `data.seed` epoch after epoch; the eval split is the fixed held-out list, in order
(`source.items`).

Held-out data: procedural tasks draw the eval set from its own seed (see `rlloom.tasks.split`).
A dataset file has a single path, so its eval set is `data.num_eval` rows picked by `data.seed`
and removed from the train set.
"""

from __future__ import annotations

import random

from rlloom.config import DataConfig
from rlloom.data.chat import PromptTokenizer, tokenize_prompts
from rlloom.data.dataset import DataError, PromptItem, RawPrompt, load_prompt_file
from rlloom.data.images import ImageProcessing
from rlloom.data.source import PromptSource
from rlloom.tasks.arithmetic import arithmetic_prompts
from rlloom.tasks.countdown import countdown_prompts
from rlloom.tasks.split import Split
from rlloom.tasks.visual_colour import visual_colour_prompts
from rlloom.tasks.visual_compare import visual_compare_prompts

DEFAULT_REWARDS = {
    "arithmetic": "number",
    "countdown": "countdown",
    "visual_compare": "choice",
    "visual_colour": "choice",
    "jsonl": "math",
    "parquet": "math",
}
"""The reward function name (`rlloom.rewards.get_reward_fn`) that fits each task."""


def task_prompts(data_cfg: DataConfig, split: Split = "train") -> list[RawPrompt]:
    """The untokenized prompts of one split."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be 'train' or 'eval'")
    cfg = data_cfg
    if cfg.task == "arithmetic":
        return arithmetic_prompts(
            split=split,
            num_train=cfg.num_train,
            num_eval=cfg.num_eval,
            num_digits=cfg.num_digits,
            operators=cfg.operators,
            seed=cfg.seed,
        )
    if cfg.task == "countdown":
        return countdown_prompts(split=split, num_train=cfg.num_train, num_eval=cfg.num_eval, seed=cfg.seed)
    if cfg.task == "visual_compare":
        return visual_compare_prompts(
            split=split,
            num_train=cfg.num_train,
            num_eval=cfg.num_eval,
            num_digits=cfg.num_digits,
            seed=cfg.seed,
        )
    if cfg.task == "visual_colour":
        return visual_colour_prompts(
            split=split, num_train=cfg.num_train, num_eval=cfg.num_eval, seed=cfg.seed
        )
    if cfg.task in ("jsonl", "parquet"):
        rows = load_prompt_file(
            cfg.path, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key, file_format=cfg.task
        )
        return split_file_rows(rows, num_eval=cfg.num_eval, seed=cfg.seed, split=split)
    raise ValueError(
        f"data.task={cfg.task!r} is unknown; fix: use arithmetic, countdown, visual_compare, visual_colour, jsonl or parquet"
    )


def split_file_rows(rows: list[RawPrompt], *, num_eval: int, seed: int, split: Split) -> list[RawPrompt]:
    """Hold out `num_eval` rows picked by `seed` for eval; train gets the rest. Both keep file order."""
    if num_eval >= len(rows):
        raise DataError(
            f"data.num_eval={num_eval} leaves no training rows in a dataset of {len(rows)} usable rows; "
            f"fix: set data.num_eval below {len(rows)} (e.g. {len(rows) // 10})"
        )
    held_out = set(random.Random(f"file:eval:{seed}").sample(range(len(rows)), num_eval))
    return [r for i, r in enumerate(rows) if (i in held_out) == (split == "eval")]


def build_task_source(
    data_cfg: DataConfig,
    tokenizer: PromptTokenizer,
    split: Split = "train",
    images: ImageProcessing | None = None,
) -> PromptSource[PromptItem]:
    """The tokenized prompts of one split as a `PromptSource` (shuffled for train, in order for eval);
    `images`: how a vision-language model reads the rows' pictures."""
    raws = task_prompts(data_cfg, split)
    tokenized = tokenize_prompts(
        raws,
        tokenizer,
        chat_template=data_cfg.chat_template,
        system_prompt=data_cfg.system_prompt,
        max_prompt_length=data_cfg.max_prompt_length,
        images=images,
    )
    return PromptSource(
        tokenized.items, seed=data_cfg.seed, shuffle=split == "train", num_too_long=tokenized.num_too_long
    )


def default_reward_name(task: str) -> str:
    """The built-in reward that scores a task's responses."""
    if task not in DEFAULT_REWARDS:
        raise ValueError(f"data.task={task!r} has no default reward; known tasks: {sorted(DEFAULT_REWARDS)}")
    return DEFAULT_REWARDS[task]
