"""Pipeline parallelism (rlloom/parallel/pp.py, pp_stages.py): the stage split, and pp=2 on gloo
against one process.

Every schedule runs two steps on one pipeline with uneven stages: micro-batches of different real
lengths (padded to the budget), a filler micro-batch (3 real ones on 2 ranks), then a step with a
different number of micro-batches and tokens, one of them in the shared-prompt layout; the MoE
model gets rollout routes, replayed in the first step and compared in the second. Losses, every
gradient, the grad norm and the logprobs must equal the one-process model's within 1e-5, and
`full_weights` must give every rank the whole model.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from parallel_helpers import run_gloo, tiny_args, tiny_model
from torch import nn
from torch.distributed.tensor import DTensor

from rlloom.models.logprobs import token_logprobs
from rlloom.models.model import CausalLM
from rlloom.parallel import ParallelDims, apply_ac, apply_fsdp, grad_norm
from rlloom.parallel.pp import apply_pp, model_name
from rlloom.parallel.pp_batches import PipeMicroBatch, pad_to_budget
from rlloom.parallel.pp_stages import check_pp, rank_stages, split_layers, zero_bubble_supported

BUDGET = 32
NUM_LAYERS = 6


def _spans(ranges: list[range]) -> list[tuple[int, int]]:
    return [(r.start, r.stop) for r in ranges]


def test_split_layers_uneven_last_stage():
    # slime's DeepSeek-R1 layout: 61 layers, pp=4, the last stage 13; the embedding weighs on stage 0.
    assert _spans(split_layers(61, 4, last_stage_layers=13)) == [(0, 16), (16, 32), (32, 48), (48, 61)]


def test_split_layers_weights_embedding_and_head():
    assert _spans(split_layers(4, 2)) == [(0, 2), (2, 4)]
    assert _spans(split_layers(6, 4)) == [(0, 1), (1, 3), (3, 5), (5, 6)]
    assert _spans(split_layers(61, 8)) == [(0, 7), *[(7 + 8 * i, 15 + 8 * i) for i in range(6)], (55, 61)]
    assert _spans(split_layers(10, 3, first_stage_layers=2, last_stage_layers=2)) == [(0, 2), (2, 8), (8, 10)]
    assert _spans(split_layers(5, 1)) == [(0, 5)]


def test_split_layers_refuses_impossible_layouts():
    with pytest.raises(ValueError, match="pp_last_stage_layers=5 leave 1 "):
        split_layers(6, 3, last_stage_layers=5)
    with pytest.raises(ValueError, match="need at least one decoder layer each"):
        split_layers(3, 4)
    with pytest.raises(ValueError, match="pp_first_stage_layers=-1"):
        split_layers(6, 2, first_stage_layers=-1)


def test_pad_to_budget_adds_a_padding_segment_and_refuses_a_longer_micro_batch():
    padded = pad_to_budget(_shared_prompt_micro_batch(0), 20, torch.device("cpu"))
    assert padded.input_ids_1P.shape == (1, 20) and padded.layout.kind == "tree"
    assert padded.layout.cu_seqlens.tolist() == [0, 9, 16, 20]
    assert padded.layout.tree.prefix == [4, 3, 4]  # the padding: a prompt of its own, no branches
    assert padded.position_ids_P[16:].tolist() == [0, 1, 2, 3]
    filler = pad_to_budget(None, 20, torch.device("cpu"))
    assert not filler.real and filler.layout.cu_seqlens.tolist() == [0, 20]
    with pytest.raises(ValueError, match="train.max_tokens_per_micro_batch=8"):
        pad_to_budget(_shared_prompt_micro_batch(0), 8, torch.device("cpu"))


def test_rank_stages_looped():
    assert rank_stages(0, 2, 2) == [0, 2] and rank_stages(1, 2, 2) == [1, 3]


def test_check_pp_refuses_bad_settings():
    args = _args()
    with pytest.raises(ValueError, match="pp_schedule='gpipe'"):
        check_pp(args, 2, "gpipe", 1)
    with pytest.raises(ValueError, match="pp_virtual_stages=2"):
        check_pp(args, 2, "1f1b", 2)


def test_zero_bubble_needs_torch_2_13(monkeypatch):
    """torch 2.11 and 2.12 (the GPU machines' 2.11 included) fail in the zero-bubble weight backward
    on a stage holding the logprob head; the schedule is refused there before anything runs."""
    assert not zero_bubble_supported("2.11.0+cu130") and not zero_bubble_supported("2.12.1")
    assert zero_bubble_supported("2.13.0+cpu") and zero_bubble_supported("3.0.0")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(ValueError, match=r"pp_schedule=zero_bubble needs torch >= 2.13.*Fix: use"):
        check_pp(_args(), 2, "zero_bubble", 2)
    check_pp(_args(), 2, "interleaved", 2)  # the other schedules run on it


def _args(family: str = "llama"):
    args = dataclasses.replace(tiny_args(family), num_layers=NUM_LAYERS)
    if args.moe is not None:  # MoE layers on both stages
        args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, sparse_layers=(1, 3, 4)))
    return args


def _model(family: str) -> CausalLM:
    """A 6-layer model of `family`: layers 2.. copy layer 1's (or dense layer 0's) random weights, all perturbed."""
    torch.manual_seed(0)
    ref = tiny_model(family)
    model = CausalLM(_args(family))
    state = ref.state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = name
            if src not in state:  # a layer the 2-layer model lacks: take layer 1's weight, else layer 0's
                layer = name.split(".")[1]
                src = name.replace(f"layers.{layer}.", "layers.1.")
                src = src if src in state else name.replace(f"layers.{layer}.", "layers.0.")
            p.copy_(state[src] + 0.05 * torch.randn_like(p))
    return model


def _micro_batch(lengths: list[int], seed: int) -> PipeMicroBatch:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    ids = torch.randint(0, 64, (n,), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(length) for length in lengths])
    # score the second half of every sequence (a "response"), target = the next token
    selected = torch.cat(
        [torch.arange(s + (e - s) // 2, e - 1) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    )
    return PipeMicroBatch(ids, positions, cu, max(lengths), selected, ids[selected + 1])


def _shared_prompt_micro_batch(seed: int) -> PipeMicroBatch:
    """Two segments: a 4-token prompt with branches of 3 and 2 tokens, a 3-token prompt with one of 4."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (16,), generator=g)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 4, 5, 0, 1, 2, 3, 4, 5, 6])
    selected = torch.tensor([3, 4, 5, 3, 7, 11, 12, 13, 14])  # a prompt's last position scores each branch
    return PipeMicroBatch(
        ids,
        positions,
        torch.tensor([0, 9, 16], dtype=torch.int32),
        9,
        selected,
        torch.randint(0, 64, (9,), generator=g),
        prefix_lens_S=torch.tensor([4, 3], dtype=torch.int32),
        branch_lens_Z=torch.tensor([3, 2, 4], dtype=torch.int32),
    )


