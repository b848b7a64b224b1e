"""The program each rank of a tensor-parallel rollout test runs (gloo on CPU), and the tiny models it
uses; the test runs the same jobs at tp = 1 in its own process and compares.

A job is a checkpoint folder and a list of steps: ("generate", prompts, [SamplingParams]) records the
completions, ("update", folder, sliced) loads another checkpoint's weights through update_weights,
full tensors or (sliced) only the part `weight_shard_slices` says this rank holds.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from rollout_testutil import randomize_
from transformers import DeepseekV3Config, Qwen3MoeConfig, Qwen3MoeForCausalLM

import rlloom.models as models
from rlloom.engines.rollout.native import NativeEngine

Result = list[tuple[int, int, list[int], list[float], str]]


def tiny_moe_tied(seed: int = 0) -> Qwen3MoeForCausalLM:
    """Qwen3-MoE with tied embeddings, one KV head (replicated at tp 2) and a vocabulary of 100 (rows
    padded at tp 2: 52 per rank)."""
    cfg = Qwen3MoeConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=512, norm_topk_prob=True, tie_word_embeddings=True, eos_token_id=None,
        bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return randomize_(Qwen3MoeForCausalLM(cfg), seed).eval()


def tiny_mla(seed: int = 0) -> torch.nn.Module:
    """DeepSeek-V3 (MLA with query LoRA, a dense first layer, shared experts, group routing)."""
    from transformers import AutoModelForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=128, hidden_size=64, num_attention_heads=4, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=1, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, n_group=4, topk_group=2, num_experts_per_tok=2, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, max_position_embeddings=512,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return randomize_(AutoModelForCausalLM.from_config(cfg), seed).eval()


def run_job(job: dict, group: dist.ProcessGroup | None) -> list[Result]:
    """Run one job's steps on a fresh engine (this rank's shard with `group`); the generated results."""
    engine = NativeEngine(
        models.from_pretrained(job["path"], fused_projections=True),
        max_model_len=64,
        num_blocks=128,
        block_size=4,
        seed=job.get("seed", 0),
        tp_group=group,
    )
    results = []
    for step in job["steps"]:
        if step[0] == "generate":
            out = engine.generate(step[1], step[2])
            results.append(
                [(c.prompt_index, c.sample_index, c.token_ids, c.logprobs, c.finish_reason) for c in out]
            )
        else:
            _, folder, sliced = step
            tensors = models.hf_named_tensors(models.from_pretrained(folder))
            if sliced:
                slices = engine.weight_shard_slices()
                tensors = ((n, t if slices[n] is None else t.narrow(*slices[n])) for n, t in tensors)
            engine.update_weights(tensors, version=len(results))
    return results


def run_rank(rank: int, world: int, rendezvous: str, jobs: dict[str, dict], out: str) -> None:
    """torch.multiprocessing.spawn target: every job at tp = world; rank r saves `out`.r."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        results = {name: run_job(job, dist.group.WORLD) for name, job in jobs.items()}
        engine_dims = NativeEngine(
            models.from_pretrained(jobs["dense"]["path"], fused_projections=True),
            max_model_len=16,
            num_blocks=4,
            block_size=4,
            tp_group=dist.group.WORLD,
        ).weight_shard_dims()
        torch.save({"results": results, "dims": engine_dims}, Path(f"{out}.{rank}"))
    finally:
        dist.destroy_process_group()
