"""`rlloom plan`: a per-GPU memory model of RL training and a layout search (docs/plan.md).

counts (parameters, activations, KV cache per layer) -> stages (pipeline split) -> memory (one
layout's GPU and host memory) -> search (legal layouts, least offload, uneven stages, step-time
ranking) -> report (CLI, JSON) and check (the trainer's start-up warning).
"""
