"""build_task_source: every task kind from a DataConfig, train shuffled, eval fixed, file hold-out."""

import dataclasses
import json

import pytest

from rlloom.config import DataConfig
from rlloom.rewards import get_reward_fn
from rlloom.tasks import build_task_source, default_reward_name, task_prompts


class FakeTokenizer:
    chat_template = "fake"

    def encode(self, text, add_special_tokens=True, split_special_tokens=False):
        return [ord(c) for c in text]

    def apply_chat_template(self, conversation, *, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation) + "<assistant>"


@pytest.mark.parametrize("task", ["arithmetic", "countdown"])
def test_procedural_tasks(task):
    cfg = DataConfig(task=task, num_train=40, num_eval=10, max_prompt_length=512, system_prompt="Think.")
    train = build_task_source(cfg, FakeTokenizer(), "train")
    evals = build_task_source(cfg, FakeTokenizer(), "eval")
    assert len(train) == 40 and len(evals) == 10
    assert evals.items[0].prompt_text.startswith("<system>Think.<user>")
    assert [p.index for p in evals.next_batch(10)] == list(range(10))  # eval: fixed order
    batch = train.next_batch(8)
    assert [p.index for p in batch] != list(range(8))  # train: shuffled
    reward = get_reward_fn(default_reward_name(task))
    solution = batch[0].metadata.get("solution") or batch[0].ground_truth
    assert reward(f"Answer: {solution}", batch[0].ground_truth) == 1.0


def test_too_long_prompts_are_counted_on_the_source():
    cfg = DataConfig(task="countdown", num_train=20, num_eval=0, chat_template=False)
    lengths = sorted(len(p.prompt) for p in task_prompts(cfg))  # the fake tokenizer: one token per character
    cfg = dataclasses.replace(cfg, max_prompt_length=lengths[9])
    src = build_task_source(cfg, FakeTokenizer())
    assert src.num_too_long == sum(n > lengths[9] for n in lengths) > 0
    assert len(src) + src.num_too_long == 20


def test_jsonl_hold_out_is_disjoint_and_seeded(tmp_path):
    path = tmp_path / "gsm.jsonl"
    rows = [{"question": f"Q{i}", "answer": f"work\n#### {i}"} for i in range(30)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(task="jsonl", path=str(path), prompt_key="question", num_eval=5, chat_template=False)
    train = build_task_source(cfg, FakeTokenizer(), "train")
    evals = build_task_source(cfg, FakeTokenizer(), "eval")
    assert len(train) == 25 and len(evals) == 5
    assert not {p.index for p in train.items} & {p.index for p in evals.items}
    assert [p.index for p in evals.items] == sorted(p.index for p in evals.items)
    assert default_reward_name("jsonl") == "math"
    assert get_reward_fn("math")(r"so \boxed{3}", evals.items[0].ground_truth) == float(
        evals.items[0].index == 3
    )
    with pytest.raises(ValueError, match="data.num_eval"):
        build_task_source(
            DataConfig(task="jsonl", path=str(path), prompt_key="question", num_eval=30), FakeTokenizer()
        )
