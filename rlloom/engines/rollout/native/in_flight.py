"""The step in flight: a launched step's sampled tokens (and an MoE model's routes) on their way to
the host while the device computes the next one (engine.py's `step`).

On CUDA the tokens and logprobs are copied into one of two pinned host buffers without waiting,
alternate steps taking alternate buffers (the other one is still being read), and an event marks
when the copies are done; on CPU they are the results themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlloom.engines.rollout.native.scheduler import Batch
from rlloom.engines.rollout.native.sequence import Sequence


@dataclass(slots=True)
class InFlight:
    """A launched step whose sampled tokens are on their way to the host."""

    rows: list[Sequence]
    offsets: list[int]
    """Where each row's pending token sits in its `output_ids` (`Scheduler.launched`)."""
    token_ids_R: torch.Tensor
    """The sampled tokens on the device: the next step's forward reads its pending tokens here."""
    host_token_ids_R: torch.Tensor
    host_logprobs_R: torch.Tensor
    copied: torch.cuda.Event | None
    """Recorded after the device-to-host copies (None on CPU, where they are done already)."""
    row_source: list[int]
    """Each row's sequence in the forward (`Batch.row_source`)."""
    route_spans: list[tuple[int, int, int]]
    """MoE: per sequence of the forward, (first position, positions, first row of `routes`)."""
    routes: torch.Tensor | None
    """MoE: [rows of the forward, MoE layers, K] experts used, on the host once `copied`."""

    def wait(self) -> None:
        """Until the host copies are done."""
        if self.copied is not None:
            self.copied.synchronize()


@dataclass(slots=True)
class HostBuffers:
    """Two pinned (token, logprob) buffers of `rows` entries on CUDA, used by alternate steps."""

    rows: int
    _buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffer the step before last used (the last step's may still be read)."""
        if not self._buffers:
            self._buffers = [
                (
                    torch.empty(self.rows, dtype=torch.int64, pin_memory=True),
                    torch.empty(self.rows, dtype=torch.float32, pin_memory=True),
                )
                for _ in range(2)
            ]
        self._buffers.reverse()
        return self._buffers[0]


def launched(
    batch: Batch,
    spans: list[tuple[int, int, int]],
    offsets: list[int],
    token_ids_R: torch.Tensor,
    logprobs_R: torch.Tensor,
    routes: torch.Tensor | None,
    buffers: HostBuffers,
) -> InFlight:
    """The record of a step whose sampling is queued (`spans`: `route_spans` of the batch before it
    was launched): on CUDA its copies to the host are queued too."""
    if token_ids_R.device.type != "cuda":
        # A copy: graph outputs are static buffers that the next step's replay overwrites.
        routes = None if routes is None else routes.clone()
        return InFlight(
            batch.rows, offsets, token_ids_R, token_ids_R, logprobs_R, None, batch.row_source, spans, routes
        )
    R = len(batch.rows)
    host_tokens, host_logprobs = (buf[:R] for buf in buffers.next())
    host_tokens.copy_(token_ids_R, non_blocking=True)
    host_logprobs.copy_(logprobs_R, non_blocking=True)
    if routes is not None:  # pinned memory comes from torch's caching host allocator
        routes = torch.empty(routes.shape, dtype=routes.dtype, pin_memory=True).copy_(
            routes, non_blocking=True
        )
    copied = torch.cuda.Event()
    copied.record()
    return InFlight(
        batch.rows, offsets, token_ids_R, host_tokens, host_logprobs, copied, batch.row_source, spans, routes
    )


def route_spans(batch: Batch) -> list[tuple[int, int, int]]:
    """Per sequence of the forward: (first position, positions, first row) of its tokens in the
    forward's input: a prefill feeds every uncached token, a decode the last one."""
    spans, offset = [], 0
    for seq in batch.seqs:
        start = seq.num_cached_tokens if batch.is_prefill else seq.num_tokens - 1
        n = seq.num_tokens - start
        spans.append((start, n, offset))
        offset += n
    return spans
