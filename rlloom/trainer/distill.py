"""On-policy distillation in the step's advantage stage (algorithm.estimator=opd, or
algorithm.distill_coef > 0): the teacher's per-token judgement of the sampled tokens turned into
advantages (`rlloom.algorithms.distill`), alone or added to a reward estimator's.

Shape legend: B samples, T response tokens.
"""

from __future__ import annotations

import torch

from rlloom.algorithms.distill import reverse_kl, reverse_kl_advantages
from rlloom.config import AlgorithmConfig
from rlloom.data.types import RolloutBatch


def distill_advantages(
    algo: AlgorithmConfig,
    batch: RolloutBatch,
    base_BT: torch.Tensor | None,
    student_logp_BT: torch.Tensor,
    teacher_logp_BT: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, T] the step's advantages with distillation, and `distill/reverse_kl`.

    Estimator opd: logp_teacher - logp_student on every trained token, the rewards unused (`base_BT`
    None). Any other: its advantages `base_BT` (e.g. GRPO's or GAE's) plus distill_coef x that term.
    `student_logp_BT` are the logprobs of the policy that sampled the batch, before the update (the
    step's old logprobs); the loss mask keeps a multi-turn sample's tool output out of both the
    advantages and the metric."""
    mask_BT = batch.response_mask()
    term_BT = reverse_kl_advantages(teacher_logp_BT, student_logp_BT, mask_BT)
    metrics = {"distill/reverse_kl": reverse_kl(teacher_logp_BT, student_logp_BT, mask_BT)}
    if algo.estimator == "opd":
        return term_BT, metrics
    assert base_BT is not None, f"estimator {algo.estimator}'s advantages come first"
    return base_BT + algo.distill_coef * term_BT, metrics
