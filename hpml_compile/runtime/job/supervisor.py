"""The loop around torchrun that carries a job to its last step through re-plans and failures.

``hpml-compile run BUILD --adapt`` runs the job as a sequence of *segments*,
each one launch of one build, in ``RUN_DIR/seg<k>/`` (a complete run
folder: ``report`` reads it). On one host the supervisor starts the ranks
itself and hosts their store (:mod:`.hostranks`: torchrun's agent would stop
every rank when one dies); across hosts each segment is one torchrun launch
per host (:mod:`.multihost`). Checkpoints live in ``RUN_DIR/checkpoints`` and
every segment resumes from the latest one.

A rank that dies while it is one replica of a replicated stage does not end
the segment: its peers (a live session, :mod:`hpml_compile.runtime.execute.members`)
agree it is gone, take its rows and run the failed step again in their own
processes, from the same parameters, with no checkpoint read; the job's events
get a ``replica_lost`` event (:func:`record_lost`). Where they cannot (the
stage had no other replica, or the lost one held state the others lack:
ZeRO shards, a compressor's error feedback, local SGD), they fail saying so,
and the segment ends in a failure as below, every dead rank's device dropped.
A segment ends in one of three ways:

- **done**: the last step is reached (a final checkpoint is written);
- **switch**: the ranks' closed loop (:mod:`.adapt`) found a plan worth
  switching to, generated its build, checkpointed and stopped; the next
  segment runs the new build;
- **failure**: a rank failed, or died where its peers could not go on. The
  launcher sees it and stops the others; :func:`blame` reads the exit codes and the ranks' error reports to
  find the culprit. A rank that died (killed by a signal, exit 137) lost its
  device: the device is dropped. A rank that failed (a communication
  time-out, a crash) is restarted on the same devices from the last
  checkpoint, until its device has failed ``max_failures`` times
  (:class:`~.policy.FailureLedger`); then it is dropped. A restart on the
  same devices keeps the rows per replica in force when the ranks failed:
  rows the closed loop moved in place (:mod:`.adapt`) are in the failed
  segment's plan.json, which each move re-publishes; the next segment's
  plan.json is that plan, and its ranks take its rows before their first
  step (the segment options' ``rows_from``; :func:`rows_in_force`). Without it the
  restart would run the build's rows again, the very split the closed loop
  had moved away from a slowed replica. Dropping a device
  re-plans for the devices left (the measured profile of the failed
  segment, when it has one), and the next segment runs on fewer ranks. When
  nothing fits on what is left, the job stops with a message naming the
  shortfall and the last checkpoint, which is intact.
  A bad input (a user error) is never retried.

Fault injection (``--slow``, ``--kill-at``, ``--hang-at``) names ranks of the *first* plan;
the supervisor translates them to devices, so a slowed device stays slow under
the next plan whatever rank it then has, and a killed device is gone.

Run again with the same ``RUN_DIR`` (after the supervisor itself was stopped),
a job goes on from its latest checkpoint in new segments. Every segment and
decision is logged to ``RUN_DIR/events.jsonl``;
:func:`timings` turns it into detection, re-plan and resume times. Rows moved
in place do not end a segment: the ranks record each move in the segment's
``replans.jsonl`` as it happens, and when the segment ends (done, switch or
failure) the supervisor copies each into ``events.jsonl`` as a
``rows_moved`` event at the time it was decided, with its measured cost
(``switch_s``), before the event that ended the segment. (A supervisor
stopped while a segment runs has written none of that segment's moves yet;
its ``replans.jsonl`` has them.)
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ... import driver
from ...errors import HpmlError, InfeasibleError, SupervisorError
from ...plan import Plan, load_plan, save_plan
from ...profile import load_profile
from ..execute.checkpoint import latest
from ..observe.monitor import read_metrics
from ..observe.policy import FailureLedger
from ..observe.runfolder import RunFolder
from .hostranks import LostRank, died, launch_here
from .launcher import RankFailure, prepare_run_dir
from .options import ResumeMode, RunOptions

__all__ = ["Culprit", "SupervisorError", "blame", "supervise", "timings", "plan_devices", "in_place_moves",
           "rows_in_force", "record_moves", "Job", "start_segment", "after_failure", "after_success", "replan_without",
           "can_go_on_live", "record_lost"]


def plan_devices(plan: Plan) -> list[str]:
    """The device of each rank, in rank order."""
    return [d for st in plan.stages for d in st.devices]


@dataclass(frozen=True, slots=True)
class Culprit:
    """The rank a failure is blamed on, and what happened to it.

    Attributes:
        rank: the rank.
        cause: ``killed`` (a signal or exit 137: its device is lost), ``comm`` (communication failed or timed
            out), ``crash`` (an exception), ``user`` (bad input: never retried), ``unknown``.
        message: its own report, or torchrun's.
        time: when it reported (epoch seconds; the supervisor's clock when it did not).
    """

    rank: int
    cause: str
    message: str
    time: float


def blame(failures: dict[int, tuple[int, str]], run_dir: Path) -> Culprit:
    """The rank that caused a failure, from torchrun's exit codes and the ranks' own reports.

    A rank that died (exit 137 or a signal other than the SIGTERM torchrun sends
    the others) comes first; then the earliest report that is not a
    communication error (its peers' reports are only echoes of it); then a
    rank that never reported while others did (it hung: its peers timed
    out); else the earliest report.
    """
    reports = {rank: info for rank in failures for info in [RunFolder(run_dir).read_error(rank)] if info is not None}
    now = time.time()

    def culprit(rank: int, cause: str) -> Culprit:
        info = reports.get(rank, {})
        return Culprit(rank, cause, info.get("message") or failures[rank][1] or f"exit code {failures[rank][0]}",
                       float(info.get("time", now)))

    dead = [r for r, (code, _) in failures.items() if died(code) or reports.get(r, {}).get("kind") == "killed"]
    if dead:
        return culprit(min(dead, key=lambda r: reports.get(r, {}).get("time", now)), "killed")
    own = sorted((info["time"], r) for r, info in reports.items() if info.get("kind", "crash") != "comm")
    if own:
        r = own[0][1]
        kind = reports[r].get("kind") or ("user" if reports[r].get("user_error") else "crash")
        return culprit(r, kind)
    silent = [r for r in failures if r not in reports]
    if reports and silent:  # torchrun's line for a rank it stopped says nothing: say what its peers saw
        peer = min(reports, key=lambda r: reports[r]["time"])
        said = str(reports[peer].get("message", "")).splitlines()[0] if reports[peer].get("message") else ""
        said = re.sub(r"\[[^\]\s]+:\d+\]\s*", "", said)  # gloo's source file and line: not the user's business
        hung = culprit(min(silent), "comm")
        return Culprit(hung.rank, "comm", f"it stopped responding: it made no report while its peers' "
                                          f"communication failed (rank {peer}: {said})", hung.time)
    if reports:
        return culprit(min(reports, key=lambda r: reports[r]["time"]), "comm")
    return culprit(min(failures), "unknown")


@dataclass(slots=True)
class Job:
    """A supervised job: its folder, its log, and the events it appends to ``events.jsonl``."""

    run: RunFolder
    log: Callable[[str], None]
    events: list[dict[str, Any]] = field(default_factory=list)

    def event(self, kind: str, **info: Any) -> None:
        e = {"event": kind, "time": time.time(), **info}
        self.events.append(e)
        self.run.append_event(e)


def in_place_moves(seg_dir: Path) -> list[dict[str, Any]]:
    """The rows a segment's ranks moved in place, in order: its ``replans.jsonl`` decisions that were carried out.

    Rank 0 records an in-place move once every rank has taken the rows (with ``switch_s``, its measured cost), so
    each such line is a move that happened; a line cut short by a failure is not one.
    """
    return [d for d in RunFolder(seg_dir).read_replans() if d.get("in_place") and "switch_s" in d]


def rows_in_force(seg_dir: Path, built: Plan) -> Plan | None:
    """The plan a segment's ranks ran when it ended, where its rows per replica are not the build's; else None.

    Each in-place row move re-publishes the segment's plan.json with the new rows (and a restart that carried
    rows wrote them there before its ranks started), so it holds the rows in force at the end. A plan that
    differs from the build's in more than rows is not a row move of this build and is not carried (None).

    Args:
        seg_dir: the segment's run folder.
        built: the plan of the build the segment ran (its generated code).

    Example:
        >>> import tempfile
        >>> from dataclasses import replace
        >>> from hpml_compile.plan import Stage
        >>> from hpml_compile.testing import cluster_of
        >>> p = Plan("toy", cluster_of(["cpu"] * 2), "gpipe", 2, (Stage(0, ("d0", "d1"), ("n",)),))
        >>> seg = Path(tempfile.mkdtemp())
        >>> _ = save_plan(p, seg / "plan.json"); rows_in_force(seg, p) is None
        True
        >>> _ = save_plan(replace(p, stages=(replace(p.stages[0], rows=(3, 1)),)), seg / "plan.json")
        >>> rows_in_force(seg, p).stages[0].rows
        (3, 1)
    """
    path = seg_dir / "plan.json"
    if not path.is_file():
        return None
    ran = load_plan(path)
    if [st.rows for st in ran.stages] == [st.rows for st in built.stages]:
        return None
    if ([(st.devices, st.nodes) for st in ran.stages] != [(st.devices, st.nodes) for st in built.stages]
            or (ran.microbatches, ran.schedule) != (built.microbatches, built.schedule)):
        return None
    return ran


def record_moves(job: Job, seg: int, seg_dir: Path) -> None:
    """Copy a segment's in-place row moves into the job's events (see the module docstring)."""
    for d in in_place_moves(seg_dir):
        job.event("rows_moved", segment=seg, step=d["step"], time=d.get("time", time.time()), rows=d.get("rows"),
                  switch_s=d["switch_s"], apply_s=d.get("apply_s"), choose_s=d.get("solve_s", 0.0),
                  predicted_step_ms=d.get("new_step_ms"), decision=d)


def _measured_or_planned(seg_dir: Path, build: Path, plan: Plan) -> tuple[Any, str]:
    """The failed segment's measured profile when it ran enough steps, else the build's."""
    from ..observe.summary import measured_profile, summarise

    prof = load_profile(build / "profile.json")
    rows = read_metrics(seg_dir)
    n = min((len(r) for r in rows.values()), default=0)
    if len(rows) == len(plan_devices(plan)) and n >= 3:
        s = summarise(plan, rows, skip=2 if n >= 5 else 1)
        return measured_profile(prof, s, source=f"{seg_dir} (before the failure)"), f"measured in {seg_dir}"
    return prof, f"the build's profile ({n} step(s) measured before the failure)"


def _replan_without(job: Job, plan: Plan, build: Path, seg_dir: Path, lost: list[str], out: Path,
                    solver: str, time_limit_s: float) -> tuple[Path, dict[str, Any]]:
    last = latest(job.run.checkpoints)
    keep = f"; the last checkpoint, {last}, is intact" if last else "; no checkpoint was written yet"
    prof, source = _measured_or_planned(seg_dir, build, plan)
    t0 = time.perf_counter()
    try:
        new = driver.replan(plan, prof, lost=list(lost),
                            opts=driver.Options(solver=solver, time_limit_s=time_limit_s)).plan
    except InfeasibleError as e:
        raise SupervisorError(f"cannot go on without {', '.join(lost)}: no plan fits on "
                              f"{', '.join(plan_devices(plan))} less {', '.join(lost)}: {e}{keep}") from None
    except HpmlError as e:  # an unknown device, or none left
        raise SupervisorError(f"cannot go on: {e}{keep}") from None
    solve_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    built = driver.rebuild(build, new, prof, out).out_dir
    cluster = new.cluster
    info = {"lost": lost[0] if len(lost) == 1 else lost, "devices": [d.name for d in cluster.devices],
            "costs": source, "solve_s": solve_s,
            "codegen_s": time.perf_counter() - t1, "predicted_step_ms": new.predicted.step_ms,
            "stages": [list(st.devices) for st in new.stages]}
    job.log(f"re-planned for {len(cluster.devices)} device(s) without {', '.join(lost)} ({source}): {len(new.stages)} "
            f"stage(s), predicted step {new.predicted.step_ms:.4g} ms; solve {solve_s:.2f} s, codegen "
            f"{info['codegen_s']:.2f} s")
    return Path(built), info


def supervise(build_dir: Path, run_dir: Path, options: RunOptions, *, max_failures: int = 2, solver: str = "ilp",
              run_info: dict[str, Any] | None = None, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run ``build_dir`` for ``options.steps`` steps on this host, re-planning and restarting as needed.

    Args:
        build_dir: the first build.
        run_dir: the job's folder (segments, checkpoints, events).
        options: the job's options. Each segment runs them with its own checkpoint folder (the job's, resumed
            when it holds one), launch time, rows in force, and faults: those of ``options.faults`` name ranks
            of the first plan and follow their devices (:meth:`~.options.Faults.follow`; the communication
            faults in the first segment only). ``options.adapt``: when to re-plan on imbalance (None: only on
            failure).
        max_failures: failures of one device (other than a death) before it is dropped.
        solver: the solver for re-planning after a failure.
        run_info: extra facts for each segment's run.json.
        log: progress lines.

    Returns:
        The events, as written to ``RUN_DIR/events.jsonl``.

    Raises:
        SupervisorError: no device or no feasible plan left (the last checkpoint named and intact).
        LaunchError: a rank failed on bad input (never retried), or the ranks could not start.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    job = Job(RunFolder(run_dir), log)  # a run folder used before goes on: new segments, events appended
    first = plan_devices(load_plan(build_dir / "plan.json"))
    for rank in options.faults.ranks():
        if not 0 <= rank < len(first):
            raise HpmlError(f"fault injection names rank {rank}, but the plan has ranks 0..{len(first) - 1}")
    ledger = FailureLedger(max_failures)
    build, seg, reason = build_dir, max(job.run.segments(), default=-1) + 1, "start"
    carried: Plan | None = None  # rows moved in place before a failure, for the restart on the same build
    while True:
        plan = start_segment(job, options, first, build, seg, reason, carried, run_info, live=True)
        devices = plan_devices(plan)
        carried = None
        try:
            lost = launch_here(build, job.run.segment(seg).path, len(devices), live=can_go_on_live(plan, options),
                               on_loss=lambda x: job.log(f"segment {seg}: rank {x.rank} ({devices[x.rank]}) died at "
                                                         f"step {x.steps_done + 1}; the others go on without it"))
            record_lost(job, seg, devices, lost)
        except RankFailure as e:
            build, reason, carried = after_failure(job, ledger, plan, build, seg, e.failures, options, solver, e)
            seg += 1
            continue
        switch = after_success(job, seg)
        if switch is not None:
            build, reason = switch
            seg += 1
            continue
        job.event("done", segment=seg, steps=options.steps)
        return job.events



def can_go_on_live(plan: Plan, options: RunOptions) -> bool:
    """Whether a lost rank of ``plan`` may be answered in place: some stage has replicas (a lost rank elsewhere,
    or one whose state the others lack, is still refused by the ranks themselves, which then fail), and a failed
    step may run again (``--retries`` 2 or more: with 1, every failure takes the restart path); not for an interleaved
    plan, whose ranks hold several stages."""
    return options.retries > 1 and plan.chunks == 1 and any(len(st.devices) > 1 and st.tp == 1 for st in plan.stages)


def record_lost(job: Job, seg: int, devices: list[str], lost: list[LostRank]) -> None:
    """Log the ranks lost in segment ``seg`` while the others went on in their processes (``replica_lost``)."""
    for x in lost:
        job.event("replica_lost", segment=seg, rank=x.rank, device=devices[x.rank], died_at=x.died_at,
                  step=x.steps_done + 1, resumed_at=x.resumed_at, exit_code=x.code, pids=list(x.pids))
        again = f"; training again {x.resumed_at - x.died_at:.2f} s after" if x.resumed_at is not None else ""
        job.log(f"segment {seg}: {devices[x.rank]} lost at step {x.steps_done + 1} without a restart: the others "
                f"ran that step again in their own processes{again}")


def start_segment(job: Job, options: RunOptions, first: list[str], build: Path, seg: int, reason: str,
                  carried: Plan | None, run_info: dict[str, Any] | None, *, live: bool = False) -> Plan:
    """Prepare segment ``seg``'s run folder (its options, plan, rows in force) and log its start.

    Args:
        job: the job's folder and log.
        options: the job's options.
        first: the first plan's devices (injected faults name its ranks).
        build: the segment's build; ``reason`` why it starts.
        carried: the plan whose rows the ranks take before their first step (a restart on the same build), or None.
        run_info: extra facts for its run.json.
        live: the supervisor starts the ranks itself (:mod:`.hostranks`): where the plan has replicas, they
            answer a lost replica in place (:func:`can_go_on_live`).

    Returns:
        The segment's plan (its build's).
    """
    plan = load_plan(build / "plan.json")
    devices = plan_devices(plan)
    seg_dir = job.run.segment(seg).path
    seg_options = options.for_segment(
        checkpoint_dir=job.run.checkpoints, resume=ResumeMode.IF_ANY, launched_at=time.time(),
        faults=options.faults.follow(first, devices, first_segment=reason == "start"),
        rows_from=seg_dir / "plan.json" if carried is not None else None,
        live=live and can_go_on_live(plan, options))
    prepare_run_dir(build, seg_dir, {"steps": options.steps, "nproc": len(devices), "segment": seg,
                                     "reason": reason, **(run_info or {})}, seg_options)
    if carried is not None:  # the segment's plan is the one in force: its ranks take its rows, report reads it
        save_plan(carried, seg_dir / "plan.json")
    resumed = latest(job.run.checkpoints)
    rows = {"rows": [list(st.rows) for st in carried.stages]} if carried is not None else {}
    job.event("segment", segment=seg, reason=reason, build=str(build), devices=devices,
              resume_from=str(resumed) if resumed else None, **rows)
    job.log(f"segment {seg} ({reason}): {len(devices)} rank(s) on {', '.join(devices)}"
            + (f", resuming from {resumed.name}" if resumed else "")
            + (" with the rows moved in place before the failure: " + _rows_text(carried) if carried else ""))
    return plan


def after_success(job: Job, seg: int) -> tuple[Path, str] | None:
    """What follows a segment whose ranks all finished: ``(build, reason)`` of a switch, or None when done."""
    seg_dir = job.run.segment(seg).path
    record_moves(job, seg, seg_dir)
    nxt = RunFolder(seg_dir).read_next()
    if nxt is None:
        return None
    job.event("switch", segment=seg, step=nxt["step"], build=nxt["build"], decision=nxt.get("event", {}))
    return Path(nxt["build"]), f"re-planned at step {nxt['step']}"


def after_failure(job: Job, ledger: FailureLedger, plan: Plan, build: Path, seg: int,
                  failures: dict[int, tuple[int, str]], options: RunOptions, solver: str,
                  error: Exception | None = None) -> tuple[Path, str, Plan | None]:
    """What follows a segment whose ranks failed: blame a rank, drop its device or restart on the same ones.

    Args:
        job: the job's folder and log.
        ledger: failures per device so far.
        plan: the failed segment's plan; ``build`` its build.
        seg: the failed segment.
        failures: global rank -> (exit code, torchrun's message), of every host.
        options: the job's options.
        solver: the solver for a re-plan.
        error: what to raise again for bad input (a user error is never retried).

    Returns:
        ``(build, reason, carried)``: the next segment's build, why it starts, and the plan whose rows it takes
        (a restart on the same build), or None.

    Raises:
        SupervisorError: no plan fits on the devices left.
    """
    seen = time.time()
    seg_dir = job.run.segment(seg).path
    devices = plan_devices(plan)
    c = blame(failures, seg_dir)
    device = devices[c.rank]
    record_moves(job, seg, seg_dir)
    if c.cause == "user":
        raise error if error is not None else SupervisorError(c.message)
    dropped = c.cause == "killed" or ledger.record(device)
    # ranks that died while the others went on (:mod:`.hostranks`), or beside the culprit: their devices are gone too
    dead = [devices[r] for r, (code, _) in sorted(failures.items()) if died(code) and devices[r] != device]
    job.event("failure", segment=seg, rank=c.rank, device=device, cause=c.cause, message=c.message,
              failed_at=c.time, detected_at=seen, dropped=dropped, failures=ledger.failures(device))
    job.log(f"segment {seg}: rank {c.rank} ({device}) {c.cause}: {c.message.splitlines()[0][:200]}")
    if dropped or dead:
        why = "its process died" if c.cause == "killed" else f"it failed {ledger.failures(device)} times"
        gone = ([device] if dropped else []) + dead
        job.log(f"dropping {', '.join(gone)}: " + (why if dropped else "") + (
            f"{'; ' if dropped else ''}{', '.join(dead)} died before" if dead else ""))
        return replan_without(job, plan, build, seg, gone, options, solver), f"{', '.join(gone)} lost", None
    job.log(f"restarting on the same {len(devices)} device(s) from the last checkpoint "
            f"({device} has failed {ledger.failures(device)}/{ledger.max_failures} times)")
    return build, f"{device} failed ({c.cause})", rows_in_force(seg_dir, plan)


def replan_without(job: Job, plan: Plan, build: Path, seg: int, lost: list[str], options: RunOptions,
                   solver: str, trigger: str = "failure") -> Path:
    """Re-plan segment ``seg``'s job for its devices less ``lost``, build it for segment ``seg + 1``, log it.

    Returns:
        The new build's folder.

    Raises:
        SupervisorError: no plan fits on the devices left (the last checkpoint named and intact).
    """
    adapt = options.adapt
    new_build, info = _replan_without(job, plan, build, job.run.segment(seg).path, lost, job.run.build_for(seg + 1),
                                      solver, adapt.time_limit_s if adapt else 20.0)
    job.event("replan", segment=seg, trigger=trigger, **info)
    return new_build


def _rows_text(plan: Plan) -> str:
    return " | ".join(",".join(st.devices) + (f" rows {':'.join(map(str, st.rows))}" if st.rows else "")
                      for st in plan.stages)


def timings(run_dir: Path) -> list[dict[str, Any]]:
    """Per recovery in a supervised run: what happened, and its detection, re-plan and resume times (seconds).

    - a failure: detection = torchrun saw it - the rank's report of it; re-plan = solve + codegen (0 when the
      same devices are restarted); resume = the next segment's first step done - the failure.
    - a switch: detection is in steps (``decided_at_step``; the watch needs ``patience`` slow steps); re-plan =
      solve + codegen (a row move's "solve" is choosing its rows); resume = the next segment's first step done -
      the decision; ``move`` says which candidate it was (``rows`` or ``replan``).
    - a replica lost without a restart (``in_place``; :mod:`.hostranks`): resume = the failed step done again on a
      survivor - the death seen; no step lost.
    - rows moved in place (``in_place``: no restart): re-plan = choosing the rows (no codegen); resume = its
      measured ``switch_s``, from rank 0's decision to the rows in force on every rank and plan.json re-published
      (the next step then runs on them).
    """
    run = RunFolder(run_dir)
    events = run.read_events()
    out = []
    for i, e in enumerate(events):
        if e["event"] == "replica_lost":
            again = e.get("resumed_at")
            out.append({"kind": f"replica lost ({e['device']}, no restart)", "detect_s": None, "replan_s": 0.0,
                        "step": e["step"], "in_place": True, "steps_lost": 0, "segment": e["segment"],
                        "resume_s": again - e["died_at"] if again is not None else None})
            continue
        if e["event"] == "rows_moved":
            out.append({"kind": "rows moved in place (no restart)", "detect_s": None, "decided_at_step": e["step"],
                        "replan_s": e.get("choose_s", 0.0), "step": e["step"], "move": "rows", "in_place": True,
                        "solve_s": e.get("choose_s", 0.0), "codegen_s": 0.0, "resume_s": e["switch_s"],
                        "switch_s": e["switch_s"], "rows": e.get("rows"), "segment": e["segment"]})
            continue
        if e["event"] not in ("failure", "switch"):
            continue
        nxt = next((x for x in events[i + 1:] if x["event"] == "segment"), None)
        started = run.segment(nxt["segment"]).read_started() if nxt else None
        first_step = started["first_step_at"] if started else None
        if e["event"] == "failure":
            rp = next((x for x in events[i + 1:i + 2] if x["event"] == "replan"), {})
            replan_s = rp.get("solve_s", 0.0) + rp.get("codegen_s", 0.0)
            t0 = e["failed_at"]
            row = {"kind": f"failure ({e['cause']}, {e['device']})", "detect_s": e["detected_at"] - t0,
                   "replan_s": replan_s}
        else:
            d = e["decision"]
            t0 = d.get("time", e["time"])
            row = {"kind": "switch (imbalance)", "detect_s": None, "decided_at_step": d.get("step"),
                   "replan_s": d.get("solve_s", 0.0) + d.get("codegen_s", 0.0), "step": e["step"],
                   "move": d.get("chosen") or "replan", "solve_s": d.get("solve_s", 0.0),
                   "codegen_s": d.get("codegen_s", 0.0)}
        row["resume_s"] = first_step - t0 if first_step else None
        out.append(row)
    return out

