"""Every bad input through the `rlloom` CLI: exit code 2, one line `rlloom: error: ...`, no traceback.

Each case is a row of docs/reliability.md ("Bad input"). Config cases run `rlloom config show`;
cases that need the model (its length, the KV cache, the data file, a resume) run `rlloom train`
on the tiny checkpoint and must fail before any step. `main()` runs in-process (an uncaught
exception fails the test, as a traceback would); one case also runs as `python -m rlloom.cli`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlloom.cli import main

REPO = Path(__file__).resolve().parents[2]


def yaml_file(tmp_path: Path, content: str | bytes) -> str:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return str(path)


def laughs(levels: int = 9) -> str:
    """A "billion laughs" YAML flow list: each level an alias of the previous one nine times (9**levels)."""
    names = [f"l{i}" for i in range(levels)]
    parts = ["&l0 [lol,lol,lol,lol,lol,lol,lol,lol,lol]"]
    parts += [f"&{n} [" + ",".join([f"*{p}"] * 9) + "]" for p, n in zip(names, names[1:])]
    return "[" + ", ".join(parts) + "]"


# (case id, text of the YAML file or None for the recipe, overrides, words the message must hold)
CONFIG_CASES = [
    # a 330-byte file expanded for minutes into a MemoryError traceback (2026-11-29)
    (
        "yaml_billion_laughs",
        f"trainer:\n  total_steps: {laughs()}\n",
        [],
        ["more than 100000 values", "aliases"],
    ),
    ("override_billion_laughs", None, [f"train.betas={laughs()}"], ["override train.betas", "aliases"]),
    ("yaml_alias_of_itself", "trainer:\n  total_steps: &a [*a]\n", [], ["more than 100000 values"]),
    ("yaml_syntax", "trainer:\n  seed: [1\n", [], ["not valid YAML", "line 3"]),
    ("yaml_tab_indent", "trainer:\n\tseed: 1\n", [], ["not valid YAML", "line 2"]),
    ("yaml_not_utf8", b"trainer:\n  run_dir: caf\xe9\n", [], ["not UTF-8", "0xe9", "line 2"]),
    ("yaml_nested_too_deeply", "trainer: " + "[" * 100_000 + "\n", [], ["nested too deeply"]),
    ("yaml_recipe_list", "recipe: [1, 2]\n", [], ["recipe=[1, 2]", "one recipe name"]),
    ("yaml_duplicate_key", "trainer:\n  seed: 1\n  seed: 2\n", [], ["duplicate key 'seed'", "line 2"]),
    ("yaml_top_level_list", "- 1\n- 2\n", [], ["mapping of sections"]),
    ("yaml_unknown_key", "trainer:\n  sed: 1\n", [], ["trainer.sed", "did you mean 'trainer.seed'"]),
    # another framework's names: a guess by spelling offered num_generations -> max_new_tokens
    ("trl_num_generations", None, ["num_generations=16"], ["this rollout.n_samples", "rollout.n_samples=16"]),
    ("trl_learning_rate", None, ["learning_rate=1e-6"], ["rlloom calls this train.lr", "train.lr=1e-6"]),
    ("trl_beta", None, ["beta=0.04"], ["rlloom calls this algorithm.kl_coef"]),
    ("verl_clip_ratio_high", None, ["algorithm.clip_ratio_high=0.28"], ["this algorithm.eps_high"]),
    ("verl_rollout_n", None, ["actor_rollout_ref.rollout.n=4"], ["rlloom's rollout.n_samples"]),
    (
        "verl_yaml_nested",
        "actor_rollout_ref:\n  actor:\n    loss_agg_mode: seq-mean-token-mean\n    kl_loss_coef: 0.01\n",
        [],
        ["rlloom's algorithm.agg_mode", "algorithm.kl_coef=0.01"],
    ),
    (
        "trl_yaml_top_level",
        "epsilon_high: 0.28\n",
        [],
        ["this algorithm.eps_high", "algorithm.eps_high=0.28"],
    ),
    ("seed_negative", None, ["trainer.seed=-1"], ["trainer.seed=-1", "2**32-1"]),
    ("seed_1e23", None, ["trainer.seed=1e23"], ["trainer.seed='1e23'", "integer"]),
    ("seed_too_large", None, ["trainer.seed=4294967296"], ["trainer.seed=4294967296", "2**32-1"]),
    ("data_seed_negative", None, ["data.seed=-3"], ["data.seed=-3"]),
    ("lr_inf", None, ["train.lr=.inf"], ["train.lr=inf", "finite"]),
    ("lr_nan_text", None, ["train.lr=nan"], ["train.lr=nan", "finite"]),
    ("default_score_nan", None, ["reward.default_score=.nan"], ["reward.default_score=nan", "finite"]),
    ("reward_timeout_inf", None, ["reward.timeout_s=.inf"], ["reward.timeout_s=inf", "finite"]),
    ("cluster_timeout_inf", None, ["cluster.timeout_s=.inf"], ["cluster.timeout_s=inf"]),
    ("betas_nan", None, ["train.betas=[0.9, .nan]"], ["train.betas", "finite"]),
    ("temperature_inf", None, ["rollout.temperature=.inf"], ["rollout.temperature=inf"]),
    ("adam_eps_zero", None, ["train.adam_eps=0"], ["train.adam_eps=0.0", "> 0"]),
    ("entropy_coef_negative", None, ["algorithm.entropy_coef=-0.1"], ["algorithm.entropy_coef=-0.1"]),
    ("run_dir_empty", None, ["trainer.run_dir="], ["trainer.run_dir=''", "must name a folder"]),
    ("run_dir_blank", None, ["trainer.run_dir=' '"], ["trainer.run_dir=' '"]),
    ("override_hash_comment", None, ["reward.name=number #x"], ["YAML comment", "reward.name='number #x'"]),
    ("override_only_comment", None, ["reward.name=#x"], ["YAML comment"]),
    ("override_unclosed", None, ["train.betas=[0.9,"], ["train.betas", "not a valid value"]),
    ("override_no_equals", None, ["train.lr"], ["section.key=value"]),
    ("override_section_value", None, ["trainer=3"], ["trainer is a section"]),
    ("missing_file", "MISSING", [], ["does not exist"]),
    # a dataset file beside a procedural task was ignored: the run trained on arithmetic
    ("data_path_with_a_task", None, ["data.path=/d.jsonl"], ["data.path='/d.jsonl'", "data.task=jsonl"]),
    # a weight-sync transport the placement cannot run
    (
        "sync_broadcast_colocated",
        None,
        ["sync.transport=broadcast"],
        ["sync.transport='broadcast'", "cluster.placement=separate", "cluster.mode=ray", "rollout_workers"],
    ),
    (
        "sync_inplace_separate",
        None,
        [
            "sync.transport=inplace",
            "cluster.mode=ray",
            "cluster.placement=separate",
            "cluster.rollout_workers=1",
        ],
        ["sync.transport='inplace'", "cluster.placement=colocated"],
    ),
]


def assert_one_line_error(rc: int, err: str, needles: list[str]) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("rlloom: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.parametrize(
    "content, overrides, needles", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES]
)
def test_bad_config_is_one_line_error(tmp_path, capsys, content, overrides, needles):
    if content is None:
        source = "arithmetic_smoke"
    elif content == "MISSING":
        source = str(tmp_path / "missing.yaml")
    else:
        source = yaml_file(tmp_path, content)
    rc = main(["config", "show", source, *overrides])
    line = assert_one_line_error(rc, capsys.readouterr().err, needles)
    assert "Fix" in line or "fix" in line or "did you mean" in line


def test_python_m_cli_prints_one_line_and_exits_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "rlloom.cli", "config", "show", "arithmetic_smoke", "train.lr=.inf"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, ["train.lr=inf"])


def test_output_piped_to_a_closed_reader_stops_without_a_traceback(tmp_path):
    # `rlloom config doc | head -1`: the reader is gone before the write
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "rlloom.cli", "config", "doc"]
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            cmd, stdout=write, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, timeout=120
        )
    finally:
        os.close(write)
    assert proc.returncode == 128 + signal.SIGPIPE and proc.stderr == "", proc.stderr


def test_a_missing_positional_names_only_itself(capsys):
    # the optional overrides were listed as required too
    with pytest.raises(SystemExit) as stop:
        main(["eval", "some_model"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and err.endswith("the following arguments are required: data"), err


def train_args(ckpt: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "train",
        "arithmetic_smoke",
        f"model.path={ckpt}",
        f"trainer.run_dir={run_dir}",
        "logging.console=false",
        "data.num_eval=2",
        "data.num_train=16",
        *extra,
    ]


def bad_jsonl(tmp_path: Path) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n' + b"[" * 200_000 + b"\n")
    return str(path)


def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("")
    return path


def truncated_parquet(tmp_path: Path) -> str:
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"PAR1\x15\x04\x15")  # cut off after the magic bytes
    return str(path)


def changed_config(tmp_path: Path, ckpt: Path, **changes) -> Path:
    """A copy of the tiny checkpoint whose config.json has `changes` (its weights as they were)."""
    out = tmp_path / "changed"
    shutil.copytree(ckpt, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | changes))
    return out


def fake_checkpoint(tmp_path: Path, ckpt: Path, *changes: str) -> Path:
    """A run folder holding a real one-step (full, resumable) checkpoint of the run with `changes`."""
    run_dir = tmp_path / "run"
    args = train_args(
        ckpt, run_dir, *changes, "trainer.total_steps=1", "trainer.save_hf_every=-1", "trainer.save_every=1"
    )
    assert main(args) == 0
    return run_dir


TRAIN_CASES = [
    (
        "model_path_missing",
        lambda t, c: ["model.path=/nonexistent/model"],
        ["model.path='/nonexistent/model'"],
    ),
    (
        "model_path_is_a_value_model",
        lambda t, c: [f"model.path={changed_config(t, c, architectures=['Qwen3ForTokenClassification'])}"],
        ["model.path=", "is a Qwen3ForTokenClassification", "must be a causal LM", "critic.model_path"],
    ),
    (
        "hub_id_not_downloaded",
        lambda t, c: ["model.path=Qwen/Qwen3-0.6B"],
        ["Hugging Face Hub id", "huggingface-cli download Qwen/Qwen3-0.6B"],
    ),
    (
        "longer_than_model",
        lambda t, c: ["rollout.max_new_tokens=300"],
        ["max_position_embeddings=512", "556"],
    ),
    (
        "num_blocks_huge",
        lambda t, c: ["rollout.num_blocks=1000000000"],
        ["rollout.num_blocks=1000000000", "GiB"],
    ),
    ("kv_memory_huge", lambda t, c: ["rollout.kv_cache_memory_gb=1000000"], ["rollout.kv_cache_memory_gb"]),
    (
        "data_no_usable_row",
        lambda t, c: ["data.task=jsonl", f"data.path={bad_jsonl(t)}"],
        ["all 2 rows are unusable", "line 1: not UTF-8", "line 2: JSON nested too deeply"],
    ),
    (
        "data_truncated_parquet",
        lambda t, c: ["data.task=parquet", f"data.path={truncated_parquet(t)}"],
        ["parquet"],
    ),
    ("data_missing_file", lambda t, c: ["data.task=jsonl", f"data.path={t}/none.jsonl"], ["not a file"]),
    ("reward_unknown", lambda t, c: ["reward.name=nosuch"], ["reward.name='nosuch'", "unknown"]),
    ("reward_plugin_missing", lambda t, c: ["reward.name=nosuch_pkg.mod:fn"], ["cannot import module"]),
    (
        "lora_unknown_target",
        lambda t, c: ["train.lora_rank=8", "train.lora_target_modules=q_proj,qkv"],
        ["train.lora_target_modules='q_proj,qkv' is invalid", "all-linear or a comma list of q_proj"],
    ),
    (
        "lora_negative_rank",
        lambda t, c: ["train.lora_rank=-1"],
        ["train.lora_rank=-1 is invalid", "must be >= 0"],
    ),
    (
        "critic_path_missing",
        lambda t, c: ["algorithm.estimator=gae", f"critic.model_path={t}/none"],
        ["critic.model_path=", "is invalid"],
    ),
    (
        "kl_in_reward_with_grpo",
        lambda t, c: ["algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1"],
        ["algorithm.kl_in_reward=True is invalid", "estimator grpo", "algorithm.estimator=gae"],
    ),
    (
        "kl_in_reward_without_coef",
        lambda t, c: ["algorithm.kl_in_reward=true", "algorithm.estimator=gae"],
        ["algorithm.kl_in_reward=True is invalid", "kl_coef > 0"],
    ),
    (
        "adaptive_kl_without_kl_in_reward",
        lambda t, c: ["algorithm.kl_ctrl=adaptive", "algorithm.kl_coef=0.1"],
        ["algorithm.kl_ctrl='adaptive' is invalid", "kl_in_reward is off", "algorithm.kl_in_reward=true"],
    ),
    (
        "adaptive_kl_short_horizon",
        lambda t, c: [
            "algorithm.estimator=gae",
            "algorithm.kl_in_reward=true",
            "algorithm.kl_coef=0.1",
            "algorithm.kl_ctrl=adaptive",
            "algorithm.kl_horizon=2",
            "trainer.prompts_per_step=8",
            "rollout.n_samples=4",
        ],
        ["algorithm.kl_horizon=2 is invalid", "can turn negative", "set algorithm.kl_horizon to"],
    ),
    ("critic_negative_clip", lambda t, c: ["critic.value_clip=-1"], ["critic.value_clip=-1", "must be > 0"]),
    ("huge_step", lambda t, c: ["trainer.prompts_per_step=1000000000"], ["host memory", "prompts_per_step"]),
    ("huge_n_samples", lambda t, c: ["rollout.n_samples=100000000"], ["host memory", "rollout.n_samples"]),
    ("resume_not_a_checkpoint", lambda t, c: [f"trainer.resume={t}"], ["not a complete checkpoint"]),
    (  # it was an errno message without the setting
        "run_dir_is_a_file",
        lambda t, c: [f"trainer.run_dir={a_file(t)}"],
        ["trainer.run_dir=", "cannot be written: it is a file, not a folder", "Fix"],
    ),
    (
        "resume_changes_lr",
        lambda t, c: [f"trainer.run_dir={fake_checkpoint(t, c, 'train.lr=0.001')}", "trainer.resume=auto"],
        ["train.lr: 0.001 -> 1e-05", "trainer.resume_allow_changes=true"],
    ),
    (
        "resume_changes_estimator",
        lambda t, c: [
            f"trainer.run_dir={fake_checkpoint(t, c, 'algorithm.estimator=rloo')}",
            "trainer.resume=auto",
        ],
        ["algorithm.estimator: 'rloo' -> 'grpo'"],
    ),
]


@pytest.mark.parametrize("extra, needles", [c[1:] for c in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES])
def test_bad_train_input_is_one_line_error(tiny_checkpoint, tmp_path, capsys, extra, needles):
    args = extra(tmp_path, tiny_checkpoint)  # may run a first, good run (a checkpoint to resume)
    metrics = tmp_path / "run" / "metrics.jsonl"
    before = metrics.read_text() if metrics.exists() else None
    capsys.readouterr()
    rc = main(train_args(tiny_checkpoint, tmp_path / "run", *args))
    assert_one_line_error(rc, capsys.readouterr().err, needles)
    assert (metrics.read_text() if metrics.exists() else None) == before  # nothing written, nothing lost


def test_weights_that_do_not_fit_their_config_are_one_line_error(tiny_checkpoint, tmp_path, capsys):
    # found as the engines load (after the start-up log lines); it was a traceback naming no setting
    bad = changed_config(tmp_path, tiny_checkpoint, intermediate_size=128)
    rc = main(
        train_args(tiny_checkpoint, tmp_path / "run", "algorithm.estimator=gae", f"critic.model_path={bad}")
    )
    err = "\n".join(x for x in capsys.readouterr().err.splitlines() if not x.startswith("[rlloom] "))
    needles = [
        "critic.model_path=",
        "is invalid: tensor",
        "but the model expects",
        "Fix: check that config.json",
    ]
    assert_one_line_error(rc, err, needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_without_cuda_is_one_line_error(tiny_checkpoint, tmp_path, capsys):
    rc = main(train_args(tiny_checkpoint, tmp_path / "run", "cluster.device=cuda"))
    assert_one_line_error(rc, capsys.readouterr().err, ["cluster.device='cuda'", "no CUDA device"])
