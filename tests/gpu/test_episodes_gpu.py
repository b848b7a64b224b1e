"""Multi-turn on a GPU: a next turn whose history comes from the prefix cache (the paged prefill over
cached blocks, CUDA graphs for the decode) samples what a recomputed one does, and a multi-turn run
through `rlloom train` keeps its bookkeeping exact. Skipped without a GPU."""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, str(Path(__file__).parents[1]))


def test_prefix_cached_turns_sample_what_recomputed_ones_do_on_cuda(tmp_path):
    from rlloom.engines.rollout.base import SamplingParams
    from rlloom.engines.rollout.native.engine import NativeEngine
    from tests.conftest import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", hidden=128, layers=2)
    engines = [
        NativeEngine.from_pretrained(
            ckpt,
            device="cuda",
            num_blocks=256,
            block_size=16,
            max_model_len=512,
            seed=0,
            enable_prefix_caching=caching,
        )  # fmt: skip
        for caching in (True, False)
    ]
    prompt = [3 + (7 * i) % 90 for i in range(70)]
    first = SamplingParams(n=4, temperature=1.0, max_new_tokens=40, seed=5)
    a, b = (e.generate([prompt], [first]) for e in engines)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    turns = [prompt + c.token_ids + [40, 41, 42] for c in a]
    later = [SamplingParams(temperature=1.0, max_new_tokens=30, seed=9 + j) for j in range(4)]
    a2, b2 = (e.generate(turns, later) for e in engines)
    # every turn found its history: the full blocks of the tokens its first turn fed to the model
    assert engines[0].block_manager.num_cached_hits == sum(
        16 * ((len(prompt) + len(c.token_ids) - 1) // 16) for c in a
    )
    assert [c.token_ids for c in a2] == [c.token_ids for c in b2]
    gap = max(abs(x - y) for ca, cb in zip(a2, b2) for x, y in zip(ca.logprobs, cb.logprobs))
    assert gap < 1e-3, gap


def test_a_multi_turn_run_on_cuda_is_exact(tmp_path):
    from rlloom.cli import main
    from tests.conftest import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    run = tmp_path / "run"
    stop = "rollout.stop_strings=" + json.dumps(list(string.ascii_letters + string.digits))
    args = [f"model.path={ckpt}", f"trainer.run_dir={run}", "data.num_train=64", "data.num_eval=0",
            "rollout.max_new_tokens=8", "logging.console=false", "trainer.save_hf_every=-1", "trainer.total_steps=2",
            "model.dtype=float32", f"reward.import_dir={Path(__file__).parents[1] / 'episodes'}",
            "rollout.env=episode_envs:Turns", stop, "trainer.num_mini_batches=2"]  # fmt: skip
    assert main(["train", "arithmetic_smoke", *args]) == 0
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for m in steps:
        assert m["rollout/turns_mean"] == 3.0
        assert abs(m["rollout/token_mult_prob_error"] - 1.0) < 1e-3
