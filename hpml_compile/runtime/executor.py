"""A minimal executor: one GPipe training step of a build, in one process or across gloo ranks.

GPipe (Huang et al., NeurIPS 2019): the batch is split along its first
dimension into the plan's ``M`` microbatches; every stage runs all its
forwards, then all its backwards; gradients accumulate over microbatches and
the stage's collectives (``sync_grads``) run once at the end. Replica ``r``
of a stage with ``d`` replicas runs slice ``r`` of ``d`` of every microbatch
(data parallelism inside the pipeline, as the solver models it); the loss of
a slice is scaled by ``1 / (M d)`` so that the gradients sum to the batch mean's.

- :func:`step_local`: every stage (and replica) in this process, chained in
  order; the generated ``ops.send``/``ops.recv`` hand tensors over through a
  mailbox (:class:`LocalComm`).
- :func:`step_rank`: this rank's stage (or replica) under torch.distributed;
  :class:`DistComm` sends with ``isend`` and receives with blocking ``recv``
  at the shapes the trace gave (gloo's ``batch_isend_irecv`` is avoided).
  Because no send ever blocks, and a stage only waits for earlier stages in
  forward and later stages in backward, no order of ranks can deadlock.
- :func:`launch`: start ``world_size`` processes with
  ``torch.multiprocessing.spawn`` and a ``file://`` rendezvous (no port).

Why our own and not torch.distributed.pipelining: its ``PipelineStage`` does
the point-to-point itself around a module, whereas codegen makes the
communication explicit nodes of each stage's graph (so a reader sees it);
this executor only calls the stages in schedule order and runs backward.
The full runtime (1F1B, monitoring, torchrun) builds on these pieces.

Example:
    >>> import tempfile, torch
    >>> from hpml_compile.trace import trace
    >>> from hpml_compile.plan import Plan, Stage
    >>> from hpml_compile.cluster import load_cluster
    >>> from hpml_compile.codegen import generate
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> x, y = torch.randn(4, 8), torch.randn(4, 1)
    >>> st = (Stage(0, ("cpu0",), ("input_1", "_0", "_1")), Stage(1, ("cpu1",), ("_2", "output")))
    >>> build = generate(trace(model, (x,)), Plan("seq", load_cluster("local-cpu-2"), "gpipe", 2, st),
    ...                  tempfile.mkdtemp())
    >>> result = step_local(build, (x,), y, torch.nn.functional.mse_loss)
    >>> expected = torch.nn.functional.mse_loss(model(x), y)
    >>> bool(torch.isclose(result.loss, expected))
    True
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..codegen import Build
from ..codegen.comm import Comm
from ..codegen.stage import StageModule
from ..errors import HpmlError
from ..hostmem import keep_freed_memory
from ..plan import Plan

__all__ = ["LocalComm", "DistComm", "StepResult", "stage_ranks", "rank_layout", "split_microbatches",
           "merge_outputs", "step_local", "step_rank", "dist_comm", "launch"]

_MAX_TENSORS = 4096  # tensors per boundary message, for unique point-to-point tags


def stage_ranks(plan: Plan) -> list[list[int]]:
    """The ranks of each stage: one rank per device, stages in order, replicas in device order."""
    out, r = [], 0
    for st in plan.stages:
        out.append(list(range(r, r + len(st.devices))))
        r += len(st.devices)
    return out


def rank_layout(plan: Plan) -> list[tuple[int, int]]:
    """``(stage, replica)`` of each rank."""
    return [(k, i) for k, ranks in enumerate(stage_ranks(plan)) for i, _ in enumerate(ranks)]


def split_microbatches(value: Any, microbatches: int) -> list[Any]:
    """Split every tensor in ``value`` along dim 0 into ``microbatches`` equal parts.

    Raises:
        HpmlError: if a tensor's first dimension does not divide evenly.
    """
    leaves, spec = tree_flatten(value)
    parts: list[list[Any]] = [[] for _ in range(microbatches)]
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            if leaf.dim() == 0 or leaf.shape[0] % microbatches:
                raise HpmlError(f"a batch of shape {tuple(leaf.shape)} does not split into {microbatches} equal "
                                "microbatches along its first dimension; use a batch divisible by it")
            chunks = leaf.tensor_split(microbatches, dim=0)
        else:
            chunks = [leaf] * microbatches
        for j in range(microbatches):
            parts[j].append(chunks[j])
    return [tree_unflatten(p, spec) for p in parts]


def merge_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate outputs of consecutive slices along dim 0 (tensors anywhere in a tuple/dict)."""
    flat = [tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    cols = zip(*(leaves for leaves, _ in flat))
    return tree_unflatten([torch.cat(c) if isinstance(c[0], Tensor) else c[0] for c in cols], spec)


class LocalComm(Comm):
    """Every stage and replica in one process: a message is a hand-off through a mailbox.

    Args:
        plan: the build's plan (replica counts, for resharding between stages).
    """

    def __init__(self, plan: Plan) -> None:
        super().__init__()
        self._reps = [len(st.devices) for st in plan.stages]
        self._box: dict[tuple[Any, ...], Tensor] = {}

    def replicas(self, stage: int) -> int:
        return self._reps[stage]

    def _put(self, frm: tuple[int, int], to: tuple[int, int], key: tuple[int, ...], tensor: Tensor) -> None:
        # A copy, as over a wire: the receiver must not share storage (or autograd history) with the sender.
        self._box[(frm, to, key)] = tensor.detach().clone()

    def _get(self, frm: tuple[int, int], to: tuple[int, int], key: tuple[int, ...], shape: tuple[int, ...],
             dtype: torch.dtype) -> Tensor:
        if (frm, to, key) not in self._box:
            raise RuntimeError(f"stage replica {to} expects message {key} from {frm}, which was never sent: "
                               "stages ran out of order")
        return self._box.pop((frm, to, key))

    def forget(self) -> None:
        """Drop undelivered messages and owed gradients (after an evaluation pass)."""
        self._box.clear()
        self._owed.clear()

    def all_reduce(self, stages: tuple[int, ...], flat: Tensor) -> None:
        pass  # one process holds every replica and every use of a tied parameter

    def reduce_scatter(self, stage: int, flat: Tensor) -> Tensor:
        return flat

    def all_gather(self, stage: int, shard: Tensor) -> Tensor:
        return shard


class DistComm(Comm):
    """One rank of a pipeline under torch.distributed (gloo on CPU).

    Args:
        plan: the build's plan (stage -> ranks).
        rank: this process's rank.
        groups: process group of each collective's stage set (None where one rank holds them all).
        device: where received tensors are created.
    """

    def __init__(self, plan: Plan, rank: int, groups: dict[tuple[int, ...], Any],
                 device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self.ranks = stage_ranks(plan)
        self.rank = rank
        self.stage, self.replica = rank_layout(plan)[rank]
        self.groups = groups
        self._pending: list[tuple[Any, Tensor]] = []

    def replicas(self, stage: int) -> int:
        return len(self.ranks[stage])

    def _tag(self, key: tuple[int, ...]) -> int:
        # key = (src, dst, direction, microbatch, tensor index): unique between two ranks within a step.
        src, _, direction, microbatch, i = key
        return ((microbatch * len(self.ranks) + src) * 2 + direction) * _MAX_TENSORS + i

    def _put(self, frm: tuple[int, int], to: tuple[int, int], key: tuple[int, ...], tensor: Tensor) -> None:
        # isend: a send never waits for its receiver (the tensor is kept alive until flush()).
        peer = self.ranks[to[0]][to[1]]
        self._pending.append((dist.isend(tensor, peer, tag=self._tag(key)), tensor))

    def _get(self, frm: tuple[int, int], to: tuple[int, int], key: tuple[int, ...], shape: tuple[int, ...],
             dtype: torch.dtype) -> Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, self.ranks[frm[0]][frm[1]], tag=self._tag(key))
        return t

    def group_size(self, stages: tuple[int, ...]) -> int:
        return len({r for k in stages for r in self.ranks[k]})

    def all_reduce(self, stages: tuple[int, ...], flat: Tensor) -> None:
        if self.groups.get(stages) is not None:
            dist.all_reduce(flat, group=self.groups[stages])

    def reduce_scatter(self, stage: int, flat: Tensor) -> Tensor:
        parts = list(flat.chunk(len(self.ranks[stage])))
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=self.groups[(stage,)])
        return out

    def all_gather(self, stage: int, shard: Tensor) -> Tensor:
        parts = [torch.empty_like(shard) for _ in self.ranks[stage]]
        dist.all_gather(parts, shard, group=self.groups[(stage,)])
        return torch.cat(parts)

    def flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def dist_comm(build: Build, device: torch.device | str = "cpu") -> DistComm:
    """This rank's communicator, with a process group per collective of the build.

    Every rank must call it (creating a group is collective), after
    ``dist.init_process_group`` with one rank per device of the plan.

    Raises:
        HpmlError: if the world size is not the plan's device count.
    """
    world, want = dist.get_world_size(), sum(len(st.devices) for st in build.plan.stages)
    if world != want:
        raise HpmlError(f"the build's plan runs on {want} devices (one rank each), but the world has {world} "
                        f"ranks: start {want} processes")
    ranks = stage_ranks(build.plan)
    groups: dict[tuple[int, ...], Any] = {}
    for stages in dict.fromkeys(build.manifest.groups()):  # the same order on every rank
        members = sorted({r for k in stages for r in ranks[k]})
        groups[stages] = dist.new_group(members) if len(members) > 1 else None
    return DistComm(build.plan, dist.get_rank(), groups, device)


