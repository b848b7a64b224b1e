"""`rlloom init-model KIND DIR` writes a tiny random model that `rlloom train` runs on a CPU, for
trying settings and layouts without downloading a model."""

from __future__ import annotations

import json

import pytest

from rlloom.cli import main

QUICK = (
    "trainer.total_steps=1",
    "data.num_eval=0",
    "data.num_train=8",
    "rollout.n_samples=2",
    "rollout.max_new_tokens=4",
    "rollout.num_blocks=16",
    "trainer.save_hf_every=-1",
    "logging.console=false",
    "algorithm.entropy_coef=0.01",  # a gradient although the random model earns no reward
)


@pytest.mark.parametrize(
    ("kind", "model_type"), [("tiny-dense", "qwen3"), ("tiny-moe", "qwen3_moe"), ("tiny-mla", "deepseek_v3")]
)
def test_init_model_writes_a_model_that_trains_one_step(kind, model_type, tmp_path, capsys):
    model = tmp_path / kind
    assert main(["init-model", kind, str(model), "--layers", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(model)
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == model_type and config["num_hidden_layers"] == 2
    run_dir = tmp_path / "run"
    assert (
        main(["train", "arithmetic_smoke", f"model.path={model}", f"trainer.run_dir={run_dir}", *QUICK]) == 0
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["train/grad_norm"] > 0


def test_init_model_tiny_vl3_trains_a_step_and_its_export_loads_in_transformers(tmp_path, capsys):
    """tiny-vl3 (Qwen3-VL, its decoder's tensors under `model.language_model.`) passes the start-up
    checks of its folder, trains on text prompts, and the export loads in transformers."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    model = tmp_path / "vl3"
    assert main(["init-model", "tiny-vl3", str(model), "--layers", "2"]) == 0
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl" and config["text_config"]["num_hidden_layers"] == 2
    run_dir = tmp_path / "run"
    quick = [o for o in QUICK if not o.startswith("trainer.save_hf_every")]
    args = ["train", "arithmetic_smoke", f"model.path={model}", f"trainer.run_dir={run_dir}", "train.lr=3e-2"]
    assert main([*args, *quick]) == 0
    trained = dict(
        Qwen3VLForConditionalGeneration.from_pretrained(run_dir / "hf" / "step_000001").named_parameters()
    )
    start = dict(Qwen3VLForConditionalGeneration.from_pretrained(model).named_parameters())
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(trained[name], start[name])
    assert trained.keys() == start.keys()


def test_init_model_refuses_a_folder_in_use_and_bad_sizes(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("")
    assert main(["init-model", "tiny-dense", str(tmp_path / "x")]) == 2
    assert main(["init-model", "tiny-dense", str(tmp_path / "y"), "--hidden", "20"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("rlloom: error: ") for line in err)
    assert "init-model output" in err[0] and "--hidden 20" in err[1]


def test_char_tokenizer_fills_up_to_a_vocabulary_size_whose_every_id_decodes():
    """benchmarks/bench_recovery.py's random Qwen3-0.6B-shape model samples any of 151936 ids: each
    must decode (to a filler word no text encodes to) while text still encodes one id a character."""
    from rlloom.models.tiny import char_tokenizer

    small, filled = char_tokenizer(), char_tokenizer(vocab_size=300)
    assert len(filled) == 300 and len(char_tokenizer(vision=True, vocab_size=300)) == 300
    assert filled("What is <fill_3>?")["input_ids"] == small("What is <fill_3>?")["input_ids"]
    assert filled.decode([len(small), 299]) == f"<fill_0><fill_{299 - len(small)}>"
