"""Start-up checks that need more than the config itself, run before any model or data is loaded.

- The model folder (and critic.model_path's) passes `model_folder.check_model_folder`: config.json,
  the safetensors headers and their agreement; its tokenizer loads and its chat template renders in
  bounds (`check_tokenizer`). It can run on the device, and its `max_position_embeddings` holds the longest sequence the run asks
  for: data.max_prompt_length + rollout.max_new_tokens (a longer one would run silently past the
  positions the model was trained on).
- The KV cache asked for fits in the device's free memory (inline mode; see `kv_cache_problem`).
- The parallel degrees (parallel.tp/ep/...) divide the model's heads, KV heads, experts, vocabulary
  and layers as each technique needs, every factor printed (the training backend's
  `engines/train/build.check_parallel`).
- A training rank's memory peak, as `rlloom plan`'s memory model predicts it for the run's layout
  (model states, one micro-batch's activations and logits, the colocated rollout), fits the GPU,
  or on CPU the host memory available to each rank (`plan.check.check_memory`).
- rollout.quantization=fp8 has routed experts to quantize (an MoE model), and rollout.tp splits the
  model evenly: it divides the attention heads, the KV heads (or is a multiple of them) and the MLP
  and expert widths (the rollout backend's `engines/rollout/build.check_rollout`).
- On-policy distillation's teacher (teacher.path) is a causal LM with the student's tokenizer that
  the run's layout splits (`teacher_check.check_teacher`).
- The reward function resolves (a built-in name, an importable plug-in, or a weighted sum of them).
- A dataset file (data.task=jsonl/parquet) has the format its task names, its rows read, at least one
  row holds the prompt and answer columns (data.prompt_key, data.answer_key), and data.num_eval
  leaves training rows (`check_data`); rows with pictures name files that exist, and need a
  vision-language model (`check_images`); an agent (rollout.agent) takes no rows with pictures
  (`check_agent_pictures`).
- The logging backends turned on (logging.tensorboard, logging.wandb) are installed.
- A resume continues the same run: the checkpoint's `config.yaml` differs from this config only in
  the settings of `rlloom.config.resume.FREE_TO_CHANGE`, unless trainer.resume_allow_changes=true
  (`check_resume_config`, called by `run` once it holds the run directory's lock and has resolved
  the checkpoint).

Each failure is one `ConfigError` line naming the setting, the value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import torch

from rlloom.agents.build import check_agent
from rlloom.config import ConfigError, RunConfig
from rlloom.config.loading import load_config
from rlloom.config.resume import run_changing_differences
from rlloom.data.chat import encode_prompt, with_image_parts
from rlloom.devices import available_memory_bytes
from rlloom.engines.rollout.build import check_rollout
from rlloom.engines.train.build import check_parallel
from rlloom.episodes.build import check_episodes
from rlloom.models.args import ModelArgs
from rlloom.models.checkpoint import VALUE_MODEL_SUFFIXES, load_tokenizer
from rlloom.plan.check import check_memory
from rlloom.rewards.build import check_model_term
from rlloom.rewards.registry import get_reward_fn
from rlloom.tasks.build import default_reward_name, task_prompts
from rlloom.trainer.async_loop import capacity
from rlloom.trainer.model_folder import check_model_folder, check_tokenizer
from rlloom.trainer.teacher_check import check_teacher


def fit_multi_turn_budget(cfg: RunConfig) -> RunConfig:
    """`cfg` with rollout.max_total_tokens capped at the model's positions when it was left at 0 and
    its derived value would pass them (a default never conflicts with the model); a value the user set
    is checked by `check_sequence_length` instead."""
    if not cfg.rollout.multi_turn or cfg.rollout.max_total_tokens:
        return cfg
    max_positions = model_hf_config(cfg.model.path).get("max_position_embeddings")
    if not isinstance(max_positions, int) or cfg.longest_sequence <= max_positions:
        return cfg
    rollout = dataclasses.replace(cfg.rollout, max_total_tokens=max_positions)
    return dataclasses.replace(cfg, rollout=rollout)


def check_before_loading(cfg: RunConfig) -> None:
    """Raise ConfigError for anything wrong that is known before the model is loaded."""
    hf_config = model_hf_config(cfg.model.path)
    check_tokenizer(
        cfg.model.path,
        "model.path",
        chat_template=cfg.data.chat_template,
        system_prompt=cfg.data.system_prompt,
    )
    max_positions = hf_config.get("max_position_embeddings")
    check_policy_model(cfg, hf_config)
    check_vision_layout(cfg, hf_config)
    check_sequence_length(cfg, max_positions if isinstance(max_positions, int) else None)
    check_rollout(cfg, hf_config)
    check_reward(cfg)
    check_step_size(cfg)
    check_parallel(cfg, hf_config)
    check_critic(cfg, hf_config)
    check_teacher(cfg, hf_config)
    check_memory(cfg)
    check_data(cfg)
    check_images(cfg, hf_config)
    check_logging_backends(cfg)
    check_episodes(cfg)
    check_agent(cfg)
    check_agent_pictures(cfg)


def check_agent_pictures(cfg: RunConfig) -> None:
    """An agent's requests reach the rollout as chat text through the OpenAI-compatible endpoint,
    without the rows' pictures: neither the rollout nor training would see them."""
    if not cfg.rollout.agent:
        return
    first = next((r for r in task_prompts(cfg.data, "train") if r.images), None)
    if first is not None:
        raise ConfigError(
            f"rollout.agent={cfg.rollout.agent!r} is invalid with pictures in the rows (data.task="
            f"{cfg.data.task!r}, row {first.index + 1}): an agent's requests reach the rollout as chat text "
            "without them. Fix: use rollout.env for a multi-turn run on pictures, or rows without images."
        )


