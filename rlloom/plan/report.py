"""`rlloom plan`: read a model's config.json (a folder, the file, or the name of one rlloom ships:
plan/published.py), evaluate (`--check`) or search layouts, print a table or one JSON object, with
the `rlloom train` overrides that run the layout chosen. Exit codes: 0 a layout fits (or was
found), 1 nothing fits, 2 bad input.

JSON fields (a contract, issue 18): fits, gpu_memory_gb, cpu_memory_gb_per_node, layout {tp, pp, cp,
ep, dp, offload_fraction, pp_first_stage_layers, pp_last_stage_layers}, breakdown {params, grads,
optimizer, activations, buffers}, rollout {model_parallel, weights_gb, kv_cache_gb,
kv_cache_tokens}; also peak_phase, reason, step_seconds, stage_peaks_gb, problems, suggestion,
alternatives, train_overrides (the dotted `rlloom train` overrides of the chosen layout), vision_tower
(a vision-language model's tower: params, placement, patches_per_gpu, activations_gb; null otherwise).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlloom.config import ConfigError
from rlloom.config.train import LORA_TARGET_NAMES, lora_targets_valid
from rlloom.models.args import ModelArgs
from rlloom.models.fp8 import FP8_NEEDS_EXPERTS
from rlloom.plan.counts import ModelCosts, lora_params, model_costs, value_model_params
from rlloom.plan.inputs import Hardware, Layout, Workload
from rlloom.plan.memory import Estimate
from rlloom.plan.overrides import train_overrides
from rlloom.plan.published import published_config, published_names
from rlloom.plan.search import Candidate, best_split, fit_layout, gpus_needed, search, step_cost

CHECK_KEYS = ("tp", "pp", "cp", "ep", "offload")


def model_config_file(model: str, flag: str = "MODEL") -> Path:
    """The config.json that MODEL (or the model of `flag`) names: a folder's, the file itself, or a
    shipped model's."""
    path = Path(model)
    file = path / "config.json" if path.is_dir() else path
    if file.is_file():
        return file
    shipped = published_config(model) if not path.exists() else None
    if shipped is None:
        raise ConfigError(
            f"{flag}={model!r} is invalid: not a folder with config.json, a config.json file, nor a model whose "
            f"config rlloom ships ({', '.join(published_names())}). Fix: pass a Hugging Face model folder or "
            "its config.json (docs/plan.md says where to get one offline), or one of those names."
        )
    return shipped


def model_folder_setting(model: str) -> str:
    """The `model.path` value of the printed `rlloom train` line: MODEL's folder, or MODEL_DIR (the
    weights to download) for a shipped config."""
    path = Path(model)
    if path.exists():
        return str(path if path.is_dir() else path.parent)
    return "MODEL_DIR"


def load_costs(model: str, flag: str = "MODEL") -> tuple[ModelCosts, dict[str, Any]]:
    """Costs and the raw config of a Hugging Face folder, a config.json file or a shipped model's
    name (no weights read)."""
    file = model_config_file(model, flag)
    try:
        raw = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{flag}={model!r} is invalid: {file} is not valid JSON ({e}). Fix: pass the model's Hugging Face "
            "config.json."
        ) from None
    try:
        return model_costs(ModelArgs.from_hf_config(raw)), raw
    except KeyError as e:
        raise ConfigError(
            f"{flag}={model!r} is invalid: its config.json has no {e.args[0]!r} field. "
            "Fix: pass the model's complete Hugging Face config.json."
        ) from None
    except ValueError as e:  # unsupported architecture
        raise ConfigError(f"{flag}={model!r}: {e}") from None


