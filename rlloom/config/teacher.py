"""The `teacher` section: the model on-policy distillation learns from (algorithm.estimator=opd, or
algorithm.distill_coef > 0)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class TeacherConfig:
    """A frozen teacher whose logprobs of the sampled tokens the student is pulled toward (reverse KL).
    It lives on the training ranks like the reference model: forward-only, in the compute dtype, no
    optimizer, in the training layout (FSDP, parallel.tp/pp/cp/ep)."""

    path: str = ""
    """Hugging Face folder of the teacher, a causal LM with the student's tokenizer (the same tokens
    under the same ids; its vocab_size at least the student's, which padding may exceed). Needed by algorithm.estimator=opd
    and algorithm.distill_coef > 0; empty: no teacher."""
    offload: bool = False
    """Keep the teacher's weights on the host between its forwards (moved to the device for each
    step's teacher forward, back after it): frees its memory for generation and training at the cost
    of two copies a step."""
