"""The `algorithm` section: advantage estimator, policy loss, KL, importance-sampling correction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlloom.config.checks import check, check_finite

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
        check_finite(self, "algorithm")
        self._check_clipping()
        self._check_kl()
        self._check_estimators()

    def _check_clipping(self) -> None:
        """The policy loss's clip ranges and its normaliser."""
        check(0 <= self.eps_low < 1, "algorithm.eps_low", self.eps_low, "must be in [0, 1)", "use 0.2")
        check(
            self.eps_high >= 0,
            "algorithm.eps_high",
            self.eps_high,
            "must be >= 0",
            "use 0.2 or 0.28 (clip-higher)",
        )
        check(
            self.dual_clip_c == 0 or self.dual_clip_c > 1,
            "algorithm.dual_clip_c",
            self.dual_clip_c,
            "must be 0 (off) or > 1",
            "use 3.0 or 0",
        )
        check(
            self.norm_constant >= 0,
            "algorithm.norm_constant",
            self.norm_constant,
            "must be >= 0",
            "use 0 for max_new_tokens",
        )

    def _check_kl(self) -> None:
        """The KL term: in the loss or in the reward, with a fixed or an adaptive coefficient."""
        check(
            self.kl_coef >= 0,
            "algorithm.kl_coef",
            self.kl_coef,
            "must be >= 0",
            "use 0 to disable the KL loss",
        )
        if self.kl_in_reward:
            check(
                self.estimator in ("gae", "reinforce_pp"),
                "algorithm.kl_in_reward",
                self.kl_in_reward,
                f"a per-token KL reward needs a token-level estimator, and estimator {self.estimator} uses one "
                "reward per sample",
                "set algorithm.estimator=gae or reinforce_pp, or algorithm.kl_in_reward=false (a KL loss term)",
            )
            check(
                self.kl_coef > 0,
                "algorithm.kl_in_reward",
                self.kl_in_reward,
                "needs algorithm.kl_coef > 0 (the penalty's coefficient)",
                "set algorithm.kl_coef, e.g. 0.01",
            )
        check(
            self.kl_ctrl == "fixed" or self.kl_in_reward,
            "algorithm.kl_ctrl",
            self.kl_ctrl,
            "the adaptive controller sets the coefficient of the KL in the reward, and kl_in_reward is off",
            "set algorithm.kl_in_reward=true (with estimator gae or reinforce_pp), or algorithm.kl_ctrl=fixed",
        )
        check(self.kl_target > 0, "algorithm.kl_target", self.kl_target, "must be > 0", "use 0.1")
        check(self.kl_horizon > 0, "algorithm.kl_horizon", self.kl_horizon, "must be > 0", "use 10000")

    def _check_estimators(self) -> None:
        """Returns and advantages, the entropy bonus, the overlong penalty, IS corrections, sampling rounds."""
        check(0 < self.gamma <= 1, "algorithm.gamma", self.gamma, "must be in (0, 1]", "use 1.0")
        check(0 <= self.lam <= 1, "algorithm.lam", self.lam, "must be in [0, 1]", "use 1.0 or 0.95")
        check(
            self.entropy_coef >= 0,
            "algorithm.entropy_coef",
            self.entropy_coef,
            "must be >= 0 (a negative bonus would reward collapsing the policy)",
            "use 0 to disable the entropy bonus",
        )
        check(
            self.overlong_factor >= 0,
            "algorithm.overlong_factor",
            self.overlong_factor,
            "must be >= 0 (it is a penalty)",
            "use 1.0",
        )
        check(self.is_high > 0, "algorithm.is_high", self.is_high, "must be > 0", "use 2.0")
        check(
            0 <= self.is_low < self.is_high,
            "algorithm.is_low",
            self.is_low,
            "must be in [0, is_high)",
            "use 0",
        )
        check(
            self.max_sampling_rounds >= 1,
            "algorithm.max_sampling_rounds",
            self.max_sampling_rounds,
            "must be >= 1",
            "use 3",
        )
        check(
            self.overlong_buffer >= 0,
            "algorithm.overlong_buffer",
            self.overlong_buffer,
            "must be >= 0",
            "use 0 to disable",
        )
