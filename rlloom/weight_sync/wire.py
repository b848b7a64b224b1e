"""The broadcast sync's messages on the wire (broadcast.py describes the protocol): a rollout rank's
layout (what it holds and in which dtype), a sender's manifest (its buckets and their pieces), boxes
as JSON lists of [start, stop) per dimension."""

from __future__ import annotations

import json

import torch

from rlloom.weight_sync.reshard import Box, Bucket, RankLayout


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_layout(layout: RankLayout, dtype: torch.dtype) -> bytes:
    boxes = {n: [list(r) for r in b] for n, b in layout.boxes.items()}
    return json.dumps({"shapes": layout.shapes, "boxes": boxes, "dtype": dtype_name(dtype)}).encode()


def decode_layout(data: bytes) -> tuple[RankLayout, torch.dtype]:
    raw = json.loads(data)
    shapes = {n: tuple(s) for n, s in raw["shapes"].items()}
    layout = RankLayout(shapes=shapes, boxes={n: box_of(b) for n, b in raw["boxes"].items()})
    return layout, getattr(torch, raw["dtype"])


def box_of(raw: list[list[int]]) -> Box:
    return tuple((a, b) for a, b in raw)


def encode_manifest(version: int, dtype: torch.dtype, route: tuple[Bucket, ...]) -> bytes:
    buckets = [[[p.name, [list(r) for r in p.box]] for p in b.pieces] for b in route]
    return json.dumps({"version": version, "dtype": dtype_name(dtype), "buckets": buckets}).encode()