LOGGING_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""logging.<setting> -> the package it needs (and the rlloom extra of the same name)."""

FILE_SUFFIXES = {"jsonl": (".jsonl", ".json", ".ndjson"), "parquet": (".parquet", ".pq")}
"""The file name endings that say a dataset file is in another task's format."""


def is_installed(package: str) -> bool:
    """The package can be imported (found without importing it)."""
    return importlib.util.find_spec(package) is not None


def check_logging_backends(cfg: RunConfig) -> None:
    """Each logging backend that is turned on has its package installed."""
    for setting, package in LOGGING_PACKAGES.items():
        if getattr(cfg.logging, setting) and not is_installed(package):
            raise ConfigError(
                f"logging.{setting}=true is invalid: it needs the {package} package, which is not installed. "
                f"Fix: pip install 'rlloom[{package}]', or set logging.{setting}=false."
            )


def check_data(cfg: RunConfig) -> None:
    """A dataset file must be in its task's format and hold usable rows for both splits (the rows
    parsed here are kept for the run's prompts: `load_prompt_file`)."""
    data = cfg.data
    if data.task not in FILE_SUFFIXES:
        return
    suffix = Path(data.path).suffix.lower()
    other = next((task for task, ends in FILE_SUFFIXES.items() if suffix in ends and task != data.task), None)
    if other is not None:
        raise ConfigError(
            f"data.task={data.task} is invalid for data.path={data.path!r}: a {suffix} file is read as "
            f"{other}. Fix: set data.task={other}."
        )
    task_prompts(data, "eval")  # DataError: missing or unreadable file, no usable row, num_eval too large


def check_images(cfg: RunConfig, hf_config: dict[str, Any]) -> None:
    """Rows with pictures need a vision-language model with its image processor, and the chat
    template (data.chat_template=true) writing one image placeholder per picture."""
    if cfg.data.task not in FILE_SUFFIXES:
        return
    rows = task_prompts(cfg.data, "eval") + task_prompts(cfg.data, "train")
    first = next((r for r in rows if r.images), None)
    if first is None:
        return
    where = f"data.path={cfg.data.path!r} row {first.index + 1} has images ({len(first.images)})"
    if ModelArgs.from_hf_config(hf_config).vision is None:
        raise ConfigError(
            f"{where} but model.path={cfg.model.path!r} is a text-only {hf_config.get('model_type')} model. "
            "Fix: use a vision-language model (Qwen2.5-VL) or a dataset without images."
        )
    if not cfg.data.chat_template:
        raise ConfigError(
            f"{where} but data.chat_template=false: pictures enter a prompt as image parts of chat "
            "messages, which the chat template turns into placeholders. Fix: set data.chat_template=true."
        )
    if not (Path(cfg.model.path) / "preprocessor_config.json").is_file():
        raise ConfigError(
            f"{where} but model.path={cfg.model.path!r} has no preprocessor_config.json (the image processor "
            "that turns pictures into patches). Fix: copy the model release's preprocessor_config.json into it."
        )
    image_token = ModelArgs.from_hf_config(hf_config).vision.image_token_id
    _, ids = encode_prompt(with_image_parts(first), load_tokenizer(cfg.model.path), chat_template=True)
    if ids.count(image_token) != len(first.images):
        raise ConfigError(
            f"{where} but the chat template of model.path={cfg.model.path!r} writes {ids.count(image_token)} "
            f"image placeholders (token {image_token}) for them. Fix: use a template that renders each "
            '{"type": "image"} part as <|vision_start|><|image_pad|><|vision_end|>, as Qwen2.5-VL\'s does.'
        )


