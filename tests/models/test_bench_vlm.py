"""benchmarks/bench_vlm.py's pieces on its tiny config (the `--tiny` smoke mode): the random native
model equals transformers' (the live model's parameter names mapped to the checkpoint's), and the
rollout and training measurements run."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from bench_vlm import TINY, bench_rollout, bench_train, image_prompts, random_models  # noqa: E402

from rlloom.models.mrope import mrope_positions  # noqa: E402


def test_bench_vlm_tiny_mode_runs_on_the_same_weights_as_transformers() -> None:
    torch.manual_seed(0)
    native, hf = random_models(TINY, torch.device("cpu"), torch.float32)
    prompts, images = image_prompts(TINY, 2, 56)
    ids, im = torch.tensor(prompts[0]), images[0]
    with torch.no_grad():
        ref = hf(input_ids=ids[None], pixel_values=im.pixel_values, image_grid_thw=im.grid_thw,
                 mm_token_type_ids=(ids == TINY["image_token_id"]).int()[None]).logits[0]  # fmt: skip
        positions = mrope_positions(prompts[0], im.grid_thw.tolist(), native.args.vision)
        got = native(ids, position_ids=positions, pixel_values=im.pixel_values, image_grid_thw=im.grid_thw)
    assert (got - ref).abs().max() < 1e-4
    device = torch.device("cpu")
    first, steady = bench_rollout(native, prompts, images, n=2, new=2, device=device)
    assert first["tokens"] == steady["tokens"] == 2 * 2 * 2
    train = bench_train(native, prompts, images, new=3, device=device, repeats=1)
    assert train["tokens"] == sum(len(p) + 3 for p in prompts) and 0 < train["mfu"] < 1


def test_bench_train_vl_tiny_mode_times_a_step_on_pictures() -> None:
    """`bench_train.py --tiny --vl` (the smoke mode of the VL GRPO step the integrator times on a GPU)
    packs picture prompts, runs the engine's step and prints the table; its GPU shape is Qwen2.5-VL-3B's
    (the published parameter count)."""
    import subprocess

    from bench_vlm import QWEN2_5_VL_3B

    from rlloom.models.args import ModelArgs
    from rlloom.plan.counts import model_costs

    assert model_costs(ModelArgs.from_hf_config(QWEN2_5_VL_3B)).total_params == 3_754_622_976
    script = Path(__file__).parents[2] / "benchmarks" / "bench_train.py"
    out = subprocess.run(
        [sys.executable, str(script), "--tiny", "--vl", "--steps", "1", "--micro-batches", "1", "--eager"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout  # fmt: skip
    assert "model tiny VL" in out and " pictures (" in out
    assert "bound s" in out and "train_step (fwd+bwd+opt)" in out and "forward_logprobs" in out
