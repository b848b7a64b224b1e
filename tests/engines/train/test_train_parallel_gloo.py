"""The training engine in tensor/sequence- and expert-parallel layouts on 2 gloo processes equals the
one-process engine in fp32: logprobs and entropies, every parameter's gradient, the gradient norm,
the losses of three steps and the weights after them; for MoE with routing replay of skewed routes
(experts that get no token). On 4 processes: tp=2 x dp=2 and ep=2 x dp=4 (experts FSDP-sharded over
efsdp=2). Checkpoints move between layouts: tp=2 -> one process, ep=2 -> one process, dp=2 -> tp=2,
tp=2 x dp=2 -> one process, dp=4 -> tp=2 x dp=2, each continuing as the uninterrupted run."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "parallel"))
from parallel_helpers import run_gloo, tiny_model  # noqa: E402
from train_engine_helpers import PolicyLoss, make_batch  # noqa: E402

from rlloom.algorithms.losses import loss_normalizer  # noqa: E402
from rlloom.config import TrainEngineConfig  # noqa: E402
from rlloom.data.types import RolloutBatch, Sample  # noqa: E402
from rlloom.engines.train.base import ForwardOptions
from rlloom.engines.train.native import NativeTrainEngine  # noqa: E402
from rlloom.parallel import ParallelDims  # noqa: E402

MODE = "seq-mean-token-sum"
TOL = dict(atol=1e-5, rtol=1e-5)
WEIGHT_TOL = dict(atol=1e-4, rtol=0)
"""After Adam steps: Adam divides by sqrt(v), so a gradient element near 0 whose last bits differ
moves its weight by up to ~lr x 1e-2; a wrong gradient moves weights by ~lr = 3e-3 a step."""


def with_routes(batch: RolloutBatch, seed: int) -> RolloutBatch:
    """Recorded routes for the one MoE layer of the tiny qwen3_moe: most tokens on experts 0 and 1,
    so experts 2 and 3 get no token in many micro-batches. Samples sharing a prompt share its routes."""
    out = []
    for i, s in enumerate(batch.samples):
        gen = torch.Generator().manual_seed(sum(s.prompt_ids) * 7 + len(s.prompt_ids))
        prompt = torch.tensor([[0, 1]]).repeat(len(s.prompt_ids), 1)
        prompt[torch.rand(len(s.prompt_ids), generator=gen) < 0.2] = torch.tensor([2, 3])
        gen = torch.Generator().manual_seed(seed * 100 + i)
        response = torch.tensor([[1, 0]]).repeat(max(len(s.response_ids) - 1, 0), 1)
        response[torch.rand(len(response), generator=gen) < 0.3] = torch.tensor([3, 1])
        routes = torch.cat([prompt, response])[: s.num_tokens - 1].unsqueeze(1).to(torch.uint8)
        out.append(dataclasses.replace(s, routed_experts=routes))
    return RolloutBatch(out)


def batches(moe: bool) -> list[RolloutBatch]:
    long = Sample(prompt_ids=list(range(40)), response_ids=[5] * 31)  # 71 tokens: odd, padded under tp
    uneven = RolloutBatch([long, *make_batch(5, seed=11).samples])
    base = make_batch(8, seed=10).samples
    paired = [  # groups of two sharing a prompt: the shared-prompt layout
        dataclasses.replace(s, prompt_ids=base[i - i % 2].prompt_ids, group_id=i // 2)
        for i, s in enumerate(base)
    ]
    out = [RolloutBatch(paired), uneven, make_batch(1, seed=12)]
    return [with_routes(b, i) for i, b in enumerate(out)] if moe else out


def cfg() -> TrainEngineConfig:
    return TrainEngineConfig(lr=3e-3, weight_decay=0.1, grad_clip=0.5, max_tokens_per_micro_batch=48)


def step(engine: NativeTrainEngine, batch: RolloutBatch, moe: bool) -> dict[str, float]:
    loss = PolicyLoss(batch, MODE)
    normalizer = loss_normalizer(batch.response_mask(), MODE)
    return engine.train_step(
        batch, loss, loss_normalizer=normalizer, options=ForwardOptions(with_entropy=True, routing_replay=moe)
    )


def full_weights(engine: NativeTrainEngine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in engine.named_weights() for name, t in bucket}


def full_grads(engine: NativeTrainEngine) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as one full tensor, under the native model's names."""
    out = {}
    for name, p in engine.module.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        if engine.layout.ep_group is not None and ".moe.experts." in name:
            blocks = [torch.empty_like(grad) for _ in range(engine.layout.ep)]
            dist.all_gather(blocks, grad.contiguous(), group=engine.layout.ep_group)
            grad = torch.cat(blocks)
        out[name.removeprefix("model.").replace("_checkpoint_wrapped_module.", "")] = grad
    return out


