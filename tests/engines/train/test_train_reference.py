"""`build_reference`: a forward-only reference policy (no gradients, no optimizer, no fp32 master copy
held apart), giving the policy engine's logprobs; and the layout `build_train_engine` asks for."""

from __future__ import annotations

import pytest
import torch
from train_engine_helpers import make_batch

from rlloom.config import load_config
from rlloom.engines.train.build import build_reference, build_train_engine, parallel_dims


def test_reference_is_forward_only_and_matches_the_policy(tiny_checkpoint):
    cfg = load_config(
        "arithmetic_smoke",
        [f"model.path={tiny_checkpoint}", "train.optimizer_offload=true", "algorithm.kl_coef=0.1"],
    )
    cpu = torch.device("cpu")
    policy = build_train_engine(cfg, device=cpu, dtype=torch.float32)
    ref = build_reference(cfg, device=cpu, dtype=torch.float32)
    assert not any(p.requires_grad for p in ref.module.parameters())
    assert (
        ref._optimizer is None
    )  # with optimizer_offload the policy pins an fp32 CPU copy; the reference none
    batch = make_batch(6, seed=3, max_prompt=6, max_response=8)
    torch.testing.assert_close(
        ref.forward_logprobs(batch)[0], policy.forward_logprobs(batch)[0], atol=0, rtol=0
    )
    with pytest.raises(ValueError, match="frozen reference .* Fix: train and save the policy engine"):
        ref.save("unused")


def test_layout_comes_from_the_parallel_section(tiny_checkpoint):
    def dims(*overrides):
        return parallel_dims(load_config("arithmetic_smoke", [f"model.path={tiny_checkpoint}", *overrides]))

    assert dims() is None  # one process, no degree: the unsharded engine
    ray = ("cluster.mode=ray", "cluster.num_workers=4")
    assert dims(*ray).degrees() == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1, "ep": 1}
    layout = dims(*ray, "parallel.tp=2")
    assert (layout.tp, layout.dp_shard, layout.world_size) == (2, 2, 4)
