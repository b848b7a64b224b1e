"""`rlloom compare-layers`: where a train-vs-rollout logprob gap comes from, layer by layer.

The rollout engine samples a response to a prompt (its paged-cache prefill of the prompt, then one
decode step per token), and the training side runs its forward over prompt + response as one packed
sequence (the layout the training engine feeds the model). Forward hooks on both models record the
output of the token embedding, of every decoder layer and of the final norm; the report gives, for
each, the largest |rollout - training| over the prompt's positions (prefill) and over the response's
(decode), then the same for the sampled tokens' logprobs, and names the first place that differs.
That is slime's reproducibility check's question ("which layer first diverges?") asked of this
project's two engines, which share their model code: a difference at the embedding points at the
weights (a sync), one that starts in layer k at the attention or MoE kernels of that layer.

The rollout engine runs eagerly here (no CUDA graphs or compiled layers: hooks do not fire inside a
replayed graph), so a gap that only the compiled decode has does not show; compare with the run's
`rollout/logp_gap_max` to tell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlloom.engines.rollout.base import SamplingParams
from rlloom.engines.rollout.native.engine import NativeEngine
from rlloom.models import from_pretrained
from rlloom.models.exact import exact_numerics
from rlloom.models.logprobs import token_logprobs


@dataclass(frozen=True, slots=True)
class Gap:
    """One compared output: its largest |rollout - training| at the prompt and response positions."""

    name: str
    """`embedding`, `layer K` (0-based), `final norm` or `logprobs`."""
    prefill: float
    """Over the prompt's positions (the rollout's prefill); nan for the logprobs (none sampled)."""
    decode: float
    """Over the response's positions (the rollout's decode steps)."""

    @property
    def differs(self) -> bool:
        return self.prefill > 0 or self.decode > 0


@dataclass(frozen=True, slots=True)
class Comparison:
    prompt_ids: list[int]
    response_ids: list[int]
    gaps: list[Gap]
    """In forward order: embedding, each layer, final norm, logprobs."""

    @property
    def first_difference(self) -> str | None:
        """The first output where the two engines differ; None when every one is equal bit for bit."""
        return next((g.name for g in self.gaps if g.differs), None)

    def table(self) -> str:
        rows = [f"{'output':<12} {'prefill max|diff|':>18} {'decode max|diff|':>18}"]
        rows += [f"{g.name:<12} {g.prefill:>18.3e} {g.decode:>18.3e}" for g in self.gaps]
        first = self.first_difference
        rows.append(
            f"first difference: {first}" if first else "rollout and training agree bit for bit at every layer"
        )
        return "\n".join(rows)


def compare_layers(
    model_path: str,
    prompt_ids: list[int],
    *,
    max_new_tokens: int = 16,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    exact: bool = False,
) -> Comparison:
    """Sample a response with the rollout engine, recompute it with the training forward, and compare
    every layer's hidden states and the response's logprobs (temperature 1); `exact`: both sides with
    rollout.match_training's batch-invariant numerics (models/exact.py)."""
    if not prompt_ids or max_new_tokens < 1:
        raise ValueError(
            f"compare-layers needs a non-empty prompt and max_new_tokens >= 1 (got {len(prompt_ids)} "
            f"prompt tokens, max_new_tokens={max_new_tokens}). Fix: pass --prompt TEXT and --max-new-tokens 16."
        )
    engine = NativeEngine.from_pretrained(
        model_path,
        dtype=dtype,
        device=device,
        enforce_eager=True,
        compile=False,
        num_blocks=(len(prompt_ids) + max_new_tokens) // 16 + 2,
        max_model_len=len(prompt_ids) + max_new_tokens + 1,
        seed=seed,
        exact=exact,
    )
    rollout_outputs, hooks = _record(engine.model)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed, ignore_eos=True)
    completion = engine.generate([prompt_ids], [sampling])[0]
    for hook in hooks:
        hook.remove()

    model = from_pretrained(model_path, dtype=dtype, device=device)
    train_outputs, _ = _record(model)
    ids = prompt_ids + completion.token_ids
    with torch.no_grad(), exact_numerics(exact):
        hidden_ND = model.hidden_states(
            torch.tensor(ids, device=device),
            position_ids=torch.arange(len(ids), device=device),
            cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32, device=device),
            max_seqlen=len(ids),
        )
        targets = torch.tensor(completion.token_ids, device=device)
        start = len(prompt_ids) - 1  # the position whose logits sample the first response token
        train_logp = token_logprobs(hidden_ND[start : start + len(targets)], model.lm_head_weight, targets)[0]
    # Positions the rollout fed to the model: the prompt, then every response token but the last.
    fed, prompt_len = len(ids) - 1, len(prompt_ids)
    gaps = []
    for name, calls in rollout_outputs.items():
        diff = (torch.cat(calls)[:fed] - train_outputs[name][0][:fed]).abs()
        decode = float(diff[prompt_len:].max()) if fed > prompt_len else 0.0
        gaps.append(Gap(name, float(diff[:prompt_len].max()), decode))
    logp_gap = (torch.tensor(completion.logprobs) - train_logp.float().cpu()).abs()
    gaps.append(Gap("logprobs", float("nan"), float(logp_gap.max())))
    return Comparison(prompt_ids=prompt_ids, response_ids=completion.token_ids, gaps=gaps)


def _record(model: torch.nn.Module) -> tuple[dict[str, list[torch.Tensor]], list]:
    """Forward hooks that append each call's output [rows, D] (fp32, on the CPU) to a list per output."""
    modules = {"embedding": model.tok_embeddings}
    modules |= {f"layer {i}": layer for i, layer in enumerate(model.layers)}
    modules["final norm"] = model.norm
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in modules}

    def keep(name: str) -> Callable:
        def hook(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
            outputs[name].append(out.detach().reshape(-1, out.shape[-1]).float().cpu())

        return hook

    return outputs, [m.register_forward_hook(keep(name)) for name, m in modules.items()]
