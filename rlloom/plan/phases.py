"""The phases of one pipeline stage's training step and the GPU memory of each (docs/plan.md, section 2).

`stage_memory` returns the peak over the moments of a backward pass of rlloom's training engine,
each of which can be the step's peak: "head" (the logprob head's backward runs first, while every
activation is still saved), "layers" (the first decoder layer's backward: gathered layers,
recomputed activations), "last layer" (the last one's backward: the same working set beside the
fp32 gradients of every other layer, which with one micro-batch appear as the layers go), "layer
reduce" (a layer's gradient reduce) and "reduce" (the end of backward, when every fp32 gradient
exists and the root unit's gradients are reduced), and "step" (the optimizer step with the engine's
trial of the update on one slice); on one GPU without optimizer offload, which runs without FSDP,
"layers", "last layer" and "backward end" (every fp32 gradient) instead of the reduces. Between
them memory moves linearly (a layer's gradients appear as its saved input goes, and every layer's
backward has the same working set), so the peak is at one of them. Checked against an H200's
allocator trace: docs/plan.md lists what was alive at each measured peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass

from rlloom.engines.train.native.step_guard import TRIAL_CHUNK
from rlloom.plan.counts import LayerCost, ModelCosts
from rlloom.plan.inputs import Layout, Workload
from rlloom.plan.stages import layer_kinds

GB = float(1 << 30)
NCCL_BUFFERS_GB = 0.5
"""Communication buffers of NCCL when more than one GPU takes part."""
EAGER_ACTIVATION_FACTOR = 1.4
"""Saved activations of an eager (not compiled) decoder layer over the counted ones: eager keeps the
norms' fp32 intermediates, the SiLU output, RoPE tables and attention layout copies (measured with
saved-tensor hooks, tests/plan/test_plan_activations.py: 1.35 dense; MoE and MLA 1.27 and 1.12
since the MoE layer permutes tokens by gathers, which keep one routed copy fewer in eager: the factor
over-predicts their eager activations by up to 25%, on the safe side)."""


@dataclass(frozen=True, slots=True)
class Breakdown:
    """GB of one GPU at the training peak."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


def _saved_per_token(layer: LayerCost, hidden: int, work: Workload, checkpointed: bool) -> int:
    if work.recompute == "none" or (work.recompute == "full" and not checkpointed):
        return layer.act_none
    if work.recompute == "selective":
        return layer.act_selective
    return hidden  # full recompute keeps only the layer's input


def _cp_attention_bytes(costs: ModelCosts, layout: Layout, tokens: float) -> float:
    """Bytes a layer's backward holds under context parallelism beyond what its local tokens cost
    (parallel/cp.py): every rank's keys and values gathered (`tokens`, the whole micro-batch) and
    the FlashAttention runs' keys and values (each local chunk's document up to the chunk's end:
    tokens x (1 + 1 / (2 cp)) keys over a rank's two chunks of every document), bf16, their heads split
    over tp. The recompute makes them before the MLP's backward, and they live until the
    attention's: an H200's allocator trace of a cp=2 step (docs/plan.md) had them beside the MLP's
    gradients at the peak."""
    runs = tokens * (1 + 1 / (2 * layout.cp))
    return 2 * (tokens * costs.cp_gathered + runs * costs.cp_run_width) / layout.tp


def _head_chunk_tokens(selected: float, chunk: int) -> float:
    """Tokens' worth of [chunk, V] bf16 tensors alive at once in the logprob head's backward: a
    chunk's logits and logit gradient, and from the second chunk on the previous chunk's gradient too
    (rebound only once the new one exists)."""
    first = min(chunk, selected)
    second = min(chunk, max(0.0, selected - chunk))
    return max(2 * first, first + 2 * second) if second else 2 * first


@dataclass(frozen=True, slots=True)
class Trained:
    """Parameters per GPU of one stage that hold fp32 gradients and AdamW moments: all of them, or
    with LoRA only the adapters (the frozen base, embedding and head have neither)."""

    params: float
    """Per GPU, sharded as the stage's parameters are."""
    layer: float
    """One decoder layer's, as one GPU gathers it (its gradients before the reduce)."""
    head: float
    """The vocabulary head's as one GPU gathers it (its weight gradient)."""
    embed: float
    """The embedding's, on one device (its gradient comes last)."""
    root: float
    """The root unit's (embedding, final norm, head) as one GPU gathers it."""
    root_shard: float
    """The root unit's shard."""


