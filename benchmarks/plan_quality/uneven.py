"""Uneven data parallelism on mixed-kind clusters: today's best plan, the plan with mixed stages, peers, bound.

For each zoo model and each mixed-kind cluster (``hetero-4``, ``hetero-cpu``
and ``mix3-8``, 2 x A100-80GB + 3 x V100-32GB + 3 x T4 in ``mix3-8.json``
beside this file) it prints, all scored by the one simulator:

- ``ilp``: today's best plan (every stage on devices of one kind, equal rows);
- ``uneven``: what the driver now returns, the fastest of ``ilp`` and the
  candidates of :mod:`hpml_compile.solve.uneven` (stages mixing kinds, rows per
  replica chosen by :func:`hpml_compile.stagecost.choose_rows`), and which
  family won;
- the peers' partitioners where importable (DeepSpeed, torchgpipe, scored as
  in ``main.py``);
- ``bound``: :func:`main.compute_bound`, the whole step's compute (forward,
  backward, optimizer step) spread over every device in proportion to its
  speed, communication free; ``target``, half way from ``ilp`` to it;
- ``1-stage``: :func:`one_stage_floor`, below which no one-stage plan can go
  (where it is above ``target``, only a pipeline could meet the goal);
- ``closed``: the share of the distance from ``ilp`` to the bound that
  ``uneven`` closes (the goal: at least 0.5 where kinds can share a stage,
  never negative), and where ``uneven``'s step goes (:func:`parts`);
- ``fixed``: :func:`main.fixed_bound`, which charges each node's fixed part
  (a GPU's per-op cost) once per microbatch per replica, as the simulator
  does, and the share of the distance to it that ``uneven`` closes.

Run:
    python benchmarks/plan_quality/uneven.py            # ~5 min on 2 busy cores
    python benchmarks/plan_quality/uneven.py --quick    # gpt2-xl only
    python benchmarks/plan_quality/uneven.py --two-stage  # every 2-stage plan of gpt2-xl on hetero-4
Writes benchmarks/plan_quality/results/uneven.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from main import best_peer_plan, compute_bound, fixed_bound, graph_of, load_peers, write_result  # noqa: E402

import cost_models  # noqa: E402
from hpml_compile.cluster import link_spec, load_cluster  # noqa: E402
from hpml_compile.costgraph import CostGraph  # noqa: E402
from hpml_compile.errors import InfeasibleError  # noqa: E402
from hpml_compile.ir import Cluster  # noqa: E402
from hpml_compile.plan import Plan, Schedule  # noqa: E402
from hpml_compile.simulate import EventKind, simulate  # noqa: E402
from hpml_compile.stagecost import overlapped_ms, transfer_ms  # noqa: E402
from hpml_compile.solve import solve  # noqa: E402
from hpml_compile.solve.baselines import cut_points  # noqa: E402
from hpml_compile.solve.candidates import Chain  # noqa: E402
from hpml_compile.solve.mixed import build_plan  # noqa: E402
from hpml_compile.solve.uneven import improve  # noqa: E402

HERE = Path(__file__).parent
# (zoo name, batch): gpt2-xl at batch 32 is the reference pair (hetero-4: 919.5 ms against 799.0 ms)
MODELS = [("gpt2-xl", 32), ("gpt2-small", 32), ("resnet50", 64), ("llama-7b", 8), ("resnet50", 256), ("gpt2-small", 256)]
CLUSTERS = ["hetero-4", "hetero-cpu", str(HERE / "mix3-8.json")]


def parts(plan: Plan, graph: CostGraph) -> dict[str, float]:
    """Where a plan's simulated step goes: ``pipeline`` (0 to the end of the last backward: compute, bubble,
    replicas waiting for the slowest), ``sync`` (gradient and tied all-reduces past it) and ``optimizer``."""
    r = simulate(plan, graph)
    compute = (EventKind.FORWARD, EventKind.BACKWARD, EventKind.RECOMPUTE)
    pipe = max(b.end_ms for b in r.intervals if b.kind in compute)
    return {"pipeline": pipe, "sync": r.step_without_optimizer_ms - pipe,
            "optimizer": r.step_ms - r.step_without_optimizer_ms}


def one_stage_floor(graph: CostGraph, cluster: Cluster) -> float:
    """A lower bound on the simulated step of any one-stage plan (every device a replica of the whole model,
    ZeRO 0 to 3; no offload, compression or local SGD), over every subset of the devices.

    Such a plan's step is at least its forward and backward spread over its devices in proportion to their
    speed (``1 / sum 1 / W_i``), plus what follows the last backward. Under ZeRO-0: the last gradient bucket's
    all-reduce, which starts when the backward ends (:func:`hpml_compile.stagecost.overlapped_ms` with the
    rest hidden), and every replica stepping every parameter at the pace of the slowest kind (``max O_k``,
    the simulator's rule for a mixed stage). Under ZeRO-1 to 3: the shards' step (``max O_k / d``) after an
    all-gather of the parameters that no backward hides. Links: the fastest choice of the stage's first
    device, whose slowest link the simulator prices the group's collectives on.
    """
    everything = graph.total("param_bytes")
    devs = list(cluster.devices)
    best = float("inf")
    for mask in range(1, 2 ** len(devs)):
        sub = [d for i, d in enumerate(devs) if mask >> i & 1]
        compute = 1.0 / sum(1.0 / graph.total("", kind=d.kind) for d in sub)
        step = max(graph.optimizer_ms_per_byte(d.kind) for d in sub) * everything
        if len(sub) > 1:
            link = max((min((link_spec(cluster, a.name, b.name) for b in sub if b is not a), key=lambda x: x.gbps)
                        for a in sub), key=lambda x: x.gbps)
            last = overlapped_ms(cost_models.allreduce_ms, everything, link, len(sub), float("inf"))
            gather = transfer_ms(cost_models.all_gather_ms, everything, link, len(sub))
            step = min(last + step, gather + step / len(sub))
        best = min(best, compute + step)
    return best


def two_stage_best(graph: CostGraph, cluster: Cluster) -> tuple[Plan | None, int]:
    """The fastest two-stage plan by exhaustion: every ordered split of the devices into two groups (of any
    kinds), every boundary where a stage may end, every microbatch count leaving a row per replica, each
    stage with the first memory configuration that fits (:func:`hpml_compile.solve.mixed.build_plan`: ZeRO 0-2,
    recompute; rows by :func:`hpml_compile.stagecost.choose_rows`).

    Returns:
        The fastest plan (None if none fits) and how many plans fitted and were simulated.
    """
    points = cut_points(Chain.of(graph))
    names = [d.name for d in cluster.devices]
    batch = graph.batch_size
    best: tuple[float, Plan | None] = (float("inf"), None)
    fitted = 0
    for mask in range(1, 2 ** len(names) - 1):
        first = [x for i, x in enumerate(names) if mask >> i & 1]
        second = [x for x in names if x not in first]
        for m in (m for m in range(1, min(batch, 64) + 1) if batch % m == 0 and batch // m >= max(len(first),
                                                                                                    len(second))):
            for cut in points[1:-1]:
                plan = build_plan(graph, cluster, [first, second], [0, cut, len(graph.order)], m, Schedule.ONE_F_ONE_B,
                              "float32", "two-stage")
                if plan is not None:
                    fitted += 1
                    t = simulate(plan, graph).step_ms
                    if t < best[0]:
                        best = (t, plan)
    return best[1], fitted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="gpt2-xl only")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP and uneven-search time limit per pair")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "uneven.json")
    ap.add_argument("--two-stage", action="store_true",
                    help="only: every two-stage plan of gpt2-xl (batch 32) on hetero-4, the fastest (~1-2 min)")
    args = ap.parse_args()
    if args.two_stage:
        c4 = load_cluster("hetero-4")
        g = graph_of("gpt2-xl", 32, sorted({d.kind for d in c4.devices}))
        t0 = time.perf_counter()
        plan, fitted = two_stage_best(g, c4)
        shape = " | ".join(",".join(st.devices) + (f" rows {list(st.rows)}" if st.rows else "") for st in plan.stages) \
            if plan else "none fits"
        print(f"gpt2-xl (32) on hetero-4, every two-stage plan: {fitted} fit; the fastest "
              f"{simulate(plan, g).step_ms if plan else float('nan'):.5g} ms, M={plan.microbatches if plan else 0}: "
              f"{shape} ({time.perf_counter() - t0:.0f} s)")
        return
    t_start = time.time()
    peers, notes = load_peers()
    clusters = {load_cluster(c).name: load_cluster(c) for c in CLUSTERS}
    kinds = sorted({d.kind for c in clusters.values() for d in c.devices})
    head = (f"{'model':11s} {'cluster':11s} {'ilp ms':>9s} {'uneven ms':>10s} {'won':>15s} "
            + "".join(f"{p:>11s}" for p in peers)
            + f" {'bound ms':>9s} {'target':>8s} {'1-stage':>8s} {'closed':>7s} {'fixed':>8s} {'closed':>7s}"
            + f"  {'pipe+sync+opt':>20s}  uneven plan")
    print(head + "\n" + "-" * len(head))
    rows: list[dict[str, Any]] = []
    for name, batch in (MODELS[:1] if args.quick else MODELS):
        graph = graph_of(name, batch, kinds)
        for cname, cluster in clusters.items():
            row: dict[str, Any] = {"model": name, "batch": batch, "cluster": cname}
            t0 = time.perf_counter()
            try:
                base = solve(graph, cluster, solver="ilp", time_limit_s=args.time_limit)
            except InfeasibleError as e:
                print(f"{name:11s} {cname:11s} infeasible for every planner: {str(e).splitlines()[0][:90]}")
                rows.append({**row, "infeasible": str(e).splitlines()[0]})
                continue
            row["ilp_seconds"] = round(time.perf_counter() - t0, 2)
            t0 = time.perf_counter()
            got = improve(graph, cluster, base, time_limit_s=args.time_limit)
            row["uneven_seconds"] = round(time.perf_counter() - t0, 2)
            bound, fixed = compute_bound(graph, cluster), fixed_bound(graph, cluster)
            ilp, unev = base.predicted.step_ms, got.plan.predicted.step_ms
            split, floor = parts(got.plan, graph), one_stage_floor(graph, cluster)
            row.update(ilp_ms=ilp, uneven_ms=unev, won=got.chosen, candidates=got.tried, bound_ms=bound,
                       target_ms=(ilp + bound) / 2, one_stage_floor_ms=floor,
                       closed=(ilp - unev) / (ilp - bound) if ilp > bound else None, fixed_bound_ms=fixed,
                       closed_fixed=(ilp - unev) / (ilp - fixed) if ilp > fixed else None,
                       ilp_parts=parts(base, graph), uneven_parts=split,
                       plan=[{"devices": list(s.devices), "rows": list(s.rows), "zero": int(s.zero),
                              "recompute": s.recompute} for s in got.plan.stages],
                       microbatches=got.plan.microbatches)
            for p, fn in peers.items():
                try:
                    row[p] = best_peer_plan(graph, cluster, p, fn)[0].predicted.step_ms
                except InfeasibleError:
                    row[p] = None
            rows.append(row)
            shape = " | ".join(f"{','.join(s.devices)}" + (f" rows {list(s.rows)}" if s.rows else "")
                               for s in got.plan.stages)
            print(f"{name:11s} {cname:11s} {ilp:9.5g} {unev:10.5g} {got.chosen:>15s} "
                  + "".join(f"{row[p]:11.5g}" if row[p] else f"{'-':>11s}" for p in peers)
                  + f" {bound:9.5g} {row['target_ms']:8.5g} {floor:8.5g} "
                  + f"{row['closed'] if row['closed'] is not None else 0:7.2f} {fixed:8.5g} "
                  + f"{row['closed_fixed'] if row['closed_fixed'] is not None else 0:7.2f}  "
                  + f"{'+'.join(f'{split[k]:.4g}' for k in ('pipeline', 'sync', 'optimizer')):>20s}  "
                  + f"M={got.plan.microbatches}: {shape}", flush=True)
    write_result(args.out, t_start, {
        "benchmark": "plan_quality/uneven", "models": MODELS[:1] if args.quick else MODELS, "clusters": list(clusters),
        "time_limit_s": args.time_limit, "peers": list(peers), "notes": notes, "rows": rows})


if __name__ == "__main__":
    main()
