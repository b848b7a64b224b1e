"""GRPO on the built-in visual tasks with a vision-language model given by the user: visual_colour
(which of four colours a picture is, "A" to "D") and visual_compare (which of two numbers in a
picture is larger, "L" or "R")."""

import dataclasses

from rlloom.config.algorithm import AlgorithmConfig
from rlloom.config.data import DataConfig
from rlloom.config.model import ModelConfig
from rlloom.config.rollout import RolloutConfig
from rlloom.config.run import RunConfig
from rlloom.config.train import TrainEngineConfig
from rlloom.config.trainer import TrainerConfig


def visual_colour() -> RunConfig:
    """A tiny CPU run that learns to read its picture: `rlloom init-model tiny-vl runs/tiny-vl
    --hidden 64` then `rlloom train visual_colour model.path=runs/tiny-vl`. One solid colour a
    picture (one image token), four colours equally many, 40 held-out shades for the greedy
    evaluation every 20 steps (a constant answer scores 0.25); one answer token (a real model's
    needs a few: rollout.max_new_tokens=8), 8 samples a prompt, and lr 1e-3 for random weights
    (a pretrained model wants ~1e-6; 3e-3 learns the letters faster but its updates jolt the policy
    onto one answer and back; a tiny Qwen3-VL wants 5e-4 and 200 steps, at 1e-3 it answered red as
    yellow for good). What it learns on a CPU is in docs/benchmarks.md."""
    cfg = visual_compare()
    return dataclasses.replace(
        cfg,
        data=DataConfig(task="visual_colour", num_train=512, num_eval=40, max_prompt_length=128),
        train=dataclasses.replace(cfg.train, lr=1e-3),
        trainer=dataclasses.replace(cfg.trainer, total_steps=160, run_dir="runs/visual_colour"),
    )


def visual_compare() -> RunConfig:
    """A tiny CPU run: `rlloom init-model tiny-vl runs/tiny-vl` then `rlloom train visual_compare
    model.path=runs/tiny-vl`. One digit a number (90 pairs, 30 held out for the greedy evaluation
    every 20 steps), one answer token (the tiny models' character tokenizer writes "L" in one token;
    a real model's answer needs a few: rollout.max_new_tokens=8), 8 samples a prompt, and the
    learning rate of a model trained from random weights (a pretrained one wants ~1e-6). On a CPU a
    tiny model learns the answer's form in ~30 steps, not to read the picture (docs/benchmarks.md
    says why); `visual_colour` is the task it does learn to read."""
    return RunConfig(
        model=ModelConfig(path="runs/tiny-vl"),
        data=DataConfig(
            task="visual_compare", num_digits=1, num_train=512, num_eval=30, max_prompt_length=128
        ),
        rollout=RolloutConfig(n_samples=8, temperature=1.0, max_new_tokens=1, sleep_during_train=False),
        algorithm=AlgorithmConfig(estimator="grpo", loss="ppo_clip", agg_mode="token-mean"),
        train=TrainEngineConfig(lr=3e-3, max_tokens_per_micro_batch=4096),
        trainer=TrainerConfig(
            total_steps=200, prompts_per_step=16, eval_every=20, run_dir="runs/visual_compare"
        ),
    )
