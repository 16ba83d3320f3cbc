"""The Lagrangian bound of one microbatch count with the memory classes capped, against every class kept.

One count ``M`` of ``--model`` (llama-70b) on ``kinds`` x ``per`` devices (the profiles and clusters of ``kinds.py``): its first
plan (``solve._first_plan``), then ``--wall`` seconds of ``lagrange.LagrangianRun`` on its table (stages under
``--cutoff``, the best plan known at any count), with the shortest paths' memory classes capped at ``--classes``
(``lagrange._Paths``' default is set for the run; the solver's own cap is ``lagrange.LAGRANGE_CLASSES``). Prints
every improvement (wall s, CPU s, lower, upper) and the end. Where the cap is below the classes the table needs,
the paths may break memory, so they are not plans and the bound can stall below the optimum.

Run:
    python benchmarks/solver_scaling/classes.py --classes 8      # the classes past 8 merged
    python benchmarks/solver_scaling/classes.py --classes 64     # after: every class
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
    from hpml_compile.solve import _first_plan, lagrange
    from hpml_compile.solve.bounds import exact_classes
    from hpml_compile.solve.candidates import Chain, Setting, classes
    from hpml_compile.solve.dp import objective
    from hpml_compile.solve.table import build_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-70b", choices=("llama-70b", "gpt2-xl"))
    ap.add_argument("--kinds", type=int, default=3)
    ap.add_argument("--per", type=int, default=256)
    ap.add_argument("-M", type=int, default=32, help="microbatch count")
    ap.add_argument("--classes", type=int, default=64, help="memory classes of the shortest paths")
    ap.add_argument("--wall", type=float, default=40.0, help="wall seconds of bounds")
    ap.add_argument("--cutoff", type=float, default=72466.0, help="best plan known at any count, ms")
    args = ap.parse_args()
    lagrange._Paths.__init__.__defaults__ = (args.classes,)
    cluster = Cluster.from_dict(cluster_dict({k: args.per for k in KINDS[:args.kinds]}))
    _, graph = cost_graph(load_profile(profile_path(args.model)), cluster)
    chain, m = Chain.of(graph), args.M
    st = Setting(m, Schedule.ONE_F_ONE_B, graph.batch_size)
    plan = _first_plan(chain, cluster, st)
    tab = build_table(chain, cluster, st, max_time=args.cutoff)
    print(f"classes {args.classes}; the table needs {exact_classes(tab, classes(st, len(cluster.devices)))}; "
          f"{len(tab)} candidates; first plan {objective(plan, m) if plan else float('inf'):,.2f} ms", flush=True)
    c0, t0 = time.process_time(), time.perf_counter()

    def say(lo: float, up: float, _: object) -> None:
        print(f"  {time.perf_counter() - t0:6.2f} s ({time.process_time() - c0:6.2f} CPU s): lower {lo:,.2f} "
              f"upper {up:,.2f}", flush=True)

    run = lagrange.LagrangianRun(chain, cluster, st, tab, start=plan, cutoff=lambda: args.cutoff, progress=say)
    b, _ = run.advance(time.perf_counter() + args.wall)
    print(f"end: lower {b.lower:,.2f} ms, upper {b.upper:,.2f} ms, {b.evaluations} shortest paths, "
          f"{time.process_time() - c0:.1f} CPU s", flush=True)


if __name__ == "__main__":
    main()
