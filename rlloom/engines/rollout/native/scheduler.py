"""Scheduler: continuous batching over a waiting and a running queue.

Each step is either a prefill or a decode:
- prefill: admit waiting sequences, oldest first, while the running set stays within
  `max_num_seqs` (a leader counts with its forks), the prefill's new tokens padded to the most of
  any sequence within `max_num_batched_tokens` (tokens the prefix cache holds are not new), the keys
  it gathers within `8 * max_num_batched_tokens`, and the block manager has blocks for all tokens;
- decode: one token for every running sequence. When a sequence needs a block and none is free, the
  most recently admitted running sequence is preempted by recompute: its blocks are freed and it goes
  back to the front of the waiting queue, to be prefilled later with its prompt and the tokens it
  has generated (sampling keys on token positions, so the result is the same as without preemption).

A step's results are recorded in two halves, so that the engine can schedule and launch the next
step while the device still samples this one (see engine.py):
- `launched(batch)`, right after the forward is queued: marks the tokens cached, joins a prefilled
  leader's forks, and appends a pending token (`sequence.pending(row)`) to every row;
- `resolve(...)`, once the sampled tokens are on the host: writes them over the pending entries and
  finishes sequences. A sequence that finished was possibly scheduled once more in the meantime:
  that step's pending token is dropped, and its result ignored.
A sequence whose pending token is certainly its last (`max_new_tokens` or `max_model_len` reached)
is not scheduled again while it waits for its result.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rlloom.data.types import FinishReason
from rlloom.engines.rollout.native.block_manager import BlockManager
from rlloom.engines.rollout.native.sequence import Sequence, Status, pending


@dataclass(slots=True)
class Batch:
    """One scheduled step: the sequences run through the model and who receives each sampled token."""

    seqs: list[Sequence]
    """Sequences in the forward (prefill: all their uncached tokens; decode: their last token)."""
    is_prefill: bool
    rows: list[Sequence]
    """Receiver of each sampled token: the forward's sequences plus, in prefill, the leaders' forks."""
    row_source: list[int]
    """For each row, the index in `seqs` whose logits it samples from (forks use their leader's)."""


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_batched_keys = 8 * max_num_batched_tokens
        """Keys a prefill gathers per layer (sequences x the longest); a prompt prefilled whole has as
        many keys as new tokens, so only prefills served by the prefix cache come near it."""
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.decode = decode
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        """The next step's batch, or None when nothing can run."""
        seqs: list[Sequence] = []
        num_seqs = len(self.running)
        widest_query = widest_keys = 0
        bm = self.block_manager
        while self.waiting:
            seq = self.waiting[0]
            if num_seqs + seq.group_size > self.max_num_seqs:
                break
            prefix = bm.cached_prefix(seq)
            query = seq.num_tokens - len(prefix) * bm.block_size
            # The attention pads every sequence's new tokens to the most of any, and gathers every
            # sequence's keys up to the longest: budget both (a next turn served by the prefix cache
            # has few new tokens and many keys).
            if seqs and (
                (len(seqs) + 1) * max(widest_query, query) > self.max_num_batched_tokens
                or (len(seqs) + 1) * max(widest_keys, seq.num_tokens) > self.max_num_batched_keys
            ):
                break
            if not bm.can_allocate(seq):
                break
            self.waiting.popleft()
            bm.allocate(seq, prefix)
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            num_seqs += seq.group_size
            widest_query, widest_keys = max(widest_query, query), max(widest_keys, seq.num_tokens)
        if seqs:
            rows, source = [], []
            for i, seq in enumerate(seqs):
                for member in (seq, *seq.forks):
                    rows.append(member)
                    source.append(i)
            return Batch(seqs, True, rows, source)
        return self._schedule_decode()

    def _schedule_decode(self) -> Batch | None:
        seqs: list[Sequence] = []
        done: list[Sequence] = []  # last token pending: nothing more to compute
        try_append = self.block_manager.try_append
        while self.running:
            seq = self.running.popleft()
            if self._at_limit(seq, len(seq.output_ids)):
                done.append(seq)
                continue
            while not try_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                seqs.append(seq)
        self.running.extend(seqs)
        self.running.extend(done)
        if not seqs:
            return None
        return Batch(seqs, False, list(seqs), list(range(len(seqs))))

    def _preempt(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.block_manager.free(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def launched(self, batch: Batch) -> list[int]:
        """Record that `batch`'s forward is queued; return, per row, where its pending token sits in
        the row's `output_ids` (row r's token is `pending(r)` until `resolve`)."""
        for seq in batch.seqs:
            seq.num_cached_tokens = seq.num_tokens
            for fork in seq.forks:
                self.block_manager.fork(seq, fork)
                fork.status = Status.RUNNING
                self.running.append(fork)
            seq.forks = []
        offsets = []
        for row, seq in enumerate(batch.rows):
            offsets.append(len(seq.output_ids))
            seq.output_ids.append(pending(row))
            seq.logprobs.append(float("nan"))
        return offsets

    def resolve(
        self, rows: list[Sequence], offsets: list[int], token_ids: list[int], logprobs: list[float]
    ) -> list[Sequence]:
        """Write a launched step's sampled tokens; return the sequences that finished with them."""
        finished = []
        for seq, at, token, logprob in zip(rows, offsets, token_ids, logprobs):
            if seq.status is Status.FINISHED:  # finished (or aborted) while this step ran
                continue
            seq.output_ids[at] = token
            seq.logprobs[at] = logprob
            reason = self._finish_reason(seq, at + 1)
            if reason is not None:
                del seq.output_ids[at + 1 :], seq.logprobs[at + 1 :]  # a later step's pending token
                if seq.status is Status.WAITING:  # preempted while this step ran
                    self.waiting.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        self._drop_running(finished)
        return finished

    def _at_limit(self, seq: Sequence, num_output: int) -> bool:
        return (
            num_output >= seq.params.max_new_tokens or len(seq.prompt_ids) + num_output >= self.max_model_len
        )

    def _finish_reason(self, seq: Sequence, num_output: int) -> FinishReason | None:
        """Why `seq` ends after its first `num_output` generated tokens, or None."""
        params, token = seq.params, seq.output_ids[num_output - 1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if params.stop_strings and self.decode is not None:
            text = self.decode(seq.output_ids[:num_output])
            if any(s in text for s in params.stop_strings):
                return "stop"
        return "length" if self._at_limit(seq, num_output) else None

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Mark `seq` finished and free its blocks; the caller takes it out of the running queue
        (`_drop_running`, one pass for all of a step's finished sequences)."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error
        self.block_manager.free(seq)

    def _drop_running(self, seqs: list[Sequence]) -> None:
        if seqs:
            gone = set(map(id, seqs))
            self.running = deque(s for s in self.running if id(s) not in gone)

    def abort(self, request_ids: set[str]) -> list[Sequence]:
        """Finish every waiting or running sequence of these requests with "abort"; return them."""
        aborted = []
        for seq in [s for s in (*self.waiting, *self.running) if s.request_id in request_ids]:
            if seq in self.waiting:
                self.waiting.remove(seq)
            for member in (seq, *seq.forks):
                self._finish(member, "abort", "aborted by the caller (engine.abort)")
                aborted.append(member)
            seq.forks = []
        self._drop_running(aborted)
        return aborted
