"""`rlloom serve MODEL_OR_RUN [--port P] [overrides]`: the OpenAI-compatible endpoint of training
(`rollout.agent`) outside training, on a Hugging Face folder, a run folder or a checkpoint (resolved
as `rlloom eval` resolves them, with the run's own settings), so an agent can be tried against the
model before and after RL. One rollout engine in this process; Ctrl-C stops it."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from rlloom.agents.build import model_id
from rlloom.agents.serve import Limits, serve
from rlloom.agents.server import Endpoint, check_installed
from rlloom.agents.turns import Formats
from rlloom.config import ConfigError
from rlloom.config.loading import load_config
from rlloom.devices import resolve_device, resolve_dtype
from rlloom.engines.rollout.build import build_rollout_engine
from rlloom.models import load_tokenizer
from rlloom.trainer.eval_model import resolve_model
from rlloom.trainer.model_folder import check_model_folder


def serve_model(model_or_run: str, overrides: list[str], *, host: str, port: int) -> None:
    try:
        check_installed()
    except ValueError as e:
        raise ConfigError(f"rlloom serve: {e}") from e
    if not 0 <= port <= 65535:
        raise ConfigError(
            f"--port={port} is invalid: a TCP port is 0-65535. Fix: e.g. --port 8000 (0: any free port)"
        )
    with tempfile.TemporaryDirectory(prefix="rlloom-serve-") as tmp:
        base, model = resolve_model(model_or_run, Path(tmp))
        cfg = load_config(base, [f"model.path={json.dumps(model)}", *overrides])
        check_model_folder(cfg.model.path, "model")
        tokenizer = load_tokenizer(cfg.model.path)
        device = resolve_device(cfg)
        one_replica = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, tp=1))
        engine = build_rollout_engine(one_replica, device=device, dtype=resolve_dtype(cfg, device))
        limits = Limits(
            max_total_tokens=cfg.longest_sequence,
            max_new_tokens=cfg.rollout.max_new_tokens,
            stop_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
            stop_strings=list(cfg.rollout.stop_strings),
        )
        endpoint = Endpoint(
            model_id=model_id(model_or_run.rstrip("/")), host=host, port=port, sessions_only=False
        )
        endpoint.start()
        print(
            f"rlloom serve: {model_or_run} at {endpoint.url}/v1 (model {endpoint.model_id!r}; Ctrl-C stops)",
            flush=True,
        )
        try:
            serve(
                engine, endpoint, Formats.of(tokenizer, cfg.rollout.tool_parser), limits, stop=lambda: False
            )
        finally:
            endpoint.close()
