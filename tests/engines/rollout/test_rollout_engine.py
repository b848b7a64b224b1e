"""NativeEngine on tiny random Qwen3 (dense and MoE) checkpoints: parity with transformers, logprob
contract, invariance to prefix sharing and preemption, seeds, weight updates, rejection and abort."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rollout_testutil import VOCAB, full_forward_logprobs, hf_greedy, prompts, save, tiny_dense, tiny_moe

import rlloom.models as models
from rlloom.engines.rollout.native import NativeEngine, SamplingParams
from rlloom.engines.rollout.native.cuda_graphs import DecodeGraphs
from rlloom.engines.rollout.native.sequence import Sequence

BLOCK = 4


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    hf = tiny_dense(seed=0)
    return hf, save(hf, tmp_path_factory.mktemp("dense"))


def _engine(path: str, **kwargs) -> NativeEngine:
    kwargs = {"max_model_len": 64, "num_blocks": 256, "block_size": BLOCK, "seed": 0} | kwargs
    return NativeEngine(models.from_pretrained(path, fused_projections=True), **kwargs)


def _assert_same(a, b, atol=1e-5):
    assert [(c.prompt_index, c.sample_index, c.token_ids, c.finish_reason) for c in a] == [
        (c.prompt_index, c.sample_index, c.token_ids, c.finish_reason) for c in b
    ]
    for x, y in zip(a, b):
        assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0.0) <= atol


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_matches_transformers(kind, dense, tmp_path):
    hf, path = dense if kind == "dense" else (lambda m: (m, save(m, tmp_path)))(tiny_moe(seed=1))
    engine = _engine(path)
    batch = prompts(24, max_len=24, seed=3)
    out = engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert len(out) == len(batch)
    for prompt, c, ref in zip(batch, out, hf_greedy(hf, batch, 8)):
        assert c.token_ids == ref, (prompt, c)
        assert c.finish_reason == "length" and c.error is None
        expected = full_forward_logprobs(engine.model, prompt, c.token_ids, 0.0)
        assert max(abs(p - q) for p, q in zip(c.logprobs, expected)) <= 1e-5


def test_sampled_logprobs_match_full_forward(dense):
    engine = _engine(dense[1])
    batch = prompts(6, seed=4)
    for temperature, top_p, top_k in [(0.7, 1.0, -1), (1.3, 0.8, 5)]:
        params = SamplingParams(n=3, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=10)
        out = engine.generate(batch, params)
        assert len(out) == 18
        for c in out:
            expected = full_forward_logprobs(engine.model, batch[c.prompt_index], c.token_ids, temperature)
            assert max(abs(p - q) for p, q in zip(c.logprobs, expected)) <= 1e-5


def test_prefix_sharing_and_preemption_do_not_change_results(dense):
    batch = prompts(8, max_len=18, seed=5)
    # Half greedy, half seeded sampling, in one batch.
    params = [
        SamplingParams(n=4, temperature=float(i % 2), max_new_tokens=10, seed=100 + i) for i in range(8)
    ]
    reference = _engine(dense[1], enable_prefix_sharing=False).generate(batch, params)
    shared = _engine(dense[1]).generate(batch, params)
    _assert_same(shared, reference)
    # 16 blocks of 4 tokens: two sequences of up to 28 tokens (7 blocks) fit, 32 do not -> preemptions.
    tight = _engine(dense[1], num_blocks=16)
    _assert_same(tight.generate(batch, params), reference)
    assert tight.num_preemptions > 0
    small_batches = _engine(dense[1], max_num_seqs=3, enable_prefix_sharing=False)
    _assert_same(small_batches.generate(batch, params), reference)


def test_overlapped_steps_equal_steps_run_one_after_the_other(dense):
    # Frequent stop tokens end sequences at different steps while their next step is in flight;
    # a tight cache adds preemptions of sequences whose token is still pending.
    batch = prompts(8, max_len=18, seed=11)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=3, stop_token_ids=[5, 9, 17])

    def sequential(engine: NativeEngine) -> list:
        for i, prompt in enumerate(batch):
            engine.add_request(prompt, params, request_id=str(i), prompt_index=i)
        out = []
        while engine.has_unfinished():
            out += engine.step()
            engine._drain()  # read this step's tokens before the next one is scheduled
        return sorted(out, key=lambda c: (c.prompt_index, c.sample_index))

    for kwargs in ({}, {"num_blocks": 14}):
        overlapped = _engine(dense[1], **kwargs)
        got = overlapped.generate(batch, params)
        _assert_same(got, sequential(_engine(dense[1], **kwargs)))  # batch sizes differ: fp32 rounding
        assert {c.finish_reason for c in got} == {"stop", "length"}
        assert overlapped.block_manager.num_free_blocks == overlapped.block_manager.num_blocks
    assert overlapped.num_preemptions > 0


def test_seeded_sampling_is_reproducible_and_unseeded_varies(dense):
    engine = _engine(dense[1])
    batch = prompts(4, seed=6)
    seeded = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=7)
    a, b = engine.generate(batch, seeded), engine.generate(batch, seeded)
    _assert_same(a, b, atol=0.0)
    assert len({tuple(c.token_ids) for c in a}) > 1  # the n samples differ from each other
    unseeded = SamplingParams(n=4, temperature=1.0, max_new_tokens=10)
    assert [c.token_ids for c in engine.generate(batch, unseeded)] != [
        c.token_ids for c in engine.generate(batch, unseeded)
    ]


def test_samples_of_one_prompt_share_kv_blocks(dense):
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks + 1 token
    used = {}
    for sharing in (True, False):
        engine = _engine(dense[1], enable_prefix_sharing=sharing)
        engine.add_request(prompt, SamplingParams(n=8, max_new_tokens=4))
        engine.step()  # prefill
        used[sharing] = engine.block_manager.num_used_blocks
        if sharing:
            tables = [s.block_table for s in engine.scheduler.running]
            assert len(tables) == 8 and all(t == tables[0] for t in tables)
            assert all(engine.block_manager.ref_counts[b] == 8 for b in tables[0])
        engine.step()  # first decode: the partial block is copied on write, full blocks stay shared
        if sharing:
            assert engine.block_manager.num_used_blocks == 4 + 8
            assert all(engine.block_manager.ref_counts[b] == 8 for b in tables[0][:4])
    assert used == {True: 5, False: 40}


def test_update_weights_equals_a_fresh_engine(dense, tmp_path):
    other = tiny_dense(seed=42)
    fresh = _engine(save(other, tmp_path))
    engine = _engine(dense[1])
    batch = prompts(8, seed=8)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1)
    before = engine.generate(batch, params)
    engine.update_weights(models.hf_named_tensors(fresh.model), version=3)
    after = engine.generate(batch, params)
    _assert_same(after, fresh.generate(batch, params))
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert {c.policy_version for c in after} == {3} and {c.policy_version for c in before} == {0}


def test_bad_requests_are_rejected_one_by_one(dense):
    engine = _engine(dense[1], max_model_len=32, num_blocks=6)
    good = SamplingParams(temperature=0.0, max_new_tokens=4)
    batch = [[1, 2, 3], [], list(range(1, 33)), [1, 2], [4, 5], [6], [7, VOCAB], [8, 9], [10]]
    params = [
        good, good, good,
        SamplingParams(max_new_tokens=0), SamplingParams(n=0), SamplingParams(temperature=-1.0),
        good, SamplingParams(stop_strings=["x"]), SamplingParams(max_new_tokens=30),
    ]  # fmt: skip
    out = engine.generate(batch, params)
    assert [c.prompt_index for c in out] == list(range(9))
    assert out[0].error is None and out[0].finish_reason == "length" and len(out[0].token_ids) == 4
    expected_words = [
        None,
        "empty",
        "max_model_len",
        "max_new_tokens",
        "n=0",
        "temperature",
        "vocabulary",
        "decode",
        "KV blocks",
    ]
    for c, word in zip(out[1:], expected_words[1:]):
        assert c.finish_reason == "abort" and c.token_ids == [] and word in c.error, c.error


def test_stop_tokens_strings_and_abort(dense):
    engine = _engine(dense[1], decode=lambda ids: " ".join(map(str, ids)))
    prompt = prompts(1, seed=9)[0]
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=10))[0].token_ids
    stop_tok = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[free[3]])
    )[0]
    assert stop_tok.token_ids == free[: free.index(free[3]) + 1] and stop_tok.finish_reason == "stop"
    text = " ".join(map(str, free[2:4]))
    stop_str = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_new_tokens=10, stop_strings=[text])
    )[0]
    assert " ".join(map(str, stop_str.token_ids)).endswith(text) and stop_str.finish_reason == "stop"

    keep = engine.add_request(prompt, SamplingParams(n=2, temperature=0.0, max_new_tokens=10))
    gone = engine.add_request(prompt, SamplingParams(n=3, temperature=0.0, max_new_tokens=10))
    engine.step()
    engine.step()
    engine.abort([gone])
    done = []
    while engine.has_unfinished():
        done += engine.step()
    aborted = [c for c in done if c.request_id == gone]
    assert len(aborted) == 3 and all(c.finish_reason == "abort" and len(c.token_ids) == 2 for c in aborted)
    assert [c.token_ids for c in done if c.request_id == keep] == [free, free]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sleep_and_wake(dense):
    engine = _engine(dense[1])
    batch = prompts(3, seed=10)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(batch, params)
    engine.sleep(offload_weights=True)
    assert engine.runner.backend is None
    engine.wake()
    _assert_same(engine.generate(batch, params), before, atol=0.0)


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose "graphs" re-run the forward eagerly: tests the static-buffer plumbing on CPU."""

    def _capture(self, bs, num_blocks):
        self.outputs[(bs, num_blocks)] = self._forward(bs, num_blocks)

        def replay():
            for static, fresh in zip(self.outputs[(bs, num_blocks)], self._forward(bs, num_blocks)):
                if static is not None:
                    static.copy_(fresh)

        self.graphs[(bs, num_blocks)] = SimpleNamespace(replay=replay)


