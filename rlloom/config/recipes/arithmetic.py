"""GRPO on two-digit addition with the embedded SmolLM2-135M-Instruct (the `make demo` job)."""

import dataclasses

from rlloom.config.algorithm import AlgorithmConfig
from rlloom.config.data import DataConfig
from rlloom.config.model import ModelConfig
from rlloom.config.rollout import RolloutConfig
from rlloom.config.run import RunConfig
from rlloom.config.train import TrainEngineConfig
from rlloom.config.trainer import TrainerConfig


def arithmetic_demo() -> RunConfig:
    """The demo: GRPO, full fine-tuning in fp32 on CPU, greedy accuracy before and after."""
    return RunConfig(
        model=ModelConfig(path="smollm2-135m-instruct"),
        data=DataConfig(task="arithmetic", num_digits=2, operators="+", num_eval=200),
        # On CPU the KV cache is cheap to keep; re-allocating it every step is not.
        rollout=RolloutConfig(n_samples=4, temperature=1.0, max_new_tokens=32, sleep_during_train=False),
        algorithm=AlgorithmConfig(estimator="grpo", loss="ppo_clip", agg_mode="token-mean"),
        train=TrainEngineConfig(lr=1e-5, max_tokens_per_micro_batch=2048),
        trainer=TrainerConfig(total_steps=40, prompts_per_step=8, run_dir="runs/arithmetic_demo"),
    )


def arithmetic_smoke() -> RunConfig:
    """A few tiny steps of the demo, for tests and quick checks."""
    cfg = arithmetic_demo()
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, num_eval=8),
        rollout=dataclasses.replace(cfg.rollout, max_new_tokens=8),
        trainer=dataclasses.replace(
            cfg.trainer, total_steps=2, prompts_per_step=2, run_dir="runs/arithmetic_smoke"
        ),
    )


def arithmetic_sft() -> RunConfig:
    """Supervised fine-tuning (`rlloom sft arithmetic_sft`) of the demo's model on the arithmetic task's
    training problems, each answered with its number (the evaluation problems held out), before RL:
    `rlloom train arithmetic_demo model.path=runs/arithmetic_sft/hf/step_000008`. A short fine-tune
    (8 steps of 16 problems) teaches the answer's form; RL then improves the sums."""
    cfg = arithmetic_demo()
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, lr=1e-5),
        trainer=dataclasses.replace(
            cfg.trainer, total_steps=8, prompts_per_step=16, run_dir="runs/arithmetic_sft"
        ),
    )


def dapo_arithmetic() -> RunConfig:
    """DAPO variant: clip-higher, token-mean, dynamic sampling, overlong shaping."""
    cfg = arithmetic_demo()
    algo = dataclasses.replace(
        cfg.algorithm, eps_high=0.28, dynamic_sampling=True, overlong_buffer=8, agg_mode="token-mean"
    )
    return dataclasses.replace(cfg, algorithm=algo)


def arithmetic_retry() -> RunConfig:
    """Multi-turn: the demo's task with feedback. After a wrong answer the environment says so and the
    model tries again (up to 3 answers); the reward is 1, 0.5 or 0.25 for a right answer at the first,
    second or third try (rlloom.episodes.envs.retry)."""
    cfg = arithmetic_demo()
    rollout = dataclasses.replace(
        cfg.rollout,
        env="rlloom.episodes.envs.retry:AnswerRetry",
        env_kwargs={"discount": 0.5, "max_tries": 3},
        max_turns=3,
        max_observation_tokens=32,
    )
    return dataclasses.replace(
        cfg, rollout=rollout, trainer=dataclasses.replace(cfg.trainer, run_dir="runs/arithmetic_retry")
    )


def calculator_tools() -> RunConfig:
    """Multi-turn with a tool: arithmetic where the model may call `calculate` (rlloom.episodes.envs.
    calculator) before it answers. Needs a model whose chat template renders tools (Qwen2.5/Qwen3):
    `rlloom train calculator_tools model.path=/path/to/Qwen3-0.6B`."""
    cfg = arithmetic_demo()
    data = dataclasses.replace(
        cfg.data,
        num_digits=3,
        operators="*",
        system_prompt="Use the calculate tool when it helps, then answer with just the number.",
    )
    rollout = dataclasses.replace(
        cfg.rollout, tools=["rlloom.episodes.envs.calculator:calculate"], max_turns=3, max_new_tokens=128
    )
    trainer = dataclasses.replace(cfg.trainer, run_dir="runs/calculator_tools")
    return dataclasses.replace(cfg, data=data, rollout=rollout, trainer=trainer)
