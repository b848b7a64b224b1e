"""`rlloom eval MODEL_OR_RUN DATA [overrides]`: accuracy of a model on a dataset, scored by the task's reward.

MODEL_OR_RUN is a Hugging Face folder (or the embedded model name), a run folder or a checkpoint.
A run's settings (chat template, system prompt, reward, max_new_tokens, ...) come from its
checkpoint's config.yaml and its weights from RUN_DIR/hf/step_N, or from an export of the checkpoint
when that folder is absent; a model folder starts from its `rlloom_task.yaml` (the run's task
settings, written by `rlloom export` and into the run's own Hugging Face folders) or, without one,
from the default settings. DATA is a .jsonl or
.parquet file (every row is evaluated) or a procedural task name (its held-out split). Dotted
overrides apply last. Greedy by default; `samples` > 1 at a temperature > 0 also reports pass@k.
The report is a table and one JSON line (the last line, for scripts); `responses` also writes every
answer with its score to a new jsonl file (an existing path is refused, never overwritten).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlloom.config import ConfigError, RunConfig
from rlloom.config.loading import load_config
from rlloom.data.chat import tokenize_prompts
from rlloom.data.control_tokens import ResponseDecoder
from rlloom.data.dataset import PromptItem, load_prompt_file
from rlloom.devices import resolve_device, resolve_dtype
from rlloom.engines.rollout.build import build_rollout_engine
from rlloom.engines.train.hf_folder import save_hf_folder
from rlloom.models import load_tokenizer
from rlloom.models.checkpoint import load_image_processing
from rlloom.models.embedded import EMBEDDED_NAME
from rlloom.rewards.build import build_reward_runner
from rlloom.run_files import open_fd, open_text, write_failed
from rlloom.tasks.build import task_prompts
from rlloom.trainer.evaluate import EvalScores, score_prompts
from rlloom.trainer.export import TASK_FILE, build_engine_from_checkpoint, hf_dir, resolve_checkpoint
from rlloom.trainer.model_folder import check_model_folder, check_tokenizer

PROCEDURAL_TASKS = ("arithmetic", "countdown", "visual_compare", "visual_colour")


@dataclass(kw_only=True, slots=True)
class EvalReport:
    """What `rlloom eval` prints. Example: `EvalReport(model="runs/x", data="test.jsonl", prompts=8,
    samples=1, temperature=0.0, skipped_too_long=0, metrics={"accuracy": 0.5, "length_mean": 6.0})`."""

    model: str
    data: str
    prompts: int
    """Prompts evaluated."""
    samples: int
    """Samples per prompt."""
    temperature: float
    skipped_too_long: int
    """Prompts over data.max_prompt_length tokens, not evaluated."""
    metrics: dict[str, float]
    """`accuracy`, `length_mean`, and `pass@k` for k > 1 samples."""

    def table(self) -> str:
        width = max(len(k) for k in self.metrics)
        rows = [f"{k:<{width}}  {v:.4f}" for k, v in self.metrics.items()]
        head = (
            f"rlloom eval: {self.model} on {self.data}: {self.prompts} prompts x {self.samples} "
            f"sample(s), temperature {self.temperature:g}"
            + (f", {self.skipped_too_long} prompt(s) skipped as too long" if self.skipped_too_long else "")
        )
        return "\n".join([head, f"{'metric':<{width}}  value", *rows])

    def json_line(self) -> str:
        fields = {
            "model": self.model,
            "data": self.data,
            "prompts": self.prompts,
            "samples": self.samples,
            "temperature": self.temperature,
            "skipped_too_long": self.skipped_too_long,
        }
        return json.dumps(fields | self.metrics)


def eval_data_overrides(data: str) -> list[str]:
    """data.task / data.path for a dataset file or a procedural task name."""
    if data in PROCEDURAL_TASKS:
        return [f"data.task={data}", "data.path=''"]  # a run's dataset file is not read by a task
    path = Path(data)
    if not path.is_file():
        raise ConfigError(
            f"eval data {data!r} is neither a file nor a task. Fix: pass a .jsonl or .parquet file of "
            f"prompts and answers, or one of {', '.join(PROCEDURAL_TASKS)}."
        )
    task = "parquet" if path.suffix == ".parquet" else "jsonl"
    # Every row is evaluated: no rows are held out of a training split here.
    return [f"data.task={task}", f"data.path={json.dumps(str(path.resolve()))}", "data.num_eval=0"]


def resolve_model(model_or_run: str, workdir: Path) -> tuple[Path | None, str]:
    """(the settings to start from: a checkpoint's config.yaml, an exported model's task file, or None
    for the defaults; the Hugging Face folder to evaluate)."""
    path = Path(model_or_run)
    if model_or_run == EMBEDDED_NAME:
        return None, EMBEDDED_NAME
    if (path / "config.json").is_file():
        task = path / TASK_FILE
        return (task if task.is_file() else None), str(path.resolve())
    if not path.is_dir():
        raise ConfigError(
            f"model {model_or_run!r} does not exist. Fix: pass a Hugging Face folder (config.json and "
            f"safetensors; download Hub models first), {EMBEDDED_NAME!r}, a run folder or a checkpoint."
        )
    if not (path / "checkpoints").is_dir() and not (path / "config.yaml").is_file():
        raise ConfigError(
            f"model {model_or_run!r} is neither a Hugging Face folder (no config.json) nor a run folder or "
            "checkpoint. Fix: pass a folder with config.json and safetensors, a run folder (RUN_DIR) or "
            "RUN_DIR/checkpoints/step_N."
        )
    ckpt = resolve_checkpoint(path)
    step = int(ckpt.name.split("_")[1])
    saved = hf_dir(ckpt.parent.parent, step)
    if (saved / "config.json").is_file():
        return ckpt / "config.yaml", str(saved.resolve())
    cfg, engine = build_engine_from_checkpoint(ckpt)
    return ckpt / "config.yaml", str(save_hf_folder(engine, cfg.model.path, workdir / "model"))


def eval_items(cfg: RunConfig, tokenizer: object) -> tuple[list[PromptItem], int]:
    """(tokenized prompts, prompts skipped as too long): every row of a file, or a task's eval split."""
    d = cfg.data
    if d.task in PROCEDURAL_TASKS:
        raws = task_prompts(d, "eval")
    else:
        raws = load_prompt_file(d.path, prompt_key=d.prompt_key, answer_key=d.answer_key, file_format=d.task)
    tokenized = tokenize_prompts(
        raws,
        tokenizer,  # type: ignore[arg-type]
        chat_template=d.chat_template,
        system_prompt=d.system_prompt,
        max_prompt_length=d.max_prompt_length,
        images=load_image_processing(cfg.model.path),
    )
    return tokenized.items, tokenized.num_too_long


