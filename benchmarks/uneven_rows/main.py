"""Uneven rows: a 2-rank data-parallel plan with one rank slowed 2x, even rows against uneven rows.

One stage on ``cpu0`` and ``cpu1`` (every node of the model; gpt-tiny by
default, AdamW at ``run``'s default learning rate), built twice from one
profile: with each microbatch split equally (``rows`` left out) and split
2:1 (``Stage.rows``: the slowed rank takes a third). Each build runs
``hpml-compile run BUILD --slow 1:2:1`` on two gloo ranks of this machine
(rank 1 computes 2x slower from the first step, as a slower device would).

Measured: the median over the steps after the warm-up of the slowest rank's
step, in each of ``--repeats`` runs per split, the splits alternating (on a
busy machine the load moves a run by more than the split does), and the
median of those runs. Predicted, two ways, each scaling a replica's compute by its rows and its
slow-down (the slowest replica sets the step):

- *simulator*: ``hpml_compile.simulate.simulate`` of the even plan on the
  healthy profile gives a replica's forward+backward per microbatch at half the
  microbatch's rows, the gradient sync and the optimizer step; each replica's
  compute is scaled by its rows and its slow-down (2x on rank 1), the slowest
  replica sets the step: ``max_r(M (fwd+bwd) rows_r/(mb/2) f_r) + sync + opt``.
- *measured*: the same formula from the first even run's own measurement: each
  rank's median forward+backward (already slowed) scaled by its rows, plus
  the rest of the slowed rank's step (sync, optimizer, overheads; the others
  wait for it, so its step holds no waiting), i.e. what the even run predicts
  for the uneven one (for the even split it gives back the even run's step).

Run:  .venv/bin/python benchmarks/uneven_rows/main.py [--model gpt-tiny] [--batch-size 96] [--steps 30]
Prints a table; writes benchmarks/uneven_rows/results/uneven_rows.json.

``--adapt``: the closed loop instead. The even build runs ``run --adapt
--slow 1:2:S`` once per candidate, the row move and the full re-plan each
forced (``HPML_ADAPT_CANDIDATES``), with the restart priced at
``--switch-cost`` seconds (``HPML_ADAPT_SWITCH_COST_S``) so that the re-plan
switches within the run (the row move is priced at its in-place cost).
Measured per candidate: the time to choose it (row choice, or the solve),
and the switch: for the row move, which the running ranks take in place,
its ``switch_s`` in ``replans.jsonl`` (from the decision to the rows in
force on every rank and the run's plan.json re-published); for the re-plan,
the codegen of its build plus the time from the decision to the first step
on it (checkpoint, torchrun restart, model rebuild, checkpoint load;
:func:`hpml_compile.runtime.job.supervisor.timings`). Also the median slowest
rank's step after the switch (leaving out its first ``--warmup`` steps)
against its prediction and the steps before it. Writes
results/uneven_rows_adapt.json.

``--splits 12:12,16:8,...``: which rows a row move should choose.
The test's job (``tests/dist/test_row_move_dist.py``: gpt-tiny, batch 48 in 2
microbatches, compiled for local-cpu-2) runs ``run --adapt --slow
1:F:S`` once (``--slow-factor`` F, both candidates, a restart priced at
``--switch-cost``) and records the rows the move chose, its prediction and
the step after it; then the same build with each split fixed by hand runs
``--slow 1:F:1``, ``--repeats`` times, alternating. Per split: the slowest
rank's median step, each rank's compute and its *net* compute (less the time
it waited for a core, ``contention_ms``: on a shared host that waiting moves
a run by more than a row does), and the simulator's prediction on the costs
the closed loop measured when it decided (*rebuilt ms*: the measured profile
and the slowed device's kind, with the slowdowns the decision recorded,
rebuilt from the run's metrics files as ``adapt.Adapter._decide`` builds
them from the rows it gathers). The rebuilt costs' prediction for the
chosen rows is printed beside the decision's own: they have differed (153
against 116 ms), so the decision's figure is the one to quote; the rebuilt
column only ranks the splits. Writes results/uneven_rows_splits.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hpml_compile.driver import cost_graph, rebuild
from hpml_compile.plan import Plan, Stage, load_plan
from hpml_compile.profile import load_profile
from hpml_compile.runtime.observe.monitor import StepMetrics, read_metrics
from hpml_compile.runtime.observe.summary import measured_setup, summarise
from hpml_compile.simulate import annotate, simulate

HERE = Path(__file__).resolve().parent
CLI = [sys.executable, "-m", "hpml_compile"]
SLOW_RANK, FACTOR = 1, 2.0


def _cli(*args: str) -> str:
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode:
        raise SystemExit(f"hpml-compile {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def _plans(base: Plan, mb: int, microbatches: int) -> dict[str, Plan]:
    """The one-stage data-parallel plan on cpu0 and cpu1, with an even and a 2:1 split of each microbatch."""
    nodes = tuple(n for st in base.stages for n in st.nodes)
    devices = ("cpu0", "cpu1")
    fast = round(mb * FACTOR / (FACTOR + 1))
    out = {}
    for name, rows in (("even", ()), ("uneven", (fast, mb - fast))):
        st = Stage(0, devices, nodes, rows=rows)
        out[name] = dataclasses.replace(base, microbatches=microbatches, stages=(st,))
    return out


def _predict(sim_stage: Any, microbatches: int, mb: int, rows: tuple[int, ...]) -> float:
    """max over replicas of its compute scaled by its rows and slow-down, plus the sync and the optimizer."""
    per = microbatches * (sim_stage.fwd_ms + sim_stage.bwd_ms) / (mb / 2)
    slow = [FACTOR if r == SLOW_RANK else 1.0 for r in range(len(rows))]
    return max(per * n * f for n, f in zip(rows, slow)) + sim_stage.synced_ms + sim_stage.optimizer_ms


def _measured(rows_by_rank: dict[int, list[StepMetrics]], skip: int) -> dict[str, Any]:
    steps = sorted({m.step for ms in rows_by_rank.values() for m in ms})[skip:]
    by_step = {s: [m for ms in rows_by_rank.values() for m in ms if m.step == s] for s in steps}
    slowest = [max(m.step_ms for m in ms) for ms in by_step.values() if len(ms) == len(rows_by_rank)]
    per_rank = {r: {"compute_ms": statistics.median(m.fwd_ms + m.bwd_ms for m in ms if m.step in by_step),
                    "allreduce_ms": statistics.median(m.allreduce_ms + m.sync_wait_ms for m in ms if m.step in by_step),
                    "optimizer_ms": statistics.median(m.optimizer_ms for m in ms if m.step in by_step),
                    "step_ms": statistics.median(m.step_ms for m in ms if m.step in by_step)}
                for r, ms in sorted(rows_by_rank.items())}
    return {"step_ms": statistics.median(slowest), "steps": len(slowest), "per_rank": per_rank}


def _segment_steps(run: Path, skip: int) -> list[float]:
    """The slowest rank's step, per step of one segment, after its first ``skip`` steps."""
    rows = read_metrics(run)
    steps = sorted({m.step for ms in rows.values() for m in ms})[skip:]
    return [max(m.step_ms for ms in rows.values() for m in ms if m.step == s) for s in steps]


