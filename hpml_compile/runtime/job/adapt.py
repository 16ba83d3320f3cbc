"""The closed loop inside a running job: watch every step, re-plan on a sustained gap, switch when it pays.

Every rank calls :meth:`Adapter.observe` after each step. The ranks agree on
the step's time (the slowest rank's, in the simulator's scope: see
:func:`plan_scope_ms`; one all-reduce of one number), so every rank's
:class:`~.policy.ImbalanceWatch` fires at the same step without any message.

The watch fires on a change, not on a level: the plan's first ``baseline``
steps after the warm-up teach it the machine's constant misprediction
(measured / predicted; on a CPU model the cost model was not tuned on, a
healthy step may run 30% over its prediction, every step), and it
fires when the step then grows ``threshold`` x beyond that. Before, the watch
compared with the prediction itself, fired after ``patience`` healthy steps on
such a machine, re-planned for nothing, and only then took the measured step
as its reference (the rebase below, which stays for a gap that opens later).
When it fires:

1. the ranks gather their measurements of this plan to rank 0;
2. rank 0 summarises the last ``patience`` steps against the plan, finds the
   devices whose own compute grew since the plan's first steps
   (:func:`~.summary.device_slowdowns`: the nodes did not change, so the
   device did), and builds the measured profile and cluster
   (:func:`~.summary.measured_setup`: a slowed device gets a kind of its own).
   When none stands out and the host was busy in those steps (steal, other
   programs), it keeps the plan and says so (:func:`busy_host_hold`): every
   rank slowed alike on a busy host cannot be told from the contention;
3. rank 0 prices the candidates on the measured costs: where a slowed
   device is one replica of a stage, a *row move* (:func:`~hpml_compile.driver.move_rows`:
   the same stages on the same devices, that stage's rows per replica chosen
   for the devices' measured speeds; no solve), and the *full re-plan*
   (:func:`~hpml_compile.driver.replan`); the running plan is scored on the
   same costs. Each one's predicted gain, applied to the measured step, is
   weighed against the cost of switching to it (this segment's start-up plus
   a checkpoint; plus the solve for the re-plan) over the steps left, and of
   those that pay the one with the largest net gain wins
   (:func:`~.policy.choose_switch`).
   The decision names both, with their predicted steps and switch costs.
   A row move needs no restart where the running code serves the new rows
   (:func:`in_place_refusal`: one stage file serves every replica, each
   boundary spec scaled to a replica's rows, wherever the code was
   generated with the batch dimensions of the boundaries next to the moved
   stage; always for a one-stage data-parallel plan). Its switch cost is
   then the in-place move's, measured (the last one of this run, else
   :data:`~.policy.ROW_MOVE_PRIOR_S`), not a restart's;
4. every rank learns the verdict (one broadcast, at this step boundary).
   An in-place row move: every rank gives its running pipeline the new rows
   (:meth:`~.pipeline.Pipeline.move_rows`: the split of each microbatch, the
   loss weights, the boundaries' row ranges, the rows a TrainSpec's loader
   reads) and the ranks check in one all-reduce that they took the same
   rows; rank 0 re-publishes the run folder's plan.json with them (atomic)
   and records the move with its measured cost (``switch_s``: from the
   decision to the rows in force on every rank and the plan published). The
   next step runs on the new rows: no checkpoint, no restart; the watch then
   learns the new plan's first steps afresh. Otherwise, if a switch pays,
   rank 0 generates the new build, the caller checkpoints and stops, and the
   supervisor (:mod:`.supervisor`) restarts the ranks on the new build.
   When no plan is predicted faster, the measured step time becomes the new
   reference (the gap is the cost model's, not the placement's), so the same
   gap does not fire the watch again. When a faster plan does not pay for a
   switch yet, the reference stays: the watch fires again after its
   cool-down, with cleaner measurements and fewer steps left.

A plan the runtime cannot hold is the other reason to re-plan, at once
(warm-up included, no patience): the same all-reduce carries each rank's
peak held bytes above its device's capacity (:class:`~.monitor.StepMetrics`
``held_bytes``); when some device is over, rank 0 re-plans on a cluster whose
devices of that kind have their memory cut by what the memory model missed
there (:func:`~.policy.replan_capacity`: measured peak less predicted), so
the new plan's prediction plus the same miss fits. The running plan no
longer fits that cluster, so any plan that does is taken
(:func:`~hpml_compile.replan.replan_graph`); when none does, the job goes on
and the decision says so.

Every decision, switch or not, is appended to ``RUN_DIR/replans.jsonl`` with
its reason, the plan diff and the times it took; the supervisor copies the
in-place moves into the job's ``events.jsonl`` (``rows_moved``), where
``report`` shows them beside the restarts.

Rows moved in place outlive a failure: the run folder's plan.json holds the
rows in force, and when the supervisor restarts the ranks on the same build
it hands them that plan (``rows_from`` in the segment's run options); each rank takes its
rows before the first step (:func:`take_rows`: the same checks and the same
:meth:`~.pipeline.Pipeline.move_rows` as the move itself, and the same
one all-reduce that every rank took the same rows).
"""