@dataclass
class StepResult:
    """What one step returns on this process.

    Attributes:
        loss: the batch loss (mean over the batch) where this process ran the
            last stage: the sum of its slices' shares; else None.
        outputs: ``(microbatch, replica, model output)`` for each slice whose last stage ran here.
        swap_bytes: bytes swapped out to host memory by this process's stages.
    """

    loss: Tensor | None = None
    outputs: list[tuple[int, int, Any]] = field(default_factory=list)
    swap_bytes: int = 0


def _check_inputs(build: Build, micro: Sequence[Any]) -> None:
    tensors = [x for x in micro if isinstance(x, Tensor)]
    for spec, x in zip(build.manifest.inputs, tensors):
        if tuple(x.shape) != spec.shape:
            raise HpmlError(f"input {spec.name}: a microbatch has shape {tuple(x.shape)}, but the build was "
                            f"generated for {spec.shape} ({build.manifest.microbatches} microbatches): feed a "
                            f"batch of {spec.shape[0] * build.manifest.microbatches} rows or recompile")


def _forward(build: Build, stage: StageModule, micro: Sequence[Any]) -> Any:
    names = [s.name for s in build.manifest.inputs]
    by_name = dict(zip(names, [x for x in micro if isinstance(x, Tensor)]))
    return stage(*[by_name[n] for n in stage.INPUTS])


