"""Loggers: JSONL resume truncation, console line format off a TTY, the factory, init_logger."""

import io
import json
import logging

import pytest

from rlloom.config import LoggingConfig
from rlloom.observability.console import ConsoleLogger, format_eta
from rlloom.observability.jsonl import JsonlLogger, read_metrics_jsonl
from rlloom.observability.log import init_logger
from rlloom.observability.logger import MultiLogger
from rlloom.observability.loggers import METRICS_FILE, build_loggers


def metrics_at(step: int) -> dict:
    return {"reward/mean": step / 10, "time/step_s": 1.5}


def test_resumed_jsonl_equals_uninterrupted(tmp_path):
    full = tmp_path / "full.jsonl"
    with JsonlLogger(full) as logger:
        for step in range(1, 7):
            logger.log(step, metrics_at(step))

    # Interrupted after step 5, with a torn last line; the checkpoint is from step 3.
    resumed = tmp_path / "resumed.jsonl"
    with JsonlLogger(resumed) as logger:
        for step in range(1, 6):
            logger.log(step, metrics_at(step))
    with resumed.open("a") as f:
        f.write('{"step": 6, "rew')
    with JsonlLogger(resumed, resume_from_step=4) as logger:
        assert [r["step"] for r in read_metrics_jsonl(resumed)] == [1, 2, 3]
        for step in range(4, 7):
            logger.log(step, metrics_at(step))
    assert resumed.read_bytes() == full.read_bytes()


