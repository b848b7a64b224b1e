"""The MoE auxiliary loss of a pipeline stage on the GPU with per-layer torch.compile (and activation
checkpointing): the router-score hook inside the compiled layers still hands the stage the scores
with their graph, so the stage's output carries the aux loss's gradient (router gradients and
moe/aux_loss's sum as the eager stage's; the CPU gloo tests check the eager stage against one process). One process: the stage is both first and last. Skipped without a GPU."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))


def stage_grads(ac: str, compiled: bool, device: str = "cuda") -> tuple[dict[str, torch.Tensor], float]:
    """Router gradients of one padded micro-batch's zero policy loss plus the aux loss (coef 1),
    and the aux metric's sum."""
    from parallel_helpers import tiny_args

    from rlloom.data.types import RolloutBatch, Sample
    from rlloom.engines.train.native.pipeline import PipeBatch
    from rlloom.models.model import CausalLM
    from rlloom.parallel.ac import apply_ac
    from rlloom.parallel.compile import apply_compile
    from rlloom.parallel.pp_batches import pad_to_budget
    from rlloom.parallel.pp_stages import PipelineStageModule, StageModel

    args = tiny_args("mixtral")  # every layer MoE
    torch.manual_seed(0)
    model = CausalLM(dataclasses.replace(args, num_layers=2)).to(device)
    stage = PipelineStageModule(
        StageModel(model, range(2), is_first=True, is_last=True),
        is_first=True,
        is_last=True,
        chunk_tokens=1024,
        fused_head=False,
    ).to(device)
    apply_ac(stage.model, ac)
    if compiled:
        apply_compile(stage.model)
    gen = torch.Generator().manual_seed(1)
    batch = RolloutBatch(
        [
            Sample(
                prompt_ids=torch.randint(0, 64, (5 + 3 * i,), generator=gen).tolist(),
                response_ids=torch.randint(0, 64, (4 + 2 * i,), generator=gen).tolist(),
            )
            for i in range(3)
        ]
    )
    pb = PipeBatch.of(batch, [[0, 1, 2]], share_prompts=False, replay_routes=False)
    padded = pad_to_budget(pb.micro_batches[0], 96, torch.device(device))
    n = pb.num_tokens[0]
    feed = stage.feed
    feed.micro_batches = [padded]
    feed.aux_loss_sum = torch.zeros((), device=device)
    feed.aux_token_weight, feed.aux_loss_coef = 1.0 / (2 * n), 1.0
    out_12P = stage(padded.input_ids_1P, mb=0)
    (out_12P.sum() * 0.0).backward()
    grads = {k: layer.moe.router.gate.weight.grad.clone() for k, layer in stage.model.layers.items()}
    return grads, float(feed.aux_loss_sum)


@pytest.mark.parametrize("ac", ["off", "full"])
def test_stage_aux_loss_under_compile_matches_eager(ac):
    eager, eager_aux = stage_grads("off", compiled=False)
    assert eager_aux > 0.5
    got, got_aux = stage_grads(ac, compiled=True)
    assert got_aux == pytest.approx(eager_aux, rel=1e-4)
    for k, g in eager.items():
        assert g.abs().sum() > 0
        torch.testing.assert_close(got[k], g, atol=1e-5, rtol=1e-3)
