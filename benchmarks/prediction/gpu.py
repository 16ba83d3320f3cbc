"""Prediction on a GPU: a GPU stage and a GPU + CPU pipeline, predicted against measured.

Needs one CUDA GPU whose kind the catalog knows (``cost_models.kind_from_cuda_name``);
without one it says so and exits 2. For each model, one profile measures the CPU (at
one torch thread, what the CPU rank gets) and the GPU. Two predictions are made of
every plan, from the same cost graph code:

- **GPU-measured**: the profile as measured (CUDA-event node times, scaled to the
  blocks timed in sequence on the GPU);
- **CPU-calibrated**: the profile with the GPU's costs removed and predicted again
  from the CPU's (:func:`hpml_compile.predict_kinds`: the datasheet's roofline with
  multipliers fitted on the CPU), which is what a user without the GPU at hand plans
  with.

Plans: the whole model on the GPU (one rank), in fp32 and, where ``--bf16``, in bf16
(the bf16 row has only the GPU-measured prediction: its CPU-calibrated twin would
need a bf16 CPU profile); and a 2-stage pipeline with the first stage on the GPU and
the second on a CPU rank (gloo through host memory), cut where the two stages'
GPU-measured times balance (the CPU is so much slower that it gets the tail). Each
plan is generated, trained with :class:`hpml_compile.runtime.Pipeline` (AdamW) on
real ranks, and measured as ``main.py`` does (median of the steps after warm-up, the
slowest rank; CUDA work is synchronized before each compute action's clock is read). Beside the
times, the GPU stage's predicted peak memory (``plan.stages[0].predicted.memory_bytes``) against the
CUDA caching allocator's peak in a step (``torch.cuda.max_memory_allocated``, as the monitor records it).

Run:  python benchmarks/prediction/gpu.py [--models gpt-mini,mlp] [--steps 10] [--bf16]
Writes benchmarks/prediction/results/prediction_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from main import Case, _stages_of, _summarise, _worker  # noqa: E402

from hpml_compile import models, predict_kinds, profile  # noqa: E402
from hpml_compile.codegen import generate  # noqa: E402
from hpml_compile.costgraph import CostGraph  # noqa: E402
from hpml_compile.costgraph import build as build_costgraph  # noqa: E402
from hpml_compile.ir import Cluster, Device, Profile  # noqa: E402
from hpml_compile.plan import Plan, Schedule, Stage  # noqa: E402
from hpml_compile.profile import local_kinds  # noqa: E402
from hpml_compile.profile.timing import host_facts  # noqa: E402
from hpml_compile.runtime import spawn_ranks  # noqa: E402
from hpml_compile.runtime.observe.summary import predicted_bubble  # noqa: E402
from hpml_compile.simulate import annotate  # noqa: E402
from hpml_compile.trace import trace  # noqa: E402


def cpu_only(p: Profile) -> Profile:
    """``p`` with every kind but the CPU removed: what a profile taken without the GPU holds."""
    keep = {"cpu"}
    return replace(p, nodes=tuple(replace(n, cost={k: v for k, v in n.cost.items() if k in keep}) for n in p.nodes),
                   devices={k: v for k, v in p.devices.items() if k in keep},
                   totals={k: v for k, v in p.totals.items() if k in keep},
                   optimizer_ms={k: v for k, v in p.optimizer_ms.items() if k in keep})


def _gpu_cpu_cut(graph: CostGraph, gpu: str) -> int:
    """The coarse boundary minimising max(GPU time of the head, CPU time of the tail), the tail holding parameters.

    A tail without parameters (the loss alone) would make the CPU rank a bystander with nothing to train.
    """
    coarse = graph.coarsen()
    order = list(coarse.order)
    g = [sum(coarse.node(v).cost[gpu]) for v in order]
    c = [sum(coarse.node(v).cost["cpu"]) for v in order]
    held = [sum(graph.node(m).param_bytes for m in coarse.node(v).members) for v in order]
    last = max((i for i in range(1, len(order)) if sum(held[i:]) > 0), default=len(order) - 1)
    best, where = float("inf"), last
    for i in range(1, last + 1):
        worst = max(sum(g[:i]), sum(c[i:]))
        if worst < best:
            best, where = worst, i
    return where


def _cluster(gpu: str) -> Cluster:
    mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    return Cluster((Device("gpu0", gpu, round(mem, 1)), Device("cpu0", "cpu", 16.0)), name="local-gpu-cpu")


def _cases(names: list[str], gpu: str, root: Path, bf16: bool, microbatches: int
           ) -> tuple[list[Case], dict[str, float], dict[str, list[int]], dict[str, Any]]:
    """The plans; per plan its CPU-calibrated prediction (ms) and each stage's predicted peak bytes; what the
    profiles recorded."""
    cases, calibrated, memory, facts = [], {}, {}, {}
    torch.set_num_threads(1)
    cluster = _cluster(gpu)
    for name in names:
        for precision in ("fp32", "bf16") if bf16 else ("fp32",):
            loaded = models.load(name, seed=0)
            kinds = ("cpu", gpu) if precision == "fp32" else (gpu,)
            print(f"profiling {name} ({precision}) on {', '.join(kinds)} ...", file=sys.stderr, flush=True)
            prof = profile(loaded.module, loaded.example_inputs, name=name, device_kinds=kinds, repeats=5, warmup=2,
                           progress=False, loss_fn=loaded.loss_fn, targets=loaded.example_targets,
                           precision=precision)
            facts[f"{name} {precision}"] = {k: dict(v) for k, v in prof.devices.items()}
            graph = build_costgraph(prof)
            graph_cal = build_costgraph(predict_kinds(cpu_only(prof), [gpu])) if precision == "fp32" else None
            gm = trace(loaded.module, loaded.example_inputs)
            coarse = graph.coarsen()
            every = tuple(m for v in coarse.order for m in coarse.node(v).members)
            plans = [(f"{name} {precision} gpu", Plan(name, cluster, Schedule.GPIPE, 1,
                                                    (Stage(0, ("gpu0",), every),), precision=precision))]
            if precision == "fp32":
                head, tail = _stages_of(graph, _gpu_cpu_cut(graph, gpu))
                plans.append((f"{name} {precision} gpu+cpu 1f1b M={microbatches}",
                              Plan(name, cluster, Schedule.ONE_F_ONE_B, microbatches,
                                   (Stage(0, ("gpu0",), head), Stage(1, ("cpu0",), tail)), precision=precision)))
            for label, bare in plans:
                plan, r = annotate(bare, graph)
                if graph_cal is not None:
                    calibrated[label] = annotate(bare, graph_cal)[0].predicted.step_ms
                out = root / label.replace(" ", "_").replace("=", "").replace("+", "-")
                generate(gm, plan, out, profile=prof)
                per_rank = tuple((st.predicted.fwd_ms + st.predicted.bwd_ms) * plan.microbatches
                                 for st in plan.stages for _ in st.devices)
                memory[label] = [st.predicted.memory_bytes for st in plan.stages]
                cases.append(Case(label, name, len(plan.stages), str(out), plan.predicted.step_ms,
                                  predicted_bubble(plan), per_rank, r.step_without_optimizer_ms))
    return cases, calibrated, memory, facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt-mini,mlp", help="comma-separated zoo names (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per plan")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=4, help="microbatches of the GPU + CPU pipeline")
    p.add_argument("--bf16", action="store_true", help="also the whole model on the GPU in bf16 (autocast)")
    args = p.parse_args(argv)
    gpus = [k for k, d in local_kinds().items() if d.type == "cuda"]
    if not gpus:
        print("prediction/gpu.py needs a CUDA GPU: torch.cuda.is_available() is False here", file=sys.stderr)
        return 2
    import cost_models

    if gpus[0] not in cost_models.known_kinds():
        print(f"the GPU {gpus[0]!r} is not in cost_models' catalog: add it (cost_models/catalog.py) to predict it",
              file=sys.stderr)
        return 2
    gpu = gpus[0]
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="hpml-prediction-gpu-"))
    host = host_facts()
    cases, calibrated, memory, facts = _cases(args.models.split(","), gpu, root, args.bf16, args.microbatches)
    for world in sorted({c.ranks for c in cases}):
        spawn_ranks(_worker, world, root, cases, args.steps, args.warmup, str(root), 5.0, 1)
    rows = _summarise(cases, root)
    for r in rows:
        gpu_rank = json.loads((root / f"rank0-w{r['ranks']}.json").read_text())[r["plan"]]
        r["gpu_peak_bytes"] = gpu_rank["peak_memory_bytes"] if gpu_rank["memory_kind"] == "cuda" else None
        r["gpu_predicted_peak_bytes"] = memory[r["plan"]][0]
        cal = calibrated.get(r["plan"])
        r["predicted_cpu_calibrated_ms"] = cal
        r["error_cpu_calibrated"] = None if cal is None else (r["measured_ms"] - cal) / cal
    print(f"{len(rows)} plans on {gpu} ({torch.cuda.get_device_name(0)}) and a CPU rank of {host['cpu_model']}; "
          f"median of {args.steps} steps after {args.warmup} warm-up; error = (measured - predicted) / predicted")
    print(f"  {'plan':30s} {'ranks':>5s} {'meas ms':>8s} {'GPU-meas':>9s} {'error':>7s} {'CPU-cal':>8s} "
          f"{'error':>7s} {'stage ms p/m':>24s} {'GPU MiB p/m':>14s}")
    for r in rows:
        cal = r["predicted_cpu_calibrated_ms"]
        stages = " ".join(f"{p_:.1f}/{m:.1f}" for p_, m in zip(r["predicted_compute_ms_by_stage"],
                                                              r["compute_ms_by_stage"]))
        print(f"  {r['plan']:30s} {r['ranks']:5d} {r['measured_ms']:8.2f} {r['predicted_ms']:9.2f} "
              f"{r['error']:+7.1%} " + (f"{cal:8.2f} {r['error_cpu_calibrated']:+7.1%}" if cal else f"{'-':>8s} "
                                        f"{'-':>7s}") + f" {stages:>24s} "
              + f"{r['gpu_predicted_peak_bytes'] / 2**20:6.1f}/{(r['gpu_peak_bytes'] or 0) / 2**20:<6.1f}")
    errs = [abs(r["error"]) for r in rows]
    cal_errs = [abs(r["error_cpu_calibrated"]) for r in rows if r["error_cpu_calibrated"] is not None]
    summary = {"median_abs_error_gpu_measured": statistics.median(errs),
               "median_abs_error_cpu_calibrated": statistics.median(cal_errs) if cal_errs else None}
    print(f"  |error| median: GPU-measured profile {summary['median_abs_error_gpu_measured']:.1%}"
          + (f", CPU-calibrated {summary['median_abs_error_cpu_calibrated']:.1%}" if cal_errs else ""))
    result = {"benchmark": "prediction_gpu", "command": " ".join([sys.executable, *sys.argv]), "gpu": gpu,
              "gpu_name": torch.cuda.get_device_name(0), "host": host, "plans": rows, "profiles": facts,
              "summary": summary, "steps": args.steps, "warmup": args.warmup, "torch": torch.__version__,
              "cpus": os.cpu_count(), "wall_s": time.perf_counter() - t0}
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "prediction_gpu.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out / 'prediction_gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
