"""Pass 7, runtime: run a build's stages. So far the minimal executor (:mod:`.executor`).

Example:
    >>> from hpml_compile.runtime import step_local, step_rank, launch
    >>> callable(step_local) and callable(step_rank) and callable(launch)
    True
"""

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

__all__ = [
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