def _with_routes(mb: PipeMicroBatch, args, seed: int) -> PipeMicroBatch:
    """`mb` with random rollout routes [N, MoE layers, top_k] (distinct experts; every 5th position none)."""
    g = torch.Generator().manual_seed(seed)
    n, layers, k = mb.input_ids_N.numel(), len(args.moe.sparse_layers), args.moe.top_k
    routes = torch.stack([torch.randperm(args.moe.num_experts, generator=g)[:k] for _ in range(n * layers)])
    routes = routes.view(n, layers, k)
    routes[::5] = -1
    return dataclasses.replace(mb, routes_NLK=routes)


STEPS = [
    [_micro_batch([9, 5, 12], 1), _micro_batch([17, 3], 2), _micro_batch([30], 3)],  # 3 real + 1 filler
    [_micro_batch([7, 11], 4), _shared_prompt_micro_batch(5)],
]


def _weights(i: int, k: int) -> torch.Tensor:
    return torch.randn(k, generator=torch.Generator().manual_seed(100 + i))


def _loss_fn(normaliser: float):
    def loss(i: int, logp_K: torch.Tensor, entropy_K: torch.Tensor | None) -> torch.Tensor:
        return ((logp_K * _weights(i, logp_K.numel())).sum() + 0.1 * entropy_K.sum()) / normaliser

    return loss


