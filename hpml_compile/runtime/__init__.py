"""Pass 7, runtime: run a build's stages under torch.distributed, measured, launched by torchrun.

The runtime is four rooms, each a sub-package with one job; a room imports the rooms below it, never
one above (``tests/unit/test_layering.py``):

- :mod:`.sync` (bottom): moving tensors between ranks: the communicators (point-to-point and
  collectives, shared memory, the hierarchical chain) and the data-parallel gradient and parameter
  sync (flat, ZeRO-1/2/3, compression, local SGD, optimizer offload);
- :mod:`.observe`: what a run measures and reports: the monitor, events, host and GPU counters, held
  memory, the live alerts, the summary, timeline and report page, and the re-plan policy that reads them;
- :mod:`.execute`: running a build on a rank: the executor, :class:`Pipeline`, the process-group
  session, data, the trainer, checkpoints, gathering the full state;
- :mod:`.job` (top): the processes: the launcher, the supervisor, the rank entry and worker, the
  lifeline, the closed loop, and :func:`spawn_ranks`.

This package is the runtime's public face: it re-exports what user code imports. ``compile``
(:mod:`hpml_compile.api`, which imports :mod:`hpml_compile.driver` and with it the solvers) is
imported on first use, not with the package: a rank (:mod:`.job.worker`) runs a build and never
solves, so it does not pay for PuLP, HiGHS and the solver modules at every (re)start.

Example:
    >>> from hpml_compile.runtime import Pipeline, compile, step_local, spawn_ranks
    >>> callable(compile) and callable(step_local) and callable(spawn_ranks) and hasattr(Pipeline, "step")
    True
"""

from .sync.comm import Backend, CommFault, CommOp, DistComm, LocalComm, dist_comm, pair_backend, rank_devices
from .execute.executor import (
    StepResult,
    merge_outputs,
    rank_layout,
    run_actions,
    split_microbatches,
    stage_ranks,
    step_local,
    step_rank,
)
from .observe.monitor import Monitor, StepMetrics
from .execute.pipeline import Pipeline
from .execute.session import CommFailure, RetryPolicy, Session
from .job.spawn import spawn_ranks

__all__ = [
    "compile",
    "Pipeline",
    "RetryPolicy",
    "Session",
    "CommFailure",
    "CommFault",
    "CommOp",
    "Backend",
    "pair_backend",
    "rank_devices",
    "Monitor",
    "StepMetrics",
    "run_actions",
    "step_local",
    "step_rank",
    "dist_comm",
    "spawn_ranks",
    "StepResult",
    "LocalComm",
    "DistComm",
    "stage_ranks",
    "rank_layout",
    "split_microbatches",
    "merge_outputs",
]

# Public names imported on first use (PEP 562): ``compile`` pulls in the driver and the solvers.
_LAZY = {"compile": "hpml_compile.api"}


def __getattr__(name: str) -> object:
    """Import a lazily exported name on first use, so that importing the runtime does not import the solvers.

    Args:
        name: the attribute asked for.

    Returns:
        The attribute, cached in the module afterwards.

    Raises:
        AttributeError: if the package has no such name.
    """
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazily imported ones included."""
    return sorted({*globals(), *_LAZY})
