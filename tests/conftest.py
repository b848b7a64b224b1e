"""Shared fixtures: a tiny random Hugging Face checkpoint with a character-level tokenizer.

Small enough to build in well under a second, real enough for the whole RL loop: a Qwen3 model
saved by transformers, and a fast tokenizer with a chat template and an end-of-turn token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlloom.models.tiny import write_tiny_model


def build_tiny_checkpoint(
    path: Path, *, seed: int = 0, hidden: int = 32, layers: int = 2, moe: bool = False
) -> Path:
    """Write a tiny Qwen3 (or, with `moe`, Qwen3-MoE: 8 experts, 2 per token) checkpoint with a
    character tokenizer into `path` and return it (`rlloom init-model`'s models)."""
    return write_tiny_model(
        "tiny-moe" if moe else "tiny-dense", path, seed=seed, hidden=hidden, layers=layers
    )


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="session")
def tiny_moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_moe") / "ckpt", moe=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for every Ray test of the session (each start costs 5-10 s of CPU on
    two cores, and five modules need one). Five CPUs: the largest layout (4 training + 1 rollout
    slots); a run joins it instead of starting its own. The Ray tests run last (see below), so the
    instance does not idle beside the rest of the suite."""
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")
    ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that use `ray_cluster` run after all others (in their collected order), so one Ray
    start serves them all and is shut down when they end."""
    items.sort(key=lambda item: "ray_cluster" in getattr(item, "fixturenames", ()))


@pytest.fixture
def restore_determinism():
    """Puts torch's process-wide deterministic-mode settings back after a test that turns them on
    (`rlloom.determinism.enable_determinism`, also called by an in-process `run`)."""
    import os

    import torch

    cuda, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        cuda.allow_tf32,
        cudnn.allow_tf32,
        cuda.allow_bf16_reduced_precision_reduction,
        cuda.allow_fp16_reduced_precision_reduction,
        cudnn.deterministic,
        cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.utils.deterministic.fill_uninitialized_memory = saved[1]
    cuda.allow_tf32, cudnn.allow_tf32 = saved[2], saved[3]
    cuda.allow_bf16_reduced_precision_reduction = saved[4]
    cuda.allow_fp16_reduced_precision_reduction = saved[5]
    cudnn.deterministic, cudnn.benchmark = saved[6], saved[7]
    if saved[8] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[8]
