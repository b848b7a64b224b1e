"""Keep Python's garbage collector from pausing the steps: freeze the heap the warm-up built.

After the first step a process holds millions of long-lived objects (the models, the compiled
graphs, the captured CUDA graphs, the caches of torch.compile). Every full (generation-2) collection
scans all of them: on the Qwen3-30B-A3B-width MoE RL job on one H200 one such pass took 0.41-0.45 s,
inside a decode step, every other step (docs/benchmarks.md). `freeze_heap` collects what is garbage
now and moves everything else to the collector's permanent generation (`gc.freeze`, as vLLM and
SGLang do after start-up): later collections scan only what later steps create. The run loop calls
it once per process, after the first step (`Groups.freeze_heap`), and `Groups.close` thaws the
heap again (`thaw_heap`): frozen objects that die in a reference cycle are never collected, so a
process that runs several trainings (a notebook, a sweep) would otherwise keep every finished run's
engines, and their GPU memory.
"""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Collect the garbage, then exempt every surviving object from later collections."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo `freeze_heap`: the frozen objects are collectable again (the next collection frees
    the dead ones)."""
    gc.unfreeze()
