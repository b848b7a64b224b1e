"""FP8 experts for the rollout engine (`rollout.quantization: fp8`): the routed experts' weights in
float8 (e4m3), activations and accumulation in the model's dtype and fp32.

MoE decode reads every routed expert once a step (a batch of 128 x 8 picks reaches all 128 experts
of Qwen3-30B-A3B), so its time is the experts' bytes over the memory bandwidth, and the experts are
most of an MoE model's bytes (95% at Qwen3-30B-A3B's and DeepSeek-V3's widths): FP8 halves them.
Training keeps bf16/fp32; every weight sync quantizes the new experts as it copies them in
(`Fp8Rows.copy_`), so the rollout always samples from the quantized current policy, and the
train-vs-rollout mismatch this adds is what `rollout/token_mult_prob_error` reports and
`algorithm.is_correction` corrects (as with verl's and slime's FP8 rollout).

Dense matrices (attention projections, dense and shared-expert MLPs), the embedding, the lm head
and the routers stay in the model dtype, and a dense model is refused. Two fp8 dense products were
built and measured (docs/benchmarks.md): this engine's Triton kernel ran at 0.52-0.62x the speed of
cuBLAS's bf16 product at decode sizes (its rows are re-read by every output block); cuBLAS's own fp8
product (`torch._scaled_mm`, W8A8 with per-token activation scales) made a Qwen3-8B-shaped rollout
only 1.09x faster on an H100 and a Qwen3-0.6B-shaped one slower (0.92x), while any fp8 format of
the dense weights raised the trained SmolLM2-135M's train-vs-rollout logprob gap from 0.030 to
0.11-0.17 (weights alone: 0.11-0.12).

Format: one fp32 scale per row and group of 128 input columns (`GROUP`): w[n, k] ~= q[n, k] *
scale[n, k // 128], scale = max |w| of the group / 448 (e4m3's largest finite value). Groups along
the rows only (not DeepSeek-V3's 128 x 128 blocks) so that any set of rows (one expert, the gate or
the up half of the stacked gate/up weight) quantizes on its own. The scales add 1/32 of the fp8
bytes.

The grouped product `fp8_linear` is a Triton kernel on CUDA (`expert_kernels.py`, compute capability
>= 8.9) and dequantize-then-matmul elsewhere: the CPU path exists for tests and is slower than the
unquantized one.

Shape legend: N output rows, K input columns, G = ceil(K / 128) groups, E experts (stacked
weights), P rows of activations sorted by expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
FP8_NEEDS_EXPERTS = (
    "fp8 quantizes the routed experts of MoE models, and this model has none (dense matrices in fp8, "
    "measured with cuBLAS's fp8 product: 0.92x bf16's rollout speed at Qwen3-0.6B's shape, 1.09x at "
    "Qwen3-8B's, and 5x the logprob gap to training on SmolLM2-135M; docs/benchmarks.md)"
)
_BATCH_BYTES = 128 << 20
"""fp32 bytes of the experts `load_rows` quantizes together (a few such temporaries at the peak)."""


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (q [..., N, K] e4m3, scale [..., N, G] fp32) with w ~= q * scale per row
    and group of 128 columns; an all-zero group gets scale 1 (q = 0)."""
    K = w.shape[-1]
    G = -(-K // GROUP)
    w32 = F.pad(w.float(), (0, G * GROUP - K)).unflatten(-1, (G, GROUP))
    amax = w32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2)[..., :K], scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_rows`: q * scale in fp32, rounded to `dtype`."""
    K = q.shape[-1]
    G = scale.shape[-1]
    q32 = F.pad(q.float(), (0, G * GROUP - K)).unflatten(-1, (G, GROUP))
    return (q32 * scale.unsqueeze(-1)).flatten(-2)[..., :K].to(dtype)


def roundtrip(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a quantized slot holds after loading `w`, read back in `dtype`."""
    return dequantize_rows(*quantize_rows(w), dtype)


def _linear_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    out = x.new_empty(x.shape[0], q.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], dequantize_rows(q[e], scale[e], x.dtype))
        start = end
    return out


def _kernel_ok(x: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(x.device) >= (8, 9)
    )


@torch.library.custom_op("rlloom::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [P, K] -> [P, N] in x's dtype: rows offsets[e-1]:offsets[e] times dequantized(q[e]).T, q
    [E, N, K] e4m3, scale [E, N, G], offsets [E] int32 (cumulative row counts: an MoE layer's rows
    sorted by expert)."""
    return _linear_reference(x, q, scale, offsets)


@fp8_linear.register_kernel("cuda")
def _fp8_linear_cuda(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    if not _kernel_ok(x):
        return _linear_reference(x, q, scale, offsets)
    from rlloom.models import expert_kernels

    return expert_kernels.expert_linear(x, q, offsets, scale, GROUP)


@fp8_linear.register_fake
def _fp8_linear_fake(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[1])


class Fp8Rows:
    """A writable window on rows of an fp8 weight (a stack of experts, one expert, the gate or up
    half of the stacked gate/up weight), standing in for the bf16 tensor of the same shape where
    weights are loaded by name (`rlloom.models.adapter`): `copy_` quantizes into it, `dequantize`
    reads it back."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        dtype: torch.dtype,
        parent: Fp8Rows | None = None,
        index: int | None = None,
    ) -> None:
        self.q, self.scale, self.dtype = q, scale, dtype
        self.parent, self.index = parent, index
        """Set on one expert of a stack (`stack[index]`), so that `load_rows` can batch the stack."""

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def data(self) -> Fp8Rows:
        return self

    def __getitem__(self, index: int) -> Fp8Rows:
        return Fp8Rows(self.q[index], self.scale[index], self.dtype, parent=self, index=index)

    def copy_(self, src: torch.Tensor) -> Fp8Rows:
        """Quantize `src` (same shape) into these rows (`load_rows` batches many slots)."""
        q, s = quantize_rows(src.to(self.q.device))
        self.q.copy_(q)
        self.scale.copy_(s)
        return self

    def dequantize(self) -> torch.Tensor:
        return dequantize_rows(self.q, self.scale, self.dtype)

    def detach(self) -> torch.Tensor:
        """The values as a tensor (what readers of named weights get)."""
        return self.dequantize()


def load_rows(pairs: list[tuple[Fp8Rows, torch.Tensor]]) -> None:
    """`slot.copy_(source)` for every pair, with the experts of one stack quantized together in
    batches of consecutive experts (a weight sync brings every expert as its own tensor: quantized
    one at a time, a dozen small kernels each, the 3,072 expert tensors of a Qwen3-30B-A3B-width
    sync made an RL step 0.1-0.4 s slower on an H200; batched, the sync takes 0.17 s against 0.11-0.13
    s unquantized). The same values as one `copy_` per pair."""
    stacks: dict[int, tuple[Fp8Rows, dict[int, torch.Tensor]]] = {}
    for slot, source in pairs:
        if slot.parent is None:
            slot.copy_(source)
        else:
            stacks.setdefault(id(slot.parent), (slot.parent, {}))[1][slot.index] = source
    for stack, sources in stacks.values():
        most = max(1, _BATCH_BYTES // (stack.q[0].numel() * 4))  # experts whose fp32 copies fit
        run: list[int] = []
        for e in sorted(sources):
            if run and (e != run[-1] + 1 or len(run) == most):
                _load_run(stack, run, sources)
                run = []
            run.append(e)
        _load_run(stack, run, sources)


def _load_run(stack: Fp8Rows, experts: list[int], sources: dict[int, torch.Tensor]) -> None:
    first, last = experts[0], experts[-1] + 1
    q, s = quantize_rows(torch.stack([sources[e].to(stack.q.device) for e in experts]))
    stack.q[first:last].copy_(q)
    stack.scale[first:last].copy_(s)


class Fp8Weights(nn.Module):
    """A module whose matrices are held in fp8: `fp8_weights()` maps each matrix's name (as the
    unquantized module called it, e.g. `w1`) to its `Fp8Rows`, and `fp8_buffers` lists the buffers
    that hold them (the adapter shows the former in place of the latter)."""

    fp8_buffers: tuple[str, ...] = ()

    def fp8_weights(self) -> dict[str, Fp8Rows]:
        raise NotImplementedError


def _fp8_buffers(module: nn.Module, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    """Register `<name>_fp8` [*shape] and `<name>_scale` [*shape[:-1], G] (uninitialised)."""
    module.register_buffer(f"{name}_fp8", torch.empty(shape, dtype=FP8, device=device))
    groups = -(-shape[-1] // GROUP)
    module.register_buffer(f"{name}_scale", torch.empty(*shape[:-1], groups, device=device))


class Fp8GroupedExperts(Fp8Weights):
    """`moe.GroupedExperts` with fp8 experts: gate and up projections stacked as one [E, 2I, D]
    weight (one grouped product instead of two; `w1` and `w3` are its halves), down [E, D, I]."""

    fp8_buffers = ("w13_fp8", "w13_scale", "w2_fp8", "w2_scale")

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        w1, w2, w3 = experts.w1.detach(), experts.w2.detach(), experts.w3.detach()
        self.num_experts, self.hidden = w1.shape[0], w1.shape[1]
        self.dtype = w1.dtype
        _fp8_buffers(self, "w13", (self.num_experts, 2 * self.hidden, w1.shape[2]), w1.device)
        _fp8_buffers(self, "w2", tuple(w2.shape), w2.device)
        stacks, weights = self.fp8_weights(), {"w1": w1, "w2": w2, "w3": w3}
        load_rows([(stacks[n][e], weights[n][e]) for n in stacks for e in range(self.num_experts)])

    def fp8_weights(self) -> dict[str, Fp8Rows]:
        h = self.hidden
        return {
            "w1": Fp8Rows(self.w13_fp8[:, :h], self.w13_scale[:, :h], self.dtype),
            "w2": Fp8Rows(self.w2_fp8, self.w2_scale, self.dtype),
            "w3": Fp8Rows(self.w13_fp8[:, h:], self.w13_scale[:, h:], self.dtype),
        }

    def forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from rlloom.models.moe import run_experts

        return run_experts(x_TD, weights_TK, experts_TK, self.num_experts, self._mlp)

    def _mlp(self, xs: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        gate, up = fp8_linear(xs, self.w13_fp8, self.w13_scale, offsets).split(self.hidden, dim=-1)
        return fp8_linear(F.silu(gate) * up, self.w2_fp8, self.w2_scale, offsets)


def quantize_fp8_(model: nn.Module) -> int:
    """Replace the model's routed experts by fp8 ones in place, one layer at a time (the peak is the
    unquantized model plus one layer's fp8 experts); returns the layers replaced (0: a dense model,
    left as it is)."""
    from rlloom.models.moe import GroupedExperts

    parents = [
        (m, name) for m in model.modules() for name, c in m.named_children() if isinstance(c, GroupedExperts)
    ]
    for parent, name in parents:
        setattr(parent, name, Fp8GroupedExperts(getattr(parent, name)))
    return len(parents)
