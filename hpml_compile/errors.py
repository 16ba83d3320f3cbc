"""The errors hpml-compile raises on bad input.

Every message states the rule that was broken, the values involved and what
would fix it, so that the CLI can print it as-is (no traceback) and exit 2.
Every error class of the package is here, the runtime's included, so that a
caller finds them in one place and catching one never imports the runtime.

>>> raise SchemaError("profile.json", "nodes[3].cost.A100-80GB.fwd_ms", "a number", "'fast'")
Traceback (most recent call last):
...
hpml_compile.errors.SchemaError: profile.json: nodes[3].cost.A100-80GB.fwd_ms: expected a number, got 'fast'
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "HpmlError",
    "LeadLost",
    "RanksLost",
    "JoinRefused",
    "SchemaError",
    "TraceError",
    "ModelError",
    "UnknownDeviceError",
    "InfeasibleError",
    "BuildMismatchError",
    "OutputError",
    "PlanError",
    "LaunchError",
    "RankFailure",
    "SupervisorError",
    "CheckpointError",
    "CommFailure",
    "ScheduleError",
    "IndexFormatError",
    "RanksTimeout",
    "BatchMismatchError",
    "OptionError",
    "UpdateApplied",
]


class HpmlError(Exception):
    """Base class: a user-facing error whose message says what to do."""


class SchemaError(HpmlError):
    """A JSON file (profile, cluster, plan) does not match its schema.

    Args:
        source: the file or object being read, e.g. ``"profile.json"``.
        field: the path of the bad field, e.g. ``"nodes[3].cost.cpu.fwd_ms"``.
        expected: what the field should hold.
        got: what it holds (already formatted).
        fix: what would mend it, appended after a semicolon (optional).
    """

    def __init__(self, source: str, field: str, expected: str, got: str, fix: str = "") -> None:
        self.source, self.field, self.expected, self.got, self.fix = source, field, expected, got, fix
        super().__init__(f"{source}: {field}: expected {expected}, got {got}" + (f"; {fix}" if fix else ""))


class TraceError(HpmlError):
    """A model could not be traced into a graph (names the module and line)."""


class ModelError(HpmlError):
    """A model name, factory or its example inputs are not usable."""


class UnknownDeviceError(HpmlError):
    """A device kind is in neither the profile nor the cost_models catalog."""


class InfeasibleError(HpmlError):
    """No plan fits the devices' memory (names each device and its shortfall)."""


class BuildMismatchError(HpmlError):
    """A build folder no longer matches its model or its own manifest."""


class OutputError(HpmlError):
    """An output path that may not be written: it holds what the tool did not make, or cannot be created."""


class PlanError(HpmlError):
    """A plan breaks one of its rules (see :func:`hpml_compile.plan.validate_plan`), or does not fit the cost
    graph or schedule it is used with (the simulator names the node or the operations)."""


class LaunchError(HpmlError):
    """The ranks could not be started, or one of them failed (the message names it and what to do)."""


class RankFailure(LaunchError):
    """A rank failed while the job ran.

    Args:
        message: what failed and what to do.
        failures: rank -> (exit code, torchrun's message) of every rank torchrun saw fail (the ones it
            stopped after the first failure exit with -15, SIGTERM).

    Attributes:
        failures: as given.
    """

    def __init__(self, message: str, failures: dict[int, tuple[int, str]]) -> None:
        super().__init__(message)
        self.failures = failures


class SupervisorError(HpmlError):
    """The job cannot go on (no device left, nothing fits, or a failure that is not the devices')."""


class LeadLost(SupervisorError):
    """A multi-host job's deciding host (host 0, with the job's store) was lost: the hosts left may take over."""


class CheckpointError(HpmlError):
    """No usable checkpoint, or one that does not hold what the current plan needs."""


class CommFailure(HpmlError):
    """A step's communication failed and retrying did not help (names the step, the error and what to do)."""


class RanksLost(CommFailure):
    """Ranks of the group died (their beat stopped): the survivors may go on without them
    (:meth:`hpml_compile.runtime.execute.session.Session.shrink`).

    Attributes:
        step: the steps completed when the failure came.
        lost: the ranks of the failed group that are gone.
    """

    def __init__(self, step: int, lost: list[int]) -> None:
        super().__init__(f"step {step + 1}: ranks {lost} of the job died; the others can go on without them only "
                         "where each lost rank was one replica of a replicated stage, else restart from the last "
                         "checkpoint")
        self.step, self.lost = step, lost


class HandoffError(HpmlError, RuntimeError):
    """A generating rank's neighbour closed its end of the pipes between them (it exited), or sent or read
    nothing for the group's time-out (:mod:`hpml_compile.infer.handoff`)."""


class JoinRefused(HpmlError):
    """A running job has no place for a process that asked to join it (:mod:`hpml_compile.runtime.execute.join`);
    the message names why and what would be right."""


class ScheduleError(HpmlError):
    """A build's per-rank action lists cannot run: an unmatched message, a rank waiting on itself, a deadlock."""


class IndexFormatError(HpmlError):
    """A checkpoint's ``index.json`` that does not describe tensors in its own folder."""


class RanksTimeout(HpmlError):
    """Spawned ranks did not finish in time (a deadlock, or a machine far slower than expected)."""


class BatchMismatchError(HpmlError):
    """Ranks that must read the same batch were given different ones (names the step and the data)."""


class OptionError(HpmlError):
    """A command-line option (or the API argument behind it) out of range, badly formed, or naming a rank or a
    step the job does not have; raised before any process starts. The message names the option, the value,
    what is expected and how to fix it."""


class UpdateApplied(HpmlError):
    """A step failed after its optimizer update: the parameters on this rank hold it, so the step must not be
    run again (that would train on its batch twice). ``run`` is what the step measured up to the failure (the
    executor's ``StepRun``); the failure itself is ``__cause__``. The ranks agreed on the loss before the update
    (``LOSS``), so they all took it; what failed is a collective after it (ZeRO-1/2's blocking parameter
    all-gather, local SGD's average), which the pipeline completes on the re-formed group before the next step
    (:meth:`hpml_compile.runtime.sync.zero.FlatShard.forget`)."""

    def __init__(self, run: Any) -> None:
        super().__init__("the step failed after its optimizer update")
        self.run = run
