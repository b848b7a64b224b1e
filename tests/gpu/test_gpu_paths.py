"""The CUDA paths against their CPU fp32 references: packed/varlen attention, grouped MoE, the rollout
engine with CUDA graphs, the bf16 FSDP training engine, and one RL step. Skipped without a GPU."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
VARYING_REWARD = [
    "reward.name=resume_reward:digit_share",
    f"reward.import_dir={Path(__file__).parents[1] / 'trainer'}",
    "reward.num_workers=1",
]

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _hf_folder(kind: str, tmp: Path) -> Path:
    from models_testutil import randomize_
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if kind == "dense":
        cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
        model = Qwen3ForCausalLM(cfg)
    else:
        cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
        model = Qwen3MoeForCausalLM(cfg)
    randomize_(model, seed=0)
    out = tmp / kind
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize(
    "kind, dtype", [("dense", torch.bfloat16), ("dense", torch.float32), ("moe", torch.float32)]
)
def test_packed_gpu_forward_matches_cpu_fp32(kind, dtype, tmp_path):
    """bf16 MoE is left out: a routing tie that bf16 rounding breaks changes a token's experts."""
    from rlloom.models import from_pretrained

    torch.backends.cuda.matmul.allow_tf32 = False
    folder = _hf_folder(kind, tmp_path)
    ref = from_pretrained(folder, dtype=torch.float32, device="cpu")
    gpu = from_pretrained(folder, dtype=dtype, device="cuda")
    lengths = [7, 300, 64, 1, 129]
    ids = torch.randint(0, 512, (sum(lengths),))
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    with torch.no_grad():
        want = ref(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=max(lengths))
        got = gpu(ids.cuda(), position_ids=pos.cuda(), cu_seqlens=cu.cuda(), max_seqlen=max(lengths))
    assert rel_err(got, want) < (2e-2 if dtype == torch.bfloat16 else 1e-4)


@torch.no_grad()
def _forward_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt + tokens], device="cuda")
    logits = model(ids)[0, len(prompt) - 1 : -1].float()
    target = torch.tensor(tokens, device="cuda")[:, None]
    return torch.log_softmax(logits, dim=-1).gather(1, target)[:, 0].tolist()


def test_rollout_engine_cuda_graphs_match_eager_and_forward(tmp_path):
    from rlloom.engines.rollout.native import NativeEngine, SamplingParams

    folder = _hf_folder("dense", tmp_path)
    prompts = [[int(x) for x in torch.randint(0, 512, (n,))] for n in (3, 17, 40, 5, 90, 33, 8, 61)]
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=7, ignore_eos=True)
    kw = dict(dtype=torch.float32, device="cuda", max_model_len=256, kv_cache_memory_gb=0.5)
    compiled_engine = NativeEngine.from_pretrained(folder, **kw)
    graphs = compiled_engine.generate(prompts, sp)
    assert compiled_engine.runner.compiled_forward is not None  # captured compiled, no fallback
    assert compiled_engine.runner.backend.use_decode_kernel  # with shared-prefix groups (n=2)
    eager = NativeEngine.from_pretrained(folder, enforce_eager=True, **kw).generate(prompts, sp)
    assert [c.token_ids for c in graphs] == [c.token_ids for c in eager]
    # sleep/wake re-allocates the cache and recaptures, without compiling again
    compiled_engine.sleep()
    compiled_engine.wake()
    assert [c.token_ids for c in compiled_engine.generate(prompts, sp)] == [c.token_ids for c in graphs]
    engine = NativeEngine.from_pretrained(folder, **kw)
    for c in graphs:
        want = _forward_logprobs(engine.model, prompts[c.prompt_index], c.token_ids)
        assert max(abs(a - b) for a, b in zip(c.logprobs, want)) < 1e-3


def test_a_fresh_engine_generates_the_bits_an_engine_that_ran_before_does(tmp_path, restore_determinism):
    """Deterministic mode, bf16: a fresh engine (a replaced rollout actor, a resumed run: a new process,
    here Dynamo reset) and one that generated before give a batch the same tokens and logprobs. The
    batch's prefill has as many tokens as the model's hidden size (4 x 64 = 256), which a fresh
    engine compiled into a graph static in the token count (duck sizing) while the other ran its
    dynamic graph: other roundings, other bits (the replaced replica of bench_recovery.py on 2 x H200)."""
    from rlloom.determinism import enable_determinism
    from rlloom.engines.rollout.native import NativeEngine, SamplingParams

    enable_determinism(True)
    folder = _hf_folder("dense", tmp_path)
    kw = dict(dtype=torch.bfloat16, device="cuda", max_model_len=256, kv_cache_memory_gb=0.5)
    before = [[int(x) for x in torch.randint(0, 512, (n,))] for n in (5, 17, 40)]
    step = [[int(x) for x in torch.randint(0, 512, (64,))] for _ in range(4)]
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=3, ignore_eos=True)
    torch._dynamo.reset()
    used = NativeEngine.from_pretrained(folder, **kw)
    used.generate(before, sp)
    want = used.generate(step, sp)
    torch._dynamo.reset()  # a new process's compiled code
    got = NativeEngine.from_pretrained(folder, **kw).generate(step, sp)
    assert [(c.token_ids, c.logprobs) for c in got] == [(c.token_ids, c.logprobs) for c in want]