def _trained(costs: ModelCosts, layers: range, layout: Layout, work: Workload, full: Trained) -> Trained:
    """`full` (every parameter trains) or, with LoRA, the stage's share of the adapters: they sit in
    every decoder layer (spread evenly: adapters are a few MB a layer), nowhere in the root unit."""
    if not work.lora_params:
        return full
    per_layer = work.lora_params / len(costs.layers)
    shard = layout.tp * layout.cp * layout.dp
    return Trained(len(layers) * per_layer / shard, per_layer / layout.tp, 0.0, 0.0, 0.0, 0.0)


def stage_memory(
    costs: ModelCosts, layers: range, stage: int, layout: Layout, work: Workload
) -> tuple[Breakdown, str, float, float]:
    """(breakdown at the peak, the phase it is in, trained parameters per GPU, bytes of the engine's
    own state per GPU: parameter shards and moments) of one stage."""
    is_first, is_last = stage == 0, stage == layout.pp - 1
    shard = layout.tp * layout.cp * layout.dp  # FSDP x TP (dense) = EP x expert FSDP (experts)
    present = layer_kinds(costs, layers)
    root = (costs.embed_params + costs.tower_params if is_first else 0) + (
        costs.head_params if is_last else 0
    )
    if costs.tied and is_first and is_last:  # one tensor is both the embedding and the head
        root -= costs.embed_params
    stage_params = sum(n * (c.dense_params + c.expert_params) for c, n in present) + root
    per_gpu = stage_params / shard
    layer = max(c.dense_params / layout.tp + c.expert_params / layout.ep for c, _ in present)
    root_gpu = root / layout.tp  # the root unit (embedding, final norm, head) as one GPU gathers it
    head_gpu = costs.vocab_size * costs.hidden_size / layout.tp if is_last else 0.0
    embed_gpu = costs.embed_params if is_first else 0.0
    full = Trained(per_gpu, layer, head_gpu, embed_gpu, root_gpu, root / shard)
    trained = _trained(costs, layers, layout, work, full)
    earlier = 4 * trained.params if work.micro_batches > 1 else 0.0  # the earlier micro-batches' gradients

    # One GPU without optimizer offload runs without FSDP (NativeTrainEngine's rule): a bf16 copy of
    # every parameter while it computes, instead of FSDP's gathered root and layers. LoRA's frozen
    # base is kept in bf16, on one device without a copy, under FSDP in bf16 shards.
    copies = layout.world == 1 and not layout.offload_fraction
    frozen = per_gpu if work.lora_params else 0.0
    # fp32 parameter shards of what trains (the master weights FSDP2 gathers from; all on one GPU)
    # and LoRA's bf16 frozen base
    shards = 4 * trained.params + 2 * frozen
    optimizer = 8 * (1 - layout.offload_fraction) * trained.params
    gathered_root = 2 * root_gpu  # bf16, gathered for the whole forward and backward

    t = work.max_tokens_per_gpu / (layout.tp * layout.cp)  # tokens per GPU (sequence parallel)
    seq = work.max_tokens_per_gpu / layout.cp
    activations, working, last_layer = _activation_bytes(costs, layers, stage, layout, work, t)
    comm = _comm_bytes(costs, layout, work, present, t, seq)

    fsdp = layout.cp * layout.dp

    def reduce_extra(unit: float) -> float:
        """Bytes of one unit's gradient reduce beyond the fp32 gradients (`unit`: its parameters as
        one GPU gathers them): the fp32 reduce input; on a single FSDP rank torch also materialises
        `input / divide_factor`; from the second micro-batch on the output exists before it is added."""
        return 4 * unit * (2 if fsdp == 1 else 1) + (4 * unit / fsdp if work.micro_batches > 1 else 0.0)

    if copies:
        phases = _one_device_phases(
            shards, earlier, optimizer, activations, working, trained=trained, tied=costs.tied,
            last_layer=last_layer,
        )  # fmt: skip
    else:
        phases = _fsdp_phases(
            shards, earlier, optimizer, activations, working, comm, trained=trained, layer=layer,
            gathered_root=gathered_root, reduce_extra=reduce_extra,
            nccl=NCCL_BUFFERS_GB * GB if layout.world > 1 else 0.0, last_layer=last_layer,
        )  # fmt: skip
    phases["step"] = _step_phase(costs, layout, trained, shards, optimizer)
    if is_last:
        # the logprob head's backward, before any layer's: every saved activation, the final norm's
        # fp32 input and compute-dtype output, the fp32 weight-gradient accumulator, and as buffers
        # the selected hidden states and their gradient and the [chunk, V] logits and gradients
        # (bf16 on CUDA, as every activation here: `act` bytes an element)
        act = work.compute_bytes
        selected = work.response_fraction * seq
        chunks = _head_chunk_tokens(selected, work.logprob_chunk_tokens)
        phases["head"] = Breakdown(
            shards + (2 * trained.params if copies else gathered_root),
            earlier + 4 * trained.head,
            optimizer,
            activations + (4 + act) * t * costs.hidden_size,
            comm + 2 * act * selected * costs.hidden_size + act * chunks * costs.vocab_size / layout.tp,
        )
    phase = max(phases, key=lambda name: phases[name].total)
    bd = phases[phase]
    return Breakdown(*(x / GB for x in astuple(bd))), phase, trained.params, shards + optimizer


