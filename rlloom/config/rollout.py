"""The `rollout` section: sampling, the KV cache, tensor-parallel replicas and partial rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlloom.config.checks import check, check_finite


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    n_samples: int = 8
    """Completions per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature of the RL policy (> 0; greedy is not a valid RL policy)."""
    top_p: float = 1.0
    """Nucleus sampling; 1.0 samples from the full distribution as RL needs."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    max_new_tokens: int = 64
    """Response length limit."""
    stop_strings: list[str] = field(default_factory=list)
    """Extra stop strings besides the tokenizer's end-of-sequence token."""
    num_blocks: int = 0
    """KV-cache blocks; 0 sizes the cache from kv_cache_memory_gb."""
    kv_cache_memory_gb: float = 1.0
    """KV-cache memory when num_blocks is 0."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    max_num_seqs: int = 256
    """Most sequences decoded together."""
    enforce_eager: bool = False
    """Disable CUDA graphs (GPU only)."""
    compile: bool = True
    """torch.compile the decode forward that the CUDA graphs capture (GPU only; the first decode
    step compiles, tens of seconds)."""
    eval_temperature: float = 0.0
    """Temperature for evaluation (0 = greedy)."""
    ignore_eos: bool = False
    """Keep generating past EOS up to max_new_tokens (benchmarks with fixed lengths)."""
    sleep_during_train: bool = True
    """Free the KV cache between generation and weight sync, so training can use that memory."""
    partial: Literal["finish", "abort_resume", "drop"] = "finish"
    """Asynchronous modes: what happens to requests in flight when new weights arrive. `finish`: they
    end under the old weights before the update is applied; `abort_resume`: they are aborted, the
    weights updated between decode steps, and they resume under the new weights from prompt + tokens
    so far (KV cache rebuilt; every token keeps the version and logprob of the policy that produced
    it); `drop`: their tokens are discarded and the samples generated again under the new weights.
    abort_resume and drop need trainer.mode=async. Every mode works at any rollout.tp, inline or on
    Ray: the ranks of a replica abort, resume and take the new weights at the same decode step, as
    the replica's rank 0 decides."""
    tp: int = 1
    """Tensor-parallel degree of one rollout engine: its model's heads, MLP (and expert) widths and
    vocabulary are split over `tp` ranks (GPUs), one all-reduce per attention and per MLP. Must divide
    the attention heads and the MLP widths (checked at start-up); kv_cache_memory_gb is per rank."""
    quantization: Literal["none", "fp8"] = "none"
    """Weights the rollout engine samples with. `fp8` (MoE models): the routed experts in float8
    e4m3 with one scale per row and 128 columns, re-quantized at every weight sync, multiplied by a
    Triton kernel (GPUs of compute capability >= 8.9; elsewhere dequantize-then-matmul, slower than
    `none`): MoE decode reads about half the bytes. Attention, dense MLPs, embedding, lm head and
    routers stay in the model dtype, and a dense model is refused. Training stays bf16/fp32, so the
    rollout's logprobs differ more from training's: watch `rollout/token_mult_prob_error` and
    correct with `algorithm.is_correction`. Needs rollout.tp=1."""

    def __post_init__(self) -> None:
        check_finite(self, "rollout")
        check(
            self.n_samples >= 1,
            "rollout.n_samples",
            self.n_samples,
            "must be >= 1",
            "use 2 or more for GRPO groups",
        )
        check(
            self.temperature > 0,
            "rollout.temperature",
            self.temperature,
            "must be > 0; temperature 0 is greedy decoding and is not a valid RL policy",
            "use 1.0",
        )
        check(
            0 < self.top_p <= 1,
            "rollout.top_p",
            self.top_p,
            "must be in (0, 1]",
            "use 1.0 for the full distribution",
        )
        check(
            self.top_k == -1 or self.top_k >= 1,
            "rollout.top_k",
            self.top_k,
            "must be -1 (off) or >= 1",
            "use -1",
        )
        check(
            self.max_new_tokens >= 1,
            "rollout.max_new_tokens",
            self.max_new_tokens,
            "must be >= 1",
            "use a positive length",
        )
        check(self.block_size >= 1, "rollout.block_size", self.block_size, "must be >= 1", "use 16")
        check(
            self.num_blocks >= 0,
            "rollout.num_blocks",
            self.num_blocks,
            "must be >= 0",
            "use 0 to size by memory",
        )
        check(
            self.kv_cache_memory_gb > 0,
            "rollout.kv_cache_memory_gb",
            self.kv_cache_memory_gb,
            "must be > 0",
            "e.g. 1.0",
        )
        check(self.max_num_seqs >= 1, "rollout.max_num_seqs", self.max_num_seqs, "must be >= 1", "e.g. 256")
        check(
            self.tp >= 1,
            "rollout.tp",
            self.tp,
            "must be >= 1",
            "use 1 (one GPU per rollout engine) or the number of GPUs one engine spans, e.g. 2",
        )
        check(
            self.eval_temperature >= 0,
            "rollout.eval_temperature",
            self.eval_temperature,
            "must be >= 0",
            "use 0 for greedy evaluation",
        )
        check(
            self.quantization == "none" or self.tp == 1,
            "rollout.quantization",
            self.quantization,
            f"fp8 rollout is not built for tensor-parallel replicas (rollout.tp={self.tp})",
            "use rollout.tp=1 with fp8, or rollout.quantization=none",
        )