def _reference(
    model: CausalLM, mbs: list[PipeMicroBatch], loss_fn, replay: bool = False
) -> tuple[torch.Tensor, list]:
    losses, logps = [], []
    for i, mb in enumerate(mbs):
        hidden = model.hidden_states(
            mb.input_ids_N,
            position_ids=mb.position_ids_N,
            cu_seqlens=mb.cu_seqlens,
            max_seqlen=mb.max_seqlen,
            prefix_lens=mb.prefix_lens_S,
            branch_lens=mb.branch_lens_Z,
            routes_NLK=mb.routes_NLK,
            replay_routes=replay,
        )
        logp_K, entropy_K = token_logprobs(
            hidden[mb.positions_K], model.lm_head_weight, mb.targets_K, with_entropy=True
        )
        loss = loss_fn(i, logp_K, entropy_K)
        loss.backward()
        losses.append(loss.detach())
        logps.append((logp_K.detach(), entropy_K.detach()))
    return torch.stack(losses), logps


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _build(
    ref: CausalLM, dims: ParallelDims, schedule: str, virtual_stages: int, first: int, last: int, wrap: str
):
    """apply_pp on a copy of `ref`; `wrap`: "" (plain), "fsdp" (FSDP2 on each stage, no reshard after
    forward under PP) or "ac+fsdp" (full activation checkpointing first)."""

    def parallelize_stage(stage: nn.Module) -> nn.Module:
        if "ac" in wrap:
            apply_ac(stage.model, "full")
        return apply_fsdp(
            stage,
            dims.dp_shard_mesh(),
            param_dtype=torch.float32,
            reshard_after_forward=False,
            layers_of=stage.model,
        )

    return apply_pp(
        copy.deepcopy(ref),
        dims.pp_mesh(),
        schedule=schedule,
        budget=BUDGET,
        device=torch.device("cpu"),
        dtype=torch.float32,
        virtual_stages=virtual_stages,
        first_stage_layers=first,
        last_stage_layers=last,
        parallelize_stage=parallelize_stage if wrap else None,
    )


def _check_schedule(
    family: str, schedule: str, virtual_stages: int, first: int, last: int, wrap: str
) -> None:
    dims = ParallelDims(world_size=2, pp=2)
    dims.build_mesh("cpu")
    ref = _model(family)
    modules, pipe = _build(ref, dims, schedule, virtual_stages, first, last, wrap)
    ref_params = dict(ref.named_parameters())
    held = {model_name(name): p for m in modules for name, p in m.named_parameters()}
    assert 0 < len(held) < len(ref_params)
    for step, mbs in enumerate(STEPS):
        replay = ref.args.moe is not None and step == 0  # MoE: routes replayed, then only compared
        if ref.args.moe is not None:
            mbs = [_with_routes(mb, ref.args, seed=10 + i) for i, mb in enumerate(mbs)]
        ref.zero_grad()
        for m in modules:
            m.zero_grad()
        normaliser = float(sum(mb.positions_K.numel() for mb in mbs))
        loss_fn = _loss_fn(normaliser)
        expected_losses, expected_logps = _reference(ref, mbs, loss_fn, replay)
        losses = pipe.forward_backward(mbs, loss_fn, with_entropy=True, replay_routes=replay)
        torch.testing.assert_close(losses, expected_losses, atol=1e-5, rtol=1e-5, msg=schedule)
        norm = pipe.clip_grad_norm_(0.0)  # sums a tied embedding's two gradients
        torch.testing.assert_close(norm, grad_norm(ref.parameters()), atol=1e-5, rtol=1e-5, msg=schedule)
        for name, p in held.items():
            grad = _full(p.grad)
            torch.testing.assert_close(
                grad, ref_params[name].grad, atol=1e-5, rtol=1e-5, msg=f"{schedule} {name}"
            )
        logps = pipe.forward_logprobs(mbs, with_entropy=True, replay_routes=replay)
        for (logp, entropy), (exp_logp, exp_entropy) in zip(logps, expected_logps, strict=True):
            torch.testing.assert_close(logp, exp_logp, atol=1e-5, rtol=1e-5, msg=schedule)
            torch.testing.assert_close(entropy, exp_entropy, atol=1e-5, rtol=1e-5, msg=schedule)
    weights = list(pipe.full_weights())  # every rank gets the whole model (buffers too), in its order, once
    ref_state = ref.state_dict()
    assert [name for name, _ in weights] == list(ref_state), schedule
    for name, tensor in weights:
        torch.testing.assert_close(tensor, ref_state[name], atol=0, rtol=0, msg=name)


