"""PPO with a critic (algorithm.estimator=gae) as a user runs it: GAE's targets against a naive loop,
`rlloom train` with the critic's warm-up, its metrics and its checkpoint, and an exact resume that
restores the critic (a critic left at its initial weights gives other values, so other advantages).

The settings make mistakes visible: a dense reward (resume_reward.py) so returns vary, learning
rates that move both models in one step, two mini-batches a step (the critic's mini-batch path)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trainer_loop import assert_same_tensors, read_metrics, run_straight_and_resumed, tiny_args, tiny_cfg

from rlloom.algorithms import adaptive_kl_coef
from rlloom.cli import main
from rlloom.config import AlgorithmConfig
from rlloom.data.types import RolloutBatch, Sample
from rlloom.engines.train.native.checkpoint import read_model_tensors
from rlloom.models.checkpoint import value_model_from_pretrained
from rlloom.trainer.checkpoint import CRITIC_DIR, checkpoint_dir, checkpoint_model_tensors
from rlloom.trainer.policy import gae_targets, outcome_token_rewards, token_rewards
from rlloom.trainer.run import run
from tests.conftest import build_tiny_checkpoint

PPO = [
    "algorithm.estimator=gae",
    "algorithm.lam=0.9",
    "critic.lr=1e-2",
    "train.lr=3e-2",
    "reward.name=resume_reward:digit_share",
    f"reward.import_dir={Path(__file__).parent}",
    "reward.num_workers=1",
    "trainer.num_mini_batches=2",
    "data.num_eval=0",
    "trainer.save_every=1",
]


def naive_gae(rewards, masks, values, gamma, lam):
    """Per sample, over its valid tokens only: the reward on the last one, GAE backwards."""
    advantages, returns = [], []
    for reward, mask, value in zip(rewards, masks, values):
        valid = [t for t, m in enumerate(mask) if m]
        adv = [0.0] * len(mask)
        running, next_value = 0.0, 0.0
        for i, t in reversed(list(enumerate(valid))):
            r = reward if i == len(valid) - 1 else 0.0
            running = r + gamma * next_value - value[t] + gamma * lam * running
            adv[t], next_value = running, value[t]
        advantages.append(adv)
        returns.append([a + v if m else 0.0 for a, v, m in zip(adv, value, mask)])
    return advantages, returns


def test_gae_targets_equal_a_naive_loop():
    rng = random.Random(0)
    samples = []
    for g in range(4):
        for _ in range(3):
            n = rng.randint(1, 9)
            mask = [int(rng.random() > 0.3) for _ in range(n)]
            samples.append(
                Sample(prompt_ids=[1], response_ids=[2] * n, loss_mask=mask, reward=rng.random(), group_id=g)
            )
    batch = RolloutBatch(samples)
    mask_BT = batch.response_mask()
    values_BT = torch.randn(mask_BT.shape, generator=torch.Generator().manual_seed(1)) * mask_BT
    algo = AlgorithmConfig(estimator="gae", gamma=0.97, lam=0.9)
    adv_BT, returns_BT = gae_targets(algo, batch, values_BT, outcome_token_rewards(batch))

    adv, ret = naive_gae(
        [s.reward for s in samples], mask_BT.tolist(), values_BT.tolist(), algo.gamma, algo.lam
    )
    torch.testing.assert_close(returns_BT, torch.tensor(ret), atol=1e-6, rtol=0)
    raw = torch.tensor(adv)[mask_BT]
    whitened = (raw - raw.mean()) / raw.std()  # over the batch's valid tokens, as verl
    torch.testing.assert_close(adv_BT[mask_BT], whitened, atol=1e-5, rtol=0)
    assert (adv_BT[~mask_BT] == 0).all()


def critic_tensors(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return read_model_tensors(checkpoint_dir(run_dir, step) / CRITIC_DIR, heads=True)


def test_ppo_with_a_critic_through_the_cli(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(tiny_checkpoint, run_dir, *PPO, "trainer.total_steps=2", "critic.warmup_steps=1")
    assert main(["train", "arithmetic_smoke", *args]) == 0
    step1, step2 = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert step1["critic/values_mean"] == 0.0  # a new value head starts at zero
    assert step1["critic/returns_mean"] > 0 and step1["critic/vf_loss"] > 0
    assert step2["critic/values_mean"] != 0.0  # the critic learned in step 1
    for key in (
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/lr",
        "critic/vf_explained_var",
    ):
        assert key in step1 and key in step2, key
    assert step1["time/values_s"] > 0 and step1["time/critic_step_s"] > 0
    # critic.warmup_steps=1: step 1 trains only the critic, step 2 both (two mini-batches each)
    assert (step1["policy/version"], step2["policy/version"]) == (0.0, 2.0)
    assert "train/grad_norm" not in step1 and "train/grad_norm" in step2
    manifest = json.loads((checkpoint_dir(run_dir, 2) / "manifest.json").read_text())
    assert manifest["sealed"] == ["engine", CRITIC_DIR]
    critic = critic_tensors(run_dir, 2)
    assert critic.keys() == critic_tensors(run_dir, 1).keys()
    assert "score.weight" in critic and "model.tok_embeddings.weight" in critic
    assert not any("output" in k for k in critic)  # no vocabulary head


def test_resume_restores_the_critic_exactly(tiny_checkpoint, tmp_path):
    straight, resumed = run_straight_and_resumed(tiny_checkpoint, tmp_path, *PPO)
    assert read_metrics(resumed) == read_metrics(straight)
    policy = lambda run_dir, step: checkpoint_model_tensors(checkpoint_dir(run_dir, step))
    for tensors in (policy, critic_tensors):
        assert_same_tensors(tensors(straight, 3), tensors(resumed, 3))


def test_ppo_with_a_critic_runs_one_step_off(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    run(tiny_cfg(tiny_checkpoint, run_dir, *PPO, "trainer.total_steps=2", "trainer.mode=one_step_off"))
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all("critic/vf_loss" in r for r in rows)


def test_a_critic_from_another_checkpoint(tiny_checkpoint, tmp_path, capsys):
    wider = build_tiny_checkpoint(tmp_path / "wider", hidden=48, seed=1)  # the policy's tokenizer
    run_dir = tmp_path / "run"
    args = tiny_args(tiny_checkpoint, run_dir, *PPO, "trainer.total_steps=1", f"critic.model_path={wider}")
    assert main(["train", "arithmetic_smoke", *args]) == 0
    assert critic_tensors(run_dir, 1)["score.weight"].shape == (1, 48)
    # a critic whose vocabulary cannot hold the policy's tokens is refused before anything loads
    small = tmp_path / "small"
    shutil.copytree(wider, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(config | {"vocab_size": 10}))
    capsys.readouterr()
    args = tiny_args(tiny_checkpoint, tmp_path / "refused", *PPO, f"critic.model_path={small}")
    assert main(["train", "arithmetic_smoke", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlloom: error: critic.model_path=") and "vocab_size 10 is smaller" in err
    assert err.count("\n") == 1


def test_kl_in_reward_is_a_per_token_penalty_with_the_outcome_on_the_last_token():
    samples = [
        Sample(prompt_ids=[1], response_ids=[2, 3, 4], loss_mask=[1, 1, 0], reward=1.0),
        Sample(prompt_ids=[1], response_ids=[2], reward=0.5),
    ]
    batch = RolloutBatch(samples)
    old_BT = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    ref_BT = torch.tensor([[-1.5, -1.0, -9.0], [-0.25, 0.0, 0.0]])
    algo = AlgorithmConfig(estimator="gae", kl_in_reward=True, kl_coef=0.1, kl_kind="k1")
    got, _ = token_rewards(algo, batch, old_BT, ref_BT)
    # k1 = old - ref; the third token of sample 0 is masked: its outcome sits on token 2
    expected = torch.tensor([[-0.1 * 0.5, 1.0 - 0.1 * -1.0, 0.0], [0.5 - 0.1 * -0.25, 0.0, 0.0]])
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp"])
def test_kl_in_reward_runs_instead_of_a_kl_loss(tiny_checkpoint, tmp_path, estimator):
    run_dir = tmp_path / "run"
    kl = ["algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1", f"algorithm.estimator={estimator}"]
    run(tiny_cfg(tiny_checkpoint, run_dir, *PPO, *kl, "trainer.total_steps=2", "trainer.num_mini_batches=1"))
    step1, step2 = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert step1["reward/kl_penalty"] == pytest.approx(0.0, abs=1e-6)  # the policy is still the reference
    assert step2["reward/kl_penalty"] > 1e-4  # k3 >= 0: the trained policy pays for moving away
    assert "loss/kl" not in step2  # not a loss term as well
    assert step1["time/old_logprobs_s"] > 0  # computed before the update even in a single pass


def test_export_the_critic_and_start_a_new_critic_from_it(tiny_checkpoint, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert (
        main(
            ["train", "arithmetic_smoke", *tiny_args(tiny_checkpoint, run_dir, *PPO, "trainer.total_steps=1")]
        )
        == 0
    )
    out = tmp_path / "critic"
    assert main(["export", str(run_dir), str(out), "--critic", "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForTokenClassification"] and config["id2label"] == {
        "0": "LABEL_0"
    }
    assert (out / "tokenizer.json").is_file()
    # the folder holds the checkpoint's critic: its body under transformers' names and its head
    exported = value_model_from_pretrained(out)
    saved = critic_tensors(run_dir, 1)
    assert torch.equal(exported[1]["score.weight"], saved["score.weight"])
    assert torch.equal(exported[1]["score.bias"], saved["score.bias"])
    assert torch.equal(exported[0].tok_embeddings.weight, saved["model.tok_embeddings.weight"])
    # a new run's critic starts from it: its first values are the trained critic's, not zero
    new_dir = tmp_path / "new"
    args = tiny_args(tiny_checkpoint, new_dir, *PPO, "trainer.total_steps=1", f"critic.model_path={out}")
    assert main(["train", "arithmetic_smoke", *args]) == 0
    assert read_metrics(new_dir)[0]["critic/values_mean"] != 0.0
    # refused in one line: a run without a critic, a value model with two outputs
    grpo_dir = tmp_path / "grpo"
    run(tiny_cfg(tiny_checkpoint, grpo_dir, "trainer.total_steps=1", "data.num_eval=0"))
    capsys.readouterr()
    assert main(["export", str(grpo_dir), str(tmp_path / "none"), "--critic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlloom: error: export --critic: checkpoint ") and "holds no critic" in err
    assert err.count("\n") == 1
    two = tmp_path / "two"
    shutil.copytree(out, two)
    (two / "config.json").write_text(json.dumps(config | {"id2label": {"0": "a", "1": "b"}}))
    args = tiny_args(tiny_checkpoint, tmp_path / "refused", *PPO, f"critic.model_path={two}")
    assert main(["train", "arithmetic_smoke", *args]) == 2
    err = capsys.readouterr().err
    assert "is a Qwen3ForTokenClassification with 2 labels" in err and err.count("\n") == 1


def test_adaptive_kl_coef_follows_the_controller():
    def naive(coef, kl, n, target, horizon):  # Ziegler et al.'s controller, as verl's AdaptiveKLController
        error = float(np.clip(kl / target - 1, -0.2, 0.2))
        return coef * (1 + error * n / horizon)

    for kl in (0.0, 0.05, 0.1, 0.11, 0.3, 5.0):
        got = adaptive_kl_coef(0.2, kl, 64, target=0.1, horizon=1000)
        assert got == pytest.approx(naive(0.2, kl, 64, 0.1, 1000), rel=1e-12)
    assert adaptive_kl_coef(0.2, 0.1, 64, target=0.1, horizon=1000) == 0.2  # on target: unchanged


def test_adaptive_kl_in_the_reward_steers_its_coefficient_and_resumes_exactly(tiny_checkpoint, tmp_path):
    kl = [
        "algorithm.estimator=reinforce_pp",
        "algorithm.kl_in_reward=true",
        "algorithm.kl_coef=0.1",
        "algorithm.kl_ctrl=adaptive",
        "algorithm.kl_target=1e-9",  # any KL above it grows the coefficient, a KL of 0 shrinks it
        "algorithm.kl_horizon=40",
        "trainer.num_mini_batches=1",
    ]
    straight, resumed = run_straight_and_resumed(tiny_checkpoint, tmp_path, *PPO, *kl)
    cfg = tiny_cfg(tiny_checkpoint, straight, *PPO, *kl)
    rows = read_metrics(straight)
    step = 0.2 * cfg.trainer.prompts_per_step * cfg.rollout.n_samples / 40  # the largest move
    assert rows[0]["reward/kl"] == 0.0 and rows[1]["reward/kl"] > 1e-6  # the policy leaves the reference
    assert rows[0]["reward/kl_coef"] == 0.1
    assert rows[1]["reward/kl_coef"] == pytest.approx(0.1 * (1 - step), rel=1e-9)
    assert rows[2]["reward/kl_coef"] == pytest.approx(0.1 * (1 - step) * (1 + step), rel=1e-9)
    assert read_metrics(resumed) == rows  # the controller's coefficient came back with the checkpoint
