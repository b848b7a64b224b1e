"""Broken or hostile model folders, each a copy of the tiny checkpoint with one thing broken: `rlloom
train`, `rlloom eval` and `rlloom export` end with one `rlloom: error:` line naming the folder or file
and the fix, exit 2, before any model is built (rlloom/trainer/model_folder.py). Before, these were
tracebacks (an allocation of 400 GB, negative dimensions, KeyError, JSONDecodeError, safetensors and
jinja errors), NaN logprobs after a step, misleading messages, or a hang (a looping template, one that
renders gigabytes). Rows of docs/reliability.md.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from rlloom.cli import main


def _config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | changes))


def _drop_config_key(folder: Path, key: str) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    del cfg[key]
    (folder / "config.json").write_text(json.dumps(cfg))


def _weights(folder: Path) -> Path:
    return folder / "model.safetensors"


def _truncate(folder: Path) -> None:
    data = _weights(folder).read_bytes()
    _weights(folder).write_bytes(data[: len(data) // 2])


def _bad_header(folder: Path) -> None:
    data = _weights(folder).read_bytes()
    _weights(folder).write_bytes(struct.pack("<Q", 10**12) + data[8:])


def _nan_weights(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(_weights(folder)))
    name = sorted(tensors)[0]
    tensors[name][0] = float("nan")
    save_file(tensors, str(_weights(folder)), metadata={"format": "pt"})


def _index(folder: Path, target: str) -> None:
    from safetensors import safe_open

    with safe_open(str(_weights(folder)), "pt") as f:
        names = list(f.keys())
    shutil.move(_weights(folder), folder / "model-00001-of-00001.safetensors")
    weight_map = {n: "model-00001-of-00001.safetensors" for n in names}
    weight_map[names[0]] = target
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def _bin_only(folder: Path) -> None:
    _weights(folder).unlink()
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not read")


def _template(folder: Path, template: str) -> None:
    (folder / "chat_template.jinja").write_text(template)


CASES = {
    "hidden_size_huge": lambda f: _config(f, hidden_size=10**9),
    "layers_huge": lambda f: _config(f, num_hidden_layers=10**7),
    "heads_negative": lambda f: _config(f, num_attention_heads=-4),
    "heads_zero": lambda f: _config(f, num_attention_heads=0),
    "eps_nan": lambda f: (f / "config.json").write_text(
        (f / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')
    ),
    "vocab_missing": lambda f: _drop_config_key(f, "vocab_size"),
    "config_not_json": lambda f: (f / "config.json").write_text("{not json"),
    "tokenizer_missing": lambda f: [(f / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
    "tokenizer_corrupt": lambda f: (f / "tokenizer.json").write_text('{"version": "1.0", "model": {'),
    "tokenizer_unreadable": lambda f: ((f / "tokenizer.json").unlink(), (f / "tokenizer.json").mkdir()),
    "weights_truncated": _truncate,
    "weights_bad_header": _bad_header,
    "weights_nan": _nan_weights,
    "index_outside_folder": lambda f: _index(f, "../../outside.safetensors"),
    "index_missing_file": lambda f: _index(f, "model-00002-of-00002.safetensors"),
    "pytorch_bin_only": _bin_only,
    "config_only": lambda f: [p.unlink() for p in list(f.iterdir()) if p.name != "config.json"],
    "template_raises": lambda f: _template(f, "{{ raise_exception('no chat here') }}"),
    "template_syntax": lambda f: _template(f, "{% for m in messages %}"),
    "template_loops": lambda f: _template(
        f, "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    ),
    "template_huge": lambda f: _template(f, "{{ 'x' * 4000000000 }}"),
}


def broken_folder(ckpt: Path, out: Path, case: str) -> Path:
    shutil.copytree(ckpt, out)
    CASES[case](out)
    return out


NEEDLES = {
    "hidden_size_huge": ["describes a model of", "parameters, but the weight files hold"],
    "layers_huge": ["num_hidden_layers=10000000", "2 of those layers"],
    "heads_negative": ["num_attention_heads=-4 must be a positive integer"],
    "heads_zero": ["num_attention_heads=0 must be a positive integer"],
    "eps_nan": ["holds NaN"],
    "vocab_missing": ["config.json has no vocab_size"],
    "config_not_json": ["does not read as JSON"],
    "tokenizer_missing": ["has no tokenizer"],
    "tokenizer_corrupt": ["its tokenizer does not load"],
    "tokenizer_unreadable": ["its tokenizer does not load"],
    "weights_truncated": ["model.safetensors is not a whole safetensors file", "truncated"],
    "weights_bad_header": ["model.safetensors is not a whole safetensors file", "header claims"],
    "weights_nan": ["holds NaN or infinite values"],
    "index_outside_folder": ["'../../outside.safetensors', a file outside the model folder"],
    "index_missing_file": ["'model-00002-of-00002.safetensors', which is missing"],
    "pytorch_bin_only": ["holds only pytorch_model.bin", "convert the model to safetensors"],
    "config_only": ["holds no weights"],
    "template_raises": ["chat template raises", "no chat here"],
    "template_syntax": ["chat template raises", "TemplateSyntaxError"],
    "template_loops": ["did not render", "within 10 s"],
    "template_huge": ["chat template took more than 1 GiB"],
}


def train_args(model: Path, run_dir: Path) -> list[str]:
    return ["train", "arithmetic_smoke", f"model.path={model}", f"trainer.run_dir={run_dir}"] + [
        "logging.console=false", "data.num_eval=2", "data.num_train=16", "trainer.total_steps=1"
    ]  # fmt: skip


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[rlloom] ")]
    assert len(lines) == 1 and lines[0].startswith("rlloom: error: "), err
    return lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_broken_model_folder_is_one_line_error(case, tiny_checkpoint, tmp_path, capsys):
    folder = broken_folder(tiny_checkpoint, tmp_path / case, case)
    capsys.readouterr()
    assert main(train_args(folder, tmp_path / "run")) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "Fix: " in line and str(folder) in line, line
    for needle in NEEDLES[case]:
        assert needle in line, (needle, line)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("case", ["weights_truncated", "template_loops", "tokenizer_corrupt"])
def test_eval_checks_the_folder_too(case, tiny_checkpoint, tmp_path, capsys):
    folder = broken_folder(tiny_checkpoint, tmp_path / case, case)
    capsys.readouterr()
    assert main(["eval", str(folder), "arithmetic", "rollout.max_new_tokens=2", "data.num_eval=2"]) == 2
    assert NEEDLES[case][0] in one_line_error(capsys.readouterr().err)


def test_export_checks_the_run_model_folder(tiny_checkpoint, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    run = tmp_path / "run"
    assert main([*train_args(model, run), "trainer.save_hf_every=-1", "trainer.save_every=1"]) == 0  # full
    CASES["weights_truncated"](model)  # the starting model damaged after the run
    capsys.readouterr()
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    assert "model.safetensors is not a whole safetensors file" in one_line_error(capsys.readouterr().err)


def test_hub_cache_links_in_an_index_are_accepted(tiny_checkpoint, tmp_path):
    # a Hub cache snapshot's files are links to ../../blobs/SHA: outside the folder once resolved
    from rlloom.trainer.model_folder import check_model_folder

    folder = broken_folder(
        tiny_checkpoint, tmp_path / "models--o--m" / "snapshots" / "rev", "index_missing_file"
    )
    blobs = tmp_path / "models--o--m" / "blobs"
    blobs.mkdir()
    shard = folder / "model-00001-of-00001.safetensors"
    shutil.move(shard, blobs / "sha")
    shard.symlink_to("../../blobs/sha")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = dict.fromkeys(index["weight_map"], shard.name)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert check_model_folder(str(folder), "model.path")["model_type"] == "qwen3"
