"""The soak's legs: one fault, one advance of the job, and the checks after it (processes, checkpoints, steps).

Shared by the one-host soak (:mod:`main`) and its two-host mode (:mod:`twohosts`).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpml_compile.runtime.execute.checkpoint import damage, list_checkpoints
from hpml_compile.runtime.job.lifeline import LAUNCHER_PID_ENV
from hpml_compile.runtime.observe.monitor import read_metrics

CLI = [sys.executable, "-m", "hpml_compile"]
_STEP_DIR = re.compile(r"step_(\d+)$")
GRACE_S = 3.0  # the ranks poll their launcher every 0.25 s (lifeline.watch_launcher)
HOST_MARGIN = 10  # a host is killed at least this many steps before the leg's end, so that it lands in time


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: its kind, the rank of the build (the host for ``hostH``), the step (from 1), the slow-down."""

    kind: str
    rank: int
    step: int
    factor: float = 1.0

    def flags(self) -> list[str]:
        """The ``hpml-compile run`` options that inject it (none for a host kill: the soak kills the host itself)."""
        if self.kind.startswith("host"):
            return []
        if self.kind == "kill":
            return ["--kill-at", f"{self.step}:{self.rank}"]
        if self.kind == "hang":
            return ["--hang-at", f"{self.step}:{self.rank}"]
        return ["--slow", f"{self.rank}:{self.factor:g}:{self.step}"]

    def __str__(self) -> str:
        extra = f" x{self.factor:g}" if self.kind == "slow" else ""
        if self.kind.startswith("host"):
            return f"kill host {self.rank} at {self.step}"
        return f"{self.kind} rank {self.rank} at {self.step}{extra}"


@dataclass(slots=True)
class Leg:
    """What one leg did, and what was checked after it."""

    leg: int
    start: int
    end: int
    fault: Fault | None
    rc: int = 0
    hit: bool = True
    steps_run: int = 0
    steps_lost: int = 0
    wall_s: float = 0.0
    launcher_pid: int = 0
    launchers: list[int] = field(default_factory=list)
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


def draw_fault(rng: random.Random, kind: str, start: int, end: int, ranks: int = 3) -> Fault:
    """A fault of ``kind`` inside steps ``start+1 .. end``.

    A kill or hang: on a random rank of ``ranks``, at least 2 steps after the resume point and 2 before the end.
    A slow-down: from a step in the first third, factor 2-4, so the watch has steps left to see it. ``hostH``:
    host ``H`` killed (its agent and ranks), ``HOST_MARGIN`` steps or more before the end.
    """
    if kind.startswith("host"):
        return Fault(kind, int(kind[4:]), rng.randint(start + 2, max(start + 2, end - HOST_MARGIN)))
    rank = rng.randrange(ranks)
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


def read_events(run: Path) -> list[dict[str, Any]]:
    """The job's events so far (``RUN/events.jsonl``), oldest first."""
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
            what = f"host {e['host']} lost" if e["cause"] == "host lost" else f"{e['device']} {e['cause']}"
            leg.did.append(f"{what}: " + ("dropped" if e["dropped"] else "restarted"))
        elif e["event"] == "lead_moved":
            leg.did.append(f"host {e['host']} took the lead")
        elif e["event"] == "replan":
            leg.did.append(f"re-planned for {len(e['devices'])}")
        elif e["event"] == "switch":
            leg.did.append(f"switched plan at {e['step']}")
    if kept:  # the imbalance watch looked and found no switch worth its restart
        leg.did.append(f"kept plan x{kept}")


def _decisions(seg: Path) -> list[dict[str, Any]]:
    path = seg / "replans.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def leg_command(build: Path, run: Path, leg: Leg, timeout: float) -> list[str]:
    """The ``hpml-compile run --adapt`` line that advances the job to ``leg.end`` with ``leg.fault`` injected."""
    return [*CLI, "run", str(build), "--adapt", "--run-dir", str(run), "--steps", str(leg.end), "--timeout",
            f"{timeout:g}", "--no-tensorboard", "--no-report", *(leg.fault.flags() if leg.fault else [])]


def wait_launchers(procs: list[subprocess.Popen[bytes]], deadline: float, leg: Leg) -> list[int]:
    """The launchers' exit codes; those still running at ``deadline`` (monotonic) are stopped together (SIGTERM,
    then SIGKILL after 30 s), so that none sees the others go first and takes it for a fault."""
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    late = [p for p in procs if p.poll() is None]
    for p in late:  # not survived: stop the launchers we started, then see what is left
        p.send_signal(signal.SIGTERM)
        leg.did.append(f"launcher {p.pid} did not end in time: stopped")
    for p in late:
        try:
            p.wait(timeout=max(0.0, deadline + 30 - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    return [p.wait() for p in procs]


def orphans_of(pids: list[int]) -> tuple[list[int], list[int]]:
    """Processes started under the launchers ``pids`` (exited): alive at once, and still alive after a grace."""
    at_exit = sorted(q for pid in pids for q in launcher_children(pid))
    left, deadline = at_exit, time.monotonic() + GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = sorted(q for pid in pids for q in launcher_children(pid))
    return at_exit, left


def check_leg(run: Path, leg: Leg, seen: int, launchers: list[int], ok_rc: bool) -> None:
    """After a leg's launchers exited: orphans, what the job did, checkpoints, steps recomputed, and survival
    (``ok_rc``: the launchers that should have ended well did, and the job logged ``done`` since event ``seen``)."""
    leg.orphans_at_exit, leg.orphans = orphans_of(launchers)
    events = read_events(run)[seen:]
    describe(events, run, leg)
    check_checkpoints(run / "checkpoints", leg)
    leg.steps_run = sum(len(read_metrics(run / f"seg{s}").get(0, [])) for s in leg.segments)
    leg.steps_lost = max(0, leg.steps_run - (leg.end - leg.start))
    done = any(e["event"] == "done" for e in events)
    leg.survived = ok_rc and done and leg.newest == leg.end and not leg.damaged


def run_leg(build: Path, run: Path, logs: Path, leg: Leg, timeout: float, limit_s: float) -> None:
    """Advance the job to ``leg.end`` with ``leg.fault`` injected; check processes and checkpoints after."""
    seen = len(read_events(run))
    cmd = leg_command(build, run, leg, timeout)
    log = logs / f"leg{leg.leg:03d}.log"
    leg.log = str(log)
    t0 = time.perf_counter()
    with log.open("w") as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        leg.launcher_pid = p.pid
        leg.launchers = [p.pid]
        leg.rc = wait_launchers([p], time.monotonic() + limit_s, leg)[0]
    leg.wall_s = time.perf_counter() - t0
    check_leg(run, leg, seen, [p.pid], leg.rc == 0)


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