def _eager_graphs(engine: NativeEngine, max_num_seqs: int, **kwargs) -> EagerGraphs:
    """EagerGraphs over `engine`'s runner, installed as its graphs (kwargs: DecodeGraphs' options)."""
    runner = engine.runner
    runner.graphs = EagerGraphs(
        engine.model, runner.backend, max_num_seqs=max_num_seqs, max_blocks_per_seq=runner.max_blocks_per_seq,
        scratch_block=runner.num_blocks, **kwargs,
    )  # fmt: skip
    return runner.graphs


def test_decode_graph_buffers_padding_and_buckets(dense):
    batch = sorted(prompts(6, max_len=20, seed=11), key=len)  # the longest prompt runs longest
    params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=3 + 3 * i, seed=i) for i in range(6)]
    reference = _engine(dense[1]).generate(batch, params)
    engine = _engine(dense[1], max_num_seqs=12)
    graphs = _eager_graphs(engine, 12, bucket_tokens=16)
    _assert_same(engine.generate(batch, params), reference)
    used = sorted(graphs.graphs)
    assert {bs for bs, _ in used} >= {2, 4, 8, 12} and len({nb for _, nb in used}) >= 2, used


def test_decode_graphs_record_moe_routes_like_eager_decode(tmp_path):
    """MoE: the experts each decode row used come out of the graphs' static outputs (padded rows
    cut off) exactly as eager decoding records them."""
    path = save(tiny_moe(seed=1), tmp_path)
    batch = prompts(5, max_len=12, seed=12)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    reference = _engine(path).generate(batch, params)
    engine = _engine(path, max_num_seqs=12)
    graphs = _eager_graphs(engine, 12, route_dtype=engine.runner.route_dtype)
    out = engine.generate(batch, params)
    _assert_same(out, reference)
    assert graphs.graphs
    for got, want in zip(out, reference):
        assert got.routed_experts is not None and torch.equal(got.routed_experts, want.routed_experts)