from __future__ import annotations

import json
import os
import statistics
import time
import zlib
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ...errors import HpmlError
from ...plan import Plan, load_plan, save_plan
from ...profile import load_profile
from ..observe.monitor import StepMetrics
from ..observe.runfolder import RunFolder
from ..observe.policy import (DEFAULT_PATIENCE, DEFAULT_THRESHOLD, ROW_MOVE_PRIOR_S, Candidate, ImbalanceWatch,
                     choose_switch, contention_discount, memory_shortfalls, replan_capacity)
from ..observe.summary import HostContention, device_slowdowns, host_contention, measured_setup, summarise

__all__ = ["AdaptOptions", "Verdict", "CANDIDATES", "Adapter", "plan_scope_ms", "busy_host_hold", "env_seconds",
           "in_place_refusal", "take_rows", "row_move_stages"]

CANDIDATES = ("both", "rows", "replan")


def busy_host_hold(recent: Mapping[int, Sequence[StepMetrics]], slow: Mapping[str, float]) -> list[HostContention]:
    """The busy hosts that stop a re-plan, or ``[]``: the latest steps ran on a host that other programs or the
    hypervisor kept busy, and no device was singled out.

    The watch already takes off each step the contention the counters see, but ranks also wait for peers the
    host descheduled, which no counter sees; so a slowdown of every rank on a busy host cannot be told from the
    contention, and ``report`` gives no re-plan advice for it either. A slowed device shows as its own rank
    slower than the others (``slow``) and is re-planned, busy host or not.

    Args:
        recent: rank -> its latest steps (the watch's window).
        slow: device -> slowdown of the devices singled out against the plan's first steps.
    """
    return [] if slow else host_contention(recent)


@dataclass(frozen=True, slots=True)
class AdaptOptions:
    """When and how a running job re-plans (the ``run --adapt-*`` options).

    Attributes:
        threshold: a step is slow when it takes more than ``threshold`` x the reference (the plan's prediction).
        patience: slow steps in a row that trigger a re-plan.
        cooldown: steps to stay quiet after a re-plan that did not switch.
        warmup: first steps of a plan not watched (allocator, caches, lazy initialisation).
        baseline: steps after the warm-up that fix each device's own speed under the plan, and the level of
            measured / predicted step time the watch takes as healthy (the machine's constant misprediction).
        min_gain: predicted speed-up below which a switch is never worth its risk.
        solver: the solver for re-planning.
        time_limit_s: its time limit.
        candidates: what a slowed device may be answered with: ``both`` (a row move where the device is a
            replica, weighed against a full re-plan), ``rows`` (the row move alone, the re-plan only when no
            row move applies) or ``replan`` (the full re-plan alone); ``rows`` and ``replan`` let a benchmark
            measure each (the ``HPML_ADAPT_CANDIDATES`` environment variable of ``run --adapt``).
        switch_cost_s: the cost of a restart to price the candidates with, instead of the one measured (this
            segment's start-up plus its last checkpoint); None: measured. Lets a short test or benchmark switch
            (``HPML_ADAPT_SWITCH_COST_S``); the decision records which it used.
    """

    threshold: float = DEFAULT_THRESHOLD
    patience: int = DEFAULT_PATIENCE
    cooldown: int = 5
    warmup: int = 2
    baseline: int = 3
    min_gain: float = 1.05
    solver: str = "ilp"
    time_limit_s: float = 20.0
    candidates: str = "both"
    switch_cost_s: float | None = None

    def __post_init__(self) -> None:
        if self.candidates not in CANDIDATES:
            raise HpmlError(f"adapt candidates must be one of {', '.join(CANDIDATES)}, got {self.candidates!r}")

    @classmethod
    def from_env(cls, **kw: Any) -> AdaptOptions:
        """Options ``kw``, with ``candidates`` and ``switch_cost_s`` from ``HPML_ADAPT_CANDIDATES`` and
        ``HPML_ADAPT_SWITCH_COST_S`` where set (read once, by ``run``: the ranks read ``run.json``).

        Raises:
            HpmlError: a value that is not a candidate or a number of seconds.
        """
        env = os.environ.get("HPML_ADAPT_CANDIDATES", "").strip()
        return cls(**kw, candidates=env or "both", switch_cost_s=env_seconds("HPML_ADAPT_SWITCH_COST_S"))


