"""The memory model counts the forward-only models beside the policy: on-policy distillation's teacher
(teacher.path, in the compute dtype on the training ranks, or on the host between its forwards with
teacher.offload) and the reward model (reward.model_path, whole on the trainer's device), in the
start-up check (`rlloom train`) and in `rlloom plan`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.plan import check
from rlloom.plan.published import CONFIG_DIR
from tests.conftest import build_tiny_checkpoint

BIG_MICRO_BATCH = [
    "rollout.n_samples=64",
    "train.max_tokens_per_micro_batch=32768",
    "rollout.sleep_during_train=true",
]
"""32k-token micro-batches on the tiny student: about 66 MiB of activations, more than the teacher's
weights (a teacher that visits for its forward then adds nothing to the peak); no KV cache kept."""
GPU_GB = 0.085
"""A GPU of 87 MiB: the student's step fits (78 MiB), beside the resident teacher it does not (96 MiB)."""


@pytest.fixture(scope="module")
def big_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 9.5M-parameter teacher with the tiny student's tokenizer: 18 MiB in bf16."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("teacher") / "ckpt", seed=1, hidden=512, layers=4)


def opd_line(student: Path, teacher: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["train", "arithmetic_smoke", f"model.path={student}", f"trainer.run_dir={run_dir}",
            "logging.console=false", "data.num_eval=2", "data.num_train=16", "algorithm.estimator=opd",
            f"teacher.path={teacher}", *BIG_MICRO_BATCH, *extra]  # fmt: skip


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_teacher_the_gpu_cannot_hold_beside_the_policy_names_teacher_offload(
    tiny_checkpoint, big_teacher, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(check, "device_memory_gb", lambda cfg: (GPU_GB, 0.0))
    rc = main(opd_line(tiny_checkpoint, big_teacher, tmp_path / "run"))
    line = one_error_line(capsys)
    assert rc == 2 and line.startswith(f"rlloom: error: teacher.path={str(big_teacher)!r} does not fit"), line
    assert "a GPU has 0.1 GiB" in line and "Fix: set teacher.offload=true" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # the same run without the teacher fits, and so does the teacher offloaded between its forwards
    base = [f"model.path={tiny_checkpoint}", *BIG_MICRO_BATCH]
    check.check_memory(load_config("arithmetic_smoke", base))
    check.check_memory(
        load_config(
            "arithmetic_smoke",
            [*base, "algorithm.estimator=opd", f"teacher.path={big_teacher}", "teacher.offload=true"],
        )
    )


def test_a_teacher_counts_in_the_compute_dtype_on_every_rank_of_its_stage(tiny_checkpoint, big_teacher):
    from rlloom.plan.counts import model_costs

    cfg = load_config("arithmetic_smoke", [f"model.path={tiny_checkpoint}"])
    opd = load_config(
        "arithmetic_smoke",
        [f"model.path={tiny_checkpoint}", "algorithm.estimator=opd", f"teacher.path={big_teacher}"],
    )
    params = model_costs(check._args(str(big_teacher))).total_params
    assert check.run_models(opd).teacher == params
    for on_cuda, dtype_bytes in [(True, 2), (False, 4)]:  # bf16 on a GPU, fp32 on CPU
        without = check.run_estimate(cfg, 80, on_cuda=on_cuda).gpu_memory_gb
        with_teacher = check.run_estimate(opd, 80, on_cuda=on_cuda).gpu_memory_gb
        assert with_teacher - without == pytest.approx(dtype_bytes * params / 2**30), on_cuda


def write_reward_model_config(path: Path, tokenizer_from: Path) -> Path:
    """A Qwen3-8B-sized one-label reward model's config.json and a tokenizer, no weights: the memory
    check reads the config alone, before anything loads."""
    path.mkdir(parents=True)
    config = json.loads((CONFIG_DIR / "qwen3-8b" / "config.json").read_text())
    config |= {"architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1}
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, path / name)
    return path


def test_a_reward_model_the_host_cannot_hold_is_one_line(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    rm = write_reward_model_config(tmp_path / "rm", tiny_checkpoint)
    # a host with 8 GiB available; the 8B reward model takes 30 GiB in fp32 in the trainer's process
    monkeypatch.setattr(check, "available_memory_bytes", lambda device: 8 * 2**30)
    line_args = ["train", "arithmetic_smoke", f"model.path={tiny_checkpoint}", f"trainer.run_dir={tmp_path / 'run'}",
                 "logging.console=false", "data.num_eval=2", "data.num_train=16", "reward.name=model",
                 f"reward.model_path={rm}"]  # fmt: skip
    rc = main(line_args)
    line = one_error_line(capsys)
    assert rc == 2 and line.startswith(f"rlloom: error: reward.model_path={str(rm)!r} does not fit"), line
    assert "this host has 8.0 GiB available" in line and "Fix: use a smaller reward model" in line, line
    check.check_memory(load_config("arithmetic_smoke", [f"model.path={tiny_checkpoint}"]))


def plan_json(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict]:
    code = main(["plan", "qwen3-0.6b", "--gpus", "1", "--gpu-memory-gb", "26",
                 "--check", "tp=1,pp=1,cp=1,ep=1,offload=0", "--json", *extra])  # fmt: skip
    return code, json.loads(capsys.readouterr().out)


def test_plan_counts_the_teacher_and_the_reward_model(capsys):
    # Qwen3-0.6B on one 26 GB GPU (22.8 GB usable) fits alone (14.6 GB); beside an 8B teacher's 15.3 GB
    # of bf16 weights it does not, and with the teacher offloaded its forward is the peak (21.9 GB)
    code, alone = plan_json(capsys)
    assert code == 0 and alone["fits"]
    code, teacher = plan_json(capsys, "--teacher", "qwen3-8b")
    assert code == 1 and not teacher["fits"] and teacher["gpu_memory_gb"] > alone["gpu_memory_gb"] + 15
    code, offloaded = plan_json(capsys, "--teacher", "qwen3-8b", "--teacher-offload")
    assert code == 0 and offloaded["fits"] and offloaded["peak_phase"] == "teacher", offloaded
    assert "teacher.offload=true" in offloaded["train_overrides"]
    code, rm = plan_json(capsys, "--reward-model", "qwen3-8b")
    assert code == 1 and rm["gpu_memory_gb"] > alone["gpu_memory_gb"] + 14
