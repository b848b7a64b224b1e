"""Vision-language rollout and training throughput: Qwen2.5-VL with random weights.

GPU (default): the Qwen2.5-VL-7B shape (28 decoder layers, hidden 3584, 28 heads, 4 KV heads,
vocab 152064; a 32-block vision tower of width 1280, window attention but in blocks 7/15/23/31),
bf16, transformers' own random initialisation copied into the native model.
  - rollout: 64 prompts, each one `--image-size` picture (448 -> 256 image tokens) between a little
    text, n = 8 samples, `--new` tokens (ignore_eos, T = 1): output tokens/s of the native engine
    (the tower runs once per prompt) against transformers' generate of the same batch
    (num_return_sequences = 8) in the same run;
  - training: forward + backward of the native model (tower included, no optimizer step) on a
    packed stream of 8 image documents with their prompts and `--new` response tokens; tokens/s
    and MFU against the dense bf16 peak (989 TFLOP/s; the decoder's FLOPs by the usual 6N + attention
    count, the tower's as 6 x its parameters per patch plus its bidirectional attention).
`--tiny`: the tests' tiny random config on the CPU in fp32, a few prompts: a smoke run of the script.

    python benchmarks/bench_vlm.py              # needs a CUDA device (one H200)
    python benchmarks/bench_vlm.py --tiny       # CPU smoke run, seconds
"""

from __future__ import annotations

import argparse
import time

import torch

from rlloom.data.images import ImageInputs
from rlloom.engines.rollout.native import NativeEngine, SamplingParams
from rlloom.models.checkpoint import build_model
from rlloom.models.mrope import mrope_positions
from rlloom.observability.mfu import mfu, transformer_flops_per_token

