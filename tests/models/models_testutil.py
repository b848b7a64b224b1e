"""Shared helpers of the rlloom.models tests: tiny HF models with lively weights, inputs, comparisons."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import torch


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite every weight so logits are O(1) and routing is decisive (HF init is nearly zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name or "original_inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    return model


def lengths_to_packed(
    lengths: list[int], vocab: int, seed: int = 0
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-sequence ids, ids_N, position_ids_N, cu_seqlens) for sequences of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return seqs, torch.cat(seqs), positions, cu


def right_pad(seqs: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], attention_mask [B, L] bool) of right-padded sequences."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
        mask[b, : len(s)] = True
    return ids, mask


@torch.no_grad()
def hf_logits_per_sequence(hf_model: torch.nn.Module, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Reference logits [N, V]: the HF model run on each sequence alone, concatenated."""
    return torch.cat([hf_model(s[None]).logits[0] for s in seqs])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-4) -> None:
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff <= atol, (
        f"max abs diff {diff:.3e} > {atol:.0e} (reference scale {expected.abs().max().item():.3f})"
    )


def run_in_triton_interpreter(script: str, *paths: Path, argv: tuple[str, ...] = ()) -> None:
    """Run `script` in a subprocess with TRITON_INTERPRET=1 (it must be set before Triton compiles a
    kernel); `paths` go on PYTHONPATH, `argv` are its sys.argv[1:]; the script must print "ok"."""
    env = os.environ | {
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([*map(str, paths), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
