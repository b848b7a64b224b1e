"""Reward models (`reward.model_path`, the `model` term of reward.name) as a user runs them: the
scores in samples.jsonl equal transformers' AutoModelForSequenceClassification logits of the
conversation the policy saw (its chat template's prompt, the response, the stop token), alone and in
a weighted sum with a rule reward; `reward/model_mean`; folders that are no reward model, or do not
load, refused in one line before anything heavy loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from test_trainer_loop import ALL_SAMPLES, read_metrics, tiny_args  # noqa: E402

from rlloom.cli import main  # noqa: E402
from rlloom.models.tiny import char_tokenizer  # noqa: E402
from rlloom.rewards.numbers import number_match  # noqa: E402

RUN = ("trainer.total_steps=1", "data.num_eval=0", ALL_SAMPLES)


def write_reward_model(path: Path, *, seed: int = 3) -> Path:
    """A tiny random Qwen2ForSequenceClassification (one label) with the character tokenizer, saved
    by transformers; its score head scaled so that scores differ by whole units."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = char_tokenizer()
    vocab = tokenizer.get_vocab()
    config = Qwen2Config(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, num_labels=1, pad_token_id=vocab["<pad>"],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.mul_(20)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_reward_model(tmp_path_factory.mktemp("rm") / "rm")


def transformers_scores(rm: Path, policy: Path, records: list[dict]) -> list[float]:
    """transformers' logit for each record's conversation: the policy's chat template around the
    prompt, the response, and the stop token when the response ended on it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy_tok, rm_tok = AutoTokenizer.from_pretrained(policy), AutoTokenizer.from_pretrained(rm)
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    scores = []
    for r in records:
        messages = [{"role": "user", "content": r["prompt"]}]
        text = policy_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        text += r["response"] + (policy_tok.eos_token if r["finish_reason"] == "stop" else "")
        ids = torch.tensor([rm_tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            scores.append(float(model(input_ids=ids).logits[0, 0]))
    return scores


def samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_reward_model_scores_equal_transformers(tiny_checkpoint, reward_model, tmp_path):
    run_dir = tmp_path / "alone"
    args = tiny_args(tiny_checkpoint, run_dir, *RUN, "reward.name=model", f"reward.model_path={reward_model}")
    assert main(["train", "arithmetic_smoke", *args, "reward.model_batch_size=3"]) == 0
    records = samples(run_dir)
    expected = transformers_scores(reward_model, tiny_checkpoint, records)
    assert len(records) == 8 and len(set(round(e, 3) for e in expected)) > 1  # the texts score apart
    for record, want in zip(records, expected):
        assert record["reward"] == pytest.approx(want, rel=1e-4, abs=1e-4)
    [row] = read_metrics(run_dir)
    assert row["reward/model_mean"] == pytest.approx(sum(expected) / len(expected), rel=1e-4, abs=1e-4)


def test_reward_model_in_a_weighted_sum_with_a_rule(tiny_checkpoint, reward_model, tmp_path):
    run_dir = tmp_path / "sum"
    extra = ("reward.name=number + 0.5*model", f"reward.model_path={reward_model}")
    assert main(["train", "arithmetic_smoke", *tiny_args(tiny_checkpoint, run_dir, *RUN, *extra)]) == 0
    records = samples(run_dir)
    expected = transformers_scores(reward_model, tiny_checkpoint, records)
    for record, model_score in zip(records, expected):
        rule = number_match(record["response"], record["ground_truth"])
        assert record["reward"] == pytest.approx(rule + 0.5 * model_score, rel=1e-4, abs=1e-4)


def test_reward_models_that_cannot_score_are_refused_in_one_line(
    tiny_checkpoint, reward_model, tmp_path, capsys
):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in reward_model.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    cases = (
        (f"reward.model_path={broken}", "reward.name=model", "does not load"),
        (f"reward.model_path={tiny_checkpoint}", "reward.name=model", "not a reward model"),
        (f"reward.model_path={tmp_path / 'missing'}", "reward.name=model", "cannot be read"),
        ("reward.name=number + model", "reward.num_workers=1", "reward.model_path is empty"),
        (f"reward.model_path={reward_model}", "reward.name=number", "has no 'model' term"),
    )
    for *extra, says in cases:
        run_dir = tmp_path / "run"
        assert main(["train", "arithmetic_smoke", *tiny_args(tiny_checkpoint, run_dir, *RUN, *extra)]) == 2
        # one line, beside the start-up log's (the weights are read after the data, before the engines)
        [err] = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[rlloom]")]
        assert err.startswith("rlloom: error: reward.") and says in err, err
        assert not (run_dir / "metrics.jsonl").exists()


def test_a_failing_reward_model_batch_costs_its_samples_the_default_score():
    """A model call that raises fails its samples (errors), a non-finite score its own (invalid); a
    sample whose rule reward failed keeps the default score whatever the model says."""
    from rlloom.rewards.calling import RewardInput
    from rlloom.rewards.runner import RewardRunner

    def raising(conversations):
        raise RuntimeError("CUDA out of memory")

    items = [RewardInput("47", "47", conversation="a"), RewardInput("x", "47", conversation="bb")]
    failed = RewardRunner(number_match, default_score=-1.0, model=raising, model_weight=0.5).score(items)
    assert failed.scores == [-1.0, -1.0] and failed.num_errors == 2
    by_length = lambda texts: [float("nan") if len(t) == 1 else 2.0 for t in texts]  # noqa: E731
    mixed = RewardRunner(number_match, default_score=-1.0, model=by_length, model_weight=0.5).score(items)
    assert mixed.scores == [-1.0, 0.0 + 0.5 * 2.0] and mixed.num_invalid == 1
    assert mixed.model_scores[1] == 2.0
