"""A run's options, typed once: :class:`RunOptions` (with :class:`Faults`), written to ``run.json`` and read by every rank.

``hpml-compile run`` parses the command line once into a :class:`RunOptions`;
the launcher writes it into the run folder's ``run.json``
(:class:`~hpml_compile.runtime.observe.runfolder.RunFolder`) before any rank
starts, and each rank reads it back (:func:`read_options`). The supervisor of
``run --adapt`` writes each segment's options as the job's, with what the
segment changes (:meth:`RunOptions.for_segment`). No command line is rebuilt
from parsed options and parsed again.

Fault injection is data, :class:`Faults`: the steps a rank dies or hangs at,
the ranks computing slower, the communication operations that fail once. A
rank's train loop consults it through one observer
(:class:`~hpml_compile.runtime.job.loop.FaultDrill`); the supervisor moves it
from rank to rank as devices come and go (:meth:`Faults.follow`).

Example:
    >>> o = RunOptions(steps=3, faults=Faults(kills=((2, 1),), slows=((0, 1.5, 1),)))
    >>> RunOptions.from_dict(json.loads(json.dumps(o.to_dict()))) == o
    True
    >>> o.faults.follow(["a", "b"], ["b"]).kills  # rank 1 (device b) is rank 0 now; device a is gone
    ((2, 0),)
"""

from __future__ import annotations

import argparse
import enum
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Sequence

from ...errors import HpmlError
from ..execute.session import RetryPolicy
from ..observe.runfolder import RunFolder
from ..sync.comm import CommFault, CommOp
from .adapt import AdaptOptions

__all__ = ["RunOptions", "Faults", "OptimizerName", "ResumeMode", "read_options", "write_options", "parse_fault",
           "parse_step_rank", "parse_slow", "OPTIONS_VERSION"]

OPTIONS_VERSION = 1


class OptimizerName(str, enum.Enum):
    """Optimizers ``run`` can train with."""

    ADAMW = "adamw"
    SGD = "sgd"


class ResumeMode(str, enum.Enum):
    """Whether a rank starts from a checkpoint: never, always (an error without one), or when there is one."""

    NO = "no"
    REQUIRED = "required"
    IF_ANY = "if-any"


def _at_least(text: str, name: str, value: int, low: int) -> None:
    if value < low:
        raise argparse.ArgumentTypeError(f"{name} must be {low} or more (steps count from 1, ranks from 0), "
                                         f"got {value} in {text!r}")


def parse_fault(text: str) -> CommFault:
    """Parse ``--inject-fault STEP:RANK:OP`` (STEP from 1, as the progress lines count).

    Raises:
        argparse.ArgumentTypeError: not three fields, a field that is not a whole number or an operation,
            a step below 1 or a negative rank.
    """
    ops = "|".join(o.value for o in CommOp)
    try:
        step, rank, op = text.split(":")
        fault = CommFault(int(step) - 1, int(rank), CommOp(op))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected STEP:RANK:{ops} (e.g. 3:1:{CommOp.COLLECTIVE.value}), "
                                         f"got {text!r}") from e
    _at_least(text, "STEP", fault.step + 1, 1)
    _at_least(text, "RANK", fault.rank, 0)
    return fault


