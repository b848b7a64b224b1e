"""The native engine on the embedded SmolLM2-135M-Instruct: greedy tokens equal transformers' generate."""

from __future__ import annotations

import pytest
import torch
from rollout_testutil import hf_greedy

from rlloom.engines.rollout.native import NativeEngine, SamplingParams

TEXTS = [
    "The capital of France is", "2 + 2 =", "Once upon a time", "The quick brown fox", "Water boils at",
    "My favourite colour is", "In 1492, Columbus", "The sun rises in the", "def fibonacci(n):",
    "Photosynthesis is", "A haiku about rain:", "The largest planet is", "import numpy as",
    "Translate to French: cat", "The speed of light is", "Roses are red,", "Hello, my name is",
    "The opposite of hot is", "Monday, Tuesday,", "E = mc",
]  # fmt: skip


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM

    from rlloom.models import load_tokenizer

    engine = NativeEngine.from_pretrained("smollm2-135m-instruct", max_model_len=128)
    folder = engine.model.source_path
    tokenizer = load_tokenizer(folder)
    batch = [tokenizer(t)["input_ids"] for t in TEXTS]
    out = engine.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = hf_greedy(hf, batch, 4)
    assert [c.token_ids for c in out] == expected