def _run(build: Build, stages: dict[int, StageModule], comm: Comm, inputs: Sequence[Any], targets: Any,
         loss_fn: Callable[[Any, Any], Tensor], replicas: Callable[[int], Sequence[int]]) -> StepResult:
    m, last = build.plan.microbatches, len(build.plan.stages) - 1
    reps = [len(st.devices) for st in build.plan.stages]
    micro_in = split_microbatches(tuple(inputs), m)
    micro_tg = split_microbatches(targets, m)
    _check_inputs(build, micro_in[0])
    # slices[k][j][r]: replica r's rows of microbatch j, for stage k's replica count
    slices_in = {d: [split_microbatches(x, d) for x in micro_in] for d in set(reps)}
    slices_tg = [split_microbatches(y, reps[last]) for y in micro_tg]
    result = StepResult()
    roots: dict[tuple[int, int, int], list[Tensor]] = {}
    for j in range(m):  # GPipe: every forward first
        for k, stage in sorted(stages.items()):
            for r in replicas(k):
                comm.microbatch, comm.replica = j, r
                out = _forward(build, stage, slices_in[reps[k]][j][r])
                if k == last:
                    loss = loss_fn(out, slices_tg[j][r]) / (m * reps[k])
                    result.outputs.append((j, r, tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out)))
                    result.loss = loss.detach() if result.loss is None else result.loss + loss.detach()
                    roots[(k, r, j)] = [loss]
                else:
                    roots[(k, r, j)] = [out] if isinstance(out, Tensor) and out.requires_grad else []
    for j in range(m):  # then every backward, later stages first
        for k in sorted(stages, reverse=True):
            for r in replicas(k):
                root = roots.pop((k, r, j))
                if root:
                    torch.autograd.backward(root)
                comm.settle(k, r, j)
    for _, stage in sorted(stages.items()):
        stage.sync_grads()
        result.swap_bytes += stage.hpml_swap.bytes_out
    comm.flush()
    return result


