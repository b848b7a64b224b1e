"""`rlloom plan` on a vision-language model folder: the vision tower's parameters equal the real
model's, its activations for the image processor's largest pictures equal what the tower saves for
backward (within 15%) and raise the first stage's peak, and the layout is data parallel only, where
the tower lives (the first stage's root unit), as `rlloom train` requires."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import rlloom.models as models
from rlloom.cli import main
from rlloom.models.tiny import write_tiny_model
from rlloom.plan.counts import model_costs
from rlloom.plan.inputs import Hardware, Layout, Workload
from rlloom.plan.memory import estimate


@pytest.fixture(scope="module", params=["tiny-vl", "tiny-vl3"])
def folder(request, tmp_path_factory):
    return write_tiny_model(request.param, tmp_path_factory.mktemp(request.param), hidden=64)


def test_plan_counts_the_tower_and_lays_it_out_data_parallel(folder, capsys):
    from transformers import AutoConfig, AutoModelForImageTextToText

    code = main(
        ["plan", str(folder), "--gpus", "4", "--gpu-memory-gb", "80", "--images-per-gpu", "3", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    hf = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder))
    tower = sum(p.numel() for name, p in hf.named_parameters() if ".visual." in f".{name}")
    assert out["vision_tower"]["params"] == tower > 0
    assert out["model"]["params"] == sum(p.numel() for p in hf.parameters())
    assert {k: out["layout"][k] for k in ("tp", "pp", "cp", "ep", "dp")} == dict(tp=1, pp=1, cp=1, ep=1, dp=4)
    assert all(a["layout"].startswith("tp=1 pp=1 cp=1 ep=1 dp=4") for a in out["alternatives"])
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    patch = hf.config.vision_config.patch_size
    assert out["vision_tower"]["patches_per_gpu"] == 3 * (processor["size"]["longest_edge"] // patch**2)
    assert "first pipeline stage" in out["vision_tower"]["placement"]

    code = main(["plan", str(folder), "--gpus", "4", "--gpu-memory-gb", "80", "--check", "tp=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "data parallel only" in err


def test_tower_activations_are_what_it_saves_and_raise_the_first_stage(folder):
    from PIL import Image
    from transformers import AutoImageProcessor

    model = models.from_pretrained(folder)
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 255, (112, 112, 3), dtype=np.uint8))
    pixels = AutoImageProcessor.from_pretrained(folder)(images=[picture], return_tensors="pt")
    weights = {p.data_ptr() for p in model.parameters()}
    saved: set[tuple[int, int]] = set()

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in weights:
            saved.add((t.data_ptr(), t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model.visual(pixels["pixel_values"], pixels["image_grid_thw"])
    measured = sum(n for _, n in saved) / pixels["pixel_values"].shape[0]
    costs = model_costs(model.args)
    assert abs(costs.tower_act_per_patch / measured - 1) < 0.15, (costs.tower_act_per_patch, measured)

    hw, layout = Hardware(gpus=1, gpu_memory_gb=80), Layout()
    work = Workload(max_tokens_per_gpu=1024)
    pictures = replace(work, image_patches_per_gpu=1_000_000)
    grown = (
        estimate(costs, layout, hw, pictures).gpu_memory_gb - estimate(costs, layout, hw, work).gpu_memory_gb
    )
    expected = work.compute_bytes * 1_000_000 * costs.tower_act_per_patch / 2**30
    assert abs(grown / expected - 1) < 0.05, (grown, expected)
