"""Communication options on 2 simulated hosts x 2 ranks: bytes, step time and loss, measured and predicted.

One run of two torchrun agents (``--nnodes 2 --nproc-per-node 2``: two
simulated hosts of two gloo ranks each, on this machine, as
tests/dist/test_hierarchical_dist.py runs them) trains a small MLP
(4 x Linear 512 + GELU, 256 inputs, 10 classes: 0.92M parameters, 3.7 MB of
fp32 gradients) data-parallel, one stage on all four ranks, AdamW, from the
same seed on the same batches (four batches of 64 rows, cycled, labels from a
fixed random linear teacher: the loss is a training loss), under each option:

- flat: the plain all-reduce over the four ranks;
- hierarchical: the same stage with ``allreduce: hierarchical`` (reduce-scatter
  inside each host, all-reduce between them, all-gather inside);
- hier ZeRO-1: the same stage with ZeRO-1 and ``allreduce: hierarchical`` (the
  optimizer sharded over the two ranks of each host: reduce-scatter inside,
  all-reduce of the shard between hosts, AdamW on the shard, all-gather of
  the parameters inside; after the backward on these CPU ranks);
- PowerSGD rank 2 and 4 (torch's hook: two plain all-reduce steps first);
- Top-K ratio 0.1 and 0.01, with error feedback;
- local SGD with H = 4 and 16 (after 2 steps of per-step sync).

Per option: the bytes each rank put into the gradient sync per step (mean over
the run: local SGD's averages amortised; for hierarchical, the bytes of each
level as the runtime counted them, against a flat ring's), the measured step
(median after warm-up, the slowest rank), the plan's predicted step on the
same two-host cluster (every link the loopback's, which is what joins the
simulated hosts), and the loss after N steps (and its mean over the last 5).
Four ranks share this machine's cores: with fewer cores than ranks the
measured steps carry the contention the prediction does not (say so when
quoting them).

Then, from a profile of the ``mlp`` zoo model (7.9M parameters) at a batch of
1024 (A100 costs predicted from FLOPs and bytes), the predicted step of the
same options for a data-parallel plan of the model over all 16 GPUs of
``2node-a100-16`` and of the same two hosts joined by 10 GbE (cost_models'
``eth10``), and the solver's plan (``dp`` solver) for each cluster with
compression not allowed against allowed (``--allow-compress topk:0.01`` and
``powersgd:4``).

Run:  .venv/bin/python benchmarks/comm_options/main.py [--steps 40]
Prints the tables; writes benchmarks/comm_options/results/comm_options.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hpml_compile import driver, models
from hpml_compile.cluster import link_spec, load_cluster
from hpml_compile.codegen import generate
from hpml_compile.costgraph import build as build_costgraph
from hpml_compile.ir import Cluster, Device, Link
from hpml_compile.memory import ZeroStage
from hpml_compile.models.mlp import MLP, MLPConfig, loss
from hpml_compile.plan import AllReduce, Plan, Schedule, Stage, with_comm
from hpml_compile.profile import predict_kinds, profile
from hpml_compile.runtime.job.launcher import free_port
from hpml_compile.schema import write_json_atomic
from hpml_compile.simulate import annotate
from hpml_compile.trace import trace

MODEL = "mlp"  # the zoo model of the GPU predictions
SMALL = MLPConfig(d_in=256, width=512, depth=4, n_classes=10)  # what the four ranks train
ROWS = 64
OPTIONS: dict[str, dict[str, Any]] = {
    "flat": {},
    "hierarchical": {},  # the hierarchical build, no other option
    "hier ZeRO-1": {},  # the hierarchical ZeRO-1 build (optimizer sharded over each host's 2 ranks), no other option
    "powersgd:2": {"compress": "powersgd:2"},
    "powersgd:4": {"compress": "powersgd:4"},
    "topk:0.1": {"compress": "topk:0.1"},
    "topk:0.01": {"compress": "topk:0.01"},
    "local H=4": {"sync_every": 4, "sync_warmup": 2},
    "local H=16": {"sync_every": 16, "sync_warmup": 2},
}
ALLOW = ("topk:0.01", "powersgd:4")
WARMUP = 3  # steps left out of the step-time median (PowerSGD's plain steps, first-touch of buffers)
HOSTS = ("hostA", "hostB")


def mlp() -> MLP:
    """The benchmark's model, the same weights on every rank."""
    torch.manual_seed(0)
    return MLP(SMALL)


