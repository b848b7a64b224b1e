"""Layout search: every legal (tp, pp, cp, ep, dp) for the GPU count, the least offload that fits,
uneven pipeline stages, and the lowest estimated step time among the layouts that fit.

Legal: a vision-language model trains data parallel only (tp = pp = cp = ep = 1, as
`rlloom train` requires); tp divides the attention and KV heads and stays inside a node; ep divides the routed experts
and the tp * cp * dp ranks of a stage; cp splits the token budget into load-balanced halves; pp has
at least one layer a stage; tp * pp * cp * dp is the GPU count. The step-time model
(`step_cost`, docs/plan.md) counts compute, the pipeline bubble, the communication volume of each
dimension over NVLink or the network, and the offload traffic; it ranks layouts, it is not a
stopwatch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from rlloom.plan.counts import ModelCosts
from rlloom.plan.inputs import Hardware, Layout, Workload
from rlloom.plan.memory import Estimate, estimate
from rlloom.plan.stages import layer_kinds, stage_ranges

OFFLOAD_STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)
PEAK_FLOPS = 400e12
"""Sustained bf16 FLOP/s of one GPU (H100/H200 class)."""
NVLINK_BYTES_PER_S = 200e9
"""Collective bandwidth per GPU inside a node."""
NETWORK_BYTES_PER_S = 25e9
"""Collective bandwidth per GPU across nodes (one 400 Gb/s NIC per GPU, after protocol overheads)."""
PCIE_BYTES_PER_S = 20e9
CPU_ADAM_PARAMS_PER_S = 1e9
"""AdamW updates per second of the CPU cores serving one GPU."""
MAX_CP = 16
"""Largest context-parallel degree searched (ring attention beyond it is all communication)."""
MICRO_BATCHES_PER_GPU = 16
"""The step's global batch is this many token budgets per GPU (fixes the batch across layouts)."""


@dataclass(frozen=True, slots=True)
class Cost:
    seconds: float
    parts: dict[str, float]
    """Seconds per part: compute, bubble, tp, cp, ep, fsdp, offload."""


@dataclass(frozen=True, slots=True)
class Candidate:
    estimate: Estimate
    cost: Cost