QWEN2_5_VL_7B = {
    "model_type": "qwen2_5_vl",
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "text_config": {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
        "mrope_section": [16, 24, 24]}, "bos_token_id": None, "eos_token_id": None,
    },
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
}  # fmt: skip
QWEN2_5_VL_3B = QWEN2_5_VL_7B | {
    "tie_word_embeddings": True,
    "text_config": QWEN2_5_VL_7B["text_config"]
    | {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
       "num_attention_heads": 16, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "vision_config": QWEN2_5_VL_7B["vision_config"] | {"out_hidden_size": 2048},
}  # fmt: skip
"""Qwen2.5-VL-3B's shape (the 7B's tower, a 36-layer decoder of width 2048, tied embeddings): the
training step's model in `bench_train.py --vl` (fp32 master weights and AdamW fit one H200)."""
TINY = QWEN2_5_VL_7B | {
    "image_token_id": 290,
    "video_token_id": 291,
    "vision_start_token_id": 288,
    "vision_end_token_id": 289,
    "text_config": QWEN2_5_VL_7B["text_config"]
    | {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2,
       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
    "vision_config": QWEN2_5_VL_7B["vision_config"]
    | {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
       "window_size": 56, "fullatt_block_indexes": [1]},
}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_to_native_name(name: str) -> str:
    """A live transformers 5 model's parameter name as the checkpoint (and rlloom) has it."""
    return name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")


def random_models(config: dict, device: torch.device, dtype: torch.dtype):  # noqa: ANN201
    """(native model, transformers model) with the same random weights (transformers' initialisation)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from rlloom.models import load_hf_tensors

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        hf = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config)).eval()
    torch.set_default_dtype(previous)
    native = build_model(config, dtype=dtype, device=device, fused_projections=True)
    load_hf_tensors(native, ((hf_to_native_name(k), v) for k, v in hf.state_dict().items()))
    return native.eval(), hf


def image_prompts(
    config: dict, num: int, image_size: int, seed: int = 0
) -> tuple[list[list[int]], list[ImageInputs]]:
    """`num` prompts of one random picture each, processed by transformers' own image processor."""
    import numpy as np
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    gen = np.random.default_rng(seed)
    image, start, end = (config[f"{k}_token_id"] for k in ("image", "vision_start", "vision_end"))
    text_vocab = min(1000, config["text_config"]["vocab_size"] - 20)  # below the special tokens
    side = image_size * image_size
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": side, "longest_edge": side})
    prompts, images = [], []
    for _ in range(num):
        pic = Image.fromarray(gen.integers(0, 255, (image_size, image_size, 3), dtype=np.uint8))
        out = processor(images=[pic], return_tensors="pt")
        t, h, w = out["image_grid_thw"][0].tolist()
        text = gen.integers(0, text_vocab, 24).tolist()
        prompts.append(text[:16] + [start] + [image] * (t * h * w // 4) + [end] + text[16:])
        images.append(ImageInputs(out["pixel_values"], out["image_grid_thw"]))
    return prompts, images


def bench_rollout(native, prompts, images, n: int, new: int, device: torch.device) -> list[dict[str, float]]:  # noqa: ANN001
    """Two runs of the batch on one engine (as an RL run reuses it every step): the first compiles
    the decode layers and captures its CUDA graphs, the second is the steady state."""
    engine = NativeEngine(native, max_model_len=len(prompts[0]) + new + 16, kv_cache_memory_gb=40.0 if
                          device.type == "cuda" else 0.05, max_num_seqs=len(prompts) * n, seed=0)  # fmt: skip
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new, ignore_eos=True)
    runs = []
    for _ in range(2):
        sync(device)
        start = time.perf_counter()
        out = engine.generate(prompts, params, images)
        sync(device)
        runs.append({"s": time.perf_counter() - start, "tokens": sum(len(c.token_ids) for c in out)})
    return runs


def bench_hf(hf, prompts, images, n: int, new: int, device: torch.device) -> dict[str, float]:  # noqa: ANN001
    ids = torch.tensor(prompts, device=device)  # one picture size: every prompt has the same length
    pixels = torch.cat([im.pixel_values for im in images]).to(device, next(hf.parameters()).dtype)
    grid = torch.cat([im.grid_thw for im in images]).to(device)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == hf.config.image_token_id).int(),
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
            max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
        )  # fmt: skip
    sync(device)
    return {"s": time.perf_counter() - start, "tokens": (out.shape[1] - ids.shape[1]) * out.shape[0]}


def bench_train(native, prompts, images, new: int, device: torch.device, repeats: int) -> dict[str, float]:  # noqa: ANN001
    """Forward + backward of a packed stream of the prompts with `new` random response tokens each."""
    vision = native.args.vision
    gen = torch.Generator().manual_seed(0)
    docs = [p + torch.randint(0, 256, (new,), generator=gen).tolist() for p in prompts]
    positions = []
    for doc, im in zip(docs, images):
        head = mrope_positions(doc[: len(doc) - new], im.grid_thw.tolist(), vision)
        tail = torch.arange(len(doc) - new, len(doc)) + int(head.max()) + 1 - (len(doc) - new)
        positions.append(torch.cat([head, tail.expand(3, -1)], dim=1))
    lens = [len(d) for d in docs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    ids = torch.tensor(sum(docs, []), device=device)
    pos = torch.cat(positions, dim=1).to(device)
    dtype = next(native.parameters()).dtype
    pixels = torch.cat([im.pixel_values for im in images]).to(device, dtype)
    grid = torch.cat([im.grid_thw for im in images])
    native.train().requires_grad_(True)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        sync(device)
        start = time.perf_counter()
        h = native.hidden_states(ids, position_ids=pos, cu_seqlens=cu, max_seqlen=max(lens), pixel_values=pixels,
                                 image_grid_thw=grid)  # fmt: skip
        (h @ native.lm_head_weight.T).float().logsumexp(-1).mean().backward()
        sync(device)
        times.append(time.perf_counter() - start)
        native.zero_grad(set_to_none=True)
    seconds = min(times[1:])
    a = native.args
    embedding = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
    tower = sum(p.numel() for p in native.visual.parameters())
    decoder = sum(p.numel() for p in native.parameters()) - tower - embedding
    text_flops = sum(
        n * transformer_flops_per_token(decoder, a.num_layers, a.num_heads * a.head_dim, n) for n in lens
    )
    flops = text_flops + tower_flops(native, grid)
    return {"s": seconds, "tokens": sum(lens), "mfu": mfu(1, seconds, flops)}


def tower_flops(native, grid: torch.Tensor, backward: bool = True) -> float:  # noqa: ANN001
    """FLOPs of the vision tower on pictures of `grid` [I, 3]: 6 x its parameters per patch (2 without
    the backward) plus its bidirectional attention over a window (the full-attention blocks counted
    as windows too: a lower bound)."""
    v = native.args.vision
    params = sum(p.numel() for p in native.visual.parameters())
    window = (v.window_size // v.patch_size) ** 2
    per_patch = transformer_flops_per_token(
        params, v.depth, v.hidden_size, window, causal=False, backward=backward
    )
    return int(grid.prod(-1).sum()) * per_patch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny config on the CPU (smoke run)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--train-docs", type=int, default=8)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        config, device, dtype = TINY, torch.device("cpu"), torch.float32
        args.prompts, args.n, args.new, args.image_size, args.train_docs = 3, 2, 4, 56, 2
    else:
        config, device, dtype = QWEN2_5_VL_7B, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    native, hf = random_models(config, device, dtype)
    prompts, images = image_prompts(config, args.prompts, args.image_size)
    first, steady = bench_rollout(native, prompts, images, args.n, args.new, device)
    rows = [("native engine", steady), ("native, first run", first)]
    if not args.skip_hf:
        rows.append(("transformers generate", bench_hf(hf, prompts, images, args.n, args.new, device)))
    del hf
    print(
        f"rollout: {args.prompts} image prompts x n={args.n}, {args.new} new tokens, {len(prompts[0])}-token prompts"
    )
    for name, r in rows:
        print(f"  {name:24s} {r['tokens'] / r['s']:10.1f} tok/s  ({r['tokens']} tokens in {r['s']:.2f} s)")
    train = bench_train(
        native, prompts[: args.train_docs], images[: args.train_docs], args.new, device, repeats=3
    )
    print(f"train forward+backward: {train['tokens']} tokens in {train['s']:.3f} s, "
          f"{train['tokens'] / train['s']:.1f} tok/s, MFU {100 * train['mfu']:.1f}% of 989 TFLOP/s")  # fmt: skip


if __name__ == "__main__":
    main()
