"""A rank's train loop, and what watches it: fault drills, progress, alerts and the closed loop.

The loop (:func:`train`) does four things per step: tell the observers a step
begins, run it, tell them how it went, and checkpoint when due (or when an
observer stops the run). Everything else a step may involve is an
:class:`Observer`, each one concern:

- :class:`FaultDrill`: ``run``'s drills (:class:`~.options.Faults`): this rank
  dies, hangs or computes slower at a given step;
- :class:`Progress`: rank 0's progress lines and ``started.json`` (the cost of
  a (re)start);
- :class:`Alerts`: rank 0's live alerts and metrics endpoint;
- :class:`ClosedLoop`: the closed loop (:class:`~.adapt.Adapter`) on every
  rank; it stops the run when a switch needs a restart, after which rank 0
  asks the supervisor for the new build (``next.json``).

Example:
    >>> class Count(Observer):
    ...     seen = 0
    ...     def after_step(self, step: int, loss: float) -> bool:
    ...         self.seen += 1
    ...         return step == 2  # stop after the third step
    >>> class Toy:
    ...     start, steps = 0, 10
    ...     def step(self, step: int) -> float: return 1.0 / (step + 1)
    ...     def checkpoint_due(self, done: int) -> bool: return False
    ...     def checkpoint(self, done: int, loss: float) -> float | None: return None
    >>> c = Count(); train(Toy(), [c]), c.seen
    (3, 3)
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from ...errors import HpmlError
from ..observe.live import AlertWatch, RowTail, serve_metrics
from ..observe.runfolder import RunFolder
from .options import Faults, RunOptions

if TYPE_CHECKING:
    from ..execute.pipeline import Pipeline
    from .adapt import Adapter, Verdict

__all__ = ["Steps", "Observer", "train", "observers_for", "FaultDrill", "Progress", "Alerts", "ClosedLoop", "KILLED_EXIT",
           "say"]

KILLED_EXIT = 137  # what a SIGKILLed process reports: the injected death looks like a real one


def say(line: str) -> None:
    """A progress line on standard error (standard output is rank 0's table of steps)."""
    print(line, file=sys.stderr, flush=True)


class Steps(Protocol):
    """What :func:`train` runs: the steps from ``start`` to ``steps``, and checkpoints."""

    start: int
    steps: int

    def step(self, step: int) -> float:
        """Run step ``step`` (from 0); return its loss."""
        ...

    def checkpoint_due(self, done: int) -> bool:
        """Whether a checkpoint is due after ``done`` steps."""
        ...

    def checkpoint(self, done: int, loss: float) -> float | None:
        """Checkpoint after ``done`` steps; the seconds it took, or None when this run keeps no checkpoints."""
        ...


class Observer:
    """Watches the loop; every hook does nothing unless overridden."""

    def before_step(self, step: int) -> None:
        """Step ``step`` (from 0) is about to run."""

    def after_step(self, step: int, loss: float) -> bool:
        """Step ``step`` ran with ``loss``; True stops the run (after a checkpoint)."""
        return False

    def after_checkpoint(self, done: int, seconds: float) -> None:
        """A checkpoint after ``done`` steps took ``seconds``."""

    def close(self, done: int, stopped: bool) -> None:
        """The loop ended after ``done`` steps; ``stopped``: an observer stopped it."""


def train(run: Steps, observers: Sequence[Observer]) -> int:
    """Run ``run``'s steps under ``observers``; return the number of steps done.

    Args:
        run: the steps to run (:class:`Steps`).
        observers: called in order around every step.

    Returns:
        The steps done when the loop ended (``run.steps``, or fewer when an observer stopped it).
    """
    done, stop = run.start, False
    for step in range(run.start, run.steps):
        for o in observers:
            o.before_step(step)
        loss = run.step(step)
        stop = any([o.after_step(step, loss) for o in observers])  # a list: every observer sees every step
        done = step + 1
        if stop or run.checkpoint_due(done):
            took = run.checkpoint(done, loss)
            if took is not None:
                for o in observers:
                    o.after_checkpoint(done, took)
        if stop:
            break
    for o in observers:
        o.close(done, stop)
    return done


def _slow_down(module: torch.nn.Module, factor: float) -> None:
    """Make a stage ``factor`` times slower, as a slower device would be.

    Each forward call sleeps ``(factor - 1)`` times its own duration three times
    over (forward plus a backward of about twice the forward), so the stage's
    compute per microbatch grows by about ``factor`` and the monitor sees it
    where a slow device would show it: in the stage's compute time.
    """
    started: list[float] = [0.0]

    def before(_m: torch.nn.Module, _args: object) -> None:
        started[0] = time.perf_counter()

    def after(_m: torch.nn.Module, _args: object, _out: object) -> None:
        time.sleep((factor - 1.0) * 3.0 * (time.perf_counter() - started[0]))

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


class FaultDrill(Observer):
    """``run``'s drills on this rank: die, hang or slow down at the steps :class:`~.options.Faults` names.

    Args:
        faults: the run's faults (ranks of the plan this launch runs).
        rank: this rank.
        pipe: its pipeline (a slowed rank's stages get slower).
        run: the run folder (a killed rank leaves its reason there, as a real failure would).
        start: the first step of this launch (a slow-down that began earlier is in force from it).
    """

    def __init__(self, faults: Faults, rank: int, pipe: Pipeline, run: RunFolder, start: int) -> None:
        self.kills = {step for step, r in faults.kills if r == rank}
        self.hangs = {step for step, r in faults.hangs if r == rank}
        self.slows = [(factor, begin) for r, factor, begin in faults.slows if r == rank]
        self.rank, self.pipe, self.run, self.start = rank, pipe, run, start

    def before_step(self, step: int) -> None:
        if step + 1 in self.kills:
            self.run.write_error(self.rank, f"killed at step {step + 1} by --kill-at (fault injection)", kind="killed")
            sys.stdout.flush()
            os._exit(KILLED_EXIT)
        if step + 1 in self.hangs:  # the peers block on this rank until their time-out
            while True:
                time.sleep(3600)
        for factor, begin in self.slows:
            if begin == step + 1 or (step == self.start and begin <= self.start):
                for module in self.pipe.stages.values():
                    _slow_down(module, factor)


class Progress(Observer):
    """Rank 0's progress: a line every ``log_every`` steps, the validation loss, and ``started.json``.

    Args:
        pipe: rank 0's pipeline (its last step's figures).
        options: the run's options.
        run: the run folder.
        start: the first step of this launch.
        resumed: the checkpoint this launch started from, or None.
    """

    def __init__(self, pipe: Pipeline, options: RunOptions, run: RunFolder, start: int, resumed: Path | None) -> None:
        self.pipe, self.options, self.run, self.start, self.resumed = pipe, options, run, start, resumed
        self.t0 = time.perf_counter()

    def after_step(self, step: int, loss: float) -> bool:
        steps = self.options.steps
        if step == self.start:  # how long a (re)start took, for the supervisor's figures
            self.run.write_started({"launched_at": self.options.launched_at, "first_step_at": time.time(),
                                    "start_step": self.start,
                                    "checkpoint": str(self.resumed) if self.resumed else None})
        if not self.pipe.metrics:
            return False
        m = self.pipe.metrics[-1]
        if step % self.options.log_every == 0 or step == steps - 1:
            print(f"step {step + 1:4d}/{steps}  loss {loss:9.4f}  {m.samples_per_s:8.1f} samples/s  "
                  f"{m.step_ms:8.1f} ms/step" + (f"  ({m.retries} retries)" if m.retries else ""), flush=True)
        if m.val_loss is not None:
            print(f"step {step + 1:4d}/{steps}  validation loss {m.val_loss:9.4f}", flush=True)
        return False

    def close(self, done: int, stopped: bool) -> None:
        if not stopped:
            print(f"done: {self.options.steps - self.start} steps in {time.perf_counter() - self.t0:.1f} s",
                  flush=True)


class Alerts(Observer):
    """Rank 0's live alerts over every rank's rows, and the metrics endpoint (``--metrics-port``).

    Raises:
        HpmlError: the metrics port cannot be served.
    """

    def __init__(self, pipe: Pipeline, options: RunOptions, run: RunFolder) -> None:
        plan = pipe.plan
        devices = [d for st in plan.stages for d in st.devices]
        if options.metrics_port:
            try:
                serve_metrics(run.path, options.metrics_port, devices, plan.predicted.step_ms)
            except OSError as e:
                raise HpmlError(f"--metrics-port {options.metrics_port}: cannot serve there ({e}); pass a free "
                                "port") from e
            say(f"metrics: http://{socket.gethostname()}:{options.metrics_port}/metrics (Prometheus text format)")
        capacity = {r: plan.cluster.device(d).memory_bytes for r, d in enumerate(devices)}
        self.watch, self.rows = AlertWatch(plan.predicted.step_ms, capacity), RowTail(run.path)

    def after_step(self, step: int, loss: float) -> bool:
        for alert in self.watch.observe(self.rows.read()):
            say(f"ALERT {alert}")
        return False


class ClosedLoop(Observer):
    """The closed loop on every rank (``run --adapt``): re-plan or move rows; stop when a switch restarts.

    The :class:`~.adapt.Adapter` starts after the first step of the launch (its start-up cost is measured up
    to there); each checkpoint's time prices the next restart.

    Args:
        pipe: the rank's pipeline.
        options: the run's options (``options.adapt`` set).
        run: the run folder.
        build: the build this launch runs.
        started: when this process started (``time.perf_counter()``), for a launch without ``launched_at``.
    """

    def __init__(self, pipe: Pipeline, options: RunOptions, run: RunFolder, build: Path, started: float) -> None:
        self.pipe, self.options, self.run, self.build, self.started = pipe, options, run, build, started
        self.adapter: Adapter | None = None
        self.switched: Verdict | None = None

    def after_step(self, step: int, loss: float) -> bool:
        from .adapt import Adapter

        if self.adapter is None:
            o = self.options
            began = time.time() - o.launched_at if o.launched_at else time.perf_counter() - self.started
            assert o.adapt is not None
            self.adapter = Adapter(self.pipe, build_dir=self.build, run_dir=self.run.path, total_steps=o.steps,
                                   startup_s=began, log=say, options=o.adapt)
        verdict = self.adapter.observe()
        if verdict is not None and verdict.restart:  # an in-place row move goes on here
            self.switched = verdict
        return self.switched is not None

    def after_checkpoint(self, done: int, seconds: float) -> None:
        if self.adapter is not None:
            self.adapter.checkpoint_s = seconds

    def close(self, done: int, stopped: bool) -> None:
        if self.switched is not None and self.pipe.rank == 0:
            self.run.write_next({"reason": "imbalance", "step": done, "build": self.switched.build,
                                 "event": self.switched.event})
            print(f"step {done}: checkpointed; restarting on the new plan ({self.switched.build})", flush=True)


def observers_for(pipe: Pipeline, options: RunOptions, run: RunFolder, *, build: Path, start: int,
                  resumed: Path | None, started: float) -> list[Observer]:
    """The observers of a rank of ``run``: the drills, rank 0's progress and alerts, and the closed loop.

    Args:
        pipe: the rank's pipeline.
        options: the run's options.
        run: the run folder.
        build: the build this launch runs.
        start: the first step of this launch.
        resumed: the checkpoint it started from, or None.
        started: when this process started (``time.perf_counter()``).
    """
    out: list[Observer] = [FaultDrill(options.faults, pipe.rank, pipe, run, start)] if options.faults else []
    place = getattr(pipe.session, "tp_index", 0)  # a tensor-parallel job: which copy of the plan this rank runs
    if options.adapt is not None and getattr(pipe.session, "tp", 1) > 1:
        raise HpmlError("--adapt re-plans the running job, which the runtime does not do for a plan with "
                        "tensor-parallel stages: run without --adapt, or compile with --max-tp 1")
    if pipe.rank == 0 and place == 0:
        out += [Progress(pipe, options, run, start, resumed), Alerts(pipe, options, run)]
    if options.adapt is not None:
        out.append(ClosedLoop(pipe, options, run, build, started))
    return out
