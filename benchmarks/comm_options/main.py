"""Communication options: bytes, step time and loss of flat, PowerSGD, Top-K and local SGD, measured and predicted.

One run on 2 gloo ranks of this machine (2 cores: 2 ranks, not the issue's 2
simulated hosts x 2 ranks; hierarchical all-reduce is another helper's part)
trains the ``mlp`` zoo model (8 x Linear 1024, 7.9M parameters, 31.5 MB of
fp32 gradients) data-parallel, one stage on both ranks, AdamW, from the same
seed on the same batches (four batches of 64 rows, cycled, labels from a fixed
random linear teacher: the loss is a training loss), under each option:

- flat: the plain all-reduce;
- PowerSGD rank 2 and 4 (torch's hook: two plain all-reduce steps first);
- Top-K ratio 0.1 and 0.01, with error feedback;
- local SGD with H = 4 and 16 (after 2 steps of per-step sync).

Per option: the bytes each rank put into the gradient sync per step (mean over
the run: local SGD's averages amortised), the measured step (median after
warm-up, the slower rank), the plan's predicted step on these ranks, and the
loss after N steps (and its mean over the last 5 steps, less noisy).

Then, from a profile of the same model at a batch of 1024 (A100 costs
predicted from FLOPs and bytes), the predicted step of the same options for a
data-parallel plan of the model over all 16 GPUs of ``2node-a100-16`` and of
the same two hosts joined by 10 GbE (cost_models' ``eth10``), and the solver's
plan (``dp`` solver) for each cluster with compression not allowed against
allowed (``--allow-compress topk:0.01`` and ``powersgd:4``).

Run:  .venv/bin/python benchmarks/comm_options/main.py [--steps 40]
Prints the tables; writes benchmarks/comm_options/results/comm_options.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hpml_compile import driver, models
from hpml_compile.cluster import load_cluster
from hpml_compile.codegen import generate
from hpml_compile.costgraph import build as build_costgraph
from hpml_compile.ir import Cluster, Link
from hpml_compile.plan import Plan, Schedule, Stage, with_comm
from hpml_compile.profile import predict_kinds, profile
from hpml_compile.schema import write_json_atomic
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.simulate import annotate
from hpml_compile.trace import trace

MODEL = "mlp"
OPTIONS: dict[str, dict[str, Any]] = {
    "flat": {},
    "powersgd:2": {"compress": "powersgd:2"},
    "powersgd:4": {"compress": "powersgd:4"},
    "topk:0.1": {"compress": "topk:0.1"},
    "topk:0.01": {"compress": "topk:0.01"},
    "local H=4": {"sync_every": 4, "sync_warmup": 2},
    "local H=16": {"sync_every": 16, "sync_warmup": 2},
}
ALLOW = ("topk:0.01", "powersgd:4")
WARMUP = 3  # steps left out of the step-time median (PowerSGD's plain steps, first-touch of buffers)


def _batches(n: int, rows: int, distinct: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` steps' batches: ``distinct`` batches of 512 features, cycled, labelled by a fixed random linear teacher
    (10 classes). The 8-layer MLP barely moves on fresh batches in 40 steps; on a few cycled ones it learns."""
    g = torch.Generator().manual_seed(7)
    teacher = torch.randn(512, 10, generator=g)
    pool = []
    for _ in range(distinct):
        x = torch.randn(rows, 512, generator=g)
        pool.append((x, (x @ teacher).argmax(1)))
    return [pool[i % distinct] for i in range(n)]


