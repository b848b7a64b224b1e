"""RL algorithm core: advantages, policy/value losses, loss aggregation, KL, IS corrections, DAPO filters.

Pure functions over tensors; see each module's shape legend. The training engine reduces per-token
losses with `aggregate_loss_sum` per micro-batch divided by `loss_normalizer` of the global batch.
"""

from rlloom.algorithms.advantages import (
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    rloo_advantages,
)
from rlloom.algorithms.aggregation import AGG_MODES, aggregate_loss, aggregate_loss_sum, loss_normalizer
from rlloom.algorithms.corrections import is_weights
from rlloom.algorithms.filters import keep_informative_groups, overlong_penalty
from rlloom.algorithms.kl import (
    KL_KINDS,
    adaptive_kl_coef,
    entropy_from_logits,
    entropy_from_logits_chunked,
    kl_estimate,
)
from rlloom.algorithms.losses import cispo_loss, gspo_loss, ppo_clip_loss, value_loss

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "adaptive_kl_coef",
    "aggregate_loss",
    "aggregate_loss_sum",
    "cispo_loss",
    "entropy_from_logits",
    "entropy_from_logits_chunked",
    "gae_advantages",
    "grpo_advantages",
    "gspo_loss",
    "is_weights",
    "keep_informative_groups",
    "kl_estimate",
    "loss_normalizer",
    "masked_whiten",
    "overlong_penalty",
    "ppo_clip_loss",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_returns",
    "rloo_advantages",
    "value_loss",
]
