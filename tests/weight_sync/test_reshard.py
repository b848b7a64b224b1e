"""The reshard plan on its own (no processes): every element of every rollout rank's slice is sent
exactly once, by a training rank that holds it; experts go only where they are held; buckets keep
to their size; layouts that disagree are refused with a one-line error."""

from __future__ import annotations

import pytest
import torch

from rlloom.weight_sync.reshard import (
    RankLayout,
    RolloutLayout,
    TrainLayout,
    chunk_box,
    full_box,
    intersect,
    plan_reshard,
)

V, D, HD, W, E = 10, 6, 8, 4, 4  # vocab, hidden, heads x head_dim, expert width, experts


def moe_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {"embed": (V, D), "q_proj": (HD, D), "o_proj": (D, HD), "norm": (D,), "router": (E, D)}
    for e in range(E):
        shapes |= {f"experts.{e}.gate": (W, D), f"experts.{e}.up": (W, D), f"experts.{e}.down": (D, W)}
    return shapes


def ep2_fsdp_layout(shapes: dict[str, tuple[int, ...]]) -> TrainLayout:
    """4 training ranks: dense tensors FSDP-sharded (dim 0) over all 4; ep=2: experts 0-1 on ranks
    {0, 1}, experts 2-3 on ranks {2, 3}, each FSDP-sharded over its 2 ranks."""
    placement = {n: (0, 1, 2, 3) for n in shapes if not n.startswith("experts.")}
    placement |= {
        n: (0, 1) if int(n.split(".")[1]) < 2 else (2, 3) for n in shapes if n.startswith("experts.")
    }
    return TrainLayout.sharded(shapes, placement)