def run_layout(family: str, dims: ParallelDims | None) -> tuple[NativeTrainEngine, dict]:
    """logprobs/entropy, gradients and grad norm of batch 0, then two steps: the results to compare."""
    moe = family.endswith("moe")
    engine = NativeTrainEngine(cfg(), tiny_model(family), parallel_dims=dims)
    data = batches(moe)
    logp, entropy = engine.forward_logprobs(data[0], options=ForwardOptions(with_entropy=True))
    loss = PolicyLoss(data[0], MODE)
    normalizer = loss_normalizer(data[0].response_mask(), MODE)
    engine.forward_backward(
        data[0],
        loss,
        loss_normalizer=normalizer,
        options=ForwardOptions(with_entropy=True, routing_replay=moe),
    )
    grads = full_grads(engine)
    metrics = [step(engine, b, moe) for b in data[:2]]
    keys = ("train/loss", "train/grad_norm", "train/tokens", "train/response_tokens", "loss/ratio_high_frac")
    out = {
        "logp": logp,
        "entropy": entropy,
        "grads": grads,
        "metrics": [{k: m[k] for k in m if k in keys or k.startswith("moe/")} for m in metrics],
        "weights": full_weights(engine),
    }
    # A bf16 export casts each shard before gathering it: the same bits as casting the full tensor.
    bf16 = {name: t.clone() for bucket in engine.named_weights(dtype=torch.bfloat16) for name, t in bucket}
    assert bf16.keys() == out["weights"].keys()
    for name, weight in out["weights"].items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], weight.to(torch.bfloat16)), name
    return engine, out


