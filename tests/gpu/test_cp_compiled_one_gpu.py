"""Context parallelism's key/value all-gather inside compiled, checkpointed decoder layers, on one
GPU: rank 0 of cp=2 runs alone over torch's fake process group (collectives move no data, so the
values mean nothing; the tensors' shapes and lifetimes are the real ones).

On torch 2.11 (the GPU machines'), torch's functional all-gather there was kept for the backward
despite activation checkpointing (cp x the local keys and values a layer: 8.5 GiB of a 64k-token
cp=2 step of Qwen3-8B), and the backward gathered again without waiting for it, leaving every
layer's output with c10d. `rlloom.parallel.distributed.all_gather_rows` is an opaque custom op: the
compiled layer recomputes it in the backward and keeps only the layer's input. Its first version
looked the group's size up when traced, so torch's on-disk compile cache (keyed by the graph, whose
group name was the same) gave a cp=4 run the cp=2 run's code, which failed on the gathered size:
here cp=2 and then cp=4 share one cache directory. The CPU tests cannot see this (layers compile
on CUDA only). Skipped without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
import torch._C._distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, "benchmarks")
from bench_train_parallel import TINY_MOE, packed_batch, policy_loss, random_model
from rlloom.algorithms.losses import loss_normalizer
from rlloom.config import TrainEngineConfig
from rlloom.engines.train.native import NativeTrainEngine
from rlloom.parallel import ParallelDims

cp = int(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)
device = torch.device("cuda", 0)
config = TINY_MOE | {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "intermediate_size": 128}
seq_len = 4096
cfg = TrainEngineConfig(lr=1e-6, max_tokens_per_micro_batch=seq_len, activation_checkpointing="full",
                        share_prompts=False, compile=True)
engine = NativeTrainEngine(cfg, random_model(config, device), device=device,
                           parallel_dims=ParallelDims(world_size=cp, cp=cp))
batch = packed_batch(1, seq_len, config["vocab_size"])
mask = batch.response_mask()
loss_fn = policy_loss(torch.ones(len(batch)), mask)
kv_width = 2 * config["head_dim"]  # keys and values side by side
saved = []
def pack(t):
    saved.append(list(t.shape))
    return t
for step in range(2):
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.train_step(batch, loss_fn, loss_normalizer=loss_normalizer(mask, "token-mean"))
    torch.cuda.synchronize()
gathered = [s for s in saved if len(s) == 3 and s[-1] == kv_width and s[0] >= seq_len]
print(json.dumps({"gathered_saved": gathered, "unwaited": c10d._get_work_registry_size(),
                  "saved": len(saved)}))
"""


def test_compiled_cp_layer_keeps_no_gathered_keys_and_waits_for_every_collective(tmp_path):
    env = os.environ | {"RLLOOM_COMPILE_CACHE": str(tmp_path / "compile")}
    for cp in (2, 4):  # one compile cache: cp=4 must not run cp=2's code
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(cp)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
            env=env,
        )
        assert done.returncode == 0, f"cp={cp}: {done.stderr[-3000:]}"
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["saved"] > 0, result  # the hooks saw the compiled layers' saved tensors
        assert result["gathered_saved"] == [], (cp, result)
        assert result["unwaited"] == 0, (cp, result)