def _worker(rank: int, world: int, build: str, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for name, opts in OPTIONS.items():
        loaded = models.load(MODEL, seed=0)
        pipe = Pipeline.from_build(build, loaded.module, comm_options=opts or None,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        rows = loaded.example_inputs[0].shape[0]
        losses = [pipe.step((x,), y, loaded.loss_fn).item() for x, y in _batches(steps, rows)]
        m = pipe.metrics
        report[name] = {"losses": losses, "step_ms": [r.step_ms for r in m], "allreduce_ms": [r.allreduce_ms for r in m],
                        "optimizer_ms": [r.optimizer_ms for r in m], "sync_bytes": [r.sync_bytes for r in m],
                        "dense_bytes": [r.sync_dense_bytes for r in m]}
        pipe.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def _ten_gbe() -> Cluster:
    """``2node-a100-16`` with its two hosts joined by 10 GbE (every cross-host pair a 1.25 GB/s link)."""
    c = load_cluster("2node-a100-16")
    hosts: dict[str, list[str]] = {}
    for d in c.devices:
        hosts.setdefault(d.host, []).append(d.name)
    a, b = list(hosts.values())
    links = tuple(Link(x, y, 1.25, 25.0) for x in a for y in b)
    return Cluster(devices=c.devices, links=links, name="2node-a100-16-10gbe")


def _describe(plan: Plan) -> str:
    parts = [f"{len(st.devices)}x" + (f"[{st.compress}]" if st.compress else "") for st in plan.stages]
    return f"{len(plan.stages)} stage(s) " + " | ".join(parts) + f", M={plan.microbatches}"


def _predictions(prof: Any) -> dict[str, Any]:
    """Predicted steps of each option (data parallel over 16 GPUs) and the solver's choices, per cluster."""
    gpu = predict_kinds(prof, ["cpu", "A100-80GB"])
    out: dict[str, Any] = {}
    for cluster in (load_cluster("2node-a100-16"), _ten_gbe()):
        _, graph = driver.cost_graph(gpu, cluster)
        every = tuple(n.name for n in gpu.nodes)
        dp = Plan(MODEL, cluster, Schedule.ONE_F_ONE_B, 1, (Stage(0, tuple(d.name for d in cluster.devices), every),))
        options = {name: annotate(with_comm(dp, **opts), graph, gpu.dtype)[0].predicted.step_ms
                   for name, opts in OPTIONS.items()}
        solver: dict[str, Any] = {}
        for allow in (None, *ALLOW):
            p = driver.plan(gpu, cluster, driver.Options(solver="dp", allow_compress=allow))
            solver[allow or "not allowed"] = {"step_ms": p.predicted.step_ms, "plan": _describe(p)}
        out[cluster.name] = {"dp16": options, "solver": solver}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="training steps per option (default %(default)s)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="hpml-comm-options-"))
    torch.set_num_threads(1)  # what each rank has: profile at it
    loaded = models.load(MODEL, seed=0)
    print(f"profiling {MODEL} at 1 thread ...", file=sys.stderr, flush=True)
    prof = profile(loaded.module, loaded.example_inputs, name=MODEL, repeats=5, warmup=2, progress=False,
                   loss_fn=loaded.loss_fn, targets=loaded.example_targets)
    graph = build_costgraph(prof)
    every = tuple(n.name for n in prof.nodes)
    local = Plan(MODEL, load_cluster("local-cpu-2"), Schedule.ONE_F_ONE_B, 1, (Stage(0, ("cpu0", "cpu1"), every),))
    predicted = {name: annotate(with_comm(local, **opts), graph)[0].predicted.step_ms for name, opts in OPTIONS.items()}
    gm = trace(loaded.module, loaded.example_inputs)
    generate(gm, annotate(local, graph)[0], root / "build", profile=prof)
    print(f"training {len(OPTIONS)} options x {args.steps} steps on 2 gloo ranks ...", file=sys.stderr, flush=True)
    spawn_ranks(_worker, 2, root, str(root / "build"), args.steps, str(root), timeout_s=3000)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    rows = []
    for name in OPTIONS:
        a, b = ranks[0][name], ranks[1][name]
        step = statistics.median(max(x, y) for x, y in list(zip(a["step_ms"], b["step_ms"]))[WARMUP:])
        rows.append({"option": name, "bytes_per_step": statistics.mean(a["sync_bytes"]),
                     "dense_bytes_per_step": statistics.mean(a["dense_bytes"]),
                     "measured_step_ms": step, "predicted_step_ms": predicted[name],
                     "sync_ms": statistics.median(a["allreduce_ms"][WARMUP:]),
                     "loss_final": a["losses"][-1], "loss_last5": statistics.mean(a["losses"][-5:]),
                     "losses": a["losses"]})
    big = models.load(MODEL, batch_size=1024, seed=0)
    print("profiling it at a batch of 1024 for the GPU predictions ...", file=sys.stderr, flush=True)
    remote = _predictions(profile(big.module, big.example_inputs, name=MODEL, repeats=1, warmup=0, progress=False,
                                  loss_fn=big.loss_fn, targets=big.example_targets))
    flat = rows[0]
    print(f"{MODEL} ({sum(p.numel() for p in loaded.module.parameters()) / 1e6:.1f}M parameters), data parallel on 2 "
          f"gloo ranks of this host (1 thread each), AdamW lr 1e-3, {args.steps} steps; step: median after {WARMUP}, "
          "slower rank; bytes: what a rank put into the gradient sync per step (mean over the run)")
    print(f"  {'option':12s} {'bytes/step':>11s} {'vs flat':>8s} {'pred ms':>8s} {'meas ms':>8s} {'error':>7s} "
          f"{'sync ms':>8s} {'loss@N':>7s} {'last5':>7s} {'vs flat':>8s}")
    for r in rows:
        err = (r["measured_step_ms"] - r["predicted_step_ms"]) / r["predicted_step_ms"]
        print(f"  {r['option']:12s} {r['bytes_per_step'] / 1e6:9.2f}MB {r['bytes_per_step'] / flat['bytes_per_step']:8.1%} "
              f"{r['predicted_step_ms']:8.1f} {r['measured_step_ms']:8.1f} {err:+7.1%} {r['sync_ms']:8.1f} "
              f"{r['loss_final']:7.4f} {r['loss_last5']:7.4f} {r['loss_last5'] - flat['loss_last5']:+8.4f}")
    for cname, res in remote.items():
        print(f"{cname}: predicted step of a data-parallel plan over all 16 GPUs (batch 1024), per option")
        print("  " + "  ".join(f"{k}: {v:.2f} ms" for k, v in res["dp16"].items()))
        for allow, s in res["solver"].items():
            print(f"  solver (dp), compression {allow if allow == 'not allowed' else 'allowed: ' + allow}: "
                  f"{s['step_ms']:.2f} ms, {s['plan']}")
    result = {"model": MODEL, "steps": args.steps, "ranks": 2, "warmup_skipped": WARMUP, "rows": rows,
              "predicted_elsewhere": remote, "host": {"cpu": platform.processor() or platform.machine(),
                                                      "cpus": os.cpu_count(), "load_average": os.getloadavg()},
              "seconds": time.perf_counter() - t0}
    out = Path(__file__).resolve().parent / "results" / "comm_options.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(result, out)
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
