"""Soak: a 3-rank ``run --adapt`` job abused for a wall-clock duration, checked against an uninterrupted run.

What it measures: whether a closed-loop job that
has a random rank killed, hung or slowed again and again, for ``--minutes``
(default 30), ends with

(a) the loss curve of an uninterrupted run of the same job, within a stated
    float tolerance (``--rtol``, default 1e-4 relative; see "Tolerance");
(b) no orphan process: after each leg, no process whose environment holds
    ``HPML_LAUNCHER_PID=<that leg's launcher pid>`` (:mod:`hpml_compile.runtime.job.lifeline`)
    is alive a few seconds after the launcher exited;
(c) no checkpoint lost or damaged: after each leg every checkpoint in
    ``RUN/checkpoints`` passes :func:`~hpml_compile.runtime.execute.checkpoint.damage`,
    the newest is the leg's last step, and the newest step never goes back;
(d) a count of the faults survived, by kind.

How: gpt-tiny is compiled once for ``local-cpu-3`` (uniform solver, 2
microbatches: quick and valid). The job is one run folder advanced in *legs*:
leg k is ``hpml-compile run BUILD --adapt --run-dir RUN --steps S_k`` with
``S_k`` growing by a seeded random 30-90 steps (``--leg-steps``; 8 times that
for a slow leg, so that a switch can pay for its restart); a run folder
used again goes on in new segments from ``RUN/checkpoints`` (see
:func:`hpml_compile.runtime.job.supervisor.supervise`). Each leg injects exactly
one fault drawn from ``random.Random(--seed)``, at a step inside the leg, on
a rank of the 3-rank build:

- ``kill``: ``--kill-at STEP:RANK``: the rank exits abruptly (137); the job
  drops its device and re-plans for the 2 left, within the leg;
- ``hang``: ``--hang-at STEP:RANK`` with ``--timeout`` (15 s): its peers time
  out, the job restarts on the same devices, the rank hangs again at the same
  step (the injected hang follows the device) and after ``--max-failures`` (2)
  the device is dropped and the job re-plans for 2;
- ``slow``: ``--slow RANK:FACTOR:STEP`` with FACTOR in [2, 4], from a step in
  the first third of the leg: the imbalance watch may switch plans (it
  switches only when the predicted gain pays for a restart).

Every leg starts from the 3-device build again (a dropped device is back: the
machine was replaced between legs), so every fault hits a 3-rank job. Legs go
on until ``--minutes`` have passed; then one more leg without a fault. Then
the reference: the same build run uninterrupted (``run BUILD --steps TOTAL``,
no ``--adapt``, no checkpoints) in its own folder.

Losses: each step's loss is rank 0's row of the segment that ran it last (a
step redone after a failure counts once, the last record wins), compared with
the reference's step by step.

Tolerance: a leg that ran on the original plan only reproduces the reference
bit for bit (same plan, same order of float operations, the checkpoint
restores parameters, AdamW moments and RNG states exactly). A re-plan to 2
devices (or to another 3-device plan) changes the stages and so the order in
which float32 gradients are summed and reduced: each step then differs at the
float32 rounding level (~1e-7 relative), and these differences are carried
into every later step through the parameters and AdamW's moments. ``--rtol``
(default 1e-4) allows three orders of magnitude of such drift; the measured
maximum is printed next to it.

Two hosts (``--hosts 2``, :mod:`twohosts`): the same job on two ``run
--adapt`` agents of this machine standing in for two hosts (``--ranks-per-host``
1 or 2: a build for ``local-cpu-2`` or ``-4``), one run folder between them,
and two more fault kinds: ``host0`` and ``host1``, the whole host (its agent
and every rank) killed at a step; every leg starts both hosts again, so a
killed host comes back as a new agent joining the job. The reference is the
same build on one launcher.

Besides (a)-(d), each leg counts the steps it lost: the steps its segments ran
(rank 0's) beyond the leg's own, i.e. those recomputed after the fault; the
totals give, by fault kind, the faults survived, the steps lost and the
orphans.

Run:  .venv/bin/python benchmarks/soak/main.py [--minutes 30] [--seed 0]
      .venv/bin/python benchmarks/soak/main.py --minutes 3     # smoke, ~5 minutes
      .venv/bin/python benchmarks/soak/main.py --hosts 2 [--kinds host0,host1,kill]
Prints a table per leg and the totals; writes benchmarks/soak/results/soak.json
(soak-2hosts.json with ``--hosts 2``; the work folder with every leg's log and
the run folders is kept and named).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import twohosts
from legs import CLI, GRACE_S, Leg, compare, draw_fault, launcher_children, run_leg, step_losses

HERE = Path(__file__).resolve().parent
RANKS = 3
KINDS = ("kill", "hang", "slow")
SLOW_LEG = 8  # a slow leg is this much longer: a switch (~15 s of restart here) pays only over hundreds of steps


def _cli(*args: str) -> None:
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode:
        raise SystemExit(f"hpml-compile {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")


def _leg_steps(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, e.g. 30:90, got {text!r}") from e
    if not 12 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 12 <= MIN <= MAX (room for a fault inside the leg), got {text!r}")
    return lo, hi


def print_table(legs: list[Leg]) -> None:
    print(f"{'leg':>3s} {'steps':>9s}  {'fault':24s} {'what the job did':58s} {'s':>6s} {'lost':>4s} "
          f"{'devices':>7s}  ok")
    for g in legs:
        did = "; ".join(g.did) or "-"
        print(f"{g.leg:3d} {g.start:4d}-{g.end:<4d}  {str(g.fault) if g.fault else 'none':24s} {did[:58]:58s} "
              f"{g.wall_s:6.1f} {g.steps_lost:4d} {len(g.devices_end):7d}  {'yes' if g.survived else 'NO'}")


def totals(legs: list[Leg], loss: dict[str, Any], kinds: tuple[str, ...]) -> dict[str, Any]:
    """The soak's figures: by fault kind (injected, survived, steps lost, orphans, host kills that missed), and
    over every leg (orphans, checkpoints, failed re-plans), with the loss check ``loss``."""
    by_kind = {k: {"injected": 0, "survived": 0, "steps_lost": 0, "orphans": 0, "missed": 0} for k in kinds}
    for g in legs:
        if g.fault:
            row = by_kind[g.fault.kind]
            if not g.hit:
                row["missed"] += 1
                continue
            row["injected"] += 1
            row["survived"] += int(g.survived)
            row["steps_lost"] += g.steps_lost
            row["orphans"] += len(g.orphans)
    newest = [g.newest for g in legs]
    return {"faults": by_kind, "legs_survived": sum(g.survived for g in legs), "legs": len(legs),
            "steps_lost": sum(g.steps_lost for g in legs),
            "orphans": sorted({p for g in legs for p in g.orphans}),
            "orphans_at_exit": sorted({p for g in legs for p in g.orphans_at_exit}),
            "checkpoints_damaged": sum(len(g.damaged) for g in legs),
            "checkpoint_went_back": any(b < a for a, b in zip(newest, newest[1:])),
            "legs_without_final_checkpoint": [g.leg for g in legs if g.newest != g.end],
            "stray_tmp_folders": sum(g.tmp_folders for g in legs[-1:]),
            "failed_replans": [e for g in legs for e in g.replan_errors], "loss": loss}


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in twohosts.KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"expected fault kinds separated by commas, of {', '.join(twohosts.KINDS)} "
                                         f"(host0, host1 with --hosts 2), got {text!r}")
    return kinds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The soak's options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock time for the faulty legs (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seeds the faults and the legs' lengths")
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                   help="1: one launcher; 2: two agents on this machine as two hosts, host kills among the faults")
    p.add_argument("--ranks-per-host", type=int, choices=(1, 2), default=1, dest="ranks_per_host",
                   help="with --hosts 2: ranks on each host (default 1; the build is for local-cpu-2 or -4)")
    p.add_argument("--kinds", type=_kinds, default=None,
                   help="the fault kinds, e.g. host0,host1,kill (default: all of the mode's kinds)")
    p.add_argument("--leg-steps", type=_leg_steps, default=(30, 90), dest="leg_steps", metavar="MIN:MAX",
                   help="steps per leg, drawn uniformly (default 30:90)")
    p.add_argument("--timeout", type=float, default=15.0, help="run --timeout: a hung peer fails after it (s)")
    p.add_argument("--host-timeout", type=float, default=3.0, dest="host_timeout",
                   help="with --hosts 2: run --host-timeout, the silence after which a host is lost (s, default 3)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative loss tolerance against the reference")
    p.add_argument("--max-faults", type=int, default=0, dest="max_faults",
                   help="stop injecting after this many faults even if time is left (default 0: no cap)")
    p.add_argument("--leg-limit", type=float, default=900.0, dest="leg_limit",
                   help="a leg still running after this many seconds is stopped and counts as not survived")
    p.add_argument("--work", type=Path, default=None, help="work folder (default: a new temporary one; kept)")
    p.add_argument("--out", type=Path, default=None, help="default results/soak.json (results/soak-2hosts.json)")
    a = p.parse_args(argv)
    all_kinds = KINDS if a.hosts == 1 else twohosts.KINDS
    if a.kinds is not None and not set(a.kinds) <= set(all_kinds):
        p.error(f"--kinds {','.join(a.kinds)}: with --hosts {a.hosts} the kinds are {', '.join(all_kinds)}")
    a.kinds = a.kinds or all_kinds
    a.ranks = RANKS if a.hosts == 1 else 2 * a.ranks_per_host
    a.out = a.out or HERE / "results" / ("soak.json" if a.hosts == 1 else "soak-2hosts.json")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cluster = f"local-cpu-{a.ranks}"
    work = a.work or Path(tempfile.mkdtemp(prefix="hpml-soak-"))
    build, run, ref, logs = work / "build", work / "run", work / "ref", work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    print(f"compiling gpt-tiny for {cluster} into {build} ...", flush=True)
    _cli("compile", "gpt-tiny", "--cluster", cluster, "--solver", "uniform", "--microbatches", "2",
         "--repeats", "1", "-o", str(build))
    legs: list[Leg] = []
    t0 = time.monotonic()
    end = 0
    final = False
    kinds: list[str] = []
    while not final:
        final = (time.monotonic() - t0 >= a.minutes * 60) or (a.max_faults > 0 and len(legs) >= a.max_faults)
        start = legs[-1].newest if legs else 0  # after a leg not survived: from what is left
        if not kinds:  # kinds come in shuffled rounds: each kind once in every round
            kinds = rng.sample(a.kinds, len(a.kinds))
        kind = None if final else kinds.pop()
        end = start + rng.randint(*a.leg_steps) * (SLOW_LEG if kind == "slow" else 1)
        leg = Leg(len(legs), start, end, None if kind is None else draw_fault(rng, kind, start, end, a.ranks))
        print(f"[{(time.monotonic() - t0) / 60:5.1f} min] leg {leg.leg}: steps {start + 1}-{end}, "
              f"fault: {leg.fault or 'none'} ...", flush=True)
        if a.hosts == 1:
            run_leg(build, run, logs, leg, a.timeout, a.leg_limit)
        else:
            twohosts.run_leg(build, run, logs, leg, a)
        print(f"    {'; '.join(leg.did) or 'nothing to do'} ({leg.wall_s:.0f} s, rc {leg.rc}, newest checkpoint "
              f"{leg.newest}, steps lost {leg.steps_lost}, orphans {len(leg.orphans)})", flush=True)
        legs.append(leg)
    soak_s = time.monotonic() - t0
    print(f"reference: {end} steps uninterrupted ...", flush=True)
    r0 = time.perf_counter()
    p_ref = subprocess.Popen([*CLI, "run", str(build), "--steps", str(end), "--run-dir", str(ref), "--no-tensorboard",
                              "--no-report"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL)
    if p_ref.wait():
        raise SystemExit(f"the reference run failed (exit {p_ref.returncode}); see {ref}")
    ref_s = time.perf_counter() - r0
    time.sleep(GRACE_S)
    ref_orphans = launcher_children(p_ref.pid)
    segs = sorted((q for q in run.glob("seg*") if q.name[3:].isdigit()), key=lambda q: int(q.name[3:]))
    loss = compare(step_losses(segs), step_losses([ref]), a.rtol)
    t = totals(legs, loss, a.kinds)
    t["orphans_of_reference"] = ref_orphans

    where = "one launcher" if a.hosts == 1 else f"2 hosts x {a.ranks_per_host} (agents on this machine)"
    print(f"\nsoak: gpt-tiny on {a.ranks} gloo ranks, {where}, `run --adapt`, {a.minutes:g} min of faults (seed {a.seed}), "
          f"{os.cpu_count()} cores, {platform.machine()}")
    print_table(legs)
    print(f"\n{'kind':6s} {'injected':>8s} {'survived':>8s} {'steps lost':>10s} {'orphans':>7s} {'missed':>6s}")
    for k, v in t["faults"].items():
        print(f"{k:6s} {v['injected']:8d} {v['survived']:8d} {v['steps_lost']:10d} {v['orphans']:7d} {v['missed']:6d}")
    print(f"legs survived {t['legs_survived']}/{t['legs']}; steps lost (recomputed after a fault) {t['steps_lost']}")
    print(f"orphan processes: {len(t['orphans'])} (still alive at the launcher's exit: {len(t['orphans_at_exit'])}; "
          f"after the reference: {len(ref_orphans)})")
    if t["failed_replans"]:
        print(f"imbalance re-plans that failed (the job went on on its plan): {len(t['failed_replans'])}: "
              f"{t['failed_replans'][0][:160]}")
    print(f"checkpoints: {t['checkpoints_damaged']} damaged; newest step went back: {t['checkpoint_went_back']}; "
          f"legs ending without their final checkpoint: {t['legs_without_final_checkpoint'] or 'none'}")
    print(f"loss vs uninterrupted run ({loss['steps']} steps, {ref_s:.0f} s): max relative difference "
          f"{loss['max_rel_diff']:.3g} at step {loss['max_rel_diff_step']} (tolerance {a.rtol:g}); "
          f"{loss['identical_steps']} steps bit-identical, first difference at step {loss['first_different_step']}; "
          f"missing steps: {len(loss['missing_steps'])}; within tolerance: {loss['within_tolerance']}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "model": "gpt-tiny", "cluster": cluster, "hosts": a.hosts, "kinds": list(a.kinds), "minutes": a.minutes, "seed": a.seed,
        "leg_steps": list(a.leg_steps), "timeout_s": a.timeout, "soak_s": soak_s, "reference_s": ref_s,
        "work": str(work), "machine": {"cpus": os.cpu_count(), "arch": platform.machine()},
        "legs": [{**asdict(g), "fault": asdict(g.fault) if g.fault else None} for g in legs], "totals": t},
        indent=2) + "\n")
    print(f"wrote {a.out} (logs and run folders in {work})")
    ok = (t["legs_survived"] == t["legs"] and not t["orphans"] and not ref_orphans and not t["checkpoints_damaged"]
          and not t["checkpoint_went_back"] and loss["within_tolerance"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
