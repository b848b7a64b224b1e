"""Weight export for weight sync: full tensors under Hugging Face names, in size-bounded buckets.

Sharded (FSDP) parameters are gathered with `DTensor.full_tensor()`, a collective: every rank must
iterate the generator to the end in the same order, although usually only one rank sends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rlloom.models.adapter import StateDictAdapter


def tensor_checksum(tensor: torch.Tensor) -> str:
    """Hex BLAKE2b digest of a tensor's dtype, shape and bytes: equal exactly when the values are.

    Both sides of a weight sync can call it on what they sent and received (same dtype) to prove the
    transfer was lossless. Costs one copy to CPU.
    """
    t = tensor.detach().contiguous().cpu()
    digest = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def named_weight_buckets(
    model: nn.Module, *, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (hf_name, full tensor) of `model` (a native CausalLM, possibly FSDP-sharded).

    A bucket holds at most `bucket_bytes` (a larger tensor comes alone). Tensors are cast to `dtype`
    when given (e.g. bf16 for a bf16 rollout engine) and stay on the model's device.
    """
    if bucket_bytes < 1:
        raise ValueError(
            f"bucket_bytes={bucket_bytes} is invalid: must be >= 1. Fix: use e.g. 512 MiB (1 << 29)."
        )
    adapter = StateDictAdapter(model.args)
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for native_name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
        if dtype is not None:
            full = full.to(dtype)
        for hf_name, part in adapter.to_hf(native_name, full):
            nbytes = part.numel() * part.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((hf_name, part))
            size += nbytes
    if bucket:
        yield bucket