HOST_BYTES_PER_TOKEN = 128
"""Host memory a step holds per token of its samples, rounded up: the ids and rollout logprobs as
Python lists (~36 and ~32 bytes an entry), and the batch's [B, T] tensors (mask, advantages, old,
reference and rollout logprobs, gather indices, targets: ~50 bytes)."""


def check_step_size(cfg: RunConfig) -> None:
    """A step's samples must fit in the host memory that is free (a billion-sample step would
    otherwise run until the OOM killer ends it without a word)."""
    seqs = cfg.trainer.prompts_per_step * cfg.rollout.n_samples
    longest = cfg.longest_sequence
    batches = 1 if cfg.trainer.mode == "sync" else capacity(cfg)  # the async modes hold several
    need = batches * seqs * longest * HOST_BYTES_PER_TOKEN
    free = available_memory_bytes(torch.device("cpu"))
    if need <= free:
        return
    held = f" x {batches} batches in flight (trainer.mode={cfg.trainer.mode})" if batches > 1 else ""
    raise ConfigError(
        f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} x rollout.n_samples={cfg.rollout.n_samples} "
        f"= {seqs} sequences of up to {longest} tokens{held} is invalid: they need about "
        f"{need / 2**30:.1f} GiB of host memory (~{HOST_BYTES_PER_TOKEN} bytes a token) and "
        f"{free / 2**30:.1f} GiB is free. Fix: lower trainer.prompts_per_step or rollout.n_samples"
        f"{' (or trainer.max_staleness)' if held else ''}."
    )


def model_hf_config(path: str, key: str = "model.path") -> dict[str, Any]:
    """The checkpoint's config.json as a dict, once the folder passes `check_model_folder` (`key`: the
    setting that named it, for the error)."""
    return check_model_folder(path, key)


def check_policy_model(cfg: RunConfig, hf_config: dict[str, Any]) -> None:
    """The policy is a causal LM: a value or reward model has no vocabulary head to sample from."""
    arch = (hf_config.get("architectures") or [""])[0]
    if arch.endswith(VALUE_MODEL_SUFFIXES):
        raise ConfigError(
            f"model.path={cfg.model.path!r} is invalid: it is a {arch}, a value or reward model without a "
            "vocabulary head, and the policy must be a causal LM. Fix: pass a causal LM checkpoint as "
            "model.path (a value model can start PPO's critic: critic.model_path with algorithm.estimator=gae)."
        )


def check_vision_layout(cfg: RunConfig, hf_config: dict[str, Any]) -> None:
    """A vision-language model trains and generates at tp = cp = pp = ep = 1 (data parallel only):
    the sharding plans and the pipeline stages cover the decoder, not the vision tower."""
    if ModelArgs.from_hf_config(hf_config).vision is None:
        return
    p = cfg.parallel
    split = {"parallel.tp": p.tp, "parallel.cp": p.cp, "parallel.pp": p.pp, "parallel.ep": p.ep}
    split["rollout.tp"] = cfg.rollout.tp
    wrong = {k: v for k, v in split.items() if v != 1}
    if wrong:
        raise ConfigError(
            f"{', '.join(f'{k}={v}' for k, v in wrong.items())} is invalid for model.path={cfg.model.path!r}: "
            f"a {hf_config.get('model_type')} model (with a vision tower) runs data parallel only (tp, cp, pp, "
            f"ep and rollout.tp 1). Fix: set {' '.join(f'{k}=1' for k in wrong)}."
        )


