"""Running a build whose stages have ``tp > 1``: process groups, each rank's parameter slices, whole tensors back.

A plan whose stages run at degree ``tp`` is run as ``tp`` copies of one plan
without tensor parallelism (:func:`hpml_compile.codegen.tensor_parallel.replica_plan`):
the ``N`` ranks of the job (one per device, the plan's device order) form

- a default process group per place ``t`` in the tensor-parallel groups:
  ranks ``t, t + tp, t + 2 tp, ...`` (``N / tp`` ranks), in which the
  pipeline runs as it does without tensor parallelism: its schedule,
  boundaries (every rank of a group receives the same tensors), loss
  agreement and gradient sync (over the data-parallel group of its place,
  as the plan prices it);
- a tensor-parallel group per block of ``tp`` consecutive ranks (one
  replica of one stage), a gloo group made on the job's store outside the
  default group, which runs the collectives inside the sharded layers
  (:mod:`hpml_compile.codegen.tpops`).

Each rank slices the parameters its stage lists in ``TP_SHARDS`` in place
(the same parameter objects, so the stage module, the optimizer and the
gradient buffers see the slice); :func:`whole_params` gathers them back to
whole tensors, so a checkpoint does not depend on ``tp``.

torch.distributed has one default group per process, which is why the
session here opens it on ``N / tp`` ranks rather than all ``N``.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.arange(8.0).reshape(4, 2))
    >>> slice_param(w, 0, rank=1, size=2)
    >>> w.tolist()
    [[4.0, 5.0], [6.0, 7.0]]
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...codegen import Build
from ...codegen.tensor_parallel import replica_plan, tp_degree
from ...codegen.tpops import TPGroup
from ...errors import HpmlError
from ...schedule import stage_ranks
from ..sync.comm import Backend
from .session import RetryPolicy, Session

__all__ = ["TensorParallelSession", "slice_param", "shard_build", "whole_params", "checkpoint_view", "open_tensor_parallel",
           "shard_rank"]


class TensorParallelSession(Session):
    """A :class:`~.session.Session` whose default group is one place of the tensor-parallel groups.

    Attributes (after opening): ``rank`` and ``world_size`` are this rank's place in its default group
    (``N / tp`` ranks); ``tp_index`` its place in its tensor-parallel group; ``tp_group`` that group;
    ``job_rank``, ``job_size`` the rank among all ``N``.

    Args:
        tp: the degree.
        init_method: ``env://`` or ``file:///path``.
        rank, world_size: this rank among all ``N`` (None: from the environment).
        policy: the retry policy.
        log: where retry notices go.

    Raises:
        HpmlError: a process group exists already (the default group must be made here), or ``N`` is not a
            multiple of ``tp``.
    """

    def __init__(self, tp: int, init_method: str = "env://", rank: int | None = None, world_size: int | None = None,
                 policy: RetryPolicy = RetryPolicy(), log: Callable[[str], None] | None = None) -> None:
        if dist.is_initialized():
            raise HpmlError("the plan has tensor-parallel stages, whose ranks need process groups this runtime "
                            "makes, but a process group exists already: let hpml_compile create it (give "
                            "init_method, or start the ranks with torchrun), without init_process_group before")
        self.tp = tp
        self.tp_group: Any = None
        self.job_rank = self.job_size = -1
        super().__init__(init_method, rank, world_size, policy, log)

    def _open(self) -> None:
        if self.job_rank < 0:
            self.job_rank, self.job_size = self.rank, self.world_size
            if self.job_size % self.tp:
                raise HpmlError(f"the job has {self.job_size} ranks, which tensor-parallel groups of {self.tp} do "
                                f"not divide: start a multiple of {self.tp} ranks, one per device of the plan")
        timeout = datetime.timedelta(seconds=self.policy.timeout_s)
        self.tp_index, block = self.job_rank % self.tp, self.job_rank // self.tp
        self.rank, self.world_size = block, self.job_size // self.tp
        gen = f"hpml/gen{self.generation}/"
        store = dist.PrefixStore(f"{gen}place{self.tp_index}/", self._store)
        self._with_retry("process group", lambda: dist.init_process_group(
            Backend.GLOO.value, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout))
        self.tp_group = dist.ProcessGroupGloo(dist.PrefixStore(f"{gen}tp{block}/", self._store), self.tp_index,
                                              self.tp, timeout)


def slice_param(p: Tensor, dim: int, rank: int, size: int) -> None:
    """Keep only slice ``rank`` of ``size`` equal slices of ``p`` along ``dim``, in place (the same object).

    Raises:
        HpmlError: ``size`` does not divide the dimension.
    """
    if p.shape[dim] % size:
        raise HpmlError(f"a parameter of shape {tuple(p.shape)} does not split into {size} along dimension {dim}: "
                        "set the stage's tp to a degree dividing it")
    with torch.no_grad():
        p.data = p.data.chunk(size, dim=dim)[rank].clone()


def shard_build(build: Build, model: nn.Module, stage: int, group: TPGroup) -> None:
    """Give stage ``stage`` of ``build`` its tensor-parallel group and slice the parameters it lists."""
    st = build.stages[stage]
    st.hpml_tp = group
    for region in st.REGIONS:  # a recompute region runs the sharded layers
        getattr(st, region).hpml_tp = group
    for name, dim in st.TP_SHARDS:
        slice_param(model.get_parameter(name), dim, group.rank, group.size)


def _gather(group: TPGroup, t: Tensor, dim: int) -> Tensor:
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(group.size)]
    group.process_group().allgather([parts], [t]).wait()
    return torch.cat(parts, dim=dim)


@contextlib.contextmanager
def whole_params(build: Build, model: nn.Module, stage: int, *, changed: bool = False,
                 optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """This rank's sliced parameters whole for the block (gathered over its tensor-parallel group; a no-op for
    a stage without slices), sliced again after it: what reads or writes parameters outside a step (the state
    dict, checkpoints) sees the model as it is without tensor parallelism.

    A collective over the tensor-parallel group: every rank of it enters it.

    Args:
        build: the build (this rank's place, see :func:`open_tensor_parallel`).
        model: the model.
        stage: the stage this rank runs.
        changed: the block writes the parameters (a load): each rank keeps its slice of what was written.
        optimizer: its per-parameter state shaped like a sliced parameter (Adam's moments) is made whole too,
            and what the block leaves shaped like the whole parameter is sliced after it.
    """
    st = build.stages[stage]
    group: TPGroup | None = st.hpml_tp
    if group is None or group.size == 1 or not st.TP_SHARDS:
        yield
        return
    params = [(model.get_parameter(name), dim) for name, dim in st.TP_SHARDS]
    states = optimizer.state if optimizer is not None else {}
    mine = [(p.data, dict(states.get(p, {}))) for p, _ in params]
    for p, dim in params:
        sliced = p.shape
        p.data = _gather(group, p.data, dim)
        for k, v in states.get(p, {}).items():
            if isinstance(v, Tensor) and v.shape == sliced and v.dim():
                states[p][k] = _gather(group, v, dim)
    try:
        yield
    finally:
        states = optimizer.state if optimizer is not None else {}  # a load may have replaced the table
        for (p, dim), (data, state) in zip(params, mine):
            whole = p.shape
            if changed:
                slice_param(p, dim, group.rank, group.size)
                for k, v in states.get(p, {}).items():
                    if isinstance(v, Tensor) and v.shape == whole and v.dim():
                        states[p][k] = v.chunk(group.size, dim=dim)[group.rank].clone()
            else:
                p.data = data
                if p in states:
                    states[p].update(state)


@contextlib.contextmanager
def checkpoint_view(pipe: Any) -> Iterator[bool]:
    """A pipeline's parameters and optimizer state whole for a checkpoint; yields whether this rank writes.

    Every place of the tensor-parallel groups holds the same whole tensors in the block, so only place 0
    writes (its default group holds every stage once); the group's other ranks wait for it at the end. A
    load runs on every rank (``changed``: each keeps its slice). Without tensor-parallel stages: yields True.
    """
    st = pipe.build.stages[pipe.stage_index]
    group: TPGroup | None = getattr(st, "hpml_tp", None)
    if group is None:
        yield True
        return
    with whole_params(pipe.build, pipe.model, pipe.stage_index, changed=True, optimizer=pipe.optimizer):
        try:
            yield group.rank == 0
        finally:
            group.all_reduce(torch.zeros(1))  # the writer is done before anyone reads the folder


def open_tensor_parallel(build: Build, init_method: str | None, policy: RetryPolicy,
                         log: Callable[[str], None] | None) -> tuple[TensorParallelSession, Build]:
    """The session of a build with tensor-parallel stages, and the build as this rank's place runs it (its plan
    :func:`~hpml_compile.codegen.tensor_parallel.replica_plan`).

    Raises:
        HpmlError: no ``init_method`` and no torchrun environment (a tensor-parallel build runs on ranks), or
            see :class:`TensorParallelSession` and :func:`~hpml_compile.codegen.tensor_parallel.tp_degree`.
    """
    tp = tp_degree(build.plan)
    if init_method is None:
        raise HpmlError(f"the build's stages run tensor-parallel (tp={tp}) on ranks of their own: start "
                        f"{sum(len(st.devices) for st in build.plan.stages)} ranks (hpml-compile run --nproc N), "
                        "or compile with --max-tp 1 to run in one process")
    session = TensorParallelSession(tp, init_method, policy=policy, log=log)
    return session, replace(build, plan=replica_plan(build.plan, session.tp_index))


def shard_rank(build: Build, model: nn.Module, session: TensorParallelSession) -> int:
    """Slice the parameters of the stage this rank runs (after any weights are loaded whole); its index."""
    stage = next(k for k, rs in enumerate(stage_ranks(build.plan)) if session.rank in rs)
    shard_build(build, model, stage, TPGroup(session, session.tp_index, session.tp))  # its group after a re-form
    return stage
