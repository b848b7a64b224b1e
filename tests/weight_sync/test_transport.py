"""`sync.transport`: `auto` is the transport the placement runs (colocated in place, a separate
rollout pool by broadcast), an explicit one that the placement runs is kept, and the cluster runs
what `weight_sync.build.transport` says (the refusals of impossible pairs are CLI cases in
tests/config/test_config_bad_input.py)."""

from __future__ import annotations

import pytest

from rlloom.config import load_config
from rlloom.weight_sync.build import transport

SEPARATE = ["cluster.mode=ray", "cluster.placement=separate", "cluster.rollout_workers=1"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], "inplace"),
        (["sync.transport=inplace"], "inplace"),
        (SEPARATE, "broadcast"),
        ([*SEPARATE, "sync.transport=broadcast"], "broadcast"),
    ],
)
def test_transport_follows_the_placement(overrides, expected):
    assert transport(load_config("arithmetic_smoke", overrides)) == expected