def check_critic(cfg: RunConfig, hf_config: dict[str, Any]) -> None:
    """A critic from another checkpoint (critic.model_path) reads the policy's token ids, so its
    vocabulary must hold them; a value or reward model there must have one output."""
    if not cfg.algorithm.uses_critic or not cfg.critic.model_path:
        return
    critic = model_hf_config(cfg.critic.model_path, "critic.model_path")
    arch = (critic.get("architectures") or [""])[0]
    labels = len(critic.get("id2label") or {}) or critic.get("num_labels", 1)
    if arch.endswith(VALUE_MODEL_SUFFIXES) and labels != 1:
        raise ConfigError(
            f"critic.model_path={cfg.critic.model_path!r} is invalid: it is a {arch} with {labels} labels, and a "
            "value model has one output. Fix: pass a critic or reward model with num_labels=1, or a causal LM "
            "(its value head then starts at zero)."
        )
    policy_vocab, critic_vocab = hf_config.get("vocab_size"), critic.get("vocab_size")
    if isinstance(policy_vocab, int) and isinstance(critic_vocab, int) and critic_vocab < policy_vocab:
        raise ConfigError(
            f"critic.model_path={cfg.critic.model_path!r} is invalid: its vocab_size {critic_vocab} is smaller than "
            f"the policy's {policy_vocab}, and the critic reads the policy's tokens. Fix: start the critic from a "
            'model with the policy\'s tokenizer (critic.model_path="" uses model.path).'
        )


def check_sequence_length(cfg: RunConfig, max_positions: int | None) -> None:
    """The longest sequence, prompt plus response, must fit the model's positions."""
    longest = cfg.longest_sequence
    if max_positions is None or longest <= max_positions:
        return
    if cfg.rollout.multi_turn:
        raise ConfigError(
            f"rollout.max_total_tokens: a multi-turn trajectory may reach {longest} tokens, beyond the model's "
            f"max_position_embeddings={max_positions} ({cfg.model.path}). Fix: set rollout.max_total_tokens="
            f"{max_positions} or less (0 derives it from data.max_prompt_length, rollout.max_turns, "
            "rollout.max_new_tokens and rollout.max_observation_tokens)."
        )
    raise ConfigError(
        f"data.max_prompt_length={cfg.data.max_prompt_length} + rollout.max_new_tokens="
        f"{cfg.rollout.max_new_tokens} = {longest} is invalid: a sequence must fit the model's "
        f"max_position_embeddings={max_positions} ({cfg.model.path}). Fix: lower data.max_prompt_length "
        f"or rollout.max_new_tokens so that their sum is at most {max_positions}."
    )


def check_reward(cfg: RunConfig) -> None:
    """`reward.name` (or the task's default) must name a reward function that can be loaded, and a
    `model` term a reward model folder (reward.model_path)."""
    name = cfg.reward.name or default_reward_name(cfg.data.task)
    rule_name, _ = check_model_term(cfg.reward, name)
    try:
        if rule_name:
            get_reward_fn(rule_name, import_dir=cfg.reward.import_dir)
    except ValueError as e:
        raise ConfigError(f"reward.name={name!r} is invalid: {' '.join(str(e).split())}") from None


def check_resume_config(checkpoint: Path, cfg: RunConfig) -> None:
    """Refuse a resume whose config changes the run (see `run_changing_differences`), unless
    trainer.resume_allow_changes=true."""
    saved_file = checkpoint / "config.yaml"
    if cfg.trainer.resume_allow_changes or not saved_file.is_file():
        return
    allow = "set trainer.resume_allow_changes=true to resume anyway"
    try:
        saved = load_config(saved_file)
    except ConfigError as e:
        raise ConfigError(
            f"trainer.resume: the checkpoint's {saved_file} does not load ({e}). Fix: {allow}."
        ) from None
    differences = run_changing_differences(saved, cfg)
    if differences:
        raise ConfigError(
            f"trainer.resume={cfg.trainer.resume!r}: this config differs from the checkpoint's "
            f"({saved_file}) in settings that change the run: {'; '.join(differences)}. Fix: use the "
            f"checkpoint's values, or {allow} (total_steps, saving and logging settings may always change)."
        )
