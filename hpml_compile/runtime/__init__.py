"""Pass 7, runtime: run a build's stages under torch.distributed, measured, launched by torchrun.

- :mod:`.api`: ``compile(model, example_inputs, ...)`` -> :class:`Pipeline` (the Python API);
- :mod:`.executor`: the one executor: runs the build's per-rank action lists, in one process or on a rank;
- :mod:`.pipeline`: :class:`Pipeline` over the executor, with the process group, retries and measurements;
- :mod:`.comm`: the communicators (a mailbox in one process; NCCL between GPUs, gloo where a CPU is
  involved, host staging);
- :mod:`.session`: the process group on torchrun's store, re-formed after a transient failure;
- :mod:`.monitor`: per-step measurements (JSON lines, TensorBoard); :mod:`.summary`: the report
  and the measured profile;
- :mod:`.launcher`: ``hpml-compile run`` starting the ranks with torchrun; :mod:`.worker`: one rank;
  :mod:`hpml_compile.recipe`: how a rank rebuilds the model (``model.json``);
- :mod:`.gather`: the full state dict and evaluation outputs across ranks;
- :mod:`.testing`: :func:`spawn_ranks`, gloo ranks with a deadline for tests; :mod:`.checkpoint`: DCP checkpoints;
- :mod:`.zero`: ZeRO-1/2 over a stage's replicas (flat buffers, the optimizer over this replica's shard);
  :mod:`.zero3`: ZeRO-3 (the parameters' flat buffer freed between uses, gathered around the stage's compute);
  :mod:`.held`: the parameter, gradient and optimizer bytes a rank holds, counted by storage;
  :mod:`.saved`: the activations saved for backward and the gradients, at their peaks;
- :mod:`.offload`: optimizer offload (state and step in host memory) for GPU stages.

``compile`` (:mod:`.api`, which imports :mod:`hpml_compile.driver` and with it
the solvers) is imported on first use, not with the package: a rank
(:mod:`.worker`) runs a build and never solves, so it does not pay for PuLP,
HiGHS and the solver modules at every (re)start.

Example:
    >>> from hpml_compile.runtime import Pipeline, compile, step_local, spawn_ranks
    >>> callable(compile) and callable(step_local) and callable(spawn_ranks) and hasattr(Pipeline, "step")
    True
"""

from .comm import Backend, CommFault, CommOp, DistComm, LocalComm, dist_comm, pair_backend, rank_devices
from .executor import (
    StepResult,
    merge_outputs,
    rank_layout,
    run_actions,
    split_microbatches,
    stage_ranks,
    step_local,
    step_rank,
)
from .monitor import Monitor, StepMetrics
from .pipeline import Pipeline
from .session import CommFailure, RetryPolicy, Session
from .testing import spawn_ranks

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
_LAZY = {"compile": "api"}


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

    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazily imported ones included."""
    return sorted({*globals(), *_LAZY})
