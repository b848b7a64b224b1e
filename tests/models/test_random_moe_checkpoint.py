"""The benchmarks' cheap random MoE checkpoint (benchmarks/bench_moe.py write_random_checkpoint, which
bench_start --moe runs on) is a real Hugging Face checkpoint: the same tensor names, shapes and dtype as
transformers' own save_pretrained writes, loadable by transformers and by rlloom's loader, with lively
(non-constant) weights and norm weights of 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from bench_moe import TINY, hf_model, write_random_checkpoint  # noqa: E402

from rlloom.models.checkpoint import from_pretrained  # noqa: E402


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_random_moe_checkpoint_matches_transformers_layout(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    mine = write_random_checkpoint(tmp_path / "mine", TINY)
    hf_model(TINY, torch.device("cpu"), torch.bfloat16).save_pretrained(tmp_path / "ref")
    ours, ref = tensors(mine), tensors(tmp_path / "ref")
    assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {k: (v.shape, v.dtype) for k, v in ref.items()}
    assert any(".mlp.experts.7.down_proj." in k for k in ours)  # one tensor per expert, as on the Hub
    for name, t in ours.items():
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        else:
            assert 0.015 < t.float().std().item() < 0.025, name
    assert json.loads((mine / "config.json").read_text())["dtype"] == "bfloat16"

    loaded, info = AutoModelForCausalLM.from_pretrained(mine, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    native = from_pretrained(mine, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        expected = loaded.float()(ids).logits
        actual = native(ids)
    assert expected.abs().max() > 0.1  # lively weights: the comparison can fail
    torch.testing.assert_close(actual, expected, atol=2e-4, rtol=1e-3)