def _powers_of_two(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def legal_layouts(costs: ModelCosts, hw: Hardware, work: Workload) -> Iterator[Layout]:
    """Every legal layout of `hw.gpus` GPUs, without offload, stages split evenly."""
    num_layers = len(costs.layers)
    most = 1 if costs.tower_params else hw.gpus  # a vision-language model trains data parallel only
    for tp in _powers_of_two(min(hw.gpus_per_node, most)):
        if costs.num_heads % tp or costs.num_kv_heads % tp:
            continue
        for cp in _powers_of_two(min(MAX_CP, most // tp)):
            if work.max_tokens_per_gpu % (2 * cp) and cp > 1:
                continue
            most_pp = min(num_layers, most // (tp * cp))
            for pp in range(1, most_pp + 1):
                if hw.gpus % (tp * cp * pp):
                    continue
                dp = hw.gpus // (tp * cp * pp)
                eps = [1]
                if costs.num_experts:
                    eps = [e for e in range(1, tp * cp * dp + 1) if (tp * cp * dp) % e == 0]
                    eps = [e for e in eps if costs.num_experts % e == 0]
                for ep in eps:
                    yield Layout(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp)


def _splits(num_layers: int, pp: int) -> Iterator[tuple[int, int]]:
    """(first, last) stage sizes near an even split; the middle stages share the rest evenly."""
    if pp == 1:
        yield 0, 0
        return
    even = num_layers // pp
    for first in range(max(1, even - 3), even + 4):
        for last in range(max(1, even - 3), even + 4):
            rest = num_layers - first - last
            if (pp == 2 and rest == 0) or (pp > 2 and rest >= pp - 2):
                yield first, last


def _active_params(costs: ModelCosts, layers: range, is_last: bool) -> float:
    """Parameters a token multiplies with in these layers (top_k of the routed experts), + the head."""
    share = costs.top_k / costs.num_experts if costs.num_experts else 0.0
    body = sum(n * (c.dense_params + c.expert_params * share) for c, n in layer_kinds(costs, layers))
    return body + (costs.vocab_size * costs.hidden_size if is_last else 0)


def stage_compute(costs: ModelCosts, layout: Layout) -> list[float]:
    """Active parameters of each pipeline stage (the slowest one paces the pipeline)."""
    stages = stage_ranges(
        len(costs.layers), layout.pp, layout.pp_first_stage_layers, layout.pp_last_stage_layers
    )
    return [_active_params(costs, r, s == len(stages) - 1) for s, r in enumerate(stages)]


def best_split(costs: ModelCosts, layout: Layout, hw: Hardware, work: Workload) -> Estimate:
    """`layout` with the pipeline split (first and last stage sizes) that fits with the most even
    compute (the last stage also runs the head); when no split fits, the one with the lowest peak."""
    best, best_key = None, None
    for first, last in _splits(len(costs.layers), layout.pp):
        est = estimate(
            costs, replace(layout, pp_first_stage_layers=first, pp_last_stage_layers=last), hw, work
        )
        compute = stage_compute(costs, est.layout)
        key = (not est.fits, max(compute) - min(compute) if est.fits else est.gpu_memory_gb)
        if best_key is None or key < best_key:
            best, best_key = est, key
    assert best is not None
    return best


def fit_layout(costs: ModelCosts, layout: Layout, hw: Hardware, work: Workload) -> Estimate:
    """The least offload fraction (of OFFLOAD_STEPS) with which some split fits, else offload 1.0."""
    for fraction in OFFLOAD_STEPS:
        est = best_split(costs, replace(layout, offload_fraction=fraction), hw, work)
        if est.fits:
            return est
    return est


def _bandwidth(span: int, hw: Hardware) -> float:
    return NVLINK_BYTES_PER_S if span <= hw.gpus_per_node else NETWORK_BYTES_PER_S


def step_cost(costs: ModelCosts, est: Estimate, hw: Hardware, work: Workload) -> Cost:
    """Estimated seconds of one optimizer step over a batch of MICRO_BATCHES_PER_GPU budgets per GPU.

    Per micro-batch: the slowest stage's compute plus the TP, CP and EP collectives on the critical
    path; FSDP gathers and reduce-scatters overlap with compute and count only where they exceed it.
    A step is (micro-batches + pp - 1) of those (the 1F1B bubble) plus the CPU Adam step. LoRA's
    compute is counted as full fine-tuning's: the frozen weights' gradients it skips cost about what
    its adapters add (docs/benchmarks.md: +4% at Qwen3-0.6B's shape on one H100).
    """
    lay = est.layout
    tokens = work.max_tokens_per_gpu
    layers_per_stage = len(costs.layers) / lay.pp
    moe_per_stage = sum(c.is_moe for c in costs.layers) / lay.pp
    passes = {"full": 4 / 3, "selective": 1.05, "none": 1.0}[work.recompute]
    hidden_bytes = 2 * costs.hidden_size
    t = tokens / (lay.tp * lay.cp)
    comm_passes = 3 if work.recompute == "full" else 2  # forward (+ recomputed forward) + backward

    flops = 6 * max(stage_compute(costs, lay)) * tokens * passes / (lay.tp * lay.cp)
    mb = {"compute": flops / PEAK_FLOPS}
    mb["tp"] = layers_per_stage * 4 * comm_passes * (lay.tp - 1) * t * hidden_bytes / _bandwidth(lay.tp, hw)
    kv_bytes = sum(c.kv_bytes_per_token for c in costs.layers) / len(costs.layers)
    mb["cp"] = layers_per_stage * comm_passes * (lay.cp - 1) / lay.cp * tokens / lay.tp * kv_bytes
    mb["cp"] /= _bandwidth(lay.tp * lay.cp, hw)
    mb["ep"] = moe_per_stage * 2 * comm_passes * (lay.ep - 1) / lay.ep * t * costs.top_k * hidden_bytes
    mb["ep"] /= _bandwidth(lay.ep, hw)
    shard = lay.cp * lay.dp  # FSDP degree of dense parameters; experts: tp * cp * dp / ep
    edp = lay.tp * lay.cp * lay.dp // lay.ep
    dense = (costs.total_params - costs.expert_params) / lay.pp / lay.tp
    experts = costs.expert_params / lay.pp / lay.ep
    # bf16 all-gathers in forward and backward, fp32 reduce-scatter: 8 bytes a parameter (LoRA's
    # frozen base is only gathered: 4 bytes)
    per_param = 4 if work.lora_params else 8
    fsdp = dense * per_param * (shard - 1) / shard + experts * per_param * (edp - 1) / edp
    critical = sum(mb.values())
    mb["fsdp"] = max(0.0, fsdp / _bandwidth(lay.tp * lay.cp * lay.dp, hw) - critical)

    micro_batches = MICRO_BATCHES_PER_GPU * lay.tp * lay.cp * lay.pp
    parts = {k: v * micro_batches for k, v in mb.items()}
    parts["bubble"] = (lay.pp - 1) * sum(mb.values())
    per_gpu = (work.lora_params or costs.total_params) / lay.world  # what the CPU Adam updates
    parts["offload"] = lay.offload_fraction * per_gpu * (8 / PCIE_BYTES_PER_S + 1 / CPU_ADAM_PARAMS_PER_S)
    return Cost(sum(parts.values()), parts)


@dataclass(frozen=True, slots=True)
class SearchResult:
    ranked: list[Candidate]
    """Fitting layouts, cheapest first (empty when none fits)."""
    closest: Candidate
    """The layout with the lowest peak relative to the GPU (the answer when nothing fits)."""

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None


def search(costs: ModelCosts, hw: Hardware, work: Workload) -> SearchResult:
    """Rank every legal layout that fits by estimated step time."""
    fitting, closest = [], None
    for layout in legal_layouts(costs, hw, work):
        est = fit_layout(costs, layout, hw, work)
        cand = Candidate(est, step_cost(costs, est, hw, work))
        if est.fits:
            fitting.append(cand)
        if closest is None or est.gpu_memory_gb < closest.estimate.gpu_memory_gb:
            closest = cand
    if closest is None:
        raise ValueError(f"no legal layout for {hw.gpus} GPUs")
    fitting.sort(key=lambda c: c.cost.seconds)
    return SearchResult(fitting, closest)


def gpus_needed(costs: ModelCosts, hw: Hardware, work: Workload, *, limit: int = 4096) -> int | None:
    """The fewest GPUs (whole nodes, doubling) on which some layout fits, up to `limit`."""
    gpus = max(hw.gpus * 2, hw.gpus_per_node)
    while gpus <= limit:
        bigger = replace(hw, gpus=gpus)
        # offload 1.0 needs the least GPU memory: if no layout fits with it, none fits at all
        widest = _widest_layouts(costs, bigger, work)
        if any(best_split(costs, replace(lay, offload_fraction=1.0), bigger, work).fits for lay in widest):
            return gpus
        gpus *= 2
    return None


def _widest_layouts(costs: ModelCosts, hw: Hardware, work: Workload) -> Iterator[Layout]:
    # Memory per GPU falls with sharding whatever the split; trying the few layouts with the most
    # tensor and expert parallelism is enough to tell whether a GPU count can fit at all.
    layouts = list(legal_layouts(costs, hw, work))
    layouts.sort(key=lambda lay: (-lay.tp * lay.ep, -lay.pp))
    yield from layouts[:24]
