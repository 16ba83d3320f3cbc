"""First plans per microbatch count on the many-kind path, and what a few seconds of bounds find from them.

For one model on 3 kinds (A100-80GB, H100-80GB, V100-32GB) x ``--per`` devices (the profiles and clusters of
``kinds.py``), each count ``M`` searched: the first plan of the restricted DPs (``solve._first_plan``, as the
solve's microbatch search makes it) with its proxy objective ``(M - 1) T + S + R`` and the CPU seconds it took,
then ``--bounds`` wall seconds of ``lagrange.lagrangian_bounds`` from it on the count's full candidate table: the
best plan and the lower bound they reach. The first plans rank the counts and start their bounds; this shows
how far each is from what the bounds then find (to compare two versions of the
solver, run it with ``PYTHONPATH`` at each commit).

Run:
    python benchmarks/solver_scaling/first_plans.py llama-70b --per 256
    python benchmarks/solver_scaling/first_plans.py gpt2-xl --per 32 --bounds 0     # first plans only
"""

from __future__ import annotations

import argparse
import time

from kinds import KINDS, cluster_dict, profile_path


def main() -> None:
    from hpml_compile.driver import cost_graph
    from hpml_compile.ir import Cluster
    from hpml_compile.plan import Schedule
    from hpml_compile.profile import load_profile
    from hpml_compile.solve import _first_plan, microbatch_choices
    from hpml_compile.solve.candidates import Chain, Setting
    from hpml_compile.solve.dp import objective
    from hpml_compile.solve.lagrange import lagrangian_bounds
    from hpml_compile.solve.table import build_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=("llama-70b", "gpt2-xl"))
    ap.add_argument("--per", type=int, default=256, help="devices per kind")
    ap.add_argument("--kinds", type=int, default=3, help="number of kinds (of kinds.KINDS)")
    ap.add_argument("--bounds", type=float, default=2.0, help="wall seconds of bounds per count (0: none)")
    args = ap.parse_args()
    cluster = Cluster.from_dict(cluster_dict({k: args.per for k in KINDS[:args.kinds]}))
    _, graph = cost_graph(load_profile(profile_path(args.model)), cluster)
    chain = Chain.of(graph)
    print(f"{args.model} {args.kinds} x {args.per}")
    print(f"{'M':>3} {'first plan ms':>14} {'cpu s':>6} {'stages':>6} {'best plan ms':>14} {'bound ms':>14}")
    for m in microbatch_choices(graph.batch_size)[::-1]:
        st = Setting(m, Schedule.ONE_F_ONE_B, graph.batch_size)
        c0 = time.process_time()
        plan = _first_plan(chain, cluster, st)
        cpu = time.process_time() - c0
        line = f"{m:>3} {objective(plan, m) if plan else float('inf'):14,.0f} {cpu:6.2f} {len(plan or ()):>6}"
        if args.bounds > 0:
            b, _ = lagrangian_bounds(chain, cluster, st, build_table(chain, cluster, st), start=plan,
                                     deadline=time.perf_counter() + args.bounds)
            line += f" {b.upper:14,.0f} {b.lower:14,.0f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