def compare(got: dict, expected: dict, what: str) -> None:
    torch.testing.assert_close(got["logp"], expected["logp"], **TOL, msg=f"{what} logp")
    torch.testing.assert_close(got["entropy"], expected["entropy"], **TOL, msg=f"{what} entropy")
    assert got["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, **TOL, msg=f"{what} grad {name}")
    for i, (a, b) in enumerate(zip(got["metrics"], expected["metrics"])):
        for k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (what, i, k, a[k], b[k])
    compare_weights(got["weights"], expected["weights"], what)


def compare_weights(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        torch.testing.assert_close(got[name], t, **WEIGHT_TOL, msg=f"{what} weight {name}")


def continue_from(engine: NativeTrainEngine, path: str, moe: bool) -> dict[str, torch.Tensor]:
    engine.load(path)
    assert engine.version == 2
    step(engine, batches(moe)[2], moe)
    return full_weights(engine)


def worker(rank: int, expected: dict, tmp: str) -> None:
    torch.manual_seed(0)
    layouts = [
        ("qwen3", dict(tp=2)),
        ("qwen3_moe", dict(tp=2)),
        ("qwen3_moe", dict(ep=2)),
        ("qwen3_moe", dict(tp=2, ep=2)),
    ]
    for family, degrees in layouts:
        engine, got = run_layout(family, ParallelDims(world_size=2, **degrees))
        what = f"{family} {degrees}"
        compare(got, expected[family], what)
        layouts = engine.weight_layouts()  # where each HF tensor lives, for an owner-only reshard
        assert layouts.keys() == got["weights"].keys()
        if "ep" in degrees:
            owners = {(w.expert, w.ep_rank) for w in layouts.values() if w.expert is not None}
            assert owners == {(e, e // 2) for e in range(4)}, owners
        if "tp" in degrees:
            assert len(layouts["model.layers.0.self_attn.q_proj.weight"].placements) == 2  # (fsdp, tp)
        if (family, degrees) in (("qwen3", dict(tp=2)), ("qwen3_moe", dict(ep=2))):
            engine.save(os.path.join(tmp, f"{family}_{next(iter(degrees))}"))
    # The frozen reference (build_reference) in the tensor-parallel layout gives the same logprobs.
    ref = NativeTrainEngine(
        cfg(), tiny_model("qwen3"), parallel_dims=ParallelDims(world_size=2, tp=2), frozen=True
    )
    torch.testing.assert_close(ref.forward_logprobs(batches(False)[0])[0], expected["qwen3"]["logp"], **TOL)
    # dp=2 -> tp=2: an FSDP checkpoint resumes in the tensor-parallel layout.
    engine, _ = run_layout("qwen3", ParallelDims(world_size=2))
    engine.save(os.path.join(tmp, "qwen3_dp"))
    resumed = NativeTrainEngine(cfg(), tiny_model("qwen3"), parallel_dims=ParallelDims(world_size=2, tp=2))
    compare_weights(
        continue_from(resumed, os.path.join(tmp, "qwen3_dp"), False), expected["qwen3"]["step3"], "dp->tp"
    )


def test_tp_and_ep_engine_equal_one_process_and_checkpoints_cross_layouts(tmp_path):
    expected = {}
    for family in ("qwen3", "qwen3_moe"):
        engine, out = run_layout(family, None)
        assert not engine.sharded
        step(engine, batches(family.endswith("moe"))[2], family.endswith("moe"))
        out["step3"] = full_weights(engine)
        expected[family] = out
    run_gloo(worker, 2, expected, str(tmp_path))
    # tp=2 -> one process and ep=2 -> one process: step 3 after the resume gives the same weights.
    for family, saved in (("qwen3", "qwen3_tp"), ("qwen3_moe", "qwen3_moe_ep")):
        single = NativeTrainEngine(cfg(), tiny_model(family))
        weights = continue_from(single, str(tmp_path / saved), family.endswith("moe"))
        compare_weights(weights, expected[family]["step3"], f"{saved} -> one process")


def worker_4(rank: int, expected: dict, tmp: str) -> None:
    # tp=2 x dp=2: 2-D (fsdp, tp) parameters, micro-batches per dp rank shared by its TP ranks.
    # ep=2 x dp=4: experts FSDP-sharded over the 2 ranks that hold the same experts (efsdp=2).
    for degrees in (dict(tp=2), dict(ep=2)):
        engine, got = run_layout("qwen3_moe", ParallelDims(world_size=4, **degrees))
        compare(got, expected, f"qwen3_moe world 4 {degrees}")
        if degrees == dict(tp=2):
            engine.save(os.path.join(tmp, "tp2_dp2"))
    # dp=4 -> tp=2 x dp=2
    engine, _ = run_layout("qwen3_moe", ParallelDims(world_size=4))
    engine.save(os.path.join(tmp, "dp4"))
    resumed = NativeTrainEngine(
        cfg(), tiny_model("qwen3_moe"), parallel_dims=ParallelDims(world_size=4, tp=2)
    )
    compare_weights(
        continue_from(resumed, os.path.join(tmp, "dp4"), True), expected["step3"], "dp4->tp2 x dp2"
    )


@pytest.mark.slow
def test_four_processes_tp_x_dp_and_ep_x_dp_equal_one_process(tmp_path):
    engine, expected = run_layout("qwen3_moe", None)
    step(engine, batches(True)[2], True)
    expected["step3"] = full_weights(engine)
    run_gloo(worker_4, 4, expected, str(tmp_path))
    # tp=2 x dp=2 -> one process
    single = NativeTrainEngine(cfg(), tiny_model("qwen3_moe"))
    compare_weights(
        continue_from(single, str(tmp_path / "tp2_dp2"), True), expected["step3"], "tp2 x dp2 -> 1"
    )