def test_jsonl_fresh_start_overwrites_and_values_are_strict_json(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlLogger(path) as logger:
        logger.log(1, {"loss/policy": 1.0})
    with JsonlLogger(path) as logger:
        logger.log(1, {"loss/policy": float("nan"), "perf/tokens": 7})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(2, {"step": 3})
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss/policy": None, "perf/tokens": 7}]


def test_jsonl_resume_of_missing_file_starts_empty(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    with JsonlLogger(path, resume_from_step=10) as logger:
        logger.log(10, {"reward/mean": 0.5})
    assert read_metrics_jsonl(path) == [{"step": 10, "reward/mean": 0.5}]
    with pytest.raises(FileNotFoundError, match="logging.jsonl"):
        read_metrics_jsonl(tmp_path / "absent.jsonl")


def test_console_prints_one_tagged_line_per_step_off_a_tty():
    out = io.StringIO()
    logger = ConsoleLogger(total_steps=20, file=out)
    logger.log(0, {"eval/accuracy": 0.1})
    logger.log(1, {"reward/trained_mean": 0.5, "train/accuracy": 0.25, "time/step_s": 1.234})
    logger.log(2, {"reward/trained_mean": 0.625, "eval/accuracy": 0.3, "time/step_s": 1.0, "other/x": 9})
    logger.log(3, {"reward/trained_mean": 0.75, "time/step_s": 1.0})
    logger.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4
    # The evaluation before training has no step time or ETA.
    assert lines[0] == "[rlloom] step 0/20 | eval_acc 0.100"
    # The first training step is the warm-up: labelled, and the ETA waits for the next step.
    assert lines[1] == (
        "[rlloom] step 1/20 | reward 0.500 | acc 0.250 | 1.23 s/step (warm-up) | eta after warm-up"
    )
    # Training values not re-logged keep showing; unknown keys are not shown.
    assert lines[2].startswith(
        "[rlloom] step 2/20 | reward 0.625 | acc 0.250 | eval_acc 0.300 | 1.00 s/step | eta 0:00:"
    )
    assert "other" not in lines[2]
    # Evaluation metrics show only on the steps that evaluated.
    assert lines[3].startswith("[rlloom] step 3/20 | reward 0.750 | acc 0.250 | 1.00 s/step | eta 0:00:")


def test_console_shows_the_samples_whose_reward_failed_only_when_there_are_some():
    out = io.StringIO()
    logger = ConsoleLogger(total_steps=3, file=out)
    failed = {"reward/errors": 6.0, "reward/timeouts": 1.0, "reward/invalid": 1.0}
    logger.log(1, {"reward/trained_mean": 0.0, **failed, "time/step_s": 1.0})
    logger.log(2, {"reward/trained_mean": 0.5, **dict.fromkeys(failed, 0.0), "time/step_s": 1.0})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[rlloom] step 1/3 | reward 0.000 | reward_failed 8 | 1.00 s/step")
    assert lines[1].startswith("[rlloom] step 2/3 | reward 0.500 | 1.00 s/step")


def test_console_eta_leaves_out_the_warm_up_step(monkeypatch):
    import rlloom.observability.console as console

    clock = iter([0.0, 100.0, 101.0, 102.0])  # start; the warm-up step ends at 100 s, then 1 s a step
    monkeypatch.setattr(console.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    logger = ConsoleLogger(total_steps=10, file=out, first_step=1)
    for step in (1, 2, 3):
        logger.log(step, {"reward/trained_mean": 0.0})
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("100.00 s/step (warm-up) | eta after warm-up")
    # 1 s a step after the warm-up, 7 steps left: 7 s (a rate over all steps would say 238 s).
    assert lines[2].endswith("1.00 s/step | eta 0:00:07")


def test_console_without_total_or_timer():
    out = io.StringIO()
    logger = ConsoleLogger(file=out)
    logger.log(3, {"reward/trained_mean": 1.0})
    line = out.getvalue().strip()
    assert line.startswith("[rlloom] step 3 | reward 1.000 | ") and line.endswith(" s/step (warm-up)")
    assert format_eta(3725.4) == "1:02:05"


def test_console_live_mode_keeps_every_step_line_above_the_bar():
    out = io.StringIO()
    logger = ConsoleLogger(total_steps=4, file=out, live=True)
    logger.log(0, {"eval/accuracy": 0.1})
    for step in range(1, 5):
        logger.log(step, {"reward/trained_mean": 0.1 * step, "time/step_s": 1.0})
    logger.close()
    # Each step's line is printed once and stays (the live bar only redraws itself), step 0's
    # evaluation too.
    text = out.getvalue()
    assert "[rlloom] step 0/4 | eval_acc 0.100" in text
    for step in range(1, 5):
        assert text.count(f"[rlloom] step {step}/4 | reward {0.1 * step:.3f}") == 1


def test_console_shows_the_kl_term_and_entropy():
    out = io.StringIO()
    logger = ConsoleLogger(total_steps=3, file=out)
    logger.log(
        1, {"reward/trained_mean": 0.5, "loss/kl": 0.00123, "actor/entropy": 0.8125, "time/step_s": 1.0}
    )
    logger.log(2, {"reward/trained_mean": 0.5, "reward/kl": 0.25, "actor/entropy": 0.5, "time/step_s": 1.0})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[rlloom] step 1/3 | reward 0.500 | kl 0.0012 | entropy 0.812 | 1.00 s/step")
    assert "| kl 0.2500 | entropy 0.500 |" in lines[1]


def test_build_loggers_follows_config(tmp_path):
    logger = build_loggers(LoggingConfig(console=False, jsonl=True, samples_per_step=0), tmp_path)
    assert isinstance(logger, MultiLogger) and len(logger.loggers) == 1
    logger.log(1, {"reward/mean": 0.1})
    logger.close()
    assert read_metrics_jsonl(tmp_path / METRICS_FILE) == [{"step": 1, "reward/mean": 0.1}]
    off = LoggingConfig(console=False, jsonl=False, samples_per_step=0)
    assert build_loggers(off, tmp_path).loggers == []


def test_tensorboard_missing_says_how_to_install(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"rlloom\[tensorboard\]"):
            build_loggers(LoggingConfig(console=False, jsonl=False, tensorboard=True), tmp_path)
    else:
        logger = build_loggers(LoggingConfig(console=False, jsonl=False, tensorboard=True), tmp_path)
        logger.log(1, {"reward/mean": 0.1})
        logger.close()
        assert any((tmp_path / "tensorboard").iterdir())


@pytest.fixture
def restore_rlloom_logger():
    # init_logger changes process-wide state; undo it so other tests' caplog still sees rlloom records.
    logger = logging.getLogger("rlloom")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate = saved[0], saved[1]
    logger.setLevel(saved[2])


def test_init_logger_once(capsys, restore_rlloom_logger):
    logger = init_logger()
    init_logger()
    assert sum(h.get_name() == "rlloom-stderr" for h in logger.handlers) == 1
    logging.getLogger("rlloom.trainer.test").warning("kl_coef=0 ignores kl_kind")
    err = capsys.readouterr().err
    assert err.count("[rlloom]") == 1 and "WARNING kl_coef=0 ignores kl_kind" in err


def test_samples_log_resumes_like_metrics_and_picks_spread_samples(tmp_path):
    from types import SimpleNamespace

    from rlloom.observability.samples import SamplesLogger, pick_samples, sample_records

    def sample(i: int) -> SimpleNamespace:
        prompt = [{"role": "user", "content": f"q{i // 4}"}]
        meta = {"prompt": prompt, "response_text": f"r{i}", "ground_truth": "1"}
        return SimpleNamespace(reward=float(i % 2), finish_reason="stop", metadata=meta)

    batch = [sample(i) for i in range(8)]  # two prompts x four samples
    picked = pick_samples(batch, 2)
    assert [s.metadata["response_text"] for s in picked] == ["r0", "r4"]  # one of each prompt
    assert pick_samples(batch, 0) == [] and len(pick_samples(batch, 20)) == 8

    path = tmp_path / "samples.jsonl"
    out = io.StringIO()
    with SamplesLogger(path, file=out) as log:
        for step in (1, 2, 3):
            log.log_samples(step, sample_records(step, picked))
    first = out.getvalue().splitlines()[0]
    assert first == "[rlloom] sample 1.1 | reward 0.000 | prompt 'user: q0' | response 'r0'"
    # A resume from step 2 drops what the interrupted run logged at step 2 and later.
    with SamplesLogger(path, resume_from_step=2, console=False) as log:
        log.log_samples(2, sample_records(2, picked[:1]))
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 1, 2]


def test_wandb_run_id_is_kept_for_a_resume(tmp_path):
    from rlloom.observability.wandb_logger import run_id

    first = run_id(tmp_path, resume=False)
    assert run_id(tmp_path, resume=True) == first
    assert run_id(tmp_path, resume=False) != first  # a fresh start is a new W&B run


class FullDisk(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


def test_a_full_disk_while_logging_is_one_line_naming_the_file(tmp_path):
    # Before (71f07fb): the OSError's traceback, without the file or the fix.
    from rlloom.observability.logger import SampleRecord
    from rlloom.observability.samples import SamplesLogger
    from rlloom.run_files import WriteFailed

    record = SampleRecord(
        step=1, prompt="1+1", response="2", reward=1.0, ground_truth="2", finish_reason="stop"
    )

    metrics = JsonlLogger(tmp_path / "metrics.jsonl")
    samples = SamplesLogger(tmp_path / "samples.jsonl", console=False)
    for logger, call in (
        (metrics, lambda: metrics.log(1, {"a": 1.0})),
        (samples, lambda: samples.log_samples(1, [record])),
    ):
        logger._file = FullDisk()
        with pytest.raises(WriteFailed) as error:
            call()
        message = str(error.value)
        assert f"writing {str(logger.path)!r} failed: No space left on device (" in message
        assert "free on its disk). Fix: free disk space, then continue with trainer.resume=auto" in message
