"""Pass 7, runtime: run a build's stages under torch.distributed, measured, launched by torchrun.

- :mod:`.api`: ``compile(model, example_inputs, ...)`` -> :class:`Pipeline` (the Python API);
- :mod:`.pipeline`: :class:`Pipeline`, GPipe / 1F1B over the generated stages, retried communication;
- :mod:`.comm`: the communicator (NCCL between GPUs, gloo where a CPU is involved, host staging);
- :mod:`.session`: the process group on torchrun's store, re-formed after a transient failure;
- :mod:`.monitor`: per-step measurements (JSON lines, TensorBoard); :mod:`.summary`: the report
  and the measured profile;
- :mod:`.launcher`: ``hpml-compile run`` starting the ranks with torchrun; :mod:`.worker`: one rank;
  :mod:`.recipe`: how a rank rebuilds the model (``model.json``);
- :mod:`.gather`: the full state dict and evaluation outputs across ranks;
- :mod:`.executor`: the minimal one-step executor codegen's tests use; :mod:`.checkpoint`: DCP checkpoints.

Example:
    >>> from hpml_compile.runtime import Pipeline, compile, step_local, launch
    >>> callable(compile) and callable(step_local) and callable(launch) and hasattr(Pipeline, "step")
    True
"""

from .api import compile
from .comm import Backend, CommFault, OpKind, PipeComm, pair_backend, rank_devices
from .executor import (
    DistComm,
    LocalComm,
    StepResult,
    dist_comm,
    launch,
    merge_outputs,
    rank_layout,
    split_microbatches,
    stage_ranks,
    step_local,
    step_rank,
)
from .monitor import Monitor, StepMetrics
from .pipeline import Pipeline
from .session import CommFailure, RetryPolicy, Session

__all__ = [
    "compile",
    "Pipeline",
    "RetryPolicy",
    "Session",
    "CommFailure",
    "CommFault",
    "OpKind",
    "Backend",
    "PipeComm",
    "pair_backend",
    "rank_devices",
    "Monitor",
    "StepMetrics",
    "step_local",
    "step_rank",
    "dist_comm",
    "launch",
    "StepResult",
    "LocalComm",
    "DistComm",
    "stage_ranks",
    "rank_layout",
    "split_microbatches",
    "merge_outputs",
]
