"""One rank of a memory_truth case, in a fresh interpreter: what a rank of a run imports, builds and holds.

Started by ``main.py`` once per rank and case (``python rank.py BUILD MODEL STEPS RANK WORLD INIT OUT``), so that
its peak resident set (``VmHWM``) is a rank's own: the interpreter, torch, the runtime, the whole model built as
a run builds it, and the steps. Writes ``OUT`` (JSON): the held bytes by part, the runtime's per-step peak RSS,
and the process's lifetime ``VmHWM``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _vmhwm() -> int:
    """The process's peak resident set since it started (or since the runtime last reset it), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str]) -> None:
    build, model, steps, rank, world, init, out = argv
    import torch
    import torch.distributed as dist

    from hpml_compile import models
    from hpml_compile.hostmem import keep_freed_memory
    from hpml_compile.runtime import Pipeline
    from hpml_compile.runtime.sync import stage as stage_sync

    torch.set_num_threads(1)
    keep_freed_memory()  # as a run's ranks (runtime.job.spawn, the worker)
    dist.init_process_group("gloo", init_method=init, rank=int(rank), world_size=int(world))
    loaded = models.load(model, seed=0)
    pipe = Pipeline.from_build(build, loaded.module, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    hwm = [_vmhwm()]  # the interpreter, torch, the runtime and the model built: the peak so far
    for _ in range(int(steps)):
        pipe.step(loaded.example_inputs, loaded.example_targets, loaded.loss_fn)
        hwm.append(_vmhwm())  # the runtime resets the peak at each step's start: this is the step's
    h = pipe.held  # parameters and optimizer state after the last step, gradients at their peak
    assert h is not None
    keys = {id(p) for st in pipe.stages.values() for p in st.parameters()}
    other = sum(b.untyped_storage().nbytes() for k, b in stage_sync._BUFFERS.items() if set(k) & keys)
    rows = pipe.metrics
    st = pipe.plan.stages[pipe.stage_index]
    Path(out).write_text(json.dumps({
        "rank": int(rank), "stage": pipe.stage_index, "device": st.devices[pipe.replica],
        "params": h.params, "grads": h.grads, "optimizer": h.optimizer,
        "activations": max(m.held_activation_bytes for m in rows), "other": other,
        "held_bytes": max(m.held_bytes for m in rows), "rss": max(m.peak_memory_bytes for m in rows),
        "vmhwm": max(hwm), "loss": [m.loss for m in rows]}))
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
