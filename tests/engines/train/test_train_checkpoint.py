"""Checkpoints: a run resumed from step 2 is bit-identical to an uninterrupted one (with and
without CPU optimizer offload); nothing is unpickled; incomplete, damaged or tampered folders are
refused by name; a full disk during a save leaves the previous checkpoint as it was."""

from __future__ import annotations

import errno
import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor
from train_engine_helpers import PolicyLoss, load_tiny, make_batch, make_tiny_checkpoint

from rlloom.algorithms.losses import loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.engines.train.native import checkpoint as native_checkpoint
from rlloom.engines.train.native.rng_state import rng_state, set_rng_state
from rlloom.engines.train.sealed import CheckpointError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), tie=True)


def step(engine, seed):
    batch = make_batch(5, seed=seed)
    # A loss that draws from the RNG, so a resume must restore the RNG state too.
    noise = torch.rand(()).item() + random.random()
    loss = PolicyLoss(batch, "seq-mean-token-mean")
    engine.train_step(
        batch,
        lambda lp, ent, rows: (loss(lp, ent, rows)[0] * (1 + noise), {}),
        loss_normalizer=loss_normalizer(batch.response_mask(), "seq-mean-token-mean"),
    )


@pytest.mark.parametrize("offload", [False, True])
def test_resume_is_bit_identical(ckpt, tmp_path, offload):
    cfg = TrainEngineConfig(
        lr=1e-3,
        weight_decay=0.1,
        warmup_steps=1,
        lr_schedule="cosine",
        optimizer_offload=offload,
        optimizer_offload_fraction=0.5,
    )
    torch.manual_seed(0)
    random.seed(0)
    straight = NativeTrainEngine(cfg, load_tiny(ckpt), total_steps=4)
    for s in range(2):
        step(straight, s)
    straight.save(str(tmp_path / "ckpt"))
    straight.save(str(tmp_path / "ckpt"))  # overwriting a checkpoint keeps it complete
    step(straight, 2)

    torch.manual_seed(123)  # the fresh engine starts from other RNG states
    random.seed(123)
    resumed = NativeTrainEngine(cfg, load_tiny(ckpt), total_steps=4)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.version == 2
    step(resumed, 2)
    for (name, a), (_, b) in zip(straight.module.named_parameters(), resumed.module.named_parameters()):
        assert torch.equal(a, b), name
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def params(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


class Payload:
    """Unpickling this object creates the file `marker` (what a crafted checkpoint file would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_damaged_or_tampered_checkpoints_are_refused_by_name(ckpt, tmp_path, monkeypatch):
    engine = NativeTrainEngine(TrainEngineConfig(lr=3e-2), load_tiny(ckpt))
    step(engine, 0)
    path = tmp_path / "ckpt"
    engine.save(str(path))
    saved = params(engine)
    step(engine, 1)  # the weights move away from the checkpoint's

    # A crafted pickle planted in the folder, and one put in place of a listed file: refused, never run.
    marker = tmp_path / "pwned"
    (path / "rng_rank0.pt").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="file 'rng_rank0.pt' is not in manifest.json"):
        engine.load(str(path))
    (path / "rng_rank0.pt").unlink()
    state_json = (path / "state.json").read_bytes()
    (path / "state.json").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="'state.json' has .* bytes"):
        engine.load(str(path))
    (path / "state.json").write_bytes(state_json)

    # Flipped bytes inside the weights (same size): refused by the sha256, naming the file.
    weights = path / "tensors_rank0.safetensors"
    good = weights.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    weights.write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match="'tensors_rank0.safetensors' does not match its sha256"):
        engine.load(str(path))
    weights.write_bytes(good)

    # The intact folder loads without any unpickling at all.
    def no_pickle(*args, **kwargs):
        raise AssertionError("a checkpoint load unpickled something")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, no_pickle)
    engine.load(str(path))
    monkeypatch.undo()
    assert not marker.exists()
    for name, t in params(engine).items():
        assert torch.equal(t, saved[name]), name

    (path / "chunks_rank0.json").unlink()
    with pytest.raises(CheckpointError, match="'chunks_rank0.json' listed in manifest.json is missing"):
        engine.load(str(path))
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        engine.load(str(path))


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(ckpt, tmp_path, monkeypatch):
    engine = NativeTrainEngine(TrainEngineConfig(lr=3e-2), load_tiny(ckpt))
    step(engine, 0)
    path = tmp_path / "ckpt"
    engine.save(str(path))
    saved = params(engine)
    step(engine, 1)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(native_checkpoint, "save_file", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device.*previous checkpoint is unchanged"):
        engine.save(str(path))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary folder left
    engine.load(str(path))
    assert engine.version == 1
    for name, t in params(engine).items():
        assert torch.equal(t, saved[name]), name
    # The public reader gives the CausalLM's own state dict.
    model = load_tiny(ckpt)
    model.load_state_dict(native_checkpoint.read_model_tensors(path))
    for name, t in model.named_parameters():
        assert torch.equal(t, saved[f"model.{name}"]), name


def test_rng_states_round_trip_through_json():
    random.gauss(0.0, 1.0)  # leaves a cached Gaussian in Python's and NumPy's generators
    np.random.standard_normal()
    state = json.loads(json.dumps(rng_state()))

    def draws():
        return torch.rand(3), random.random(), random.gauss(0.0, 1.0), np.random.standard_normal(3).tolist()

    expected = draws()
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    set_rng_state(state)
    got = draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("offload", [False, True])
def test_resume_is_bit_identical_on_cuda_bf16(ckpt, tmp_path, offload):
    # The CUDA paths: bf16 compute on compute copies (one GPU without FSDP), or with optimizer
    # offload FSDP2 on one rank; fused AdamW state on the GPU, CUDA RNG.
    cfg = TrainEngineConfig(
        lr=1e-3, weight_decay=0.1, optimizer_offload=offload, optimizer_offload_fraction=0.5
    )

    def build():
        return NativeTrainEngine(cfg, load_tiny(ckpt), device="cuda", dtype=torch.bfloat16)

    torch.manual_seed(0)
    straight = build()
    for s in range(2):
        step(straight, s)
    straight.save(str(tmp_path / "ckpt"))
    noise_after_save = torch.randn(4, device="cuda")
    step(straight, 2)
    torch.manual_seed(123)
    resumed = build()
    resumed.load(str(tmp_path / "ckpt"))
    assert torch.equal(torch.randn(4, device="cuda"), noise_after_save)  # the CUDA generator was restored
    step(resumed, 2)
    assert straight.sharded == offload
    for (name, a), (_, b) in zip(straight.module.named_parameters(), resumed.module.named_parameters()):
        assert torch.equal(_full(a), _full(b)), name