def adapt_main(a: argparse.Namespace, work: Path) -> int:
    """The closed loop's two candidates, each forced, on the even build (see the module docstring)."""
    from hpml_compile.runtime.job.supervisor import timings

    m = a.microbatches
    print(f"compiling {a.model} (batch {a.batch_size}) for local-cpu-2 ...", flush=True)
    _cli("compile", a.model, "--cluster", "local-cpu-2", "--batch-size", str(a.batch_size), "--microbatches",
         str(m), "-o", str(work / "base"))
    prof = load_profile(work / "base" / "profile.json")
    even = _plans(load_plan(work / "base" / "plan.json"), a.batch_size // m, m)["even"]
    _, graph = cost_graph(prof, even.cluster)
    rebuild(work / "base", annotate(even, graph, prof.dtype)[0], prof, work / "even")
    results: dict[str, Any] = {}
    for rep in range(a.repeats):
        for cand in ("rows", "replan"):
            run = work / f"adapt-{cand}-{rep}"
            print(f"run {rep + 1}: --adapt, {cand} forced, rank {SLOW_RANK} slowed {FACTOR:g}x from step "
                  f"{a.slow_from} ...", flush=True)
            load0 = os.getloadavg()
            env = {**os.environ, "HPML_ADAPT_CANDIDATES": cand, "HPML_ADAPT_SWITCH_COST_S": str(a.switch_cost)}
            r = subprocess.run([*CLI, "run", str(work / "even"), "--steps", str(a.steps), "--adapt",
                                "--adapt-patience", "3", "--slow", f"{SLOW_RANK}:{FACTOR:g}:{a.slow_from}",
                                "--run-dir", str(run), "--no-tensorboard", "--no-report"],
                               capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)
            if r.returncode:
                raise SystemExit(f"run --adapt ({cand}) failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
            events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
            switch = next((e for e in events if e["event"] == "switch"), None)
            decisions = [json.loads(x) for x in (run / "seg0" / "replans.jsonl").read_text().splitlines()
                         if x.strip()] if (run / "seg0" / "replans.jsonl").is_file() else []
            moved = next((d for d in decisions if d.get("in_place")), None)
            row: dict[str, Any] = {"loadavg_before": load0, "loadavg_after": os.getloadavg(),
                                   "switched": bool(switch or moved), "in_place": bool(moved),
                                   "segments": sum(e["event"] == "segment" for e in events)}
            if moved:  # the running ranks took the rows: the steps before and after it are in segment 0
                steps = _segment_steps(run / "seg0", 0)
                new_plan = load_plan(run / "seg0" / "plan.json")
                before, after = steps[:moved["step"]][-3:], steps[moved["step"] + a.warmup:]
                row.update(chosen=moved["chosen"], step=moved["step"], choose_s=moved["solve_s"], codegen_s=0.0,
                           resume_s=None, switch_s=moved["switch_s"], apply_s=moved["apply_s"],
                           first_after_ms=steps[moved["step"]] if len(steps) > moved["step"] else None,
                           **_outcome(new_plan, moved, before, after))
            elif switch:
                d = switch["decision"]
                t = next(x for x in timings(run) if x["kind"].startswith("switch"))
                new_plan = load_plan(Path(switch["build"]) / "plan.json")
                last = max(e["segment"] for e in events if e["event"] == "segment")
                after = _segment_steps(run / f"seg{last}", a.warmup)
                before = _segment_steps(run / "seg0", 0)[-3:]
                row.update(chosen=d["chosen"], step=d["step"], choose_s=d["solve_s"], codegen_s=d["codegen_s"],
                           resume_s=t["resume_s"], switch_s=d["solve_s"] + d["codegen_s"] + (t["resume_s"] or 0),
                           **_outcome(new_plan, d, before, after))
            results.setdefault(cand, []).append(row)
    print(f"\n{a.model}, batch {a.batch_size} in {m} microbatches, one stage on 2 gloo ranks, rank {SLOW_RANK} "
          f"slowed {FACTOR:g}x from step {a.slow_from}; {a.steps} steps; restart priced at {a.switch_cost:g} s")
    print(f"{'forced':7s} {'new plan':22s} {'in place':8s} {'choose s':>8s} {'codegen s':>9s} {'resume s':>8s} "
          f"{'switch s':>8s} {'before ms':>9s} {'after ms':>8s} {'pred. ms':>8s}  load avg before")
    for cand, rows in results.items():
        for x in rows:
            if not x["switched"]:
                print(f"{cand:7s} did not switch (load {x['loadavg_before'][0]:.1f})")
                continue
            plan_txt = " | ".join(",".join(st) + (f" {':'.join(map(str, r))}" if r else "")
                                  for st, r in zip(x["stages"], x["rows"]))
            print(f"{cand:7s} {plan_txt[:22]:22s} {'yes' if x['in_place'] else 'no':8s} {x['choose_s']:8.2f} "
                  f"{x['codegen_s']:9.2f} {x['resume_s'] or float('nan'):8.1f} {x['switch_s']:8.3f} "
                  f"{x['measured_before_ms'] or 0:9.1f} "
                  f"{x['measured_after_ms'] or 0:8.1f} {x['predicted_after_ms']:8.1f}  {x['loadavg_before'][0]:.1f}")
    for x in results.get("rows", []):
        if x.get("in_place"):
            print(f"rows moved in place at step {x['step']} in {x['switch_s'] * 1e3:.1f} ms (applied on the slowest rank "
                  f"in {x['apply_s'] * 1e3:.2f} ms), {x['segments']} segment(s); the first step on the new rows "
                  f"{x['first_after_ms'] or float('nan'):.1f} ms")
    out = a.out.with_name("uneven_rows_adapt.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": a.model, "batch_size": a.batch_size, "microbatches": m, "steps": a.steps,
                               "slow": {"rank": SLOW_RANK, "factor": FACTOR, "from_step": a.slow_from},
                               "switch_cost_s": a.switch_cost, "warmup": a.warmup, "cpus": os.cpu_count(),
                               "arch": platform.machine(), "results": results}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _split_plan(base: Plan, rows: tuple[int, ...]) -> Plan:
    """``base``'s one stage on cpu0 and cpu1 with ``rows`` per microbatch (an even split writes no rows)."""
    st = Stage(0, ("cpu0", "cpu1"), tuple(n for s in base.stages for n in s.nodes),
               rows=() if len(set(rows)) == 1 else rows)
    return dataclasses.replace(base, stages=(st,))


def _decision_costs(seg: Path, plan: Plan, step: int, slow: dict[str, float]) -> tuple[Any, Any]:
    """The measured profile and cluster the closed loop decided on at ``step`` (steps done) with the slowdowns
    ``slow`` it recorded, rebuilt from the segment's metrics as ``adapt.Adapter._decide`` builds them (the last
    ``AdaptOptions().patience`` steps)."""
    from hpml_compile.runtime.job.adapt import AdaptOptions

    every = {r: [m for m in ms if m.step < step] for r, ms in read_metrics(seg).items()}
    recent = {r: ms[-AdaptOptions().patience:] for r, ms in every.items()}
    return measured_setup(load_profile(seg / "plan_profile.json"), summarise(plan, recent, skip=0), slow)


def _net(run: Path, skip: int) -> dict[int, dict[str, float]]:
    """Per rank: median compute, and compute less the time the rank waited for a core, after ``skip`` steps."""
    out = {}
    for r, ms in sorted(read_metrics(run).items()):
        kept = [m for m in ms if m.step >= skip]
        out[r] = {"compute_ms": statistics.median(m.fwd_ms + m.bwd_ms for m in kept),
                  "net_compute_ms": statistics.median(m.fwd_ms + m.bwd_ms - m.contention_ms for m in kept)}
    return out


def splits_main(a: argparse.Namespace, work: Path) -> int:
    """The row move's choice against splits fixed by hand, on the test's job (see the module docstring)."""
    m, f = a.microbatches, a.slow_factor
    mb = a.batch_size // m
    splits = [tuple(int(x) for x in s.split(":")) for s in a.splits.split(",")]
    for sp in splits:
        if len(sp) != 2 or sum(sp) != mb or min(sp) < 1:
            raise SystemExit(f"--splits: {':'.join(map(str, sp))} is not 2 rows of at least 1 summing to {mb} "
                             f"(batch {a.batch_size} over {m} microbatches)")
    print(f"compiling {a.model} (batch {a.batch_size}, {m} microbatches) for local-cpu-2 ...", flush=True)
    _cli("compile", a.model, "--cluster", "local-cpu-2", "--batch-size", str(a.batch_size), "--microbatches",
         str(m), "--repeats", "1", "-o", str(work / "base"))
    base = load_plan(work / "base" / "plan.json")
    prof = load_profile(work / "base" / "profile.json")
    if [st.devices for st in base.stages] != [("cpu0", "cpu1")] or base.stages[0].rows:
        raise SystemExit(f"compile made {[st.devices for st in base.stages]}, not one even stage on cpu0, cpu1")
    print(f"run --adapt --slow {SLOW_RANK}:{f:g}:{a.slow_from} ...", flush=True)
    run = work / "adapt"
    load0 = os.getloadavg()
    r = subprocess.run([*CLI, "run", str(work / "base"), "--steps", str(a.steps), "--adapt", "--adapt-patience",
                        "3", "--slow", f"{SLOW_RANK}:{f:g}:{a.slow_from}", "--run-dir", str(run),
                        "--no-tensorboard", "--no-report"], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, env={**os.environ, "HPML_ADAPT_SWITCH_COST_S": str(a.switch_cost)})
    if r.returncode:
        raise SystemExit(f"run --adapt failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    decisions = [json.loads(x) for x in (run / "seg0" / "replans.jsonl").read_text().splitlines() if x.strip()]
    moved = next((d for d in decisions if d.get("in_place")), None)
    if moved is None:
        raise SystemExit(f"the closed loop moved no rows in place: {decisions}")
    steps = _segment_steps(run / "seg0", 0)
    after = steps[moved["step"] + a.warmup:]
    chosen = tuple(moved["rows"][0])
    adapt = {"loadavg_before": load0, "step": moved["step"], "slow_devices": moved["slow_devices"],
             "rows": list(chosen), "predicted_ms": moved["new_step_ms"], "predicted_old_ms": moved["old_step_ms"],
             "measured_before_ms": statistics.median(steps[moved["step"] - 3:moved["step"]]),
             "measured_after_ms": statistics.median(after), "steps_after": len(after),
             "after": {r: x for r, x in _net(run / "seg0", moved["step"] + a.warmup).items()}}
    slow = {d: float(x) for d, x in moved["slow_devices"].items()}
    mprof, cluster = _decision_costs(run / "seg0", base, moved["step"], slow)
    _, graph = cost_graph(mprof, cluster)
    kinds = [cluster.device(d).kind for d in ("cpu0", "cpu1")]
    fit = {}
    for d, k in zip(("cpu0", "cpu1"), kinds):
        fixed = sum(sum(graph.cost_at(n, k, 0.0)) for n in graph.order)
        per_row = (sum(sum(graph.cost_at(n, k, 1.0)) for n in graph.order) - fixed) / graph.batch_size
        fit[d] = {"kind": k, "fixed_ms_per_microbatch": fixed, "per_row_ms": per_row}
    again, _ = annotate(dataclasses.replace(_split_plan(base, chosen), cluster=cluster), graph, mprof.dtype)
    adapt["predicted_rebuilt_ms"] = again.predicted.step_ms  # the decision's costs rebuilt: its prediction again?
    results: dict[str, Any] = {}
    for sp in splits:
        name = ":".join(map(str, sp))
        plan = _split_plan(base, sp)
        pred, _ = annotate(dataclasses.replace(plan, cluster=cluster), graph, mprof.dtype)
        ann, _ = annotate(plan, cost_graph(prof, plan.cluster)[1], prof.dtype)
        ann = dataclasses.replace(ann, stages=tuple(dataclasses.replace(x, rows=st.rows)  # the rows, as main()
                                                    for x, st in zip(ann.stages, plan.stages)))
        rebuild(work / "base", ann, prof, work / f"split-{sp[0]}-{sp[1]}")
        if load_plan(work / f"split-{sp[0]}-{sp[1]}" / "plan.json").stages[0].rows != plan.stages[0].rows:
            raise SystemExit(f"the {name} build lost its rows")
        results[name] = {"rows": list(sp), "predicted_rebuilt_ms": pred.predicted.step_ms, "runs": []}
    for rep in range(a.repeats):
        for name, res in results.items():
            print(f"run {rep + 1}: rows {name} with rank {SLOW_RANK} slowed {f:g}x ...", flush=True)
            load0 = os.getloadavg()
            run = work / f"split-{'-'.join(map(str, res['rows']))}-run{rep}"
            _cli("run", str(work / f"split-{res['rows'][0]}-{res['rows'][1]}"), "--steps", str(a.steps), "--slow",
                 f"{SLOW_RANK}:{f:g}:1", "--run-dir", str(run), "--no-tensorboard", "--no-report")
            res["runs"].append({"loadavg_before": load0, "step_ms": statistics.median(_segment_steps(run, a.warmup)),
                                "per_rank": _net(run, a.warmup)})
    for res in results.values():
        res["step_ms"] = statistics.median(x["step_ms"] for x in res["runs"])
        res["net_compute_ms"] = {str(r): statistics.median(x["per_rank"][r]["net_compute_ms"] for x in res["runs"])
                                 for r in (0, 1)}
    print(f"\n{a.model}, batch {a.batch_size} in {m} microbatches, one stage on cpu0 and cpu1, rank {SLOW_RANK} "
          f"slowed {f:g}x (--slow); {a.steps} steps, medians after {a.warmup}")
    print(f"closed loop: slowed {', '.join(f'{d} {x:.2f}x' for d, x in slow.items())} (measured) at step "
          f"{adapt['step']}: rows {':'.join(map(str, chosen))}, predicted {adapt['predicted_ms']:.1f} ms, measured "
          f"{adapt['measured_after_ms']:.1f} ms after the move ({adapt['measured_before_ms']:.1f} ms before); "
          f"net compute after: " + ", ".join(f"rank {r} {x['net_compute_ms']:.1f} ms" for r, x in
                                             adapt["after"].items()))
    print(f"the decision's costs rebuilt from the metrics predict {adapt['predicted_rebuilt_ms']:.1f} ms for its rows "
          f"(it predicted {adapt['predicted_ms']:.1f} ms); the column rebuilt ms is on them")
    print("its costs per microbatch: " + "; ".join(f"{d} ({x['kind']}) fixed {x['fixed_ms_per_microbatch']:.2f} ms "
                                                  f"+ {x['per_row_ms']:.3f} ms per row" for d, x in fit.items()))
    print(f"{'rows':>6s} {'measured ms (each run)':>24s} {'median':>7s} {'rebuilt ms':>10s} {'net r0':>7s} "
          f"{'net r1':>7s}  load avg before each run")
    for name, res in results.items():
        each = ", ".join(f"{x['step_ms']:.1f}" for x in res["runs"])
        print(f"{name:>6s} {each:>24s} {res['step_ms']:7.1f} {res['predicted_rebuilt_ms']:10.1f} "
              f"{res['net_compute_ms']['0']:7.1f} {res['net_compute_ms']['1']:7.1f}  "
              + ", ".join(f"{x['loadavg_before'][0]:.1f}" for x in res["runs"]))
    fastest = min(results, key=lambda k: results[k]["step_ms"])
    balanced = min(results, key=lambda k: max(results[k]["net_compute_ms"].values()))
    print(f"chosen {':'.join(map(str, chosen))}; fastest measured step {fastest}; smallest slowest net compute "
          f"{balanced}")
    out = a.out.with_name("uneven_rows_splits.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": a.model, "batch_size": a.batch_size, "microbatches": m, "steps": a.steps,
                               "warmup": a.warmup, "repeats": a.repeats,
                               "slow": {"rank": SLOW_RANK, "factor": f, "from_step": a.slow_from},
                               "cpus": os.cpu_count(), "arch": platform.machine(), "adapt": adapt,
                               "decision_costs": fit, "splits": results, "fastest_measured": fastest,
                               "smallest_net_bottleneck": balanced}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _outcome(new_plan: Any, decision: dict[str, Any], before: list[float], after: list[float]) -> dict[str, Any]:
    """What a row move and a restart both report: the plan switched to, its prediction, the steps around it."""
    return {"stages": [list(st.devices) for st in new_plan.stages], "rows": [list(st.rows) for st in new_plan.stages],
            "predicted_after_ms": new_plan.predicted.step_ms, "predicted_old_on_measured_ms": decision["old_step_ms"],
            "measured_before_ms": statistics.median(before) if before else None,
            "measured_after_ms": statistics.median(after) if after else None, "steps_after": len(after),
            "candidates": decision["candidates"]}

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--repeats", type=int, default=2, help="runs of each split, alternating")
    p.add_argument("--out", type=Path, default=HERE / "results" / "uneven_rows.json")
    p.add_argument("--adapt", action="store_true", help="the closed loop: row move against full re-plan, each forced")
    p.add_argument("--slow-from", type=int, default=6, dest="slow_from", help="with --adapt: the first slowed step")
    p.add_argument("--switch-cost", type=float, default=0.5, dest="switch_cost",
                   help="with --adapt: the restart cost the candidates are priced with, seconds")
    p.add_argument("--splits", default=None,
                   help="rows per microbatch to time by hand against the row move's choice, e.g. 12:12,18:6,23:1 "
                        "(use with --batch-size 48 --steps 20 --slow-factor 3)")
    p.add_argument("--slow-factor", type=float, default=3.0, dest="slow_factor",
                   help="with --splits: the --slow factor of rank 1")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hpml-uneven-rows-"))
    if a.splits:
        return splits_main(a, work)
    if a.adapt:
        return adapt_main(a, work)
    m, mb = a.microbatches, a.batch_size // a.microbatches
    print(f"compiling {a.model} (batch {a.batch_size}) for local-cpu-2 ...", flush=True)
    _cli("compile", a.model, "--cluster", "local-cpu-2", "--batch-size", str(a.batch_size), "--microbatches",
         str(m), "-o", str(work / "base"))
    prof = load_profile(work / "base" / "profile.json")
    plans = _plans(load_plan(work / "base" / "plan.json"), mb, m)
    _, graph = cost_graph(prof, plans["even"].cluster)
    # the plans carry the simulator's predictions (for the uneven one, those of its stages without their rows),
    # not the base plan's
    plans = {name: dataclasses.replace(ann, stages=tuple(dataclasses.replace(a, rows=st.rows) for a, st in
                                                        zip(ann.stages, plan.stages)))
             for name, plan in plans.items() for ann in [annotate(plan, graph, prof.dtype)[0]]}
    sim = simulate(plans["even"], graph, prof.dtype)
    stage = sim.stages[0]
    results: dict[str, Any] = {}
    for name, plan in plans.items():
        rebuild(work / "base", plan, prof, work / name)
        if load_plan(work / name / "plan.json").stages[0].rows != plan.stages[0].rows:
            raise SystemExit(f"the {name} build lost its rows {list(plan.stages[0].rows)}")
        rows = plan.stages[0].rows or (mb // 2, mb // 2)
        results[name] = {"rows": list(rows), "runs": [], "predicted_simulator_ms": _predict(stage, m, mb, rows)}
    # alternate the splits (even, uneven, even, ...): this machine's load moves a run's step by more than the split
    for rep in range(a.repeats):
        for name in plans:
            print(f"run {rep + 1}: {name} rows {results[name]['rows']} with rank {SLOW_RANK} slowed {FACTOR:g}x ...",
                  flush=True)
            load0 = os.getloadavg()
            t0 = time.perf_counter()
            run = work / f"run-{name}-{rep}"
            _cli("run", str(work / name), "--steps", str(a.steps), "--slow", f"{SLOW_RANK}:{FACTOR:g}:1",
                 "--run-dir", str(run), "--no-tensorboard", "--no-report")
            results[name]["runs"].append({"wall_s": time.perf_counter() - t0, "loadavg_before": load0,
                                          "loadavg_after": os.getloadavg(),
                                          "measured": _measured(read_metrics(run), a.warmup)})
    for r in results.values():
        r["measured_step_ms"] = statistics.median(x["measured"]["step_ms"] for x in r["runs"])
    ev = results["even"]["runs"][0]["measured"]["per_rank"]
    last = max(ev, key=lambda r: ev[r]["compute_ms"])  # the rank the others wait for: its step has no wait in it
    rest = ev[last]["step_ms"] - ev[last]["compute_ms"]  # sync, optimizer and overheads of a step
    for name in results:  # the even run's own measurement, scaled to each split's rows
        rows = results[name]["rows"]
        comp = max(ev[r]["compute_ms"] * n / (mb / 2) for r, n in enumerate(rows))
        results[name]["predicted_measured_ms"] = comp + rest
    print(f"\n{a.model}, batch {a.batch_size} in {m} microbatches, one stage on 2 gloo ranks, rank {SLOW_RANK} "
          f"slowed {FACTOR:g}x; {a.steps} steps, median of the slowest rank's step after {a.warmup}")
    print(f"simulator (even plan, healthy profile): fwd {stage.fwd_ms:.2f} + bwd {stage.bwd_ms:.2f} ms per "
          f"microbatch per replica, sync {stage.synced_ms:.2f} ms, optimizer {stage.optimizer_ms:.2f} ms; "
          f"its own step {sim.step_ms:.2f} ms (healthy)")
    print(f"{'split':8s} {'rows':>8s} {'measured ms (each run)':>26s} {'median':>8s} {'pred. sim ms':>13s} "
          f"{'pred. meas ms':>14s}  load avg (1 min) before each run")
    for name, r in results.items():
        each = ", ".join(f"{x['measured']['step_ms']:.1f}" for x in r["runs"])
        loads = ", ".join(f"{x['loadavg_before'][0]:.1f}" for x in r["runs"])
        print(f"{name:8s} {':'.join(map(str, r['rows'])):>8s} {each:>26s} {r['measured_step_ms']:8.1f} "
              f"{r['predicted_simulator_ms']:13.1f} {r['predicted_measured_ms']:14.1f}  {loads}")
    gain = results["even"]["measured_step_ms"] / results["uneven"]["measured_step_ms"]
    pgain = results["even"]["predicted_simulator_ms"] / results["uneven"]["predicted_simulator_ms"]
    print(f"uneven rows: {gain:.2f}x the even split's speed measured (medians), {pgain:.2f}x predicted by the "
          "simulator")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "model": a.model, "batch_size": a.batch_size, "microbatches": m, "steps": a.steps, "warmup": a.warmup,
        "repeats": a.repeats,
        "slow": {"rank": SLOW_RANK, "factor": FACTOR}, "cpus": os.cpu_count(), "arch": platform.machine(),
        "simulator_even_stage": {"fwd_ms": stage.fwd_ms, "bwd_ms": stage.bwd_ms, "sync_ms": stage.synced_ms,
                                 "optimizer_ms": stage.optimizer_ms, "step_ms": sim.step_ms},
        "results": results, "measured_speedup": gain, "predicted_speedup": pgain}, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
