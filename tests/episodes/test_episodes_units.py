"""Multi-turn pieces against plain expectations: tool-call parsing, tool execution failures, the
environment-result checks, isolated and inline environment calls (hangs, exits, crashes, garbage),
and the driver's exact token bookkeeping on scripted turns (tool calls in the Qwen/Hermes format)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlloom.data.control_tokens import ResponseDecoder
from rlloom.data.dataset import PromptItem
from rlloom.engines.rollout import Completion, SamplingParams
from rlloom.episodes.calls import EnvCalls, EnvSpec
from rlloom.episodes.driver import EpisodeDriver, EpisodeSettings
from rlloom.episodes.tools import ToolCall, parse_hermes, run_tool, tool_schema
from rlloom.episodes.trajectory import truncate_ids
from rlloom.episodes.types import as_env_step
from rlloom.models.checkpoint import load_tokenizer

HERE = str(Path(__file__).parent)


def test_hermes_parser_finds_calls_and_reports_malformed_ones():
    text = (
        'I will add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
    )
    calls, errors = parse_hermes(text)
    assert calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})]
    assert len(errors) == 2 and "not valid JSON" in errors[0] and "no string `name`" in errors[1]
    assert parse_hermes("the answer is 3") == ([], [])


def test_tool_failures_become_error_messages_for_the_model():
    from episode_envs import add, crash, hang, opaque

    tools = {f.__name__: f for f in (add, crash, hang, opaque)}
    assert run_tool(tools, ToolCall("add", {"a": 2, "b": 3}), timeout_s=5) == ("5", False)
    for call, expected in [
        (ToolCall("nope", {}), "unknown tool 'nope'"),
        (ToolCall("add", {"a": 1}), "TypeError"),
        (ToolCall("crash", {"x": 1}), "ZeroDivisionError"),
        (ToolCall("opaque", {"x": 1}), "not text or JSON data"),
        (ToolCall("hang", {"x": 1}), "did not return within 0.3 s"),
    ]:
        text, failed = run_tool(tools, call, timeout_s=0.3)
        assert failed and expected in text, text
    assert tool_schema(add)["function"]["parameters"]["required"] == ["a", "b"]


def test_env_step_results_are_checked():
    assert as_env_step({"done": True, "reward": 1}).reward == 1
    for bad in [
        42,
        {"done": "yes"},
        {"reward": float("nan")},
        {"observations": "text"},
        {"surprise": 1},
        {"observations": [{"role": "system", "content": "x"}]},
        {"metrics": {"a": "b"}},
    ]:
        with pytest.raises(TypeError):
            as_env_step(bad)
    assert truncate_ids([1, 2, 3, 4], 2, "right") == [1, 2] and truncate_ids([1, 2, 3, 4], 2, "left") == [
        3,
        4,
    ]


@pytest.mark.parametrize("workers", [2, 0], ids=["isolated", "inline"])
def test_a_failing_environment_call_costs_only_its_trajectory(workers):
    calls = EnvCalls(EnvSpec(env="episode_envs:Faulty", import_dir=HERE), num_workers=workers, timeout_s=2.0)
    hows = ["ok", "hang", "exit", "garbage", "ok"] + (
        ["crash"] if workers else []
    )  # os._exit inline ends pytest
    try:
        for k, how in enumerate(hows):
            calls.submit(k, None, "reset", {"prompt": how})
        envs = {}
        start = time.monotonic()
        while len(envs) < len(hows) and time.monotonic() - start < 30:
            envs.update({r.key: r for r in calls.poll(0.5)})
        assert all(envs[k].error is None for k in range(len(hows)))
        for k in range(len(hows)):
            calls.submit(k, envs[k].env, "step", [{"role": "assistant", "content": "x"}])
        done = {}
        while len(done) < len(hows) and time.monotonic() - start < 60:
            done.update({r.key: r for r in calls.poll(0.5)})
        assert time.monotonic() - start < 30  # the hang cost its timeout, not the others' time
        errors = {hows[k]: r.error for k, r in done.items()}
        assert errors["ok"] is None and done[0].value.reward == 1.0 and done[4].value.reward == 1.0
        assert "no result within 2 s" in errors["hang"]
        assert "SystemExit" in errors["exit"] and "TypeError" in errors["garbage"]
        if workers:
            assert "died" in errors["crash"]
    finally:
        calls.close()


def test_async_environment_methods_are_awaited():
    calls = EnvCalls(
        EnvSpec(env="episode_envs:AsyncTurns", env_kwargs={"turns": 1}, import_dir=HERE),
        num_workers=0,
        timeout_s=5,
    )
    try:
        calls.submit("a", None, "step", [])
        results = []
        while not results:
            results = calls.poll(1.0)
        assert results[0].error is None and results[0].value.done
    finally:
        calls.close()


def _driver(tokenizer, tools: tuple[str, ...], **settings) -> EpisodeDriver:
    spec = EnvSpec(tools=tools, tool_timeout_s=0.5, import_dir=HERE)
    defaults = dict(
        max_turns=4,
        max_total_tokens=4096,
        max_observation_tokens=64,
        observation_truncation="right",
        multi_turn_samples="auto",
        tool_parser="hermes",
    )
    return EpisodeDriver(
        settings=EpisodeSettings(**{**defaults, **settings}),
        calls=EnvCalls(spec, num_workers=1, timeout_s=10),
        tokenizer=tokenizer,
        stop_token_ids=[tokenizer.eos_token_id],
        decode=ResponseDecoder.of(tokenizer),
    )


def _turn(driver, tokenizer, key, j, text, *, version=0):
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    c = Completion(
        request_id=key,
        prompt_index=0,
        sample_index=j,
        token_ids=ids,
        logprobs=[-0.5] * len(ids),
        finish_reason="stop",
        policy_version=version,
    )
    driver.on_turn(key, j, c, [version] * len(ids))
    return ids


def _next(driver):
    start = time.monotonic()
    while time.monotonic() - start < 30:
        if out := driver.poll(0.2):
            return out
        if not driver.waiting:
            return []
    raise AssertionError("no environment result")


def test_tool_turns_are_exact_tokens_with_observations_masked(tiny_checkpoint):
    tok = load_tokenizer(str(tiny_checkpoint))
    driver = _driver(tok, ("episode_envs:add", "episode_envs:hang", "episode_envs:crash"))
    try:
        prompt = tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": "2+3?"}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        item = PromptItem(prompt_ids=prompt, prompt_text="", ground_truth="5", index=0, prompt="2+3?")
        driver.begin("r", item, SamplingParams(n=1, seed=7, max_new_tokens=64))
        [first] = _next(driver)
        assert first.prompt_ids == prompt and first.j is None  # no reset messages, no tools: the plain prompt
        turn1 = _turn(
            driver, tok, "r", 0, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        )
        [second] = _next(driver)
        seg = driver.groups["r"].trajs[0].current
        obs = seg.response_ids[len(turn1) :]
        assert second.prompt_ids == prompt + turn1 + obs  # exact: nothing re-tokenized
        assert (
            tok.decode(obs, skip_special_tokens=False)
            == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
        )
        assert seg.loss_mask == [1] * len(turn1) + [0] * len(obs)
        assert second.sampling.seed != 7 and second.sampling.n == 1
        turn2 = _turn(
            driver,
            tok,
            "r",
            0,
            '<tool_call>{bad</tool_call><tool_call>{"name": "hang", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "crash", "arguments": {"x": 1}}</tool_call>',
        )
        [third] = _next(driver)
        text = tok.decode(third.prompt_ids[len(second.prompt_ids) + len(turn2) :], skip_special_tokens=False)
        assert (
            "not valid JSON" in text and "did not return within 0.5 s" in text and "ZeroDivisionError" in text
        )
        _turn(driver, tok, "r", 0, "The answer is 5.")
        assert _next(driver) == [] and driver.finished("r")
        [sample] = driver.take("r", group_id=3)
        ep = sample.metadata["episode"]
        assert (ep["turns"], ep["tool_calls"], ep["tool_errors"]) == (3, 4, 3)
        assert (
            tok.decode(sample.metadata["answer_ids"][:-1]) == "The answer is 5."
            and sample.metadata["env_reward"] is None
        )
        assert (
            sum(sample.loss_mask)
            == sum(len(t) for t in (turn1, turn2))
            + len(tok.encode("The answer is 5.", add_special_tokens=False))
            + 1
        )
        assert [m["role"] for m in sample.metadata["messages"]] == [
            "user",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "tool",
            "tool",
            "assistant",
        ]
    finally:
        driver.calls.close()


def test_a_template_that_rewrites_history_starts_a_new_sample(tiny_checkpoint):
    tok = load_tokenizer(str(tiny_checkpoint))
    # Like Qwen3's: earlier assistant turns are rendered without their text before the last user turn.
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last "
        "%}...{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    for mode, expected in [("auto", 2), ("per_turn", 2), ("trajectory", 1)]:
        driver = _driver(tok, ("episode_envs:add",), multi_turn_samples=mode)
        try:
            prompt = tok.encode(
                "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
            )
            driver.begin(
                "r",
                PromptItem(prompt_ids=prompt, prompt_text="", ground_truth="5", index=0, prompt="q"),
                SamplingParams(n=1, seed=1),
            )
            _next(driver)
            _turn(
                driver, tok, "r", 0, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            )
            out = _next(driver)
            if mode == "trajectory":  # refused: one sample, the trajectory ended with an environment error
                assert out == [] and "does not extend" in driver.groups["r"].trajs[0].env_error
            else:
                _turn(driver, tok, "r", 0, "5")
                _next(driver)
            samples = driver.take("r", group_id=0)
            assert len(samples) == expected
            if mode != "trajectory":
                assert "..." in tok.decode(samples[1].prompt_ids) and samples[1].loss_mask == [1] * len(
                    samples[1].response_ids
                )
        finally:
            driver.calls.close()


def test_a_trajectory_split_into_turns_counts_once_in_its_group():
    from rlloom.config import AlgorithmConfig
    from rlloom.data.types import RolloutBatch, Sample
    from rlloom.trainer.policy import compute_advantages

    def sample(reward, traj):
        return Sample(prompt_ids=[1], response_ids=[2, 3], reward=reward, group_id=0, trajectory_id=traj)

    split = RolloutBatch([sample(1.0, 7), sample(1.0, 7), sample(1.0, 7), sample(0.0, None)])
    whole = RolloutBatch([sample(1.0, None), sample(0.0, None)])
    for estimator in ("grpo", "dr_grpo", "rloo"):
        algo = AlgorithmConfig(estimator=estimator)
        adv_split, adv_whole = compute_advantages(algo, split)[:, 0], compute_advantages(algo, whole)[:, 0]
        assert adv_split.tolist() == [adv_whole[0].item()] * 3 + [adv_whole[1].item()], estimator


def test_control_token_strings_in_observations_stay_plain_text(tiny_checkpoint):
    tok = load_tokenizer(str(tiny_checkpoint))
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    spec = EnvSpec(env="episode_envs:Hostile", import_dir=HERE)
    defaults = dict(max_turns=4, max_total_tokens=4096, max_observation_tokens=64, observation_truncation="right",
                    multi_turn_samples="auto", tool_parser="hermes")  # fmt: skip
    driver = EpisodeDriver(settings=EpisodeSettings(**defaults), calls=EnvCalls(spec, num_workers=0, timeout_s=10),
                           tokenizer=tok, stop_token_ids=[tok.eos_token_id], decode=ResponseDecoder.of(tok))  # fmt: skip
    try:
        prompt = tok.encode(
            "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )
        driver.begin("r", PromptItem(prompt_ids=prompt, prompt_text="", ground_truth="", index=0, prompt="q"),
                     SamplingParams(n=1, seed=1))  # fmt: skip
        _next(driver)
        turn = _turn(driver, tok, "r", 0, "x")
        [second] = _next(driver)
        obs = second.prompt_ids[len(prompt) + len(turn) :]
        assert "obey" in tok.decode(obs)
        # the template's own structure only: <|im_start|>tool, <|im_end|>, <|im_start|>assistant
        assert (obs.count(start), obs.count(end)) == (2, 1), tok.convert_ids_to_tokens(obs)
    finally:
        driver.calls.close()


def test_a_rows_pictures_ride_the_turns_that_extend_its_prompt(tiny_checkpoint):
    """A row with pictures: its first and next turns carry them (the next one extends the row's prompt,
    placeholders and all, though the messages hold no picture), and so do its samples; a trajectory
    whose prompt is rendered anew (tools, per_turn's new segment) ends with `PICTURES_EXTEND`."""
    import torch

    from rlloom.data.images import ImageInputs
    from rlloom.episodes.driver import PICTURES_EXTEND

    tok = load_tokenizer(str(tiny_checkpoint))
    pictures = ImageInputs(pixel_values=torch.zeros(4, 8), grid_thw=torch.tensor([[1, 2, 2]]))
    written = tok.encode("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    prompt = written[:3] + [7, 7] + written[3:]  # as if a picture's placeholders were expanded in it
    for mode, tools in (("auto", None), ("per_turn", None), ("auto", [{"type": "function"}])):
        driver = EpisodeDriver(
            settings=EpisodeSettings(
                max_turns=4, max_total_tokens=4096, max_observation_tokens=64, observation_truncation="right",
                multi_turn_samples=mode, tool_parser="hermes", tools=tools,
            ),
            calls=EnvCalls(EnvSpec(env="episode_envs:Turns", import_dir=HERE), num_workers=0, timeout_s=10),
            tokenizer=tok, stop_token_ids=[tok.eos_token_id], decode=ResponseDecoder.of(tok),
        )  # fmt: skip
        item = PromptItem(
            prompt_ids=prompt, prompt_text="", ground_truth="", index=0, prompt="q", images=pictures
        )
        driver.begin("r", item, SamplingParams(n=2, seed=1))
        out = _next(driver)
        trajs = driver.groups["r"].trajs
        if tools:  # the first prompt is rendered with the tools: no turn, the trajectories end
            assert out == [] and [t.env_error for t in trajs] == [PICTURES_EXTEND] * 2
            continue
        [first] = out
        assert first.images is pictures and first.prompt_ids == prompt and first.j is None
        turn = _turn(driver, tok, "r", 0, "hello")
        out = _next(driver)
        if mode == "per_turn":
            assert out == [] and trajs[0].env_error == PICTURES_EXTEND
        else:
            [second] = out
            assert second.images is pictures and second.prompt_ids[: len(prompt) + len(turn)] == prompt + turn
            assert len(second.prompt_ids) > len(prompt) + len(
                turn
            )  # the observation, rendered as an extension
        assert driver.take("r", group_id=0)[0].images is pictures
