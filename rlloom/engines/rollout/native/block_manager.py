"""BlockManager: hands out the paged KV cache's blocks and counts who points at each.

The cache is `num_blocks` blocks of `block_size` token slots; a sequence's `block_table` lists its
blocks in order, so token position p lives in slot `block_table[p // block_size] * block_size +
p % block_size`.

Prefix sharing: the n samples of one prompt are forked from the prefilled leader; every fork's block
table points at the leader's blocks and each block's reference count says how many tables hold it.
Full blocks stay shared until the last holder frees them. A partially filled block is shared too,
and the first fork to write into it gets a private copy (copy-on-write): the block manager takes a
free block, records the (source, destination) pair in `pending_copies` for the model runner to copy
before the next forward, and drops one reference to the shared block.

Prefix caching (`enable_prefix_caching`, multi-turn episodes): a full block whose keys and values
are computed is remembered under a hash of its tokens (and of the pictures whose placeholder tokens
it holds: vision.py) chained with those of every block before it, when its sequence frees it. A
later sequence whose tokens start with the same full blocks (the next turn of a trajectory: its
conversation so far plus the new messages) takes those blocks, counted, and its prefill computes
only the tokens after them. A remembered block with no holder stays in the free
list, oldest first, and loses its hash when it is taken for something else; `clear_prefix_cache`
forgets every hash (new weights make the cached keys and values stale).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from rlloom.engines.rollout.native.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        """Free blocks, oldest first, plus stale entries of the `claimed` ones."""
        self.claimed: set[int] = set()
        """Prefix caching: blocks taken back from the free list by a cache hit, whose entries there
        are skipped (or made valid again when the block is freed again)."""
        self.pending_copies: list[tuple[int, int]] = []
        """Copy-on-write (source, destination) block pairs the runner copies before the next forward."""
        self.enable_prefix_caching = enable_prefix_caching
        self.cached: dict[int, int] = {}
        """Prefix caching: chained hash of a computed full block -> the block holding it."""
        self.block_hash: dict[int, int] = {}
        """Prefix caching: block -> the hash it is remembered under."""
        self.num_cached_hits = 0
        """Prompt tokens that prefills did not compute because their blocks were cached."""

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) - len(self.claimed)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        while block in self.claimed:  # a stale entry: the block was taken by a cache hit
            self.claimed.remove(block)
            block = self.free_blocks.popleft()
        assert self.ref_counts[block] == 0, (block, self.ref_counts[block])
        self.ref_counts[block] = 1
        if (h := self.block_hash.pop(block, None)) is not None:  # evicted: its contents get overwritten
            del self.cached[h]
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, block
        if self.ref_counts[block] == 0:
            if block in self.claimed:  # its old entry in the free list is valid again
                self.claimed.remove(block)
            else:
                self.free_blocks.append(block)

    def can_allocate(self, seq: Sequence) -> bool:
        """Room to prefill all of `seq`'s tokens (its forks share these blocks)."""
        return self.blocks_for(seq.num_tokens) <= self.num_free_blocks

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """With prefix caching, the cached blocks `seq`'s tokens start with (never the last token's:
        the prefill must compute it to sample the next); taken by `allocate(seq, prefix)`."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for h in self._hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate(self, seq: Sequence, prefix: list[int] | None = None) -> None:
        """Blocks for all of `seq`'s tokens: the cached `prefix` (`cached_prefix(seq)` when not
        given), shared and counted in `seq.num_cached_tokens`, then fresh ones."""
        assert not seq.block_table, seq.seq_id
        table = self.cached_prefix(seq) if prefix is None else list(prefix)
        for block in table:
            if self.ref_counts[block] == 0:
                self.claimed.add(block)
            self.ref_counts[block] += 1
        if self.enable_prefix_caching:
            seq.num_cached_tokens = len(table) * self.block_size
            self.num_cached_hits += seq.num_cached_tokens
        table += [self._take() for _ in range(self.blocks_for(seq.num_tokens) - len(table))]
        seq.block_table = table

    def _hashes(self, seq: Sequence, num_blocks: int) -> Iterator[int]:
        """The chained hash of each of the first `num_blocks` full blocks of `seq`, computed as they
        are read (a lookup stops at its first miss): a block's tokens and the digests of the pictures
        whose placeholders it holds, so that the same placeholder ids of another picture miss."""
        h, size, token_ids = 0, self.block_size, seq.token_ids
        for i in range(num_blocks):
            start, end = i * size, (i + 1) * size
            pictures = seq.vision.pictures_in(start, end) if seq.vision is not None else ()
            h = hash((h, tuple(token_ids[start:end]), pictures))
            yield h

    def _remember(self, seq: Sequence) -> None:
        """Remember the full blocks of `seq` whose keys and values are computed (before it frees them)."""
        computed = min(seq.num_cached_tokens, seq.num_tokens) // self.block_size
        for block, h in zip(seq.block_table, self._hashes(seq, computed)):
            if h not in self.cached and block not in self.block_hash:
                self.cached[h] = block
                self.block_hash[block] = h

    def clear_prefix_cache(self) -> None:
        """Forget every cached block (new weights: their keys and values are stale)."""
        self.cached.clear()
        self.block_hash.clear()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks (shared, counted) and cached-token count."""
        assert not child.block_table, child.seq_id
        for block in parent.block_table:
            self.ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.num_cached_tokens = parent.num_cached_tokens

    def free(self, seq: Sequence) -> None:
        if self.enable_prefix_caching:
            self._remember(seq)
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def append_cost(self, seq: Sequence) -> int:
        """Free blocks the next decode of `seq` needs: 1 for a new or copied-on-write block, else 0."""
        index = (seq.num_tokens - 1) // self.block_size
        table = seq.block_table
        return 1 if index == len(table) or self.ref_counts[table[index]] > 1 else 0

    def try_append(self, seq: Sequence) -> bool:
        """`may_append` if the free blocks allow it (True), else nothing (False): the decode
        scheduler's per-sequence call."""
        if self.append_cost(seq) == 0:
            return True  # the slot is in a private block already: nothing to do
        if not self.num_free_blocks:
            return False
        self.may_append(seq)
        return True

    def may_append(self, seq: Sequence) -> None:
        """Make the slot of `seq`'s last token writable: a new block, or a private copy of a shared one."""
        pos = seq.num_tokens - 1
        index = pos // self.block_size
        assert index <= len(seq.block_table), (seq.seq_id, pos, len(seq.block_table))
        if index == len(seq.block_table):
            seq.block_table.append(self._take())
            return
        shared = seq.block_table[index]
        if self.ref_counts[shared] > 1:
            private = self._take()
            self.pending_copies.append((shared, private))
            self._release(shared)
            seq.block_table[index] = private

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
