"""Attention functions over the three input layouts a CausalLM accepts.

- padded: q/k/v [B, T, H, D] of a right-padded batch; plain causal attention. With right padding
  the causal mask already hides every pad key from every real query (pads come after the real
  tokens), so real positions are exact without an explicit mask, and the fast `is_causal` kernels
  stay usable. Outputs at pad positions are finite and meaningless.
- packed: q/k/v [N, H, D] of sequences laid back to back (`cu_seqlens` [S + 1]); block-diagonal
  causal attention, no token sees another sequence.
- tree: a packed stream whose segments may be prompt-sharing trees, [prompt (P), branch_1, ...,
  branch_k] (see `rlloom.data.types`): prompt tokens attend causally within the prompt, a branch
  token to the whole prompt and causally to its own branch. Segments with at most one branch are
  plain causal sequences.
- backend: q/k/v [N, H, D] handed to a pluggable `attn` object: `attn.attn(q, k, v, scale) -> out`,
  called once per layer in layer order, k/v NOT repeated for GQA. Two backends use this hook: the rollout engine's paged
  KV cache, and context parallelism (`rlloom.parallel.cp.CPShard`: the stream is one rank's share
  of a packed micro-batch, and the hook attends to the keys of every cp rank).

Packed kernels by device:
- CPU (the tested reference) and other cases: one causal SDPA per sequence. Measured on 2 CPU
  cores with SmolLM2 attention shapes (benchmarks/bench_models.py --cpu-packed), this beats one SDPA
  over the whole stream with a block-diagonal [N, N] mask at every size tried, e.g. 1.1 vs 2.2 ms
  at 256 tokens, 2.6 vs 24 ms for 32 sequences of 16 tokens, 101 vs 1927 ms at 4096 tokens (the
  masked call falls back to the math kernel), and its memory grows with the longest sequence only.
- CUDA with bf16/fp16 and equal q/v head dims: `torch.nn.attention.varlen.varlen_attn`
  (FlashAttention varlen; causal through window (-1, 0)); untested here (no GPU in CI).

Under rollout.match_training on CUDA (`is_exact()`), every layout goes to one batch-invariant kernel
instead (`exact_cuda_attention`, models/exact_attention.py), the one the rollout's paged attention
uses then, so a token's attention output does not depend on the layout or the batch.

Tree kernels (`TreePlan` holds the structure, built once per forward and shared by all layers):
- CPU and other cases: per segment, causal SDPA when it has at most one branch, else one SDPA with
  an explicit [L, L] bool mask. Measured on 2 CPU cores (SmolLM2 shapes, forward + backward, prompt
  50 + 4 branches of 20; benchmarks/bench_shared_prompts.py --attention): 2.0-2.6 ms against
  4.4-5.0 ms for causal SDPA over the prompt plus one masked SDPA per branch over cat(prompt k/v,
  branch k/v).
- CUDA with bf16/fp16 and equal q/v head dims: ONE varlen call per layer. The stream is cut into
  runs (each prompt, each branch); a prompt run attends to itself, a branch run to its prompt's
  k/v followed by its own (gathered once per layer). FlashAttention aligns the causal mask to the
  bottom right when a run has fewer queries than keys, so branch token t sees the whole prompt and
  branch tokens 0..t: exactly the tree mask, with no per-segment launches.

Shape legend: B batch, T padded length, N packed tokens, S sequences, Hq query heads, Hkv key/value
heads, D head channels (Dqk for q/k, Dv for v).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from rlloom.devices import to_device
from rlloom.models.exact import is_exact, uses_kernels


class AttnBackend(Protocol):
    """Attention that knows the sequence structure the model does not: the rollout engine's (it owns
    the KV cache) or context parallelism's (the keys live on several ranks)."""

    def attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Called once per decoder layer, in layer order, every forward: a backend that keeps state
        per layer counts the calls (no layer index is passed, so none becomes a constant of a
        compiled graph: see the rollout engine's attention.py)."""


@dataclass(slots=True)
class AttnLayout:
    """How the tokens of one forward are arranged; built once per forward by CausalLM."""

    kind: str
    """'padded', 'packed', 'tree' or 'backend'."""
    cu_seqlens: torch.Tensor | None = None
    """packed and tree: [S + 1] int32 cumulative sequence (segment) lengths."""
    max_seqlen: int | None = None
    """packed: longest sequence (needed by the CUDA varlen kernel)."""
    tree: TreePlan | None = None
    """tree: the segments' prompt and branch structure."""
    backend: Any = None
    """backend: the object whose `.attn(...)` computes attention."""


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, layout: AttnLayout
) -> torch.Tensor:
    """Causal attention of q [.., Hq, Dqk] over k [.., Hkv, Dqk], v [.., Hkv, Dv] -> [.., Hq, Dv]."""
    if layout.kind == "backend":
        return layout.backend.attn(q, k, v, scale)
    if is_exact() and uses_kernels(q):
        return exact_cuda_attention(q, k, v, scale, layout)
    if layout.kind == "padded":
        return padded_attention(q, k, v, scale)
    if layout.kind == "tree":
        return tree_attention(q, k, v, scale, layout.tree)
    assert layout.kind == "packed", layout.kind
    return packed_attention(q, k, v, scale, layout.cu_seqlens, layout.max_seqlen)


