"""Block-wise FP8 Hugging Face checkpoints (DeepSeek-V3's and R1's as published, Qwen3's `-FP8`
releases), read into a bf16/fp32 model.

Their config.json has `quantization_config: {"quant_method": "fp8", "weight_block_size": [128, 128],
...}`; every quantized linear weight `X.weight` is float8 (e4m3) with an fp32 `X.weight_scale_inv`
of one scale per block of 128 x 128 weights (the last row and column blocks may be partial):

    w[i, j] = q[i, j] * scale_inv[i // 128, j // 128]

(the rule of DeepSeek-V3's `weight_dequant` and of transformers' fine-grained FP8). Embeddings,
norms, routers and the lm head stay in bf16. rlloom trains in bf16 with fp32 masters, so a
checkpoint is dequantized as it is read (`dequantized`), and the model remembers its config without
`quantization_config`: what it saves is the unquantized model. Other schemes (per-tensor FP8, GPTQ,
AWQ, compressed-tensors) are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


def block_fp8_config(cfg: dict[str, Any], where: str) -> tuple[int, int] | None:
    """(rows, columns) of a block-wise FP8 checkpoint's scale blocks; None when config.json has no
    `quantization_config`. Raises ValueError for any other quantization (`where` names the file)."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "?")
    block = quant.get("weight_block_size")
    if method != "fp8" or not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(
            f"{where} has quantization_config {{quant_method: {method!r}, weight_block_size: {block!r}}}; "
            "rlloom reads unquantized weights and block-wise FP8 (quant_method 'fp8' with a weight_block_size "
            "of two positive ints, as DeepSeek-V3 and Qwen3-FP8 publish). Fix: dequantize the checkpoint to "
            "bf16 first, or use its bf16 release."
        )
    return int(block[0]), int(block[1])


def unquantized_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json as the dequantized model's: without `quantization_config`."""
    return {k: v for k, v in cfg.items() if k != "quantization_config"}


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 w[i, j] = q[i, j] * scale_inv[i // block[0], j // block[1]] for a 2-D float8 `q`."""
    rows, cols = q.shape
    br, bc = block
    scales = scale_inv.float().repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return q.float() * scales


def dequantized(
    named_tensors: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each float8 `X.weight` replaced by its fp32 dequantization (with
    `X.weight_scale_inv`, which is consumed) and the rest passed through. A weight and its scale may
    come in either order and from different files; one without the other raises ValueError."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name.endswith(SCALE_SUFFIX):
            weight_name = name[: -len(SCALE_SUFFIX)]
            if weight_name in weights:
                yield weight_name, _dequantize(weight_name, weights.pop(weight_name), tensor, block)
            else:
                scales[weight_name] = tensor
        elif tensor.dtype in FP8_DTYPES:
            if name in scales:
                yield name, _dequantize(name, tensor, scales.pop(name), block)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    if weights or scales:
        lonely = [f"{n} (no {n}{SCALE_SUFFIX})" for n in weights] + [
            f"{n}{SCALE_SUFFIX} (no {n})" for n in scales
        ]
        raise ValueError(
            f"FP8 checkpoint: {len(lonely)} tensor(s) without their pair: {', '.join(sorted(lonely)[:4])}. "
            "Fix: check that every safetensors file of the checkpoint is present and listed in its index."
        )


def _dequantize(name: str, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    if q.dim() != 2:
        raise ValueError(
            f"FP8 tensor {name!r} has shape {list(q.shape)}: block-wise FP8 weights are 2-D. "
            "Fix: dequantize this checkpoint with its publisher's tool."
        )
    want = [math.ceil(q.shape[0] / block[0]), math.ceil(q.shape[1] / block[1])]
    if list(scale_inv.shape) != want:
        raise ValueError(
            f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)} but a {list(q.shape)} weight in "
            f"{block[0]} x {block[1]} blocks needs {want}. Fix: check weight_block_size in config.json."
        )
    return dequantize_blocks(q, scale_inv, block)
