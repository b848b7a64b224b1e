"""The `model` section: which checkpoint the policy starts from, and its compute dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str = "smollm2-135m-instruct"
    """Hugging Face checkpoint folder, or the embedded model name `smollm2-135m-instruct`."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype: `auto` is float32 on CPU and bfloat16 on GPU."""
