"""The `rlloom train` overrides that run a planned layout: `rlloom plan` prints them as one line to
copy, and `plan/check.run_layout` reads the same settings back from a run's config."""

from __future__ import annotations

from rlloom.plan.inputs import Layout, Workload

ACTIVATION_CHECKPOINTING = {"full": "full", "none": "off"}
"""The planner's --recompute -> train.activation_checkpointing (`selective` has no rlloom setting:
the line then keeps the run's own)."""


def train_overrides(
    layout: Layout,
    work: Workload,
    *,
    model_path: str,
    critic: bool,
    lora_rank: int,
    lora_targets: str,
    teacher_offload: bool = False,
) -> list[str]:
    """Dotted overrides that give a run `layout` under `work` (the model's own settings aside):
    workers, parallel degrees and stage split, optimizer offload, micro-batch tokens, recompute,
    rollout quantization, LoRA, the critic and the teacher's offload. Degrees of 1 and unset options are left out."""
    out = [f"model.path={model_path}"]
    if layout.world > 1:  # several processes need Ray (cluster.num_workers = pp x dp x cp x tp)
        out += ["cluster.mode=ray", f"cluster.num_workers={layout.world}"]
    out += [
        f"parallel.{k}={v}"
        for k, v in (("tp", layout.tp), ("pp", layout.pp), ("cp", layout.cp), ("ep", layout.ep))
        if v > 1
    ]
    if layout.pp > 1:
        for key in ("pp_first_stage_layers", "pp_last_stage_layers"):
            if getattr(layout, key):
                out.append(f"parallel.{key}={getattr(layout, key)}")
    if layout.cp > 1:  # context parallelism cuts sequences that shared prompts would pack together
        out.append("train.share_prompts=false")
    if layout.offload_fraction:
        out += [
            "train.optimizer_offload=true",
            f"train.optimizer_offload_fraction={layout.offload_fraction:g}",
        ]
    out.append(f"train.max_tokens_per_micro_batch={work.max_tokens_per_gpu}")
    if work.recompute in ACTIVATION_CHECKPOINTING:
        out.append(f"train.activation_checkpointing={ACTIVATION_CHECKPOINTING[work.recompute]}")
    if work.rollout_quantization != "none":
        out.append(f"rollout.quantization={work.rollout_quantization}")
    if lora_rank:
        out += [f"train.lora_rank={lora_rank}", f"train.lora_target_modules={lora_targets}"]
    if critic:
        out.append("algorithm.estimator=gae")
    if teacher_offload:
        out.append("teacher.offload=true")
    return out