def _step_phase(
    costs: ModelCosts, layout: Layout, trained: Trained, shards: float, optimizer: float
) -> Breakdown:
    """The optimizer step's memory (`shards`, `optimizer`: the stage's parameter shards and moments)."""
    shard = layout.tp * layout.cp * layout.dp
    fsdp = layout.cp * layout.dp
    # the optimizer step: every fp32 gradient, and the engine's trial of the update on one slice of
    # at most TRIAL_CHUNK elements (parameter, two moments, the isfinite flags: 13 bytes an element;
    # engines/train/native/step_guard.py) before it applies the step
    fsdp_vh = costs.vocab_size * costs.hidden_size / shard if trained.root else 0.0
    largest = max(fsdp_vh, trained.layer / 3 / fsdp)  # a layer's largest matrix: about a third of it
    return Breakdown(
        shards,
        4 * trained.params,
        optimizer,
        0.0,
        13 * min(TRIAL_CHUNK, largest) + (NCCL_BUFFERS_GB * GB if layout.world > 1 else 0.0),
    )


def _activation_bytes(
    costs: ModelCosts, layers: range, stage: int, layout: Layout, work: Workload, t: float
) -> tuple[float, float, float]:
    """Activation bytes of one stage (`t` tokens per GPU): (saved by the micro-batches in flight, the
    working memory of one layer's recompute and backward, the saved input of the backward's last layer)."""
    present = layer_kinds(costs, layers)
    in_flight = layout.pp - stage  # 1F1B: the first stage holds pp micro-batches
    if work.recompute_every_k == 1:
        saved = sum(n * _saved_per_token(c, costs.hidden_size, work, True) for c, n in present)
    else:  # every k-th layer of the stage is checkpointed
        saved = sum(
            _saved_per_token(
                costs.layers[i], costs.hidden_size, work, (i - layers.start) % work.recompute_every_k == 0
            )
            for i in layers
        )
    eager = 1.0 if work.compiled else EAGER_ACTIVATION_FACTOR
    act = work.compute_bytes  # bytes an element: bf16 on CUDA, fp32 on CPU
    activations = act * t * saved * in_flight * eager
    if stage == 0:  # the vision tower's, beside the decoder's until the backward reaches it last
        activations += act * work.image_patches_per_gpu * costs.tower_act_per_patch * in_flight
    largest = max(c.act_none for c, _ in present)
    working = act * t * largest * (1.5 if work.recompute == "full" else 0.5) * eager  # recomputed + grads
    if layout.cp > 1:
        working += _cp_attention_bytes(costs, layout, work.max_tokens_per_gpu)
    last_layer = activations / max(1, len(layers))  # the saved input of the backward's last layer
    return activations, working, last_layer


