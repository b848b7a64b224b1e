"""The persistent compile cache (rlloom/compile_cache.py): where it points, who wins, and that a
second process loads what the first one compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default_cache_dir

from rlloom.compile_cache import cache_env

ROOT = Path(__file__).parents[1]


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


_CHILD = """
import json, torch
from rlloom.compile_cache import enable_compile_cache
from rlloom.parallel.compile import apply_compile
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import cache_dir

class Layer(torch.nn.Module):
    def forward(self, x):
        return torch.sin(x) * 2 + 1

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer()])

model = Model()
apply_compile(model)  # the training compile, which sets the cache up first
model.layers[0](torch.randn(8))
print(json.dumps({"dir": cache_dir(), "again": str(enable_compile_cache()),
                  "hit": counters["inductor"]["fxgraph_cache_hit"]}))
"""


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    env.update(RLLOOM_COMPILE_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.splitlines()[-1]))
    assert runs[0]["dir"] == runs[0]["again"] == str(tmp_path / "cache")
    assert (runs[0]["hit"], runs[1]["hit"]) == (0, 1)
    assert any((tmp_path / "cache" / "fxgraph").rglob("*"))
