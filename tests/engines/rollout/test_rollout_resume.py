"""`NativeEngine.resume_request`: a sample aborted mid-response and resumed from its tokens (the KV
cache rebuilt by a prefill) continues exactly as if it had never stopped, and after a weight update
it continues under the new weights with the new version."""

from __future__ import annotations

import pytest
import torch
from rollout_testutil import save, tiny_dense

import rlloom.models as models
from rlloom.engines.rollout.native import NativeEngine, SamplingParams
from rlloom.models.adapter import hf_named_tensors

PROMPTS = [[5, 6, 7, 8, 9], [11, 3]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=14, seed=3)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save(tiny_dense(seed=0), tmp_path_factory.mktemp("dense"))


def _engine(path) -> NativeEngine:
    return NativeEngine(
        models.from_pretrained(path, fused_projections=True), max_model_len=64, num_blocks=64, block_size=4
    )


def _abort_after(engine: NativeEngine, steps: int) -> list:
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, PARAMS, request_id=str(i), prompt_index=i)
    done = []
    for _ in range(steps):
        done += engine.step()
    engine.abort([str(i) for i in range(len(PROMPTS))])
    return done + engine.step()


def _resume_all(engine: NativeEngine, aborted: list) -> list:
    out = [c for c in aborted if c.finish_reason != "abort"]
    for c in aborted:
        if c.finish_reason == "abort":
            engine.resume_request(
                PROMPTS[c.prompt_index], PARAMS, output_ids=c.token_ids, logprobs=c.logprobs,
                request_id=c.request_id, prompt_index=c.prompt_index, sample_index=c.sample_index,
            )  # fmt: skip
    while engine.has_unfinished():
        out += engine.step()
    return sorted(out, key=lambda c: (c.prompt_index, c.sample_index))


def test_resumed_samples_equal_uninterrupted_ones(path):
    straight = _engine(path).generate(PROMPTS, PARAMS)
    engine = _engine(path)
    aborted = _abort_after(engine, 6)
    assert any(c.finish_reason == "abort" and c.token_ids for c in aborted)
    resumed = _resume_all(engine, aborted)
    assert [c.token_ids for c in resumed] == [c.token_ids for c in straight]
    for a, b in zip(resumed, straight):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_resume_after_a_weight_update_continues_under_the_new_weights(path, tmp_path):
    engine = _engine(path)
    aborted = [c for c in _abort_after(engine, 6) if c.finish_reason == "abort" and c.token_ids]
    other = models.from_pretrained(save(tiny_dense(seed=1), tmp_path), fused_projections=True)
    engine.update_weights(hf_named_tensors(other), version=7)
    resumed = {(c.prompt_index, c.sample_index): c for c in _resume_all(engine, aborted)}
    for before in aborted:
        after = resumed[(before.prompt_index, before.sample_index)]
        k = len(before.token_ids)
        assert after.policy_version == 7 and after.token_ids[:k] == before.token_ids
        assert after.logprobs[:k] == before.logprobs  # the old policy's logprobs are kept
        # the new tokens' logprobs are the new weights' (log_softmax of their logits at T=1)
        ids = torch.tensor([PROMPTS[before.prompt_index] + after.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(other(ids).float(), -1)[0]
        P = len(PROMPTS[before.prompt_index])
        new = [logp[P - 1 + t, after.token_ids[t]].item() for t in range(k, len(after.token_ids))]
        torch.testing.assert_close(torch.tensor(after.logprobs[k:]), torch.tensor(new), atol=1e-5, rtol=0)
