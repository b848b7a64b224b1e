"""`build_episode_driver(cfg, tokenizer, stop_token_ids)`: the multi-turn driver of a run, or None for
single-turn generation. Checks at start-up, before the model loads, that the environment and the
tools import and have the right shape (ConfigError naming the setting otherwise)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlloom.config import ConfigError, RunConfig
from rlloom.episodes.calls import EnvCalls, EnvSpec
from rlloom.episodes.driver import EpisodeDriver, EpisodeSettings
from rlloom.rewards.registry import plugin_folder


def env_spec(cfg: RunConfig) -> EnvSpec:
    ro = cfg.rollout
    return EnvSpec(
        env=ro.env,
        env_kwargs=dict(ro.env_kwargs),
        tools=tuple(ro.tools),
        tool_parser=ro.tool_parser,
        tool_timeout_s=ro.tool_timeout_s,
        import_dir=plugin_folder(cfg.reward.import_dir),
    )


def check_episodes(cfg: RunConfig) -> None:
    """The environment and tools of a multi-turn run import and fit their contract."""
    if not (cfg.rollout.env or cfg.rollout.tools):
        return
    if not cfg.data.chat_template:
        raise ConfigError(
            f"rollout.env={cfg.rollout.env!r} / rollout.tools={list(cfg.rollout.tools)} need data.chat_template=true: "
            "multi-turn episodes append chat messages. Fix: set data.chat_template=true"
        )
    try:
        env_spec(cfg).check()
    except ValueError as e:
        raise ConfigError(str(e)) from e


def build_episode_driver(
    cfg: RunConfig, tokenizer: Any, stop_token_ids: list[int], decode: Callable[[list[int]], str]
) -> EpisodeDriver | None:
    if not (cfg.rollout.env or cfg.rollout.tools):
        return None
    ro = cfg.rollout
    spec = env_spec(cfg)
    tools = spec.tool_schemas() if ro.tools else None
    if tools and "tools" not in (getattr(tokenizer, "chat_template", "") or ""):
        raise ConfigError(
            f"rollout.tools={list(ro.tools)}: the chat template of {cfg.model.path} does not render tools "
            "(it never reads `tools`), so the model would not know them. Fix: use a model whose template "
            "renders tools (e.g. Qwen2.5/Qwen3), or describe the tools in data.system_prompt and use rollout.env"
        )
    settings = EpisodeSettings(
        max_turns=ro.max_turns,
        max_total_tokens=cfg.longest_sequence,
        max_observation_tokens=ro.max_observation_tokens,
        observation_truncation=ro.observation_truncation,
        multi_turn_samples=ro.multi_turn_samples,
        tool_parser=ro.tool_parser,
        system_prompt=cfg.data.system_prompt,
        tools=tools,
        template_renders_tool_calls="tool_calls" in (getattr(tokenizer, "chat_template", "") or ""),
        default_score=cfg.reward.default_score,
    )
    calls = EnvCalls(spec, num_workers=ro.env_workers, timeout_s=ro.env_timeout_s)
    return EpisodeDriver(
        settings=settings, calls=calls, tokenizer=tokenizer, stop_token_ids=stop_token_ids, decode=decode
    )
