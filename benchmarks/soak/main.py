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

Run:  .venv/bin/python benchmarks/soak/main.py [--minutes 30] [--seed 0]
      .venv/bin/python benchmarks/soak/main.py --minutes 3     # smoke, ~5 minutes
Prints a table per leg and the totals; writes benchmarks/soak/results/soak.json
(the work folder with every leg's log and the run folders is kept and named).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpml_compile.runtime.execute.checkpoint import damage, list_checkpoints
from hpml_compile.runtime.job.lifeline import LAUNCHER_PID_ENV
from hpml_compile.runtime.observe.monitor import read_metrics

HERE = Path(__file__).resolve().parent
CLI = [sys.executable, "-m", "hpml_compile"]
RANKS = 3
KINDS = ("kill", "hang", "slow")
_STEP_DIR = re.compile(r"step_(\d+)$")
SLOW_LEG = 8  # a slow leg is this much longer: a switch (~15 s of restart here) pays only over hundreds of steps
_GRACE_S = 3.0  # the ranks poll their launcher every 0.25 s (lifeline.watch_launcher)


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: its kind, the rank of the 3-rank build, the step (from 1), the slow-down."""

    kind: str
    rank: int
    step: int
    factor: float = 1.0

    def flags(self) -> list[str]:
        """The ``hpml-compile run`` options that inject it."""
        if self.kind == "kill":
            return ["--kill-at", f"{self.step}:{self.rank}"]
        if self.kind == "hang":
            return ["--hang-at", f"{self.step}:{self.rank}"]
        return ["--slow", f"{self.rank}:{self.factor:g}:{self.step}"]

    def __str__(self) -> str:
        extra = f" x{self.factor:g}" if self.kind == "slow" else ""
        return f"{self.kind} rank {self.rank} at {self.step}{extra}"


@dataclass(slots=True)
class Leg:
    """What one leg did, and what was checked after it."""

    leg: int
    start: int
    end: int
    fault: Fault | None
    rc: int = 0
    wall_s: float = 0.0
    launcher_pid: int = 0
    survived: bool = False
    did: list[str] = field(default_factory=list)
    devices_end: list[str] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    orphans_at_exit: list[int] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    damaged: dict[str, str] = field(default_factory=dict)
    newest: int = 0
    tmp_folders: int = 0
    replan_errors: list[str] = field(default_factory=list)
    log: str = ""


def draw_fault(rng: random.Random, kind: str, start: int, end: int) -> Fault:
    """A fault of ``kind`` inside steps ``start+1 .. end`` on a random rank (bounded: a kill or hang at least
    2 steps after the resume point and 2 before the end; a slow-down from a step in the first third, factor
    2-4, so the watch has steps left to see it)."""
    rank = rng.randrange(RANKS)
    if kind == "slow":
        return Fault(kind, rank, rng.randint(start + 2, start + max(2, (end - start) // 3)),
                     round(rng.uniform(2.0, 4.0), 1))
    return Fault(kind, rank, rng.randint(start + 2, end - 2))


def launcher_children(pid: int) -> list[int]:
    """PIDs of live processes started under launcher ``pid`` (their environment names it)."""
    want = f"{LAUNCHER_PID_ENV}={pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or not ours
            continue
        if want in env.split(b"\0") and state != "Z":  # a zombie has exited; its parent has not reaped it yet
            found.append(int(entry.name))
    return sorted(found)


def _step_of(path: Path) -> int:
    m = _STEP_DIR.search(path.name)
    return int(m.group(1)) if m else -1


def check_checkpoints(root: Path, leg: Leg) -> None:
    """Fill ``leg`` with the checkpoints under ``root``, the damaged ones, the newest step, stray ``.tmp``."""
    found = list_checkpoints(root)
    leg.checkpoints = [_step_of(p) for p in found]
    leg.damaged = {p.name: why for p in found if (why := damage(p)) is not None}
    leg.newest = max(leg.checkpoints, default=0)
    leg.tmp_folders = sum(1 for p in root.glob("*.tmp")) if root.is_dir() else 0


def _events(run: Path) -> list[dict[str, Any]]:
    path = run / "events.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def describe(events: list[dict[str, Any]], run: Path, leg: Leg) -> None:
    """What the job did in this leg's events: failures, restarts, drops, re-plans, switches, kept plans."""
    kept = 0
    for e in events:
        if e["event"] == "segment":
            leg.segments.append(e["segment"])
            leg.devices_end = e["devices"]
            for d in _decisions(run / f"seg{e['segment']}"):
                if str(d.get("why", "")).startswith("re-planning failed"):  # the job went on on its plan
                    leg.did.append(f"re-plan FAILED at {d['step']}")
                    leg.replan_errors.append(d["why"])
                elif not d.get("switch"):
                    kept += 1
        elif e["event"] == "failure":
            leg.did.append(f"{e['device']} {e['cause']}: " + ("dropped" if e["dropped"] else "restarted"))
        elif e["event"] == "replan":
            leg.did.append(f"re-planned for {len(e['devices'])}")
        elif e["event"] == "switch":
            leg.did.append(f"switched plan at {e['step']}")
    if kept:  # the imbalance watch looked and found no switch worth its restart
        leg.did.append(f"kept plan x{kept}")


def _decisions(seg: Path) -> list[dict[str, Any]]:
    path = seg / "replans.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def run_leg(build: Path, run: Path, logs: Path, leg: Leg, timeout: float, limit_s: float) -> None:
    """Advance the job to ``leg.end`` with ``leg.fault`` injected; check processes and checkpoints after."""
    seen = len(_events(run))
    cmd = [*CLI, "run", str(build), "--adapt", "--run-dir", str(run), "--steps", str(leg.end), "--timeout",
           f"{timeout:g}", "--no-tensorboard", "--no-report", *(leg.fault.flags() if leg.fault else [])]
    log = logs / f"leg{leg.leg:03d}.log"
    leg.log = str(log)
    t0 = time.perf_counter()
    with log.open("w") as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        leg.launcher_pid = p.pid
        try:
            leg.rc = p.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:  # not survived: stop the launcher we started, then see what is left
            p.send_signal(signal.SIGTERM)
            try:
                leg.rc = p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                leg.rc = p.wait()
            leg.did.append(f"no end within {limit_s:g} s: stopped")
    leg.wall_s = time.perf_counter() - t0
    leg.orphans_at_exit = launcher_children(p.pid)
    deadline = time.monotonic() + _GRACE_S
    leg.orphans = leg.orphans_at_exit
    while leg.orphans and time.monotonic() < deadline:
        time.sleep(0.25)
        leg.orphans = launcher_children(p.pid)
    events = _events(run)[seen:]
    describe(events, run, leg)
    check_checkpoints(run / "checkpoints", leg)
    done = any(e["event"] == "done" for e in events)
    leg.survived = leg.rc == 0 and done and leg.newest == leg.end and not leg.damaged


def step_losses(folders: list[Path]) -> dict[int, float]:
    """Step (from 1) -> rank 0's loss, the later folder winning (a redone step counts once)."""
    out: dict[int, float] = {}
    for folder in folders:
        for m in read_metrics(folder).get(0, []):
            if m.loss is not None:
                out[m.step + 1] = m.loss
    return out


def compare(soak: dict[int, float], ref: dict[int, float], rtol: float) -> dict[str, Any]:
    """Step-by-step relative difference of the soak's losses to the reference's."""
    steps = sorted(set(ref) | set(soak))
    missing = [s for s in steps if s not in soak or s not in ref]
    rel = {s: abs(soak[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in steps if s in soak and s in ref}
    worst = max(rel, key=lambda s: rel[s], default=None)
    over = [s for s, r in rel.items() if r > rtol]
    return {"steps": len(steps), "missing_steps": missing, "identical_steps": sum(1 for r in rel.values() if r == 0),
            "first_different_step": min((s for s, r in rel.items() if r > 0), default=None),
            "max_rel_diff": rel[worst] if worst else 0.0, "max_rel_diff_step": worst,
            "steps_over_rtol": over[:20], "n_over_rtol": len(over), "rtol": rtol,
            "within_tolerance": not over and not missing,
            "loss_first": ref.get(1), "loss_last": ref.get(max(ref, default=0))}


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
    print(f"{'leg':>3s} {'steps':>9s}  {'fault':24s} {'what the job did':58s} {'s':>6s} {'devices':>7s}  ok")
    for g in legs:
        did = "; ".join(g.did) or "-"
        print(f"{g.leg:3d} {g.start:4d}-{g.end:<4d}  {str(g.fault) if g.fault else 'none':24s} {did[:58]:58s} "
              f"{g.wall_s:6.1f} {len(g.devices_end):7d}  {'yes' if g.survived else 'NO'}")


def totals(legs: list[Leg], loss: dict[str, Any]) -> dict[str, Any]:
    by_kind = {k: {"injected": 0, "survived": 0} for k in KINDS}
    for g in legs:
        if g.fault:
            by_kind[g.fault.kind]["injected"] += 1
            by_kind[g.fault.kind]["survived"] += int(g.survived)
    newest = [g.newest for g in legs]
    return {"faults": by_kind, "legs_survived": sum(g.survived for g in legs), "legs": len(legs),
            "orphans": sorted({p for g in legs for p in g.orphans}),
            "orphans_at_exit": sorted({p for g in legs for p in g.orphans_at_exit}),
            "checkpoints_damaged": sum(len(g.damaged) for g in legs),
            "checkpoint_went_back": any(b < a for a, b in zip(newest, newest[1:])),
            "legs_without_final_checkpoint": [g.leg for g in legs if g.newest != g.end],
            "stray_tmp_folders": sum(g.tmp_folders for g in legs[-1:]),
            "failed_replans": [e for g in legs for e in g.replan_errors], "loss": loss}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock time for the faulty legs (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seeds the faults and the legs' lengths")
    p.add_argument("--leg-steps", type=_leg_steps, default=(30, 90), dest="leg_steps", metavar="MIN:MAX",
                   help="steps per leg, drawn uniformly (default 30:90)")
    p.add_argument("--timeout", type=float, default=15.0, help="run --timeout: a hung peer fails after it (s)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative loss tolerance against the reference")
    p.add_argument("--max-faults", type=int, default=0, dest="max_faults",
                   help="stop injecting after this many faults even if time is left (default 0: no cap)")
    p.add_argument("--leg-limit", type=float, default=900.0, dest="leg_limit",
                   help="a leg still running after this many seconds is stopped and counts as not survived")
    p.add_argument("--work", type=Path, default=None, help="work folder (default: a new temporary one; kept)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "soak.json")
    a = p.parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="hpml-soak-"))
    build, run, ref, logs = work / "build", work / "run", work / "ref", work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    print(f"compiling gpt-tiny for local-cpu-3 into {build} ...", flush=True)
    _cli("compile", "gpt-tiny", "--cluster", "local-cpu-3", "--solver", "uniform", "--microbatches", "2",
         "--repeats", "1", "-o", str(build))
    legs: list[Leg] = []
    t0 = time.monotonic()
    end = 0
    final = False
    kinds: list[str] = []
    while not final:
        final = (time.monotonic() - t0 >= a.minutes * 60) or (a.max_faults > 0 and len(legs) >= a.max_faults)
        start = legs[-1].newest if legs else 0  # after a leg not survived: from what is left
        if not kinds:  # kinds come in shuffled rounds: each kind once in every round of 3 legs
            kinds = rng.sample(KINDS, len(KINDS))
        kind = None if final else kinds.pop()
        end = start + rng.randint(*a.leg_steps) * (SLOW_LEG if kind == "slow" else 1)
        leg = Leg(len(legs), start, end, None if kind is None else draw_fault(rng, kind, start, end))
        print(f"[{(time.monotonic() - t0) / 60:5.1f} min] leg {leg.leg}: steps {start + 1}-{end}, "
              f"fault: {leg.fault or 'none'} ...", flush=True)
        run_leg(build, run, logs, leg, a.timeout, a.leg_limit)
        print(f"    {'; '.join(leg.did) or 'nothing to do'} ({leg.wall_s:.0f} s, rc {leg.rc}, newest checkpoint "
              f"{leg.newest}, orphans {len(leg.orphans)})", flush=True)
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
    time.sleep(_GRACE_S)
    ref_orphans = launcher_children(p_ref.pid)
    segs = sorted((q for q in run.glob("seg*") if q.name[3:].isdigit()), key=lambda q: int(q.name[3:]))
    loss = compare(step_losses(segs), step_losses([ref]), a.rtol)
    t = totals(legs, loss)
    t["orphans_of_reference"] = ref_orphans

    print(f"\nsoak: gpt-tiny on {RANKS} gloo ranks, `run --adapt`, {a.minutes:g} min of faults (seed {a.seed}), "
          f"{os.cpu_count()} cores, {platform.machine()}")
    print_table(legs)
    kinds = ", ".join(f"{k} {v['survived']}/{v['injected']}" for k, v in t["faults"].items())
    print(f"\nfaults survived, by kind: {kinds}; legs survived {t['legs_survived']}/{t['legs']}")
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
        "model": "gpt-tiny", "cluster": "local-cpu-3", "minutes": a.minutes, "seed": a.seed,
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
