"""The host's cost per op of an eager and of a compiled stage, on this machine's GPU.

A deep, narrow MLP (``--layers`` x Linear(16, 16) + ReLU, batch 8) has kernels far smaller than a
launch, so a step's time over its op count is what the host spends per op: Python, the dispatcher, the
caching allocator and the launch. It is measured three ways, each over ``--steps`` timed forward and
backward passes after warm-up (CUDA synchronised around the timed loop):

- ``eager``: the plain module;
- ``stage``: the module traced by :func:`hpml_compile.trace.trace` (the fx graph a generated stage runs);
- ``compiled``: ``torch.compile`` of the traced graph (inductor; CUDA graphs where it can).

``cost_models.catalog.EAGER_GPU_OP_MS`` assumes the ``stage`` figure for the forward; this prints it beside
the measured one. Without a GPU it measures the CPU (``--device cpu``), which says nothing of a GPU.

Run:  python benchmarks/gpu/op_cost.py [--layers 100] [--steps 50] [--device cuda]
Prints a table; writes benchmarks/gpu/results/op_cost.json (atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from cost_models.catalog import EAGER_GPU_OP_MS
from hpml_compile.trace import trace

HERE = Path(__file__).resolve().parent


def _timed(fn: Callable[[], None], steps: int, device: torch.device) -> float:
    """Milliseconds per call of ``fn``, synchronised."""
    for _ in range(5):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / steps * 1e3


def measure(layers: int, steps: int, device: torch.device) -> dict[str, dict[str, float]]:
    """Forward and backward ms per op of the eager model, its traced stage and the compiled stage."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(16, 16), nn.ReLU())]).to(device)
    x = torch.randn(8, 16, device=device)
    stage = trace(model, (x,))
    ops = 2 * layers  # a linear and a relu per layer
    runs: dict[str, nn.Module | Callable[..., torch.Tensor]] = {"eager": model, "stage": stage}
    try:
        runs["compiled"] = torch.compile(stage)
    except Exception as e:  # noqa: BLE001 - say why, measure the rest
        print(f"torch.compile failed: {type(e).__name__}: {e}", file=sys.stderr)
    out: dict[str, dict[str, float]] = {}
    for name, fn in runs.items():
        with torch.no_grad():
            fwd = _timed(lambda: fn(x), steps, device)
        step = _timed(lambda: fn(x).sum().backward(), steps, device)
        out[name] = {"fwd_ms_per_op": fwd / ops, "bwd_ms_per_op": max(step - fwd, 0.0) / ops,
                     "fwd_ms": fwd, "step_ms": step}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=100)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=HERE / "results" / "op_cost.json")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("op_cost: no CUDA device; pass --device cpu to measure the CPU instead", file=sys.stderr)
        return 2
    got = measure(a.layers, a.steps, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"host cost per op on {name}, {a.layers} x (Linear 16 + ReLU), batch 8 (us)")
    print(f"{'':10s} {'forward':>9s} {'backward':>9s}")
    for k, v in got.items():
        print(f"{k:10s} {v['fwd_ms_per_op'] * 1e3:9.1f} {v['bwd_ms_per_op'] * 1e3:9.1f}")
    print(f"cost_models assumes {EAGER_GPU_OP_MS * 1e3:.0f} us per forward op of an eager stage (EAGER_GPU_OP_MS)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"command": "python benchmarks/gpu/op_cost.py", "date": time.strftime("%Y-%m-%d"), "commit": commit,
           "device": name, "torch": torch.__version__, "layers": a.layers, "assumed_ms_per_op": EAGER_GPU_OP_MS,
           "measured": got}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(f".{a.out.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