_FP8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="fp8 needs compute capability >= 8.9",
)


@pytest.mark.parametrize("quantization", ["none", pytest.param("fp8", marks=_FP8)])
def test_moe_decode_is_captured_compiled_in_cuda_graphs(tmp_path, quantization):
    """bf16 MoE decode runs the compiled forward in CUDA graphs (no host sync in the routing) and its
    logprobs match a full forward of the same model; with fp8 experts too (rollout.quantization=fp8:
    the kernel reads the experts' row offsets on the device, and the full forward's prefill-sized
    products take its other tile shapes)."""
    from rlloom.engines.rollout.native import NativeEngine, SamplingParams

    folder = _hf_folder("moe", tmp_path)
    prompts = [[int(x) for x in torch.randint(0, 512, (n,))] for n in (3, 17, 40, 5, 90, 33, 8, 61)]
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=7, ignore_eos=True)
    engine = NativeEngine.from_pretrained(
        folder,
        dtype=torch.bfloat16,
        device="cuda",
        max_model_len=256,
        kv_cache_memory_gb=0.5,
        quantization=quantization,
    )
    out = engine.generate(prompts, sp)
    assert engine.runner.compiled_forward is not None and engine.runner.graphs is not None
    assert engine.runner.graphs.graphs, "no decode graph was captured"
    gaps = []
    for c in out:
        want = _forward_logprobs(engine.model, prompts[c.prompt_index], c.token_ids)
        gaps += [abs(a - b) for a, b in zip(c.logprobs, want)]
    assert sorted(gaps)[len(gaps) // 2] < 2e-2, max(gaps)


@pytest.mark.parametrize("ac", ["off", "full"])
def test_moe_aux_loss_and_loads_under_compile(tmp_path, ac):
    """The compiled (per-layer torch.compile) bf16 MoE step keeps the aux loss in the graph: the
    router moves under a zero policy loss, and the load metrics come back."""
    from rlloom.config import TrainEngineConfig
    from rlloom.data.types import RolloutBatch, Sample
    from rlloom.engines.train.native import NativeTrainEngine

    folder = _hf_folder("moe", tmp_path)
    batch = RolloutBatch(
        [
            Sample(prompt_ids=list(range(i, i + 20)), response_ids=list(range(30, 60)), group_id=i)
            for i in range(8)
        ]
    )
    cfg = TrainEngineConfig(lr=1e-2, moe_aux_loss_coef=1.0, activation_checkpointing=ac, compile=True)
    engine = NativeTrainEngine.build(cfg, str(folder), device="cuda")
    gates = {i: m.router.gate.weight for i, m in engine.model.moe_layers().items()}
    before = {
        i: g.full_tensor().clone() if hasattr(g, "full_tensor") else g.clone() for i, g in gates.items()
    }
    zero = lambda logp, ent, rows: ((logp * 0.0).sum(), {})
    metrics = engine.train_step(batch, zero, loss_normalizer=1.0)
    assert metrics["moe/aux_loss"] >= 1.0 - 1e-3 and metrics["moe/load_max_over_mean"] >= 1.0
    after = {i: g.full_tensor() if hasattr(g, "full_tensor") else g for i, g in gates.items()}
    assert all(not torch.equal(after[i], before[i]) for i in gates)


def test_bf16_train_engine_logprobs_and_step(tmp_path):
    from rlloom.algorithms import aggregate_loss_sum, loss_normalizer
    from rlloom.config import TrainEngineConfig
    from rlloom.data.types import RolloutBatch, Sample
    from rlloom.engines.train.base import ForwardOptions
    from rlloom.engines.train.native import NativeTrainEngine

    folder = _hf_folder("dense", tmp_path)
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            prompt_ids=torch.randint(0, 512, (int(torch.randint(4, 60, (1,), generator=gen)),), generator=gen).tolist(),
            response_ids=torch.randint(0, 512, (int(torch.randint(1, 80, (1,), generator=gen)),), generator=gen).tolist(),
            group_id=i // 4,
            reward=float(i % 2),
        )
        for i in range(16)
    ]  # fmt: skip
    batch = RolloutBatch(samples)
    cfg = TrainEngineConfig(lr=1e-4, max_tokens_per_micro_batch=512)
    cpu = NativeTrainEngine.build(cfg, str(folder), device="cpu")
    gpu = NativeTrainEngine.build(cfg, str(folder), device="cuda")
    want, _ = cpu.forward_logprobs(batch)
    got, _ = gpu.forward_logprobs(batch)
    mask = batch.response_mask()
    assert rel_err(got[mask], want[mask]) < 2e-2
    norm = loss_normalizer(mask, "token-mean")
    loss_fn = lambda logp, ent, rows: (aggregate_loss_sum(-logp, mask[rows].cuda(), "token-mean"), {})
    m = gpu.train_step(batch, loss_fn, loss_normalizer=norm, options=ForwardOptions(with_entropy=True))
    assert m["train/skipped_step"] == 0.0 and 0 < m["perf/mfu"] < 1
    after, _ = gpu.forward_logprobs(batch)
    assert after[mask].mean() > got[mask].mean()  # one step of maximum likelihood raised them


