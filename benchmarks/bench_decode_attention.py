"""Paged decode attention of one layer at a GRPO decode step (GPU): plain against shared-prompt
(cascade) reading, against the bandwidth bound of the bytes each must read (one table).

Shape: Qwen3-0.6B attention (16 query heads, 8 KV heads, head dim 128, bf16), 64 prompts x 8
samples, 128 prompt tokens, each sample `--generated` tokens into its response (default 256, the
middle of a 512-token rollout). The plain kernel reads every sample's keys; with shared prefixes
each group's 128 prompt keys are read once by `_shared_prefix_kernel`, then each sample reads its
own. Rows sweep the prefix kernel's tile and warps, then the per-sequence kernel's tile, warps and
pipeline stages, then compare the kernel storing the new tokens' k/v itself (`new_kv`, what the
engine does) with two `index_copy_` launches before it. Errors are against `reference_decode` in fp32.

    python benchmarks/bench_decode_attention.py [--generated 256]
"""

from __future__ import annotations

import argparse

import torch

from rlloom.engines.rollout.native.paged_decode import (
    SharedPrefix,
    max_group_members,
    paged_decode,
    reference_decode,
    shared_prefix_groups,
)


def cuda_us(fn, repeat: int = 50) -> float:  # noqa: ANN001
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generated", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    groups, n, prompt, block, hq, hkv, d = 64, 8, 128, 16, 16, 8, 128
    S, keys = groups * n, prompt + args.generated + 1
    own = -(-(keys - prompt) // block)
    num_blocks = groups * prompt // block + S * own
    k = torch.randn(num_blocks * block, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(S, hq, d, device="cuda", dtype=torch.bfloat16)
    shared = torch.arange(groups * prompt // block).view(groups, 1, -1).expand(groups, n, -1).reshape(S, -1)
    private = groups * prompt // block + torch.arange(S * own).view(S, own)
    tables = torch.cat([shared, private], dim=1).cuda()
    num_keys = torch.full((S,), keys, device="cuda")
    members, group_keys, start = shared_prefix_groups(
        tables.cpu().numpy(), num_keys.cpu().numpy() - 1, block, max_group_members(hq, hkv)
    )
    prefix = SharedPrefix(*(torch.from_numpy(a).cuda() for a in (members, group_keys, start)))
    want = reference_decode(q.float(), k.float(), v.float(), tables, num_keys, d**-0.5, block)
    bandwidth = 2 * 4e9 / (cuda_us(lambda: torch.empty(int(4e9), dtype=torch.uint8, device="cuda").copy_(
        torch.empty(int(4e9), dtype=torch.uint8, device="cuda")), repeat=5) / 1e6)  # fmt: skip
    token_bytes = hkv * 2 * d * 2
    plain_bytes, shared_bytes = S * keys * token_bytes, (groups * prompt + S * (keys - prompt)) * token_bytes
    rows = []
    configs = [("plain", {}, plain_bytes)]
    configs += [
        (f"shared prefix, prefix tile {t}, {w} warps", dict(shared_prefix=prefix, prefix_tile=t, prefix_warps=w), shared_bytes)
        for t in (32, 64, 128)
        for w in (2, 4, 8)
    ]  # fmt: skip
    configs += [  # the per-sequence kernel's own configuration, with the default prefix kernel
        (f"shared prefix, tile {t}, {w} warps, {st} stages", dict(shared_prefix=prefix, tile=t, num_warps=w, num_stages=st), shared_bytes)
        for t in (32, 64, 128)
        for w in (2, 4, 8)
        for st in (1, 2, 3)
    ]  # fmt: skip
    last = tables[torch.arange(S, device="cuda"), (num_keys - 1) // block] * block + (num_keys - 1) % block
    new_kv = (torch.randn(S, hkv, d, device="cuda", dtype=k.dtype), torch.randn_like(k[:S]), last)
    write_bytes = 2 * S * token_bytes  # read the new k/v, write them
    configs += [
        ("shared prefix + the kernel stores the new k/v (engine default)", dict(shared_prefix=prefix, new_kv=new_kv), shared_bytes + write_bytes),
        ("shared prefix + two index_copy_ for the new k/v (before)", dict(shared_prefix=prefix, copies=new_kv), shared_bytes + write_bytes),
    ]  # fmt: skip

    def run(kw: dict) -> torch.Tensor:
        kw = dict(kw)
        if "copies" in kw:
            new_k, new_v, slots = kw.pop("copies")
            k.index_copy_(0, slots, new_k)
            v.index_copy_(0, slots, new_v)
        return paged_decode(q, k, v, tables, num_keys, d**-0.5, block, **kw)

    for name, kw, nbytes in configs:
        if "new_kv" in kw or "copies" in kw:  # the reference with the new tokens in place
            new_k, new_v, slots = new_kv
            k_want, v_want = k.clone(), v.clone()
            k_want[slots], v_want[slots] = new_k, new_v
            want = reference_decode(
                q.float(), k_want.float(), v_want.float(), tables, num_keys, d**-0.5, block
            )
        err = (run(kw).float() - want).abs().max().item()
        us = cuda_us(lambda kw=kw: run(kw))
        rows.append((name, us, nbytes / bandwidth * 1e6, err))
    print(f"\nbench_decode_attention ({torch.cuda.get_device_name()}, {S} sequences of {keys} keys, "
          f"groups of {n} sharing {prompt}, copy bandwidth {bandwidth / 1e12:.2f} TB/s)")  # fmt: skip
    print("| kernel | us per layer | bound us | ratio | max error |")
    print("|---|---|---|---|---|")
    for name, us, bound, err in rows:
        print(f"| {name} | {us:.1f} | {bound:.1f} | {bound / us:.2f} | {err:.1e} |")


if __name__ == "__main__":
    main()
