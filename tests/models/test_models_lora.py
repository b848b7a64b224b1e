"""LoRA adapters (rlloom/models/lora.py): which projections get them, the adapted forward against a
plain linear of the merged weight, and the merged state the weight sync and export read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from parallel_helpers import tiny_model  # noqa: E402

from rlloom.models.lora import LoRALinear, apply_lora, merged_state  # noqa: E402


def adapted(model) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, LoRALinear))


@pytest.mark.parametrize(
    "family, targets, per_layer",
    [
        (
            "qwen3",
            "all-linear",
            {
                "attention.wq",
                "attention.wk",
                "attention.wv",
                "attention.wo",
                "feed_forward.w1",
                "feed_forward.w2",
                "feed_forward.w3",
            },
        ),  # fmt: skip
        ("qwen3", "q_proj, v_proj", {"attention.wq", "attention.wv"}),
        (
            "deepseek_v3",
            "q_a_proj,kv_b_proj,down_proj",
            {"attention.wq_a", "attention.wkv_b", "feed_forward.w2"},
        ),
    ],
)
def test_the_targeted_projections_get_adapters_and_nothing_else_trains(family, targets, per_layer):
    model = tiny_model(family)
    count = apply_lora(model, rank=2, alpha=4.0, targets=targets)
    names = adapted(model)
    assert count == len(names)
    assert {n.split(".", 2)[2] for n in names if n.startswith("layers.0.")} == per_layer
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {f"{n}.lora_{x}" for n in names for x in "AB"}
    if family == "deepseek_v3":  # the MoE layer: its shared expert's down_proj, not the routed experts
        assert "layers.1.moe.shared_experts.w2" in names
        assert not any(".moe.experts" in n or ".router" in n for n in names)


def test_the_adapted_forward_is_the_merged_linear_and_starts_as_the_base():
    model = tiny_model("qwen2")  # q/k/v biases
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    wq = model.layers[0].attention.wq
    before = wq(x).detach()
    apply_lora(model, rank=3, alpha=6.0)
    assert torch.equal(wq(x), before)  # B starts at zero
    with torch.no_grad():
        wq.lora_B.normal_()
    merged = wq.weight + 2.0 * wq.lora_B @ wq.lora_A
    torch.testing.assert_close(wq(x), F.linear(x, merged, wq.bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wq.merged_weight(), merged.detach())
    state = dict(merged_state(model.state_dict(), model))
    assert state.keys() == {k for k in model.state_dict() if not k.endswith(("lora_A", "lora_B"))}
    torch.testing.assert_close(state["layers.0.attention.wq.weight"], merged.detach())
    assert torch.equal(state["layers.0.attention.wq.bias"], wq.bias)


def test_targets_the_model_lacks_are_a_config_error():
    from rlloom.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.lora_target_modules='q_a_proj' is invalid: it matches no"):
        apply_lora(tiny_model("qwen3"), rank=2, alpha=4.0, targets="q_a_proj")  # an MLA projection
