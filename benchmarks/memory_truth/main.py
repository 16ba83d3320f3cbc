"""Memory truth: the plan's predicted bytes per device against the bytes each rank really holds.

For each model, the profile is measured once; then, for each memory option
the solver can choose (ZeRO 0-3, recompute, optimizer offload, activation
swap, bf16), the benchmark looks for a per-device capacity that makes the
solver choose it on a cluster of 2 CPU devices (planning only, over a grid of
capacities), compiles a build for that cluster with
:func:`hpml_compile.driver.compile` (the path ``hpml_compile.compile`` and
``hpml-compile compile`` take), runs it for a few AdamW steps on 2 gloo ranks,
and puts, per device and per part, the plan's memory breakdown
(:func:`hpml_compile.plan.stage_breakdown`) beside what the rank held:

- parameters and optimizer state: :func:`hpml_compile.runtime.observe.held.held_bytes`
  after the last step (each storage once), as the pipeline records it (``Pipeline.held``);
- activations: :class:`hpml_compile.saved.SavedActivations`, the most
  bytes saved for backward alive at once in any step (by storage);
- gradients at their peak, the end of the backward (:class:`~hpml_compile.saved.GradPeak`:
  a ZeRO-2 rank frees its whole gradient buffer after the reduce-scatter), plus
  ``other``: the flat buffer the gradients of parameters tied to another stage
  are all-reduced through (``runtime.sync.stage._grad_buffer``, kept across steps; the
  memory model counts it with the gradients);
- the process: each rank runs in a fresh interpreter (``rank.py``, as a run's
  ranks do), and its peak resident set (``VmHWM``, ``/proc/self/status``: the
  interpreter, torch, the runtime, the whole model built, the steps) is put
  beside the whole prediction, which for a CPU device adds the rank's baseline
  (measured once per host, :mod:`hpml_compile.profile.process`) and the rest of
  the model to the stage's tensors. Each case runs ``--repeats`` times, each
  time in fresh processes: a rank's peak differs between identical runs (where
  ``malloc`` places a step's large blocks depends on the small allocations
  between them, :mod:`hpml_compile.hostmem`), and the row compares the largest
  with the prediction and prints the smallest beside it.

On a CUDA device the held figure would be ``torch.cuda.max_memory_allocated``;
this machine has none, and the rows say ``cpu``.

Offload and swap are not offered on a CPU device (the host is the device:
they would save nothing), so their rows say so instead of running. The bf16
row compiles with ``precision="bf16"`` (autocast, fp32 master weights and
optimizer state) at the capacity where the solver first chose ZeRO-1, and
once more by hand (``bf16-dp``): one stage replicated on both devices under
ZeRO-1, where every microbatch in flight holds its own autocast weight copies.

Error per device: ``(predicted - held) / held`` of the tensors and of the
process, and the under-prediction as a share of the device's capacity. Goal:
never under-predicted by more than 5% of the capacity (tensors and RSS alike),
median |error| of the tensors <= 10%.

Run:  .venv/bin/python benchmarks/memory_truth/main.py [--models gpt-mini,mlp] [--steps 6] [--repeats 3]
      [--options bf16,zero3]
Prints a table; writes benchmarks/memory_truth/results/memory_truth.json (memory_truth-<options>.json with
--options).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hpml_compile import driver, models
from hpml_compile.ir import Cluster, Device, Precision
from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.plan import Plan, Schedule, load_plan, stage_breakdown, validate_plan
from hpml_compile.profile import load_profile
from hpml_compile.schema import write_json_atomic
from hpml_compile.profile.process import this_host
from hpml_compile.trace import trace

MiB = 2**20
HERE = Path(__file__).resolve().parent
OPTIONS = ("zero0", "zero1", "zero2", "zero3", "recompute", "offload", "swap", "bf16")
NOT_ON_CPU = {"offload": "not offered on a CPU device: the host is the device, offload saves nothing "
                         "(validate_plan refuses it; on a GPU it runs, runtime/sync/offload.py)",
              "swap": "not offered on a CPU device: the host is the device, swap saves nothing"}


def _options(plan: Plan) -> set[str]:
    """The memory options a plan uses (``zero0``: replicated without ZeRO, or none at all)."""
    out: set[str] = set()
    for st in plan.stages:
        if len(st.devices) > 1:
            out.add(f"zero{int(st.zero)}")
        if st.recompute:
            out.add("recompute")
        if st.offload_optimizer:
            out.add("offload")
        if st.swap:
            out.add("swap")
    if not out & {"zero1", "zero2", "zero3", "recompute", "offload", "swap"}:
        out.add("zero0")
    return out


def _cluster(cap_mib: float) -> Cluster:
    gib = round(cap_mib / 1024, 6)
    return Cluster(devices=(Device("cpu0", "cpu", gib, host="localhost"), Device("cpu1", "cpu", gib, host="localhost")),
                   name=f"2cpu-{cap_mib:g}MiB")


def _find_caps(prof: Any, lo_mib: float, hi_mib: float, n: int, microbatches: int | None) -> dict[str, float]:
    """For each option, the largest capacity on a geometric grid at which the solver's plan uses it; then, between
    the smallest capacity that fits and the grid's next (where nothing does), a few halvings: the options a
    solver takes only near the edge (recompute, ZeRO-3) lie in a window narrower than the grid's 20% steps."""
    found: dict[str, float] = {}
    # the ZeRO, recompute and swap options, without tensor parallelism (its ranks make their own process groups)
    opts = driver.Options(solver="ilp", time_limit_s=10, microbatches=microbatches, max_tp=1)

    def fits(cap: float) -> bool:
        try:
            plan = driver.plan(prof, _cluster(cap), opts)
        except Exception:  # noqa: BLE001 -- nothing fits here
            return False
        for o in _options(plan):
            found.setdefault(o, cap)
        return True

    ok = None
    for i in range(n):
        cap = round(hi_mib * (lo_mib / hi_mib) ** (i / (n - 1)), 1)
        if not fits(cap):
            if ok is not None:
                for _ in range(5):  # the edge between the last fit and this capacity
                    mid = round((ok + cap) / 2, 1)
                    ok, cap = (mid, cap) if fits(mid) else (ok, mid)
            break
        ok = cap
    return found


