"""How long does planning take? Solve time against graph size (coarsened blocks) and device count.

Each zoo model is profiled on the meta device (nothing allocated, every cost
predicted for A100-80GB and H100-80GB; llama-70b traces in ~10 s), coarsened
into blocks, and placed on clusters of 4 to 64 A100-80GB (hosts of 8 GPUs on
NVLink, 100 GbE between hosts; the clusters are written here as cluster.json
dicts). For each point the table gives the wall time of the ``dp`` solver
(microbatch search included) and of ``ilp`` (the same search, then the ILP
with its DP bounds and, where they do not meet, HiGHS), the ILP's status and
gap, and the chosen plan. ``--plain`` also runs the ILP without the DP bounds
(HiGHS alone from the DP's warm start) at the two goal points, to show what
the bounds buy.

Goals: under 10 s for gpt2-xl on 16 devices and under 60 s for
llama-70b on 64 devices, on a 2-core machine, with the gap reported.

Run:
    python benchmarks/solver_scaling/main.py                 # ~2-3 min on 2 cores
    python benchmarks/solver_scaling/main.py --quick         # the two goal points only (~30 s)
    python benchmarks/solver_scaling/main.py --plain         # + HiGHS without the DP bounds (~+2 min)
    python benchmarks/solver_scaling/main.py --cprofile      # where the time goes, llama-70b on 64
Writes benchmarks/solver_scaling/results/scaling.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import time
from pathlib import Path
from typing import Any

import torch

from hpml_compile import models, profile
from hpml_compile.costgraph import CostGraph, build
from hpml_compile.errors import InfeasibleError
from hpml_compile.ir import Cluster
from hpml_compile.plan import Schedule
from hpml_compile.solve import solve
from hpml_compile.solve.candidates import Chain, Setting
from hpml_compile.solve.ilp import solve_ilp

KINDS = ("A100-80GB", "H100-80GB")
# (zoo name, batch size): batches big enough that the microbatch search has several counts to try.
MODELS = [("gpt2-small", 32), ("gpt2-xl", 8), ("gpt2-xl", 64), ("llama-7b", 16), ("llama-70b", 64)]
DEVICES = [4, 8, 16, 32, 64]
GOALS = [("gpt2-xl", 8, 16, 10.0), ("llama-70b", 64, 64, 60.0)]  # (model, batch, devices, seconds)


def cluster_dict(devices: int, per_host: int = 8, kinds: tuple[str, ...] = ("A100-80GB",)) -> dict[str, Any]:
    """A cluster.json dict: ``devices`` GPUs, ``per_host`` per host; hosts take the kinds in turn."""
    hosts = (devices + per_host - 1) // per_host
    devs = [{"name": f"gpu{h * per_host + i}", "kind": kinds[h * len(kinds) // hosts], "memory_gib": 80,
             "host": f"node{h}"} for h in range(hosts) for i in range(min(per_host, devices - h * per_host))]
    return {"schema_version": 1, "name": f"{devices}x{'+'.join(kinds)}", "devices": devs}


def graph_of(name: str, batch: int) -> tuple[CostGraph, float]:
    """The coarsened cost graph of a zoo model profiled on meta, and the seconds profiling took."""
    t0 = time.perf_counter()
    m = models.load(name, batch_size=batch, device="meta")
    p = profile(m.module, m.example_inputs, name=name, device_kinds=KINDS, batch_size=m.batch_size,
                seq_len=m.seq_len, progress=False)
    return build(p).coarsen(), time.perf_counter() - t0


def timed_solve(graph: CostGraph, cluster: Cluster, solver: str, time_limit: float) -> dict[str, Any]:
    """One solve, timed, as a result row."""
    lines: list[str] = []
    t0 = time.perf_counter()
    try:
        plan = solve(graph, cluster, solver=solver, time_limit_s=time_limit, dtype="float32", progress=lines.append)
    except InfeasibleError:  # too big for the cluster: the time to prove it still counts
        return {"solver": solver, "seconds": round(time.perf_counter() - t0, 3), "status": "infeasible",
                "gap": 0.0, "microbatches": None, "stages": None, "degrees": [], "step_ms": None}
    secs = time.perf_counter() - t0
    return {"solver": solver, "seconds": round(secs, 3), "status": plan.solver.status.value,
            "gap": plan.solver.gap, "microbatches": plan.microbatches, "stages": len(plan.stages),
            "degrees": [len(s.devices) for s in plan.stages], "step_ms": plan.predicted.step_ms,
            # how the ILP's answer was settled: the DP bounds met, or HiGHS ran
            "proof": ("highs" if any("solving with HiGHS" in x for x in lines) else
                      "dp-bounds" if any("optimal by the DP bounds" in x for x in lines) else "-")}


def plain_ilp(graph: CostGraph, cluster: Cluster, microbatches: int, time_limit: float) -> dict[str, Any]:
    """HiGHS without the DP bounds (warm-started by the DP), at one microbatch count."""
    setting = Setting(microbatches, Schedule.ONE_F_ONE_B, graph.batch_size)
    res = solve_ilp(Chain.of(graph), cluster, setting, time_limit_s=time_limit, cuts=False)
    return {"solver": "ilp-plain", "seconds": round(res.seconds, 3), "status": res.status.value, "gap": res.gap,
            "microbatches": microbatches, "variables": res.variables}


def _row_text(r: dict[str, Any]) -> str:
    gap = f"{r['gap']:.2%}" if r["solver"] != "dp" else "-"
    plan = f"M={r['microbatches']} {r['stages']} st" if r.get("stages") else (
        f"M={r['microbatches']}" if r.get("microbatches") else "-")
    step = f"{r['step_ms']:.6g}" if r.get("step_ms") else "-"
    return (f"{r['model']:11s} {r['batch']:5d} {r['blocks']:6d} {r['devices']:7d}  {r['solver']:9s} "
            f"{r['seconds']:8.2f} {r['status']:>10s} {gap:>7s}  {plan:14s} {step:>12s}  {r.get('proof', '')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the two goal points")
    ap.add_argument("--plain", action="store_true", help="also HiGHS without the DP bounds at the goal points")
    ap.add_argument("--cprofile", action="store_true", help="profile the llama-70b / 64 solve and print the top")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit per solve (solve's default: 30)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "scaling.json")
    args = ap.parse_args()

    t_start = time.time()
    grid = [(m, b, d) for m, b in MODELS for d in DEVICES]
    if args.quick:
        grid = [(m, b, d) for m, b, d, _ in GOALS]
    graphs: dict[tuple[str, int], CostGraph] = {}
    rows: list[dict[str, Any]] = []
    print(f"{'model':11s} {'batch':>5s} {'blocks':>6s} {'devices':>7s}  {'solver':9s} {'seconds':>8s} "
          f"{'status':>10s} {'gap':>7s}  {'plan':14s} {'step ms':>12s}  proof")
    for name, batch, devices in grid:
        if (name, batch) not in graphs:
            graphs[(name, batch)], secs = graph_of(name, batch)
            print(f"# profiled {name} (batch {batch}) on meta in {secs:.1f} s: "
                  f"{len(graphs[(name, batch)].order)} blocks", flush=True)
        g = graphs[(name, batch)]
        cluster = Cluster.from_dict(cluster_dict(devices))
        for solver in ("dp", "ilp"):
            r = {"model": name, "batch": batch, "blocks": len(g.order), "devices": devices,
                 **timed_solve(g, cluster, solver, args.time_limit)}
            rows.append(r)
            print(_row_text(r), flush=True)
        goal_point = any((name, batch, devices) == (m, b, d) for m, b, d, _ in GOALS)
        if args.plain and rows[-1]["microbatches"] and goal_point:
            r = {"model": name, "batch": batch, "blocks": len(g.order), "devices": devices,
                 **plain_ilp(g, cluster, rows[-1]["microbatches"], args.time_limit)}
            rows.append(r)
            print(_row_text(r), flush=True)
    # a two-kind cluster: device-count vectors grow to (33 x 33), and the DP bounds need not meet
    g = graphs.get(("llama-70b", 64)) or graph_of("llama-70b", 64)[0]
    graphs[("llama-70b", 64)] = g
    mixed = Cluster.from_dict(cluster_dict(64, kinds=KINDS))
    r = {"model": "llama-70b", "batch": 64, "blocks": len(g.order), "devices": 64, "cluster": mixed.name,
         **timed_solve(g, mixed, "ilp", args.time_limit)}
    rows.append(r)
    print(_row_text(r) + "   (32 A100 + 32 H100)", flush=True)

    goals = []
    for name, batch, devices, limit in GOALS:
        hit = next((r for r in rows if (r["model"], r["batch"], r["devices"], r["solver"]) ==
                    (name, batch, devices, "ilp") and "cluster" not in r), None)
        if hit:
            ok = hit["seconds"] < limit
            goals.append({"model": name, "batch": batch, "devices": devices, "limit_s": limit,
                          "seconds": hit["seconds"], "status": hit["status"], "gap": hit["gap"], "met": ok})
            print(f"goal: {name} (batch {batch}) on {devices} devices under {limit:g} s: {hit['seconds']:.2f} s, "
                  f"{hit['status']}, gap {hit['gap']:.2%} -> {'met' if ok else 'MISSED'}")
    top = ""
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        solve(graphs[("llama-70b", 64)], Cluster.from_dict(cluster_dict(64)), solver="ilp",
              time_limit_s=args.time_limit)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(18)
        top = buf.getvalue()
        print(top)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "solver_scaling", "time_limit_s": args.time_limit, "rows": rows, "goals": goals,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "seconds": round(time.time() - t_start, 1), "cprofile_top": top,
    }, indent=1))
    print(f"wrote {args.out} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
