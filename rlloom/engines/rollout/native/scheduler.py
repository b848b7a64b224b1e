"""Scheduler: continuous batching over a waiting and a running queue.

Each step is either a prefill or a decode:
- prefill: admit waiting sequences, oldest first, while the running set stays within
  `max_num_seqs` (a leader counts with its forks), the prefill's sequences padded to its longest
  one within `max_num_batched_tokens`, and the block manager has blocks for all of their tokens;
- decode: one token for every running sequence. When a sequence needs a block and none is free, the
  most recently admitted running sequence is preempted by recompute: its blocks are freed and it goes
  back to the front of the waiting queue, to be prefilled later with its prompt and the tokens it
  has generated (sampling keys on token positions, so the result is the same as without preemption).

`postprocess` appends the sampled tokens, joins a prefilled leader's forks, and finishes sequences.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rlloom.data.types import FinishReason
from rlloom.engines.rollout.native.block_manager import BlockManager
from rlloom.engines.rollout.native.sequence import Sequence, Status


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
        longest = 0
        while self.waiting:
            seq = self.waiting[0]
            if num_seqs + seq.group_size > self.max_num_seqs:
                break
            # The attention pads every sequence to the longest one: budget the padded tokens.
            if seqs and (len(seqs) + 1) * max(longest, seq.num_tokens) > self.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            num_seqs += seq.group_size
            longest = max(longest, seq.num_tokens)
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
        try_append = self.block_manager.try_append
        while self.running:
            seq = self.running.popleft()
            while not try_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                seqs.append(seq)
        self.running.extend(seqs)
        if not seqs:
            return None
        return Batch(seqs, False, list(seqs), list(range(len(seqs))))

    def _preempt(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.block_manager.free(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, batch: Batch, token_ids: list[int], logprobs: list[float]) -> list[Sequence]:
        """Record the sampled tokens; return the sequences that finished in this step."""
        for seq in batch.seqs:
            seq.num_cached_tokens = seq.num_tokens
            for fork in seq.forks:
                self.block_manager.fork(seq, fork)
                fork.status = Status.RUNNING
                self.running.append(fork)
            seq.forks = []
        finished = []
        for seq, token, logprob in zip(batch.rows, token_ids, logprobs):
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        self._drop_running(finished)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if params.stop_strings and self.decode is not None:
            text = self.decode(seq.output_ids)
            if any(s in text for s in params.stop_strings):
                return "stop"
        if len(seq.output_ids) >= params.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

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