def test_compiled_decode_forward_traces_one_layer_and_matches_eager(tmp_path):
    """The forward the GPU runner captures, its layers compiled, through the same static buffers, on
    a model with more layers than Dynamo recompiles a function for (8): every layer reuses the one
    traced layer (the layer index stays out of the graphs), so there are fewer graphs than layers
    (the same number as with 2 layers); a batch of one pads to two (size 1 would compile again); a
    woken engine decodes through the same compiled layers without compiling again."""
    from torch._dynamo.utils import counters

    from rlloom.engines.rollout.native.model_runner import compile_decode_forward

    torch._dynamo.reset()
    counters.clear()
    path = save(tiny_dense(seed=3, layers=10), tmp_path / "deep")
    batch = prompts(3, max_len=12, seed=5)
    params = [SamplingParams(temperature=1.0, max_new_tokens=2 + 4 * i, seed=i) for i in range(3)]
    reference = _engine(path).generate(batch, params)
    engine = _engine(path, max_num_seqs=4)
    graphs = _eager_graphs(engine, 4, forward=compile_decode_forward(engine.model))
    _assert_same(engine.generate(batch, params), reference)
    assert {bs for bs, _ in graphs.graphs} == {2, 4}
    # Specialised per layer, the 9th layer would hit the recompile limit (a frame not ok) and run eagerly.
    assert counters["frames"]["total"] == counters["frames"]["ok"], dict(counters["unimplemented"])
    assert 0 < counters["stats"]["unique_graphs"] < 8, dict(counters["stats"])  # 6 at torch 2.13
    # Sleep/wake re-allocates the cache behind the same handle: the compiled layers still find it.
    compiled, forward = counters["stats"]["unique_graphs"], graphs.forward
    engine.sleep()
    engine.wake()
    _eager_graphs(engine, 4, forward=forward)
    _assert_same(engine.generate(batch, params), reference)
    assert counters["stats"]["unique_graphs"] == compiled, "woken up, the decode forward compiled again"