def parse_step_rank(text: str) -> tuple[int, int]:
    """Parse ``--kill-at``/``--hang-at STEP:RANK`` (STEP from 1).

    Returns:
        ``(step, rank)``.

    Raises:
        argparse.ArgumentTypeError: not two whole numbers, a step below 1 or a negative rank.
    """
    try:
        step, rank = (int(x) for x in text.split(":"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected STEP:RANK (e.g. 5:1; step from 1), got {text!r}") from e
    _at_least(text, "STEP", step, 1)
    _at_least(text, "RANK", rank, 0)
    return step, rank


def parse_slow(text: str) -> tuple[int, float, int]:
    """Parse ``--slow RANK:FACTOR:FROM_STEP`` (FROM_STEP from 1).

    Returns:
        ``(rank, factor, from_step)``.

    Raises:
        argparse.ArgumentTypeError: not three fields, a field of the wrong type, a factor below 1 or not
            finite, a step below 1 or a negative rank.
    """
    try:
        rank, factor, step = text.split(":")
        out = int(rank), float(factor), int(step)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected RANK:FACTOR:FROM_STEP, e.g. 1:3:10, got {text!r}") from e
    if not (math.isfinite(out[1]) and out[1] >= 1):
        raise argparse.ArgumentTypeError(f"FACTOR must be a number >= 1 (how many times slower), got {factor!r} "
                                         f"in {text!r}")
    _at_least(text, "RANK", out[0], 0)
    _at_least(text, "FROM_STEP", out[2], 1)
    return out


@dataclass(frozen=True, slots=True)
class Faults:
    """Faults to inject on purpose (``run``'s drills), by rank of the plan they run under; steps count from 1.

    Attributes:
        comm: communication operations that fail once each (``--inject-fault``; the first segment only).
        kills: ``(step, rank)``: the rank dies abruptly when it reaches the step (``--kill-at``).
        hangs: ``(step, rank)``: the rank stops responding at the step (``--hang-at``).
        slows: ``(rank, factor, from_step)``: the rank computes ``factor`` times slower (``--slow``).
    """

    comm: tuple[CommFault, ...] = ()
    kills: tuple[tuple[int, int], ...] = ()
    hangs: tuple[tuple[int, int], ...] = ()
    slows: tuple[tuple[int, float, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.comm or self.kills or self.hangs or self.slows)

    def ranks(self) -> list[int]:
        """Every rank a fault names."""
        return ([f.rank for f in self.comm] + [r for _, r in self.kills] + [r for _, r in self.hangs]
                + [r for r, _, _ in self.slows])

    def follow(self, first: Sequence[str], now: Sequence[str], *, first_segment: bool = False) -> Faults:
        """The faults under another plan: each follows its device from the first plan's ranks to ``now``'s.

        A device that is gone takes its faults with it; a communication fault applies to the first segment only.

        Args:
            first: the device of each rank of the plan the faults were given for.
            now: the device of each rank of the plan about to run.
            first_segment: whether this is the job's first segment (which keeps the communication faults).
        """
        where = {d: now.index(d) for d in first if d in now}

        def moved(rank: int) -> int | None:
            return where.get(first[rank]) if 0 <= rank < len(first) else None

        return Faults(
            comm=self.comm if first_segment else (),
            kills=tuple((s, r) for s, r0 in self.kills for r in [moved(r0)] if r is not None),
            hangs=tuple((s, r) for s, r0 in self.hangs for r in [moved(r0)] if r is not None),
            slows=tuple((r, f, s) for r0, f, s in self.slows for r in [moved(r0)] if r is not None))

    def to_dict(self) -> dict[str, Any]:
        """The faults as JSON data."""
        return {"comm": [[f.step, f.rank, f.op.value, f.index] for f in self.comm],
                "kills": [list(k) for k in self.kills], "hangs": [list(h) for h in self.hangs],
                "slows": [list(s) for s in self.slows]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Faults:
        """Read :meth:`to_dict`'s data back."""
        return cls(comm=tuple(CommFault(int(s), int(r), CommOp(op), int(i)) for s, r, op, i in d.get("comm", [])),
                   kills=tuple((int(s), int(r)) for s, r in d.get("kills", [])),
                   hangs=tuple((int(s), int(r)) for s, r in d.get("hangs", [])),
                   slows=tuple((int(r), float(f), int(s)) for r, f, s in d.get("slows", [])))


_PATHS = ("checkpoint_dir", "rows_from")


@dataclass(frozen=True, slots=True)
class RunOptions:
    """What every rank of a run needs to know, as ``hpml-compile run`` was asked (see ``run --help``).

    Attributes:
        steps: the step the run ends at.
        optimizer, lr: the optimizer (a TrainSpec's own wins) and its learning rate.
        log_every: rank 0 prints every N steps.
        retries: attempts per step when communication fails transiently.
        timeout_s: seconds a rank may block in communication before it fails.
        tensorboard: also write TensorBoard events.
        metrics_port: rank 0 serves the latest figures there (Prometheus text format), or None.
        val_every: a TrainSpec's validation loss every K steps and at the end (0: never).
        log_samples: first-stage ranks write each step's dataset indices.
        compress, sync_every, sync_warmup: override the plan's gradient compression and local SGD (None: the plan's).
        checkpoint_dir: where checkpoints go (None: none written).
        checkpoint_every: checkpoint every K steps (0: only at the end and before a switch).
        keep: complete checkpoints kept (0: every one).
        resume: whether to start from the latest checkpoint in ``checkpoint_dir``.
        adapt: the closed loop's options on rank 0, or None (no re-plan while training).
        faults: faults to inject (drills).
        rows_from: a plan whose rows per replica the ranks take before their first step (a restart after rows
            moved in place), or None.
        launched_at: when the launch began (epoch seconds; rank 0 records the time to its first step).
        compile_stages: ``auto``, ``on`` or ``off``: stages compiled by torch.compile
            (:mod:`hpml_compile.runtime.execute.compiled`).
        live: the ranks were started by the supervisor itself (:mod:`.hostranks`), not torchrun's agent: a lost
            replica is answered in place (the survivors go on in their processes) rather than by a restart.
    """

    steps: int = 20
    optimizer: OptimizerName = OptimizerName.ADAMW
    lr: float = 1e-3
    log_every: int = 1
    retries: int = 3
    timeout_s: float = RetryPolicy().timeout_s
    tensorboard: bool = True
    metrics_port: int | None = None
    val_every: int = 0
    log_samples: bool = False
    compress: str | None = None
    sync_every: int | None = None
    sync_warmup: int | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    keep: int = 3
    resume: ResumeMode = ResumeMode.NO
    adapt: AdaptOptions | None = None
    faults: Faults = field(default_factory=Faults)
    rows_from: Path | None = None
    launched_at: float | None = None
    compile_stages: str = "auto"
    live: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1 or self.log_every < 1 or self.checkpoint_every < 0 or self.keep < 0:
            raise HpmlError(f"run options: steps ({self.steps}) and log_every ({self.log_every}) must be 1 or more, "
                            f"checkpoint_every ({self.checkpoint_every}) and keep ({self.keep}) 0 or more")
        if self.compile_stages not in ("auto", "on", "off"):
            raise HpmlError(f"run options: compile_stages must be auto, on or off, got {self.compile_stages!r}")

    @property
    def comm_options(self) -> dict[str, Any]:
        """The plan's communication overrides, as :meth:`~hpml_compile.runtime.execute.pipeline.Pipeline.from_build`
        takes them."""
        return {"compress": self.compress, "sync_every": self.sync_every, "sync_warmup": self.sync_warmup}

    def to_dict(self) -> dict[str, Any]:
        """The options as JSON data (paths as strings, enums as their values)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "faults":
                value = value.to_dict()
            elif f.name == "adapt":
                value = None if value is None else asdict(value)
            elif isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, Path):
                value = str(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunOptions:
        """Read :meth:`to_dict`'s data back.

        Raises:
            HpmlError: a key that is no option (a run folder written by another version).
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise HpmlError(f"run.json: unknown run options {unknown}; this version knows {sorted(names)}. Start the "
                            "run again with this version's `hpml-compile run`")
        kw: dict[str, Any] = dict(d)
        kw["optimizer"] = OptimizerName(kw.get("optimizer", OptimizerName.ADAMW.value))
        kw["resume"] = ResumeMode(kw.get("resume", ResumeMode.NO.value))
        kw["faults"] = Faults.from_dict(kw.get("faults") or {})
        kw["adapt"] = None if kw.get("adapt") is None else AdaptOptions(**kw["adapt"])
        for name in _PATHS:
            kw[name] = None if kw.get(name) is None else Path(kw[name])
        return cls(**kw)

    def for_segment(self, **changes: Any) -> RunOptions:
        """These options with ``changes`` (a supervised job's segment: its faults, rows, launch time)."""
        return replace(self, **changes)


def write_options(run: RunFolder, options: RunOptions, info: dict[str, Any]) -> None:
    """Write ``run.json``: ``info`` (the run's facts: build, start time, ranks, ...) and the options.

    Args:
        run: the run folder.
        options: what every rank reads back.
        info: facts for a reader of the folder (``report``, ``replan``).
    """
    run.path.mkdir(parents=True, exist_ok=True)
    run.run_json.write_text(json.dumps({**info, "options_version": OPTIONS_VERSION, "options": options.to_dict()},
                                       indent=1, sort_keys=True) + "\n")


def read_options(run: RunFolder) -> RunOptions:
    """The options a rank runs with, from ``run.json``.

    Raises:
        HpmlError: no ``run.json`` with options, or options of another version.
    """
    info = run.read_info()
    if "options" not in info:
        raise HpmlError(f"{run.run_json}: no run options; start the ranks with `hpml-compile run`, which writes them")
    if info.get("options_version") != OPTIONS_VERSION:
        raise HpmlError(f"{run.run_json}: run options version {info.get('options_version')!r}, this version reads "
                        f"{OPTIONS_VERSION}; start the run again with this version's `hpml-compile run`")
    return RunOptions.from_dict(info["options"])
