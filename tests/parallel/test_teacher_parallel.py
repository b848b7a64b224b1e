"""On-policy distillation's teacher in a parallel training layout: on 2 gloo processes in tensor
parallelism (parallel.tp=2, each rank holding half of every head and of the vocabulary) the teacher's
logprobs of a batch, and the student's, equal the one-process run's in fp32; the teacher kept on the
host between its forwards (teacher.offload) gives the same ones."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from parallel_helpers import run_gloo  # noqa: E402
from test_distill_run import favouring_teacher  # noqa: E402

from rlloom.config import load_config  # noqa: E402
from rlloom.data.types import RolloutBatch, Sample  # noqa: E402
from rlloom.workers.train import TrainWorker  # noqa: E402
from tests.conftest import build_tiny_checkpoint  # noqa: E402


def batch() -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i, (p, r) in enumerate([(7, 5), (12, 9), (3, 14), (9, 1)]):
        ids = torch.randint(3, 90, (p + r,), generator=gen).tolist()
        mask = [int(j % 4 != 3) for j in range(r)]  # masked tokens, as a multi-turn sample's tool output
        samples.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:], loss_mask=mask, group_id=i))
    return RolloutBatch(samples)


def logprobs(student: Path, teacher: Path, *extra: str, rank: int = 0) -> dict[str, torch.Tensor]:
    overrides = [f"model.path={student}", f"teacher.path={teacher}", "algorithm.estimator=opd", *extra]
    worker = TrainWorker(load_config("arithmetic_smoke", overrides), rank=rank)
    data = batch()
    return {"teacher": worker.teacher_logprobs(data), "student": worker.old_logprobs(data)}


def _tp_rank(rank: int, student: Path, teacher: Path, out: Path) -> None:
    got = logprobs(student, teacher, "cluster.mode=ray", "cluster.num_workers=2", "parallel.tp=2", rank=rank)
    if rank == 0:
        torch.save(got, out)


def test_teacher_logprobs_in_tensor_parallelism_equal_one_process(tmp_path):
    student = build_tiny_checkpoint(tmp_path / "student")
    teacher = favouring_teacher(tmp_path / "teacher")
    one = logprobs(student, teacher)
    assert (one["teacher"] - one["student"]).abs().max() > 0.5  # two different models
    offloaded = logprobs(student, teacher, "teacher.offload=true")
    for key in one:
        torch.testing.assert_close(offloaded[key], one[key], rtol=0, atol=0)
    out = tmp_path / "tp.pt"
    run_gloo(_tp_rank, 2, student, teacher, out)
    tp = torch.load(out)
    for key in one:
        torch.testing.assert_close(tp[key], one[key], rtol=1e-5, atol=1e-5)
