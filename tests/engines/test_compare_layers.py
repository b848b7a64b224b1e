"""`rlloom compare-layers` (rlloom/engines/compare_layers.py): the rollout engine's prefill and decode
against the training forward, layer by layer, on the tiny checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from rlloom.cli import main
from rlloom.engines import compare_layers as compare_mod
from rlloom.engines.rollout.native.engine import NativeEngine


def test_compare_layers_prints_every_layer(tiny_moe_checkpoint, capsys):
    code = main(["compare-layers", str(tiny_moe_checkpoint), "--prompt", "12+7=", "--max-new-tokens", "6"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split("  ")[0].strip() for line in lines[1:-1]]
    assert names == ["embedding", "layer 0", "layer 1", "final norm", "logprobs"]
    gaps = {n: [float(x) for x in line.split()[-2:]] for n, line in zip(names, lines[1:-1])}
    assert gaps["embedding"] == [0.0, 0.0]  # the same weights: the rollout got the checkpoint's
    assert gaps["logprobs"][1] < 1e-5 and math.isnan(gaps["logprobs"][0])
    assert lines[-1].startswith(("first difference: ", "rollout and training agree"))


@pytest.mark.parametrize("where", ["tok_embeddings", "layers.1.attention_norm"])
def test_the_first_difference_is_where_the_rollout_changed(tiny_checkpoint, monkeypatch, where):
    """A rollout whose weights differ in one place (as a broken sync would leave them) shows a large
    gap from there on and none before it."""
    real = NativeEngine.from_pretrained

    def perturbed(*args, **kwargs):
        engine = real(*args, **kwargs)
        with torch.no_grad():
            engine.model.get_parameter(f"{where}.weight").mul_(1.5)
        return engine

    monkeypatch.setattr(NativeEngine, "from_pretrained", perturbed)
    report = compare_mod.compare_layers(str(tiny_checkpoint), [5, 9, 12, 7, 20], max_new_tokens=4)
    gaps = {g.name: max(g.prefill, g.decode) for g in report.gaps}
    first = "embedding" if where == "tok_embeddings" else "layer 1"
    names = [g.name for g in report.gaps]
    assert gaps[first] > 1e-3 and all(gaps[n] < 1e-5 for n in names[: names.index(first)])
    # Exactly: the CPU's fused rollout projections already round differently in layer 0 (~1e-9)
    assert report.first_difference == ("embedding" if first == "embedding" else "layer 0")


def test_exact_numerics_agree_at_every_layer(tiny_checkpoint, capsys):
    """rollout.match_training's numerics (models/exact.py) on both sides: nothing differs anywhere."""
    args = ["compare-layers", str(tiny_checkpoint), "--prompt", "12+7=", "--max-new-tokens", "6", "--exact"]
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "rollout and training agree bit for bit at every layer"