def _after_step(stages: dict[int, StageModule], optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is None:
        return
    optimizer.step()
    for stage in stages.values():
        stage.after_step()


def step_local(build: Build, inputs: Sequence[Any], targets: Any, loss_fn: Callable[[Any, Any], Tensor], *,
               optimizer: torch.optim.Optimizer | None = None) -> StepResult:
    """One training step with every stage and replica in this process, chained in order.

    Args:
        build: a loaded build.
        inputs: the model's positional inputs for the whole batch.
        targets: the targets for ``loss_fn`` (split like the inputs).
        loss_fn: ``(output, targets) -> loss``, a mean over the batch.
        optimizer: stepped after the gradients are complete (None: gradients only).

    Returns:
        The loss, the outputs of every slice and the swap traffic.
    """
    comm = LocalComm(build.plan)
    stages = dict(enumerate(build.stages))
    for stage in stages.values():
        stage.hpml_comm = comm
    reps = [len(st.devices) for st in build.plan.stages]
    result = _run(build, stages, comm, inputs, targets, loss_fn, lambda k: range(reps[k]))
    _after_step(stages, optimizer)
    return result


def step_rank(build: Build, comm: DistComm, inputs: Sequence[Any], targets: Any,
              loss_fn: Callable[[Any, Any], Tensor], *, optimizer: torch.optim.Optimizer | None = None) -> StepResult:
    """One training step of this rank's stage replica (every rank calls it with the same batch).

    Args:
        build: a loaded build.
        comm: this rank's communicator (:func:`dist_comm`).
        inputs: the model's positional inputs for the whole batch.
        targets: the targets for ``loss_fn``.
        loss_fn: ``(output, targets) -> loss``, a mean over the batch.
        optimizer: stepped after the gradient collectives (None: gradients only).

    Returns:
        This rank's share: the loss and outputs where it runs the last stage.
    """
    stage = build.stages[comm.stage]
    stage.hpml_comm = comm
    result = _run(build, {comm.stage: stage}, comm, inputs, targets, loss_fn, lambda k: (comm.replica,))
    _after_step({comm.stage: stage}, optimizer)
    return result


def _entry(rank: int, fn: Callable[..., None], world_size: int, init: str, threads: int, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(threads)  # ranks share the machine's cores
    keep_freed_memory()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., None], world_size: int, workdir: str | Path, *args: Any, threads: int = 1) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes on this machine.

    Args:
        fn: a module-level function (it is pickled to the children).
        world_size: number of ranks.
        workdir: a folder for the ``file://`` rendezvous (a fresh file in it; no port is opened).
        args: passed to ``fn`` after the rank and world size.
        threads: torch threads per rank.

    Raises:
        torch.multiprocessing.ProcessRaisedException: if a rank fails (with its traceback).
    """
    path = Path(workdir).resolve() / f"rendezvous-{os.getpid()}-{id(fn)}"
    path.unlink(missing_ok=True)
    mp.spawn(_entry, args=(fn, world_size, f"file://{path}", threads, args), nprocs=world_size, join=True)
