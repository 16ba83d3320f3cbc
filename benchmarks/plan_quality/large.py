"""Large models on large clusters: the compute bound, ``ilp`` and the ``grid`` peer, under two per-op costs.

Each row places a model in bf16 (profiled on the meta device, every cost
predicted) on a cluster with :func:`hpml_compile.driver.plan`, the path
``hpml-compile plan`` runs, once with ``ilp`` and once with ``grid`` (what a
practitioner configures by hand in Megatron-LM or torchtitan: one
tensor-parallel degree for every stage, pipeline depth, data-parallel degree,
microbatches, ZeRO and recompute, searched: :mod:`hpml_compile.solve.grid`),
(``grid`` without the uneven-rows search that ``plan`` runs after a solver:
a mesh has equal rows), and prints their predicted steps beside two lower
bounds that hold for every
plan: ``compute`` (:func:`hpml_compile.certify.compute_bound`: the step's
compute spread over every device) and ``fixed`` (the certificate's bound,
which charges every node's per-op host cost once per microbatch per replica,
as the simulator does: no plan beats it).

Every row is priced twice. ``eager``: each op of a GPU costs the host 70 us
(``cost_models.EAGER_GPU_OP_MS``, measured on H100 hosts running eager fx
stages); that per-op cost does not shrink with the rows, so it favours deep
pipelines, whose stages each pay it for a part of the model only.
``compiled``: 5 us an op, an assumption for stages that run compiled
(fewer, fused launches; about the bare kernel launch of the CUDA C++ Best
Practices Guide), not a measurement.

Clusters: ``dgx-h100-8x8`` (8 hosts of 8 H100-80GB, NVLink 4 inside, one
InfiniBand NDR card per GPU), ``3x256`` (32 hosts each of 8 H100-80GB, 8
A100-80GB and 8 V100-32GB: NVLink 4 / 3 / 2 inside, InfiniBand NDR / HDR cards
one per GPU, 100 GbE cards one per two V100s), ``hetero-4`` and ``mix3-8``
(one host each, catalog links).

    python benchmarks/plan_quality/large.py            # every row, ~10 min on 2 busy cores
    python benchmarks/plan_quality/large.py --quick    # llama-7b on dgx-h100-8x8 only
    python benchmarks/plan_quality/large.py --schedule auto   # ilp under 1F1B, or ZB-H1 where faster
    python benchmarks/plan_quality/large.py --schedule auto --interleave   # interleaved 1F1B weighed too
    python benchmarks/plan_quality/large.py --schedule interleaved-1f1b    # the ilp pipeline interleaved
    python benchmarks/plan_quality/large.py --only llama-70b:3x256   # one model on one cluster

``bubble``: the share of the ilp plan's step its stages sit idle in the pipeline (the simulator's bubble).
``--schedule`` (``1f1b``, the default; ``zb-h1``; ``auto``: ZB-H1 on the ilp placement where it simulates
faster and runs, :func:`hpml_compile.driver.faster_schedule`; ``interleaved-1f1b``: the ilp pipeline's device
groups holding several chunks each, :mod:`hpml_compile.solve.interleave`) sets the ilp plan's schedule;
``--interleave`` lets ``auto`` weigh interleaved 1F1B too. ``sched`` names the chunks (``ilv x3``).

Writes ``results/large.json`` (with the commit and date). Predictions are
deterministic: the machine's load changes only the solver's seconds.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path
from typing import Any

from hpml_compile import driver, models
from hpml_compile.certify import compute_bound
from hpml_compile.cluster import load_cluster
from hpml_compile.errors import HpmlError
from hpml_compile.ir import Cluster, Device, Host, Profile
from hpml_compile.profile import predict_kinds, profile
from hpml_compile.schema import write_json_atomic

HERE = Path(__file__).parent
#: llama-7b at 64 x 2048 tokens, llama-70b at 512 x 2048.
MODELS = (("llama-7b", 64), ("llama-70b", 512))
#: The per-op host cost of a compiled stage, an assumption (seconds of the host per op, in ms).
COMPILED_OP_MS = 0.005
#: The issue's goals, as ratios of the step to the compute bound.
GOALS = {("llama-7b", "dgx-h100-8x8"): 1.7, ("llama-70b", "3x256"): 1.9}


def three_by_256() -> Cluster:
    """32 hosts of each of H100-80GB, A100-80GB and V100-32GB, 8 GPUs a host (module docstring)."""
    spec = (("H100-80GB", 80, "nvlink4", "ib-ndr", 8), ("A100-80GB", 80, "nvlink3", "ib-hdr", 8),
            ("V100-32GB", 32, "nvlink2", "eth100", 4))
    devices, hosts = [], []
    for kind, gib, fabric, nic, nics in spec:
        for h in range(32):
            name = f"{kind.split('-')[0].lower()}-{h}"
            hosts.append(Host(name, fabric, nic, nics))
            devices += [Device(f"gpu{len(devices) + i}", kind, gib, name) for i in range(8)]
    return Cluster(tuple(devices), name="3x256", hosts=tuple(hosts))


def clusters(quick: bool) -> dict[str, Cluster]:
    """The clusters of the table."""
    if quick:
        return {"dgx-h100-8x8": load_cluster("dgx-h100-8x8")}
    return {"dgx-h100-8x8": load_cluster("dgx-h100-8x8"), "3x256": three_by_256(),
            "hetero-4": load_cluster("hetero-4"), "mix3-8": load_cluster(str(HERE / "mix3-8.json"))}


def model_profile(name: str, batch: int, kinds: list[str], op_ms: float | None) -> Profile:
    """``name`` profiled on the meta device in bf16, costs predicted for ``kinds`` with the per-op cost ``op_ms``
    (None: the catalog's eager cost)."""
    m = models.load(name, batch_size=batch, device="meta")
    p = profile(m.module, m.example_inputs, name=name, device_kinds=[], batch_size=batch, seq_len=m.seq_len,
                progress=False, precision="bf16")
    return predict_kinds(p, kinds, op_ms=op_ms)


def _shape(plan: Any) -> str:
    """``2 x (tp 4 x 8) ZeRO-1 | ...``: each stage's devices, kind, tp and ZeRO stage."""
    parts = []
    for st in plan.stages:
        kind = plan.cluster.device(st.devices[0]).kind.split("-")[0]
        parts.append(f"{kind} tp{st.tp}x{st.replicas}" + (f" Z{int(st.zero)}" if st.zero else "")
                     + (" rc" if st.recompute else ""))
    runs: list[list[Any]] = []
    for p in parts:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return " | ".join(f"{n} x [{p}]" if n > 1 else p for p, n in runs) + f", M={plan.microbatches}"


def row(prof: Profile, cluster: Cluster, time_limit: float, schedule: str = "1f1b",
        interleave: bool | None = None) -> dict[str, Any]:
    """``ilp`` (under ``schedule``) and ``grid`` for one profile and cluster, with the bounds."""
    graph = driver.cost_graph(prof, cluster)[1]
    out: dict[str, Any] = {"compute_bound_ms": compute_bound(graph, cluster)}
    for solver in ("ilp", "grid"):
        t0 = time.perf_counter()
        try:
            # grid is the mesh a user configures: no uneven rows after it (ilp runs as `plan` runs it)
            plan = driver.plan(prof, cluster, driver.Options(solver=solver, time_limit_s=time_limit,
                                                             uneven=solver != "grid",
                                                             schedule=schedule if solver == "ilp" else None,
                                                             interleave=interleave if solver == "ilp" else None))
        except HpmlError as e:
            out[solver] = {"step_ms": None, "note": str(e).splitlines()[0][:200]}
            continue
        out[solver] = {"step_ms": plan.predicted.step_ms, "shape": _shape(plan), "seconds": time.perf_counter() - t0,
                       "bubble": plan.predicted.bubble, "schedule": plan.schedule.value, "chunks": plan.chunks}
        if plan.certificate is not None and plan.certificate.bound_ms:
            out["fixed_bound_ms"] = plan.certificate.bound_ms
    return out


def _ms(x: float | None) -> str:
    return f"{x:9.1f}" if x else f"{'-':>9s}"


def _line(r: dict[str, Any]) -> str:
    """One row of the printed table."""
    ilp, ratio, grid = r["ilp"], r["ilp_vs_compute"], r["grid_vs_ilp"]
    bubble = f"{ilp['bubble']:.1%}" if ilp.get("bubble") is not None else "-"
    return (f"{r['model']:10s} {r['cluster']:13s} {r['per_op']:9s} {_ms(r['compute_bound_ms'])} "
            f"{_ms(r.get('fixed_bound_ms'))} {_ms(ilp['step_ms'])} {(f'{ratio:.2f}x' if ratio else 'infeas.'):>8s} "
            f"{bubble:>7s} {_sched(ilp):>6s} "
            f"{_ms(r['grid']['step_ms'])} {(f'{grid:.2f}x' if grid else '-'):>8s}  "
            f"{ilp.get('shape', ilp.get('note', ''))}; {r['grid'].get('shape', r['grid'].get('note', ''))}")


def _sched(r: dict[str, Any]) -> str:
    """The schedule column: ``1f1b``, ``zb-h1``, or ``ilv x3`` for interleaved 1F1B with 3 chunks."""
    if r.get("chunks", 1) > 1:
        return f"ilv x{r['chunks']}"
    return str(r.get("schedule", "-"))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="llama-7b on dgx-h100-8x8 only")
    ap.add_argument("--time-limit", type=float, default=30.0, help="each solve's time limit, seconds")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "large.json")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "zb-h1", "interleaved-1f1b", "auto"],
                    help="the ilp plan's schedule (auto: ZB-H1 on its placement where faster)")
    ap.add_argument("--interleave", action="store_true",
                    help="let --schedule auto weigh interleaved 1F1B on the ilp plan's device groups too")
    ap.add_argument("--only", metavar="MODEL:CLUSTER", help="the rows of one model on one cluster "
                    "(e.g. llama-70b:3x256)")
    args = ap.parse_args()
    cs = clusters(args.quick)
    models_ = MODELS[:1] if args.quick else MODELS
    if args.only:
        name, _, cname = args.only.partition(":")
        models_ = tuple(m for m in models_ if m[0] == name)
        if not models_ or cname not in cs:
            ap.error(f"--only {args.only}: give MODEL:CLUSTER, MODEL one of {[m for m, _ in MODELS]}, CLUSTER one "
                     f"of {sorted(cs)}")
        cs = {cname: cs[cname]}
    kinds = sorted({d.kind for c in cs.values() for d in c.devices})
    rows: list[dict[str, Any]] = []
    head = (f"{'model':10s} {'cluster':13s} {'per-op':9s} {'compute':>9s} {'fixed':>9s} {'ilp':>9s} {'ilp/cmp':>8s} "
            f"{'bubble':>7s} {'sched':>6s} "
            f"{'grid':>9s} {'grid/ilp':>8s}  ilp plan; grid plan")
    print(head + "\n" + "-" * len(head), flush=True)
    for name, batch in models_:
        for label, op_ms in (("eager", None), ("compiled", COMPILED_OP_MS)):
            prof = model_profile(name, batch, kinds, op_ms)
            for cname, cluster in cs.items():
                r = {"model": name, "batch": batch, "cluster": cname, "per_op": label,
                     "op_us": (op_ms if op_ms is not None else 0.070) * 1e3,
                     **row(prof, cluster, args.time_limit, args.schedule, args.interleave or None)}
                ilp, grid = r["ilp"]["step_ms"], r["grid"]["step_ms"]
                r["ilp_vs_compute"] = ilp / r["compute_bound_ms"] if ilp else None
                r["grid_vs_ilp"] = grid / ilp if ilp and grid else None
                goal = GOALS.get((name, cname))
                if goal is not None:
                    r["goal"] = goal
                    r["goal_reachable"] = r.get("fixed_bound_ms", 0.0) / r["compute_bound_ms"] <= goal
                rows.append(r)

                print(_line(r), flush=True)
    print("compute: the step's compute spread over every device; fixed: the certificate's bound (per-op costs "
          "charged per microbatch per replica): no plan is faster than either. A goal whose ratio is below "
          "fixed/compute is out of reach under that per-op cost.")
    write_json_atomic({"commit": _commit(), "date": time.strftime("%Y-%m-%d"), "schedule": args.schedule,
                       "interleave": args.interleave,
                       "rows": rows}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
