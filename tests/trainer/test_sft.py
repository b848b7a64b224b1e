"""`rlloom sft`: supervised fine-tuning on the training engine.

The first step's `sft/loss` equals transformers' mean cross-entropy over the assistant tokens of the
same rows (each assistant message's content and its `<|im_end|>`, as the chat template renders
them; system, user and template tokens not counted) at 1, 2 and 3 micro-batches, and on 2 gloo
ranks (FSDP); the loss falls over steps; a resumed run equals the uninterrupted one bit for bit;
bad rows and settings stop the start-up in one line naming them, before the model loads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from parallel_helpers import run_gloo  # noqa: E402
from test_trainer_loop import read_metrics  # noqa: E402

from rlloom.algorithms.sft import sft_normalizer  # noqa: E402
from rlloom.cli import main  # noqa: E402
from rlloom.config import load_config  # noqa: E402
from rlloom.data.conversations import load_conversations  # noqa: E402
from rlloom.data.types import RolloutBatch  # noqa: E402
from rlloom.models import load_tokenizer  # noqa: E402
from rlloom.trainer.checkpoint import checkpoint_dir, checkpoint_model_tensors  # noqa: E402
from rlloom.trainer.sft import run_sft  # noqa: E402
from rlloom.trainer.sft_data import conversation_samples  # noqa: E402

ROWS = [
    [
        {"role": "user", "content": "What is 12 + 35? Answer with just the number, nothing else."},
        {"role": "assistant", "content": "47"},
    ],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Add 2 and 2"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "thanks"},  # after the last answer: not trained, left out
    ],
    [
        {"role": "user", "content": "Name a colour of the sky, please, in one word."},
        {"role": "assistant", "content": "Blue."},
    ],
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread costs a third of the CPU time of two on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_rows(path: Path, rows: list, key: str = "messages") -> Path:
    path.write_text("".join(json.dumps({key: r} if isinstance(r, list) else r) + "\n" for r in rows))
    return path


def sft_args(ckpt: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.path={ckpt}",
        "data.task=jsonl",
        f"data.path={data}",
        f"trainer.run_dir={run_dir}",
        "trainer.save_hf_every=-1",
        f"trainer.prompts_per_step={len(ROWS)}",
        "trainer.total_steps=1",
        *extra,
    ]


def transformers_mean_ce(ckpt: Path, rows: list) -> float:
    """Mean cross-entropy over the assistant tokens (content and `<|im_end|>`) of `rows`, with the
    conversation built piece by piece as the tiny model's template writes it."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    for messages in rows:
        ids: list[int] = []
        trained: list[bool] = []
        for m in messages:
            head = tokenizer.encode(f"<|im_start|>{m['role']}\n", add_special_tokens=False)
            body = tokenizer.encode(f"{m['content']}<|im_end|>", add_special_tokens=False)
            tail = tokenizer.encode("\n", add_special_tokens=False)
            ids += head + body + tail
            trained += [False] * len(head) + [m["role"] == "assistant"] * len(body) + [False] * len(tail)
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids).logits[0, :-1]
        labels = torch.where(torch.tensor(trained[1:]), input_ids[0, 1:], -100)
        total += float(torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
        count += int((labels != -100).sum())
    return total / count


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> Path:
    return write_rows(tmp_path_factory.mktemp("sft") / "rows.jsonl", ROWS)


@pytest.fixture(scope="module")
def expected_loss(tiny_checkpoint) -> float:
    return transformers_mean_ce(tiny_checkpoint, ROWS)


def row_tokens(ckpt: Path, rows_file: Path) -> list[int]:
    tokenizer = load_tokenizer(ckpt)
    conversations = load_conversations(rows_file, messages_key="messages", file_format="jsonl")
    return [
        sum(s.num_tokens for s in conversation_samples(tokenizer, c, system_prompt="", group_id=i))
        for i, c in enumerate(conversations)
    ]


@pytest.mark.parametrize("num_micro_batches", [1, 2, 3])
def test_first_step_loss_equals_transformers_cross_entropy(
    num_micro_batches, tiny_checkpoint, rows_file, expected_loss, tmp_path
):
    lengths = sorted(row_tokens(tiny_checkpoint, rows_file), reverse=True)
    assert lengths[0] > lengths[1] > lengths[2] and lengths[1] + lengths[2] > lengths[0]
    budget = {1: sum(lengths), 2: lengths[0] + lengths[2], 3: lengths[0]}[num_micro_batches]
    cfg = load_config(
        "arithmetic_smoke",
        sft_args(tiny_checkpoint, rows_file, tmp_path / "run", f"train.max_tokens_per_micro_batch={budget}"),
    )
    run_sft(cfg)
    [first] = read_metrics(tmp_path / "run")
    assert first["train/num_micro_batches"] == num_micro_batches
    assert first["sft/loss"] == pytest.approx(expected_loss, rel=1e-4)
    assert first["train/loss"] == pytest.approx(expected_loss, rel=1e-4)  # token-mean: the loss itself
    assert first["sft/tokens"] == 2 + 1 + 22 + 1 + 1 + 1 + 5 + 1  # each answer and its <|im_end|>


def _gloo_rank(rank: int, ckpt: Path, rows_file: Path, expected: float) -> None:
    from rlloom.workers.train import TrainWorker

    cfg = load_config("arithmetic_smoke", [f"model.path={ckpt}"])
    tokenizer = load_tokenizer(ckpt)
    conversations = load_conversations(rows_file, messages_key="messages", file_format="jsonl")
    samples = [
        s
        for i, c in enumerate(conversations)
        for s in conversation_samples(tokenizer, c, system_prompt="", group_id=i)
    ]
    batch = RolloutBatch(samples)
    worker = TrainWorker(cfg, rank=rank)
    assert worker.engine.dp_size == 2
    metrics = worker.update_sft(batch, sft_normalizer(batch.response_mask(), "token-mean"))
    assert metrics["sft/loss"].value == pytest.approx(expected, rel=1e-4)
    assert metrics["train/loss"].value == pytest.approx(expected, rel=1e-4)


def test_two_gloo_ranks_first_step_loss_equals_transformers(tiny_checkpoint, rows_file, expected_loss):
    run_gloo(_gloo_rank, 2, tiny_checkpoint, rows_file, expected_loss)


def test_loss_falls_resume_equals_uninterrupted_and_export(tiny_checkpoint, rows_file, tmp_path):
    """lr 3e-2 with 2 of the 3 rows a step: the order wraps an epoch inside step 2, so a resume that
    lost the data position or the optimizer state would train other rows or other updates."""
    common = ("train.lr=3e-2", "trainer.prompts_per_step=2", "trainer.save_every=1")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_sft(
        load_config(
            "arithmetic_smoke",
            sft_args(tiny_checkpoint, rows_file, straight, *common, "trainer.total_steps=4"),
        )
    )
    assert (
        main(
            [
                "sft",
                "arithmetic_smoke",
                *sft_args(tiny_checkpoint, rows_file, resumed, *common, "trainer.total_steps=2"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "sft",
                "arithmetic_smoke",
                *sft_args(
                    tiny_checkpoint,
                    rows_file,
                    resumed,
                    *common,
                    "trainer.total_steps=4",
                    "trainer.resume=auto",
                ),
            ]
        )
        == 0
    )
    want, got = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert want == got
    losses = [m["sft/loss"] for m in want]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.8 * losses[0], losses
    a = checkpoint_model_tensors(checkpoint_dir(straight, 4))
    b = checkpoint_model_tensors(checkpoint_dir(resumed, 4))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert main(["export", str(resumed), str(tmp_path / "out")]) == 0  # an SFT run exports as an RL run does
    assert (tmp_path / "out" / "model.safetensors").is_file()


def _error(capsys, *argv: str) -> str:
    assert main(["sft", "arithmetic_smoke", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlloom: error: ") and err.count("\n") == 1, err
    return err


BAD = {
    "no assistant turn": (
        [ROWS[0], [{"role": "user", "content": "hello"}]],
        "line 2: no assistant message",
    ),
    "malformed message": (
        [ROWS[0], [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]],
        "line 2: message 1 is not a {role, content} object of strings",
    ),
    "messages not a list": ([ROWS[0], {"messages": "hi"}], "line 2: messages must be a non-empty list"),
    "unknown role": (
        [[{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]],
        "line 1: message 1 has role 'bot'",
    ),
    "starts with the answer": (
        [[{"role": "assistant", "content": "4"}]],
        "line 1: message 0 is an assistant",
    ),
    "row missing the column": ([ROWS[0], {"text": "hi"}], "line 2: missing messages field 'messages'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_rows_are_one_line_errors_naming_the_row(case, tiny_checkpoint, tmp_path, capsys):
    rows, needle = BAD[case]
    data = write_rows(tmp_path / "rows.jsonl", rows)
    err = _error(capsys, *sft_args(tiny_checkpoint, data, tmp_path / "run"))
    assert f"data.path={str(data)!r}" in err and needle in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before the model loaded


def test_missing_messages_column_names_the_setting(tiny_checkpoint, rows_file, tmp_path, capsys):
    err = _error(
        capsys, *sft_args(tiny_checkpoint, rows_file, tmp_path / "run", "data.messages_key=conversation")
    )
    assert "data.messages_key='conversation': no row" in err and "['messages']" in err, err


@pytest.mark.parametrize(
    "setting, needle",
    [
        ("data.task=countdown data.path=", "data.task=countdown is invalid for rlloom sft"),
        ("algorithm.agg_mode=token-sum", "algorithm.agg_mode=token-sum is invalid for rlloom sft"),
        ("algorithm.kl_coef=0.1", "algorithm.kl_coef=0.1 is invalid for rlloom sft"),
        ("data.chat_template=false", "data.chat_template=false is invalid for rlloom sft"),
    ],
)
def test_bad_settings_are_one_line_errors(setting, needle, tiny_checkpoint, rows_file, tmp_path, capsys):
    err = _error(capsys, *sft_args(tiny_checkpoint, rows_file, tmp_path / "run", *setting.split()))
    assert needle in err, err


def test_arithmetic_rows_answer_with_the_number(tiny_checkpoint):
    """data.task=arithmetic (the arithmetic_sft recipe): each training problem's prompt, answered by its
    number and the end of turn; the evaluation problems are not among them."""
    from rlloom.tasks.build import task_prompts
    from rlloom.trainer.sft_data import sft_conversations

    cfg = load_config("arithmetic_smoke", ["data.num_train=5", "data.num_eval=5"])
    conversations = sft_conversations(cfg.data)
    held_out = {raw.prompt for raw in task_prompts(cfg.data, "eval")}
    assert len(conversations) == 5
    tokenizer = load_tokenizer(tiny_checkpoint)
    for c in conversations:
        question, answer = c.messages
        assert question["content"] not in held_out
        [sample] = conversation_samples(tokenizer, c, system_prompt="", group_id=0)
        assert tokenizer.decode(sample.response_ids) == f"{answer['content']}<|im_end|>"
        assert sample.loss_mask == [1] * len(sample.response_ids)


TWO_STEPS = ("train.lr=3e-2", "trainer.total_steps=2")


@pytest.fixture(scope="module")
def one_process(tiny_checkpoint, rows_file, tmp_path_factory) -> list[dict]:
    """The one-process run both Ray layouts are compared with (run once for both)."""
    run_dir = tmp_path_factory.mktemp("sft_one")
    run_sft(load_config("arithmetic_smoke", sft_args(tiny_checkpoint, rows_file, run_dir, *TWO_STEPS)))
    return read_metrics(run_dir)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")  # the session's one Ray instance
@pytest.mark.parametrize("layout", [(), ("parallel.tp=2",)], ids=["dp=2", "tp=2"])
def test_two_ray_workers_match_one_process(layout, one_process, tiny_checkpoint, rows_file, tmp_path):
    """The whole `rlloom sft` run on 2 Ray workers (FSDP, or tensor parallelism) equals the one-process
    run's losses and gradient norms within rel 1e-4 at lr 3e-2 (the second step trains on the first's
    update)."""
    ray = ("cluster.mode=ray", "cluster.num_workers=2", *layout)
    run_sft(
        load_config(
            "arithmetic_smoke", sft_args(tiny_checkpoint, rows_file, tmp_path / "ray", *TWO_STEPS, *ray)
        )
    )
    want, got = one_process, read_metrics(tmp_path / "ray")
    assert [m["step"] for m in got] == [1, 2]
    for a, b in zip(want, got):
        for key in ("sft/loss", "sft/tokens", "train/loss", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key
    assert got[1]["sft/loss"] < got[0]["sft/loss"]