def generate_and_score(cfg: RunConfig, samples: int) -> tuple[list[PromptItem], EvalScores, int]:
    """Load the model of `cfg.model.path` into a rollout engine and score the eval prompts:
    (the prompts, their scores, prompts skipped as too long)."""
    check_model_folder(cfg.model.path, "model")
    d = cfg.data
    check_tokenizer(cfg.model.path, "model", chat_template=d.chat_template, system_prompt=d.system_prompt)
    tokenizer = load_tokenizer(cfg.model.path)
    items, too_long = eval_items(cfg, tokenizer)
    columns = {name for item in items for name in item.metadata}
    runner = build_reward_runner(cfg.reward, task=cfg.data.task, columns=columns)  # before the model
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    decode = ResponseDecoder.of(tokenizer)  # control tokens inside a response stay visible
    try:
        device = resolve_device(cfg)
        # one whole replica in this process, whatever rollout.tp the run had
        one_replica = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, tp=1))
        engine = build_rollout_engine(one_replica, device=device, dtype=resolve_dtype(cfg, device))
        scores = score_prompts(
            engine.generate, items, runner, decode, cfg, stop_token_ids=stop, samples=samples
        )
        return items, scores, too_long
    finally:
        runner.close()


def create_responses_file(path: Path) -> None:
    """Create `path` as a new empty file (its folder is created if missing), or a one-line ConfigError.

    Anything already there is refused (a file, a link, a folder): `--responses` never overwrites, so
    a mistyped path cannot destroy the data file being evaluated or a run's metrics.jsonl."""
    if path.is_symlink() or path.exists():
        raise ConfigError(
            f"--responses={str(path)!r} already exists; rlloom eval writes only a new file (it would "
            "overwrite the file there, which may be the data or a run's metrics). Fix: pass a new file name, "
            "or delete the old file first."
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except OSError as e:
        raise ConfigError(
            f"--responses={str(path)!r} cannot be written: {e.strerror or e}. Fix: pass a new file path in a "
            "folder you can write to."
        ) from e


def write_responses(path: Path, items: list[PromptItem], scores: EvalScores) -> None:
    """One JSON line per prompt: its row index, the templated prompt, the ground truth, and every
    response with its score."""
    try:
        with open_text(path) as f:
            for item, texts, row in zip(items, scores.texts, scores.scores):
                record = {"index": item.index, "prompt": item.prompt_text, "ground_truth": item.ground_truth}
                f.write(json.dumps(record | {"responses": texts, "scores": row}) + "\n")
    except OSError as e:
        raise write_failed(path, e, "free disk space, or pass --responses a file on another disk.") from e


def eval_model(
    model_or_run: str,
    data: str,
    overrides: list[str] | None = None,
    *,
    samples: int = 1,
    temperature: float | None = None,
    responses: str | None = None,
) -> EvalReport:
    """`rlloom eval`: see the module docstring. `responses`: a jsonl file to write every answer to."""
    if samples < 1:
        raise ConfigError(f"--samples={samples} is invalid: must be >= 1. Fix: use 1 (greedy) or e.g. 8.")
    data_overrides = eval_data_overrides(data)
    if responses:
        create_responses_file(Path(responses))  # before the evaluation, which a failed write would lose
    try:
        report, items, scores = _evaluate(
            model_or_run, data, data_overrides + (overrides or []), samples=samples, temperature=temperature
        )
    except BaseException:
        if responses:
            Path(responses).unlink(missing_ok=True)  # the empty file made above: a rerun may use the name
        raise
    if responses:
        write_responses(Path(responses), items, scores)
    return report


def _evaluate(
    model_or_run: str, data: str, overrides: list[str], *, samples: int, temperature: float | None
) -> tuple[EvalReport, list[PromptItem], EvalScores]:
    """The report, and the prompts with their scores (for `--responses`)."""
    with tempfile.TemporaryDirectory(prefix="rlloom-eval-") as tmp:
        workdir = Path(tmp)
        base, model = resolve_model(model_or_run, workdir)  # a model folder: the defaults (base None)
        extra = [] if temperature is None else [f"rollout.eval_temperature={temperature}"]
        cfg = load_config(base, [f"model.path={json.dumps(model)}", *overrides, *extra])
        temp = cfg.rollout.eval_temperature
        if samples > 1 and temp == 0:
            raise ConfigError(
                f"--samples={samples} at temperature 0 (greedy) gives {samples} identical answers per prompt. "
                "Fix: add --temperature 0.7 (or rollout.eval_temperature=0.7), or use --samples 1."
            )
        items, scores, too_long = generate_and_score(cfg, samples)
    metrics = {k.removeprefix("eval/"): v for k, v in scores.metrics().items()}
    report = EvalReport(
        model=model_or_run,
        data=data,
        prompts=len(scores.scores),
        samples=samples,
        temperature=temp,
        skipped_too_long=too_long,
        metrics=metrics,
    )
    return report, items, scores
