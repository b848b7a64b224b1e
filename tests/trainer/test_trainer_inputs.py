"""Run settings the trainer must honour: rollout.ignore_eos generates to max_new_tokens in training;
a KV cache larger than free memory is refused before it is allocated."""

from __future__ import annotations

import pytest

from rlloom.config import ConfigError, load_config
from rlloom.engines.rollout.native import NativeEngine
from rlloom.trainer.run import run
from rlloom.workers.rollout import RolloutWorker


def test_ignore_eos_generates_every_training_sample_to_max_new_tokens(tiny_checkpoint, tmp_path, monkeypatch):
    calls = []
    generate = RolloutWorker.generate

    def spy(self, prompts, sampling):
        completions = generate(self, prompts, sampling)
        calls.append((sampling, completions))
        return completions

    monkeypatch.setattr(RolloutWorker, "generate", spy)
    max_new = 20  # the random tiny model emits EOS (1 of ~100 tokens) in some of 16 x 20 draws
    cfg = load_config(
        "arithmetic_smoke",
        [
            f"model.path={tiny_checkpoint}",
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.total_steps=1",
            "data.num_eval=0",
            "data.num_train=16",
            f"rollout.max_new_tokens={max_new}",
            "rollout.ignore_eos=true",
            "rollout.num_blocks=64",
            "logging.console=false",
        ],
    )
    run(cfg)
    train = [(s, c) for s, c in calls if s[0].n == cfg.rollout.n_samples]
    assert train, "no training generation was seen"
    for sampling, completions in train:
        assert all(sp.ignore_eos and not sp.stop_token_ids for sp in sampling)
        assert [len(c.token_ids) for c in completions] == [max_new] * len(completions)


def test_engine_refuses_a_kv_cache_larger_than_free_memory(tiny_checkpoint):
    # The start-up check catches this before loading; the engine checks again right before allocating.
    with pytest.raises(ConfigError, match=r"rollout.num_blocks=1000000000 is invalid: .* GiB free"):
        NativeEngine.from_pretrained(tiny_checkpoint, num_blocks=10**9, max_model_len=64)
