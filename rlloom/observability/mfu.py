"""Model FLOPs and model FLOPs utilisation (MFU) of a decoder-only transformer.

Convention: PaLM (Chowdhery et al. 2022, appendix B). Training one token costs

    6 * N + 12 * L * A * T          (full, bidirectional attention)
    6 * N +  6 * L * A * T          (causal attention: halved, as rlloom reports it)

- N: non-embedding parameters. Each takes part in one multiply-add per token forward (2 FLOPs)
  and two in backward (4 FLOPs): 6 N. The input embedding is a lookup and does no matmul, so it is
  left out; an untied LM head is a matmul, so include `vocab * hidden` in N to count it.
- L: layers; A: attention width, `num_heads * head_dim` of the queries (the hidden size for most
  dense models); T: sequence length (the context the token attends over).
- Attention scores Q K^T and the weighted sum P V each cost 2 * A * T FLOPs per token and layer
  forward, so 4 * L * A * T forward and 12 * L * A * T forward + backward. Under a causal mask the
  t-th token attends to t keys, T / 2 on average, hence the halving. This counts the FLOPs the model
  needs, not what a kernel executes (recomputation in activation checkpointing is not counted).

Forward only (rollout, logprob recomputation) is a third of this: 2 N + 2 L A T causal.

MFU = achieved model FLOPs per second / peak FLOPs per second of the hardware.
"""

from __future__ import annotations

from collections.abc import Iterable

H100_BF16_PEAK_FLOPS = 989e12
"""Dense bf16 peak of one H100 SXM (989 TFLOP/s, no sparsity)."""


def _check_non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name}={value} is invalid: it must be >= 0. Fix: pass a count, not a difference.")


def transformer_flops_per_token(
    num_params_non_embedding: int,
    num_layers: int,
    hidden: int,
    seq_len: int,
    *,
    causal: bool = True,
    backward: bool = True,
) -> float:
    """Model FLOPs to process one token of a `seq_len`-token sequence (see the module docstring).

    `hidden` is the attention width A (num_heads * head_dim). `backward=False` counts the forward
    pass only (one third). `causal=False` counts full attention (PaLM's 12 * L * A * T).
    """
    for name, value in (
        ("num_params_non_embedding", num_params_non_embedding),
        ("num_layers", num_layers),
        ("hidden", hidden),
        ("seq_len", seq_len),
    ):
        _check_non_negative(name, value)
    attention = 12.0 * num_layers * hidden * seq_len
    if causal:
        attention /= 2
    flops = 6.0 * num_params_non_embedding + attention
    return flops if backward else flops / 3


def packed_batch_flops(
    seq_lens: Iterable[int],
    num_params_non_embedding: int,
    num_layers: int,
    hidden: int,
    *,
    causal: bool = True,
    backward: bool = True,
) -> float:
    """Model FLOPs for a packed batch of independent sequences of lengths `seq_lens`.

    Attention cost grows with each sequence's own length, so a batch of one 1000-token and ten
    100-token sequences costs more than its 2000 tokens at the mean length would suggest. Per
    sequence of length s this is `s * transformer_flops_per_token(..., seq_len=s)`, i.e.
    6 N s + 6 L A s^2 (causal, training). Divide by `sum(seq_lens)` for FLOPs per token.
    """
    total = 0.0
    for s in seq_lens:
        total += s * transformer_flops_per_token(
            num_params_non_embedding, num_layers, hidden, s, causal=causal, backward=backward
        )
    return total


def mfu(
    tokens: float,
    seconds: float,
    flops_per_token: float,
    peak_flops: float = H100_BF16_PEAK_FLOPS,
    num_devices: int = 1,
) -> float:
    """Model FLOPs utilisation in [0, 1] (more means the FLOP count or the peak is wrong).

    `tokens` processed in `seconds` by `num_devices` devices, each with `peak_flops` FLOP/s.
    """
    if seconds <= 0:
        raise ValueError(
            f"mfu: seconds={seconds} is invalid: it must be > 0. Fix: time a non-empty interval."
        )
    if peak_flops <= 0 or num_devices < 1:
        raise ValueError(
            f"mfu: peak_flops={peak_flops}, num_devices={num_devices} are invalid: peak_flops must be > 0 "
            "and num_devices >= 1. Fix: pass the per-device peak (e.g. 989e12 for H100 bf16)."
        )
    _check_non_negative("tokens", tokens)
    return tokens * flops_per_token / (seconds * peak_flops * num_devices)
