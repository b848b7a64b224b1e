"""On-policy distillation's advantages and metric against a naive loop over tokens."""

from __future__ import annotations

import pytest
import torch

from rlloom.algorithms.distill import reverse_kl, reverse_kl_advantages


def test_reverse_kl_advantages_and_metric_equal_a_loop_over_the_trained_tokens():
    gen = torch.Generator().manual_seed(0)
    teacher_BT, student_BT = -torch.rand(3, 5, generator=gen) * 4, -torch.rand(3, 5, generator=gen) * 4
    mask_BT = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    adv_BT = reverse_kl_advantages(teacher_BT, student_BT, mask_BT)
    diffs = []
    for b in range(3):
        for t in range(5):
            want = float(teacher_BT[b, t] - student_BT[b, t]) if mask_BT[b, t] else 0.0
            assert float(adv_BT[b, t]) == pytest.approx(want, abs=1e-6)
            if mask_BT[b, t]:
                diffs.append(float(student_BT[b, t] - teacher_BT[b, t]))
    assert reverse_kl(teacher_BT, student_BT, mask_BT) == pytest.approx(sum(diffs) / len(diffs), rel=1e-6)
    assert reverse_kl(teacher_BT, student_BT, torch.zeros_like(mask_BT)) == 0.0
    with pytest.raises(ValueError, match="teacher_logp_BT has shape"):
        reverse_kl_advantages(teacher_BT[:, :4], student_BT, mask_BT)
