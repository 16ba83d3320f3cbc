"""Running a build whose stages have ``tp > 1``: process groups, each rank's parameter slices, whole tensors back.

The ``N`` ranks of the job (one per device, the plan's device order) form
one default process group, and each replica of a stage with ``tp > 1`` a
tensor-parallel group of its ``tp`` consecutive ranks (a gloo group made on
the job's store outside the default group), which runs the collectives
inside the sharded layers (:mod:`hpml_compile.codegen.tpops`). A rank runs
the plan without tensor parallelism that its place in its group sees
(:func:`hpml_compile.codegen.tensor_parallel.replica_plan`): its schedule,
its boundaries (peers by :class:`~hpml_compile.codegen.tensor_parallel.Places`,
stages of different ``tp`` included), and gradient sync over the
data-parallel group of its place, as the plan prices it. The loss agreement
runs over the job, each group's loss counted once (place 0 adds it).

Each rank slices the parameters its stages list in ``TP_SHARDS`` in place
(the same parameter objects, so the stage module, the optimizer and the
gradient buffers see the slice; a rank of an interleaved plan holds several
stages of its device group's ``tp``, all sharded over its one group, whose
collectives run in the order of the rank's list, the same on every place);
:func:`whole_params` gathers them back to
whole tensors, so a checkpoint does not depend on ``tp`` (every rank takes
part in writing it; the whole tensors of a group are stored once).

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
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...codegen import Build
from ...codegen.tensor_parallel import Places, replica_plan, tp_degree
from ...codegen.tpops import TPGroup
from ...errors import HpmlError
from ...plan import Plan
from .chunks import held_stages
from .session import RetryPolicy, Session

__all__ = ["TensorParallelSession", "slice_param", "shard_build", "whole_params", "checkpoint_view", "open_tensor_parallel",
           "shard_rank"]


class TensorParallelSession(Session):
    """A :class:`~.session.Session` over every rank of a plan with tensor-parallel stages, and this rank's group.

    Attributes (after opening): ``rank`` and ``world_size`` are the job's (one rank per device of the plan);
    ``plan`` the job's plan and ``places`` its :class:`~hpml_compile.codegen.tensor_parallel.Places`;
    ``stage``, ``replica`` and ``tp_index`` this rank's stage, replica and place in its tensor-parallel group;
    ``tp`` that group's size; ``tp_group`` its process group (None where ``tp`` is 1).

    Args:
        plan: the job's plan (every stage with its ``tp``).
        init_method: ``env://`` or ``file:///path``.
        rank, world_size: this rank among all ``N`` (None: from the environment).
        policy: the retry policy.
        log: where retry notices go.

    Raises:
        HpmlError: a process group exists already (this runtime makes the tensor-parallel groups on the job's
            store), or the job does not have one rank per device of the plan.
    """

    def __init__(self, plan: Plan, init_method: str = "env://", rank: int | None = None,
                 world_size: int | None = None, policy: RetryPolicy = RetryPolicy(),
                 log: Callable[[str], None] | None = None) -> None:
        if dist.is_initialized():
            raise HpmlError("the plan has tensor-parallel stages, whose ranks need process groups this runtime "
                            "makes, but a process group exists already: let hpml_compile create it (give "
                            "init_method, or start the ranks with torchrun), without init_process_group before")
        self.plan = plan
        self.places = Places.of(plan)
        self.tp_group: Any = None
        super().__init__(init_method, rank, world_size, policy, log)

    def _open(self) -> None:
        if self.world_size != self.places.size:
            raise HpmlError(f"the job has {self.world_size} ranks, but the plan's stages hold {self.places.size} "
                            f"devices: start {self.places.size} ranks, one per device of the plan")
        super()._open()
        self.stage, self.replica, self.tp_index = self.places.locate(self.rank)
        self.tp = self.places.tps[self.stage]
        if self.tp > 1:
            timeout = datetime.timedelta(seconds=self.policy.timeout_s)
            store = dist.PrefixStore(f"hpml/gen{self.generation}/tp{self.stage}.{self.replica}/", self._store)
            self.tp_group = dist.ProcessGroupGloo(store, self.tp_index, self.tp, timeout)


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


def shard_build(build: Build, model: nn.Module, stage: int, group: TPGroup, done: set[int] | None = None) -> None:
    """Give stage ``stage`` of ``build`` its tensor-parallel group and slice the parameters it lists.

    Args:
        build: the build.
        model: the model its stages bind.
        stage: the stage.
        group: its tensor-parallel group.
        done: ids of parameters sliced already (another stage of the rank lists a tied one too), added to.
    """
    st = build.stages[stage]
    st.hpml_tp = group
    for region in st.REGIONS:  # a recompute region runs the sharded layers
        getattr(st, region).hpml_tp = group
    done = set() if done is None else done
    for name, dim in st.TP_SHARDS:
        p = model.get_parameter(name)
        if id(p) not in done:
            done.add(id(p))
            slice_param(p, dim, group.rank, group.size)


def _gather(group: TPGroup, t: Tensor, dim: int) -> Tensor:
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(group.size)]
    group.process_group().allgather([parts], [t]).wait()
    return torch.cat(parts, dim=dim)


@contextlib.contextmanager
def whole_params(build: Build, model: nn.Module, stage: int | Sequence[int], *, changed: bool = False,
                 optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """This rank's sliced parameters whole for the block (gathered over its tensor-parallel group; a no-op for
    stages without slices), sliced again after it: what reads or writes parameters outside a step (the state
    dict, checkpoints) sees the model as it is without tensor parallelism.

    A collective over the tensor-parallel group: every rank of it enters it.

    Args:
        build: the build (this rank's place, see :func:`open_tensor_parallel`).
        model: the model.
        stage: the stage this rank runs, or the stages it holds (an interleaved plan's chunks, in order).
        changed: the block writes the parameters (a load): each rank keeps its slice of what was written.
        optimizer: its per-parameter state shaped like a sliced parameter (Adam's moments) is made whole too,
            and what the block leaves shaped like the whole parameter is sliced after it.
    """
    params: list[tuple[nn.Parameter, int, TPGroup]] = []
    seen: set[int] = set()
    for k in [stage] if isinstance(stage, int) else stage:
        st = build.stages[k]
        group: TPGroup | None = st.hpml_tp
        if group is None or group.size == 1:
            continue
        for name, dim in st.TP_SHARDS:
            p = model.get_parameter(name)
            if id(p) not in seen:  # a parameter tied between two chunks of the rank: once
                seen.add(id(p))
                params.append((p, dim, group))
    if not params:
        yield
        return
    states = optimizer.state if optimizer is not None else {}
    mine = [(p.data, dict(states.get(p, {}))) for p, _, _ in params]
    for p, dim, group in params:
        sliced = p.shape
        p.data = _gather(group, p.data, dim)
        for k, v in states.get(p, {}).items():
            if isinstance(v, Tensor) and v.shape == sliced and v.dim():
                states[p][k] = _gather(group, v, dim)
    try:
        yield
    finally:
        states = optimizer.state if optimizer is not None else {}  # a load may have replaced the table
        for (p, dim, group), (data, state) in zip(params, mine):
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

    Every rank of the job takes part in a checkpoint (it is a collective over the job); the ranks of a
    tensor-parallel group hold the same whole tensors in the block, which the checkpoint stores once. A load
    keeps each rank's slice (``changed``). Without tensor-parallel stages: yields True.
    """
    held = sorted(pipe.stages)
    if all(getattr(pipe.build.stages[k], "hpml_tp", None) is None for k in held):
        yield True
        return
    with whole_params(pipe.build, pipe.model, held, changed=True, optimizer=pipe.optimizer):
        yield True


def open_tensor_parallel(build: Build, init_method: str | None, policy: RetryPolicy,
                         log: Callable[[str], None] | None) -> tuple[TensorParallelSession, Build]:
    """The session of a build with tensor-parallel stages, and the build as this rank runs it (its plan
    :func:`~hpml_compile.codegen.tensor_parallel.replica_plan` at this rank's place; the session keeps the
    whole plan's places).

    Raises:
        HpmlError: no ``init_method`` and no torchrun environment (a tensor-parallel build runs on ranks), or
            see :class:`TensorParallelSession` and :func:`~hpml_compile.codegen.tensor_parallel.tp_degree`.
    """
    tp = tp_degree(build.plan)
    if init_method is None:
        raise HpmlError(f"the build's stages run tensor-parallel (tp up to {tp}) on ranks of their own: start "
                        f"{sum(len(st.devices) for st in build.plan.stages)} ranks (hpml-compile run --nproc N), "
                        "or compile with --max-tp 1 to run in one process")
    session = TensorParallelSession(build.plan, init_method, policy=policy, log=log)
    return session, replace(build, plan=replica_plan(build.plan, session.tp_index))


def shard_rank(build: Build, model: nn.Module, session: TensorParallelSession) -> int:
    """Slice the parameters of the stages this rank runs (after any weights are loaded whole: an interleaved
    plan's chunks too, each of its device group's ``tp``, over the rank's one group); its first stage's index."""
    if session.tp > 1:
        group = TPGroup(session, session.tp_index, session.tp)  # after a re-form
        done: set[int] = set()
        for k in held_stages(build.plan, session.stage):
            shard_build(build, model, k, group, done)
    return session.stage
