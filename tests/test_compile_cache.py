"""The persistent compile cache (rlloom/compile_cache.py): where it points, who wins, and that a
second process loads what the first one compiled."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from procs import spawn
from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default_cache_dir

from rlloom.compile_cache import cache_env


def test_default_directory_is_under_the_user_cache_not_tmp():
    assert cache_env({"XDG_CACHE_HOME": "/x/cache"}) == {
        "TORCHINDUCTOR_CACHE_DIR": "/x/cache/rlloom/compile",
        "TRITON_CACHE_DIR": "/x/cache/rlloom/compile/triton",
    }
    home = cache_env({})["TORCHINDUCTOR_CACHE_DIR"]
    assert home == str(Path.home() / ".cache" / "rlloom" / "compile")
    # torch._dynamo's import writes torch's /tmp default into the environment: that is not a choice
    default = {"TORCHINDUCTOR_CACHE_DIR": torch_default_cache_dir()}
    assert cache_env(default)["TORCHINDUCTOR_CACHE_DIR"] == home


def test_rlloom_setting_overrides_the_default_and_torch_settings_win():
    ours = {"RLLOOM_COMPILE_CACHE": "/ours", "XDG_CACHE_HOME": "/x"}
    assert cache_env(ours) == {"TORCHINDUCTOR_CACHE_DIR": "/ours", "TRITON_CACHE_DIR": "/ours/triton"}
    assert cache_env({**ours, "TORCHINDUCTOR_CACHE_DIR": "/user"}) == {
        "TORCHINDUCTOR_CACHE_DIR": "/user",
        "TRITON_CACHE_DIR": "/user/triton",
    }
    assert cache_env({**ours, "TRITON_CACHE_DIR": "/tri"})["TRITON_CACHE_DIR"] == "/tri"


class _Layer(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2 + 1


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer()])


def _compile_once(rank: int, out: str) -> None:
    """A fresh process (forked from the test's fork server, which imported torch but never compiled):
    the training compile, which sets the cache up first, then what it found."""
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from rlloom.compile_cache import enable_compile_cache
    from rlloom.parallel.compile import apply_compile

    model = _Model()
    apply_compile(model)
    model.layers[0](torch.randn(8))
    found = {"dir": cache_dir(), "again": str(enable_compile_cache())}
    Path(out).write_text(json.dumps(found | {"hit": counters["inductor"]["fxgraph_cache_hit"]}))


def test_a_second_process_loads_what_the_first_compiled(tmp_path, monkeypatch):
    for name in [k for k in os.environ if k.startswith(("TORCHINDUCTOR_", "TRITON_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("RLLOOM_COMPILE_CACHE", str(tmp_path / "cache"))
    runs = []
    for i in range(2):  # one process after the other
        spawn(_compile_once, args=(str(tmp_path / f"run{i}.json"),), nprocs=1)
        runs.append(json.loads((tmp_path / f"run{i}.json").read_text()))
    assert runs[0]["dir"] == runs[0]["again"] == str(tmp_path / "cache")
    assert (runs[0]["hit"], runs[1]["hit"]) == (0, 1)
    assert any((tmp_path / "cache" / "fxgraph").rglob("*"))
