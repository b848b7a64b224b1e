"""The rollout engine on DeepSeek-V3's multi-head latent attention: it caches the compressed latent
(one head of kv_lora_rank + qk_rope_head_dim per token and layer, the values a view of its first
kv_lora_rank channels) and attends with the up-projections absorbed; tokens and logprobs equal
transformers' greedy decode and the training form's full forward (expanded keys and values)."""

from __future__ import annotations

import pytest
import torch
from rollout_testutil import full_forward_logprobs, hf_greedy, prompts, save, tiny_deepseek

import rlloom.models as models
from rlloom.engines.rollout.native import NativeEngine, SamplingParams
from rlloom.engines.rollout.native.model_runner import kv_bytes_per_block


@pytest.fixture(scope="module", params=[16, None], ids=["q_lora", "no_q_lora"])
def deepseek(request, tmp_path_factory):
    hf = tiny_deepseek(seed=3, q_lora_rank=request.param)
    return hf, save(hf, tmp_path_factory.mktemp("deepseek"))


def _engine(path: str, **kwargs) -> NativeEngine:
    kwargs = {"max_model_len": 64, "num_blocks": 256, "block_size": 4, "seed": 0} | kwargs
    return NativeEngine(models.from_pretrained(path, fused_projections=True), **kwargs)


def test_the_cache_holds_the_latent_only(deepseek):
    engine = _engine(deepseek[1])
    backend = engine.runner.backend
    m = engine.model.args.mla
    assert backend.k_cache.shape[2:] == (1, m.kv_lora_rank + m.qk_rope_head_dim)
    assert backend.v_cache.shape[2:] == (1, m.kv_lora_rank)
    assert backend.v_cache.data_ptr() == backend.k_cache.data_ptr()  # values are the keys' first channels
    assert backend.caches() == [backend.k_cache]
    per_token = engine.model.args.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 4  # fp32
    assert kv_bytes_per_block(engine.model.args, 4, torch.float32) == 4 * per_token


def test_greedy_matches_transformers_and_the_expanded_forward(deepseek):
    hf, path = deepseek
    engine = _engine(path)
    batch = prompts(12, max_len=20, seed=3)
    out = engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=8))
    for prompt, c, ref in zip(batch, out, hf_greedy(hf, batch, 8)):
        assert c.token_ids == ref, (prompt, c)
        expected = full_forward_logprobs(engine.model, prompt, c.token_ids, 0.0)
        assert max(abs(p - q) for p, q in zip(c.logprobs, expected)) <= 1e-5


def test_sampling_with_shared_prefixes_and_preemption(deepseek):
    """n = 3 samples share their prompt's latent blocks; with 24 blocks sequences are preempted and
    recomputed; the completions and logprobs stay those of a roomy cache and of a full forward."""
    path = deepseek[1]
    batch = prompts(6, max_len=16, seed=8)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=11)
    roomy = _engine(path).generate(batch, params)
    tight_engine = _engine(path, num_blocks=24)
    tight = tight_engine.generate(batch, params)
    assert [(c.prompt_index, c.sample_index, c.token_ids) for c in roomy] == [
        (c.prompt_index, c.sample_index, c.token_ids) for c in tight
    ]
    assert tight_engine.num_preemptions > 0
    for c in tight:
        expected = full_forward_logprobs(tight_engine.model, batch[c.prompt_index], c.token_ids, 1.0)
        assert max(abs(p - q) for p, q in zip(c.logprobs, expected)) <= 1e-5
