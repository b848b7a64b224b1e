"""On a GPU: the reward model in bf16 scores close to transformers' fp32 CPU logits (batched, padded),
and the teacher's logprobs in bf16 on the training rank (also offloaded between its forwards) are the
CPU's within bf16 error. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
sys.path.insert(0, str(Path(__file__).parents[1] / "rewards"))


def test_reward_model_in_bf16_on_the_gpu_matches_fp32(tmp_path):
    from test_reward_model import write_reward_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlloom.rewards.reward_model import RewardModel

    rm = write_reward_model(tmp_path / "rm")
    texts = ["<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>", "5", "x" * 300]
    model = RewardModel.load(str(rm), batch_size=2)
    assert model.device.type == "cuda"
    got = model(texts)
    tok = AutoTokenizer.from_pretrained(rm)
    ref = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [
            float(ref(input_ids=torch.tensor([tok(t, add_special_tokens=False)["input_ids"]])).logits[0, 0])
            for t in texts
        ]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=3e-2, abs=3e-2)


def test_teacher_logprobs_in_bf16_on_the_gpu_match_the_cpu(tmp_path):
    """The teacher built as the reference is (bf16 compute on the GPU), and offloaded between forwards."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
    from test_distill_run import favouring_teacher
    from test_teacher_parallel import logprobs

    from tests.conftest import build_tiny_checkpoint

    student = build_tiny_checkpoint(tmp_path / "student")
    teacher = favouring_teacher(tmp_path / "teacher")
    cpu = logprobs(student, teacher, "cluster.device=cpu")
    for extra in ((), ("teacher.offload=true",)):
        gpu = logprobs(student, teacher, "cluster.device=cuda", *extra)
        for key in cpu:
            torch.testing.assert_close(gpu[key], cpu[key], rtol=5e-2, atol=5e-2)
