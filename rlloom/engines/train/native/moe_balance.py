"""MoE router balancing during training: the auxiliary loss, the correction-bias update, load metrics.

One `MoEBalance` per engine (None for dense models). At pp=1 the engine runs each micro-batch's
forward `recording` the routers' scores, adds `coef x aux_term(...)` to the loss and calls
`accumulate`; after the optimizer step, `finish` reduces the step's expert loads over the
data-parallel ranks, moves DeepSeek-V3's correction bias when asked to, and returns metrics:

    moe/aux_loss                       token-weighted mean of the layers' balancing loss (1.0 = even)
    moe/load_max_over_mean             the worst layer's busiest expert over the mean load
    moe/layer<i>_load_max_over_mean    the same per MoE layer
    moe/bias_abs_mean                  mean |correction bias| (with a bias update)

The auxiliary loss is computed as the pipeline stages compute it (`rlloom.parallel.pp_aux`, one
function for both): over the real rows (the padding to a multiple of tp not counted), and where
ranks split a micro-batch's tokens (CP, TP ranks that each route their shard) from the expert counts
summed over them, so each rank's term is its part of the whole micro-batch's loss: the parts (and
moe/aux_loss's, summed over those ranks) add up to the one-process run's.

The bias update follows DeepSeek-V3 (arXiv:2412.19437, section 2.1.2): b_e += rate * sign(mean load
- load_e), from the step's token counts, identically on every rank (the counts are all-reduced), so
the replicated bias buffers stay equal. It runs only for applied steps, like the optimizer's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from rlloom.parallel.pp_aux import RouterScores, layers_aux_loss


def moe_layers_of(model: nn.Module) -> dict[int, nn.Module]:
    """Layer index -> MoE module of a CausalLM, or of a pipeline rank's stages (`layers` a ModuleDict
    keyed by the whole model's layer indices; see `pipeline.stage_view`)."""
    if hasattr(model, "moe_layers"):
        return model.moe_layers()
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        return {}
    return {int(k): layer.moe for k, layer in layers.items() if getattr(layer, "moe", None) is not None}


class MoEBalance:
    def __init__(self, model: nn.Module, *, aux_loss_coef: float, bias_update_rate: float) -> None:
        self.layers = moe_layers_of(model)
        self.aux_loss_coef = aux_loss_coef
        self.bias_update_rate = bias_update_rate
        self._scores = RouterScores(self.layers) if aux_loss_coef > 0 else None
        self._loads_LE: torch.Tensor | None = None

    @classmethod
    def build(cls, model: nn.Module, *, aux_loss_coef: float, bias_update_rate: float) -> MoEBalance | None:
        has_moe = bool(moe_layers_of(model))
        return cls(model, aux_loss_coef=aux_loss_coef, bias_update_rate=bias_update_rate) if has_moe else None

    @contextlib.contextmanager
    def recording(self, on: bool = True) -> Iterator[None]:
        """Keep the routers' scores of the forward run inside (for `aux_term`) when the auxiliary
        loss is on and `on` (a real micro-batch)."""
        if self._scores is None:
            yield
            return
        with self._scores.recording(on):
            yield

    def aux_term(
        self,
        real_rows: Callable[[int], torch.Tensor],
        groups: tuple[dist.ProcessGroup, ...],
        token_weight: float,
    ) -> torch.Tensor | None:
        """The mean over layers of the recorded forward's balancing loss (over `real_rows`, the
        whole micro-batch's when `groups` split its tokens: this rank's part of it) x the
        micro-batch's real tokens x `token_weight` (1 / the global batch's tokens): this micro-batch's
        part of moe/aux_loss, to multiply by the coefficient. None when the coefficient is 0."""
        if self._scores is None:
            return None
        term = layers_aux_loss(self._scores, self.layers, real_rows, groups)
        return term * (token_weight / len(self.layers))

    def accumulate(self, padding_tokens: int = 0) -> None:
        """Add the last forward's per-layer token counts to the step's loads (no host sync), less
        those of its last `padding_tokens` tokens (the padding that tensor parallelism appends)."""
        counts = []
        for moe in self.layers.values():
            counts_E = moe.last_token_counts
            if padding_tokens:
                pad_experts = moe.last_experts_TK[-padding_tokens:].flatten()
                counts_E = counts_E - torch.bincount(pad_experts, minlength=counts_E.shape[0]).to(
                    counts_E.dtype
                )
            counts.append(counts_E)
        self.add_loads(torch.stack(counts))

    def add_loads(self, counts_LE: torch.Tensor) -> None:
        """Add [MoE layers, E] token counts (in `self.layers`' order) to the step's loads."""
        self._loads_LE = counts_LE if self._loads_LE is None else self._loads_LE + counts_LE

    def bias_abs_sum(self) -> tuple[float, int]:
        """(sum of |correction bias|, number of bias entries) of these layers: pipeline ranks each
        hold some layers, and the engine combines theirs into moe/bias_abs_mean."""
        biases = [
            moe.router.expert_bias for moe in self.layers.values() if moe.router.expert_bias is not None
        ]
        return float(sum(b.abs().sum() for b in biases)), sum(b.numel() for b in biases)

    @torch.no_grad()
    def finish(self, *, applied: bool, group: dist.ProcessGroup | None, comm_device: torch.device) -> dict:
        """Reduce the loads over ranks, update the correction biases (applied steps only), and
        return the step's load metrics; resets for the next step."""
        loads_LE, self._loads_LE = self._loads_LE, None
        reduce = group is not None and dist.get_world_size(group) > 1
        if loads_LE is None:
            if not reduce:
                return {}
            # A rank whose data-parallel share of the batch was empty ran only zero-weight filler
            # micro-batches: it still joins the reduction (with no load), or the others wait forever.
            experts = [moe.router.gate.weight.shape[0] for moe in self.layers.values()]
            loads_LE = torch.zeros(len(experts), max(experts), dtype=torch.float64)
        if reduce:
            reduced = loads_LE.to(comm_device, torch.float64)
            dist.all_reduce(reduced, group=group)
            loads_LE = reduced.to(loads_LE.device)
        loads_LE = loads_LE.double()
        ratio_L = loads_LE.max(dim=1).values / loads_LE.mean(dim=1).clamp(min=1e-12)
        metrics = {
            f"moe/layer{i}_load_max_over_mean": float(r) for i, r in zip(self.layers, ratio_L.tolist())
        }
        metrics["moe/load_max_over_mean"] = float(ratio_L.max())
        biases = [
            moe.router.expert_bias for moe in self.layers.values() if moe.router.expert_bias is not None
        ]
        if self.bias_update_rate > 0 and biases:
            for moe, load_E in zip(self.layers.values(), loads_LE):
                bias = moe.router.expert_bias
                if bias is not None and applied:
                    step_E = torch.sign(load_E.mean() - load_E).to(bias.device, bias.dtype)
                    bias.add_(self.bias_update_rate * step_E)
            metrics["moe/bias_abs_mean"] = float(torch.cat([b.abs().flatten() for b in biases]).mean())
        return metrics
