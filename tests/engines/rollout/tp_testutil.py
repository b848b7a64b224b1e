"""The program each rank of a tensor-parallel rollout test runs (gloo on CPU); the test runs the same
jobs at tp = 1 in its own process and compares. (No transformers import: the ranks start faster.)

A job is a checkpoint folder and a list of steps: ("generate", prompts, [SamplingParams]) records the
completions, ("dims",) the engine's `weight_shard_dims()`, ("update", folder, sliced) loads another
checkpoint's weights through update_weights, full tensors or (sliced) only the part
`weight_shard_slices` says this rank holds.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import rlloom.models as models
from rlloom.engines.rollout.native import NativeEngine

Result = list[tuple[int, int, list[int], list[float], str]]


def run_job(job: dict, group: dist.ProcessGroup | None) -> list[Result]:
    """Run one job's steps on a fresh engine (this rank's shard with `group`); the generated results.
    With job["build"] the engine comes from `build_rollout_engine` (at tp > 1: each rank loads only
    its shard of the checkpoint), else from the full model."""
    if job.get("build"):
        engine = _built_engine(job["path"], group)
    else:
        engine = NativeEngine(
            models.from_pretrained(job["path"], fused_projections=True),
            max_model_len=64,
            num_blocks=128,
            block_size=4,
            seed=job.get("seed", 0),
            tp_group=group,
        )
    results = []
    for step in job["steps"]:
        if step[0] == "generate":
            out = engine.generate(step[1], step[2])
            results.append(
                [(c.prompt_index, c.sample_index, c.token_ids, c.logprobs, c.finish_reason) for c in out]
            )
        elif step[0] == "dims":
            results.append(engine.weight_shard_dims())
        else:
            _, folder, sliced = step
            tensors = models.hf_named_tensors(models.from_pretrained(folder))
            if sliced:
                slices = engine.weight_shard_slices()
                tensors = ((n, t if slices[n] is None else t.narrow(*slices[n])) for n, t in tensors)
            engine.update_weights(tensors, version=len(results))
    return results


def _built_engine(path: str, group: dist.ProcessGroup | None) -> NativeEngine:
    from rlloom.config.loading import load_config
    from rlloom.engines.rollout.build import build_rollout_engine

    tp = 1 if group is None else dist.get_world_size(group)
    overrides = ["data.max_prompt_length=40", "rollout.max_new_tokens=24", "rollout.num_blocks=128"]
    if tp > 1:  # a run's rollout ranks form whole replicas of rollout.tp
        overrides += ["cluster.mode=ray", f"cluster.num_workers={tp}"]
    cfg = load_config(
        "arithmetic_smoke", [f"model.path={path}", f"rollout.tp={tp}", "rollout.block_size=4", *overrides]
    )
    return build_rollout_engine(cfg, device=torch.device("cpu"), dtype=torch.float32, tp_group=group)


def run_rank(rank: int, world: int, rendezvous: str, jobs: dict[str, dict], out: str) -> None:
    """torch.multiprocessing.spawn target: every job at tp = world; rank r saves `out`.r."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        results = {name: run_job(job, dist.group.WORLD) for name, job in jobs.items()}
        torch.save(results, Path(f"{out}.{rank}"))
    finally:
        dist.destroy_process_group()