@pytest.mark.parametrize(
    "extra",
    # LoRA: compiled adapted layers, the bf16 frozen base, the merged weight sync (lr 3e-2 and a
    # reward that varies: a sync of the unmerged weights leaves the rollout behind at step 2)
    # (with optimizer offload one GPU trains under FSDP2: the bf16 base sharded beside fp32 adapters)
    [
        [],
        ["train.lora_rank=8", "train.lora_alpha=16", "train.lr=3e-2", *VARYING_REWARD],
        [
            "train.lora_rank=8",
            "train.lora_alpha=16",
            "train.lr=3e-2",
            "train.optimizer_offload=true",
            *VARYING_REWARD,
        ],
    ],
    ids=["full", "lora", "lora-fsdp"],
)
def test_one_rl_step_on_gpu(tiny_checkpoint, tmp_path, extra):
    from rlloom.cluster.build import build_groups
    from rlloom.config import load_config
    from rlloom.data.control_tokens import ResponseDecoder
    from rlloom.models import load_tokenizer
    from rlloom.rewards.build import build_reward_runner
    from rlloom.tasks.build import build_task_source
    from rlloom.trainer.step import StepContext, rl_step

    cfg = load_config(
        "arithmetic_smoke",
        [
            f"model.path={tiny_checkpoint}",
            f"trainer.run_dir={tmp_path}",
            "algorithm.is_correction=tis",
            *extra,
        ],
    )
    tok = load_tokenizer(tiny_checkpoint)
    groups = build_groups(cfg)
    ctx = StepContext(
        cfg=cfg,
        train_group=groups.train,
        rollout_group=groups.rollout,
        weight_sync=groups.sync,
        source=build_task_source(cfg.data, tok, "train"),
        runner=build_reward_runner(cfg.reward, task=cfg.data.task),
        decode=ResponseDecoder.of(tok),
        stop_token_ids=[tok.eos_token_id],
    )
    for step in range(2):
        m = rl_step(ctx, step)
    assert m["policy/version"] == 2 and m["rollout/logp_gap_abs"] < (0.03 if extra else 0.1)
    assert m["train/skipped_step"] == 0.0


def test_compiled_layers_match_eager(tmp_path):
    from rlloom.config import TrainEngineConfig
    from rlloom.data.types import RolloutBatch, Sample
    from rlloom.engines.train.native import NativeTrainEngine

    folder = _hf_folder("dense", tmp_path)
    gen = torch.Generator().manual_seed(1)
    samples = [
        Sample(prompt_ids=torch.randint(0, 512, (5 + 7 * i,), generator=gen).tolist(),
               response_ids=torch.randint(0, 512, (3 + 11 * i,), generator=gen).tolist(), group_id=i)
        for i in range(8)
    ]  # fmt: skip
    batch = RolloutBatch(samples)
    mask = batch.response_mask()
    eager = NativeTrainEngine.build(TrainEngineConfig(compile=False), str(folder), device="cuda")
    compiled = NativeTrainEngine.build(TrainEngineConfig(compile=True), str(folder), device="cuda")
    want, _ = eager.forward_logprobs(batch)
    for _ in range(2):  # a second call must not recompile into something else
        got, _ = compiled.forward_logprobs(batch.select(list(range(8))))
        assert rel_err(got[mask], want[mask]) < 2e-2