def exact_cuda_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, layout: AttnLayout
) -> torch.Tensor:
    """rollout.match_training on CUDA: the batch-invariant kernel (models/exact_attention.py) over the
    layout's runs, the rollout's paged kernel for every query; its gradient is the plain kernel's."""
    from rlloom.models import exact_attention  # Triton: imported where it runs

    if layout.kind == "padded":  # B runs of T rows (right padding: pads come after every real key)
        B, T = q.shape[:2]
        cu = torch.arange(B + 1, dtype=torch.int32, device=q.device) * T
        packed = AttnLayout("packed", cu_seqlens=cu, max_seqlen=T)
        out = exact_cuda_attention(*(x.flatten(0, 1) for x in (q, k, v)), scale, packed)
        return out.unflatten(0, (B, T))
    if layout.kind == "tree":
        cu_q, cu_k, kv_index, max_q, _ = layout.tree.varlen()
        runs = exact_attention.varlen_runs(*(to_device(x, q.device) for x in (cu_q, cu_k, kv_index)), max_q)

        def reference(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
            return tree_attention(q_, k_, v_, scale, layout.tree)
    else:
        cu = to_device(layout.cu_seqlens, q.device)
        max_seqlen = layout.max_seqlen if layout.max_seqlen is not None else int((cu[1:] - cu[:-1]).max())
        runs = exact_attention.packed_runs(cu, max_seqlen, q.shape[0])

        def reference(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
            return packed_attention(q_, k_, v_, scale, cu, max_seqlen)

    return exact_attention.attention(q, k, v, scale, runs, reference)


def padded_attention(
    q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal SDPA over a (right-padded) batch -> [B, T, Hq, Dv]."""
    q, k, v = (x.transpose(1, 2) for x in (q_BTHD, k_BTHD, v_BTHD))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2)


def check_right_padded(attention_mask_BT: torch.Tensor) -> None:
    """ValueError unless every row is ones then zeros (real tokens first, padding after)."""
    mask = attention_mask_BT.bool()
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError(
            "attention_mask must describe right padding (each row: True on the real tokens, then False); "
            "got a row with a real token after padding. Fix: right-pad the batch (RolloutBatch.padded() "
            "does) or pass a packed stream."
        )


def packed_attention(
    q_NHD: torch.Tensor,
    k_NHD: torch.Tensor,
    v_NHD: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Block-diagonal causal attention over a packed stream -> [N, Hq, Dv]."""
    if flash_varlen_fits(q_NHD, v_NHD):
        return _varlen_cuda(q_NHD, k_NHD, v_NHD, scale, cu_seqlens, max_seqlen)
    gqa = q_NHD.shape[1] != k_NHD.shape[1]
    return _per_sequence(q_NHD, k_NHD, v_NHD, scale, cu_seqlens.tolist(), gqa)


def flash_varlen_fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether FlashAttention's varlen kernel takes these heads: CUDA, bf16/fp16, equal q/v head
    dims, a multiple of 8 up to 256 (the kernel refuses other sizes; a tiny MLA config has 12)."""
    d = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and d == v.shape[-1]
        and d % 8 == 0
        and d <= 256
    )


def _per_sequence(
    q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, scale: float, cu: list[int], gqa: bool
) -> torch.Tensor:
    outs = []
    for start, end in zip(cu[:-1], cu[1:]):
        q, k, v = (x[start:end].transpose(0, 1) for x in (q_NHD, k_NHD, v_NHD))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs, dim=0)


def _varlen_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
) -> torch.Tensor:
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    return varlen_causal(q, k, v, scale, cu, cu, max_seqlen, max_seqlen)


def varlen_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
) -> torch.Tensor:
    """FlashAttention varlen, causal aligned to the bottom right (a run with fewer queries than keys
    has its queries at the end of its keys)."""
    from torch.nn.attention.varlen import varlen_attn

    # The keyword arguments changed across torch releases (2.11: is_causal, no scale and no GQA;
    # later: window_size, scale, enable_gqa): adapt to the installed one.
    params = _varlen_params()
    kwargs: dict[str, object] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # the kernel uses 1/sqrt(head_dim); fold the difference into q
        q = q * (scale * math.sqrt(q.shape[-1]))
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            reps = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


VarlenRuns = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]


def varlen_runs(
    q_lens: list[int], k_lens: list[int], kv_index: list[torch.Tensor], device: torch.device
) -> VarlenRuns:
    """`varlen_causal`'s parameters for U runs of queries: (cu_q, cu_k [U + 1] int32 on `device`,
    kv_index [M] int64 (run u's keys are kv_index[cu_k[u]:cu_k[u + 1]]), max_q, max_k)."""
    cu_q, cu_k = (
        torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32) for lens in (q_lens, k_lens)
    )
    return (
        to_device(cu_q, device),
        to_device(cu_k, device),
        to_device(torch.cat(kv_index), device),
        max(q_lens),
        max(k_lens),
    )


@functools.cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


class TreePlan:
    """The structure of a tree stream, with each kernel's view built on first use (once per forward).

    cu_seqlens [S + 1]; prefix_lens [S]: the prompt length opening each segment; branch_lens [Z]:
    the non-empty branch lengths in stream order, segment s owning the next entries that sum to its
    length minus its prompt (as `rlloom.data.types.PackedTensors` describes). The plan reads them on
    the host: pass CPU tensors to keep a CUDA forward free of host syncs. `device`: where the
    kernels' index tensors go (default: cu_seqlens's device).
    """

    def __init__(
        self,
        cu_seqlens: torch.Tensor,
        prefix_lens: torch.Tensor,
        branch_lens: torch.Tensor,
        device: torch.device | None = None,
    ) -> None:
        self.device = cu_seqlens.device if device is None else device
        self.cu: list[int] = cu_seqlens.tolist()
        self.prefix: list[int] = prefix_lens.tolist()
        self.branches = _split_branches(self.cu, self.prefix, branch_lens.tolist())
        """Per segment, its branch lengths."""
        self._masks: list[torch.Tensor | None] | None = None
        self._varlen: VarlenRuns | None = None
        if self.device.type == "cuda":
            # Built here, before the layers: inside a compiled layer the pinned copy would not trace.
            self.varlen()

    @property
    def has_branches(self) -> bool:
        """Whether some segment has several branches (otherwise the stream is plain packed)."""
        return any(len(b) > 1 for b in self.branches)

    def masks(self) -> list[torch.Tensor | None]:
        """Per segment: None when it has at most one branch (causal), else its [L, L] bool mask."""
        if self._masks is None:
            self._masks = [
                _branch_mask(p, b, self.device) if len(b) > 1 else None
                for p, b in zip(self.prefix, self.branches)
            ]
        return self._masks

    def varlen(self) -> VarlenRuns:
        """(cu_q [U + 1], cu_k [U + 1] int32, kv_index [M] int64, max_q, max_k) over U runs (each
        prompt, each branch): the queries are the stream itself; run u's keys are kv_index[cu_k[u]:
        cu_k[u + 1]], its prompt's positions (for a branch) followed by its own."""
        if self._varlen is None:
            q_lens, k_lens, kv_index = [], [], []
            for start, p, branches in zip(self.cu, self.prefix, self.branches):
                prompt = torch.arange(start, start + p)
                q_lens.append(p)
                k_lens.append(p)
                kv_index.append(prompt)
                offset = start + p
                for r in branches:
                    q_lens.append(r)
                    k_lens.append(p + r)
                    kv_index += [prompt, torch.arange(offset, offset + r)]
                    offset += r
            self._varlen = varlen_runs(q_lens, k_lens, kv_index, self.device)
        return self._varlen


def _split_branches(cu: list[int], prefix: list[int], branch_lens: list[int]) -> list[list[int]]:
    if len(prefix) != len(cu) - 1:
        raise ValueError(f"prefix_lens has {len(prefix)} entries for {len(cu) - 1} segments in cu_seqlens")
    out, z = [], 0
    for s, p in enumerate(prefix):
        rest, lens = cu[s + 1] - cu[s] - p, []
        while rest > 0 and z < len(branch_lens):
            lens.append(branch_lens[z])
            rest, z = rest - branch_lens[z], z + 1
        if rest != 0 or p < 1 or min(lens, default=1) < 1:
            raise ValueError(
                f"segment {s} ({cu[s + 1] - cu[s]} tokens, prompt {p}) is not its prompt plus whole "
                f"branches of branch_lens {branch_lens}. Fix: pass PackedTensors.prefix_lens_S/branch_lens_Z."
            )
        out.append(lens)
    if z != len(branch_lens):
        raise ValueError(f"branch_lens has {len(branch_lens)} entries but the segments use {z}")
    return out


def _branch_mask(prefix_len: int, branch_lens: list[int], device: torch.device) -> torch.Tensor:
    """[L, L] bool: causal, and a key in a branch is visible only to queries of the same branch."""
    lens = torch.tensor([prefix_len, *branch_lens], device=device)
    branch_L = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
    length = int(branch_L.shape[0])
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return causal & ((branch_L[None, :] == 0) | (branch_L[None, :] == branch_L[:, None]))


def tree_attention(
    q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, scale: float, tree: TreePlan
) -> torch.Tensor:
    """Attention over a tree stream -> [N, Hq, Dv] (kernels: see the module docstring)."""
    gqa = q_NHD.shape[1] != k_NHD.shape[1]
    if flash_varlen_fits(q_NHD, v_NHD):
        cu_q, cu_k, kv_index, max_q, max_k = tree.varlen()
        return varlen_causal(q_NHD, k_NHD[kv_index], v_NHD[kv_index], scale, cu_q, cu_k, max_q, max_k)
    outs = []
    for start, end, mask in zip(tree.cu[:-1], tree.cu[1:], tree.masks()):
        q, k, v = (x[start:end].transpose(0, 1) for x in (q_NHD, k_NHD, v_NHD))
        if gqa and mask is not None and q.is_cuda:
            # CUDA's masked kernel (memory-efficient attention) takes no GQA; without repeated heads
            # SDPA would fall back to the math kernel.
            k, v = (x.repeat_interleave(q.shape[0] // k.shape[0], dim=0) for x in (k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=k.shape[0] != q.shape[0]
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs, dim=0)
