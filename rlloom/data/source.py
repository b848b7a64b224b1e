"""`PromptSource`: batches of prompts over epochs, in a seeded order that resumes exactly.

The order of epoch `e` is a permutation drawn from `(seed, e)` alone, so it never depends on how
many batches were taken before or on the process that draws it. The position is two integers,
`epoch` and `cursor` (prompts of that epoch already handed out); `state_dict()` holds them plus
the seed and the number of prompts, which `load_state_dict` checks so that a resume with
different data fails loudly instead of silently training on another order.

A batch that runs past the end of an epoch is filled from the start of the next epoch's order,
so every batch has the size asked for.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rlloom.data.dataset import DataError, PromptItem


def epoch_order(num_items: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The item order of one epoch: a permutation seeded by (seed, epoch), or 0..n-1 unshuffled."""
    order = list(range(num_items))
    if shuffle:
        # A string seed is hashed with SHA-512 by `random`, so it is stable across processes and
        # independent of PYTHONHASHSEED.
        random.Random(f"rlloom-prompts:{seed}:{epoch}").shuffle(order)
    return order


class PromptSource:
    """Hands out prompts in batches, epoch after epoch, from a seed.

    Example: `src = PromptSource(items, seed=0)`; `batch = src.next_batch(8)`;
    `state = src.state_dict()` -> `{"epoch": 0, "cursor": 8, "seed": 0, "num_items": 100}`.
    """

    def __init__(
        self, items: Sequence[PromptItem], *, seed: int = 0, shuffle: bool = True, num_too_long: int = 0
    ) -> None:
        self.items: tuple[PromptItem, ...] = tuple(items)
        self.seed = seed
        self.shuffle = shuffle
        self.num_too_long = num_too_long
        """Prompts left out when the source was built because they exceed data.max_prompt_length."""
        self.epoch = 0
        self.cursor = 0
        self._order: list[int] | None = None  # cache of epoch_order for self.epoch

    def __len__(self) -> int:
        return len(self.items)

    def next_batch(self, num_prompts: int) -> list[PromptItem]:
        """The next `num_prompts` prompts, moving into the next epoch(s) when this one runs out."""
        if num_prompts < 1:
            raise ValueError(f"PromptSource.next_batch: num_prompts={num_prompts} must be >= 1")
        if not self.items:
            raise ValueError(
                "PromptSource.next_batch: the source holds no prompts; check data.num_train / data.path"
            )
        batch: list[PromptItem] = []
        while len(batch) < num_prompts:
            if self.cursor == len(self.items):
                self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
            take = min(num_prompts - len(batch), len(self.items) - self.cursor)
            order = self._epoch_order()
            batch.extend(self.items[i] for i in order[self.cursor : self.cursor + take])
            self.cursor += take
        return batch

    def state_dict(self) -> dict[str, int]:
        """The position, as a small JSON-friendly dict."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_items": len(self.items)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; the seed and the number of prompts must match."""
        if state["num_items"] != len(self.items) or state["seed"] != self.seed:
            raise DataError(
                f"prompt source state was saved for {state['num_items']} prompts with data.seed={state['seed']}, "
                f"but this source has {len(self.items)} prompts with data.seed={self.seed}; the order would differ. "
                "Fix: resume with the same data settings (path, task, num_train, max_prompt_length, seed)"
            )
        if not 0 <= state["cursor"] <= len(self.items) or state["epoch"] < 0:
            raise ValueError(f"prompt source state {state} is out of range for {len(self.items)} prompts")
        self.epoch, self.cursor, self._order = state["epoch"], state["cursor"], None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            self._order = epoch_order(len(self.items), seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        return self._order