@dataclass
class Case:
    model: str
    option: str
    cap_mib: float
    build: str
    plan_options: list[str]
    forced: bool = False


def _forced(gm: Any, prof: Any, name: str, opt: str, out: Path) -> float:
    """A plan with ``opt`` made by hand (:func:`split_plan`), on 2 devices just large enough for it; its capacity."""
    if opt == "recompute":
        plan = split_plan(gm, name, 2, microbatches=2, recompute=(0, 1), schedule=Schedule.ONE_F_ONE_B)
    else:
        plan = split_plan(gm, name, 1, microbatches=2, replicas=[2], zero=int(opt[-1]), schedule=Schedule.ONE_F_ONE_B)
    need = max(stage_breakdown(plan, prof, st).total for st in plan.stages)
    cap = float(-(-int(need * 1.02) // (MiB // 10))) / 10
    plan = replace(plan, cluster=_cluster(cap))
    validate_plan(plan, prof)
    generate(gm, plan, out, profile=prof)
    return cap


def _run_case(case: Case, world: int, steps: int, where: Path) -> list[dict[str, Any]]:
    """Train ``case`` on ``world`` ranks, each a fresh interpreter (:mod:`rank`): what each rank held."""
    where.mkdir(parents=True, exist_ok=True)
    init = f"file://{where / 'rendezvous'}"
    procs = [subprocess.Popen([sys.executable, str(HERE / "rank.py"), case.build, case.model, str(steps), str(r),
                               str(world), init, str(where / f"rank{r}.json")], env=_env())
             for r in range(world)]
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise SystemExit(f"{case.option}@{case.model}: a rank failed (exit codes {codes})")
    return [json.loads((where / f"rank{r}.json").read_text()) for r in range(world)]


def _env() -> dict[str, str]:
    """The ranks import this checkout's package, as this process does."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def _predicted(plan: Plan, prof: Any) -> dict[str, dict[str, int]]:
    out = {}
    for st in plan.stages:
        for d in st.devices:
            m = stage_breakdown(plan, prof, st, d)
            out[d] = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer, "activations": m.activations,
                      "tensors": m.tensors, "process": m.process, "total": m.total, "stage": st.index}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-mini,mlp")
    ap.add_argument("--steps", type=int, default=6, help="AdamW steps per run (a rank's heap keeps growing over "
                    "the first few: hpml_compile.hostmem)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each case, each in fresh processes: the rows "
                    "compare each rank's largest peak RSS with the prediction")
    ap.add_argument("--grid", type=int, default=14, help="capacities tried per model when looking for each option")
    ap.add_argument("--options", default="", help="only these options (comma-separated, from " + ",".join(OPTIONS)
                    + "; default all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="memory-truth-"))
    # a CPU rank's baseline memory, as `compile` measures it (once per host, cached): the memory model adds it
    process = this_host(log=lambda line: print(line, file=sys.stderr, flush=True)).get("process")
    base_mib = process["bytes"] / MiB if process else 0.0
    cases: list[Case] = []
    skipped: list[dict[str, str]] = []
    for name in args.models.split(","):
        loaded = models.load(name, seed=0)
        print(f"profiling {name} ...", file=sys.stderr, flush=True)
        big = 4096.0
        first = root / f"{name}-profile"
        driver.compile(loaded.module, loaded.example_inputs, first, cluster=_cluster(big + base_mib),
                       opts=driver.Options(time_limit_s=10, max_tp=1), prof_opts=driver.ProfileOptions(process=process))
        prof = load_profile(first / "profile.json")
        gm = trace(loaded.module, loaded.example_inputs)
        p_mib = sum(n.param_bytes for n in prof.nodes) / MiB
        # the process's own bytes, then 1.05x to 8x the parameters' (the tensors): where the options change
        caps = _find_caps(prof, lo_mib=base_mib + 1.05 * p_mib, hi_mib=base_mib + 8 * p_mib, n=args.grid,
                          microbatches=None)
        print(f"{name}: {p_mib:.1f} MiB of parameters; options found at capacities (MiB) {caps}", file=sys.stderr,
              flush=True)
        for opt in OPTIONS:
            if args.options and opt not in args.options.split(","):
                continue
            if opt in NOT_ON_CPU:
                skipped.append({"model": name, "option": opt, "why": NOT_ON_CPU[opt]})
                continue
            if opt == "bf16":  # bf16 autocast, fp32 master weights, at the capacity of the first option found
                cap = caps.get("zero1", max(caps.values()))
                out = root / f"{name}-{opt}"
                driver.compile(loaded.module, loaded.example_inputs, out, cluster=_cluster(cap),
                               opts=driver.Options(time_limit_s=10, precision="bf16", max_tp=1),
                               prof_opts=driver.ProfileOptions(process=process))
                plan = load_plan(out / "plan.json")
                cases.append(Case(name, opt, cap, str(out), sorted(_options(plan) | {"bf16"})))
                # and bf16 on one stage replicated on both devices, ZeRO-1, by hand: every microbatch in flight
                # holds its own weight copies (memory.autocast_copy_bytes), the case the model once missed
                prof16 = load_profile(out / "profile.json")
                dp = replace(split_plan(gm, name, 1, microbatches=2, replicas=[2], zero=1,
                                        schedule=Schedule.ONE_F_ONE_B), precision=Precision.BF16)
                need = max(stage_breakdown(dp, prof16, st).total for st in dp.stages)
                dp = replace(dp, cluster=_cluster(float(-(-int(need * 1.02) // (MiB // 10))) / 10))
                validate_plan(dp, prof16)
                generate(gm, dp, root / f"{name}-bf16-dp", profile=prof16)
                cases.append(Case(name, "bf16-dp", dp.cluster.devices[0].memory_bytes / MiB,
                                  str(root / f"{name}-bf16-dp"), sorted(_options(dp) | {"bf16"}), forced=True))
                continue
            out = root / f"{name}-{opt}"
            if opt not in caps:  # the solver prefers another option at every capacity: the plan, made by hand
                try:
                    cap = _forced(gm, prof, name, opt, out)
                except Exception as e:  # noqa: BLE001 -- a plan the tool refuses: say so, go on
                    skipped.append({"model": name, "option": opt,
                                    "why": f"the solver chose it at no capacity tried; a plan with it by hand is "
                                           f"refused: {str(e).splitlines()[0][:160]}"})
                    continue
                plan = load_plan(out / "plan.json")
                cases.append(Case(name, opt, cap, str(out), sorted(_options(plan)), forced=True))
                continue
            driver.compile(loaded.module, loaded.example_inputs, out, cluster=_cluster(caps[opt]),
                           opts=driver.Options(time_limit_s=10, max_tp=1), measured=prof)
            plan = load_plan(out / "plan.json")
            cases.append(Case(name, opt, caps[opt], str(out), sorted(_options(plan))))
    by_world: dict[int, list[Case]] = {}
    for c in cases:
        by_world.setdefault(sum(len(s.devices) for s in load_plan(Path(c.build) / "plan.json").stages), []).append(c)
    held: dict[str, dict[str, Any]] = {}
    for world, cs in sorted(by_world.items()):
        for c in cs:  # each case in fresh rank processes: their peak RSS is the case's own
            print(f"training {c.option} on {c.model} ...", file=sys.stderr, flush=True)
            for i in range(args.repeats):
                for v in _run_case(c, world, args.steps, root / f"ranks-{c.option}-{c.model}-{i}"):
                    key = f"{c.option}@{c.model}#{v['device']}"
                    peak = max(v["vmhwm"], v["rss"])
                    runs = held.get(key, {}).get("rss_runs", []) + [peak]
                    held[key] = {**held.get(key, v), "rss_runs": runs}  # the tensors: the first run's (the same)
    rows = []
    for c in cases:
        plan = load_plan(Path(c.build) / "plan.json")
        prof = load_profile(Path(c.build) / "profile.json")
        pred = _predicted(plan, prof)
        for dev, p in sorted(pred.items()):
            h = held[f"{c.option}@{c.model}#{dev}"]
            h = {**h, "grads": h["grads"] + h["other"]}  # the model's gradients include the tied ones' flat buffer
            total = h["params"] + h["grads"] + h["optimizer"] + h["activations"]
            cap = plan.cluster.device(dev).memory_bytes
            rss = max(h["rss_runs"])  # the largest of the repeats
            rows.append({"model": c.model, "option": c.option, "cap_mib": c.cap_mib, "forced": c.forced,
                         "plan": "+".join(c.plan_options) + (" (by hand)" if c.forced else ""),
                         "device": dev, "stage": p["stage"], "predicted": p, "held": {**h, "total": total},
                         # the tensors: the stage's parts against what the runtime's hooks counted
                         "error": (p["tensors"] - total) / total,
                         "under_of_cap": max(0, total - p["tensors"]) / cap,
                         # the process: the whole prediction against the rank's peak resident set
                         "rss_error": (p["total"] - rss) / rss, "rss_under_of_cap": max(0, rss - p["total"]) / cap,
                         "fits": rss <= cap})
    print(f"predicted / held MiB per device at the peak, 2 CPU gloo ranks (fresh processes), {args.steps} AdamW "
          "steps; tensors: the stage's parts against the runtime's hooks; process: the whole prediction (a rank's "
          f"measured baseline {base_mib:.0f} MiB, the rest of the model, the heap's slack, the tensors) against the "
          f"rank's peak RSS, the largest of {args.repeats} runs (the smallest after it); "
          "error = (predicted - held) / held; under = held above predicted, share of the capacity")
    head = (f"{'model':9s} {'option':9s} {'plan':26s} {'cap':>6s} {'dev':4s} {'st':>2s} {'params':>11s} "
            f"{'grads':>11s} {'optim':>11s} {'acts':>11s} {'other':>5s} {'tensors':>13s} {'error':>7s} {'under':>6s} "
            f"{'process/rss':>13s} {'error':>7s} {'under':>6s} {'least':>5s}")
    print(head)
    for r in rows:
        p, h = r["predicted"], r["held"]
        pair = lambda k: f"{p[k] / MiB:5.1f}/{h[k] / MiB:<5.1f}"  # noqa: E731
        rss = max(h["rss_runs"])
        print(f"{r['model']:9s} {r['option']:9s} {r['plan']:26s} {r['cap_mib']:6.1f} {r['device']:4s} {r['stage']:2d} "
              f"{pair('params')} {pair('grads')} {pair('optimizer')} {pair('activations')} "
              f"{h['other'] / MiB:5.1f} {p['tensors'] / MiB:6.1f}/{h['total'] / MiB:<6.1f} {r['error']:+7.1%} "
              f"{r['under_of_cap']:6.1%} {p['total'] / MiB:6.0f}/{rss / MiB:<6.0f} {r['rss_error']:+7.1%} "
              f"{r['rss_under_of_cap']:6.1%} {min(h['rss_runs']) / MiB:5.0f}")
    for s in skipped:
        print(f"{s['model']:9s} {s['option']:9s} -- {s['why']}")
    errs = [abs(r["error"]) for r in rows]
    worst = max((r["under_of_cap"] for r in rows), default=0.0)
    rss_errs = [abs(r["rss_error"]) for r in rows]
    rss_worst = max((r["rss_under_of_cap"] for r in rows), default=0.0)
    if errs:
        print(f"tensors: median |error| {statistics.median(errs):.1%} (goal <= 10%); worst under-prediction "
              f"{worst:.1%} of the capacity (goal <= 5%)")
        print(f"process (peak RSS): median |error| {statistics.median(rss_errs):.1%}; worst under-prediction "
              f"{rss_worst:.1%} of the capacity (goal <= 5%)")
    res = Path(__file__).resolve().parent / "results"
    res.mkdir(exist_ok=True)
    write_json_atomic({"steps": args.steps, "repeats": args.repeats, "rows": rows, "skipped": skipped,
                       "baseline_rss": process,
                       "median_abs_error": statistics.median(errs) if errs else None,
                       "worst_under_of_capacity": worst,
                       "rss_median_abs_error": statistics.median(rss_errs) if rss_errs else None,
                       "rss_worst_under_of_capacity": rss_worst},
                      res / (f"memory_truth-{args.options.replace(',', '-')}.json" if args.options else "memory_truth.json"))


if __name__ == "__main__":
    main()
