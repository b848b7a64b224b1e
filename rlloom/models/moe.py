"""Mixture-of-experts feed-forward: a router and grouped SwiGLU experts (plus DeepSeek shared experts).

Routing in fp32 (`router_logits`: on CUDA with bf16 operands one tensor-core GEMM with an fp32
output, the same products summed in fp32, where an fp32 GEMM of the upcast operands ran without
tensor cores: 5.8 ms of a 16k-token step of the Qwen3-30B-A3B width with 8 layers, forward and
backward; the backward rounds the logits' gradient to bf16, as every bf16 layer's is):
- softmax (Qwen3-MoE, Mixtral): top-k of softmax(logits); renormalised to sum 1 when
  `norm_topk_prob` (Qwen3-MoE's flag; Mixtral always renormalises).
- sigmoid (DeepSeek-V3, "auxiliary-loss-free" noaux_tc): s = sigmoid(logits); experts are chosen on
  s + e_score_correction_bias, only inside the `topk_groups` best groups (a group scores the sum of
  its top-2 biased scores); the weights are the unbiased s of the chosen experts, renormalised
  (+1e-20) when norm_topk_prob, times `routed_scaling_factor`.

Experts are stored stacked, w1 (gate) [E, I, D], w2 (down) [E, D, I], w3 (up) [E, I, D]. The
token-expert pairs are sorted by expert so each expert reads one contiguous slice: on CUDA with
bf16 one `torch._grouped_mm` per projection (the rollout engine's copy: `expert_linear`, a
Triton kernel at decode row counts that reads the weights at about 4 TB/s on an H200, where
cutlass reads 2.6-3.3), elsewhere a loop over experts (never over tokens).
Tokens go to and come back from that order by gathers only (`DispatchRows`, `CombineRows`: the
backward of each is a gather too), and a token's K expert outputs are summed with their weights
in fp32 in one pass (`gather_sum`, a Triton kernel on CUDA): no atomic scatter-adds, so the result
is deterministic, and on an H200 the combine at 16k tokens took 2 ms per layer as a bf16
`index_add`.
Under exact numerics (rollout.match_training, models/exact.py) on CUDA the three products run
through one batch-invariant Triton kernel (`exact_expert_linear`) in both engines, and a token's
experts are chosen by a stable sort and listed in expert order (`_top_k`), so the router, each
expert's product and the combine (K rows summed in that order by `gather_sum`, which never adds
rows of other tokens) give a token the same bits whatever batch it is in; the experts' silu(gate) * up
is `exact_fused`'s kernel there, as the dense MLP's (`layers.silu_mul`).
The CUDA path never reads a device value on the host (counts by scatter-add, offsets by cumsum on
the device), so the rollout engine captures MoE decode steps in CUDA graphs with the compiled
forward; `bincount` would sync (its output size depends on the data) and break both.

Load balancing for RL (both off by default, as verl, slime and NeMo-RL run RL):
- auxiliary loss (Switch Transformer, Fedus et al. 2021; Qwen3-MoE and Mixtral's
  `router_aux_loss_coef`): `load_balancing_loss` = E * sum_e f_e * P_e of one layer's forward, f_e
  the fraction of the T*K token-expert picks that went to expert e, P_e the mean routing
  probability of e (softmax; for sigmoid routing the scores normalised per token). Per layer, where
  transformers pools the tokens of all layers into one f and P; the training engine takes the
  router's scores by a hook and averages the layers (parallel/pp_aux.py: over the real rows, with
  the counts summed over the ranks that split the tokens).
- correction-bias update (DeepSeek-V3's auxiliary-loss-free balancing): the engine moves
  `expert_bias` by +rate for under-loaded and -rate for over-loaded experts after each step.

Routing replay (R3, "rollout routing replay"; verl, slime and NeMo-RL ship it): the rollout engine
records the experts each token used (`last_experts_TK`); training can pass them back as `routes_TK`
with `replay`, so each token goes through the experts that generated it while the weights still
come from the current router. Without replay the routes are only compared (`last_route_mismatch`).

Shape legend: T tokens, D hidden, E experts, K experts per token, I expert hidden width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rlloom.models.args import MoEArgs
from rlloom.models.exact import is_exact, uses_kernels
from rlloom.models.layers import SwiGLU, silu_mul


class Router(nn.Module):
    """Chooses K experts per token and their weights."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        if args.score_bias:
            # Updated by a balancing rule, not by gradients, so it is a buffer (saved with the weights).
            self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(
        self, x_TD: torch.Tensor, replay_TK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (weights_TK fp32, experts_TK int64, own_TK, scores_TE fp32).

        own_TK are the experts this router chooses; experts_TK are the ones used: `replay_TK`'s where
        it holds a route (>= 0, routing replay), own_TK elsewhere. The weights are always the current
        scores of the experts used, so the router still learns under replay.
        scores_TE: softmax or sigmoid of the logits (for the auxiliary loss).
        """
        logits_TE = router_logits(x_TD, self.gate.weight)
        a = self.args
        if a.score_func == "softmax":
            scores_TE = logits_TE.softmax(dim=-1)
            own_TK = _top_k(scores_TE, a.top_k, sorted=True)
        else:
            scores_TE = logits_TE.sigmoid()
            choice_TE = scores_TE if self.expert_bias is None else scores_TE + self.expert_bias.float()
            if a.num_groups > 1:
                choice_TE = _keep_top_groups(choice_TE, a.num_groups, a.topk_groups)
            own_TK = _top_k(choice_TE, a.top_k, sorted=False)
        experts_TK = own_TK if replay_TK is None else torch.where(replay_TK >= 0, replay_TK, own_TK)
        weights_TK = scores_TE.gather(1, experts_TK)
        if a.score_func == "softmax":
            if a.norm_topk_prob:
                weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
            return weights_TK, experts_TK, own_TK, scores_TE
        if a.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_TK * a.routed_scaling_factor, experts_TK, own_TK, scores_TE


def router_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """x_TD @ weight_ED.T in fp32 [T, E] (see the module docstring)."""
    if x_TD.is_cuda and x_TD.dtype == weight_ED.dtype == torch.bfloat16:
        return _RouterLogits.apply(x_TD, weight_ED)
    return F.linear(x_TD.float(), weight_ED.float())


class _RouterLogits(torch.autograd.Function):
    """bf16 operands, fp32 logits; the gradients in bf16 from the logits' gradient rounded to bf16."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x_TD, weight_ED)
        return torch.mm(x_TD, weight_ED.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_TE: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # noqa: ANN001
        x_TD, weight_ED = ctx.saved_tensors
        grad_TE = grad_TE.to(x_TD.dtype)
        grad_x = grad_TE @ weight_ED if ctx.needs_input_grad[0] else None
        grad_w = grad_TE.t() @ x_TD if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def _keep_top_groups(choice_TE: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Set to -inf the scores of experts outside each token's `topk_groups` best groups."""
    T, E = choice_TE.shape
    grouped = choice_TE.view(T, num_groups, E // num_groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    top_groups = _top_k(group_scores, topk_groups, sorted=False)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)


def _top_k(x_TE: torch.Tensor, k: int, *, sorted: bool) -> torch.Tensor:
    """[T, k] indices of each row's k largest entries (`sorted`: by decreasing value). Under exact
    numerics (rollout.match_training) the first k of a stable descending sort (ties: the lower
    index), in increasing index order, whatever `sorted` asks: torch.topk's CUDA kernels choose an
    algorithm from the tensor's shape (a multi-block one for few rows), and the order in which it
    returns the chosen experts, and its choice among equal scores, may change with it; the combine
    sums a token's expert outputs in this order."""
    if is_exact():
        return torch.sort(x_TE, dim=-1, descending=True, stable=True).indices[:, :k].sort(dim=-1).values
    return torch.topk(x_TE, k, dim=-1, sorted=sorted)[1]


def load_balancing_loss(scores_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-style auxiliary loss E * sum_e f_e * P_e (1.0 when perfectly balanced).

    scores_TE: [T, E] routing probabilities (rows normalised here, so sigmoid scores work too);
    counts_E: [E] token-expert picks per expert (sum T * K); gradients flow through the scores only.
    """
    T, E = scores_TE.shape
    probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True).clamp(min=1e-20)
    f_E = counts_E.float() / max(T * top_k, 1)
    return E * (f_E * probs_TE.mean(dim=0)).sum()


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights, run over token slices sorted by expert."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)
        self.inference_kernel = False
        """Run no-grad products through `expert_linear` (`use_inference_kernel_`)."""

    def forward(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out_TD, tokens per expert [E] int64)."""
        return run_experts(x_TD, weights_TK, experts_TK, self.w1.shape[0], self._mlp)

    def _mlp(self, xs: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        linear = self._linear(xs)
        h = silu_mul(linear(xs, self.w1, offsets), linear(xs, self.w3, offsets))
        return linear(h, self.w2, offsets)

    def _linear(self, xs: torch.Tensor) -> ExpertLinear:
        """The experts' product for rows like `xs`: under exact numerics on CUDA the batch-invariant
        kernel; on CUDA in bf16 `torch._grouped_mm` (the rollout's no-grad forwards: `expert_linear`);
        elsewhere one product per expert's slice (autograd runs through the slices)."""
        if is_exact() and uses_kernels(xs):
            return exact_expert_linear
        if not (xs.is_cuda and xs.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
            return _experts_loop
        return expert_linear if self.inference_kernel and not torch.is_grad_enabled() else _grouped_linear


def use_inference_kernel_(model: nn.Module) -> None:
    """Let the model's routed experts run their no-grad products through `expert_linear` (the rollout
    engine's copy of the model; training keeps `torch._grouped_mm`, so its forward passes stay as
    they were)."""
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.inference_kernel = True


ExpertLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x [P, K] rows sorted by expert, w [E, N, K], offsets [E] int32 cumulative row counts) -> [P, N]:
each expert's slice of rows times w[e].T."""


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`ExpertLinear` by one `torch._grouped_mm` (CUDA, bf16; differentiable)."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def exact_expert_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`ExpertLinear` under exact numerics on CUDA (rollout.match_training): the forward is
    `exact_kernels.grouped_matmul` (a token's row does not depend on how many rows its expert got),
    the gradient the plain product's (recomputed in the backward: only the forward values must be
    the rollout's, as for exact attention)."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _ExactExpertLinear.apply(x, w, offsets)
    from rlloom.models import exact_kernels  # Triton: imported where it runs

    return exact_kernels.grouped_matmul(x, w, offsets)


class _ExactExpertLinear(torch.autograd.Function):
    """`exact_kernels.grouped_matmul` forward; backward: the gradient of the plain product."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        from rlloom.models import exact_kernels

        ctx.save_for_backward(x, w, offsets)
        return exact_kernels.grouped_matmul(x, w, offsets)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # noqa: ANN001
        x, w, offsets = ctx.saved_tensors
        grouped = x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
        plain = _grouped_linear if grouped else _experts_loop
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), w.detach().requires_grad_()
            grad_x, grad_w = torch.autograd.grad(plain(x_, w_, offsets), (x_, w_), grad_y)
        return grad_x, grad_w, None


def _experts_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [P, K] -> [P, N]: each expert's slice of rows (`offsets` as in `expert_linear`) times w[e].T."""
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end] @ w[e].T
        start = end
    return out


@torch.library.custom_op("rlloom::expert_linear", mutates_args=())
def expert_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [P, K] -> [P, N]: rows offsets[e-1]:offsets[e] (int32, cumulative: rows sorted by expert)
    times w[e].T, w [E, N, K]; no autograd. On CUDA in bf16 with few rows an expert (decode) a
    Triton kernel that reads the weights near the memory bandwidth (`expert_kernels.py`), otherwise
    `torch._grouped_mm`; a loop over experts elsewhere."""
    return _experts_loop(x, w, offsets)


@expert_linear.register_kernel("cuda")
def _expert_linear_cuda(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from rlloom.models import expert_kernels

    if x.dtype == w.dtype == torch.bfloat16 and expert_kernels.fits_rows(x.shape[0], w.shape[0]):
        return expert_kernels.expert_linear(x, w, offsets)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


@expert_linear.register_fake
def _expert_linear_fake(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


def run_experts(
    x_TD: torch.Tensor,
    weights_TK: torch.Tensor,
    experts_TK: torch.Tensor,
    num_experts: int,
    mlp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the token-expert pairs by expert, run `mlp(rows in expert order, counts_E)` over them
    and combine each token's K outputs with its weights -> (out_TD, tokens per expert [E] int64).
    Shared by the bf16 experts and the rollout's fp8 ones (`fp8.Fp8GroupedExperts`)."""
    K = experts_TK.shape[1]
    flat_experts = experts_TK.flatten()
    # 16-bit keys: a CUDA radix sort makes one pass per key byte (int64 took 0.23 ms of a 4.6 ms decode step)
    keys = flat_experts.to(torch.int16) if num_experts <= torch.iinfo(torch.int16).max else flat_experts
    order = torch.argsort(keys, stable=True)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat_experts.device)
    counts_E.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
    inverse = inverse_permutation(order)
    ys = mlp(dispatch_rows(x_TD, order, inverse, K), counts_E)
    return combine_rows(ys, inverse, weights_TK), counts_E


def dispatch_rows(x_TD: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, K: int) -> torch.Tensor:
    """[T, D] -> [T*K, D]: token t's row at every position j with order[j] // K == t, where `order`
    sorts the T*K token-expert pairs (pair p = t*K + k) by expert; `inverse` is
    `inverse_permutation(order)` (computed once per layer for this and `combine_rows`)."""
    return DispatchRows.apply(x_TD, order, inverse, K)


def combine_rows(y_PD: torch.Tensor, inverse: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """[T*K, D] outputs in expert order (as `dispatch_rows` sent them) -> [T, D]: each token's K
    outputs weighted by `weights_TK` and summed in fp32, in one pass (`gather_sum`)."""
    return CombineRows.apply(y_PD, inverse.view(weights_TK.shape), weights_TK)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inv with inv[order[j]] = j (a scatter of unique indices: deterministic, no host sync)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))


def _gather_sum_torch(
    src_PD: torch.Tensor, index_TK: torch.Tensor, weight_TK: torch.Tensor | None
) -> torch.Tensor:
    T, K = index_TK.shape
    acc = torch.promote_types(src_PD.dtype, torch.float32)
    rows_TKD = src_PD[index_TK.flatten()].view(T, K, src_PD.shape[-1]).to(acc)
    if weight_TK is not None:
        rows_TKD = rows_TKD * weight_TK.to(acc).unsqueeze(-1)
    return rows_TKD.sum(dim=1).to(src_PD.dtype)


def _combine_grad_torch(
    grad_TD: torch.Tensor, src_PD: torch.Tensor, index_TK: torch.Tensor, weight_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = index_TK.shape
    D = src_PD.shape[-1]
    acc = torch.promote_types(src_PD.dtype, torch.float32)
    flat = index_TK.flatten()
    g_T1D = grad_TD.to(acc).unsqueeze(1)
    grad_weight_TK = (src_PD[flat].view(T, K, D).to(acc) * g_T1D).sum(dim=-1).to(weight_TK.dtype)
    grad_src_PD = torch.empty_like(src_PD)
    grad_src_PD[flat] = (weight_TK.to(acc).unsqueeze(-1) * g_T1D).to(src_PD.dtype).view(T * K, D)
    return grad_src_PD, grad_weight_TK


def _triton_ok(t: torch.Tensor) -> bool:
    """The Triton kernels take fp32, bf16 and fp16 (fp64 goes to the torch code)."""
    return t.dtype in (torch.float32, torch.bfloat16, torch.float16)


@torch.library.custom_op("rlloom::moe_gather_sum", mutates_args=())
def gather_sum(src_PD: torch.Tensor, index_TK: torch.Tensor, weight_TK: torch.Tensor | None) -> torch.Tensor:
    """[T, D] in src's dtype: out[t] = sum_k w[t, k] * src[index[t, k]] (w = 1 without weights),
    summed in fp32 (or wider). The combine's forward and the dispatch's backward; on CUDA a Triton
    kernel (`moe_kernels.py`) that reads each row once, this torch code elsewhere."""
    return _gather_sum_torch(src_PD, index_TK, weight_TK)


@gather_sum.register_kernel("cuda")
def _gather_sum_cuda(
    src_PD: torch.Tensor, index_TK: torch.Tensor, weight_TK: torch.Tensor | None
) -> torch.Tensor:
    if not _triton_ok(src_PD):
        return _gather_sum_torch(src_PD, index_TK, weight_TK)
    from rlloom.models import moe_kernels

    return moe_kernels.gather_sum(src_PD, index_TK, weight_TK)


@gather_sum.register_fake
def _gather_sum_fake(
    src_PD: torch.Tensor, index_TK: torch.Tensor, weight_TK: torch.Tensor | None
) -> torch.Tensor:
    return src_PD.new_empty(index_TK.shape[0], src_PD.shape[-1])


@torch.library.custom_op("rlloom::moe_combine_grad", mutates_args=())
def combine_grad(
    grad_TD: torch.Tensor, src_PD: torch.Tensor, index_TK: torch.Tensor, weight_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of `gather_sum` with weights, for an `index_TK` holding every row of src once:
    (grad_src [P, D] with grad_src[index[t, k]] = w[t, k] * g[t], in src's dtype; grad_weight [T, K]
    = <g[t], src[index[t, k]]> summed in fp32 (or wider), in the weights' dtype). A Triton kernel
    on CUDA."""
    return _combine_grad_torch(grad_TD, src_PD, index_TK, weight_TK)


@combine_grad.register_kernel("cuda")
def _combine_grad_cuda(
    grad_TD: torch.Tensor, src_PD: torch.Tensor, index_TK: torch.Tensor, weight_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if not (_triton_ok(src_PD) and _triton_ok(weight_TK)):
        return _combine_grad_torch(grad_TD, src_PD, index_TK, weight_TK)
    from rlloom.models import moe_kernels

    return moe_kernels.combine_grad(grad_TD, src_PD, index_TK, weight_TK)


@combine_grad.register_fake
def _combine_grad_fake(
    grad_TD: torch.Tensor, src_PD: torch.Tensor, index_TK: torch.Tensor, weight_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(src_PD), torch.empty_like(weight_TK)


class DispatchRows(torch.autograd.Function):
    """x_TD -> x_TD[order // K]: each token's row once per chosen expert, in expert order.

    The backward sums each token's K row gradients through the inverse permutation (`gather_sum`),
    where autograd's index backward would scatter-add into x's rows."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, K: int) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(inverse)
        ctx.K = K
        return x_TD[order // K]

    @staticmethod
    def backward(ctx, grad_xs: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # noqa: ANN001
        (inverse,) = ctx.saved_tensors
        return gather_sum(grad_xs, inverse.view(-1, ctx.K), None), None, None, None


class CombineRows(torch.autograd.Function):
    """(y_PD in expert order, inverse [T, K], weights_TK) -> sum_k weights[t, k] * y[inverse[t, k]];
    both the forward and the backward read each row once (`gather_sum`, `combine_grad`)."""

    @staticmethod
    def forward(ctx, y_PD: torch.Tensor, inverse_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(y_PD, inverse_TK, weights_TK)
        return gather_sum(y_PD, inverse_TK, weights_TK)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:  # noqa: ANN001
        y_PD, inverse_TK, weights_TK = ctx.saved_tensors
        grad_y_PD, grad_weights_TK = combine_grad(grad_TD, y_PD, inverse_TK, weights_TK)
        return grad_y_PD, None, grad_weights_TK


class MoE(nn.Module):
    """Routed experts plus optional always-on shared experts; remembers the last token counts."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.router = Router(dim, args)
        self.experts = GroupedExperts(args.num_experts, dim, args.intermediate_size)
        shared = args.num_shared_experts * args.intermediate_size
        self.shared_experts = SwiGLU(dim, shared) if shared else None
        self.last_token_counts: torch.Tensor | None = None
        self.last_experts_TK: torch.Tensor | None = None
        """Experts used per token in the last forward (the rollout engine records them)."""
        self.last_route_mismatch: torch.Tensor | None = None
        """[2] (differing, compared) tokens of the last forward that was given rollout routes."""

    def forward(
        self, x: torch.Tensor, routes_TK: torch.Tensor | None = None, replay: bool = False
    ) -> torch.Tensor:
        """x [.., D] -> [.., D]. `routes_TK` [T, K]: the experts the rollout chose per token (-1 =
        none recorded); with `replay` they are used (routing replay), otherwise only compared."""
        x_TD = x.reshape(-1, x.shape[-1])
        weights_TK, experts_TK, own_TK, scores_TE = self.router(x_TD, routes_TK if replay else None)
        out_TD, counts_E = self.experts(x_TD, weights_TK, experts_TK)
        self.last_token_counts = counts_E.detach()
        self.last_experts_TK = experts_TK.detach()
        if routes_TK is not None:
            self.last_route_mismatch = route_mismatch(own_TK, routes_TK)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view_as(x)


def route_mismatch(own_TK: torch.Tensor, routes_TK: torch.Tensor) -> torch.Tensor:
    """[2] float: tokens whose chosen expert set differs from the recorded one, and tokens with a
    recorded route (rows of -1 are not counted). A row holds K distinct experts, so the sets differ
    exactly when one of the token's own experts is missing from its record: a [T, K, K] comparison,
    not a sort. With a sort of each row here, the compile of the first training step of
    `bench_start.py --moe` (an H200) did not finish in 250 s, in each of three runs; with this
    comparison it takes about 30 s (docs/benchmarks.md)."""
    valid_T = (routes_TK >= 0).all(dim=-1)
    missing_TK = ~(own_TK.unsqueeze(-1) == routes_TK.unsqueeze(-2)).any(dim=-1)
    differ_T = missing_TK.any(dim=-1) & valid_T
    return torch.stack([differ_T.sum(), valid_T.sum()]).float()
