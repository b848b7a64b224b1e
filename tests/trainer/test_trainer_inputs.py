"""Run settings the trainer must honour: rollout.ignore_eos generates to max_new_tokens in training;
a KV cache larger than free memory is refused before it is allocated."""

from __future__ import annotations

import pytest

from rlloom.config import ConfigError, load_config
from rlloom.engines.rollout.native import NativeEngine
from rlloom.trainer.run import run
from rlloom.workers.stream import EngineStream


def test_ignore_eos_generates_every_training_sample_to_max_new_tokens(tiny_checkpoint, tmp_path, monkeypatch):
    added, finished = [], []
    add, poll = EngineStream.add, EngineStream.poll

    def spy_add(self, requests):
        added.extend(requests)
        return add(self, requests)

    def spy_poll(self, timeout_s):
        out = poll(self, timeout_s)
        finished.extend(out)
        return out

    monkeypatch.setattr(EngineStream, "add", spy_add)
    monkeypatch.setattr(EngineStream, "poll", spy_poll)
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
    assert added, "no training generation was seen"
    assert all(r.sampling.ignore_eos and not r.sampling.stop_token_ids for r in added)
    assert len(finished) == cfg.trainer.prompts_per_step * cfg.rollout.n_samples
    assert [len(f.completion.token_ids) for f in finished] == [max_new] * len(finished)


def test_engine_refuses_a_kv_cache_larger_than_free_memory(tiny_checkpoint):
    # The start-up check catches this before loading; the engine checks again right before allocating.
    with pytest.raises(ConfigError, match=r"rollout.num_blocks=1000000000 is invalid: .* GiB free"):
        NativeEngine.from_pretrained(tiny_checkpoint, num_blocks=10**9, max_model_len=64)
