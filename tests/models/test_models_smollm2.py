"""The embedded SmolLM2-135M-Instruct: cached HF folder built from the GGUF; greedy parity with HF.

The first run builds $RLLOOM_CACHE/smollm2-135m-instruct (about 30-40 s on 2 cores); later runs
reuse it. Our greedy continuation (full packed forwards, no KV cache, all prompts in one stream)
must equal transformers' `generate(do_sample=False)` token for token.
"""

from __future__ import annotations

import pytest
import torch
from models_testutil import assert_close
from transformers import AutoModelForCausalLM

import rlloom.models as models
from rlloom.models.embedded import EMBEDDED_NAME, MARKER, ensure_embedded_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is 12 + 35?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Translate 'good morning' to Spanish.",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Explain gravity in one sentence.",
    "What is 7 times 8?",
    "List two uses of a paperclip.",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smol():
    path = ensure_embedded_model()
    tokenizer = models.load_tokenizer(EMBEDDED_NAME)
    ours = models.from_pretrained(EMBEDDED_NAME)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, tokenizer, ours, hf


def _prompt_ids(tokenizer, prompt):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, return_tensors="pt").input_ids[0]


@torch.no_grad()
def _hf_greedy(hf, tokenizer, prompts: list[torch.Tensor]) -> list[list[int]]:
    """transformers' greedy continuations, all prompts in one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :], mask[b, width - len(p) :] = p, 1
    out = hf.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=ids[0, 0].item()
    )
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    continuations = []
    for row in out[:, width:].tolist():
        stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        continuations.append(row[:stop])
    return continuations


@torch.no_grad()
def _our_greedy_choices(
    model, prompts: list[torch.Tensor], continuations: list[list[int]]
) -> list[list[int]]:
    """Our argmax after each prefix prompt + continuation[:i], from one packed forward.

    Greedy decoding yields `continuation` exactly when every one of these argmaxes equals the next
    token of `continuation` (same prefixes, one token at a time), so this checks our greedy loop
    without running one forward per generated token.
    """
    seqs = [p.tolist() + c for p, c in zip(prompts, continuations)]
    lengths = [len(s) for s in seqs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    hidden = model.hidden_states(
        torch.tensor([t for s in seqs for t in s]),
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
        cu_seqlens=cu,
    )
    choices = []
    for start, p, c in zip(cu.tolist(), prompts, continuations):
        rows = hidden[start + len(p) - 1 : start + len(p) - 1 + len(c)]
        choices.append((rows @ model.lm_head_weight.T).argmax(-1).tolist())
    return choices


def test_cache_folder_is_complete_and_has_chat_template(smol):
    path, tokenizer, ours, _ = smol
    assert (path / MARKER).is_file() and (path / "config.json").is_file()
    assert tokenizer.chat_template
    assert ours.args.model_type == "llama" and ours.args.tie_word_embeddings
    assert "quantization_config" not in ours.hf_config


def test_greedy_continuations_equal_transformers(smol):
    _, tokenizer, ours, hf = smol
    prompts = [_prompt_ids(tokenizer, p) for p in PROMPTS]
    expected = _hf_greedy(hf, tokenizer, prompts)
    assert sum(len(c) for c in expected) >= 5 * len(PROMPTS)
    actual = _our_greedy_choices(ours, prompts, expected)
    for prompt, mine, theirs in zip(PROMPTS, actual, expected):
        assert mine == theirs, (prompt, tokenizer.decode(mine), tokenizer.decode(theirs))
    with torch.no_grad():
        assert_close(ours(prompts[3][None]), hf(prompts[3][None]).logits, atol=2e-4)
