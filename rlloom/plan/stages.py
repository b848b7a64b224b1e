"""Pipeline stages: which decoder layers each stage holds, and the kinds of layer in a range.

`stage_ranges(num_layers, pp, first, last)` splits the layers (first and last stage sizes given,
the middle ones even); `layer_kinds(costs, layers)` returns the kinds of layer (dense, MoE) in a
range with their counts, so a stage costs O(1) to evaluate: the search evaluates tens of thousands.
"""

from __future__ import annotations

from rlloom.plan.counts import LayerCost, ModelCosts


def stage_ranges(num_layers: int, pp: int, first: int = 0, last: int = 0) -> list[range]:
    """Decoder layers of each pipeline stage: first and last as given (0: even), the middle ones even."""
    if pp == 1:
        return [range(num_layers)]
    if pp == 2:  # two stages: the one not given holds the rest (as parallel/pp_stages.py splits)
        first = first or num_layers - (last or num_layers // 2)
        last = last or num_layers - first
    first = first or num_layers // pp
    last = last or num_layers // pp
    rest = num_layers - first - last
    if first < 1 or last < 1 or rest < (pp - 2) or (pp == 2 and rest != 0):
        raise ValueError(
            f"pipeline split first={first} last={last} is impossible for {num_layers} layers, pp={pp}"
        )
    bounds = [0, first]
    for i in range(pp - 2):
        # extra layers go to the later middle stages, which hold fewer micro-batches in flight
        bounds.append(bounds[-1] + rest // (pp - 2) + (1 if i >= (pp - 2) - rest % (pp - 2) else 0))
    bounds.append(num_layers)
    return [range(bounds[i], bounds[i + 1]) for i in range(pp)]


_KINDS: dict[int, tuple[ModelCosts, list[int], LayerCost | None, LayerCost | None]] = {}


def layer_kinds(costs: ModelCosts, layers: range) -> list[tuple[LayerCost, int]]:
    """The kinds of layer in `layers` (dense, MoE) with their counts (layers of one kind cost the same)."""
    hit = _KINDS.get(id(costs))
    if hit is None or hit[0] is not costs:  # the cached object pins its id
        prefix = [0]
        for c in costs.layers:
            prefix.append(prefix[-1] + c.is_moe)
        dense = next((c for c in costs.layers if not c.is_moe), None)
        moe = next((c for c in costs.layers if c.is_moe), None)
        assert all(c == (moe if c.is_moe else dense) for c in costs.layers)
        if len(_KINDS) > 16:
            _KINDS.clear()
        hit = _KINDS[id(costs)] = (costs, prefix, dense, moe)
    _, prefix, dense, moe = hit
    num_moe = prefix[layers.stop] - prefix[layers.start]
    kinds = [(dense, len(layers) - num_moe), (moe, num_moe)]
    return [(c, n) for c, n in kinds if n and c is not None]
