"""The OpenAI-compatible endpoint through the official `openai` client, on the tiny model served in
this process (the serve loop of `rlloom serve`): streaming equals non-streaming, n choices, stop
strings, concurrent requests, logprobs, the context budget, and OpenAI-style 4xx bodies."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest
import torch

from rlloom.agents.api import parse_chat
from rlloom.agents.serve import Limits, serve
from rlloom.agents.server import Endpoint
from rlloom.agents.turns import Formats, make_choice, render_prompt
from rlloom.config import load_config
from rlloom.engines.rollout.build import build_rollout_engine
from rlloom.episodes.tools import ToolCall
from rlloom.models import load_tokenizer


@pytest.fixture(scope="module")
def url(tiny_checkpoint):
    cfg = load_config(
        None, [f"model.path={tiny_checkpoint}", "data.max_prompt_length=64", "rollout.max_new_tokens=16"]
    )
    tokenizer = load_tokenizer(str(tiny_checkpoint))
    engine = build_rollout_engine(cfg, device=torch.device("cpu"), dtype=torch.float32)
    limits = Limits(
        max_total_tokens=cfg.longest_sequence,
        max_new_tokens=16,
        stop_token_ids=[tokenizer.eos_token_id],
        stop_strings=[],
    )
    endpoint = Endpoint(model_id="tiny", sessions_only=False)
    endpoint.start()
    done = threading.Event()
    thread = threading.Thread(
        target=serve, args=(engine, endpoint, Formats.of(tokenizer), limits), kwargs={"stop": done.is_set}
    )
    thread.start()
    yield endpoint.url + "/v1"
    done.set()
    thread.join(10)
    endpoint.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0)


HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {}}}]


def test_models_lists_the_policy(url):
    assert [m.id for m in client(url).models.list().data] == ["tiny"]


def test_streaming_gives_the_non_streaming_tokens(url):
    args = dict(model="tiny", messages=HI, max_tokens=12, temperature=1.0, seed=7, logprobs=True)
    whole = client(url).chat.completions.create(**args).choices[0]
    chunks = [c for c in client(url).chat.completions.create(**args, stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.message.content and len(text) > 0
    streamed_lps = [t.logprob for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed_lps == [t.logprob for t in whole.logprobs.content]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_a_stream_sends_tokens_while_they_are_sampled(url, monkeypatch):
    import time

    import rlloom.agents.serve as serve_module

    finished = []  # when the serve loop saw the completion come back from the engine
    make_choice_ = serve_module.make_choice
    monkeypatch.setattr(
        serve_module, "make_choice", lambda *a: finished.append(time.monotonic()) or make_choice_(*a)
    )
    args = dict(model="tiny", messages=HI, max_tokens=16, temperature=1.0, seed=5, stream=True)
    arrived = []
    for c in client(url).chat.completions.create(**args):
        if c.choices and c.choices[0].delta.content:
            arrived.append(time.monotonic())
    assert len(finished) == 1 and len(arrived) > 2
    assert sum(t < finished[0] for t in arrived) > 1, "the tokens came only with the finished answer"


def test_n_choices_are_the_seeded_samples(url):
    args = dict(model="tiny", messages=HI, max_tokens=10, temperature=1.0, seed=3)
    three = client(url).chat.completions.create(**args, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert len(set(texts)) == 3  # three draws, not one copied
    assert [c.message.content for c in client(url).chat.completions.create(**args, n=3).choices] == texts


def test_stop_strings_end_the_answer_before_them(url):
    args = dict(model="tiny", messages=HI, max_tokens=16, temperature=1.0, seed=11)
    free = client(url).chat.completions.create(**args).choices[0].message.content
    stop = free[3]
    cut = client(url).chat.completions.create(**args, stop=[stop]).choices[0]
    assert cut.message.content == free[: free.index(stop)] and cut.finish_reason == "stop"
    text = client(url).completions.create(
        model="tiny", prompt="abc", max_tokens=16, temperature=1.0, seed=11, stop=stop
    )
    assert stop not in text.choices[0].text


def test_concurrent_requests_answer_as_alone(url):
    prompts = [f"question {i}" for i in range(6)]

    async def ask(c, p):
        r = await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": p}], max_tokens=8, temperature=0
        )
        return r.choices[0].message.content

    async def together():
        async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as c:
            return await asyncio.gather(*(ask(c, p) for p in prompts))

    alone = [
        client(url)
        .chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": p}], max_tokens=8, temperature=0
        )
        .choices[0]
        .message.content
        for p in prompts
    ]
    assert asyncio.run(together()) == alone


def test_over_the_budget_is_length_not_an_error(url):
    r = client(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x" * 200}], max_tokens=4
    )
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == ""


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        ({"messages": HI, "temperature": "hot"}, "temperature"),
        ({"messages": HI, "n": 0}, "n"),
        ({"messages": HI, "stop": [""]}, "stop"),
        ({"messages": HI, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": HI, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": HI, "tool_choice": "required"}, "tool_choice"),
        ({"messages": HI, "tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            {
                "messages": HI,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "mul"}},
            },
            "tool_choice",
        ),
    ],
)
def test_a_malformed_request_gets_an_openai_400(url, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="tiny", **body)
    assert e.value.status_code == 400 and e.value.body["param"] == param and e.value.body["message"]


def test_bad_json_and_unknown_routes_get_openai_bodies(url):
    import httpx

    r = httpx.post(
        url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(url + "/embeddings")
    assert r.status_code == 404 and "error" in r.json() and "Traceback" not in r.text


def test_tool_calls_are_parsed_and_sent_back_as_dict_arguments():
    req = parse_chat(
        {
            "messages": [
                {"role": "user", "content": "add"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
            ],
            "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}],
        }
    )
    assert req.parse_tools and req.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}],
    }


def test_tool_choice_none_auto_and_a_named_function_decide_the_calls(tiny_checkpoint):
    tokenizer = load_tokenizer(str(tiny_checkpoint))
    fmt = Formats.of(tokenizer)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'

    def answer(tool_choice, text):
        req = parse_chat({"messages": HI, "tools": TOOLS, "tool_choice": tool_choice})
        ids = tokenizer.encode(text, add_special_tokens=False)
        return req, make_choice(fmt, req, ids, [0.0] * len(ids), "stop")

    _, auto = answer("auto", call)
    assert auto.tool_calls == [ToolCall("add", {"a": 1})] and auto.finish_reason == "tool_calls"
    _, none = answer("none", call)
    assert none.tool_calls == [] and none.text == call and none.finish_reason == "stop"
    # A named function: the prompt ends with the call's opening, so the sampled tokens are its arguments.
    req, named = answer({"type": "function", "function": {"name": "add"}}, '{"a": 1}}\n</tool_call>')
    assert render_prompt(fmt, req).text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": '
    )
    assert named.tool_calls == auto.tool_calls and named.finish_reason == "tool_calls"
    assert named.token_ids == tokenizer.encode('{"a": 1}}\n</tool_call>', add_special_tokens=False)


def test_a_required_tool_call_starts_the_answer(url):
    args = dict(model="tiny", messages=HI, tools=TOOLS, max_tokens=4, temperature=0)
    auto = client(url).chat.completions.create(**args)
    required = client(url).chat.completions.create(**args, tool_choice="required")
    opening = "<tool_call>\n"
    assert required.choices[0].message.content.startswith(opening)
    assert required.usage.prompt_tokens == auto.usage.prompt_tokens + len(opening)


def test_answers_are_not_held_back_by_nagle():
    """The endpoint's connections send at once (TCP_NODELAY): without it each answer's body waited
    for the client's delayed ACK of its headers, about 40 ms a request on Linux."""
    import http.client
    import socket

    endpoint = Endpoint(model_id="tiny", sessions_only=False)
    endpoint.start()
    try:
        conn = http.client.HTTPConnection(endpoint.host, int(endpoint.url.rsplit(":", 1)[1]))
        conn.request("GET", "/v1/models")
        assert conn.getresponse().read()
        (served,) = endpoint._server.server_state.connections  # the server's side of `conn`
        sock = served.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        conn.close()
    finally:
        endpoint.close()
