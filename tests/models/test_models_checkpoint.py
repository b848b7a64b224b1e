"""Checkpoint round trips, the weight-sync adapter API and load errors.

References: the bytes of our own first save (save -> load -> save is bit-exact), transformers'
loader (it reads what we save and gives the same logits), and the tensors in the file.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from models_testutil import assert_close, randomize_
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import rlloom.models as models
from rlloom.models.adapter import StateDictAdapter

VOCAB = 80


@pytest.fixture(scope="module")
def hf_dense_dir(tmp_path_factory):
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("dense")
    randomize_(Qwen3ForCausalLM(cfg), seed=3).save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"marker": "copied"}')
    return path


@pytest.fixture(scope="module")
def hf_moe_dir(tmp_path_factory):
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("moe")
    randomize_(Qwen3MoeForCausalLM(cfg), seed=4).save_pretrained(path)
    return path


def _tensors(path):
    files = sorted(path.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}


def test_save_load_save_is_bit_exact_and_hf_loads_it(hf_moe_dir, tmp_path):
    ours = models.from_pretrained(hf_moe_dir)
    models.save_pretrained(ours, tmp_path / "a")
    models.save_pretrained(models.from_pretrained(tmp_path / "a"), tmp_path / "b")
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()
    original, saved = _tensors(hf_moe_dir), _tensors(tmp_path / "a")
    assert original.keys() == saved.keys()
    assert all(torch.equal(original[k], saved[k]) for k in original)
    assert json.loads((tmp_path / "a/config.json").read_text()) == json.loads(
        (hf_moe_dir / "config.json").read_text()
    )
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        assert_close(ours(ids), hf(ids).logits)


def test_sharded_save_loads_in_ours_and_transformers(hf_dense_dir, tmp_path):
    ours = models.from_pretrained(hf_dense_dir)
    models.save_pretrained(ours, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert (tmp_path / "tokenizer_config.json").read_text() == '{"marker": "copied"}'
    ids = torch.randint(0, VOCAB, (1, 9))
    again = models.from_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(again(ids), ours(ids))
        assert_close(again(ids), hf(ids).logits)


def test_hf_named_tensors_and_in_place_load(hf_moe_dir):
    ours = models.from_pretrained(hf_moe_dir)
    reference = _tensors(hf_moe_dir)
    named = dict(models.hf_named_tensors(ours))
    assert named.keys() == reference.keys()
    assert all(torch.equal(named[k], reference[k]) for k in reference)
    pointers = {n: p.data_ptr() for n, p in ours.named_parameters()}
    new_expert = torch.randn_like(reference["model.layers.1.mlp.experts.5.up_proj.weight"])
    new_norm = torch.randn_like(reference["model.norm.weight"])
    filled = models.load_hf_tensors(
        ours, [("model.layers.1.mlp.experts.5.up_proj.weight", new_expert), ("model.norm.weight", new_norm)]
    )
    assert filled == {("layers.1.moe.experts.w3", 5), ("norm.weight", None)}
    assert torch.equal(ours.layers[1].moe.experts.w3[5], new_expert)
    assert torch.equal(
        ours.layers[1].moe.experts.w3[4], reference["model.layers.1.mlp.experts.4.up_proj.weight"]
    )
    assert torch.equal(ours.norm.weight, new_norm)
    assert pointers == {n: p.data_ptr() for n, p in ours.named_parameters()}


def test_tied_model_yields_no_lm_head(tmp_path):
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    names = [n for n, _ in models.hf_named_tensors(models.from_pretrained(tmp_path))]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_adapter_names_round_trip(hf_moe_dir):
    adapter = StateDictAdapter(models.from_pretrained(hf_moe_dir).args)
    for name in _tensors(hf_moe_dir):
        native, expert = adapter.from_hf(name)
        assert adapter.hf_name(native, expert) == name


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_tensor_is_named(hf_dense_dir, tmp_path):
    path = _rewrite(hf_dense_dir, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight \[48, 32\]"
    ):
        models.from_pretrained(path)


def test_extra_tensor_is_named(hf_dense_dir, tmp_path):
    path = _rewrite(
        hf_dense_dir,
        tmp_path / "e",
        lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3, 4)}),
    )
    with pytest.raises(
        ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight' with shape \[3, 4\]"
    ):
        models.from_pretrained(path)


def test_wrong_shape_is_named(hf_dense_dir, tmp_path):
    path = _rewrite(hf_dense_dir, tmp_path / "s", lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(
        ValueError, match=r"'model\.norm\.weight' has shape \[31\] but the model expects \[32\]"
    ):
        models.from_pretrained(path)


def test_unsupported_architecture(hf_dense_dir, tmp_path):
    shutil.copytree(hf_dense_dir, tmp_path / "u")
    cfg = json.loads((tmp_path / "u/config.json").read_text()) | {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
    }
    (tmp_path / "u/config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*GPT2LMHeadModel.*supported model types"):
        models.from_pretrained(tmp_path / "u")


def test_not_a_checkpoint_folder(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        models.from_pretrained(tmp_path)


def test_build_model_buffers_are_the_constructors(monkeypatch):
    """`build_model` materialises with `to_empty` (garbage); its persistent buffers (DeepSeek-V3's
    router `expert_bias`) must come out as a model constructed directly holds them, or a model that
    only gets random parameters routes by garbage (seen: tp=2 gradients that changed run to run)."""
    from rlloom.models.checkpoint import build_model
    from rlloom.models.model import CausalLM

    to_empty = torch.nn.Module.to_empty

    def garbage(self, *, device, recurse=True):  # what reused memory can hold
        out = to_empty(self, device=device, recurse=recurse)
        with torch.no_grad():
            for t in [*out.parameters(), *out.buffers()]:
                t.fill_(float("nan"))
        return out

    cfg = {
        "model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "moe_intermediate_size": 16, "num_hidden_layers": 2, "first_k_dense_replace": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }  # fmt: skip
    built = build_model(cfg, dtype=torch.float32, device="cpu")  # before the patch: the reference
    reference = CausalLM(built.args, cfg)  # constructed on the CPU: real initial buffers
    monkeypatch.setattr(torch.nn.Module, "to_empty", garbage)
    built = build_model(cfg, dtype=torch.float32, device="cpu")
    buffers = dict(built.named_buffers())
    assert "layers.1.moe.router.expert_bias" in buffers
    for name, expected in reference.named_buffers():
        torch.testing.assert_close(buffers[name], expected, msg=name)