def batches(n: int, distinct: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` steps' batches: ``distinct`` batches of ``ROWS`` rows, cycled, labelled by a fixed random linear teacher
    (10 classes): on a few cycled batches the MLP learns in a few dozen steps."""
    g = torch.Generator().manual_seed(7)
    teacher = torch.randn(SMALL.d_in, 10, generator=g)
    pool = []
    for _ in range(distinct):
        x = torch.randn(ROWS, SMALL.d_in, generator=g)
        pool.append((x, (x @ teacher).argmax(1)))
    return [pool[i % distinct] for i in range(n)]


def two_hosts() -> Cluster:
    """cpu0-1 on hostA, cpu2-3 on hostB, every pair joined by this machine's loopback (what joins them here)."""
    devs = tuple(Device(f"cpu{i}", "cpu", 4.0, host=HOSTS[i // 2]) for i in range(4))
    lo = link_spec(load_cluster("local-cpu-2"), "cpu0", "cpu1")
    links = tuple(Link(a.name, b.name, lo.gbps, lo.latency_us, shared=lo.shared, source="loopback (local-cpu-2)")
                  for i, a in enumerate(devs) for b in devs[i + 1:])
    return Cluster(devices=devs, links=links, name="two-hosts-loopback")


def _ten_gbe() -> Cluster:
    """``2node-a100-16`` with its two hosts joined by 10 GbE (every cross-host pair a 1.25 GB/s link)."""
    c = load_cluster("2node-a100-16")
    hosts: dict[str, list[str]] = {}
    for d in c.devices:
        hosts.setdefault(d.host, []).append(d.name)
    a, b = list(hosts.values())
    links = tuple(Link(x, y, 1.25, 25.0) for x in a for y in b)
    return Cluster(devices=c.devices, links=links, name="2node-a100-16-10gbe")


def option_plan(dp: Plan, name: str) -> Plan:
    """``dp`` (one stage on every device) under option ``name``."""
    if name == "hierarchical":
        return replace(dp, stages=tuple(replace(st, allreduce=AllReduce.HIERARCHICAL) for st in dp.stages))
    if name == "hier ZeRO-1":
        return replace(dp, stages=tuple(replace(st, zero=ZeroStage.OS, allreduce=AllReduce.HIERARCHICAL)
                                        for st in dp.stages))
    return with_comm(dp, **OPTIONS[name])


def _describe(plan: Plan) -> str:
    parts = [f"{len(st.devices)}x" + (f"[{st.compress}]" if st.compress else "")
             + (f"[ZeRO-{int(st.zero)}]" if st.zero else "")
             + ("[hier]" if st.allreduce is AllReduce.HIERARCHICAL else "") for st in plan.stages]
    return f"{len(plan.stages)} stage(s) " + " | ".join(parts) + f", M={plan.microbatches}"


def _predictions(prof: Any) -> dict[str, Any]:
    """Predicted steps of each option (data parallel over 16 GPUs) and the solver's choices, per cluster."""
    gpu = predict_kinds(prof, ["cpu", "A100-80GB"])
    out: dict[str, Any] = {}
    for cluster in (load_cluster("2node-a100-16"), _ten_gbe()):
        _, graph = driver.cost_graph(gpu, cluster)
        every = tuple(n.name for n in gpu.nodes)
        dp = Plan(MODEL, cluster, Schedule.ONE_F_ONE_B, 1, (Stage(0, tuple(d.name for d in cluster.devices), every),))
        options = {name: annotate(option_plan(dp, name), graph, gpu.dtype)[0].predicted.step_ms for name in OPTIONS}
        solver: dict[str, Any] = {}
        for allow in (None, *ALLOW):
            p = driver.plan(gpu, cluster, driver.Options(solver="dp", allow_compress=allow))
            solver[allow or "not allowed"] = {"step_ms": p.predicted.step_ms, "plan": _describe(p)}
        out[cluster.name] = {"dp16": options, "solver": solver}
    return out


def _run_agents(flat: Path, hier: Path, hzero: Path, steps: int, out: Path) -> None:
    """Two torchrun agents of two ranks each on this machine: the two simulated hosts."""
    root = Path(__file__).resolve().parents[2]
    endpoint = f"localhost:{free_port()}"
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    worker = Path(__file__).with_name("comm_worker.py")
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                                "--rdzv-backend=static", f"--rdzv-endpoint={endpoint}", "--nproc-per-node=2",
                                str(worker), str(flat), str(hier), str(hzero), str(steps), str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
              for node in (1, 0)]
    try:
        results = [a.communicate(timeout=3000) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    if any(a.returncode for a in agents):
        raise SystemExit("a torchrun agent failed:\n" + "\n".join(r[1][-3000:] for r in results))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="training steps per option (default %(default)s)")
    p.add_argument("--no-gpu-predictions", action="store_false", dest="gpu", help="skip the 2node-a100-16 part")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="hpml-comm-options-"))
    torch.set_num_threads(1)  # what each rank has: profile at it
    model, (x, y) = mlp(), batches(1)[0]
    print(f"profiling the {sum(q.numel() for q in model.parameters()) / 1e6:.2f}M-parameter MLP at 1 thread ...",
          file=sys.stderr, flush=True)
    prof = profile(model, (x,), name="mlp-comm", repeats=5, warmup=2, progress=False, loss_fn=loss, targets=y)
    # the two simulated hosts are this one machine: each has half of its cores, so that the simulator shares them
    # among the host's two ranks as they are shared here (hpml_compile.simulate: ranks beyond a host's cores)
    graph = build_costgraph(prof)
    graph = replace(graph, cores={k: max(1, c // 2) for k, c in graph.cores.items()})
    every = tuple(n.name for n in prof.nodes)
    cluster = two_hosts()
    dp = Plan("mlp-comm", cluster, Schedule.ONE_F_ONE_B, 1, (Stage(0, tuple(d.name for d in cluster.devices), every),))
    plans = {name: annotate(option_plan(dp, name), graph)[0] for name in OPTIONS}
    gm = trace(model, (x,))
    generate(gm, plans["flat"], root / "flat", profile=prof)
    generate(gm, plans["hierarchical"], root / "hier", profile=prof)
    generate(gm, plans["hier ZeRO-1"], root / "hzero", profile=prof)
    print(f"training {len(OPTIONS)} options x {args.steps} steps on 2 simulated hosts x 2 gloo ranks ...",
          file=sys.stderr, flush=True)
    load0 = os.getloadavg()
    t1 = time.perf_counter()
    _run_agents(root / "flat", root / "hier", root / "hzero", args.steps, root)
    train_s = time.perf_counter() - t1
    load1 = os.getloadavg()
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(4)]
    rows = []
    for name in OPTIONS:
        per = [rk[name] for rk in ranks]
        step = statistics.median(max(xs) for xs in list(zip(*(a["step_ms"] for a in per)))[WARMUP:])
        a = per[0]
        row = {"option": name, "bytes_per_step": statistics.mean(a["sync_bytes"]),
               "dense_bytes_per_step": statistics.mean(a["dense_bytes"]),
               "measured_step_ms": step, "predicted_step_ms": plans[name].predicted.step_ms,
               "sync_ms": statistics.median(max(xs) for xs in list(zip(*(q["allreduce_ms"] for q in per)))[WARMUP:]),
               "loss_final": a["losses"][-1], "loss_last5": statistics.mean(a["losses"][-5:]), "losses": a["losses"],
               "same_loss_on_every_rank": all(q["losses"] == a["losses"] for q in per),
               "hierarchical_groups": a["hierarchical"]}
        if name in ("hierarchical", "hier ZeRO-1"):
            row.update(intra_bytes_per_step=statistics.mean(a["intra_bytes"]),
                       inter_bytes_per_step=statistics.mean(a["inter_bytes"]),
                       flat_ring_bytes_per_step=statistics.mean(a["flat_bytes"]))
        rows.append(row)
    remote: dict[str, Any] = {}
    if args.gpu:
        big = models.load(MODEL, batch_size=1024, seed=0)
        print("profiling the mlp zoo model at a batch of 1024 for the GPU predictions ...", file=sys.stderr, flush=True)
        remote = _predictions(profile(big.module, big.example_inputs, name=MODEL, repeats=1, warmup=0,
                                      progress=False, loss_fn=big.loss_fn, targets=big.example_targets))
    flat = rows[0]
    print(f"MLP {SMALL.d_in}-{SMALL.width}x{SMALL.depth}-{SMALL.n_classes} "
          f"({sum(q.numel() for q in model.parameters()) / 1e6:.2f}M parameters), data parallel on 2 simulated hosts "
          f"x 2 gloo ranks (two torchrun agents, 1 thread each, {os.cpu_count()} cores), AdamW lr 1e-3, batch {ROWS}, "
          f"{args.steps} steps; step: median after {WARMUP}, slowest rank; bytes: what a rank put into the gradient "
          f"sync per step (mean over the run); load average {load0[0]:.1f} before, {load1[0]:.1f} after")
    print(f"  {'option':12s} {'bytes/step':>11s} {'vs flat':>8s} {'pred ms':>8s} {'meas ms':>8s} {'error':>7s} "
          f"{'sync ms':>8s} {'loss@N':>7s} {'last5':>7s} {'vs flat':>8s}")
    for r in rows:
        err = (r["measured_step_ms"] - r["predicted_step_ms"]) / r["predicted_step_ms"]
        print(f"  {r['option']:12s} {r['bytes_per_step'] / 1e6:9.3f}MB {r['bytes_per_step'] / flat['bytes_per_step']:8.1%} "
              f"{r['predicted_step_ms']:8.1f} {r['measured_step_ms']:8.1f} {err:+7.1%} {r['sync_ms']:8.1f} "
              f"{r['loss_final']:7.4f} {r['loss_last5']:7.4f} {r['loss_last5'] - flat['loss_last5']:+8.4f}")
    h = next(r for r in rows if r["option"] == "hierarchical")
    print(f"hierarchical, as the runtime counted it per rank and step: {h['inter_bytes_per_step'] / 1e6:.3f} MB between "
          f"the hosts + {h['intra_bytes_per_step'] / 1e6:.3f} MB inside; a flat ring: "
          f"{h['flat_ring_bytes_per_step'] / 1e6:.3f} MB (groups made: {h['hierarchical_groups']}); step measured "
          f"{h['measured_step_ms']:.1f} ms against {h['predicted_step_ms']:.1f} ms predicted (flat: "
          f"{flat['measured_step_ms']:.1f} against {flat['predicted_step_ms']:.1f})")
    z = next(r for r in rows if r["option"] == "hier ZeRO-1")
    print(f"hier ZeRO-1, as the runtime counted it per rank and step: {z['inter_bytes_per_step'] / 1e6:.3f} MB between "
          f"the hosts + {z['intra_bytes_per_step'] / 1e6:.3f} MB inside (flat ring: "
          f"{z['flat_ring_bytes_per_step'] / 1e6:.3f} MB); step measured {z['measured_step_ms']:.1f} ms against "
          f"{z['predicted_step_ms']:.1f} ms predicted; loss {z['loss_final']:.4f} (flat {flat['loss_final']:.4f})")
    for cname, res in remote.items():
        print(f"{cname}: predicted step of a data-parallel plan of the mlp zoo model over all 16 GPUs (batch 1024)")
        print("  " + "  ".join(f"{k}: {v:.2f} ms" for k, v in res["dp16"].items()))
        for allow, s in res["solver"].items():
            print(f"  solver (dp), compression {allow if allow == 'not allowed' else 'allowed: ' + allow}: "
                  f"{s['step_ms']:.2f} ms, {s['plan']}")
    result = {"model": f"MLP {SMALL}", "steps": args.steps, "ranks": 4, "hosts": 2, "warmup_skipped": WARMUP,
              "rows": rows, "predicted_elsewhere": remote, "train_seconds": train_s,
              "host": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "load_average_before": load0, "load_average_after": load1},
              "seconds": time.perf_counter() - t0}
    out = Path(__file__).resolve().parent / "results" / "comm_options.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(result, out)
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
