"""The multi-turn workload of `bench_e2e.py --multiturn`: bench_multiturn.py's episodes, run through the
whole GRPO step as a user's `rollout.env` runs (environment worker processes, the episode driver,
prefix caching, loss masks), with what the benchmark needs around them.

A trajectory is a chat: the prompt (random digits rendered by the chat template), then `turns` turns
of equal length (ignore_eos: each turn is cut at rollout.max_new_tokens), and after each turn but the
last the environment (`ToolTurns`) waits `tool_s` (the tool), then returns a fixed observation. The
observation's text is sized so that the tokens it adds to the context (its message and the template's
turn markers, 10 of them as with Qwen's template) are `--obs-tokens`. The environment gives no reward:
the benchmark's reward function scores the last turn (the parity of its last token id: groups vary).

Two things differ from a user's run, both for the fixed-length turns of bench_multiturn.py:
- the tokenizer (`bench_tokenizer`) is the tiny models' character tokenizer with "user" and
  "assistant" as tokens; the random model samples from its whole vocabulary, whose ids beyond the
  tokenizer's decode to nothing, so a turn's text is short but its tokens are all kept and trained
  (an assistant message is the text of all its tokens: no turn ends at a stop token);
- a turn cut at max_new_tokens ends its trajectory in rlloom (finish reason "length"), so the
  benchmark's driver (`FixedLengthTurns`) passes such a turn on as finished.

The environment workers import this module by name: they get the trainer's sys.path (this folder
comes first when bench_e2e.py runs as a script), and bench_e2e's config names this folder as
reward.import_dir as well, from which `rollout.env` imports.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path
from typing import Any

from rlloom.data.dataset import PromptItem
from rlloom.episodes.render import encode, extension_ids, render_conversation
from rlloom.episodes.types import EnvStep

HERE = Path(__file__).parent
ENV = "multiturn_env:ToolTurns"
"""`rollout.env` of the benchmark."""


class ToolTurns:
    """`turns` turns; after each but the last, `tool_s` of tool time and then `observation`."""

    def __init__(self, turns: int = 4, tool_s: float = 0.05, observation: str = "") -> None:
        self.turns, self.tool_s, self.observation = turns, tool_s, observation

    def reset(self, row: dict) -> None:
        return None  # the row's prompt is the first message

    def step(self, messages: list[dict], state: dict) -> EnvStep:
        state["turns"] = state.get("turns", 0) + 1
        if state["turns"] >= self.turns:
            return EnvStep(done=True)  # reward None: the benchmark's reward function scores the last turn
        time.sleep(self.tool_s)
        return EnvStep(observations=[{"role": "user", "content": self.observation}])


class FixedLengthTurns:
    """An episode driver whose turns cut at max_new_tokens go on to the environment (bench_multiturn's
    fixed-length turns) instead of ending the trajectory; everything else is the wrapped driver's."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def on_turn(self, key: Any, j: int, c: Any, versions: list[int]) -> None:
        if c.finish_reason == "length":
            c = dataclasses.replace(c, finish_reason="stop")
        self.driver.on_turn(key, j, c, versions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.driver, name)


def bench_tokenizer() -> Any:
    """The tiny models' character tokenizer (one token per printable character, a chat template)
    with "user" and "assistant" as tokens: an observation's turn markers are then 10 tokens."""
    from rlloom.models.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.add_tokens(["user", "assistant"])
    return tokenizer


def observation_text(tokenizer: Any, obs_tokens: int) -> str:
    """An observation whose message and turn markers add exactly `obs_tokens` tokens to the context
    (ValueError when the markers alone take that many)."""
    prompt = [{"role": "user", "content": "0"}]
    so_far = encode(tokenizer, render_conversation(tokenizer, prompt, tools=None)) + tokenizer.encode(
        "1", add_special_tokens=False
    )
    empty = prompt + [{"role": "assistant", "content": "1"}, {"role": "user", "content": ""}]
    markers = len(extension_ids(tokenizer, so_far, render_conversation(tokenizer, empty, tools=None)) or [])
    if obs_tokens <= markers:
        raise ValueError(f"--obs-tokens {obs_tokens}: the chat template's turn markers alone are {markers}")
    return "0" * (obs_tokens - markers)  # a digit is one token


def chat_prompts(tokenizer: Any, num: int, prompt_tokens: int) -> list[PromptItem]:
    """`num` chat prompts of exactly `prompt_tokens` tokens (template included): random digits
    (seeded), as the episode driver renders a row's prompt."""
    rng = random.Random(0)
    markers = len(
        encode(tokenizer, render_conversation(tokenizer, [{"role": "user", "content": ""}], tools=None))
    )
    if prompt_tokens <= markers:
        raise ValueError(f"--prompt-tokens {prompt_tokens}: the chat template alone is {markers} tokens")
    items = []
    for i in range(num):
        text = "".join(rng.choice("0123456789") for _ in range(prompt_tokens - markers))
        rendered = render_conversation(tokenizer, [{"role": "user", "content": text}], tools=None)
        ids = encode(tokenizer, rendered)
        assert len(ids) == prompt_tokens, (len(ids), prompt_tokens)
        items.append(
            PromptItem(prompt_ids=ids, prompt_text=rendered.text, ground_truth="", index=i, prompt=text)
        )
    return items


def multiturn_overrides(
    *, turns: int, turn_tokens: int, prompt_tokens: int, obs_tokens: int, tool_s: float, env_workers: int,
    observation: str,
) -> list[str]:  # fmt: skip
    """The run config of the workload: the environment, its budgets (the longest trajectory fits
    exactly) and its worker processes."""
    return [
        f"rollout.env={ENV}",
        f"rollout.env_kwargs={{turns: {turns}, tool_s: {tool_s}, observation: '{observation}'}}",
        f"reward.import_dir={HERE}",
        f"rollout.env_workers={env_workers}",
        f"rollout.max_turns={turns}",
        f"rollout.max_new_tokens={turn_tokens}",
        f"rollout.max_observation_tokens={obs_tokens}",
        f"rollout.max_total_tokens={prompt_tokens + turns * turn_tokens + (turns - 1) * obs_tokens}",
        "data.chat_template=true",
    ]
