"""The session ledger on scripted answers (no model): a request that sends the conversation back
extends its answer's sample with the new suffix masked; a sub-agent's request, a rewritten history or
`per_turn` start a sample of their own; the samples are the branches no request continued."""

from __future__ import annotations

from rlloom.agents.api import parse_chat
from rlloom.agents.ledger import Ledger
from rlloom.agents.turns import Formats, render_prompt
from rlloom.models.tiny import char_tokenizer

TOK = char_tokenizer()
FMT = Formats.of(TOK)
END = TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def ask(ledger: Ledger, messages: list[dict]):
    return ledger.fork(render_prompt(FMT, parse_chat({"messages": messages})))


def answer(ledger: Ledger, fork, text: str, messages: list[dict]) -> list[int]:
    sampled = ids(text) + [END]
    lps = [-0.5] * len(sampled)
    ledger.record(
        fork, sampled, lps, [3] * len(sampled), finish_reason="stop", messages=messages, routed_experts=None
    )
    return sampled


def test_a_conversation_sent_back_extends_its_sample_with_the_suffix_masked():
    ledger = Ledger(tokenizer=TOK)
    first = [{"role": "user", "content": "2+2?"}]
    fork = ask(ledger, first)
    assert fork.parent is None
    sampled = answer(ledger, fork, "calc", first)
    second = [*first, {"role": "assistant", "content": "calc"}, {"role": "tool", "content": "4"}]
    fork2 = ask(ledger, second)
    assert fork2.parent is ledger.branches[0]
    assert TOK.decode(fork2.added) == "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"
    assert fork2.prompt_ids == fork.prompt_ids + sampled + fork2.added  # the sampled ids, not re-tokenized
    answer(ledger, fork2, "4", second)
    [leaf] = ledger.leaves()
    seg = leaf.segment
    assert seg.prompt_ids == fork.prompt_ids
    assert seg.loss_mask == [1] * len(sampled) + [0] * len(fork2.added) + [1] * 2
    assert seg.logprobs[len(sampled) : len(sampled) + len(fork2.added)] == [0.0] * len(fork2.added)
    assert len(seg.versions) == len(seg.response_ids)


def test_sub_agents_rewrites_and_per_turn_start_samples_of_their_own():
    ledger = Ledger(tokenizer=TOK)
    first = [{"role": "user", "content": "plan"}]
    answer(ledger, ask(ledger, first), "go", first)
    sub = [{"role": "system", "content": "you are a sub-agent"}, {"role": "user", "content": "step 1"}]
    assert ask(ledger, sub).parent is None  # a conversation of its own
    rewritten = [*first, {"role": "assistant", "content": "GO"}, {"role": "user", "content": "next"}]
    assert (
        ask(ledger, rewritten).parent is None
    )  # the answer was changed: the tokens would not be the model's
    answer(ledger, ask(ledger, sub), "ok", sub)
    assert len(ledger.leaves()) == 2
    per_turn = Ledger(tokenizer=TOK, extend=False)
    answer(per_turn, ask(per_turn, first), "go", first)
    assert (
        ask(
            per_turn, [*first, {"role": "assistant", "content": "go"}, {"role": "user", "content": "x"}]
        ).parent
        is None
    )


def test_choices_of_one_request_are_samples_each():
    ledger = Ledger(tokenizer=TOK)
    first = [{"role": "user", "content": "hi"}]
    fork = ask(ledger, first)
    answer(ledger, fork, "a", first)
    answer(ledger, fork, "b", first)
    follow = [*first, {"role": "assistant", "content": "b"}, {"role": "user", "content": "more"}]
    fork2 = ask(ledger, follow)
    assert fork2.parent is ledger.branches[1]  # the choice the agent kept
    answer(ledger, fork2, "c", follow)
    assert [TOK.decode(b.answer_ids) for b in ledger.leaves()] == ["a<|im_end|>", "c<|im_end|>"]