def parse_check(text: str, gpus: int, costs: ModelCosts) -> Layout:
    """`tp=8,pp=12,cp=1,ep=8,offload=1.0` -> Layout (dp = gpus / (tp * pp * cp)); ConfigError if illegal."""
    values: dict[str, float] = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "offload": 0.0}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in CHECK_KEYS:
            raise ConfigError(
                f"--check {item!r} is invalid: unknown key {key!r}. Fix: use keys {', '.join(CHECK_KEYS)}, "
                "e.g. --check tp=8,pp=12,cp=1,ep=8,offload=1.0."
            )
        try:
            values[key] = float(value) if key == "offload" else int(value)
        except ValueError:
            raise ConfigError(
                f"--check {item!r} is invalid: {key} must be a number. Fix: e.g. {key}=8."
            ) from None
    tp, pp, cp, ep = (int(values[k]) for k in ("tp", "pp", "cp", "ep"))
    offload = values["offload"]
    _require(min(tp, pp, cp, ep) >= 1, text, "tp, pp, cp and ep must be >= 1", "use 1 to disable one")
    _require(0 <= offload <= 1, text, f"offload={offload:g} must be in [0, 1]", "use a fraction such as 0.5")
    _require(
        gpus % (tp * pp * cp) == 0,
        text,
        f"tp*pp*cp={tp * pp * cp} must divide --gpus {gpus} (dp is the quotient)",
        "pick degrees whose product divides the GPU count",
    )
    dp = gpus // (tp * pp * cp)
    _require(
        not costs.tower_params or tp * pp * cp == 1,
        text,
        "a vision-language model trains data parallel only (tp = pp = cp = 1: the sharding plans and "
        "stages cover the decoder, not the vision tower)",
        "use tp=1,pp=1,cp=1 (offload may vary)",
    )
    _require(
        costs.num_heads % tp == 0 and costs.num_kv_heads % tp == 0,
        text,
        f"tp={tp} must divide the {costs.num_heads} attention heads and {costs.num_kv_heads} KV heads",
        "pick a smaller tp",
    )
    _require(
        pp <= len(costs.layers), text, f"pp={pp} exceeds the {len(costs.layers)} layers", "pick a smaller pp"
    )
    if costs.num_experts:
        _require(
            costs.num_experts % ep == 0 and (tp * cp * dp) % ep == 0,
            text,
            f"ep={ep} must divide the {costs.num_experts} experts and tp*cp*dp={tp * cp * dp}",
            "pick an ep that divides both",
        )
    else:
        _require(ep == 1, text, "ep must be 1 for a dense model", "drop ep")
    return Layout(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, offload_fraction=offload)


DEFAULT_MAX_PIXELS = 12_845_056
"""Pixels of the largest picture transformers' Qwen2-VL image processor writes when the model folder
names no size (`max_pixels`: 65,536 patches of 14 x 14, 16,384 image tokens)."""


def picture_patches(model: str, raw: dict[str, Any]) -> int:
    """Patches of the largest picture MODEL's image processor writes: its folder's
    preprocessor_config.json `size.longest_edge` (or `max_pixels`) pixels, else `DEFAULT_MAX_PIXELS`,
    over the tower's patch area (a picture's two frames make one temporal patch); 0 for a text model."""
    vision = ModelArgs.from_hf_config(raw).vision
    if vision is None:
        return 0
    folder = Path(model) if Path(model).is_dir() else Path(model).parent
    file = folder / "preprocessor_config.json"
    pixels = DEFAULT_MAX_PIXELS
    if Path(model).exists() and file.is_file():
        processor = json.loads(file.read_text())
        pixels = (processor.get("size") or {}).get("longest_edge") or processor.get("max_pixels") or pixels
    return int(pixels) // vision.patch_size**2


def vision_summary(costs: ModelCosts, work: Workload) -> dict[str, Any] | None:
    """Where the vision tower lives and what it costs (the JSON's `vision_tower`); None: a text model."""
    if not costs.tower_params:
        return None
    return {
        "params": costs.tower_params,
        "placement": "first pipeline stage, in the root unit with the embedding: FSDP-sharded over dp "
        "(data parallel only), whole on every rank's forward",
        "patches_per_gpu": work.image_patches_per_gpu,
        "activations_gb": round(
            work.compute_bytes * work.image_patches_per_gpu * costs.tower_act_per_patch / 2**30, 3
        ),
    }