def pp_worker(rank: int, layouts: list[tuple]) -> None:
    torch.manual_seed(0)
    for layout in layouts:
        _check_schedule(*layout)


def test_pp_matches_one_process_every_schedule():
    """pp=2 with (model, schedule, virtual stages, first/last stage layers, wrapping of each stage)."""
    layouts = [
        ("llama", "1f1b", 1, 2, 0, ""),
        ("llama", "interleaved", 2, 0, 1, ""),
        ("llama", "zero_bubble", 2, 2, 0, ""),
        ("llama", "interleaved", 2, 0, 0, "fsdp"),
        ("llama", "zero_bubble", 2, 0, 2, "ac+fsdp"),
        ("qwen3", "1f1b", 1, 0, 4, "fsdp"),  # tied embeddings: the last stage's head is a copy
        ("deepseek_v3", "1f1b", 1, 2, 0, ""),  # MLA + MoE layers on both stages, routes replayed
    ]
    if not zero_bubble_supported(torch.__version__):  # refused before torch 2.13 (check_pp)
        layouts = [layout for layout in layouts if layout[1] != "zero_bubble"]
    run_gloo(pp_worker, 2, layouts)


def pp_dp_worker(rank: int) -> None:
    """pp=2 x dp_shard=2 (FSDP2): each data-parallel rank runs its own micro-batches, the loss is
    normalised over both, and the summed gradients equal one process running them all."""
    dims = ParallelDims(world_size=4, pp=2)
    dims.build_mesh("cpu")
    ref = _model("llama")
    modules, pipe = _build(ref, dims, "interleaved", 2, 0, 1, "fsdp")
    shares = [STEPS[0][:2], STEPS[1]]
    mine = shares[dims.dp_mesh().get_local_rank()]
    loss_fn = _loss_fn(float(sum(mb.positions_K.numel() for share in shares for mb in share)))
    offset = 0 if mine is shares[0] else len(shares[0])
    losses = pipe.forward_backward(
        mine, lambda i, logp, ent: loss_fn(offset + i, logp, ent), with_entropy=True
    )
    expected_losses, _ = _reference(ref, shares[0] + shares[1], loss_fn)
    torch.testing.assert_close(losses, expected_losses[offset : offset + len(mine)], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pipe.clip_grad_norm_(0.0), grad_norm(ref.parameters()), atol=1e-5, rtol=1e-5)
    ref_params = dict(ref.named_parameters())
    for m in modules:
        for name, p in m.named_parameters():
            expected = ref_params[model_name(name)].grad
            torch.testing.assert_close(_full(p.grad), expected, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_pp_with_fsdp_data_parallel_matches_one_process():
    run_gloo(pp_dp_worker, 4)
