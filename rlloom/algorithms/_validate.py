"""Input checks shared by the algorithm functions: tensor type, shape, finiteness, masks, group ids.

Every check raises `ValueError` naming the argument, what it got, the rule and the fix, so a bad
batch fails at the function that received it instead of surfacing later as a NaN loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_deferred: list[tuple[str, torch.Tensor, int]] | None = None


@contextlib.contextmanager
def deferred_finite_checks() -> Iterator[None]:
    """Inside, `check_finite` of a CUDA tensor queues its count of bad entries instead of reading it
    (a host sync per check); on exit the counts are read at once and the first bad one raises the
    same ValueError. The training engine runs its micro-batch loop under this, so the GPU queue
    never drains for a check."""
    global _deferred
    outer, _deferred = _deferred, []
    try:
        yield
        pending = _deferred
    finally:
        _deferred = outer
    if pending:
        counts = torch.stack([bad for _, bad, _ in pending]).tolist()
        for (name, _, numel), num_bad in zip(pending, counts):
            if num_bad:
                raise _not_finite(name, int(num_bad), numel)


def _not_finite(name: str, num_bad: int, numel: int) -> ValueError:
    return ValueError(
        f"{name} has {num_bad} NaN/inf entries out of {numel}; every entry must be finite. "
        "Fix: find the upstream overflow (e.g. -inf logprobs at padding) and put a finite value there."
    )


def check_tensor(name: str, x: object, *, ndim: int | None = None) -> torch.Tensor:
    """Return `x` if it is a tensor with `ndim` dimensions; raise ValueError otherwise."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(
            f"{name} must be a torch.Tensor, got {type(x).__name__}. Fix: pass torch.tensor(...)."
        )
    if ndim is not None and x.dim() != ndim:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} ({x.dim()} dims) but must have {ndim} dims. "
            "Fix: check the argument order and the shape suffix in the argument name."
        )
    return x


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise ValueError if a floating tensor holds NaN or inf (never propagate them silently)."""
    if not x.is_floating_point():
        return
    if _deferred is not None and x.is_cuda:
        _deferred.append((name, (~torch.isfinite(x.detach())).sum(), x.numel()))
        return
    if not bool(torch.isfinite(x).all()):
        raise _not_finite(name, int((~torch.isfinite(x)).sum()), x.numel())


def float_input(name: str, x: object, *, ndim: int | None = None) -> torch.Tensor:
    """A floating, finite tensor with `ndim` dims. Integer or bool inputs become the default float dtype."""
    x = check_tensor(name, x, ndim=ndim)
    if not x.is_floating_point():
        if x.is_complex():
            raise ValueError(f"{name} has complex dtype {x.dtype}; it must be real. Fix: pass a real tensor.")
        x = x.to(torch.get_default_dtype())
    check_finite(name, x)
    return x


def check_same_shape(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise ValueError if `x` and `ref` differ in shape."""
    if x.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}; they must match. "
            "Fix: build both from the same batch with the same response width T."
        )


def bool_mask(name: str, mask: object, shape: torch.Size, ref_name: str) -> torch.Tensor:
    """Return `mask` as a bool tensor of `shape` (the shape of `ref_name`); it may be bool or 0/1."""
    mask = check_tensor(name, mask)
    if mask.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but {ref_name} has shape {tuple(shape)}; a mask must have "
            "the shape of the tensors it masks. Fix: build both from the same batch with the same width T."
        )
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            f"{name} holds values other than 0 and 1; a mask must be bool or 0/1. Fix: pass mask != 0."
        )
    return mask != 0


def check_group_ids(group_ids_B: object, num_samples: int) -> torch.Tensor:
    """Raise ValueError unless `group_ids_B` is a 1-D integer tensor with one id per sample."""
    group_ids_B = check_tensor("group_ids_B", group_ids_B, ndim=1)
    if group_ids_B.is_floating_point() or group_ids_B.is_complex() or group_ids_B.dtype == torch.bool:
        raise ValueError(
            f"group_ids_B has dtype {group_ids_B.dtype}; it must be an integer tensor. "
            "Fix: pass torch.tensor([s.group_id for s in samples]) (int64)."
        )
    if group_ids_B.numel() != num_samples:
        raise ValueError(
            f"group_ids_B has {group_ids_B.numel()} entries but rewards_B has {num_samples}; "
            "they must match, one group id per sample. Fix: build both from the same list of samples."
        )
    return group_ids_B


def check_positive(name: str, value: float) -> None:
    """Raise ValueError unless `value` > 0."""
    if not value > 0:
        raise ValueError(f"{name}={value!r} must be > 0. Fix: pass a positive number.")
