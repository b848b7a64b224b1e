"""The embedded-model cache is built atomically and once, even with concurrent or crashing builders.

The real GGUF conversion is replaced by a fake `_build` that writes a marker file, so the test checks
the folder protocol (temp folder, marker, rename, lock) in milliseconds.
"""

from __future__ import annotations

import threading
import time

import pytest

from rlloom.models import embedded


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLLOOM_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "gguf_path", lambda: tmp_path / "fake.gguf")
    return tmp_path


def test_crashed_build_leaves_nothing_that_loads(fake_cache, monkeypatch):
    def crash(_gguf, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed halfway")

    monkeypatch.setattr(embedded, "_build", crash)
    with pytest.raises(RuntimeError):
        embedded.ensure_embedded_model()
    assert not (fake_cache / embedded.EMBEDDED_NAME).exists()
    assert [p.name for p in fake_cache.iterdir()] == [f"{embedded.EMBEDDED_NAME}.lock"]


def test_concurrent_builders_build_once(fake_cache, monkeypatch):
    builds = []

    def slow_build(_gguf, out):
        builds.append(out)
        time.sleep(0.2)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(embedded, "_build", slow_build)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(embedded.ensure_embedded_model())) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = fake_cache / embedded.EMBEDDED_NAME
    assert len(builds) == 1 and results == [target] * 3
    assert (target / embedded.MARKER).is_file() and (target / "config.json").is_file()


def test_folder_without_marker_is_rebuilt(fake_cache, monkeypatch):
    target = fake_cache / embedded.EMBEDDED_NAME
    target.mkdir()
    (target / "half_written.safetensors").write_text("")
    monkeypatch.setattr(embedded, "_build", lambda _g, out: (out / "config.json").write_text("{}"))
    assert embedded.ensure_embedded_model() == target
    assert not (target / "half_written.safetensors").exists() and (target / embedded.MARKER).is_file()
