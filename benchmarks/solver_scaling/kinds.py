"""Planning time on clusters of many device kinds: kinds x devices per kind.

For each model (llama-70b at batch 512, sequence 2048; gpt2-xl at batch 512,
both profiled on the meta device with costs predicted for every kind), each
number of kinds (A100-80GB, + H100-80GB, + V100-32GB, + A100-40GB) and each
count per kind (8, 32, 128, 256; hosts of 8), plus one mix with CPUs, one
``solve(..., solver="ilp")`` runs in a fork of the process that loaded the
profile once (so its peak resident memory, the profile included, is the
row's own), and the row records, from the solver's log:

- first plan: seconds from the start of the solve to its first feasible plan;
- 1% gap: seconds until the certified gap (incumbent against the lower bound
  of the relaxation, at the chosen microbatch count) is at most 1%;
- final gap and status when the time limit stops it;
- peak: the process's peak resident memory (``ru_maxrss``), profile loading
  included;
- each time also as this process's CPU seconds, since the machine is shared
  (the wall times include waiting for a core), and the one-minute load
  average when the row began (``load``).

Goals: first plan <= 1 s everywhere; 1% gap <= 10 s up to 3 kinds
x 256, <= 60 s for 4 kinds x 256; peak < 4 GiB.

Run:
    python benchmarks/solver_scaling/kinds.py                      # the whole table
    python benchmarks/solver_scaling/kinds.py --models gpt2-xl --per 8,32
Writes benchmarks/solver_scaling/results/kinds.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

KINDS = ("A100-80GB", "H100-80GB", "V100-32GB", "A100-40GB")
MEMORY_GIB = {"A100-80GB": 80, "H100-80GB": 80, "V100-32GB": 32, "A100-40GB": 40, "cpu": 64}
MODELS = {"llama-70b": (512, 2048), "gpt2-xl": (512, None)}
RESULTS = Path(__file__).parent / "results"


def cluster_dict(counts: dict[str, int], per_host: int = 8) -> dict[str, Any]:
    """A cluster.json dict: ``counts[kind]`` devices of each kind, ``per_host`` to a host of one kind."""
    devs = []
    for kind, count in counts.items():
        for i in range(count):
            devs.append({"name": f"{kind}-{i}", "kind": kind, "memory_gib": MEMORY_GIB[kind],
                         "host": f"{kind}-node{i // per_host}"})
    name = "+".join(f"{c}x{k}" for k, c in counts.items())
    return {"schema_version": 1, "name": name, "devices": devs}


def profile_path(model: str) -> Path:
    """The meta profile of ``model`` with every kind's costs (written once, then reused)."""
    path = RESULTS / f"profile-{model}.json"
    if not path.exists():
        batch, seq = MODELS[model]
        cmd = [sys.executable, "-m", "hpml_compile", "profile", model, "--meta", "--batch-size", str(batch),
               "--device-kinds", ",".join((*KINDS, "cpu")), "-o", str(path)]
        if seq:
            cmd[6:6] = ["--seq-len", str(seq)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return path


def child(prof: Any, model: str, counts: dict[str, int], limit: float) -> dict[str, Any]:
    """One solve (in a forked process, so that ``ru_maxrss`` is this row's peak): the row."""
    from hpml_compile.driver import cost_graph
    from hpml_compile.errors import InfeasibleError
    from hpml_compile.ir import Cluster
    from hpml_compile.solve import solve

    load = os.getloadavg()[0]  # the machine is shared: how busy it was when the row began
    cluster = Cluster.from_dict(cluster_dict(counts))
    _, graph = cost_graph(prof, cluster)
    lines: list[tuple[float, float, str]] = []  # (wall s, this process's CPU s, line), from the solve's start
    t0, c0 = time.perf_counter(), time.process_time()
    say = lambda s: lines.append((time.perf_counter() - t0, time.process_time() - c0, s))  # noqa: E731
    try:
        plan = solve(graph, cluster, solver="ilp", time_limit_s=limit, progress=say)
    except InfeasibleError:  # the model does not fit: proving it is the answer
        secs = time.perf_counter() - t0
        return {"model": model, "kinds": len(counts), "counts": counts, "devices": sum(counts.values()),
                "limit_s": limit, "first_plan_s": None, "gap_1pct_s": None, "seconds": round(secs, 3),
                "status": "infeasible", "gap": 0.0, "cpu_s": round(time.process_time() - c0, 2), "load1": load,
                "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    first = next(((w, c) for w, c, s in lines if "first plan after" in s), (None, None))
    # the certified gap as it closes: the many-kind search's lines, and the exact path's DP bounds at its count
    gaps = [(w, c, float(m.group(1)) / 100) for w, c, s in lines
            if (m := re.match(r"(?:anytime: [0-9.]+ s|ilp: DP bounds so far): .* gap ([0-9.]+)%", s))]
    gap = plan.solver.gap
    one = next(((w, c) for w, c, g in gaps if g <= 0.01), (None, None))
    if not gaps and gap <= 0.01:  # the exact path (few devices): proven at the end
        one = (secs, cpu)
    r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return {"model": model, "kinds": len(counts), "counts": counts, "devices": sum(counts.values()),
            "limit_s": limit, "first_plan_s": r3(first[0]), "gap_1pct_s": r3(one[0]), "seconds": round(secs, 3),
            "first_plan_cpu_s": r3(first[1]), "gap_1pct_cpu_s": r3(one[1]),
            "status": plan.solver.status.value, "gap": float(gap), "microbatches": plan.microbatches,
            "stages": len(plan.stages), "step_ms": plan.predicted.step_ms, "cpu_s": round(cpu, 2), "load1": load,
            "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def _row(send: Any, prof: Any, model: str, counts: dict[str, int], limit: float) -> None:
    """The forked process: one row, or the error that stopped it."""
    try:
        send.send(child(prof, model, counts, limit))
    except Exception as e:  # noqa: BLE001 - reported as the row
        send.send({"model": model, "counts": counts, "error": f"{type(e).__name__}: {e}"})


def _fmt(r: dict[str, Any]) -> str:
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    mix = "+".join(f"{c} {k}" for k, c in r["counts"].items())
    return (f"{r['model']:9s} {r['kinds']:5d} {r['devices']:7d}  {f(r['first_plan_s']):>7s} "
            f"{f(r.get('first_plan_cpu_s')):>7s} {f(r['gap_1pct_s']):>7s} {f(r.get('gap_1pct_cpu_s')):>7s} "
            f"{r['seconds']:8.2f} {r['cpu_s']:7.2f} {r['status']:>10s} {r['gap']:7.2%} {r['peak_mib']:8.0f} "
            f"{r.get('load1', 0.0):5.1f}  {mix}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-70b,gpt2-xl")
    ap.add_argument("--kinds", default="1,2,3,4", help="numbers of kinds")
    ap.add_argument("--per", default="8,32,128,256", help="devices per kind")
    ap.add_argument("--limit", type=float, default=10.0, help="solve time limit, 1-3 kinds")
    ap.add_argument("--limit4", type=float, default=60.0, help="solve time limit, 4 kinds")
    ap.add_argument("--no-cpu", action="store_true", help="skip the mix with CPUs")
    ap.add_argument("--timeout", type=float, default=300.0, help="kill a row's process after this long")
    ap.add_argument("--out", type=Path, default=RESULTS / "kinds.json")
    args = ap.parse_args()
    from hpml_compile.profile import load_profile

    RESULTS.mkdir(parents=True, exist_ok=True)
    grid = [(m, {k: p for k in KINDS[:n]}, args.limit4 if n == 4 else args.limit) for m in args.models.split(",")
            for n in map(int, args.kinds.split(",")) for p in map(int, args.per.split(","))]
    if not args.no_cpu:
        grid.append(("gpt2-xl", {"A100-80GB": 32, "cpu": 8}, args.limit))
    rows: list[dict[str, Any]] = []
    t_start = time.time()
    print(f"{'model':9s} {'kinds':>5s} {'devices':>7s}  {'first s':>7s} {'(cpu)':>7s} {'1% s':>7s} {'(cpu)':>7s} "
          f"{'total s':>8s} {'(cpu)':>7s} {'status':>10s} {'gap':>7s} {'peak MiB':>8s} {'load':>5s}  cluster", flush=True)
    profiles: dict[str, Any] = {}
    ctx = mp.get_context("fork")  # the profile is loaded once; each row's solve runs in a fork of this process
    for model, counts, limit in grid:
        if model not in profiles:
            profiles[model] = load_profile(profile_path(model))
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_row, args=(send, profiles[model], model, counts, limit))
        proc.start()
        row: dict[str, Any] = {"model": model, "counts": counts, "error": f"killed after {args.timeout:g} s"}
        if recv.poll(args.timeout):
            row = recv.recv()
        proc.kill() if proc.is_alive() else None
        proc.join()
        rows.append(row)
        print(_fmt(row) if "error" not in row else f"{model:9s} {counts}: {row['error']}", flush=True)
    ok = [r for r in rows if "error" not in r and r["status"] != "infeasible"]
    goals = {
        "first_plan_le_1s": all(r["first_plan_s"] is not None and r["first_plan_s"] <= 1.0 for r in ok),
        "gap_1pct_le_10s_up_to_3_kinds": all(r["gap_1pct_s"] is not None and r["gap_1pct_s"] <= 10.0
                                             for r in ok if r["kinds"] <= 3 and "cpu" not in r["counts"]),
        "gap_1pct_le_60s_4_kinds": all(r["gap_1pct_s"] is not None and r["gap_1pct_s"] <= 60.0
                                       for r in ok if r["kinds"] == 4),
        "peak_lt_4gib": all(r["peak_mib"] < 4096 for r in ok),
    }
    print("goals:", ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in goals.items()))
    args.out.write_text(json.dumps({
        "benchmark": "solver_scaling/kinds", "rows": rows, "goals": goals,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "seconds": round(time.time() - t_start, 1)}, indent=1))
    print(f"wrote {args.out} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
