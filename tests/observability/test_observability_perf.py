"""MFU formulas against hand computations; StageTimer and memory metrics on CPU."""

import time

import pytest

from rlloom.observability.memory import (
    allocation_site,
    memory_metrics,
    peak_holders,
    peak_memory_gib,
    peak_rss_gib,
)
from rlloom.observability.metrics import Max
from rlloom.observability.mfu import mfu, packed_batch_flops, transformer_flops_per_token
from rlloom.observability.timers import StageTimer


def test_flops_per_token_by_hand():
    # N = 1e8, L = 12, A = 768, T = 1024: 6N = 6e8; 12*L*A*T = 113_246_208 (full), half causal.
    assert transformer_flops_per_token(10**8, 12, 768, 1024, causal=False) == 600_000_000 + 113_246_208
    assert transformer_flops_per_token(10**8, 12, 768, 1024) == 600_000_000 + 56_623_104
    assert transformer_flops_per_token(10**8, 12, 768, 1024, backward=False) == pytest.approx(
        (600_000_000 + 56_623_104) / 3
    )


def test_mfu_by_hand():
    # 1e5 tokens in 10 s at 656_623_104 FLOPs/token on one H100 (989e12 FLOP/s).
    assert mfu(1e5, 10.0, 656_623_104) == pytest.approx(6.56623104e13 / 9.89e15)
    assert mfu(1e5, 10.0, 656_623_104, peak_flops=1e12, num_devices=4) == pytest.approx(6.56623104e13 / 4e13)
    with pytest.raises(ValueError, match="seconds=0"):
        mfu(1, 0.0, 1.0)


def test_packed_batch_flops_by_hand_and_consistent():
    # N=10, L=1, A=4: a sequence of length s costs 6*10*s + 6*1*4*s^2 = 60 s + 24 s^2.
    assert packed_batch_flops([2, 3], 10, 1, 4) == (120 + 96) + (180 + 216)
    # Equal lengths reduce to tokens * flops_per_token at that length.
    assert packed_batch_flops([128] * 5, 1000, 2, 64) == 5 * 128 * transformer_flops_per_token(
        1000, 2, 64, 128
    )
    # Attention makes one long sequence dearer than many short ones of the same token count.
    assert packed_batch_flops([1000], 10, 2, 64) > packed_batch_flops([100] * 10, 10, 2, 64)
    with pytest.raises(ValueError, match="seq_len=-1"):
        packed_batch_flops([-1], 10, 1, 4)


def test_stage_timer_sums_repeats_and_names_keys():
    timer = StageTimer(sync_cuda=False)
    for _ in range(2):
        with timer("generate"):
            time.sleep(0.01)
    with timer("train"):
        pass
    seconds = timer.seconds()
    assert set(seconds) == {"time/generate_s", "time/train_s"}
    assert 0.02 <= seconds["time/generate_s"] < 1.0
    assert timer.metrics()["time/train_s"] == Max(seconds["time/train_s"])
    with pytest.raises(ValueError, match="stage name"):
        with timer("a/b"):
            pass
    timer.reset()
    assert timer.seconds() == {}


def test_stage_timer_records_when_body_raises():
    timer = StageTimer(sync_cuda=False)
    with pytest.raises(RuntimeError):
        with timer("reward"):
            raise RuntimeError("boom")
    assert "time/reward_s" in timer.seconds()


def test_memory_on_cpu():
    rss = peak_rss_gib()
    assert 0.01 < rss < 1024  # a Python process with torch holds tens of MB at least
    assert peak_memory_gib("cpu") == rss
    metrics = memory_metrics("cpu")
    assert set(metrics) == {"memory/peak_rss_gib"} and isinstance(metrics["memory/peak_rss_gib"], Max)


def _alloc(addr: int, size: int, filename: str, line: int = 1) -> dict:
    frames = [{"filename": "/x/site-packages/torch/foo.py", "line": 9, "name": "op"}]
    frames.append({"filename": filename, "line": line, "name": "fn"})
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def _free(addr: int, action: str = "free_completed") -> dict:
    return {"action": action, "addr": addr}


def test_peak_holders_replays_the_trace_to_its_peak():
    cp, head = "/w/rlloom/parallel/cp.py", "/w/rlloom/models/logprobs.py"
    events = [
        _free(99),  # allocated before the recording: ignored
        _alloc(1, 100, cp, 10),
        _alloc(2, 50, head, 20),
        _free(2, "free_requested"),  # still counted until free_completed
        _alloc(3, 30, cp, 10),  # the peak: 1 + 2 + 3 = 180
        _free(2),
        _alloc(4, 40, head, 21),  # 170 (the peak, had 2 been freed at its request)
        _free(1),
        _alloc(5, 80, cp, 11),  # 150
    ]
    peak, holders = peak_holders(events)
    assert peak == 180
    assert holders == [("rlloom/parallel/cp.py:10 fn", 130), ("rlloom/models/logprobs.py:20 fn", 50)]
    # a trace without free_completed events (older allocators): free_requested frees
    events = [_alloc(1, 10, cp), _free(1, "free_requested"), _alloc(2, 5, cp)]
    assert peak_holders(events) == (10, [("rlloom/parallel/cp.py:1 fn", 10)])


def test_allocation_site_prefers_rlloom_frames():
    frames = [
        {"filename": "/venv/site-packages/torch/nn/functional.py", "line": 5, "name": "linear"},
        {"filename": "/repo/rlloom/observability/memory.py", "line": 7, "name": "rec"},
        {"filename": "/repo/rlloom/models/attention.py", "line": 42, "name": "forward"},
    ]
    assert allocation_site(frames) == "rlloom/models/attention.py:42 forward"
    assert allocation_site(frames[:1]) == "torch/nn/functional.py:5 linear"
    assert allocation_site([]) == "(no stack)"
    # torch alone: its innermost frame and the caller's function (FSDP's gather and reduce buffers
    # are made on one line)
    fsdp = [
        {"filename": "/venv/site-packages/torch/fsdp/_fsdp_collectives.py", "line": 59, "name": "allocate"},
        {
            "filename": "/venv/site-packages/torch/fsdp/_fsdp_collectives.py",
            "line": 522,
            "name": "foreach_reduce",
        },
    ]
    assert allocation_site(fsdp) == "torch/fsdp/_fsdp_collectives.py:59 allocate < foreach_reduce"
    # code torch.compile generated into rlloom's cache (~/.cache/rlloom/compile) is not rlloom's source
    generated = "/root/.cache/rlloom/compile/3x/c3xw5uv6wew35t7pir44nfugsizeczwuxdatdptoiosyzkyvxp57.py"
    frames = [{"filename": generated, "line": 739, "name": "call"}, *frames]
    site = "compiled 3x/c3xw5uv6wew35t7pir44nfugsizeczwuxdatdptoiosyzkyvxp57.py:739 call"
    assert allocation_site(frames) == site