def _lora_params(args: Any, raw: dict[str, Any]) -> int:
    """The adapters' parameter count of `--lora-rank` on `--lora-target-modules` (0 without LoRA)."""
    if args.lora_rank < 0:
        raise ConfigError(
            f"--lora-rank={args.lora_rank} is invalid: must be >= 0. Fix: e.g. 16, or 0 for none."
        )
    if not args.lora_rank:
        return 0
    targets = args.lora_target_modules
    if not lora_targets_valid(targets):
        raise ConfigError(
            f"--lora-target-modules={targets!r} is invalid: must be all-linear or a comma list of "
            f"{', '.join(LORA_TARGET_NAMES)}. Fix: use all-linear, or e.g. q_proj,v_proj."
        )
    adapters = lora_params(ModelArgs.from_hf_config(raw), args.lora_rank, targets)
    if not adapters:
        raise ConfigError(
            f"--lora-target-modules={targets!r} is invalid: it matches no projection of {args.model}. "
            "Fix: use all-linear, or names this model has."
        )
    return adapters


def _require(ok: bool, text: str, rule: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"--check {text!r} is invalid: {rule}. Fix: {fix}.")


@dataclass(frozen=True, slots=True)
class PlanAnswer:
    chosen: Candidate
    fits: bool
    reason: str
    alternatives: list[Candidate]
    suggestion: str = ""


def plan(costs: ModelCosts, hw: Hardware, work: Workload, check: Layout | None) -> PlanAnswer:
    """Evaluate `check`, or search; the answer says why and, when nothing fits, what would."""
    if check is not None:
        est = best_split(costs, check, hw, work)  # the user fixed degrees and offload
        cand = Candidate(est, step_cost(costs, est, hw, work))
        reason = f"the layout given with --check; estimated step {cand.cost.seconds:.2f} s"
        if not est.fits:
            reason += "; it does not fit: " + "; ".join(est.problems)
        elif (least := fit_layout(costs, check, hw, work).layout.offload_fraction) < check.offload_fraction:
            reason += f"; offload {least:g} would also fit"
        return PlanAnswer(cand, est.fits, reason, [], "" if est.fits else _suggest(costs, est, hw, work))
    result = search(costs, hw, work)
    if result.best is None:
        closest = result.closest
        reason = "no legal layout fits; closest: " + "; ".join(closest.estimate.problems)
        return PlanAnswer(closest, False, reason, [], _suggest(costs, closest.estimate, hw, work))
    return PlanAnswer(result.best, True, _why(result.ranked), result.ranked[1:6])


def _why(ranked: list[Candidate]) -> str:
    best = ranked[0]
    parts = ", ".join(f"{k} {v:.2f}" for k, v in best.cost.parts.items() if v >= 0.005)
    text = f"lowest estimated step time of the {len(ranked)} fitting layouts: {best.cost.seconds:.2f} s ({parts})"
    if len(ranked) > 1:
        nxt = ranked[1]
        slower = nxt.cost.seconds / best.cost.seconds - 1
        text += f"; next best {nxt.estimate.layout.short()} is {100 * slower:.0f}% slower"
    if best.estimate.layout.offload_fraction:
        text += f"; offload {best.estimate.layout.offload_fraction:g} is the least that fits"
    return text


def _suggest(costs: ModelCosts, est: Estimate, hw: Hardware, work: Workload) -> str:
    tips = []
    if est.layout.offload_fraction < 1:
        tips.append("a larger offload fraction")
    need = gpus_needed(costs, hw, work)
    if need is not None:
        tips.append(f"--gpus {need} (the fewest, doubling, on which a layout fits)")
    tips.append(f"GPUs with at least {est.gpu_memory_gb / 0.95 + 2:.0f} GB for this layout")
    if work.recompute != "full":
        tips.append("--recompute full")
    return "would fit with " + ", or ".join(tips)


