"""Model FLOPs of one training or forward pass of the engine, for MFU.

Counts what the engine computes: the decoder body over every token of every sequence (with causal
attention growing with each sequence's own length, see `rlloom.observability.mfu`), and the
language-model head only at the positions that predict a trained response token, because the
engine's chunked head runs nowhere else. Routed MoE experts count with their active fraction
top_k / num_experts.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from rlloom.observability.mfu import packed_batch_flops


def active_body_params(model: nn.Module) -> float:
    """Parameters used per token by the decoder layers (no embedding, no lm head)."""
    args = model.args
    total = 0.0
    for name, p in model.named_parameters():
        if not name.startswith("layers."):
            continue
        if ".moe.experts." in name and args.moe is not None:
            total += p.numel() * args.moe.top_k / args.moe.num_experts
        else:
            total += p.numel()
    return total


def step_flops(
    model: nn.Module,
    seq_lens: Sequence[int],
    num_head_tokens: int,
    *,
    body_params: float,
    backward: bool = True,
) -> float:
    """FLOPs of a pass over sequences of `seq_lens` tokens with the head at `num_head_tokens` positions."""
    args = model.args
    body = packed_batch_flops(
        seq_lens, int(body_params), args.num_layers, args.num_heads * args.head_dim, backward=backward
    )
    head = 2.0 * args.vocab_size * args.hidden_size * num_head_tokens * (3 if backward else 1)
    return body + head
