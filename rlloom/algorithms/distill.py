"""On-policy distillation: the student samples, a frozen teacher scores the sampled tokens, and each
token's advantage is the teacher's logprob minus the student's.

Shape legend: B sequences, T response tokens.

This is the per-token reverse KL of Agarwal et al., "On-Policy Distillation of Language Models"
(GKD, 2024) with the sampled-token estimator used by Thinking Machines' on-policy distillation,
slime's `--use-opd` and verl's `opd`: with x ~ student, KL(student || teacher) at a position is
estimated by logp_student(x) - logp_teacher(x) (k1), and its negative is the token's advantage, so
the policy gradient lowers the reverse KL. No discount and no whitening: each token is its own
one-step return (the teacher's judgement of exactly that token).
"""

from __future__ import annotations

import torch

from rlloom.algorithms._validate import check_same_shape


def reverse_kl_advantages(
    teacher_logp_BT: torch.Tensor, student_logp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """[B, T] advantages logp_teacher - logp_student of the sampled tokens, 0 where `mask_BT` is off.

    teacher_logp_BT: [B, T] the teacher's logprobs of the response tokens.
    student_logp_BT: [B, T] the student's, from the policy that sampled them (before the update).
    mask_BT: [B, T] bool, the tokens trained on (a multi-turn sample's tool output is off).
    """
    _check(teacher_logp_BT, student_logp_BT, mask_BT)
    return (teacher_logp_BT - student_logp_BT).float() * mask_BT


def reverse_kl(teacher_logp_BT: torch.Tensor, student_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """The mean over every masked-in response token of the batch of logp_student - logp_teacher: the
    sampled estimate of KL(student || teacher) per token (0 for a batch without such tokens)."""
    _check(teacher_logp_BT, student_logp_BT, mask_BT)
    diff = (student_logp_BT - teacher_logp_BT).double()[mask_BT]
    return float(diff.mean()) if diff.numel() else 0.0


def _check(teacher_logp_BT: torch.Tensor, student_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> None:
    check_same_shape("teacher_logp_BT", teacher_logp_BT, "student_logp_BT", student_logp_BT)
    check_same_shape("mask_BT", mask_BT, "student_logp_BT", student_logp_BT)
