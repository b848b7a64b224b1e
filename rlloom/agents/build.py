"""`build_agent_driver(cfg, tokenizer, stop_token_ids)`: a run's agent driver with its endpoint
started (`rollout.agent`), and `check_agent(cfg)`, the start-up check before the model loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlloom.agents.driver import AgentDriver, AgentSettings
from rlloom.agents.server import Endpoint, check_installed
from rlloom.agents.spec import AgentSpec
from rlloom.agents.turns import Formats
from rlloom.config import ConfigError, RunConfig
from rlloom.episodes.calls import EnvCalls
from rlloom.rewards.registry import plugin_folder


def agent_spec(cfg: RunConfig) -> AgentSpec:
    return AgentSpec(agent=cfg.rollout.agent, import_dir=plugin_folder(cfg.reward.import_dir))


def model_id(path: str) -> str:
    """The id `GET /v1/models` lists: the model folder's name."""
    return Path(path).name or path


def check_agent(cfg: RunConfig) -> None:
    """The endpoint's packages are installed and the agent imports and takes its three arguments."""
    if not cfg.rollout.agent:
        return
    try:
        check_installed()
        agent_spec(cfg).check()
    except ValueError as e:
        raise ConfigError(f"rollout.agent={cfg.rollout.agent!r}: {e}") from e


def build_agent_driver(cfg: RunConfig, tokenizer: Any, stop_token_ids: list[int]) -> AgentDriver:
    ro = cfg.rollout
    endpoint = Endpoint(model_id=model_id(cfg.model.path), sessions_only=True)
    endpoint.start()
    calls = EnvCalls(agent_spec(cfg), num_workers=ro.env_workers, timeout_s=ro.agent_timeout_s)
    settings = AgentSettings(
        max_turns=ro.max_turns,
        max_total_tokens=cfg.longest_sequence,
        per_turn=ro.multi_turn_samples == "per_turn",
        default_score=cfg.reward.default_score,
    )
    return AgentDriver(
        settings=settings,
        calls=calls,
        endpoint=endpoint,
        fmt=Formats.of(tokenizer, ro.tool_parser),
        stop_token_ids=stop_token_ids,
    )
