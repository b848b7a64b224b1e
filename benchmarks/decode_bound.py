"""The memory-bandwidth lower bound of a rollout's decode steps: the bytes each step must read at least,
over the measured copy bandwidth.

A decode step reads, at least: every weight that every token uses (attention, dense MLPs, norms,
routers, shared experts, the lm head), the routed experts that the step's tokens chose (each one
once, however many tokens chose it: a batch of 64 x 8 routed tokens does not reach all 256 of
DeepSeek-V3's experts), and every cached key/value (or MLA latent) of each sequence's positions so
far. The input embedding is left out when it is not the lm head: a step gathers only its tokens'
rows. The experts a step's tokens chose are known after the run: each completion carries its routes
(`Completion.routed_experts`), and `run_engine` records which (sequence, position) each decode step
fed. Shared prompt prefixes are counted once per sequence, so a workload with n > 1 and prefix
sharing would need a smaller count (the benchmarks that print a bound use n = 1).
"""

from __future__ import annotations

import torch

from rlloom.engines.rollout.base import Completion

DecodeRow = tuple[int, int, int]
"""(prompt index, sample index, position) of one sequence's token in one decode step."""


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers (an fp8 rollout's experts and their scales are buffers)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def routed_expert_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of one routed expert of one layer, bytes of all routed experts); (0, 0) for a dense model.
    The experts of every MoE layer have one shape (and one dtype, fp8 scales included)."""
    layers = list(model.moe_layers().values()) if hasattr(model, "moe_layers") else []
    if not layers:
        return 0, 0
    per_layer = {weight_bytes(m.experts) for m in layers}
    assert len(per_layer) == 1, per_layer
    num_experts = model.args.moe.num_experts
    total = per_layer.pop()
    assert total % num_experts == 0, (total, num_experts)
    return total // num_experts, total * len(layers)


def every_step_bytes(model: torch.nn.Module) -> int:
    """Bytes every decode step reads whatever its tokens: the weights without the routed experts and
    without an untied input embedding (a step gathers only its tokens' rows of it)."""
    untied = model.lm_head_weight is not model.tok_embeddings.weight
    embedding = weight_bytes(model.tok_embeddings) if untied else 0
    return weight_bytes(model) - routed_expert_bytes(model)[1] - embedding


def experts_hit(routes_RLK: torch.Tensor, num_experts: int) -> int:
    """Distinct (MoE layer, expert) pairs the rows of one step chose. routes_RLK [rows, MoE layers,
    K]: expert ids per row, layer and choice."""
    rows, layers, k = routes_RLK.shape
    hit_LE = torch.zeros(layers, num_experts, dtype=torch.bool)
    layer_RLK = torch.arange(layers)[None, :, None].expand(rows, layers, k)
    hit_LE[layer_RLK.reshape(-1), routes_RLK.reshape(-1).long()] = True
    return int(hit_LE.sum())


def decode_bytes(
    every_step: int, expert: int, experts_hit_S: list[int], kv_tokens_S: list[int], kv_token: int
) -> int:
    """Bytes the decode steps read at least: per step s, the weights every step reads, `experts_hit_S[s]`
    routed experts of `expert` bytes each, and `kv_tokens_S[s]` cached tokens of `kv_token` bytes
    (all layers)."""
    assert len(experts_hit_S) == len(kv_tokens_S), (len(experts_hit_S), len(kv_tokens_S))
    return sum(every_step + hit * expert + kv * kv_token for hit, kv in zip(experts_hit_S, kv_tokens_S))


def decode_bound_s(
    model: torch.nn.Module,
    kv_dtype: torch.dtype,
    steps: list[list[DecodeRow]],
    completions: list[Completion],
    bandwidth: float,
) -> float:
    """Seconds the decode `steps` of a run (`run_engine`'s record) need at least at `bandwidth` bytes/s;
    `completions`: the run's, whose routes say which experts each step's tokens chose (MoE)."""
    a = model.args
    kv_token = a.num_layers * a.kv_cache.values_per_token * kv_dtype.itemsize
    kv_tokens_S = [sum(pos + 1 for _, _, pos in rows) for rows in steps]  # keys 0..pos of each row
    expert, _ = routed_expert_bytes(model)
    if expert:
        routes = {(c.prompt_index, c.sample_index): c.routed_experts for c in completions}
        hit_S = [
            experts_hit(torch.stack([routes[(p, s)][pos] for p, s, pos in rows]), a.moe.num_experts)
            for rows in steps
        ]
    else:
        hit_S = [0] * len(steps)
    return decode_bytes(every_step_bytes(model), expert, hit_S, kv_tokens_S, kv_token) / bandwidth