@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_logprob_head_matches_eager(with_entropy):
    from rlloom.models.logprobs import token_logprobs

    gen = torch.Generator().manual_seed(0)  # V = 20000: three 8192-wide statistics slices, one partial
    hidden = torch.randn(3000, 256, generator=gen).cuda().bfloat16().requires_grad_()
    weight = (torch.randn(20000, 256, generator=gen) * 0.05).cuda().bfloat16().requires_grad_()
    targets = torch.randint(0, 20000, (3000,), generator=gen).cuda()
    upstream = torch.randn(3000, generator=gen).cuda()
    results = []
    for fused in (False, True):
        logp, ent = token_logprobs(
            hidden, weight, targets, temperature=0.8, chunk_tokens=1024, with_entropy=with_entropy,
            fused=fused,
        )  # fmt: skip
        loss = (logp * upstream).sum() + (ent.sum() * 0.1 if ent is not None else 0.0)
        results.append((logp, ent, *torch.autograd.grad(loss, (hidden, weight))))
    for eager, fused in zip(*results):
        if eager is not None:
            assert rel_err(fused, eager) < 1e-2


def test_fused_sampler_matches_the_torch_path():
    """The chunked Triton sampler against the torch path on the same noise, at a full vocabulary in
    bf16: the same tokens (greedy and sampled rows) and logprobs."""
    from rlloom.engines.rollout.native.sampler import Sampler, SamplingRows, noise_key

    gen = torch.Generator().manual_seed(0)
    R, V = 64, 151936
    logits = (torch.randn(R, V, generator=gen) * 4).cuda().bfloat16()
    logits[0, 7] = logits[0, V - 3] = 100.0  # a tie across chunks: the first index, as torch.argmax
    temps = [0.0 if r % 4 == 0 else 0.6 + 0.1 * (r % 7) for r in range(R)]
    rows = SamplingRows.build(
        temps, [1.0] * R, [-1] * R, [noise_key(5, r, 11) for r in range(R)], torch.device("cuda")
    )
    sampler = Sampler(torch.device("cuda"), seed=0)
    fused = sampler(logits, rows)
    assert not rows.truncate and sampler.use_triton
    # The torch path (taken when a row may truncate; none does here) draws the same Triton noise.
    rows.truncate = True
    torch_path = sampler(logits, rows)
    assert fused[0].tolist() == torch_path[0].tolist() and fused[0][0] == 7
    assert (fused[1] - torch_path[1]).abs().max() < 1e-4


def test_train_micro_batch_loop_never_syncs_with_the_host(tmp_path, monkeypatch):
    """forward_backward queues every micro-batch without a host sync (the host packs the next one
    while the GPU runs); only the metric reduction at the end reads values back. A NaN found by a
    deferred check still raises, naming the input."""
    from rlloom.algorithms import aggregate_loss_sum, loss_normalizer
    from rlloom.algorithms._validate import check_finite, deferred_finite_checks
    from rlloom.config import TrainEngineConfig
    from rlloom.data.types import RolloutBatch, Sample
    from rlloom.devices import to_device
    from rlloom.engines.train.native import NativeTrainEngine
    from rlloom.engines.train.native import runner as runner_module

    folder = _hf_folder("dense", tmp_path)
    gen = torch.Generator().manual_seed(2)
    samples = [
        Sample(prompt_ids=torch.randint(0, 512, (20,), generator=gen).tolist(),
               response_ids=torch.randint(0, 512, (5 + 9 * (i % 4),), generator=gen).tolist(),
               group_id=i // 4, reward=float(i % 2))
        for i in range(16)
    ]  # fmt: skip
    batch = RolloutBatch(samples)
    mask = batch.response_mask()
    norm = loss_normalizer(mask, "token-mean")
    cfg = TrainEngineConfig(max_tokens_per_micro_batch=128)
    engine = NativeTrainEngine.build(cfg, str(folder), device="cuda")

    def loss_fn(logp, ent, rows):
        return aggregate_loss_sum(-logp, to_device(mask[rows], "cuda"), "token-mean"), {"loss/m": logp.sum()}

    engine.forward_backward(batch, loss_fn, loss_normalizer=norm)  # warm-up: compilation, allocations
    torch.cuda.synchronize()

    @contextlib.contextmanager
    def checks_then_allow_sync():  # the loop is over: reading values back is allowed again
        with deferred_finite_checks():
            yield
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(runner_module, "deferred_finite_checks", checks_then_allow_sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        m = engine.forward_backward(batch, loss_fn, loss_normalizer=norm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert m["train/num_micro_batches"] > 2
    with pytest.raises(ValueError, match="logp_BT has 1 NaN"):
        with deferred_finite_checks():
            check_finite("logp_BT", torch.tensor([0.0, float("nan")], device="cuda"))
            check_finite("ok", torch.zeros(3, device="cuda"))  # queued too: no raise before the exit