def tp2_dims(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Column-parallel q and expert gate/up, row-parallel o and expert down, vocab-parallel embedding."""
    dims = {"embed": 0, "q_proj": 0, "o_proj": 1}
    return dims | {n: 1 if n.endswith("down") else 0 for n in shapes if n.startswith("experts.")}


def tp2_rollout(shapes: dict[str, tuple[int, ...]]) -> RolloutLayout:
    return RolloutLayout.split(shapes, 2, tp2_dims(shapes))


def coverage(plan, shapes, tp: int) -> dict[tuple[str, int], torch.Tensor]:
    """How many times each element reaches each tp rank."""
    counts = {(n, r): torch.zeros(s, dtype=torch.int64) for n, s in shapes.items() for r in range(tp)}
    for bucket in plan.buckets:
        for piece in bucket.pieces:
            counts[(piece.name, bucket.tp_rank)][tuple(slice(a, b) for a, b in piece.box)] += 1
    return counts


def test_ep2_fsdp_to_tp2_each_piece_once_to_exactly_its_holders():
    shapes = moe_shapes()
    train, rollout = ep2_fsdp_layout(shapes), tp2_rollout(shapes)
    plan = plan_reshard(train, rollout, bucket_numel=40)
    for (name, rank), count in coverage(plan, shapes, 2).items():
        expected = torch.zeros_like(count)
        expected[tuple(slice(a, b) for a, b in rollout.box(name, rank))] = 1
        assert torch.equal(count, expected), (name, rank)
    for bucket in plan.buckets:
        for piece in bucket.pieces:  # the sender holds what it sends
            held = [box for rank, box in train.owners[piece.name] if rank == bucket.sender]
            assert any(intersect(piece.box, box) == piece.box for box in held)
            if piece.name.startswith("experts."):  # experts only from their EP rank's pair
                assert bucket.sender in ((0, 1) if int(piece.name.split(".")[1]) < 2 else (2, 3))
    # sizes add up: split tensors once over the two tp ranks, the replicated norm and router twice
    total = sum(b.numel for b in plan.buckets)
    copies = {n: 1 if n in tp2_dims(shapes) else 2 for n in shapes}
    assert total == sum(torch.Size(s).numel() * copies[n] for n, s in shapes.items())
    assert total == sum(plan.sent_numel(s) for s in range(4))


def test_buckets_keep_to_their_size_and_the_training_order():
    shapes = moe_shapes()
    plan = plan_reshard(ep2_fsdp_layout(shapes), tp2_rollout(shapes), bucket_numel=20)
    order = list(shapes)
    for sender in range(4):
        for rank in range(2):
            route = plan.route(sender, rank)
            names = [p.name for b in route for p in b.pieces]
            assert names == sorted(names, key=order.index)
            assert all(b.numel <= 20 or len(b.pieces) == 1 for b in route)


def test_experts_reach_only_the_rollout_ranks_that_hold_them():
    shapes = moe_shapes()
    holders = {n: (int(n.split(".")[1]) % 2,) for n in shapes if n.startswith("experts.")}
    rollout = RolloutLayout.split(shapes, 2, {"embed": 0}, holders)
    plan = plan_reshard(ep2_fsdp_layout(shapes), rollout, bucket_numel=1000)
    for bucket in plan.buckets:
        for piece in bucket.pieces:
            if piece.name.startswith("experts."):
                assert bucket.tp_rank == int(piece.name.split(".")[1]) % 2
    for (name, rank), count in coverage(plan, shapes, 2).items():
        if name.startswith("experts."):  # whole (from its two FSDP shards) on its holder, absent elsewhere
            assert bool((count == (rank == int(name.split(".")[1]) % 2)).all())


def test_replicas_send_once_and_share_the_work():
    shapes = moe_shapes()
    plan = plan_reshard(TrainLayout.replicated(shapes, 2), RolloutLayout.split(shapes, 1), bucket_numel=64)
    for count in coverage(plan, shapes, 1).values():
        assert bool((count == 1).all())
    sent = [plan.sent_numel(s) for s in (0, 1)]
    assert min(sent) > 0.4 * sum(sent)


def test_chunk_box_follows_torch_chunk():
    for n, parts in [(5, 2), (3, 4), (8, 3)]:
        chunks = torch.arange(n).chunk(parts)
        for i in range(parts):
            (start, stop), _ = chunk_box((n, 2), 0, i, parts)
            expected = chunks[i].tolist() if i < len(chunks) else []
            assert list(range(start, stop)) == expected


def test_layouts_that_disagree_are_refused():
    shapes = moe_shapes()
    with pytest.raises(ValueError, match="'q_proj' has shape .* Fix:"):
        plan_reshard(
            TrainLayout.replicated(shapes, 1),
            RolloutLayout.split(shapes | {"q_proj": (1, 1)}, 1),
            bucket_numel=8,
        )
    with pytest.raises(ValueError, match="lacks \\['extra'\\]"):
        plan_reshard(
            TrainLayout.replicated(shapes, 1),
            RolloutLayout.split(shapes | {"extra": (2,)}, 1),
            bucket_numel=8,
        )
    gap = TrainLayout(shapes={"w": (4, 2)}, owners={"w": ((0, ((0, 2), (0, 2))),)})
    with pytest.raises(ValueError, match="do not tile"):
        plan_reshard(gap, RolloutLayout.split({"w": (4, 2)}, 1), bucket_numel=8)


def test_each_rank_states_its_own_boxes_replicated_kv_heads_and_padded_vocab():
    """As a tensor-parallel engine reports them (`weight_shard_slices`): tp=4 over 2 KV heads (two
    ranks share each head) and a vocabulary of 10 rows padded to 8 per rank (rank 1 holds 2)."""
    shapes = {"k_proj": (4, D), "embed": (V, D)}
    boxes = [{"k_proj": ((2 * (r // 2), 2 * (r // 2) + 2), (0, D))} for r in range(4)]
    boxes[0]["embed"], boxes[1]["embed"] = ((0, 8), (0, D)), ((8, V), (0, D))
    rollout = RolloutLayout(ranks=tuple(RankLayout(shapes=shapes, boxes=b) for b in boxes))
    plan = plan_reshard(
        TrainLayout.sharded(shapes, {"k_proj": (0, 1), "embed": (0, 1)}), rollout, bucket_numel=16
    )
    for (name, rank), count in coverage(plan, shapes, 4).items():
        expected = torch.zeros_like(count)
        if name in boxes[rank]:
            expected[tuple(slice(a, b) for a, b in boxes[rank][name])] = 1
        assert torch.equal(count, expected), (name, rank)


def test_owner_only_layout_sends_each_expert_from_its_ep_rank_and_balances_the_rest():
    """Skewed ownership: 3 senders, EP ranks (0, 0, 1): experts 0-2 on EP rank 0 (senders 0 and 1,
    replicas after the expert-FSDP gather), expert 3 alone on EP rank 1 (sender 2)."""
    shapes = moe_shapes()
    expert_ep = {n: 0 if int(n.split(".")[1]) < 3 else 1 for n in shapes if n.startswith("experts.")}
    train = TrainLayout.owned(shapes, expert_ep, (0, 0, 1))
    assert list(train.shapes) == list(shapes)
    for name, owners in train.owners.items():
        ranks = {r for r, _ in owners}
        assert ranks == ({0, 1} if expert_ep.get(name) == 0 else {2} if name in expert_ep else {0, 1, 2})
        assert all(box == tuple((0, n) for n in shapes[name]) for _, box in owners)
    plan = plan_reshard(train, tp2_rollout(shapes), bucket_numel=40)
    for (name, rank), count in coverage(plan, shapes, 2).items():
        expected = torch.zeros_like(count)
        expected[tuple(slice(a, b) for a, b in tp2_rollout(shapes).box(name, rank))] = 1
        assert torch.equal(count, expected), (name, rank)
    sent_by = {}
    for bucket in plan.buckets:
        for piece in bucket.pieces:
            sent_by.setdefault(piece.name, set()).add(bucket.sender)
    for name, ep_rank in expert_ep.items():
        assert sent_by[name] <= ({0, 1} if ep_rank == 0 else {2}), name
    # the replicas of EP rank 0 share its experts; sender 2 (one expert) takes more dense tensors
    assert {s for n, ranks in sent_by.items() if expert_ep.get(n) == 0 for s in ranks} == {0, 1}
    sent = [plan.sent_numel(s) for s in range(3)]
    assert max(sent) < 1.5 * min(sent), sent


def test_owner_only_layout_refuses_an_ep_rank_no_sender_holds():
    shapes = moe_shapes()
    expert_ep = {n: int(n.split(".")[1]) // 2 for n in shapes if n.startswith("experts.")}
    with pytest.raises(ValueError, match="lives on EP rank 1, but the senders hold EP ranks \\[0\\].*Fix:"):
        TrainLayout.owned(shapes, expert_ep, (0,))


def test_owner_only_layout_under_tp2_gives_each_sender_its_tp_shard_and_sends_it_from_there():
    """4 senders: tp=2 x 2 FSDP replicas (tp ranks 0, 1, 0, 1), no expert parallelism. The
    column-parallel q, row-parallel o and vocabulary-parallel embedding are held as their tp rank's
    chunk (replicated over the two senders of it); the norm, router and experts whole everywhere."""
    shapes = moe_shapes()
    tp_shards = {"embed": (0, 2), "q_proj": (0, 2), "o_proj": (1, 2)}
    tp_ranks = (0, 1, 0, 1)
    train = TrainLayout.owned(shapes, {}, (0, 0, 0, 0), tp_shards=tp_shards, sender_tp_ranks=tp_ranks)
    assert train.owners["q_proj"] == tuple((s, ((4 * t, 4 * t + 4), (0, D))) for s, t in enumerate(tp_ranks))
    assert train.owners["o_proj"] == tuple((s, ((0, D), (4 * t, 4 * t + 4))) for s, t in enumerate(tp_ranks))
    assert train.owners["embed"] == tuple((s, ((5 * t, 5 * t + 5), (0, D))) for s, t in enumerate(tp_ranks))
    for name in set(shapes) - set(tp_shards):
        assert train.owners[name] == tuple((s, full_box(shapes[name])) for s in range(4))
    for rollout in (RolloutLayout.split(shapes, 1), tp2_rollout(shapes)):
        plan = plan_reshard(train, rollout, bucket_numel=24)
        for (name, rank), count in coverage(plan, shapes, rollout.tp).items():
            expected = torch.zeros_like(count)
            expected[tuple(slice(a, b) for a, b in rollout.box(name, rank))] = 1
            assert torch.equal(count, expected), (name, rank)
        for bucket in plan.buckets:
            for piece in bucket.pieces:
                held = dict(train.owners[piece.name])[bucket.sender]
                assert intersect(piece.box, held) == piece.box  # sent only by a sender that holds it
                if piece.name in tp_shards and rollout.tp == 2:  # same split: each rank from its peers
                    assert tp_ranks[bucket.sender] == bucket.tp_rank
        sent = [plan.sent_numel(s) for s in range(4)]
        assert min(sent) > 0.15 * sum(sent), sent  # the replicas of each tp rank share the work


def test_owner_only_layout_refuses_a_tp_rank_no_sender_holds():
    shapes = moe_shapes()
    with pytest.raises(ValueError, match="senders hold tp ranks \\[0\\], none holds tp ranks \\[1\\].*Fix:"):
        TrainLayout.owned(shapes, {}, (0,), tp_shards={"q_proj": (0, 2)}, sender_tp_ranks=(0,))
