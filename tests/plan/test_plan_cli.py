"""`rlloom plan` as users run it: the anchors' published layouts fit, impossible asks say so,
the search recommends a fitting layout, and bad input is one error line with exit code 2."""

from __future__ import annotations

import json

import pytest

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.plan.check import run_layout
from rlloom.plan.published import CONFIG_DIR

CONFIGS = CONFIG_DIR  # the published configs rlloom ships
VERL_TOKENS = "11680"  # verl's DeepSeek-V3 recipe: (2048 prompt + 9632 response) tokens per GPU


def plan(capsys, model: str, *args: str) -> tuple[int, dict]:
    code = main(["plan", str(CONFIGS / model), *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("model", "gpus", "check"),
    [
        ("deepseek-v3", 96, "tp=8,pp=12,ep=8,offload=1.0"),
        ("deepseek-v3", 128, "tp=8,pp=16,ep=8,offload=0.5"),
        ("deepseek-v3", 256, "tp=8,pp=16,ep=8,offload=0"),
        ("deepseek-v3", 512, "tp=1,pp=16,ep=32"),
        ("qwen3-235b-a22b", 32, "tp=4,pp=8,ep=4,offload=1.0"),
        ("qwen3-235b-a22b", 64, "tp=4,pp=8,ep=4,offload=0.5"),
        ("qwen3-235b-a22b", 128, "tp=4,pp=8,ep=4,offload=0"),
        ("qwen3-235b-a22b", 256, "tp=4,pp=8,ep=4,offload=0"),
        ("qwen3-30b-a3b", 8, "ep=8,offload=1.0"),
        ("qwen3-30b-a3b", 16, "ep=8,offload=1.0"),
        ("qwen3-30b-a3b", 32, "ep=8,offload=1.0"),
    ],
)
def test_verl_recommended_layouts_fit_on_96gb(capsys, model, gpus, check):
    code, out = plan(
        capsys, model, "--gpus", str(gpus), "--gpu-memory-gb", "96", "--max-tokens-per-gpu", VERL_TOKENS,
        "--check", check,
    )  # fmt: skip
    assert code == 0 and out["fits"], out["problems"]
    assert out["layout"]["dp"] * out["layout"]["tp"] * out["layout"]["pp"] * out["layout"]["cp"] == gpus
    assert set(out["breakdown"]) == {"params", "grads", "optimizer", "activations", "buffers"}
    assert out["peak_phase"] in ("head", "layers", "layer reduce", "reduce")
    assert out["rollout"]["weights_gb"] > 0 and out["rollout"]["kv_cache_tokens"] >= int(VERL_TOKENS)
    if out["layout"]["pp"] > 1:  # the head makes the last stage the heaviest per layer: fewer layers
        assert out["layout"]["pp_last_stage_layers"] < out["layout"]["pp_first_stage_layers"]


def test_verl_deepseek_v3_96_gpus_memory_against_its_measurement(capsys):
    code, out = plan(
        capsys, "deepseek-v3", "--gpus", "96", "--gpu-memory-gb", "96", "--max-tokens-per-gpu", VERL_TOKENS,
        "--check", "tp=8,pp=12,ep=8,offload=1.0",
    )  # fmt: skip
    # verl measured 66 GB per GPU (Megatron keeps bf16 weights; rlloom's FSDP keeps fp32 shards,
    # docs/plan.md) and 1.5 TB of host memory per node.
    assert 66 <= out["gpu_memory_gb"] <= 96
    assert out["reason"].endswith("offload 0.75 would also fit")  # verl's 1.0 has room to spare
    assert out["cpu_memory_gb_per_node"] == pytest.approx(1500, rel=0.15)


def test_slime_deepseek_r1_on_128_h100_fits(capsys):
    code, out = plan(
        capsys, "deepseek-v3", "--gpus", "128", "--gpu-memory-gb", "80", "--max-tokens-per-gpu", "16384",
        "--check", "tp=8,pp=4,cp=4,ep=32,offload=1.0",
    )  # fmt: skip
    assert code == 0 and out["fits"], out["problems"]
    assert out["cpu_memory_gb_per_node"] == pytest.approx(1450, rel=0.25)  # slime: 1.4-1.5 TB per node


def test_deepseek_v3_on_8_gpus_without_offload_does_not_fit(capsys):
    code, out = plan(capsys, "deepseek-v3", "--gpus", "8", "--gpu-memory-gb", "80", "--check", "tp=8,ep=8")
    assert code == 1 and not out["fits"]
    assert out["gpu_memory_gb"] > 1000 and "training needs" in out["problems"][0]
    assert "--gpus" in out["suggestion"] and "offload" in out["suggestion"]


def test_search_on_8_gpus_says_nothing_fits_and_how_many_gpus_would(capsys):
    code, out = plan(capsys, "deepseek-v3", "--gpus", "8", "--gpu-memory-gb", "80")
    assert code == 1 and not out["fits"]
    assert "--gpus 128" in out["suggestion"]


def test_search_recommends_the_cheapest_fitting_layout_with_a_reason(capsys):
    code, out = plan(capsys, "qwen3-8b", "--gpus", "8", "--gpu-memory-gb", "80")
    assert code == 0 and out["fits"]
    assert out["layout"] == {
        "tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 8, "offload_fraction": 0.0,
        "pp_first_stage_layers": 36, "pp_last_stage_layers": 36,
    }  # fmt: skip
    assert out["reason"].startswith("lowest estimated step time")
    assert all(a["step_seconds"] >= out["step_seconds"] for a in out["alternatives"])
    # on one small GPU the same model needs offload, and the search says so
    code, small = plan(capsys, "qwen3-8b", "--gpus", "1", "--gpu-memory-gb", "141")
    assert code == 0 and small["layout"]["offload_fraction"] > 0 and "least that fits" in small["reason"]


def test_a_critic_needs_its_memory_in_every_layout(capsys):
    _, policy_only = plan(capsys, "qwen3-8b", "--gpus", "2", "--gpu-memory-gb", "141")
    _, with_critic = plan(capsys, "qwen3-8b", "--gpus", "2", "--gpu-memory-gb", "141", "--critic")
    assert policy_only["layout"] == with_critic["layout"]
    # dp=2: half of the critic's fp32 weights and moments (12 bytes a parameter) on each GPU
    critic_gb = 12 * 7.57e9 / 2**30
    grown = with_critic["gpu_memory_gb"] - policy_only["gpu_memory_gb"]
    assert grown == pytest.approx(critic_gb / 2, rel=0.01)
    # pp=2: each stage's GPU keeps its share of the critic, by layers (cut as the policy is: the
    # first stage 20 of the 36 layers, the worst: the last holds the vocabulary head beside 16)
    check = ["--check", "pp=2"]
    _, policy_pp = plan(capsys, "qwen3-8b", "--gpus", "2", "--gpu-memory-gb", "141", *check)
    _, critic_pp = plan(capsys, "qwen3-8b", "--gpus", "2", "--gpu-memory-gb", "141", "--critic", *check)
    assert critic_pp["layout"]["pp"] == 2 and critic_pp["layout"]["pp_first_stage_layers"] == 20
    assert critic_pp["gpu_memory_gb"] - policy_pp["gpu_memory_gb"] == pytest.approx(
        critic_gb * 20 / 36, rel=0.01
    )


def test_table_output(capsys):
    assert main(["plan", str(CONFIGS / "deepseek-v3" / "config.json"), "--gpus", "96", "--gpu-memory-gb", "96",
                 "--check", "tp=8,pp=12,ep=8,offload=1"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    for word in ("layout", "GPU peak", "host", "rollout", "why", "1 MTP layer(s) not trained"):
        assert word in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "96", "--gpu-memory-gb", "96", "--check", "tp=8,pp=12,ep=7"], "ep=7 must divide"),
        (["--gpus", "96", "--gpu-memory-gb", "96", "--check", "tp=3"], "tp=3 must divide the 128"),
        (["--gpus", "10", "--gpu-memory-gb", "96", "--check", "tp=8"], "must divide --gpus 10"),
        (["--gpus", "8", "--gpu-memory-gb", "96", "--check", "tp=8,zz=1"], "unknown key 'zz'"),
        (["--gpus", "8", "--gpu-memory-gb", "96", "--check", "offload=2"], "offload=2 must be in [0, 1]"),
        (["--gpus", "0", "--gpu-memory-gb", "96"], "--gpus=0 is invalid"),
        (["--gpus", "8", "--gpu-memory-gb", "-1"], "--gpu-memory-gb=-1 is invalid"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(capsys, args, message):
    assert main(["plan", str(CONFIGS / "deepseek-v3"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlloom: error: ") and err.count("\n") == 1 and message in err


@pytest.mark.parametrize(
    "args",
    [
        ["--gpus", "eight", "--gpu-memory-gb", "80"],
        ["--gpu-memory-gb", "80"],
        ["--gpus", "8", "--gpu-memory-gb", "80", "--recompute", "some"],
    ],
)
def test_bad_command_line_is_one_error_line_and_exit_2(capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(CONFIGS / "qwen3-8b"), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("rlloom: error: plan: ") and err.count("\n") == 1


def test_missing_or_unsupported_model_is_exit_2(capsys, tmp_path):
    assert main(["plan", str(tmp_path / "nope"), "--gpus", "8", "--gpu-memory-gb", "80"]) == 2
    assert "not a folder with config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert main(["plan", str(tmp_path), "--gpus", "8", "--gpu-memory-gb", "80"]) == 2
    assert "model_type='gpt2'" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert main(["plan", str(tmp_path), "--gpus", "8", "--gpu-memory-gb", "80"]) == 2
    assert "has no 'num_attention_heads' field" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert main(["plan", str(tmp_path), "--gpus", "8", "--gpu-memory-gb", "80"]) == 2
    assert "config.json is not valid JSON (Expecting property name" in capsys.readouterr().err


def test_host_memory_per_node_is_checked(capsys):
    args = ["--gpus", "96", "--gpu-memory-gb", "96", "--max-tokens-per-gpu", VERL_TOKENS]
    check = ["--check", "tp=8,pp=12,ep=8,offload=1.0"]
    code, out = plan(capsys, "deepseek-v3", *args, *check, "--cpu-memory-gb-per-node", "1024")
    assert code == 1 and any("host memory" in p for p in out["problems"])
    code, out = plan(capsys, "deepseek-v3", *args, *check, "--cpu-memory-gb-per-node", "2048")
    assert code == 0 and out["fits"]


def test_fp8_rollout_weights(capsys):
    """--rollout-quantization fp8 (rollout.quantization): the rollout's experts at 1 + 4/128 bytes a
    parameter; refused for a dense model, as a run refuses it."""
    args = ("--gpus", "8", "--gpu-memory-gb", "80", "--check", "tp=1,pp=1,ep=8,offload=1.0")
    _, bf16 = plan(capsys, "qwen3-30b-a3b", *args)
    _, fp8 = plan(capsys, "qwen3-30b-a3b", *args, "--rollout-quantization", "fp8")

    def total(answer):  # a replica's weights (the planner shards bf16 ones over 2 GPUs here)
        return answer["rollout"]["weights_gb"] * answer["rollout"]["model_parallel"]

    assert fp8["rollout"]["model_parallel"] < bf16["rollout"]["model_parallel"]
    assert total(fp8) < 0.55 * total(bf16)
    assert main(["plan", str(CONFIGS / "qwen3-8b"), "--gpus", "8", "--gpu-memory-gb", "80",
                 "--rollout-quantization", "fp8"]) == 2  # fmt: skip
    assert "fp8 quantizes the routed experts" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "Qwen/Qwen3-8B", "llama-3.1-8b", "deepseek-v3"])
def test_plan_takes_a_shipped_model_name_and_prints_the_train_line_of_its_layout(name, capsys, tmp_path):
    """`rlloom plan NAME` reads the config rlloom ships; its `rlloom train` line, pasted after a recipe,
    gives a run whose layout (as the trainer's own memory check reads it) is the planned one."""
    gpus = "16" if name == "deepseek-v3" else "8"
    args = ["plan", name, "--gpus", gpus, "--gpu-memory-gb", "80", "--cpu-memory-gb-per-node", "2048"]
    assert main([*args, "--json"]) in (0, 1)
    answer = json.loads(capsys.readouterr().out)
    main(args)
    line = next(
        x for x in capsys.readouterr().out.splitlines() if x.startswith("train     rlloom train CONFIG ")
    )
    overrides = line.removeprefix("train     rlloom train CONFIG ").split()
    assert overrides == answer["train_overrides"] and overrides[0] == "model.path=MODEL_DIR"
    cfg = load_config("arithmetic_demo", overrides[1:])
    layout, work = run_layout(cfg)
    planned = answer["layout"]
    keys = [k for k in planned if "stage" not in k or planned["pp"] > 1]  # pp=1 reports every layer
    assert {k: getattr(layout, k) for k in keys} == {k: planned[k] for k in keys}
    assert work.max_tokens_per_gpu == 8192 and work.recompute == "full"
