"""Other frameworks' names for rlloom's config keys (TRL's GRPOConfig, verl's PPO trainer config).

An unknown key that one of these names is told "rlloom calls this X" instead of a guess by spelling
(which offered `num_generations` -> `max_new_tokens`). A name matches by its dotted tail, so verl's
nested `actor_rollout_ref.actor.clip_ratio_high` and a top-level `clip_ratio_high` both match; the
longest tail wins (`critic.optim.lr` before `lr`). Only names with a real rlloom equivalent are
listed; docs/guide.md ("Coming from TRL or verl") shows the same table.
"""

from __future__ import annotations

ALIASES: dict[str, tuple[str, ...]] = {
    # TRL (GRPOConfig, TrainingArguments, ModelConfig)
    "learning_rate": ("train.lr",),
    "beta": ("algorithm.kl_coef",),
    "num_generations": ("rollout.n_samples",),
    "epsilon": ("algorithm.eps_low", "algorithm.eps_high"),
    "epsilon_high": ("algorithm.eps_high",),
    "num_iterations": ("trainer.ppo_epochs",),
    "max_completion_length": ("rollout.max_new_tokens",),
    "max_prompt_length": ("data.max_prompt_length",),
    "temperature": ("rollout.temperature",),
    "top_p": ("rollout.top_p",),
    "top_k": ("rollout.top_k",),
    "max_steps": ("trainer.total_steps",),
    "max_grad_norm": ("train.grad_clip",),
    "adam_epsilon": ("train.adam_eps",),
    "weight_decay": ("train.weight_decay",),
    "warmup_steps": ("train.warmup_steps",),
    "lr_scheduler_type": ("train.lr_schedule",),
    "gradient_checkpointing": ("train.activation_checkpointing",),
    "seed": ("trainer.seed",),
    "output_dir": ("trainer.run_dir",),
    "save_steps": ("trainer.save_every",),
    "eval_steps": ("trainer.eval_every",),
    "resume_from_checkpoint": ("trainer.resume",),
    "model_name_or_path": ("model.path",),
    "lora_r": ("train.lora_rank",),
    "lora_alpha": ("train.lora_alpha",),
    "lora_target_modules": ("train.lora_target_modules",),
    # verl (ppo_trainer.yaml; DAPO's recipe)
    "lr": ("train.lr",),
    "critic.optim.lr": ("critic.lr",),
    "critic.optim.lr_warmup_steps": ("critic.warmup_steps",),
    "clip_ratio": ("algorithm.eps_low", "algorithm.eps_high"),
    "clip_ratio_low": ("algorithm.eps_low",),
    "clip_ratio_high": ("algorithm.eps_high",),
    "clip_ratio_c": ("algorithm.dual_clip_c",),
    "kl_loss_coef": ("algorithm.kl_coef",),
    "kl_loss_type": ("algorithm.kl_kind",),
    "kl_ctrl.kl_coef": ("algorithm.kl_coef",),
    "use_kl_in_reward": ("algorithm.kl_in_reward",),
    "entropy_coeff": ("algorithm.entropy_coef",),
    "loss_agg_mode": ("algorithm.agg_mode",),
    "adv_estimator": ("algorithm.estimator",),
    "filter_groups": ("algorithm.dynamic_sampling",),
    "filter_groups.enable": ("algorithm.dynamic_sampling",),
    "filter_groups.max_num_gen_batches": ("algorithm.max_sampling_rounds",),
    "overlong_buffer.len": ("algorithm.overlong_buffer",),
    "overlong_buffer.penalty_factor": ("algorithm.overlong_factor",),
    "rollout.n": ("rollout.n_samples",),
    "response_length": ("rollout.max_new_tokens",),
    "max_response_length": ("rollout.max_new_tokens",),
    "train_batch_size": ("trainer.prompts_per_step",),
    "ppo_epochs": ("trainer.ppo_epochs",),
    "ppo_max_token_len_per_gpu": ("train.max_tokens_per_micro_batch",),
    "tensor_model_parallel_size": ("rollout.tp",),
    "lr_warmup_steps": ("train.warmup_steps",),
    "min_lr_ratio": ("train.min_lr_ratio",),
    "grad_clip": ("train.grad_clip",),
    "model.path": ("model.path",),
    "total_training_steps": ("trainer.total_steps",),
    "save_freq": ("trainer.save_every",),
    "test_freq": ("trainer.eval_every",),
    "default_local_dir": ("trainer.run_dir",),
}
"""Another framework's key (a dotted tail) -> the rlloom key or keys that set the same thing."""


def rlloom_keys(dotted: str) -> tuple[str, ...]:
    """The rlloom keys another framework's `dotted` key stands for (its longest tail in `ALIASES`), or ()."""
    parts = dotted.split(".")
    for start in range(len(parts)):
        if (tail := ".".join(parts[start:])) in ALIASES:
            return ALIASES[tail]
    return ()
