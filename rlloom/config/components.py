"""Typed configs, one dataclass per component, composed into `RunConfig`.

Every field has a docstring right under it. Range checks live in `__post_init__` and raise
`ConfigError` naming the key, the value, the rule and the fix; type checks and unknown keys are
handled once by `rlloom.config.loading` when a YAML file or overrides are applied.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Literal

MAX_SEED = 2**32 - 1
"""Largest seed: `numpy.random.seed` accepts 0..2**32-1, the narrowest range of the RNGs a run seeds
(`random.seed` takes any int, `torch.manual_seed` -2**63..2**64-1)."""


LORA_TARGET_NAMES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)
"""Hugging Face projection names `train.lora_target_modules` may list (rlloom/models/lora.py)."""


def lora_targets_valid(targets: str) -> bool:
    """`all-linear`, or a non-empty comma list of LORA_TARGET_NAMES: the rule of
    train.lora_target_modules (and of `rlloom plan --lora-target-modules`)."""
    names = [t.strip() for t in targets.split(",") if t.strip()]
    return targets.strip() == "all-linear" or (bool(names) and all(t in LORA_TARGET_NAMES for t in names))


class UserError(ValueError):
    """A mistake in what the user gave (config, data file, model path): the CLI prints its one-line
    message as `rlloom: error: ...` and exits 2, without a traceback. Internal bugs raise other types."""


class ConfigError(UserError):
    """A user error in the run configuration (unknown key, wrong type, impossible value)."""


MAX_ABS_SCORE = 1e15
"""Largest reward magnitude a run accepts (`reward.default_score`, and every score: the reward
runner's copy is `rlloom.rewards.calling.MAX_ABS_SCORE`, which says why)."""


def _check(ok: bool, key: str, value: object, rule: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {rule}. Fix: {fix}.")


def _check_finite(section: object, prefix: str) -> None:
    """Every float of a section (and of its tuples) must be finite: no field here accepts NaN or
    infinity, so `.inf` / `.nan` in YAML are refused before any range check can be fooled by them."""
    for f in fields(section):  # type: ignore[arg-type]
        value = getattr(section, f.name)
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, float) and not math.isfinite(item):
                _check(
                    False,
                    f"{prefix}.{f.name}",
                    value,
                    "must be a finite number (NaN and infinity are refused)",
                    f"give a finite number, e.g. the default {prefix}.{f.name}={f.default!r}",
                )


def _check_seed(key: str, seed: int) -> None:
    _check(
        0 <= seed <= MAX_SEED,
        key,
        seed,
        "must be in [0, 2**32-1] (numpy.random.seed's range, the narrowest of the seeded RNGs)",
        "use a seed such as 0 or 1234",
    )


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str = "smollm2-135m-instruct"
    """Hugging Face checkpoint folder, or the embedded model name `smollm2-135m-instruct`."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype: `auto` is float32 on CPU and bfloat16 on GPU."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    task: Literal["arithmetic", "countdown", "jsonl", "parquet"] = "arithmetic"
    """Built-in procedural task, or a dataset file (`path`) of prompts and ground truths."""
    path: str = ""
    """Dataset file for task=jsonl/parquet."""
    prompt_key: str = "prompt"
    """Field holding the prompt: a string or a list of chat messages."""
    answer_key: str = "answer"
    """Field holding the ground truth."""
    max_prompt_length: int = 256
    """Prompts longer than this (in tokens, after templating) are skipped and counted."""
    chat_template: bool = True
    """Apply the tokenizer's chat template to the prompt."""
    system_prompt: str = ""
    """Optional system message put before every prompt when chat_template is on."""
    num_digits: int = 2
    """Arithmetic: digits per operand."""
    operators: str = "+"
    """Arithmetic: operators drawn from, e.g. `+-*`."""
    num_train: int = 10000
    """Procedural tasks: number of training prompts generated."""
    num_eval: int = 200
    """Held-out prompts for evaluation (procedural tasks: generated with a different seed)."""
    seed: int = 0
    """Seed for shuffling and procedural generation."""

    def __post_init__(self) -> None:
        _check(
            self.max_prompt_length >= 1,
            "data.max_prompt_length",
            self.max_prompt_length,
            "must be >= 1",
            "use a positive token count",
        )
        _check(
            1 <= self.num_digits <= 9,
            "data.num_digits",
            self.num_digits,
            "must be in [1, 9]",
            "pick 1..9 digits",
        )
        bad = set(self.operators) - set("+-*")
        _check(
            bool(self.operators) and not bad,
            "data.operators",
            self.operators,
            "must be a non-empty string of + - *",
            "e.g. data.operators='+-'",
        )
        _check(
            self.num_eval >= 0, "data.num_eval", self.num_eval, "must be >= 0", "use 0 to disable evaluation"
        )
        _check(self.num_train >= 1, "data.num_train", self.num_train, "must be >= 1", "use a positive count")
        _check_seed("data.seed", self.seed)
        _check(
            not self.path or self.task in ("jsonl", "parquet"),
            "data.path",
            self.path,
            f"is read only by data.task=jsonl or parquet, and data.task={self.task} generates its own prompts",
            "set data.task=jsonl (or parquet) to train on the file, or leave data.path out",
        )


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
        _check_finite(self, "rollout")
        _check(
            self.n_samples >= 1,
            "rollout.n_samples",
            self.n_samples,
            "must be >= 1",
            "use 2 or more for GRPO groups",
        )
        _check(
            self.temperature > 0,
            "rollout.temperature",
            self.temperature,
            "must be > 0; temperature 0 is greedy decoding and is not a valid RL policy",
            "use 1.0",
        )
        _check(
            0 < self.top_p <= 1,
            "rollout.top_p",
            self.top_p,
            "must be in (0, 1]",
            "use 1.0 for the full distribution",
        )
        _check(
            self.top_k == -1 or self.top_k >= 1,
            "rollout.top_k",
            self.top_k,
            "must be -1 (off) or >= 1",
            "use -1",
        )
        _check(
            self.max_new_tokens >= 1,
            "rollout.max_new_tokens",
            self.max_new_tokens,
            "must be >= 1",
            "use a positive length",
        )
        _check(self.block_size >= 1, "rollout.block_size", self.block_size, "must be >= 1", "use 16")
        _check(
            self.num_blocks >= 0,
            "rollout.num_blocks",
            self.num_blocks,
            "must be >= 0",
            "use 0 to size by memory",
        )
        _check(
            self.kv_cache_memory_gb > 0,
            "rollout.kv_cache_memory_gb",
            self.kv_cache_memory_gb,
            "must be > 0",
            "e.g. 1.0",
        )
        _check(self.max_num_seqs >= 1, "rollout.max_num_seqs", self.max_num_seqs, "must be >= 1", "e.g. 256")
        _check(
            self.tp >= 1,
            "rollout.tp",
            self.tp,
            "must be >= 1",
            "use 1 (one GPU per rollout engine) or the number of GPUs one engine spans, e.g. 2",
        )
        _check(
            self.eval_temperature >= 0,
            "rollout.eval_temperature",
            self.eval_temperature,
            "must be >= 0",
            "use 0 for greedy evaluation",
        )
        _check(
            self.quantization == "none" or self.tp == 1,
            "rollout.quantization",
            self.quantization,
            f"fp8 rollout is not built for tensor-parallel replicas (rollout.tp={self.tp})",
            "use rollout.tp=1 with fp8, or rollout.quantization=none",
        )


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    name: str = ""
    """Reward function: a built-in name (number, math, countdown, format_number, ...), a plug-in
    `package.module:function`, or a weighted sum such as `number + 0.1*format_number`; empty picks
    the task's default."""
    num_workers: int = 2
    """Worker processes that run plug-in reward functions, isolated from the trainer: each sample
    under `timeout_s`, each worker under `memory_limit_gb`, killed with every process it started."""
    builtins_in_workers: bool = False
    """Also run the built-in rewards in the workers; off by default because they are trusted and
    about 10x cheaper inline (plug-ins, and sums holding one, always run in workers)."""
    timeout_s: float = 10.0
    """Per-sample timeout (per call for a batched reward function): a sample not scored in time
    scores default_score, and its worker is killed (with every process it started) and replaced."""
    memory_limit_gb: float = 4.0
    """Address-space cap of each worker (RLIMIT_AS), in GiB; an allocation beyond it fails and the
    sample scores default_score. 0 means no cap (needed for a reward model on a GPU)."""
    import_dir: str = ""
    """Folder where plug-in reward modules are also looked for (appended to the import path, so
    no PYTHONPATH is needed): a YAML config file sets it to its own folder; empty means the current
    directory (where `rlloom train` or `rlloom eval` runs; a recipe's default)."""
    default_score: float = 0.0
    """Score of a sample whose reward function hung, raised, crashed or returned a non-number (or
    a number of magnitude above 1e15, beyond which the group statistics overflow float32)."""

    def __post_init__(self) -> None:
        _check_finite(self, "reward")
        _check(
            self.num_workers >= 1,
            "reward.num_workers",
            self.num_workers,
            "must be >= 1 (plug-in rewards always run in worker processes)",
            "use e.g. 2; built-in rewards run inline unless reward.builtins_in_workers=true",
        )
        _check(
            math.isfinite(self.timeout_s) and self.timeout_s > 0,
            "reward.timeout_s",
            self.timeout_s,
            "must be a finite number of seconds > 0 (a hung reward must not stall the run)",
            "e.g. 10",
        )
        _check(
            math.isfinite(self.memory_limit_gb) and self.memory_limit_gb >= 0,
            "reward.memory_limit_gb",
            self.memory_limit_gb,
            "must be a finite number >= 0",
            "e.g. 4, or 0 for no cap",
        )
        _check(
            math.isfinite(self.default_score) and abs(self.default_score) <= MAX_ABS_SCORE,
            "reward.default_score",
            self.default_score,
            f"must be a finite number of magnitude at most {MAX_ABS_SCORE:g} (as every score)",
            "e.g. 0",
        )


Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"]
PolicyLoss = Literal["ppo_clip", "gspo", "cispo"]
AggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    estimator: Estimator = "grpo"
    """Advantage estimator. `gae`: PPO with a critic (a value model trained beside the policy, the
    `critic` section; Generalized Advantage Estimation with `gamma` and `lam`, whitened over the
    batch); the others need no critic."""
    loss: PolicyLoss = "ppo_clip"
    """Policy loss."""
    eps_low: float = 0.2
    """Lower clip range of the importance ratio (1 - eps_low)."""
    eps_high: float = 0.2
    """Upper clip range (1 + eps_high); DAPO's clip-higher uses 0.28."""
    dual_clip_c: float = 0.0
    """Dual-clip constant (> 1 enables it; 0 disables)."""
    agg_mode: AggMode = "token-mean"
    """How per-token losses reduce to the step loss."""
    norm_constant: int = 0
    """Normaliser for seq-mean-token-sum-norm; 0 means rollout.max_new_tokens."""
    kl_kind: Literal["k1", "k2", "k3", "abs"] = "k3"
    """KL estimator for the KL loss against the reference (initial) policy."""
    kl_coef: float = 0.0
    """KL coefficient (a loss term, or with `kl_in_reward` a reward penalty); 0 turns the reference
    policy off."""
    kl_in_reward: bool = False
    """Put the KL against the reference into the reward instead of the loss: every response token's
    reward is -kl_coef x KL_t (`kl_kind`'s estimate between the policy before the update and the
    reference), the outcome reward added on the last token (InstructGPT's and TRL's PPO, OpenRLHF's
    REINFORCE++; verl's use_kl_in_reward). Needs a token-level estimator (gae, reinforce_pp) and
    kl_coef > 0; the old logprobs are then always recomputed."""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """The KL-in-reward coefficient: `fixed` (kl_coef throughout) or `adaptive` (Ziegler et al.'s
    controller, as InstructGPT, TRL's PPO and verl's kl_ctrl.type=adaptive: starts at kl_coef, then
    each step multiplies it by 1 + clip(KL / kl_target - 1, -0.2, 0.2) x samples / kl_horizon, where
    KL is the step's mean per-sample KL; saved in checkpoints). `adaptive` needs kl_in_reward."""
    kl_target: float = 0.1
    """The KL per sample (mean over its tokens) the adaptive controller steers to (verl's target_kl)."""
    kl_horizon: int = 10000
    """The adaptive controller's horizon in samples (verl's horizon): the larger, the slower it moves."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    gamma: float = 1.0
    """Discount of REINFORCE++ returns and of GAE."""
    lam: float = 1.0
    """GAE's lambda (estimator gae): 1 gives returns minus values, 0 one-step temporal differences."""
    use_rollout_logprobs: bool = False
    """Use the rollout engine's logprobs as old logprobs instead of recomputing them."""
    routing_replay: Literal["none", "rollout"] = "none"
    """MoE models: `rollout` replays the experts the rollout engine chose for every token in the
    training forwards (old logprobs and updates), so training and rollout use the same experts (R3;
    the router weights still come from the current router). `none`: training routes by itself;
    `moe/route_mismatch_frac` reports how often the two disagree."""
    is_correction: Literal["none", "tis", "mis"] = "none"
    """Train/inference mismatch correction: truncated (tis) or masked (mis) importance sampling."""
    is_level: Literal["token", "sequence"] = "token"
    """Level at which IS weights are computed."""
    is_high: float = 2.0
    """Upper bound of the IS weight."""
    is_low: float = 0.0
    """Lower bound of the IS weight for mis (0 = none)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and sample more prompts until the batch is full."""
    max_sampling_rounds: int = 3
    """Most extra generation rounds per step for dynamic sampling."""
    decoupled_ppo: bool = False
    """Decoupled PPO (Hilton et al. 2022; AReaL): the clip is around the proximal policy, the current
    weights before the update (recomputed old logprobs), and each token's loss is weighted by
    proximal / behaviour (the rollout's logprob of the policy that produced it), untruncated up to
    `is_high`. Off: the asynchronous modes weight by truncated importance sampling (`is_correction`,
    `tis` unless set)."""
    overlong_buffer: int = 0
    """DAPO overlong shaping buffer in tokens (0 = off)."""
    overlong_factor: float = 1.0
    """Penalty at max length for overlong shaping."""

    @property
    def uses_critic(self) -> bool:
        """The estimator trains a critic (PPO's value model, the `critic` section): gae."""
        return self.estimator == "gae"

    def __post_init__(self) -> None:
        _check_finite(self, "algorithm")
        _check(0 <= self.eps_low < 1, "algorithm.eps_low", self.eps_low, "must be in [0, 1)", "use 0.2")
        _check(
            self.eps_high >= 0,
            "algorithm.eps_high",
            self.eps_high,
            "must be >= 0",
            "use 0.2 or 0.28 (clip-higher)",
        )
        _check(
            self.dual_clip_c == 0 or self.dual_clip_c > 1,
            "algorithm.dual_clip_c",
            self.dual_clip_c,
            "must be 0 (off) or > 1",
            "use 3.0 or 0",
        )
        _check(
            self.norm_constant >= 0,
            "algorithm.norm_constant",
            self.norm_constant,
            "must be >= 0",
            "use 0 for max_new_tokens",
        )
        _check(
            self.kl_coef >= 0,
            "algorithm.kl_coef",
            self.kl_coef,
            "must be >= 0",
            "use 0 to disable the KL loss",
        )
        _check(0 < self.gamma <= 1, "algorithm.gamma", self.gamma, "must be in (0, 1]", "use 1.0")
        if self.kl_in_reward:
            _check(
                self.estimator in ("gae", "reinforce_pp"),
                "algorithm.kl_in_reward",
                self.kl_in_reward,
                f"a per-token KL reward needs a token-level estimator, and estimator {self.estimator} uses one "
                "reward per sample",
                "set algorithm.estimator=gae or reinforce_pp, or algorithm.kl_in_reward=false (a KL loss term)",
            )
            _check(
                self.kl_coef > 0,
                "algorithm.kl_in_reward",
                self.kl_in_reward,
                "needs algorithm.kl_coef > 0 (the penalty's coefficient)",
                "set algorithm.kl_coef, e.g. 0.01",
            )
        _check(
            self.kl_ctrl == "fixed" or self.kl_in_reward,
            "algorithm.kl_ctrl",
            self.kl_ctrl,
            "the adaptive controller sets the coefficient of the KL in the reward, and kl_in_reward is off",
            "set algorithm.kl_in_reward=true (with estimator gae or reinforce_pp), or algorithm.kl_ctrl=fixed",
        )
        _check(self.kl_target > 0, "algorithm.kl_target", self.kl_target, "must be > 0", "use 0.1")
        _check(self.kl_horizon > 0, "algorithm.kl_horizon", self.kl_horizon, "must be > 0", "use 10000")
        _check(0 <= self.lam <= 1, "algorithm.lam", self.lam, "must be in [0, 1]", "use 1.0 or 0.95")
        _check(
            self.entropy_coef >= 0,
            "algorithm.entropy_coef",
            self.entropy_coef,
            "must be >= 0 (a negative bonus would reward collapsing the policy)",
            "use 0 to disable the entropy bonus",
        )
        _check(
            self.overlong_factor >= 0,
            "algorithm.overlong_factor",
            self.overlong_factor,
            "must be >= 0 (it is a penalty)",
            "use 1.0",
        )
        _check(self.is_high > 0, "algorithm.is_high", self.is_high, "must be > 0", "use 2.0")
        _check(
            0 <= self.is_low < self.is_high,
            "algorithm.is_low",
            self.is_low,
            "must be in [0, is_high)",
            "use 0",
        )
        _check(
            self.max_sampling_rounds >= 1,
            "algorithm.max_sampling_rounds",
            self.max_sampling_rounds,
            "must be >= 1",
            "use 3",
        )
        _check(
            self.overlong_buffer >= 0,
            "algorithm.overlong_buffer",
            self.overlong_buffer,
            "must be >= 0",
            "use 0 to disable",
        )


@dataclass(kw_only=True, slots=True)
class TrainEngineConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warmup: constant, linear decay to 0, or cosine decay to min_lr_ratio * lr."""
    warmup_steps: int = 0
    """Linear warmup optimizer steps."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""
    grad_clip: float = 1.0
    """Clip gradients by global norm (0 = off)."""
    max_tokens_per_micro_batch: int = 4096
    """Token budget per micro-batch (max_tokens_per_gpu of verl and slime)."""
    gather_once_per_step: bool = False
    """FSDP: gather the compute-dtype parameters once per optimizer step and reduce the gradients
    once, after the last micro-batch (accumulating them unsharded in fp32), instead of around every
    micro-batch. Saves per-micro-batch copies, casts and collectives; costs a full compute-dtype
    copy of the parameters plus a full fp32 gradient on every rank for the whole step. Worth it for
    models that fit on one GPU several times over (e.g. 0.6B-4B), not for sharding large ones. One
    GPU without optimizer offload runs without FSDP and already works this way
    (rlloom/parallel/mixed_precision.py)."""
    activation_checkpointing: Literal["off", "full", "every_k"] = "off"
    """Recompute activations in backward for all layers, or every k-th layer."""
    ac_every_k: int = 2
    """With activation_checkpointing=every_k: checkpoint every k-th layer."""
    compile: bool = True
    """torch.compile each decoder layer on CUDA (fuses norms, RoPE and SwiGLU: 1.37x faster train step
    on an H200; the first steps pay the compile time). CPU runs stay eager: compiling takes minutes."""
    optimizer_offload: bool = False
    """Run the AdamW step on CPU with its state in CPU memory (CPU Adam). On one GPU it also keeps
    FSDP's bf16 copies one layer at a time (2 bytes a parameter less at the peak, a slower step)."""
    optimizer_offload_fraction: float = 1.0
    """Fraction of parameters whose optimizer state is offloaded when optimizer_offload is on."""
    logprob_chunk_tokens: int = 4096
    """Tokens per chunk of the logprob head (bounds the logits memory: chunk x vocabulary)."""
    share_prompts: bool = True
    """Pack a group's responses behind one copy of their shared prompt; exact, fewer FLOPs."""
    moe_aux_loss_coef: float = 0.0
    """MoE load-balancing auxiliary loss coefficient (Qwen3-MoE/Mixtral's router_aux_loss_coef, e.g.
    0.001 in pre-training). 0, as verl, slime and NeMo-RL run RL: the loss would pull the router away
    from the rollout's routing. See rlloom/models/moe.py."""
    moe_bias_update_rate: float = 0.0
    """DeepSeek-V3 correction-bias update per step (its pre-training used 0.001): under-loaded experts'
    bias rises by this much, over-loaded ones' falls. 0 keeps the checkpoint's bias, as RL runs do."""
    lora_rank: int = 0
    """LoRA: train rank-r adapters on the targeted projections with the rest of the policy frozen
    (0 = full fine-tuning). Gradients and AdamW state exist for the adapters only; the weight sync,
    `rlloom export` and the run's Hugging Face folders carry the merged weights, so the rollout
    engine runs the plain model. LoRA usually wants a larger train.lr than full fine-tuning (e.g.
    10x). The reference and the critic stay full models. Runs in every layout (FSDP, parallel.tp,
    pp, cp, ep; routed experts stay frozen)."""
    lora_alpha: float = 16.0
    """LoRA's scale numerator: the update is (lora_alpha / lora_rank) x B A."""
    lora_target_modules: str = "all-linear"
    """The projections that get adapters: all-linear (every attention and dense-MLP projection of the
    decoder layers; routed experts, routers, embeddings and the lm head stay frozen) or a comma list
    of Hugging Face names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, q_a_proj,
    q_b_proj, kv_a_proj_with_mqa, kv_b_proj."""

    def __post_init__(self) -> None:
        _check_finite(self, "train")
        _check(
            self.lora_rank >= 0, "train.lora_rank", self.lora_rank, "must be >= 0", "use 0 (off) or e.g. 16"
        )
        _check(self.lora_alpha > 0, "train.lora_alpha", self.lora_alpha, "must be > 0", "e.g. 32")
        _check(
            lora_targets_valid(self.lora_target_modules),
            "train.lora_target_modules",
            self.lora_target_modules,
            f"must be all-linear or a comma list of {', '.join(LORA_TARGET_NAMES)}",
            "use all-linear, or e.g. q_proj,v_proj",
        )
        _check(self.lr > 0, "train.lr", self.lr, "must be > 0", "e.g. 1e-5")
        _check(
            self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0", "use 0.0 or 0.01"
        )
        _check(
            all(0 <= b < 1 for b in self.betas),
            "train.betas",
            self.betas,
            "each must be in [0, 1)",
            "use [0.9, 0.999]",
        )
        _check(self.adam_eps > 0, "train.adam_eps", self.adam_eps, "must be > 0", "use 1e-8")
        _check(self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "must be >= 0", "use 0")
        _check(
            0 <= self.min_lr_ratio <= 1,
            "train.min_lr_ratio",
            self.min_lr_ratio,
            "must be in [0, 1]",
            "use 0.0",
        )
        _check(
            self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "must be >= 0", "use 1.0 or 0 to disable"
        )
        _check(
            self.max_tokens_per_micro_batch >= 1,
            "train.max_tokens_per_micro_batch",
            self.max_tokens_per_micro_batch,
            "must be >= 1",
            "e.g. 4096",
        )
        _check(self.ac_every_k >= 1, "train.ac_every_k", self.ac_every_k, "must be >= 1", "use 2")
        _check(
            0 < self.optimizer_offload_fraction <= 1,
            "train.optimizer_offload_fraction",
            self.optimizer_offload_fraction,
            "must be in (0, 1]",
            "use 1.0",
        )
        _check(
            self.logprob_chunk_tokens >= 1,
            "train.logprob_chunk_tokens",
            self.logprob_chunk_tokens,
            "must be >= 1",
            "use 1024",
        )
        for name in ("moe_aux_loss_coef", "moe_bias_update_rate"):
            value = getattr(self, name)
            _check(
                math.isfinite(value) and value >= 0,
                f"train.{name}",
                value,
                "must be a finite number >= 0",
                "use 0 (off, as RL runs do) or e.g. 0.001",
            )


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """The value model of PPO with a critic, trained only with algorithm.estimator=gae. It lives on the
    training ranks, in their layout, and takes the `train` section's other settings (token budget,
    activation checkpointing, AdamW betas, schedule, optimizer offload)."""

    model_path: str = ""
    """Checkpoint the critic starts from ("" = model.path): a causal LM's body, with the lm head
    replaced by a linear value head that starts at zero (the first values are all 0), or a value or
    reward model with its head (transformers' *ForTokenClassification, e.g. `rlloom export --critic`'s
    folder, or *ForSequenceClassification, with one label)."""
    lr: float = 1e-5
    """Peak learning rate of the critic."""
    grad_clip: float = 1.0
    """Clip the critic's gradients by global norm (0 = off)."""
    value_clip: float = 0.5
    """Clip range of the value loss around the values at rollout time (verl's cliprange_value)."""
    warmup_steps: int = 0
    """RL steps at the start of the run that train only the critic; the policy is not updated in
    them (verl's trainer.critic_warmup). Not the learning-rate warmup (`train.warmup_steps`)."""

    def __post_init__(self) -> None:
        _check_finite(self, "critic")
        _check(self.lr > 0, "critic.lr", self.lr, "must be > 0", "e.g. 1e-5")
        _check(
            self.grad_clip >= 0, "critic.grad_clip", self.grad_clip, "must be >= 0", "use 1.0 or 0 to disable"
        )
        _check(self.value_clip > 0, "critic.value_clip", self.value_clip, "must be > 0", "use 0.5")
        _check(self.warmup_steps >= 0, "critic.warmup_steps", self.warmup_steps, "must be >= 0", "use 0")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree: attention heads, MLP width and the vocabulary split over tp ranks.
    Data parallelism is what the degrees leave: cluster.num_workers = pp x dp x cp x tp."""
    pp: int = 1
    """Pipeline-parallel degree (decoder layers split into pp stages); composes with tp, ep and cp."""
    cp: int = 1
    """Context-parallel degree: each packed micro-batch split over cp ranks, every document cut into
    2 x cp chunks balanced by attention cost (rlloom.parallel.cp). Needs train.share_prompts=false."""
    ep: int = 1
    """Expert-parallel degree (routed experts split over ep ranks, taken from dp x cp x tp; no
    expert-tensor parallelism: split across TP ranks the expert GEMMs get too small to run well)."""
    sequence_parallel: bool = True
    """With tp > 1, keep the residual stream sharded over tokens between blocks (norms and residual
    adds run on a 1/tp share). The engine always runs it with tp > 1: false is refused."""
    pp_schedule: Literal["1f1b", "interleaved", "zero_bubble"] = "1f1b"
    """Pipeline schedule with pp > 1: 1F1B, interleaved 1F1B (pp_virtual_stages per rank), or a
    zero-bubble variant (needs torch >= 2.13: older pipelining fails on rlloom's logprob head)."""
    pp_virtual_stages: int = 1
    """Stages per pipeline rank for the interleaved schedule (1 = one stage per rank)."""
    pp_first_stage_layers: int = 0
    """Decoder layers of the first pipeline stage (0 = an even split)."""
    pp_last_stage_layers: int = 0
    """Decoder layers of the last pipeline stage (0 = an even split), e.g. a shorter last stage
    that also holds the lm head."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "pp_virtual_stages"):
            value = getattr(self, name)
            _check(
                value >= 1, f"parallel.{name}", value, "must be >= 1", f"use parallel.{name}=1 to turn it off"
            )
        for name in ("pp_first_stage_layers", "pp_last_stage_layers"):
            value = getattr(self, name)
            _check(value >= 0, f"parallel.{name}", value, "must be >= 0", "use 0 for an even split")
        _check(
            self.sequence_parallel or self.tp == 1,
            "parallel.sequence_parallel",
            self.sequence_parallel,
            f"tensor parallelism (parallel.tp={self.tp}) always runs with sequence parallelism here",
            "set parallel.sequence_parallel=true",
        )
        _check(
            self.pp_schedule != "1f1b" or self.pp_virtual_stages == 1,
            "parallel.pp_virtual_stages",
            self.pp_virtual_stages,
            "parallel.pp_schedule=1f1b runs one stage per pp rank",
            "use parallel.pp_schedule=interleaved (or zero_bubble) for virtual stages, or pp_virtual_stages=1",
        )


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    total_steps: int = 20
    """RL steps (each: generate, score, update, sync)."""
    prompts_per_step: int = 8
    """Prompts per RL step; the batch is prompts_per_step x rollout.n_samples completions."""
    ppo_epochs: int = 1
    """Passes over the step's batch."""
    num_mini_batches: int = 1
    """Optimizer steps per pass (the batch is split into this many mini-batches)."""
    eval_every: int = 0
    """Evaluate every k steps (0 = only before and after training)."""
    save_every: int = 0
    """Checkpoint every k steps, each with the optimizer state so that trainer.resume continues exactly.
    0 = only at the end, and a run that ends normally then keeps the weights only (a third of the
    size; no critic: PPO's stays full), so it cannot be trained further exactly; a run meant to be
    extended later (a higher total_steps) sets k > 0. A stop (Ctrl-C, SIGTERM) always writes a full one."""
    save_hf_every: int = 0
    """Write a Hugging Face folder of the policy (RUN_DIR/hf/step_N: config, tokenizer, safetensors
    in the model's own dtype; loads with transformers' AutoModelForCausalLM) every k steps; 0 = only
    at the end of the run, -1 = never."""
    run_dir: str = "runs/latest"
    """Folder for logs, checkpoints and plots (non-empty; a leading `~` is expanded)."""
    resume: str = "never"
    """`never` (refused when run_dir already holds a run), `auto` (newest intact checkpoint in run_dir,
    damaged ones skipped with a warning; no checkpoint at all starts fresh) or a checkpoint path."""
    keep_last_checkpoints: int = 0
    """Keep only the newest k complete checkpoints in run_dir/checkpoints (0 = keep every one)."""
    seed: int = 0
    """Global seed (sampling, shuffling, initialisation); 0 <= seed <= 2**32-1."""
    resume_allow_changes: bool = False
    """Resume even when the config differs from the checkpoint's in a setting that changes the run
    (see `rlloom.config.resume.FREE_TO_CHANGE` for the settings that may always change)."""
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    """`sync`: generate, then train, then sync, one after the other. `one_step_off`: the rollout of
    step k + 1 runs while step k trains (step k trains on policy version k - 1). `async`: generation
    stays in flight while training runs, with at most `max_staleness` versions between a sample's
    policy and the one it trains (rlloom/trainer/async_loop.py)."""
    max_staleness: int = 1
    """trainer.mode=async: a sample whose oldest token was generated by policy version v trains at
    step s (version s) only if s - v <= max_staleness; 0 gives exactly the synchronous run."""
    stale_samples: Literal["drop", "downweight"] = "drop"
    """Samples older than max_staleness: `drop` (counted in async/samples_dropped) or `downweight`
    (kept, each token's loss weighted by 0.5 ** (its staleness - max_staleness))."""
    save_weights_only: bool = False
    """Checkpoints hold the policy's weights only (CHECKPOINT/hf, a Hugging Face folder in the model's
    dtype) with the step and data position, without optimizer state: a fraction of the size, but no run
    can resume from one (trainer.resume refuses it and says so). Start a new run from its weights with
    model.path=RUN_DIR/checkpoints/step_N/hf."""

    def __post_init__(self) -> None:
        _check(
            self.total_steps >= 0,
            "trainer.total_steps",
            self.total_steps,
            "must be >= 0",
            "use a positive step count",
        )
        _check(
            self.prompts_per_step >= 1,
            "trainer.prompts_per_step",
            self.prompts_per_step,
            "must be >= 1",
            "e.g. 8",
        )
        _check(self.ppo_epochs >= 1, "trainer.ppo_epochs", self.ppo_epochs, "must be >= 1", "use 1")
        _check(
            self.num_mini_batches >= 1,
            "trainer.num_mini_batches",
            self.num_mini_batches,
            "must be >= 1",
            "use 1 (fully on-policy)",
        )
        _check(self.eval_every >= 0, "trainer.eval_every", self.eval_every, "must be >= 0", "use 0")
        _check(self.save_every >= 0, "trainer.save_every", self.save_every, "must be >= 0", "use 0")
        _check(
            self.keep_last_checkpoints >= 0,
            "trainer.keep_last_checkpoints",
            self.keep_last_checkpoints,
            "must be >= 0 (0 keeps every checkpoint)",
            "use 2 to keep the newest two",
        )
        _check(
            self.save_hf_every >= -1,
            "trainer.save_hf_every",
            self.save_hf_every,
            "must be >= -1",
            "use 0 (only at the end) or -1 (never)",
        )
        _check_seed("trainer.seed", self.seed)
        _check(
            self.max_staleness >= 0,
            "trainer.max_staleness",
            self.max_staleness,
            "must be >= 0 (policy versions between a sample's policy and the trained one)",
            "use 1, or 0 for the synchronous run",
        )
        _check(
            bool(self.run_dir.strip()),
            "trainer.run_dir",
            self.run_dir,
            "must name a folder",
            "e.g. trainer.run_dir=runs/my_run",
        )
        self.run_dir = os.path.expanduser(self.run_dir)
        if self.resume not in ("never", "auto"):
            _check(
                "/" in self.resume or os.sep in self.resume or self.resume.startswith("~"),
                "trainer.resume",
                self.resume,
                "must be never, auto or the path of a checkpoint folder (a path holds a '/')",
                "use trainer.resume=auto (newest checkpoint in trainer.run_dir), trainer.resume=never, "
                "or e.g. trainer.resume=runs/my_run/checkpoints/step_000010",
            )
            self.resume = os.path.expanduser(self.resume)


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    mode: Literal["inline", "ray"] = "inline"
    """`inline`: everything in this process; `ray`: one actor per GPU (or CPU slot)."""
    num_workers: int = 1
    """Training ranks (data parallel). With placement=colocated each also hosts a rollout rank on
    the same device."""
    placement: Literal["colocated", "separate"] = "colocated"
    """`colocated`: training and rollout share the same GPUs and hand memory over (offload/onload,
    sleep/wake); `separate`: `rollout_workers` GPUs (or CPU slots) for rollout apart from the
    `num_workers` training ones, with the weights broadcast after each step (needs cluster.mode=ray)."""
    rollout_workers: int = 0
    """GPUs (or CPU slots) of the rollout pool with placement=separate (a multiple of rollout.tp);
    0 with colocated, where the rollout runs on the training GPUs."""
    address: str = ""
    """Ray address: empty starts a local Ray; `auto` or host:port joins a cluster."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device for engines: auto picks cuda when available."""
    timeout_s: float = 600.0
    """Longest wait for any worker call before the run is stopped as hung."""

    def __post_init__(self) -> None:
        _check_finite(self, "cluster")
        _check(self.num_workers >= 1, "cluster.num_workers", self.num_workers, "must be >= 1", "use 1")
        _check(self.timeout_s > 0, "cluster.timeout_s", self.timeout_s, "must be > 0", "e.g. 600")
        _check(
            self.mode == "ray" or self.num_workers == 1,
            "cluster.num_workers",
            self.num_workers,
            "more than one worker needs cluster.mode=ray",
            "set cluster.mode=ray or cluster.num_workers=1",
        )
        if self.placement == "separate":
            _check(
                self.rollout_workers >= 1,
                "cluster.rollout_workers",
                self.rollout_workers,
                "cluster.placement=separate needs at least one rollout GPU (or CPU slot)",
                "set cluster.rollout_workers=1 or more, or cluster.placement=colocated",
            )
            _check(
                self.mode == "ray",
                "cluster.mode",
                self.mode,
                "cluster.placement=separate runs the rollout in its own processes, which needs Ray",
                "set cluster.mode=ray, or cluster.placement=colocated",
            )
        else:
            _check(
                self.rollout_workers == 0,
                "cluster.rollout_workers",
                self.rollout_workers,
                "with cluster.placement=colocated the rollout runs on the training GPUs",
                "set cluster.rollout_workers=0, or cluster.placement=separate for a rollout pool of its own",
            )


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    bucket_mb: int = 256
    """Weight-sync bucket size in MiB: tensors travel in flat buffers of at most this size (a larger
    tensor travels alone). Bigger buckets mean fewer transfers and more memory held per transfer."""
    checksum: Literal["auto", "always", "never"] = "auto"
    """Compare a content checksum of every tensor sent and received on each sync: `auto` = on when
    the weights are on CPU, off on GPU (it copies every tensor to the host); `always`; `never`. The
    structural check (every rollout tensor received exactly once, right shape, right version) always runs."""
    timeout_s: float = 300.0
    """Longest wait for one weight sync between separate training and rollout workers; on timeout the
    rollout keeps its previous weights and version and the sync raises."""

    def __post_init__(self) -> None:
        _check_finite(self, "sync")
        _check(self.bucket_mb >= 1, "sync.bucket_mb", self.bucket_mb, "must be >= 1 (MiB)", "use e.g. 256")
        _check(self.timeout_s > 0, "sync.timeout_s", self.timeout_s, "must be > 0 seconds", "use e.g. 300")


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    console: bool = True
    """Live progress line on the console."""
    jsonl: bool = True
    """Write metrics.jsonl in the run folder."""
    tensorboard: bool = False
    """Write TensorBoard events (needs `pip install rlloom[tensorboard]`)."""
    wandb: bool = False
    """Log metrics and the sample completions to Weights & Biases (needs `pip install rlloom[wandb]`).
    With the environment variable WANDB_MODE=offline it writes RUN_DIR/wandb without an account
    (`wandb sync` uploads it later)."""
    wandb_project: str = "rlloom"
    """The W&B project the run is logged to (with logging.wandb=true)."""
    run_name: str = ""
    """The run's name in the summary line and in W&B; empty = the run folder's name."""
    samples_per_step: int = 2
    """Sample completions (prompt, response, reward) per step printed to the console (with
    logging.console=true) and appended to RUN_DIR/samples.jsonl; 0 = none."""

    def __post_init__(self) -> None:
        _check(
            self.samples_per_step >= 0,
            "logging.samples_per_step",
            self.samples_per_step,
            "must be >= 0",
            "use 0 (no samples) or a small count such as 2",
        )
        _check(
            bool(self.wandb_project.strip()),
            "logging.wandb_project",
            self.wandb_project,
            "must name a W&B project",
            "e.g. logging.wandb_project=my_project",
        )


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """The whole run: one field per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    @property
    def critic_model_path(self) -> str:
        """The checkpoint PPO's critic starts from: critic.model_path, or the policy's model.path."""
        return self.critic.model_path or self.model.path

    def __post_init__(self) -> None:
        _check_parallel_world(self.parallel, self.cluster.num_workers)
        _check(  # the same rule as rlloom.parallel.cp.check_cp_layout, at start-up
            self.parallel.cp == 1 or not self.train.share_prompts,
            "train.share_prompts",
            self.train.share_prompts,
            f"parallel.cp={self.parallel.cp} splits plain packed documents, not shared-prompt trees",
            "set train.share_prompts=false (or parallel.cp=1)",
        )
        longest = self.data.max_prompt_length + self.rollout.max_new_tokens
        _check(
            self.parallel.pp == 1 or self.train.max_tokens_per_micro_batch >= longest,
            "train.max_tokens_per_micro_batch",
            self.train.max_tokens_per_micro_batch,
            f"parallel.pp={self.parallel.pp} pads every micro-batch to this budget, so it must hold the longest "
            f"sample: data.max_prompt_length + rollout.max_new_tokens = {self.data.max_prompt_length} + "
            f"{self.rollout.max_new_tokens} = {longest}",
            f"set train.max_tokens_per_micro_batch={longest} or more (or lower those)",
        )
        shares, budget = self.parallel.cp * self.parallel.tp, self.train.max_tokens_per_micro_batch
        _check(
            self.parallel.pp == 1 or budget % shares == 0,
            "train.max_tokens_per_micro_batch",
            budget,
            f"parallel.pp={self.parallel.pp} splits every micro-batch, padded to this budget, into "
            f"parallel.cp x parallel.tp = {self.parallel.cp} x {self.parallel.tp} equal token shares, so it must "
            f"be a multiple of {shares}",
            f"set train.max_tokens_per_micro_batch={-(-budget // shares) * shares}",
        )
        if self.data.task in ("jsonl", "parquet"):
            _check(
                bool(self.data.path),
                "data.path",
                self.data.path,
                f"data.task={self.data.task} needs a dataset file",
                "set data.path=/path/to/file",
            )
        if self.algorithm.estimator in ("grpo", "dr_grpo", "rloo") and self.rollout.n_samples < 2:
            _check(
                False,
                "rollout.n_samples",
                self.rollout.n_samples,
                f"estimator {self.algorithm.estimator} needs groups of 2 or more",
                "set rollout.n_samples=4 or more",
            )
        _check(
            self.rollout.partial == "finish" or self.trainer.mode == "async",
            "rollout.partial",
            self.rollout.partial,
            "abort_resume and drop act on requests in flight across a weight update: they need "
            "trainer.mode=async",
            "set trainer.mode=async, or rollout.partial=finish",
        )
        _check(
            not self.algorithm.decoupled_ppo or self.trainer.mode != "sync",
            "algorithm.decoupled_ppo",
            self.algorithm.decoupled_ppo,
            "needs trainer.mode=one_step_off or async (in sync mode the proximal and behaviour policies "
            "are the same weights)",
            "set trainer.mode=async, or algorithm.decoupled_ppo=false",
        )
        self._check_rollout_replicas()
        _check(
            self.algorithm.overlong_buffer <= self.rollout.max_new_tokens,
            "algorithm.overlong_buffer",
            self.algorithm.overlong_buffer,
            f"must be at most rollout.max_new_tokens={self.rollout.max_new_tokens} (the penalty ramps over "
            "the last overlong_buffer tokens a response may have)",
            f"lower algorithm.overlong_buffer (e.g. {self.rollout.max_new_tokens // 4}) or raise rollout.max_new_tokens",
        )
        batch = self.trainer.prompts_per_step * self.rollout.n_samples
        _check(
            self.algorithm.kl_ctrl == "fixed" or self.algorithm.kl_horizon > 0.2 * batch,
            "algorithm.kl_horizon",
            self.algorithm.kl_horizon,
            f"must be more than 0.2 x the {batch} samples of a step, or the adaptive KL coefficient can turn "
            "negative (it changes by up to 20% of samples / kl_horizon a step)",
            f"set algorithm.kl_horizon to {max(10000, 10 * batch)} or more",
        )
        _check(
            batch % self.trainer.num_mini_batches == 0,
            "trainer.num_mini_batches",
            self.trainer.num_mini_batches,
            f"must divide the batch of {batch} completions",
            "pick a divisor of prompts_per_step x n_samples",
        )

    def _check_rollout_replicas(self) -> None:
        """The rollout ranks split into whole replicas of rollout.tp ranks each."""
        tp = self.rollout.tp
        c = self.cluster
        ranks, key = (
            (c.rollout_workers, "cluster.rollout_workers")
            if c.placement == "separate"
            else (c.num_workers, "cluster.num_workers")
        )
        _check(
            ranks % tp == 0,
            key,
            ranks,
            f"the rollout ranks form replicas of rollout.tp={tp} ranks each, so it must be a multiple of {tp}",
            f"set {key} to a multiple of {tp}, or change rollout.tp",
        )


def _check_parallel_world(par: ParallelConfig, num_workers: int) -> None:
    """cluster.num_workers = pp x dp x cp x tp (dp is what is left); ep divides dp x cp x tp."""
    others = par.pp * par.cp * par.tp
    factors = f"(pp={par.pp}, cp={par.cp}, tp={par.tp}, ep={par.ep}, cluster.num_workers={num_workers})"
    _check(
        num_workers % others == 0,
        "cluster.num_workers",
        num_workers,
        f"must be divisible by pp x cp x tp = {par.pp} x {par.cp} x {par.tp} = {others} (num_workers = "
        f"pp x dp x cp x tp, dp is what is left) {factors}",
        f"use cluster.num_workers={others * max(1, -(-num_workers // others))} or degrees whose product divides "
        f"{num_workers}",
    )
    pool = num_workers // par.pp
    dp = pool // (par.cp * par.tp)
    _check(
        pool % par.ep == 0,
        "parallel.ep",
        par.ep,
        f"must divide dp x cp x tp = {dp} x {par.cp} x {par.tp} = {pool}, the ranks expert parallelism "
        f"borrows {factors}",
        f"use a parallel.ep that divides {pool}",
    )
