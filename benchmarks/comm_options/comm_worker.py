"""One rank of benchmarks/comm_options, started by torchrun (two agents, ``--nnodes 2``, stand in for two hosts).

Trains the benchmark's MLP under every option in turn, from the same seed on
the same batches, in one process group: ``flat`` and every compression / local
SGD option on the flat build (the options as ``comm_options``, as ``hpml-compile
run --compress/--sync-every`` gives them), ``hierarchical`` on the build whose
stage all-reduces hierarchically, ``hier ZeRO-1`` on the build whose ZeRO-1 stage
does (optimizer sharded per host). Writes ``rank<r>.json``: per option, the
per-step losses, step times, gradient-sync times and the bytes the runtime
counted (sync payload, and for the hierarchical build each level's bytes).

Usage (what main.py runs): torchrun --nnodes 2 --nproc-per-node 2 ... comm_worker.py FLAT HIER HZERO STEPS OUT
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from main import OPTIONS, batches, mlp  # noqa: E402  (the benchmark's model, options and data)

from hpml_compile.models.mlp import loss  # noqa: E402
from hpml_compile.runtime import Pipeline  # noqa: E402


def main(flat_build: str, hier_build: str, hzero_build: str, steps: str, out: str) -> None:
    faulthandler.dump_traceback_later(1500, exit=True)  # a hang ends as a traceback
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict[str, Any] = {}
    data = batches(int(steps))
    for name, opts in OPTIONS.items():
        build = {"hierarchical": hier_build, "hier ZeRO-1": hzero_build}.get(name, flat_build)
        pipe = Pipeline.from_build(build, mlp(), comm_options=opts or None,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        losses = [pipe.step((x,), y, loss).item() for x, y in data]
        m = pipe.metrics
        report[name] = {"losses": losses, "step_ms": [r.step_ms for r in m], "allreduce_ms": [r.allreduce_ms for r in m],
                        "sync_bytes": [r.sync_bytes for r in m], "dense_bytes": [r.sync_dense_bytes for r in m],
                        "intra_bytes": [r.sync_intra_bytes for r in m], "inter_bytes": [r.sync_inter_bytes for r in m],
                        "flat_bytes": [r.sync_flat_bytes for r in m],
                        "hierarchical": sorted(map(list, pipe.comm.hierarchy)) if pipe.comm is not None else []}
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:6])
