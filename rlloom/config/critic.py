"""The `critic` section: PPO's value model (algorithm.estimator=gae)."""

from __future__ import annotations

from dataclasses import dataclass

from rlloom.config.checks import check, check_finite


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
        check_finite(self, "critic")
        check(self.lr > 0, "critic.lr", self.lr, "must be > 0", "e.g. 1e-5")
        check(
            self.grad_clip >= 0, "critic.grad_clip", self.grad_clip, "must be >= 0", "use 1.0 or 0 to disable"
        )
        check(self.value_clip > 0, "critic.value_clip", self.value_clip, "must be > 0", "use 0.5")
        check(self.warmup_steps >= 0, "critic.warmup_steps", self.warmup_steps, "must be >= 0", "use 0")