def to_json(answer: PlanAnswer, costs: ModelCosts, work: Workload, overrides: list[str]) -> dict[str, Any]:
    est = answer.chosen.estimate
    lay = est.layout
    return {
        "fits": answer.fits,
        "gpu_memory_gb": round(est.gpu_memory_gb, 2),
        "cpu_memory_gb_per_node": round(est.cpu_memory_gb_per_node, 1),
        "layout": {
            "tp": lay.tp,
            "pp": lay.pp,
            "cp": lay.cp,
            "ep": lay.ep,
            "dp": lay.dp,
            "offload_fraction": lay.offload_fraction,
            "pp_first_stage_layers": lay.pp_first_stage_layers or len(costs.layers),
            "pp_last_stage_layers": lay.pp_last_stage_layers or len(costs.layers),
        },
        "breakdown": {k: round(v, 2) for k, v in asdict(est.breakdown).items()},
        "peak_phase": est.peak_phase,
        "rollout": None if est.rollout is None else {k: _round(v) for k, v in asdict(est.rollout).items()},
        "stage_peaks_gb": [round(x, 2) for x in est.stage_peaks_gb],
        "lora_params": int(work.lora_params),
        "step_seconds": round(answer.chosen.cost.seconds, 3),
        "reason": answer.reason,
        "problems": list(est.problems),
        "suggestion": answer.suggestion,
        "alternatives": [
            {
                "layout": c.estimate.layout.short(),
                "gpu_memory_gb": round(c.estimate.gpu_memory_gb, 2),
                "step_seconds": round(c.cost.seconds, 3),
            }
            for c in answer.alternatives
        ],
        "train_overrides": overrides,
        "model": {
            "params": costs.total_params,
            "expert_params": costs.expert_params,
            "layers": len(costs.layers),
        },
        "vision_tower": vision_summary(costs, work),
    }


def _round(v: float | int) -> float | int:
    return round(v, 2) if isinstance(v, float) else v


def format_table(
    answer: PlanAnswer,
    costs: ModelCosts,
    raw: dict[str, Any],
    hw: Hardware,
    work: Workload,
    overrides: list[str],
) -> str:
    est = answer.chosen.estimate
    bd = est.breakdown
    mtp = raw.get("num_nextn_predict_layers") or 0
    lines = [
        f"model     {raw.get('model_type')}: {costs.total_params / 1e9:.1f}B parameters "
        f"({costs.expert_params / 1e9:.1f}B in routed experts), {len(costs.layers)} layers"
        + (f"; {mtp} MTP layer(s) not trained" if mtp else "")
        + (
            f"; LoRA: {work.lora_params / 1e6:.1f}M adapter parameters trained, the rest frozen"
            if work.lora_params
            else ""
        ),
        f"cluster   {hw.gpus} x {hw.gpu_memory_gb:g} GB GPUs, {hw.gpus_per_node} per node; "
        f"{work.max_tokens_per_gpu} tokens per GPU, recompute {work.recompute}",
        f"layout    {est.layout.short()}",
        f"fits      {'yes' if answer.fits else 'NO'}",
        f"GPU peak  {est.gpu_memory_gb:.1f} GB of {hw.usable_gpu_gb:.1f} GB usable "
        f"(stages: {' '.join(f'{x:.0f}' for x in est.stage_peaks_gb)}; at the {est.peak_phase} phase)",
        f"  params {bd.params:.1f}  grads {bd.grads:.1f}  optimizer {bd.optimizer:.1f}  "
        f"activations {bd.activations:.1f}  buffers {bd.buffers:.1f}",
        f"host      {est.cpu_memory_gb_per_node:.0f} GB per node",
    ]
    if (tower := vision_summary(costs, work)) is not None:
        lines.append(
            f"vision    tower {tower['params'] / 1e6:.1f}M parameters on the first stage (root unit, with the "
            f"embedding; data parallel only); activations {tower['activations_gb']:.2f} GB for "
            f"{tower['patches_per_gpu']} patches a GPU"
        )
    if est.rollout is not None:
        r = est.rollout
        lines.append(
            f"rollout   weights {r.weights_gb:.1f} GB per GPU over {r.model_parallel} GPUs, "
            f"KV cache {r.kv_cache_gb:.1f} GB ({r.kv_cache_tokens} tokens)"
        )
    lines.append(f"why       {answer.reason}")
    if answer.suggestion:
        lines.append(f"to fit    {answer.suggestion}")
    for c in answer.alternatives:
        lines.append(
            f"  also    {c.estimate.layout.short()}: {c.estimate.gpu_memory_gb:.1f} GB, {c.cost.seconds:.2f} s"
        )
    lines.append(f"train     rlloom train CONFIG {' '.join(overrides)}")
    note = "CONFIG: your recipe or YAML file" + (
        ", MODEL_DIR: the model's folder" if "model.path=MODEL_DIR" in overrides else ""
    )
    lines.append(f"          ({note})")
    return "\n".join(lines)


