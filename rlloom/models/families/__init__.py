"""One home per model family (torchtitan's per-model folders are the example): each module here
holds a family's reading of config.json (its `ModelArgs` fields), its Hugging Face weight names and
its tensor-parallel plan (`tp_plan.py`; training and rollout TP both read it), and `FAMILIES`
registers it. Adding a family built from the existing blocks (GQA or MLA attention, dense MLP, MoE)
is a module here plus its line below.
"""

from __future__ import annotations

from rlloom.models.families.base import Family, FamilyArgs, WeightNames
from rlloom.models.families.deepseek_v3 import DEEPSEEK_V3
from rlloom.models.families.dense import DENSE
from rlloom.models.families.mixtral import MIXTRAL
from rlloom.models.families.qwen2_5_vl import QWEN2_5_VL
from rlloom.models.families.qwen3_moe import QWEN3_MOE
from rlloom.models.families.qwen3_vl import QWEN3_VL

FAMILIES: dict[str, Family] = {
    model_type: family
    for family in (DENSE, QWEN3_MOE, MIXTRAL, DEEPSEEK_V3, QWEN2_5_VL, QWEN3_VL)
    for model_type in family.model_types
}
"""config.json `model_type` -> its family."""

__all__ = ["FAMILIES", "Family", "FamilyArgs", "WeightNames"]
