"""In-process weight sync into a native rollout engine (fused projections): the rollout equals the
training weights after the 1st and the 10th sync while the trainer steps at a large learning rate;
a sync that is not whole leaves the rollout on its previous weights and version; the `sync` config."""

from __future__ import annotations

import pytest
import torch

from rlloom.config import ConfigError, load_config
from rlloom.weight_sync.base import WeightSyncError, checksum_enabled
from rlloom.weight_sync.checksum import rank_layout, same_bits
from rlloom.weight_sync.inplace import sync_inplace
from tests.weight_sync.sync_helpers import TrainSide, rollout_engine, rollout_weights


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("kind", ["dense", "moe", "mla"])
def test_rollout_equals_training_after_1st_and_10th_sync(kind):
    train, engine = TrainSide(kind), rollout_engine(kind)
    for sync in range(1, 11):
        train.step()
        report = sync_inplace(train, engine, bucket_bytes=4 << 10, checksum=True)
        if sync in (1, 10):
            assert _equal(rollout_weights(engine), train.weights())
            assert engine.policy_version == report.version == sync
            assert report.num_tensors == len(train.weights())


@pytest.fixture
def synced():
    train, engine = TrainSide("moe"), rollout_engine("moe")
    train.step()
    sync_inplace(train, engine, bucket_bytes=4 << 10)
    train.step()
    return train, engine, rollout_weights(engine)


def _assert_kept(engine, before) -> None:
    assert _equal(rollout_weights(engine), before) and engine.policy_version == 1


def test_missing_tensor_keeps_previous_version(synced):
    train, engine, before = synced
    train.skip = {"model.layers.1.mlp.experts.3.down_proj.weight"}
    with pytest.raises(
        WeightSyncError, match=r"experts\.3\.down_proj.*keeps its previous weights \(version 1\)"
    ):
        sync_inplace(train, engine, bucket_bytes=4 << 10)
    _assert_kept(engine, before)


def test_source_failing_midway_keeps_previous_version(synced):
    train, engine, before = synced
    buckets = train.named_weights

    def failing(**kwargs):
        for i, bucket in enumerate(buckets(**kwargs)):
            if i == 3:
                raise RuntimeError("lost a rank while gathering")
            yield bucket

    train.named_weights = failing
    with pytest.raises(WeightSyncError, match="raised RuntimeError: lost a rank.*keeps its previous weights"):
        sync_inplace(train, engine, bucket_bytes=4 << 10)
    _assert_kept(engine, before)


def test_checksum_catches_a_loader_that_copies_wrong_values(synced, monkeypatch):
    train, engine, _ = synced
    load = engine.update_weights

    def lossy(named_tensors, version):
        load([(n, t + 1e-3 if n.endswith("q_proj.weight") else t) for n, t in named_tensors], version)

    monkeypatch.setattr(engine, "update_weights", lossy)
    with pytest.raises(WeightSyncError, match="2 tensors differ from those sent.*no longer trustworthy"):
        sync_inplace(train, engine, bucket_bytes=4 << 10, checksum=True)
    sync_inplace(train, engine, bucket_bytes=4 << 10, checksum=False)  # without checksums it goes unseen


def test_sync_config_and_checksum_modes():
    cfg = load_config("arithmetic_smoke", ["sync.bucket_mb=64", "sync.checksum=never", "sync.timeout_s=30"])
    assert (cfg.sync.bucket_mb, cfg.sync.checksum, cfg.sync.timeout_s) == (64, "never", 30.0)
    with pytest.raises(
        ConfigError, match=r"^sync.bucket_mb=0 is invalid: must be >= 1 \(MiB\). Fix: use e.g. 256.$"
    ):
        load_config("arithmetic_smoke", ["sync.bucket_mb=0"])
    with pytest.raises(ConfigError, match="sync.checksum"):
        load_config("arithmetic_smoke", ["sync.checksum=sometimes"])
    assert checksum_enabled("auto", torch.device("cpu")) and not checksum_enabled(
        "auto", torch.device("cuda")
    )
    assert checksum_enabled("always", torch.device("cuda")) and not checksum_enabled(
        "never", torch.device("cpu")
    )


def test_rank_layout_reads_the_engine_slices():
    engine = rollout_engine("dense")
    layout = rank_layout(engine)
    assert set(layout.shapes) == set(rollout_weights(engine))
    assert all(box == tuple((0, n) for n in layout.shapes[name]) for name, box in layout.boxes.items())
    name = "model.layers.0.self_attn.o_proj.weight"
    sharded = rollout_engine("dense")
    sharded.weight_shard_slices = lambda: {name: (1, 16, 16)}  # as rank 1 of a tp=2 engine says
    assert rank_layout(sharded).boxes[name] == ((0, 32), (16, 32))


def test_same_bits_compares_bytes():
    a = torch.tensor([1.0, float("nan"), -0.0])
    assert same_bits(a, a.clone()) and same_bits(torch.tensor(3), torch.tensor(3))
    assert not same_bits(a, torch.tensor([1.0, float("nan"), 0.0]))  # -0.0 and 0.0 differ in bits
    assert not same_bits(a, a.double()) and not same_bits(a, a[:2])


def test_fp32_training_into_bf16_rollout_casts_in_the_copy():
    """A bf16 rollout from fp32 training weights: the export yields the unsharded fp32 tensors
    uncast (`lazy_cast`) and the copy into the rollout casts them, bit for bit what a cast gives;
    the report counts the bf16 bytes that moved."""
    train, engine = TrainSide("moe"), rollout_engine("moe", dtype=torch.bfloat16)
    train.step()
    report = sync_inplace(train, engine, bucket_bytes=4 << 10, dtype=torch.bfloat16, checksum=True)
    want = {n: t.to(torch.bfloat16) for n, t in train.weights().items()}
    got = rollout_weights(engine)
    assert all(t.dtype == torch.bfloat16 for t in got.values()) and _equal(got, want)
    assert report.num_bytes == sum(t.numel() * 2 for t in want.values())