def run_plan(args: Any) -> int:
    """The `rlloom plan` command on parsed arguments; prints the answer, returns the exit code."""
    for flag, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node)):
        if value < 1:
            raise ConfigError(f"{flag}={value} is invalid: must be >= 1. Fix: pass a positive GPU count.")
    if args.gpu_memory_gb <= 0:
        raise ConfigError(f"--gpu-memory-gb={args.gpu_memory_gb:g} is invalid: must be > 0. Fix: e.g. 80.")
    if args.cpu_memory_gb_per_node < 0:
        raise ConfigError(
            f"--cpu-memory-gb-per-node={args.cpu_memory_gb_per_node:g} is invalid: must be >= 0. "
            "Fix: e.g. 2048, or 0 to skip the host check."
        )
    if args.max_tokens_per_gpu < 1:
        raise ConfigError(
            f"--max-tokens-per-gpu={args.max_tokens_per_gpu} is invalid: must be >= 1. Fix: e.g. 8192."
        )
    if args.images_per_gpu < 0:
        raise ConfigError(
            f"--images-per-gpu={args.images_per_gpu} is invalid: must be >= 0. Fix: e.g. 4 (pictures in one "
            "micro-batch of one GPU)."
        )
    costs, raw = load_costs(args.model)
    adapters = _lora_params(args, raw)
    hw = Hardware(
        gpus=args.gpus,
        gpu_memory_gb=args.gpu_memory_gb,
        gpus_per_node=args.gpus_per_node,
        cpu_memory_gb_per_node=args.cpu_memory_gb_per_node,
    )
    if args.rollout_quantization != "none" and costs.expert_params == 0:
        raise ConfigError(
            f"--rollout-quantization={args.rollout_quantization} is invalid for {args.model}: "
            f"{FP8_NEEDS_EXPERTS}. Fix: leave it at none."
        )
    work = Workload(
        max_tokens_per_gpu=args.max_tokens_per_gpu,
        recompute=args.recompute,
        image_patches_per_gpu=args.images_per_gpu * picture_patches(args.model, raw),
        rollout_quantization=args.rollout_quantization,
        critic_params=value_model_params(costs) if args.critic else 0.0,
        lora_params=adapters,
        teacher_params=load_costs(args.teacher, "--teacher")[0].total_params if args.teacher else 0.0,
        teacher_offload=args.teacher_offload,
        reward_model_params=value_model_params(load_costs(args.reward_model, "--reward-model")[0])
        if args.reward_model
        else 0.0,
    )
    check = parse_check(args.check, args.gpus, costs) if args.check is not None else None
    answer = plan(costs, hw, work, check)
    overrides = train_overrides(
        answer.chosen.estimate.layout,
        work,
        model_path=model_folder_setting(args.model),
        critic=args.critic,
        lora_rank=args.lora_rank,
        lora_targets=args.lora_target_modules,
        teacher_offload=bool(args.teacher) and args.teacher_offload,
    )
    if args.json:
        print(json.dumps(to_json(answer, costs, work, overrides), indent=2))
    else:
        print(format_table(answer, costs, raw, hw, work, overrides))
    return 0 if answer.fits else 1