def env_seconds(name: str) -> float | None:
    """A number of seconds from the environment variable ``name``, or None when it is not set.

    Raises:
        HpmlError: not a number, or negative.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise HpmlError(f"{name}={text!r}: expected a number of seconds, e.g. {name}=0.5") from None
    if value < 0:
        raise HpmlError(f"{name}={text!r}: a cost cannot be negative; give 0 or more seconds")
    return value


def row_move_stages(plan: Plan, slow: Mapping[str, float], front_end: str = "fx") -> tuple[set[int], str | None]:
    """The stages whose rows may move off the slowed devices, and why none may where a build forbids it.

    A row move applies where a slowed device is one replica of a stage. A build traced with torch.export has
    fixed shapes: no code of it serves uneven rows (codegen refuses them, so neither a move in place nor a
    restart on a regenerated build could run them), and such a build is offered no row move.

    Args:
        plan: the running plan.
        slow: device -> slow-down of the devices singled out.
        front_end: how the build's graph was traced (``fx`` or ``export``).

    Returns:
        ``(stages, why_not)``: the replicated stages holding a slowed device, and None; or no stages and the
        reason when some exist but the build cannot move rows.

    Example:
        >>> from hpml_compile.plan import Stage
        >>> from hpml_compile.testing import cluster_of
        >>> p = Plan("toy", cluster_of(["cpu"] * 3), "gpipe", 2, (Stage(0, ("d0",), ("a",)),
        ...                                                       Stage(1, ("d1", "d2"), ("b",))))
        >>> row_move_stages(p, {"d2": 3.0}), row_move_stages(p, {"d0": 3.0})
        (({1}, None), (set(), None))
        >>> row_move_stages(p, {"d2": 3.0}, "export")[1]
        "the build's graph came from torch.export, which fixes every shape: its code serves no uneven rows"
    """
    stages = {st.index for st in plan.stages if len(st.devices) > 1 and set(st.devices) & set(slow)}
    if stages and front_end == "export":
        return set(), ("the build's graph came from torch.export, which fixes every shape: its code serves no "
                       "uneven rows")
    return stages, None


def in_place_refusal(generated: Plan, old: Plan, new: Plan, front_end: str = "fx") -> str | None:
    """Why running ranks cannot take ``new``'s rows without new code, or None when they can.

    The stage code serves any rows of its stage's replicas: it was generated at
    its first replica's rows, and each boundary spec is scaled to a replica's
    own (:meth:`~hpml_compile.codegen.comm.Comm.shaped`). A boundary reshards
    rows between its two sides only along the batch dimensions codegen
    recorded, and it records them only where the generated plan split the two
    sides differently (another replica count, or rows on either side:
    ``codegen.render._boundary_dims``); a graph from torch.export fixes every
    shape.

    Args:
        generated: the plan the running stage code was generated for (the build's).
        old: the running plan.
        new: the plan with the new rows (the same stages on the same devices).
        front_end: how the build's graph was traced (``fx`` or ``export``: ``build.manifest.front_end``).

    Returns:
        None when the running code serves ``new``'s rows; else what needs new code (the switch then restarts the
        ranks on a regenerated build, as a re-plan does).

    Example:
        >>> from hpml_compile.plan import Stage
        >>> from hpml_compile.testing import cluster_of
        >>> st = lambda k, devs, rows=(): Stage(k, devs, (f"n{k}",), rows=rows)
        >>> two = Plan("toy", cluster_of(["cpu"] * 4), "gpipe", 2, (st(0, ("d0", "d1")), st(1, ("d2", "d3"))))
        >>> moved = replace(two, stages=(st(0, ("d0", "d1"), (3, 1)), two.stages[1]))
        >>> in_place_refusal(two, two, moved)[:62]
        'the boundary between stage 0 and stage 1 was generated without'
        >>> one = Plan("toy", cluster_of(["cpu"] * 2), "gpipe", 2, (st(0, ("d0", "d1")),))
        >>> in_place_refusal(one, one, replace(one, stages=(st(0, ("d0", "d1"), (3, 1)),))) is None
        True
    """
    moved = {a.index for a, b in zip(old.stages, new.stages) if a.rows != b.rows}
    if moved and front_end == "export":
        return "the build's graph came from torch.export, which fixes every shape"
    gen = generated.stages
    for k in range(len(gen) - 1):
        if not {k, k + 1} & moved:
            continue
        here, there = gen[k], gen[k + 1]
        if len(here.devices) == len(there.devices) and not here.rows and not there.rows:
            return (f"the boundary between stage {k} and stage {k + 1} was generated without its batch dimensions "
                    f"(both sides split each microbatch equally over {len(here.devices)} replicas), so rows moved "
                    "there need new code")
    return None


def _same_rows(plan: Plan, step: int, took_s: float = 0.0) -> float:
    """Check in one all-reduce that every rank runs ``plan``'s rows; returns the slowest rank's ``took_s``.

    Raises:
        HpmlError: the ranks hold different rows (they all read one verdict or one plan: a bug if ever).
    """
    if not dist.is_initialized():  # every stage in this one process: nothing to agree on
        return took_s
    rows = [list(st.rows) for st in plan.stages]
    sig = float(zlib.crc32(json.dumps(rows).encode()))
    t = torch.tensor([sig, -sig, took_s], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the same rows on every rank (max = min); the slowest to apply
    if float(t[0]) != -float(t[1]):
        raise HpmlError(f"step {step}: the ranks took different rows per replica (this rank {rows}); the job "
                        "cannot go on consistently: restart it")
    return float(t[2])


def take_rows(pipe: Any, path: str | Path) -> Plan:
    """A restarted rank (every rank, before its first step): train with the rows per replica of ``path``'s plan.

    What the supervisor's restart after a failure runs when rows were moved in place before it (``rows_from``
    of the worker): ``path`` is the running build's plan with other rows (the failed segment's re-published
    plan.json). Only the rows and the predictions made for them are taken; everything else stays the build's.

    Args:
        pipe: this rank's pipeline, as loaded from the build (no rows moved yet).
        path: the plan whose rows to take.

    Returns:
        The plan now running (``pipe.plan``).

    Raises:
        HpmlError: ``path``'s plan has other stages, devices, nodes, microbatches or schedule than the build's, its
            rows do not split a microbatch, the build's code cannot serve them (:func:`in_place_refusal`), or the
            ranks took different rows.
    """
    given, plan, built = load_plan(path), pipe.plan, pipe.build.plan
    if ([(st.devices, st.nodes) for st in given.stages] != [(st.devices, st.nodes) for st in plan.stages]
            or (given.microbatches, given.schedule) != (plan.microbatches, plan.schedule)):
        raise HpmlError(f"{path}: not the running build's plan with other rows (its stages, devices, nodes, "
                        "microbatches or schedule differ): the rows to take come from the plan.json of a run of this build")
    moved = replace(plan, predicted=given.predicted, stages=tuple(
        replace(st, rows=g.rows, predicted=g.predicted) for st, g in zip(plan.stages, given.stages)))
    refusal = in_place_refusal(built, plan, moved, pipe.build.manifest.front_end.value)
    if refusal is not None:
        raise HpmlError(f"{path}: its rows per replica cannot run on this build's code: {refusal}")
    pipe.move_rows(moved)
    _same_rows(moved, pipe.steps_done)
    return moved


@dataclass(frozen=True, slots=True)
class Verdict:
    """What rank 0 decided, sent to every rank.

    Attributes:
        switch: the job switches plans (a restart on ``build``, or rows moved in place: ``plan``).
        build: the new build to restart on; None for no switch or an in-place row move.
        reference_ms: the step time the watch compares with from now on.
        event: the decision as recorded in ``replans.jsonl``.
        plan: an in-place row move's plan (the running one with new rows), which every rank runs from the next
            step on.
    """

    switch: bool
    build: str | None
    reference_ms: float
    event: dict[str, Any] = field(default_factory=dict)
    plan: Plan | None = None

    @property
    def restart(self) -> bool:
        """Whether the caller must checkpoint and stop, for the supervisor to restart the ranks on ``build``."""
        return self.switch and self.build is not None


def plan_scope_ms(m: StepMetrics, with_optimizer: bool = True) -> float:
    """A step's time in the scope of the plan's prediction.

    The whole step when the plan's profile timed the optimizer (the simulator then
    predicts it); less the optimizer step for a profile without it (schema version 1).
    """
    return m.step_ms if with_optimizer else m.step_ms - m.optimizer_ms


class Adapter:
    """One rank's side of the closed loop (see the module docstring).

    Args:
        pipe: the running pipeline (its plan, measurements, process group).
        build_dir: the build it runs (its profile.json and model.json are re-planned from).
        run_dir: this plan's run folder (the decisions log; the next build is generated under it).
        options: thresholds and solver.
        total_steps: the step the job ends at (for the pay-off of a switch).
        startup_s: how long this plan took from launch to its first step (the cost of a restart).
        log: where decisions are told (rank 0).
    """

    def __init__(self, pipe: Any, *, build_dir: Path, run_dir: Path, options: AdaptOptions = AdaptOptions(),
                 total_steps: int, startup_s: float, log: Callable[[str], None] = lambda line: None) -> None:
        self.pipe, self.build_dir, self.run_dir, self.opts = pipe, Path(build_dir), Path(run_dir), options
        self.total_steps, self.startup_s, self.log = total_steps, startup_s, log
        self._profile = load_profile(self.build_dir / "profile.json")  # the costs the running plan was made on
        self.with_optimizer = bool(self._profile.optimizer_ms)
        self.checkpoint_s = 1.0  # until one is measured
        self.move_s: float | None = None  # the last in-place row move's measured switch (None: none yet)
        # the plan the running stage code was generated for (pipe.build.plan takes moved rows: Pipeline.move_rows)
        self._generated = load_plan(self.build_dir / "plan.json")
        self._front_end = pipe.build.manifest.front_end.value
        self._next_profile = self._profile  # rank 0: the measured costs of an in-place move being made
        plan = pipe.plan
        self._capacity = plan.cluster.device(plan.stages[pipe.stage_index].devices[pipe.replica]).memory_bytes
        self._begin_plan(plan.predicted.step_ms)
        if pipe.rank == 0:
            # the decider loads the driver and its solvers here, after the first step, rather than every rank at
            # its start (a restart's cost) or inside a decision's timing
            from ... import driver  # noqa: F401

    def _begin_plan(self, reference_ms: float) -> None:
        """Watch a plan from its first step: warm-up, the baseline steps, then the watch against ``reference_ms``."""
        o = self.opts
        self.watch = ImbalanceWatch(o.threshold, o.patience, o.cooldown, baseline=o.baseline)
        self.reference_ms = reference_ms
        self._seen = 0
        self._start: int | None = None  # index in pipe.metrics of the plan's first step (set when it is observed)
        self._times: deque[float] = deque(maxlen=o.patience)  # the latest steps' times
        self._lost: list[float] = []  # ms lost to contention in the first steps (the contention's baseline)
        self._memory_tried = False  # one memory re-plan per plan: a second would be cut from the same miss

    def observe(self) -> Verdict | None:
        """Feed the step just run (call on every rank); a verdict when the watch fired, else None."""
        m = self.pipe.metrics[-1]
        if self._start is None:
            self._start = len(self.pipe.metrics) - 1
        # a host busier than in the plan's first steps (steal, other programs) is not a wrong plan: the step at
        # the first steps' contention
        if self._seen < self.opts.warmup + self.opts.baseline:
            self._lost.append(m.contention_ms)
        base = statistics.fmean(self._lost) if self._lost else 0.0
        over = m.held_bytes - self._capacity if m.held_bytes else -1
        # the slowest rank's step less the most any rank lost (the ranks wait for each other); the most any
        # device is over its memory
        t = torch.tensor([plan_scope_ms(m, self.with_optimizer), m.contention_ms - base, float(over)],
                         dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        measured = contention_discount(float(t[0]), float(t[1]))
        self._times.append(measured)
        self._seen += 1
        if float(t[2].item()) > 0 and not self._memory_tried:  # some device held more than it has
            self._memory_tried = True
            return self._agree(self._decide_memory, [m.to_dict()])
        if self._seen <= self.opts.warmup:
            return None
        learning = self.watch.learning
        fired = self.watch.observe(measured, self.reference_ms)
        if learning and not self.watch.learning and self.pipe.rank == 0:
            self.log(f"the first {self.opts.baseline} steps ran at {self.watch.level:.2f}x the plan's predicted "
                     f"{self.reference_ms:.1f} ms: re-planning when a step runs {self.opts.threshold:g}x beyond that "
                     f"for {self.opts.patience} steps")
        if not fired:
            return None
        rows, head = self.pipe.metrics[self._start:], self.opts.warmup + self.opts.baseline
        # what the decision reads: the plan's first steps (its baseline) and the latest ones, not the whole run
        return self._agree(self._decide, [r.to_dict() for r in [*rows[:head], *rows[-self.opts.patience:]]])

    def _agree(self, decide: Callable[[list[Any], float], Verdict], mine: list[dict[str, Any]]) -> Verdict:
        """Gather every rank's rows to rank 0, which decides; every rank gets the verdict."""
        detected = time.perf_counter()
        every: list[Any] = [None] * self.pipe.world_size
        dist.all_gather_object(every, mine)
        box: list[Any] = [None]
        if self.pipe.rank == 0:
            try:
                box[0] = decide(every, detected)
            except Exception as e:  # noqa: BLE001 -- a failed re-plan must not stop training on the running plan
                recent = statistics.median(self._times)
                box[0] = Verdict(False, None, recent, {"step": self.pipe.steps_done, "switch": False,
                                                       "why": f"re-planning failed: {type(e).__name__}: {e}"})
                self._record(box[0].event)
                self.log(f"re-plan at step {self.pipe.steps_done} failed ({e}); going on with the running plan")
        decided = time.perf_counter()
        dist.broadcast_object_list(box, src=0)
        verdict: Verdict = box[0]
        if verdict.plan is not None:
            return self._move_in_place(verdict, decided)
        if not verdict.switch:
            if verdict.reference_ms != self.reference_ms:  # a measured step: it holds the misprediction already
                self.reference_ms = verdict.reference_ms
                self.watch.rebase(level=1.0)
            else:
                self.watch.rebase()
        return verdict

    def _decide(self, every: list[Any], detected: float) -> Verdict:
        from ... import driver  # loaded by __init__: see there

        o, plan, step = self.opts, self.pipe.plan, self.pipe.steps_done
        rows = {r: [StepMetrics.from_dict(d) for d in rs] for r, rs in enumerate(every)}
        recent = {r: rs[-o.patience:] for r, rs in rows.items()}
        baseline = {r: rs[o.warmup:o.warmup + o.baseline] for r, rs in rows.items()}
        measured = statistics.median(self._times)
        slow = device_slowdowns(plan, baseline, recent, o.threshold)
        busy = busy_host_hold(recent, slow)
        if busy:  # every rank slower on a busy host: the report's rule, no re-plan on it
            return self._hold_busy(step, measured, busy)
        s = summarise(plan, recent, skip=0, run_dir=self.run_dir)
        prof, cluster = measured_setup(self._profile, s, slow,
                                       source=f"{self.run_dir} steps {step - o.patience + 1}..{step}")
        steps_left = self.total_steps - step
        restart_ms = (self.startup_s + self.checkpoint_s if o.switch_cost_s is None else o.switch_cost_s) * 1e3
        tried: dict[str, tuple[Any, float]] = {}  # candidate -> (its ReplanResult, seconds to make it)
        replicated, why_no_rows = row_move_stages(plan, slow, self._front_end)
        if why_no_rows is not None:
            self.log(f"no row move at step {step}: {why_no_rows}")
        elif replicated and o.candidates in ("both", "rows"):
            t0 = time.perf_counter()
            try:
                tried["rows"] = (driver.move_rows(plan, prof, cluster=cluster, stages=replicated),
                                 time.perf_counter() - t0)
            except HpmlError as e:  # new rows that do not fit: the full re-plan may still
                self.log(f"no row move at step {step}: {e}")
        if o.candidates in ("both", "replan") or not tried:
            t0 = time.perf_counter()
            tried["replan"] = (driver.replan(plan, prof, cluster=cluster,
                                             opts=driver.Options(solver=o.solver, time_limit_s=o.time_limit_s)),
                               time.perf_counter() - t0)
        # what switching to each costs: a row move the running code serves, its in-place move (measured: the
        # last one of this run, else the prior); else a checkpoint and a restart (this segment's start-up), and
        # for a full re-plan also its solve (a row move needs none); a restart regenerates the build (codegen_s)
        refusal = (in_place_refusal(self._generated, plan, tried["rows"][0].plan, self._front_end)
                   if "rows" in tried else None)
        move_ms = (self.move_s if self.move_s is not None else ROW_MOVE_PRIOR_S) * 1e3
        cost_ms = {name: (move_ms if name == "rows" and refusal is None else restart_ms)
                   + (took * 1e3 if name == "replan" else 0.0) for name, (_, took) in tried.items()}
        cands = {name: Candidate(name, r.diff.new_step_ms, r.diff.gain, cost_ms[name])
                 for name, (r, took) in tried.items() if r.switched}
        best, why_best = choose_switch(list(cands.values()), measured, steps_left, o.min_gain)
        chosen = best.name if best is not None else None
        result, solve_s = tried[chosen or ("replan" if "replan" in tried else "rows")]
        diff = result.diff
        switch = best is not None
        scopes = {n.name: n.scope for n in prof.nodes}
        event: dict[str, Any] = {
            "step": step, "time": time.time(), "trigger": "imbalance",
            "reason": f"measured step {measured:.1f} ms > {o.threshold:g} x {self.watch.level:.2f} (the first steps' "
                      f"measured / predicted) x reference {self.reference_ms:.1f} ms for {o.patience} steps",
            "learned_level": round(self.watch.level, 4),
            "slow_devices": {d: round(f, 3) for d, f in slow.items()},
            "old_step_ms": diff.old_step_ms, "new_step_ms": diff.new_step_ms, "gain": diff.gain,
            "steps_left": steps_left, "switch_cost_s": (cands[chosen].switch_cost_ms if chosen else restart_ms) / 1e3,
            "switch": switch, "chosen": chosen,
            "restart_cost": "measured" if o.switch_cost_s is None else "given (HPML_ADAPT_SWITCH_COST_S)",
            "row_move_cost": "measured in this run" if self.move_s is not None else "prior (policy.ROW_MOVE_PRIOR_S)",
            "candidates": {name: {"predicted_step_ms": r.diff.new_step_ms, "old_step_ms": r.diff.old_step_ms,
                                  "gain": r.diff.gain, "faster": r.switched, "made_s": took,
                                  "switch_cost_s": cost_ms[name] / 1e3,
                                  **({"in_place": refusal is None, "why_not_in_place": refusal}
                                     if name == "rows" else {}),
                                  "pays": name in cands and cands[name].pays(measured, steps_left, o.min_gain),
                                  "rows": [list(st.rows) for st in r.plan.stages],
                                  "stages": [list(st.devices) for st in r.plan.stages]}
                           for name, (r, took) in tried.items()},
            "diff": diff.summary(scope_of=lambda n: scopes.get(n, "")), "solve_s": solve_s,
        }
        build = None
        in_place = switch and chosen == "rows" and refusal is None
        if in_place:  # the running ranks take the rows at this step boundary (_move_in_place records it)
            event.update(in_place=True, codegen_s=0.0, why_chosen=why_best)
            self._next_profile = prof
        elif switch:
            t1 = time.perf_counter()
            build = str(driver.rebuild(self.build_dir, result.plan, prof, self.run_dir / "next_build").out_dir)
            event.update(codegen_s=time.perf_counter() - t1, build=build, why_chosen=why_best)
        elif not cands:
            event["why"] = "no plan is predicted faster on the measured costs"
        else:
            event["why"] = (f"no candidate pays for its switch over {steps_left} steps of a {measured:.0f} ms step "
                            f"(or gains under {o.min_gain:g}x): {why_best}")
        event["decide_s"] = time.perf_counter() - detected
        if not in_place:
            self._record(event)
        head = f"re-plan at step {step}: {event['reason']}"
        if slow:
            head += "; slowed: " + ", ".join(f"{d} {f:.2f}x" for d, f in slow.items())
        priced = "\n".join(
            f"  candidate {name}: predicted step {r.diff.new_step_ms:.4g} ms against {r.diff.old_step_ms:.4g} ms "
            f"({r.diff.gain:.2f}x), switch cost {event['candidates'][name]['switch_cost_s']:.3g} s; "
            + " | ".join(",".join(st.devices) + (f" rows {':'.join(map(str, st.rows))}" if st.rows else "")
                         for st in r.plan.stages)
            + ("" if r.switched else " (not faster)") for name, (r, took) in tried.items())
        self.log(head + "\n" + priced + "\n" + diff.summary(scope_of=lambda n: scopes.get(n, "")) + "\n"
                 + (f"switching by rows in place (no restart): {why_best}" if in_place
                    else f"switching by {chosen} to the new plan ({build}): {why_best}" if switch
                    else f"keeping the plan: {event['why']}"))
        # the new reference: the new plan's prediction; the measured step when no plan is faster (the gap is the
        # cost model's, not the placement's); unchanged when a faster plan did not pay yet (asked again later)
        ref = result.plan.predicted.step_ms if switch else measured if not cands else self.reference_ms
        return Verdict(switch, build, ref, event, plan=result.plan if in_place else None)

    def _move_in_place(self, verdict: Verdict, decided: float) -> Verdict:
        """Every rank: run the verdict's rows from the next step on; rank 0 publishes and records the move.

        Args:
            verdict: the in-place row move (its ``plan``), as broadcast.
            decided: when this rank had the verdict (rank 0: before the broadcast).

        Raises:
            HpmlError: the ranks took different rows (they all run one broadcast verdict: a bug if ever).
        """
        assert verdict.plan is not None
        t0 = time.perf_counter()
        self.pipe.move_rows(verdict.plan)
        slowest = _same_rows(verdict.plan, self.pipe.steps_done, time.perf_counter() - t0)
        rows = [list(st.rows) for st in verdict.plan.stages]
        if self.pipe.rank == 0:
            save_plan(verdict.plan, self.run_dir / "plan.json")  # report and show read the rows in force
            self.move_s = time.perf_counter() - decided
            self._profile = self._next_profile
            event = {**verdict.event, "switch_s": self.move_s, "apply_s": slowest,
                     "rows": rows, "plan": str(self.run_dir / "plan.json")}
            self._record(event)
            self.log(f"step {self.pipe.steps_done}: rows moved in place in {self.move_s * 1e3:.1f} ms (no restart): "
                     + " | ".join(",".join(st.devices) + (f" rows {':'.join(map(str, st.rows))}" if st.rows else "")
                                  for st in verdict.plan.stages))
            verdict = replace(verdict, event=event)
        self._begin_plan(verdict.reference_ms)
        return verdict

    def _hold_busy(self, step: int, measured: float, busy: list[Any]) -> Verdict:
        """Keep the plan: see :func:`busy_host_hold`."""
        why = ("; ".join(c.describe() for c in busy) + ": every rank slowed alike, which cannot be told from the "
               "host's contention; keeping the plan (a slowed device would stand out from the others)")
        event = {"step": step, "time": time.time(), "trigger": "imbalance", "switch": False, "why": why,
                 "reason": f"measured step {measured:.1f} ms > {self.opts.threshold:g} x {self.watch.level:.2f} x "
                           f"reference {self.reference_ms:.1f} ms for {self.opts.patience} steps",
                 "slow_devices": {}, "host_busy": [c.describe() for c in busy]}
        self._record(event)
        self.log(f"re-plan at step {step} not tried: {why}")
        return Verdict(False, None, self.reference_ms, event)

    def _decide_memory(self, every: list[Any], detected: float) -> Verdict:
        """Rank 0: some device held more than its capacity; re-plan with that kind's memory cut by the miss."""
        from ... import driver  # loaded by __init__: see there

        plan, step = self.pipe.plan, self.pipe.steps_done
        rows = [StepMetrics.from_dict(rs[-1]) for rs in every]
        held = {plan.stages[m.stage].devices[m.replica]: m.held_bytes for m in rows if m.held_bytes}
        caps = {d.name: d.memory_bytes for d in plan.cluster.devices}
        short = memory_shortfalls(held, caps)
        predicted = {d: st.predicted.memory_bytes for st in plan.stages for d in st.devices}
        miss: dict[str, int] = {}  # per device kind: the largest (held - predicted) of its devices over capacity
        for d in short:
            kind = plan.cluster.device(d).kind
            miss[kind] = max(miss.get(kind, 0), caps[d] - replan_capacity(caps[d], held[d], predicted.get(d, 0)))
        cluster = replace(plan.cluster, devices=tuple(
            replace(d, memory_gib=(d.memory_bytes - miss.get(d.kind, 0)) / 2**30) for d in plan.cluster.devices))
        reason = "; ".join(f"{d} held {held[d] / 2**20:.1f} MiB, above its {caps[d] / 2**20:.1f} MiB by "
                           f"{b / 2**20:.1f} MiB (predicted {predicted.get(d, 0) / 2**20:.1f} MiB)"
                           for d, b in short.items())
        event: dict[str, Any] = {"step": step, "time": time.time(), "trigger": "memory", "reason": reason,
                                 "shortfalls": short, "held": held,
                                 "replan_memory_mib": {d.name: round(d.memory_bytes / 2**20, 1)
                                                       for d in cluster.devices}}
        prof = load_profile(self.build_dir / "profile.json")
        t0 = time.perf_counter()
        build = None
        try:
            result = driver.replan(plan, prof, cluster=cluster,
                                   opts=driver.Options(solver=self.opts.solver, time_limit_s=self.opts.time_limit_s))
        except HpmlError as e:
            event.update(switch=False, why=f"no plan fits with that much less memory: {e}",
                         solve_s=time.perf_counter() - t0)
        else:
            event.update(solve_s=time.perf_counter() - t0, switch=result.switched,
                         diff=result.diff.summary())
            if result.switched:
                t1 = time.perf_counter()
                # the new plan runs on the real cluster: its capacities, the smaller budget only solved for
                placed = replace(result.plan, cluster=plan.cluster)
                build = str(driver.rebuild(self.build_dir, placed, prof, self.run_dir / "next_build").out_dir)
                event.update(codegen_s=time.perf_counter() - t1, build=build)
            else:
                event["why"] = "the solver found no other plan"
        event["decide_s"] = time.perf_counter() - detected
        self._record(event)
        self.log(f"re-plan at step {step}: over memory: {reason}\n"
                 + (f"switching to the new plan ({build})" if build else f"keeping the plan: {event['why']}"))
        return Verdict(build is not None, build, self.reference_ms, event)

    def _record(self, event: dict[str, Any]) -> None:
        RunFolder(self.run_dir).append_replan(event)
