"""PPO's critic (a `head="value"` engine) in the layouts a critic may use equals the one-process
critic in fp32, on 2 gloo processes: FSDP (dp=2; the value head's one-element bias leaves a rank an
empty shard), tensor parallelism (tp=2: each rank gathers the token shards for the value head),
pipeline parallelism (pp=2: the last stage runs the value head; the tiny model's tied embedding is
not held twice), context parallelism (cp=2, documents cut over the ranks) and expert parallelism
(ep=2 on an MoE model). Two value-loss steps from the zero head (the first moves only the head, the
second the whole model), then the values and every gradient of a third batch, the weights, and the
weights as `rlloom export --critic` takes them (`named_weights`, the value head gathered)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines" / "train"))
from parallel_helpers import run_gloo, tiny_model  # noqa: E402
from test_train_parallel_gloo import TOL, WEIGHT_TOL, batches, cfg, full_grads  # noqa: E402

from rlloom.algorithms.objective import make_value_loss_fn, value_normalizer  # noqa: E402
from rlloom.data.types import RolloutBatch, ValueUpdate  # noqa: E402
from rlloom.engines.train.native import NativeTrainEngine  # noqa: E402
from rlloom.parallel import ParallelDims  # noqa: E402

LAYOUTS = {"dp=2": ("qwen3", dict(world_size=2)), "cp=2": ("qwen3", dict(world_size=2, cp=2))}
LAYOUTS["tp=2"] = ("qwen3", dict(world_size=2, tp=2))
LAYOUTS["pp=2"] = ("qwen3", dict(world_size=2, pp=2))
LAYOUTS["ep=2"] = ("qwen3_moe", dict(world_size=2, ep=2))


def value_update(batch: RolloutBatch) -> ValueUpdate:
    mask = batch.response_mask()
    gen = torch.Generator().manual_seed(len(batch))
    returns = torch.randn(mask.shape, generator=gen) * mask
    # old values near the targets: both clip branches
    return ValueUpdate(
        batch=batch, old_values_BT=0.1 * returns, returns_BT=returns, normalizer=value_normalizer(mask)
    )


def module_weights(engine: NativeTrainEngine) -> dict[str, torch.Tensor]:
    """Every parameter of the critic's module (the value head's too) as one full tensor."""
    out = {}
    for name, p in engine.module.named_parameters():
        weight = p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        if engine.layout.ep_group is not None and ".moe.experts." in name:
            blocks = [torch.empty_like(weight) for _ in range(engine.layout.ep)]
            dist.all_gather(blocks, weight.contiguous(), group=engine.layout.ep_group)
            weight = torch.cat(blocks)
        out[name] = weight
    return out


def run(family: str, dims: ParallelDims | None, save_to: str | None = None) -> dict:
    # pipeline parallelism pads every micro-batch to the budget, which must hold the longest sample
    budget = 80 if dims is not None and dims.pp > 1 else cfg().max_tokens_per_micro_batch
    config = dataclasses.replace(cfg(), share_prompts=False, max_tokens_per_micro_batch=budget)
    engine = NativeTrainEngine(config, tiny_model(family), parallel_dims=dims, head="value")
    data = batches(family.endswith("moe"))
    metrics = []
    for batch in data[:2]:
        update = value_update(batch)
        loss_fn = make_value_loss_fn(update, clip=0.2)
        m = engine.train_step(batch, loss_fn, loss_normalizer=update.normalizer)
        metrics.append({k: m[k] for k in ("train/loss", "train/grad_norm", "critic/vpred_mean")})
    values = engine.forward_values(data[2])
    update = value_update(data[2])
    engine.forward_backward(data[2], make_value_loss_fn(update, clip=0.2), loss_normalizer=update.normalizer)
    if engine.pipe is not None:
        engine.pipe.clip_grad_norm_(0.0)  # finishes the gradients (measures only)
    if save_to is not None:
        engine.save(save_to)
    return {
        "metrics": metrics,
        "values": values,
        "grads": full_grads(engine),
        "weights": module_weights(engine),
        # what `rlloom export --critic` writes: transformers' names, the value head's last
        "exported": {n: t.clone() for bucket in engine.named_weights() for n, t in bucket},
    }


def compare(got: dict, expected: dict, what: str) -> None:
    for i, (a, b) in enumerate(zip(got["metrics"], expected["metrics"])):
        for k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (what, i, k, a[k], b[k])
    assert expected["values"].abs().max() > 0.01  # the critic moved off its zero head
    torch.testing.assert_close(got["values"], expected["values"], **TOL, msg=f"{what} values")
    for key in ("grads", "weights"):  # under PP each rank holds its stages' parameters; together all
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, sorted(got[key]))
        assert set().union(*held) == expected[key].keys(), (what, key)
        assert what == "pp=2" or got[key].keys() == expected[key].keys(), (what, key)
    for name, grad in got["grads"].items():
        torch.testing.assert_close(grad, expected["grads"][name], **TOL, msg=f"{what} grad {name}")
    for name, weight in got["weights"].items():
        torch.testing.assert_close(
            weight, expected["weights"][name], **WEIGHT_TOL, msg=f"{what} weight {name}"
        )
    assert list(got["exported"]) == list(expected["exported"]) and list(got["exported"])[-2:] == [
        "score.weight",
        "score.bias",
    ]
    for name, weight in expected["exported"].items():
        torch.testing.assert_close(got["exported"][name], weight, **WEIGHT_TOL, msg=f"{what} exported {name}")


def worker(rank: int, expected: dict, save_to: str) -> None:
    for what, (family, dims) in LAYOUTS.items():
        got = run(family, ParallelDims(**dims), save_to if what == "pp=2" else None)
        compare(got, expected[family], what)


@pytest.mark.slow
def test_critic_in_every_layout_equals_one_process(tmp_path):
    expected = {family: run(family, None) for family in ("qwen3", "qwen3_moe")}
    run_gloo(worker, 2, expected, str(tmp_path / "pp2"))
    # the pp=2 critic's checkpoint (each rank its stages, the value head on the last) loads in one process
    engine = NativeTrainEngine(cfg(), tiny_model("qwen3"), head="value")
    engine.load(str(tmp_path / "pp2"))
    values = engine.forward_values(batches(False)[2])
    torch.testing.assert_close(values, expected["qwen3"]["values"], **TOL)
