"""A run whose updates all overflow stops with a clear error and leaves only finite checkpoints."""

from __future__ import annotations

import json

import torch
from test_trainer_loop import final_weights

from rlloom.cli import main
from rlloom.trainer.checkpoint import checkpoint_dir, complete_checkpoints


def test_every_step_non_finite_stops_with_error_and_saves_only_finite_weights(
    tiny_checkpoint, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    # 1e39 is a finite float but inf in fp32: loss and gradient norm are finite, the new weights are not.
    code = main(
        [
            "train",
            "arithmetic_smoke",
            f"model.path={tiny_checkpoint}",
            f"trainer.run_dir={run_dir}",
            "train.lr=1e39",
            "trainer.total_steps=2",
            "trainer.save_every=1",
            "data.num_eval=0",
            "data.num_train=16",  # not the recipe's 10000 prompts to tokenize
            "rollout.max_new_tokens=5",
            "rollout.num_blocks=64",
            "logging.console=false",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "rlloom: error: every policy update of steps 1-2 was skipped" in err and "Traceback" not in err
    assert "step 1: 100% of its optimizer steps were skipped" in err

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/skipped_step"] == 1.0 and r["policy/version"] == 0.0 for r in records)
    # Only step 1's (finite) checkpoint: the stalled run writes no final one.
    assert complete_checkpoints(run_dir) == [checkpoint_dir(run_dir, 1)]
    weights = final_weights(run_dir, 1, tmp_path)
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
