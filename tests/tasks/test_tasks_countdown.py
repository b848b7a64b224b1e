"""Countdown task: solvable by construction, deterministic, disjoint train and eval."""

import json

from rlloom.rewards.countdown import countdown_reward
from rlloom.tasks.countdown import countdown_prompts


def test_every_instance_is_solved_by_its_construction():
    prompts = countdown_prompts(split="train", num_train=200, num_eval=20, seed=0)
    assert {len(p.metadata["numbers"]) for p in prompts} == {3, 4}
    for p in prompts:
        truth = json.loads(p.ground_truth)
        assert 1 <= truth["target"] <= 100 and all(1 <= n <= 25 for n in truth["numbers"])
        assert str(truth["target"]) in p.prompt and "exactly once" in p.prompt
        assert countdown_reward(f"Answer: {p.metadata['solution']}", p.ground_truth) == 1.0


def test_deterministic_and_disjoint():
    train = countdown_prompts(split="train", num_train=300, num_eval=50, seed=1)
    evals = countdown_prompts(split="eval", num_train=300, num_eval=50, seed=1)
    assert train == countdown_prompts(split="train", num_train=300, num_eval=50, seed=1)

    def key(p):
        t = json.loads(p.ground_truth)
        return tuple(sorted(t["numbers"])), t["target"]

    assert not {key(p) for p in train} & {key(p) for p in evals}
    assert len({key(p) for p in evals}) == 50
