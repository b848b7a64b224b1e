"""Shared fixtures: a tiny random Hugging Face checkpoint with a character-level tokenizer.

Small enough to build in well under a second, real enough for the whole RL loop: a Qwen3 model
saved by transformers, and a fast tokenizer with a chat template and an end-of-turn token.
"""

from __future__ import annotations

import ast
import compileall
import functools
import importlib.util
import sys
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
    slots); a run joins it instead of starting its own. The Ray tests run one after another and the
    last one shuts it down (see below), so the instance does not idle beside the rest of the suite."""
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'rlloom[ray]'")
    for attempt in range(3):  # Ray gives its raylet a fixed 30 s to register: a busy machine misses it
        try:
            ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False)
            break
        except Exception:  # Ray raises a bare Exception for it
            ray.shutdown()
            if attempt == 2:
                raise
    yield
    ray.shutdown()


def pytest_configure(config: pytest.Config) -> None:
    """Writes rlloom's bytecode (`__pycache__`) once, before any test: where PYTHONDONTWRITEBYTECODE
    is set (as on the 2-core CI machine), every process the suite starts (each Ray actor, CLI and
    reward-worker subprocess) would otherwise compile rlloom's sources again: 1.7 s of the 9.0 s of
    CPU an actor spends importing `rlloom.cluster.ray_actor` (docs/benchmarks.md). Up to date, it
    costs 0.05 s; xdist's workers leave it to the controller."""
    if not hasattr(config, "workerinput"):
        compileall.compile_dir(config.rootpath / "rlloom", quiet=1)


def _uses_ray(item: pytest.Item | None) -> bool:
    return item is not None and "ray_cluster" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that use `ray_cluster` run one after another, so one Ray start serves them all and
    is shut down when they end: after all others in one process; first under `make test`'s xdist
    workers (`--dist loadgroup`, see `ModuleScheduling`), whose Ray unit is the longest."""
    xdist = config.getoption("loadgroup", False)  # set in an xdist worker by `--dist loadgroup`
    items.sort(key=lambda item: _uses_ray(item) != xdist)
    for item in items if xdist else ():  # the controller's Ray unit, read from the source, is these
        uses = _ray_tests(item.path)
        if _uses_ray(item) != ("*" in uses or item.originalname in uses):
            raise pytest.UsageError(
                f"{item.nodeid}: the Ray unit (`_ray_tests`) misreads whether it uses Ray"
            )


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The last Ray test shuts Ray down, so its processes do not idle beside the tests that follow
    in the same process (the session fixture's own teardown comes only at the session's end)."""
    ray = sys.modules.get("ray")
    if ray is not None and _uses_ray(item) and not _uses_ray(nextitem):
        ray.shutdown()


@functools.cache
def _ray_tests(path: Path) -> frozenset[str]:
    """The names of the module's tests that use `ray_cluster` ("*": all of them, by the module's
    `pytestmark`), read from its source: as an argument, in a decorator, or through a fixture of
    the module that uses it."""
    if path.suffix != ".py" or "ray_cluster" not in (text := path.read_text()):
        return frozenset()
    tree = ast.parse(text)
    if any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and "ray_cluster" in ast.unparse(node.value)
        for node in tree.body
    ):
        return frozenset({"*"})
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    ray_names = {"ray_cluster"}
    while True:  # a fixture that uses a Ray name is one too
        found = {
            f.name
            for f in functions
            if {a.arg for a in f.args.args} & ray_names
            or any(name in ast.unparse(d) for d in f.decorator_list for name in ray_names)
        }
        if found <= ray_names:
            return frozenset(n for n in found if n.startswith("test"))
        ray_names |= found


if importlib.util.find_spec("xdist") is not None:  # the dev extra's pytest-xdist (`make test`)
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        """`make test`'s schedule over two xdist workers: a module is a unit (its tests run on one
        worker, so a module-scoped baseline run that several tests compare with is built once), and
        every test that uses `ray_cluster` joins one unit, so one worker starts Ray once and Ray's
        processes never run twice side by side; a Ray module's other tests stay in their module's
        unit, free to run on the other worker meanwhile. The units go out in the collected order,
        the Ray unit (the longest) first. Built here because the controller sees test ids only
        (xdist's own `xdist_group` suffix is not applied under pytest 9.2)."""

        def _split_scope(self, nodeid: str) -> str:
            module, _, test = nodeid.partition("::")
            uses = _ray_tests(self.config.rootpath / module)
            return "ray" if "*" in uses or test.split("[", 1)[0] in uses else module

    def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 (xdist's Scheduling)
        if config.getoption("dist") != "loadgroup":
            return None
        config.option.loadscopereorder = False  # the collected order: the Ray unit first
        return ModuleScheduling(config, log)


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