def _comm_bytes(
    costs: ModelCosts,
    layout: Layout,
    work: Workload,
    present: list[tuple[LayerCost, int]],
    t: float,
    seq: float,
) -> float:
    """Communication buffers of one stage: NCCL's own, and what TP, EP and PP send and receive."""
    comm = NCCL_BUFFERS_GB * GB if layout.world > 1 else 0.0
    if layout.tp > 1:  # sequence-parallel all-gather of a layer input
        comm += 2 * 2 * seq * costs.hidden_size
    if layout.ep > 1 and any(c.is_moe for c, _ in present):  # all-to-all send and receive
        comm += 2 * 2 * t * costs.top_k * costs.hidden_size
    if layout.pp > 1:  # p2p activation and gradient buffers
        comm += 2 * 2 * t * costs.hidden_size
    return comm


def _fsdp_phases(
    shards: float,
    earlier: float,
    optimizer: float,
    activations: float,
    working: float,
    comm: float,
    *,
    trained: Trained,
    layer: float,
    gathered_root: float,
    reduce_extra: Callable[[float], float],
    nccl: float,
    last_layer: float,
) -> dict[str, Breakdown]:
    """The backward's phases under FSDP2 (several GPUs, or one with optimizer offload): layers
    gathered one at a time (`layer`: one gathered; `trained`: what of it gets gradients)."""
    return {
        # a decoder layer's backward: it and the prefetched next layer gathered in bf16, its bf16
        # gradients, the previous layer's reduce input (kept until this layer reduces), the head's
        # bf16 weight gradient (reduced with the root at the end), recomputed activations and grads
        "layers": Breakdown(
            shards + gathered_root + 2 * 2 * layer,
            earlier + 2 * trained.head + (2 + 4) * trained.layer,
            optimizer,
            activations + working,
            comm,
        ),
        # the backward's last layer: the same working set, with the fp32 gradient shards of every
        # other layer (with one micro-batch they appear as the layers go) and one layer's input
        "last layer": Breakdown(
            shards + gathered_root + 2 * layer,
            (earlier or 4 * (trained.params - trained.root_shard))
            + 2 * trained.head
            + (2 + 4) * trained.layer,
            optimizer,
            last_layer + working,
            comm,
        ),
        # that layer's gradient reduce, once it is resharded: the prefetched layer and the reduce
        "layer reduce": Breakdown(
            shards + gathered_root + 2 * layer,
            earlier + 2 * trained.head + reduce_extra(trained.layer),
            optimizer,
            activations,
            comm,
        ),
        # end of backward, the root unit's reduce (after its reshard): every fp32 gradient
        "reduce": Breakdown(
            shards,
            4 * trained.params + reduce_extra(trained.root),
            optimizer,
            0.0,
            nccl,
        ),
    }


def _one_device_phases(
    shards: float,
    earlier: float,
    optimizer: float,
    activations: float,
    working: float,
    *,
    trained: Trained,
    tied: bool,
    last_layer: float,
) -> dict[str, Breakdown]:
    """The backward's phases on one GPU without optimizer offload, which runs without FSDP
    (parallel/mixed_precision.py): a bf16
    copy of every parameter for the whole forward and backward, each bf16 gradient added into the
    fp32 ones as soon as autograd has it. A tied head's bf16 gradient waits in autograd for the
    embedding's part until the end of backward; an untied head's is in fp32 from the start. With
    LoRA only the adapters have copies and gradients (`trained`)."""
    copies = 2 * trained.params
    waiting = 2 * trained.head if tied else 0.0
    if earlier:  # the fp32 gradients exist (earlier micro-batches): a layer adds its bf16 ones into them
        layer_grads = earlier + waiting + 2 * trained.layer
    else:  # the first layer's bf16 gradients and their fp32 casts, the head's gradient
        layer_grads = (waiting or 4 * trained.head) + (2 + 4) * trained.layer
    return {
        # the first layer's backward: its gradients, recomputed activations
        "layers": Breakdown(shards + copies, layer_grads, optimizer, activations + working, 0.0),
        # the last layer's backward: the same working set, every fp32 gradient but the embedding's
        # (with one micro-batch they appear as the layers go), one layer's input
        "last layer": Breakdown(
            shards + copies,
            (earlier or 4 * (trained.params - trained.embed)) + waiting + 2 * trained.layer,
            optimizer,
            last_layer + working,
            0.0,
        ),
        # the end of backward: every fp32 gradient but the embedding's, whose bf16 one (and a tied
        # head's) autograd still holds
        "backward end": Breakdown(
            shards + copies, 4 * trained.params + waiting + 2 * trained.head, optimizer, 0.0, 0.0
        ),
    }
