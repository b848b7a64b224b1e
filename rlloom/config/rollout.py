"""The `rollout` section: sampling, the KV cache, tensor-parallel replicas, partial rollouts and
multi-turn episodes (environments, tools, budgets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

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
    it); `drop`: their tokens are discarded and the samples generated again under the new weights
    (but for an agent's streamed request: the agent has read its tokens, so it resumes from them).
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
    match_training: bool = False
    """Each sampled token's rollout logprob equals, bit for bit, the logprob the training forward
    computes for it at the same weights: both engines run batch-invariant numerics
    (rlloom/models/exact.py: fixed-order products, reductions and attention whatever the batch,
    prefill or decode), so `rollout/logp_gap_max` reads 0.0 and the old-logprob forward is skipped
    (the rollout's logprobs are pi_old). Text models (not vision-language ones): on the CPU every
    family (slow: for tests and tiny models); on CUDA dense, MoE and MLA models, with Triton kernels
    of one fixed configuration (the experts' grouped product and MLA's latent attention included).
    train.compile and rollout.compile are then off (a compiled graph fuses and rounds differently);
    the rollout's decode still replays CUDA graphs, of the plain forward. Needs
    rollout.temperature=1.0, rollout.quantization=none, rollout.tp=1 and parallel degrees 1
    (data-parallel training ranks are exact)."""

    env: str = ""
    """Multi-turn environment, "module:Class" (imported like reward plug-ins: next to the YAML file,
    in reward.import_dir, or on PYTHONPATH), one instance per trajectory, built with `env_kwargs`:
    `reset(row) -> list[dict] | None` gives the first messages (None: the row's prompt), and
    `step(messages, state) -> EnvStep | dict` (observations, reward, done, metrics) follows each turn.
    Either may be `async def`. Empty: single-turn generation (or the tool loop of `tools`)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    env_workers: int = 4
    """Worker processes that run environment and tool calls (or agents: one a trajectory at a time) isolated from the trainer (a hang past
    env_timeout_s, a crash or sys.exit fails that trajectory only); 0 runs them in threads of the
    trainer, for cheap trusted environments (which must then be thread-safe)."""
    env_timeout_s: float = 60.0
    """Longest environment call (reset or one step); a call past it ends its trajectory with
    reward.default_score, counted in rollout/env_errors."""
    agent: str = ""
    """An agent program to train, "module:function" (imported like `env`): `async def run_agent(base_url,
    row, sampling) -> float | dict | None`, called once per trajectory with the base URL of an
    OpenAI-compatible session on the policy (`http://127.0.0.1:PORT/sessions/<id>/v1`), the data row,
    and the OpenAI client's sampling arguments (model, temperature, top_p, max_tokens). Every request
    the agent sends there is recorded token for token and trained on; it returns the reward (or
    `{"reward": ..., "metrics": {...}}`), or None to let the reward function score its last answer.
    Runs in the environment workers (env_workers); needs `pip install "rlloom[serve]"`. Excludes
    `env` and `tools`."""
    agent_timeout_s: float = 600.0
    """Longest run of one agent (all of its trajectory); past it, or when the agent raises, exits or
    returns something else, its trajectory gets reward.default_score, counted in rollout/agent_errors."""
    tools: list[str] = field(default_factory=list)
    """Tools the policy may call, ["module:function", ...]: plain functions with type hints and a
    Google-style docstring (their JSON schemas are rendered by the chat template). Without `env`, a
    built-in environment runs the calls until the model answers without one."""
    tool_timeout_s: float = 10.0
    """Longest tool call; past it the model reads an error as the tool's output."""
    tool_parser: Literal["hermes"] = "hermes"
    """How tool calls are written in responses: `hermes` is Qwen2.5/Qwen3's
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    max_turns: int = 8
    """Most generation turns of a multi-turn trajectory (it ends with finish reason "length")."""
    max_total_tokens: int = 0
    """Context budget of a multi-turn trajectory (prompt, turns and observations); reaching it ends
    the trajectory with finish reason "length". 0: data.max_prompt_length + max_turns x
    (max_new_tokens + max_observation_tokens)."""
    max_observation_tokens: int = 256
    """Most tokens of one observation message's content; longer ones are truncated."""
    observation_truncation: Literal["right", "left"] = "right"
    """Which end of a long observation is cut: `right` keeps its beginning, `left` its end."""
    multi_turn_samples: Literal["auto", "trajectory", "per_turn"] = "auto"
    """How a multi-turn trajectory becomes samples: `trajectory`, one sample with the observations
    masked out (needs a chat template that extends earlier turns); `per_turn`, one sample per turn;
    `auto`, one sample while the template extends the turns, a new one where it rewrites them (Qwen3
    strips earlier <think> blocks). The samples of a trajectory share its group and reward."""

    @property
    def multi_turn(self) -> bool:
        """Episodes of several turns (an environment, tools or an agent) instead of single-turn generation."""
        return bool(self.env or self.tools or self.agent)

    def __post_init__(self) -> None:
        check_finite(self, "rollout")
        self._check_sampling()
        self._check_engine()
        self._check_episodes()

    def _check_sampling(self) -> None:
        """How responses are sampled, in training and in evaluation."""
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
        check(
            self.eval_temperature >= 0,
            "rollout.eval_temperature",
            self.eval_temperature,
            "must be >= 0",
            "use 0 for greedy evaluation",
        )

    def _check_engine(self) -> None:
        """The engine's KV cache, batch, tensor parallelism and quantization."""
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
            self.quantization == "none" or self.tp == 1,
            "rollout.quantization",
            self.quantization,
            f"fp8 rollout is not built for tensor-parallel replicas (rollout.tp={self.tp})",
            "use rollout.tp=1 with fp8, or rollout.quantization=none",
        )

    def _check_episodes(self) -> None:
        """Multi-turn episodes: environment workers, time limits, turn and token budgets."""
        check(
            self.env_workers >= 0,
            "rollout.env_workers",
            self.env_workers,
            "must be >= 0",
            "e.g. 4 (0: inline)",
        )
        check(
            not self.agent or not (self.env or self.tools),
            "rollout.agent",
            self.agent,
            f"an agent runs its own loop, so it excludes rollout.env={self.env!r} and rollout.tools={self.tools}",
            "leave rollout.env and rollout.tools empty (the agent calls its own tools)",
        )
        for name in ("env_timeout_s", "tool_timeout_s", "agent_timeout_s"):
            value = getattr(self, name)
            check(value > 0, f"rollout.{name}", value, "must be > 0 seconds", "e.g. 30")
        check(self.max_turns >= 1, "rollout.max_turns", self.max_turns, "must be >= 1", "e.g. 4")
        check(
            self.max_total_tokens >= 0,
            "rollout.max_total_tokens",
            self.max_total_tokens,
            "must be >= 0",
            "use 0 to derive it from the prompt, turn and observation limits",
        )
        check(
            self.max_observation_tokens >= 1,
            "rollout.max_observation_tokens",
            self.max_observation_tokens,
            "must be >= 1",
            "e.g. 256",
        )
