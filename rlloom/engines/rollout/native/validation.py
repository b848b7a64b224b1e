"""What the engine validates, once: each request (which ones it rejects, and why: one message per
request, naming the value, rule and fix) and the size of its KV cache.

A rejected request comes back as completions with finish_reason "abort" and `error` set to the
message, while the rest of the batch proceeds (see engine.py). The KV cache the engine is asked for
is sized here (`kv_cache_blocks`) and checked, before it is allocated, against the memory the device
has free (`kv_cache_problem`): a cache larger than that would be killed by the OOM killer without a
message. The settings themselves (rollout.block_size, num_blocks, ...) are checked where they are
read, in rlloom/config/rollout.py.
"""

from __future__ import annotations

import torch

from rlloom.config import ConfigError
from rlloom.devices import available_memory_bytes
from rlloom.engines.rollout.base import SamplingParams
from rlloom.engines.rollout.native.block_manager import BlockManager
from rlloom.engines.rollout.native.model_runner import kv_bytes_per_block
from rlloom.models.args import ModelArgs


def request_problem(
    prompt_ids: list[int],
    sampling: SamplingParams,
    *,
    max_model_len: int,
    vocab_size: int,
    can_decode: bool,
    block_manager: BlockManager,
) -> str | None:
    """Why this request cannot run, or None when it can."""
    problem = sampling.problem()
    if problem is not None:
        return problem
    if not prompt_ids:
        return "prompt is empty: a completion needs at least one prompt token. Fix: drop or fill the prompt."
    if len(prompt_ids) >= max_model_len:
        return (
            f"prompt has {len(prompt_ids)} tokens; it must be shorter than max_model_len={max_model_len} "
            "to leave room for a new token. Fix: truncate the prompt or raise max_model_len."
        )
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        return (
            f"prompt has token ids outside the model's vocabulary [0, {vocab_size}) (min {min(prompt_ids)}, "
            f"max {max(prompt_ids)}). Fix: tokenize with this model's tokenizer."
        )
    if sampling.stop_strings and not can_decode:
        return (
            "SamplingParams.stop_strings needs a decode function. Fix: pass decode= to NativeEngine "
            "(from_pretrained does when the checkpoint has a tokenizer) or use stop_token_ids."
        )
    longest = min(len(prompt_ids) + sampling.max_new_tokens, max_model_len)
    needed = block_manager.blocks_for(longest)
    if needed > block_manager.num_blocks:
        return (
            f"a sequence of up to {longest} tokens needs {needed} KV blocks of {block_manager.block_size} "
            f"tokens but the cache has {block_manager.num_blocks}. Fix: raise num_blocks or "
            "kv_cache_memory_gb, or lower max_new_tokens."
        )
    return None


def kv_cache_blocks(
    args: ModelArgs,
    *,
    num_blocks: int,
    kv_cache_memory_gb: float,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """The KV cache's blocks for a model of `args` (a tensor-parallel rank's own heads): `num_blocks`,
    or with 0 as many as `kv_cache_memory_gb` holds. Raises ConfigError, naming the rollout setting
    that asked for it, when that is less than one block or more than `device` has free."""
    per_block = kv_bytes_per_block(args, block_size, dtype)
    setting, value = (
        ("rollout.num_blocks", num_blocks)
        if num_blocks
        else ("rollout.kv_cache_memory_gb", kv_cache_memory_gb)
    )
    if num_blocks == 0:
        num_blocks = int(kv_cache_memory_gb * 1024**3) // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"{setting}={value!r} is invalid: it holds less than one KV block of {per_block} bytes. "
                "Fix: raise it."
            )
    problem = kv_cache_problem(
        setting,
        value,
        num_blocks=num_blocks,
        extra_blocks=1,  # the model runner's scratch block
        bytes_per_block=per_block,
        available_bytes=available_memory_bytes(device),
        device=str(device),
    )
    if problem is not None:
        raise ConfigError(problem)
    return num_blocks


def kv_cache_problem(
    setting: str,
    value: object,
    *,
    num_blocks: int,
    extra_blocks: int,
    bytes_per_block: int,
    available_bytes: int,
    device: str,
) -> str | None:
    """Why a cache of `num_blocks + extra_blocks` blocks cannot be allocated, or None when it fits in
    `available_bytes`. `setting=value` is the config entry that asked for the cache
    (rollout.num_blocks or rollout.kv_cache_memory_gb); `extra_blocks` are the engine's own."""
    total = num_blocks + extra_blocks
    needed = total * bytes_per_block
    if needed <= available_bytes:
        return None
    fits = max(available_bytes // bytes_per_block - extra_blocks, 0)
    return (
        f"{setting}={value!r} is invalid: it asks for a KV cache of {total} blocks x {bytes_per_block} "
        f"bytes = {needed / 2**30:.1f} GiB, but {device} has {available_bytes / 2**30:.1f} GiB free. "
        f"Fix: set rollout.num_blocks to at most {fits}, or rollout.num_blocks=0 with a smaller "
        "rollout.kv_cache_memory_gb."
    )