def test_compiled_decode_forward_runs_one_graph_whatever_the_first_token_count(tmp_path):
    """A fresh engine's first forward of as many tokens as the model's hidden size (a prefill of 16
    prompts x 64 tokens on Qwen3-0.6B, 1024) compiled, with duck sizing, a graph static in the
    token count; an engine that had decoded before ran that count through its dynamic graph, which
    rounds differently on a GPU: a replaced rollout actor's step differed from the uninterrupted run's.
    Now the first call compiles the dynamic graph that every later count (of at least 2) runs."""
    from torch._dynamo.utils import counters

    from rlloom.engines.rollout.native.model_runner import compile_decode_forward

    torch._dynamo.reset()
    counters.clear()
    hidden = 64  # tiny_dense's hidden size
    engine = _engine(save(tiny_dense(seed=4), tmp_path), max_num_seqs=hidden)
    graphs = _eager_graphs(engine, hidden, forward=compile_decode_forward(engine.model))
    graphs.warm_up(hidden, graphs.block_buckets[0])
    first = counters["stats"]["unique_graphs"]
    for tokens in (4, 48, hidden):
        graphs.warm_up(tokens, graphs.block_buckets[0])
    assert counters["stats"]["unique_graphs"] == first, "another token count compiled another graph"


def test_built_from_rollout_config(dense):
    from rlloom.config import RolloutConfig

    cfg = RolloutConfig(
        n_samples=3, temperature=0.9, max_new_tokens=5, num_blocks=32, block_size=8, max_num_seqs=4
    )
    engine = NativeEngine.from_config(
        models.from_pretrained(dense[1], fused_projections=True), cfg, max_model_len=48
    )
    assert engine.block_manager.num_blocks == 32 and engine.block_manager.block_size == 8
    out = engine.generate(prompts(2, seed=12), SamplingParams.from_config(cfg))
    assert [(c.prompt_index, len(c.token_ids)) for c in out] == [(0, 5)] * 3 + [(1, 5)] * 3
    assert SamplingParams.from_config(cfg, evaluation=True).temperature == 0.0


def test_prefill_attends_to_a_cached_prefix(dense):
    engine = _engine(dense[1])
    prompt = prompts(1, max_len=20, seed=13)[0] + [5, 6, 7, 8, 9, 10, 11]
    seq = Sequence(seq_id=0, request_id="r", prompt_index=0, sample_index=0, prompt_ids=prompt[:9],
                   params=SamplingParams(), policy_version=0)  # fmt: skip
    bm = engine.block_manager
    bm.allocate(seq)
    engine.runner.run([seq], is_prefill=True)
    seq.num_cached_tokens, seq.prompt_ids = 9, prompt  # the rest arrives as a second prefill chunk
    seq.block_table += [bm._take() for _ in range(bm.blocks_for(len(prompt)) - len(seq.block_table))]
    logits = engine.runner.run([seq], is_prefill=True)[0]
    expected = engine.model(torch.tensor([prompt]))[0, -1]
    assert (logits - expected).abs().max() < 1e-5


def test_large_groups_and_the_model_length_cap(dense):
    engine = _engine(dense[1], max_num_seqs=3)
    out = engine.generate([[1, 2, 3]], SamplingParams(n=7, temperature=1.0, max_new_tokens=3, seed=0))
    assert [c.sample_index for c in out] == list(range(7)) and all(len(c.token_ids) == 3 for c in out)
    capped = engine.generate([list(range(1, 61))], SamplingParams(temperature=0.0, max_new_tokens=10))[0]
    assert len(capped.token_ids) == 4 and capped.finish_reason == "length"  # 60 + 4 = max_model_len 64


def test_rollout_experts_take_the_inference_kernel_and_the_model_elsewhere_does_not(tmp_path):
    from rlloom.models import from_pretrained
    from rlloom.models.moe import GroupedExperts, expert_linear

    path = save(tiny_moe(seed=1), tmp_path)
    rollout = [m for m in _engine(path).model.modules() if isinstance(m, GroupedExperts)]
    other = [m for m in from_pretrained(path).modules() if isinstance(m, GroupedExperts)]
    assert rollout and all(m.inference_kernel for m in rollout)
    assert other and not any(m.inference_kernel for m in other)
    # The product it runs: each row times its expert's matrix (the CPU reference; the CUDA kernel
    # is checked against it in tests/gpu/test_expert_kernels_gpu.py).
    g = torch.Generator().manual_seed(1)
    counts = [3, 0, 5, 1]
    w = torch.randn(4, 12, 150, generator=g)
    x = torch.randn(sum(counts), 150, generator=g)
    got = expert_linear(x, w, torch.tensor(counts).cumsum(0).to(torch.int32))
    experts = [e for e, n in enumerate(counts) for _ in range(n)]
    torch.testing.assert_close(got, torch.stack([w[e] @ x[p] for p, e in enumerate(experts)]))
