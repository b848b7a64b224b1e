"""`PromptSource`: batches of prompts over epochs, in a seeded order that resumes exactly.

The order of epoch `e` is a permutation drawn from `(seed, e)` alone, so it never depends on how
many batches were taken before or on the process that draws it. The position is two integers,
`epoch` and `cursor` (prompts of that epoch already handed out), plus the positions given back;
`state_dict()` holds them, the seed and the number of prompts, which `load_state_dict` checks so
that a resume with different data fails loudly instead of silently training on another order.

A batch that runs past the end of an epoch is filled from the start of the next epoch's order,
so every batch has the size asked for.

Giving back: the asynchronous loop drops the jobs in flight at a checkpoint, an evaluation or a stop
and hands their prompts back (`give_back`); the next draws take them first, in the order they were
first drawn, then go on at the cursor. The cursor never moves back: a job trained before the drop
may have drawn prompts after a dropped one (dynamic sampling's extra rounds), and rewinding the
cursor would draw those a second time in the epoch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from rlloom.data.dataset import DataError

Item = TypeVar("Item")
"""What a source hands out: a `PromptItem` (RL), or a tokenized conversation's samples (`rlloom sft`)."""

Position = tuple[int, int]
"""Where a prompt was drawn: (epoch, offset in that epoch's order)."""


def epoch_order(num_items: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The item order of one epoch: a permutation seeded by (seed, epoch), or 0..n-1 unshuffled."""
    order = list(range(num_items))
    if shuffle:
        # A string seed is hashed with SHA-512 by `random`, so it is stable across processes and
        # independent of PYTHONHASHSEED.
        random.Random(f"rlloom-prompts:{seed}:{epoch}").shuffle(order)
    return order


class PromptSource(Generic[Item]):
    """Hands out prompts in batches, epoch after epoch, from a seed.

    Example: `src = PromptSource(items, seed=0)`; `batch = src.next_batch(8)`;
    `state = src.state_dict()` -> `{"epoch": 0, "cursor": 8, "seed": 0, "num_items": 100, "returned": []}`.
    """

    def __init__(
        self, items: Sequence[Item], *, seed: int = 0, shuffle: bool = True, num_too_long: int = 0
    ) -> None:
        self.items: tuple[Item, ...] = tuple(items)
        self.seed = seed
        self.shuffle = shuffle
        self.num_too_long = num_too_long
        """Prompts left out when the source was built because they exceed data.max_prompt_length."""
        self.epoch = 0
        self.cursor = 0
        self.returned: list[Position] = []
        """Positions given back (`give_back`), sorted: drawn again before the cursor moves on."""
        self._orders: dict[int, list[int]] = {}  # epoch_order of the epochs in use

    def __len__(self) -> int:
        return len(self.items)

    def next_batch(self, num_prompts: int) -> list[Item]:
        """The next `num_prompts` prompts, moving into the next epoch(s) when this one runs out."""
        return [self.item_at(p) for p in self.next_positions(num_prompts)]

    def next_positions(self, num_prompts: int) -> list[Position]:
        """Where the next `num_prompts` prompts are: the ones given back first, then the cursor's."""
        if num_prompts < 1:
            raise ValueError(f"PromptSource.next_batch: num_prompts={num_prompts} must be >= 1")
        if not self.items:
            raise ValueError(
                "PromptSource.next_batch: the source holds no prompts; check data.num_train / data.path"
            )
        positions, self.returned = self.returned[:num_prompts], self.returned[num_prompts:]
        while len(positions) < num_prompts:
            if self.cursor == len(self.items):
                self.epoch, self.cursor = self.epoch + 1, 0
            take = min(num_prompts - len(positions), len(self.items) - self.cursor)
            positions.extend((self.epoch, k) for k in range(self.cursor, self.cursor + take))
            self.cursor += take
        return positions

    def item_at(self, position: Position) -> Item:
        epoch, offset = position
        return self.items[self._epoch_order(epoch)[offset]]

    def give_back(self, positions: list[Position]) -> None:
        """Prompts drawn but never trained (their job was dropped): the next draws take them first."""
        self.returned = sorted({*self.returned, *positions})

    def state_dict(self) -> dict[str, Any]:
        """The position, as a small JSON-friendly dict."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "num_items": len(self.items),
            "returned": [list(p) for p in self.returned],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the seed and the number of prompts must match. A state
        without `returned` (saved before prompts could be given back) has none."""
        if state["num_items"] != len(self.items) or state["seed"] != self.seed:
            raise DataError(
                f"prompt source state was saved for {state['num_items']} prompts with data.seed={state['seed']}, "
                f"but this source has {len(self.items)} prompts with data.seed={self.seed}; the order would differ. "
                "Fix: resume with the same data settings (path, task, num_train, max_prompt_length, seed)"
            )
        returned = sorted((int(e), int(k)) for e, k in state.get("returned", []))
        in_range = all(0 <= e and 0 <= k < len(self.items) for e, k in returned)
        if not 0 <= state["cursor"] <= len(self.items) or state["epoch"] < 0 or not in_range:
            raise ValueError(f"prompt source state {state} is out of range for {len(self.items)} prompts")
        self.epoch, self.cursor, self.returned = state["epoch"], state["cursor"], returned

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            # The epochs in use: the cursor's and those of the prompts given back.
            keep = {self.epoch, *(e for e, _ in self.returned)}
            self._orders = {e: o for e, o in self._orders.items() if e in keep}
            self._orders[epoch] = epoch_order(
                len(self.items), seed=self.seed, epoch=epoch, shuffle=self.shuffle
            )
        return self._orders[epoch]
