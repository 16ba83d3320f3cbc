"""One interface for the data-parallel sync of a stage on this rank, chosen once from the plan.

Every collective of a rank's action list names the stages whose ranks take
part and the implementation that runs it (``ALLREDUCE.shm(0)``,
``REDUCESCATTER.hier(1)``, ``ALLGATHER.zero3(1)``: the suffix is
:func:`hpml_compile.schedule.sync_impl` of the plan). The executor hands each
such token to the :class:`StageSync` of its stages (:meth:`StageSync.run`);
:func:`for_stage` builds the one of this rank's replicated stage, and
:class:`Unbuffered` runs every other (the gradients of parameters tied across
stages; a stage in one process; a runner without a pipeline).

- ``flat``, ``shm``, ``hier`` on a ZeRO-0 stage: :class:`DataParallel`, one flat
  gradient buffer all-reduced in place (:class:`~.zero.FlatGrads`), bucket by
  bucket during the last backward where the plan overlaps the sync;
- ``topk``, ``powersgd``, ``local``: :class:`Compressed`, the same buffer
  with a reducer (:mod:`.compress`): compressed gradients with error
  feedback, or local SGD (its ``ALLREDUCE.local(k)`` after ``OPTk`` averages
  the replicas' parameters every few steps);
- ``flat``, ``shm``, ``hier`` on a ZeRO-1/2 stage: :class:`Sharded`,
  reduce-scatter into this replica's shard, the parameters all-gathered after
  the step (:class:`~.zero.FlatShard`);
- ``zero3``: :class:`Sharded3`, the shard's parameters gathered around the
  compute (:class:`~.zero3.FlatShard3`);
- any, over the stages of a tied parameter or where no buffer was made:
  :class:`Unbuffered`, the gradients flattened, summed, written back;
- a rank holding several stages (an interleaved plan): :class:`Several`, one of the above per stage.

Where the plan names a reduce dtype (``bf16``, ``fp16``), the gradient collectives of ``DataParallel``,
``Sharded`` and ``Sharded3`` run on a copy of each bucket in it, cast back after (:mod:`.reducecast`);
``Unbuffered`` sums in the gradients' own dtype, and ``Compressed`` is refused with one by the plan.

The transport of ``flat``, ``shm`` and ``hier`` (a ring over the group,
shared memory between the CPU ranks of one host, or the three-level
hierarchical chain) is the communicator's
(:meth:`~.comm.DistComm.all_reduce`), which reads the same facts of the plan.

A new implementation: one class here (listed in the table), one member of
:class:`~hpml_compile.schedule.SyncImpl` (its token suffix), one cost
function in :mod:`hpml_compile.stagecost`.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ...codegen.comm import Comm
from ...errors import HpmlError
from ...memory import FIRST_BUCKET_BYTES, ZeroStage
from ...plan import Plan
from ...schedule import Action, ActionKind, SyncImpl, sync_impl
from .compress import Reducer, make_reducer
from .feedback import CommState, Feedback, Replica
from .reducecast import reduce_dtype
from .zero import FlatGrads, FlatShard
from .zero3 import FlatShard3

__all__ = ["StageSync", "Unbuffered", "Several", "DataParallel", "Compressed", "Sharded", "Sharded3", "for_stage",
           "UNBUFFERED"]


class StageSync:
    """The collectives of one group of stages on this rank, and the hooks a step calls around them.

    Attributes:
        stages: the stages whose ranks take part (``(k,)``: stage ``k``'s replicas).
        impl: the implementation (the token suffix it runs); None for :class:`Unbuffered`, which runs any.
        buffer: the flat buffer the collectives run on (:class:`~.zero.FlatGrads`, :class:`~.zero.FlatShard`), or
            None.
    """

    impl: SyncImpl | None = None
    buffer: Any = None

    def __init__(self, stages: tuple[int, ...]) -> None:
        self.stages = stages

    @property
    def parts(self) -> list["StageSync"]:
        """The syncs this one runs, each of one group of stages (itself; :class:`Several`'s members)."""
        return [self]

    def run(self, action: Action, comm: Comm, params: Sequence[Tensor], *, stepped: bool = False) -> None:
        """Carry out one collective token of this group: after the optimizer step (``stepped``; an ``ALLGATHER``
        always is) the parameter collective, else the gradient collective (``ALLREDUCE`` or ``REDUCESCATTER``)
        after the last backward."""
        if not params or comm.group_size(self.stages) == 1:
            return  # one process holds every use: autograd summed the gradients already
        if stepped or action.kind is ActionKind.ALL_GATHER:
            self.gather(comm, params)
        else:
            self.reduce(comm, params)

    def reduce(self, comm: Comm, params: Sequence[Tensor]) -> None:
        """The gradient collective: every replica (or its shard) holds the summed gradients after it."""
        raise NotImplementedError

    def token_params(self, resolve: Callable[[], Sequence[Tensor]]) -> Sequence[Tensor]:
        """The parameter list a collective token of this group hands :meth:`run`: ``resolve()``, the stage code's
        list resolved by name. A sync with a buffer reads that list only to check it against its buffer once
        (:meth:`.zero.FlatShard.check`); after that it gives its buffer's own (the same parameters), so the names
        are not resolved every step (a hundred of them were 0.1 ms of the small-op MLP's step on two busy ranks)."""
        return resolve()

    def gather(self, comm: Comm, params: Sequence[Tensor]) -> None:
        """The parameter collective after the optimizer step (ZeRO's all-gather, local SGD's average every few
        steps); nothing where the parameters agree already."""

    def begin_step(self, step: int) -> None:
        """Before the step's first forward (``step``: the steps done so far)."""

    def pointed(self) -> Sequence[nn.Parameter]:
        """The parameters whose ``.grad`` :meth:`begin_step` points at a zeroed buffer (a step need not clear them
        first)."""
        return ()

    def arm(self) -> None:
        """Just before the stage's last backward of the step: overlapped buckets launch as they become ready."""

    def bind(self, comm: Any) -> None:
        """Run the collectives on ``comm`` (a new communicator after the process group was re-formed)."""

    def release(self) -> None:
        """Let go of the process groups held here, so that destroying them closes their connections."""

    @property
    def shards(self) -> list[FlatShard]:
        """The ZeRO shards the optimizer steps ([] where none)."""
        return []

    def state(self, module: nn.Module, replica: int) -> list[CommState]:
        """What a checkpoint keeps of the sync (error feedback, local SGD's replica); ``module``'s names."""
        return []

    def sync_bytes(self, *, dense: bool) -> int:
        """Payload put into the gradient sync this step (``dense``: uncompressed, every step)."""
        return 0

    def gathered_bytes(self) -> int:
        """Bytes of parameters gathered whole and held at the moment (ZeRO-3)."""
        return 0

    @contextlib.contextmanager
    def whole(self, *, changed: bool = False) -> Iterator[None]:
        """The parameters whole for the block (ZeRO-3 gathers them; a no-op elsewhere)."""
        with contextlib.ExitStack() as stack:
            for s in self.shards:
                stack.enter_context(s.whole(changed=changed))
            yield

    def settle(self) -> None:
        """Wait for prefetched parameter gathers."""
        for s in self.shards:
            s.settle()

    def forget(self) -> None:
        """Drop collectives in flight on failed groups (they are run again)."""
        for s in self.shards:
            s.forget()


class Unbuffered(StageSync):
    """Any collective without a buffer of its own: the gradients flattened into one tensor, summed over every rank
    of the stages, written back; a reduce-scatter without a shard (no optimizer state to shard) sums them whole;
    an all-gather has nothing to do (every replica stepped the same summed gradients)."""

    def __init__(self) -> None:
        super().__init__(())

    def run(self, action: Action, comm: Comm, params: Sequence[Tensor], *, stepped: bool = False) -> None:
        if params and comm.group_size(action.stages) > 1 and not stepped and action.kind is not ActionKind.ALL_GATHER:
            flat = _flat_grads(params)
            comm.all_reduce(action.stages, flat)
            _write_grads(params, flat)


UNBUFFERED = Unbuffered()


class Several(StageSync):
    """The syncs of the stages one rank holds under an interleaved plan (one per replicated stage: its own buffer
    or shard, on its own group's ranks), as one: the executor hands each token to its stage's part
    (:attr:`parts`), and the step's hooks go to every part.

    Why not one buffer over every stage of the rank: each stage's gradients are complete after its own last
    backward, at a different point of the step, and a checkpoint names each stage's parameters alike under any
    plan; one sync per stage keeps both as a plain plan has them.
    """

    def __init__(self, parts: Sequence[StageSync]) -> None:
        super().__init__(())
        self._parts = list(parts)

    @property
    def parts(self) -> list[StageSync]:
        return list(self._parts)

    def run(self, action: Action, comm: Comm, params: Sequence[Tensor], *, stepped: bool = False) -> None:
        part = next((s for s in self._parts if s.stages == action.stages), UNBUFFERED)
        part.run(action, comm, params, stepped=stepped)

    def begin_step(self, step: int) -> None:
        for s in self._parts:
            s.begin_step(step)

    def pointed(self) -> Sequence[nn.Parameter]:
        return [p for s in self._parts for p in s.pointed()]

    def arm(self) -> None:
        for s in self._parts:
            s.arm()

    def bind(self, comm: Any) -> None:
        for s in self._parts:
            s.bind(comm)

    def release(self) -> None:
        for s in self._parts:
            s.release()

    @property
    def shards(self) -> list[FlatShard]:
        return [sh for s in self._parts for sh in s.shards]

    def state(self, module: nn.Module, replica: int) -> list[CommState]:
        return [c for s in self._parts for c in s.state(module, replica)]

    def sync_bytes(self, *, dense: bool) -> int:
        return sum(s.sync_bytes(dense=dense) for s in self._parts)

    def gathered_bytes(self) -> int:
        return sum(s.gathered_bytes() for s in self._parts)


class DataParallel(StageSync):
    """ZeRO-0 over a stage's replicas: one flat gradient buffer, all-reduced in place (:class:`~.zero.FlatGrads`)."""

    def __init__(self, buffer: FlatGrads, impl: SyncImpl) -> None:
        super().__init__((buffer.stage,))
        self.buffer, self.impl = buffer, impl

    def reduce(self, comm: Comm, params: Sequence[Tensor]) -> None:
        self.buffer.check(params)  # type: ignore[misc]  # FlatShard.check, shared by FlatGrads
        self.buffer.all_reduce(comm)

    def token_params(self, resolve: Callable[[], Sequence[Tensor]]) -> Sequence[Tensor]:
        return self.buffer.params if self.buffer.checked else resolve()

    def begin_step(self, step: int) -> None:
        self.buffer.begin_step()  # gradients accumulate into the flat buffer the collective reads

    def pointed(self) -> Sequence[nn.Parameter]:
        return self.buffer.params

    def arm(self) -> None:
        if self.buffer.buckets is not None:
            self.buffer.buckets.arm()

    def bind(self, comm: Any) -> None:
        self.buffer.comm = comm

    def sync_bytes(self, *, dense: bool) -> int:
        return self.buffer.grad_flat.numel() * _wire_size(self.buffer, self.buffer.grad_flat)


class Compressed(DataParallel):
    """ZeRO-0 with a reducer (:mod:`.compress`): top-k or PowerSGD with error feedback, or local SGD; never
    overlapped (the cost model prices them after the backward)."""

    def __init__(self, buffer: FlatGrads, impl: SyncImpl, reducer: Reducer) -> None:
        super().__init__(buffer, impl)
        self.reducer = buffer.reducer = reducer

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self.reducer.begin_step(step)

    def gather(self, comm: Comm, params: Sequence[Tensor]) -> None:
        self.reducer.after_step(self.buffer.params)  # local SGD: the replicas' parameters averaged, every H steps

    def bind(self, comm: Any) -> None:
        super().bind(comm)
        self.reducer.rebind(comm.groups.get(self.stages))  # PowerSGD's state and local SGD hold the group

    def state(self, module: nn.Module, replica: int) -> list[CommState]:
        names: dict[int, str] = {}
        for name, p in module.named_parameters():
            names.setdefault(id(p), name)
        red, b = self.reducer, self.buffer
        if red.keeps_error:
            return [Feedback(red, [names[id(p)] for p in b.params], [p.numel() for p in b.params], replica,
                             b.grad_flat.device)]
        return [Replica(replica, red.replicas)] if red.diverges else []

    def sync_bytes(self, *, dense: bool) -> int:
        nbytes = super().sync_bytes(dense=dense)
        return (self.reducer.dense if dense else self.reducer.sent) or (nbytes if dense else 0)


class Sharded(StageSync):
    """ZeRO-1/2: reduce-scatter into this replica's shard, the optimizer over it, all-gather after the step
    (:class:`~.zero.FlatShard`; under ``hier`` sharded over the ranks of each host)."""

    def __init__(self, shard: FlatShard, impl: SyncImpl) -> None:
        super().__init__((shard.stage,))
        self.shard = self.buffer = shard
        self.impl = impl

    def reduce(self, comm: Comm, params: Sequence[Tensor]) -> None:
        self.shard.check(params)
        self.shard.reduce_scatter(comm)

    def token_params(self, resolve: Callable[[], Sequence[Tensor]]) -> Sequence[Tensor]:
        return self.shard.params if self.shard.checked else resolve()

    def gather(self, comm: Comm, params: Sequence[Tensor]) -> None:
        self.shard.all_gather(comm)

    def begin_step(self, step: int) -> None:
        self.shard.begin_step()

    def arm(self) -> None:
        if self.shard.buckets is not None:
            self.shard.buckets.arm()

    def bind(self, comm: Any) -> None:
        self.shard.comm = comm
        if self.impl is SyncImpl.HIER:  # the new sub-groups
            self.shard.hier = comm.hierarchy[self.stages]

    def release(self) -> None:
        if self.shard.hier is not None:
            self.shard.hier = _without_groups(self.shard.hier)

    @property
    def shards(self) -> list[FlatShard]:
        return [self.shard]

    def sync_bytes(self, *, dense: bool) -> int:
        return self.shard.flat.numel() * _wire_size(self.shard, self.shard.flat)


class Sharded3(Sharded):
    """ZeRO-3: the parameters sharded between uses too, gathered whole around the stage's compute
    (:class:`~.zero3.FlatShard3`)."""

    shard: FlatShard3

    def gathered_bytes(self) -> int:
        return self.shard.gathered_bytes if self.shard.gathers else 0


def _wire_size(buffer: Any, flat: Tensor) -> int:
    """Bytes per element the buffer's gradient collective puts on the wire (its reduce dtype's, where cast)."""
    return flat.element_size() if buffer.wire is None else torch.empty(0, dtype=buffer.wire).element_size()


def _without_groups(hier: Any) -> Any:
    return replace(hier, intra=None, inter=None)


def for_stage(plan: Plan, stage: int, comm: Any, params: list[nn.Parameter], module: nn.Module, *, replica: int,
              sharded: bool, overlap: bool, bucket_bytes: int) -> StageSync | None:
    """The sync of this rank's replicated ``stage``, as the plan names it (:func:`~hpml_compile.schedule.sync_impl`).

    Args:
        plan: the running plan.
        stage: this rank's stage.
        comm: this rank's communicator (its groups; its sub-groups under ``hier``).
        params: the stage's parameters not tied to another stage, in the same order on every replica.
        module: the stage module (ZeRO-3 gathers around its forward and backward; ZeRO-1/2 prefetch under it).
        replica: this rank's replica of the stage.
        sharded: whether ZeRO-1/2/3 may shard the optimizer (an optimizer factory was given); without, every
            replica keeps the summed gradients.
        overlap: launch the gradient buckets during the last backward (the plan's rule unless forced).
        bucket_bytes: the size of an overlapped bucket after the first.

    Returns:
        The stage's sync, or None where the stage has one replica or no parameters of its own.

    Raises:
        HpmlError: ZeRO-3 with optimizer offload, which the runtime does not combine.
    """
    st = plan.stages[stage]
    replicas = len(st.devices)
    if replicas == 1 or not params:
        return None
    impl = sync_impl(plan, (stage,))
    grouped = comm.groups.get((stage,)) is not None
    first = min(FIRST_BUCKET_BYTES, bucket_bytes)
    if st.zero == ZeroStage.NONE or not sharded:
        buffer = FlatGrads(stage, params)
        buffer.comm = comm
        reducer = make_reducer(plan, stage, comm.groups.get((stage,)))  # compression, local SGD
        if reducer is not None:  # its own payload: a plan refuses a reduce dtype with it (check_reduce_dtype)
            return Compressed(buffer, impl, reducer)
        buffer.wire = reduce_dtype(plan.reduce_dtype, buffer.grad_flat.dtype)  # .reducecast
        if overlap and grouped:
            buffer.enable_overlap(first, bucket_bytes)
        return DataParallel(buffer, impl)
    if impl is SyncImpl.ZERO3:  # parameters sharded too, gathered around the stage's compute
        if st.offload_optimizer:
            raise HpmlError(f"stage {stage} asks for ZeRO-3 with optimizer offload, which the runtime does not "
                            "combine: use ZeRO-3 or offload (ZeRO-1 with offload)")
        shard3 = FlatShard3(stage, params, replicas=replicas, replica=replica)
        shard3.attach(module)
        shard3.comm = comm
        shard3.wire = reduce_dtype(plan.reduce_dtype, shard3.flat.dtype)
        return Sharded3(shard3, impl)
    if impl is SyncImpl.HIER:  # ZeRO-1 over the ranks of each host (HSDP-like)
        hier = comm.hierarchy[(stage,)]
        shard = FlatShard(stage, params, replicas=hier.per_host, replica=hier.local, zero=st.zero, hier=hier)
    else:
        shard = FlatShard(stage, params, replicas=replicas, replica=replica, zero=st.zero)
    shard.comm = comm
    shard.wire = reduce_dtype(plan.reduce_dtype, shard.flat.dtype)
    if overlap and grouped:
        shard.enable_overlap(first, bucket_bytes)
        if shard.buckets is not None:  # ZeRO-1/2 (not 3): the parameter all-gather under the next forward
            shard.enable_prefetch(module)
    return Sharded(shard, impl)


_BUFFERS: dict[tuple[int, ...], Tensor] = {}


def _grad_buffer(params: Sequence[Tensor]) -> Tensor:
    """One flat buffer per parameter list, kept across steps.

    A new buffer each step costs more than the copy into it: on a CPU rank the
    first touch of fresh pages ran at ~1.6 GB/s against ~10 GB/s for a copy into
    memory already mapped (33.6 MB of mlp gradients: 20.5 ms against 3.5 ms).
    """
    key = tuple(id(p) for p in params)
    n = sum(p.numel() for p in params)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() != n or buf.dtype != params[0].dtype or buf.device != params[0].device:
        if key not in _BUFFERS:  # forget it with the parameters
            weakref.finalize(params[0], _BUFFERS.pop, key, None)
        buf = _BUFFERS[key] = torch.empty(n, dtype=params[0].dtype, device=params[0].device)
    return buf


def _flat_grads(params: Sequence[Tensor]) -> Tensor:
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    if len({t.dtype for t in parts}) > 1:
        return torch.cat(parts)
    return torch.cat(parts, out=_grad_buffer(params))


def _write_grads(params: Sequence[Tensor], flat: Tensor) -> None:
    # Copy into the gradient that is there (no allocation). A parameter without one gets its own copy:
    # a view would alias the buffer the next step packs into. Cloning every slice cost more than the
    # all-reduce itself on CPU ranks (benchmarks/prediction).
    offset = 0
    for p in params:
        n = p.numel()
        part = flat[offset:offset + n].view_as(p)
        if p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == flat.dtype:
            p.grad.copy_(part)
        else:
            p.grad = part.clone()
        offset += n
