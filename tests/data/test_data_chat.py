"""Templating and tokenization: chat template, raw text, system prompt, length limit, a real HF tokenizer."""

import logging

import pytest

from rlloom.data.chat import encode_prompt, prompt_messages, tokenize_prompts
from rlloom.data.dataset import RawPrompt


class FakeTokenizer:
    """One token per character (id = code point); BOS id 1 when special tokens are added."""

    chat_template = "fake"

    def encode(self, text, add_special_tokens=True, split_special_tokens=False):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, conversation, *, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation) + "<assistant>"


def raws(*prompts):
    return [RawPrompt(prompt=p, ground_truth=str(i), index=i) for i, p in enumerate(prompts)]


def test_chat_template_and_system_prompt():
    tok = FakeTokenizer()
    assert encode_prompt("hi", tok, chat_template=True)[0] == "<user>hi<assistant>"
    assert (
        encode_prompt("hi", tok, chat_template=True, system_prompt="S")[0] == "<system>S<user>hi<assistant>"
    )
    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]
    assert prompt_messages(own, "S") == own  # the row's own system message wins
    out = tokenize_prompts(raws("hi"), tok, chat_template=True, max_prompt_length=100)
    item = out.items[0]
    assert item.prompt_text == "<user>hi<assistant>"
    assert item.prompt_ids == [ord(c) for c in item.prompt_text]  # no BOS added on top of the template


def test_raw_text_encodes_with_special_tokens_and_refuses_chat_lists(caplog):
    tok = FakeTokenizer()
    with caplog.at_level(logging.WARNING):
        out = tokenize_prompts(raws("ab"), tok, chat_template=False, system_prompt="S", max_prompt_length=10)
    assert out.items[0].prompt_ids == [1, 97, 98] and out.items[0].prompt_text == "ab"
    assert "system_prompt" in caplog.text
    with pytest.raises(ValueError, match="chat_template"):
        encode_prompt([{"role": "user", "content": "x"}], tok, chat_template=False)


def test_too_long_prompts_are_skipped_and_counted():
    tok = FakeTokenizer()
    out = tokenize_prompts(raws("a", "b" * 50, "c"), tok, chat_template=False, max_prompt_length=5)
    assert [i.ground_truth for i in out.items] == ["0", "2"] and out.num_too_long == 1
    with pytest.raises(ValueError, match="data.max_prompt_length"):
        tokenize_prompts(raws("b" * 50), tok, chat_template=False, max_prompt_length=5)


def test_missing_chat_template_raises_with_a_fix():
    tok = FakeTokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="data.chat_template=false"):
        encode_prompt("hi", tok, chat_template=True)


def test_real_hugging_face_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    words = [
        "[UNK]",
        "<s>",
        "<|user|>",
        "<|assistant|>",
        "<|system|>",
        "What",
        "is",
        "2",
        "+",
        "3",
        "?",
        "Be",
        "brief.",
    ]
    core = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    )
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="<s>")
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    out = tokenize_prompts(
        raws("What is 2 + 3 ?"), tok, chat_template=True, system_prompt="Be brief.", max_prompt_length=64
    )
    item = out.items[0]
    assert item.prompt_text == "<|system|> Be brief. <|user|> What is 2 + 3 ? <|assistant|>"
    assert item.prompt_ids == [4, 11, 12, 2, 5, 6, 7, 8, 9, 10, 3]
    assert tok.decode(item.prompt_ids) == item.prompt_text
