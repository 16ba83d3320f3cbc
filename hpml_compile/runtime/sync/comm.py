"""The runtime's communicators: a mailbox in one process, or torch.distributed with a backend per pair of devices.

What the generated stages ask for (``ops.send``/``ops.recv``, gradient
collectives) goes through a :class:`~hpml_compile.codegen.comm.Comm`:
:class:`LocalComm` when every stage runs in this process (a message is a
copy handed over through a mailbox; collectives have nothing to do), else
:class:`DistComm`, over torch.distributed:

- **Backend per pair** (:func:`pair_backend`): NCCL between two GPUs (a
  two-rank NCCL group per adjacent GPU pair), gloo wherever a CPU is
  involved (the default group). A GPU rank talking to a CPU rank stages the
  tensor through host memory: ``.cpu()`` before a gloo send, ``.to(cuda)``
  after a gloo receive. A collective's group is NCCL when every member is a
  GPU, gloo otherwise (GPU tensors staged the same way).
- **Sends never block** (``isend``, kept alive until :meth:`DistComm.flush` at
  the end of the step); receives block. :func:`hpml_compile.schedule_check.validate`
  replays each build's action lists under exactly these rules before a step
  runs, so an order that could deadlock is refused. The executor posts a gloo
  receive ahead of its token where it can (:meth:`DistComm.expect`,
  :mod:`..execute.ahead`); the token then waits for it.
- **Asynchronous collectives** (:meth:`DistComm.all_reduce_async`,
  :meth:`DistComm.reduce_scatter_async`): launched with ``async_op=True`` on
  the stage's group while the backward still runs (the overlapped gradient
  buckets of :mod:`.zero`) and waited for by :meth:`PendingCollective.wait`,
  which counts only the time spent waiting (what the overlap leaves exposed).
  A GPU tensor in a gloo group is staged through a host copy, copied back on
  the wait.
- **Hierarchical all-reduce** (:mod:`.hierarchy`): a stage whose plan says
  ``allreduce: hierarchical`` sums its gradients in three collectives on
  sub-groups (inside each host, between hosts), blocking after the backward
  or bucket by bucket during it; under ZeRO-1 its reduce-scatter is the first
  two levels and its all-gather the third, on the host's ranks.
- **Timings** (:class:`CommStats`): seconds blocked in each receive, in
  collectives and in posting sends, and bytes moved; the monitor splits a
  receive's wait into transfer and idle.
- **Transient errors** (:func:`is_transient`): a dropped or reset
  connection, a gloo pair closed by a peer, a network or store time-out.
  gloo cannot retry an operation in place (a timed-out wait closes the pair:
  ``RuntimeError: Application timeout caused pair closure``), so the retry is
  one level up: the pipeline tears the process group down, builds a new one
  on the same store and re-runs the step (:mod:`.session`).

Example:
    >>> import torch
    >>> pair_backend(torch.device("cuda", 0), torch.device("cuda", 1)).value
    'nccl'
    >>> pair_backend(torch.device("cuda", 0), torch.device("cpu")).value
    'gloo'
    >>> is_transient(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4321"))
    True
    >>> is_transient(ValueError("bad shape"))
    False
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ...codegen import Build
from ...codegen.comm import Comm, Direction, TensorSpec
from ...codegen.tensor_parallel import Places
from ...errors import HpmlError
from ...memory import RIDE_IN_BYTES
from ...plan import Plan
from ...schedule import rank_layout
from .hierarchy import (ChainQueue, HierGroups, PendingChain, hierarchical_all_gather, hierarchical_all_reduce,
                        hierarchical_gather_into, hierarchical_levels, hierarchical_reduce_scatter, level_bytes,
                        make_hierarchy)
from .shm import DIRECT_BYTES, SLOT_BYTES, HostReduce

__all__ = ["Backend", "CommOp", "CommStats", "Rider", "PendingCollective", "CommFault", "InjectedFault", "LocalComm", "DistComm",
           "dist_comm", "pair_backend", "rank_devices", "is_transient", "make_groups", "HierGroups", "make_hierarchy",
           "hierarchical_all_reduce", "hierarchical_levels", "PendingChain", "ChainQueue", "level_bytes"]

_MAX_TENSORS = 4096  # tensors per boundary message, for unique point-to-point tags
# Substrings of the messages gloo/NCCL/the store give for a broken or timed-out link (not for a bug).
_TRANSIENT_TEXT = ("Connection closed by peer", "Connection reset", "Connection refused", "Broken pipe",
                   "pair closure", "Timed out", "timed out", "Socket Timeout", "NCCL communicator was aborted",
                   "remote process exited")


class Backend(str, enum.Enum):
    """A torch.distributed backend."""

    GLOO = "gloo"
    NCCL = "nccl"


class CommOp(str, enum.Enum):
    """A communication operation of a rank, for fault injection and error messages."""

    SEND = "send"
    RECV = "recv"
    COLLECTIVE = "collective"
    AGREE = "agree"  # the loss agreement: index 0 fails before this rank's share goes out, 1 after it came back


class InjectedFault(ConnectionError):
    """A communication failure injected on purpose (tests, fault drills); always transient."""


@dataclass(frozen=True, slots=True)
class CommFault:
    """Fail one operation once: the ``index``-th operation of kind ``op`` on ``rank`` in step ``step`` (from 0)."""

    step: int
    rank: int
    op: CommOp = CommOp.RECV
    index: int = 0


@dataclass
class CommStats:
    """Communication of one rank in one step.

    Attributes:
        recv_s: ``(direction, seconds blocked)`` of each receive.
        send_s: seconds spent posting sends (and staging them to the host).
        collective_s: seconds in gradient collectives (all-reduce, reduce-scatter, all-gather), from the
            moment the last member arrived.
        collective_wait_s: seconds waiting at a collective for the other members to arrive (pipeline skew).
        bytes_sent: bytes handed to sends.
        bytes_received: bytes received.
        intra_bytes, inter_bytes: what this rank's hierarchical all-reduces sent inside its host and between hosts
            (:func:`level_bytes`, from the sizes of the collectives it ran).
        flat_bytes: what flat rings of the same all-reduces would have sent.
        early_received: received tensors whose receive was posted ahead of its token (:meth:`DistComm.expect`).
    """

    recv_s: list[tuple[Direction, float]] = field(default_factory=list)
    send_s: float = 0.0
    collective_s: float = 0.0
    collective_wait_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    intra_bytes: int = 0
    inter_bytes: int = 0
    flat_bytes: int = 0
    early_received: int = 0

    def reset(self) -> None:
        self.recv_s.clear()
        self.send_s = self.collective_s = self.collective_wait_s = 0.0
        self.bytes_sent = self.bytes_received = self.intra_bytes = self.inter_bytes = self.flat_bytes = 0
        self.early_received = 0


@dataclass
class Rider:
    """A float64 SUM all-reduce over the ranks of ``stages`` that rides the next collective of those stages as its
    meeting (:meth:`DistComm._collective`), so that the ranks meet once for both.

    The loss agreement of a plan whose one stage spans every rank (:mod:`..execute.batchcheck`) travels so with the
    gradient collective: issued with it, it is complete when the collective is, and it cannot complete on any rank
    before every rank has offered its gradients (the meeting is the sum of every rank's share). Where the
    gradients are small and go through gloo, the vector and the gradients are one float64 all-reduce
    (:meth:`DistComm._ride_in`), with the same guarantees.

    Attributes:
        stages: the stages of the collective it rides.
        vector: summed in place over the ranks once ``carried``.
        carried: the vector was summed (its collective's meeting returned).
    """

    stages: tuple[int, ...]
    vector: Tensor
    carried: bool = False


@dataclass
class PendingCollective:
    """A collective launched asynchronously: :meth:`wait` blocks until it is done and puts the result in place.

    Attributes:
        work: the torch.distributed work handle.
        wire: the tensor the collective writes (a host copy where a GPU tensor crosses a gloo group).
        out: where the result must end up (``wire`` itself, or the GPU tensor it was staged from).
        stats: the communicator's counters (the wait is added to ``collective_s``).
        name: the event name (``ALLREDUCE``, ``REDUCESCATTER``).
        start: ``perf_counter`` at the launch.
        nbytes: bytes the collective reduces.
        group_size: ranks in the group.
        stage: the stage, for the event log.
        events: the event log (None: none).
        device: this rank's device, synchronised after an NCCL collective for the timings.
    """

    work: Any
    wire: Tensor
    out: Tensor
    stats: CommStats
    name: str
    start: float
    nbytes: int
    group_size: int
    stage: int
    events: Any = None
    device: torch.device = torch.device("cpu")
    done: bool = False

    started = True  # launched at once (a :class:`PendingChain` may wait for the buckets before it)
    issued = 1  # one collective (a :class:`PendingChain` has a level each)

    def poll(self) -> None:
        """Nothing to advance: the one collective runs on its own."""

    def wait(self) -> None:
        """Block until the collective is done; its result is then in :attr:`out`."""
        if self.done:
            return
        t0 = time.perf_counter()
        self.work.wait()
        if self.wire is not self.out:
            self.out.copy_(self.wire)  # a GPU tensor staged through the host for gloo
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        t1 = time.perf_counter()
        self.done = True
        self.stats.collective_s += t1 - t0
        if self.events is not None:  # from the launch: the time it was in flight, overlapped or not
            self.events.add(self.name, self.start, t1, self.stage, -1, self.group_size, self.nbytes)


def pair_backend(a: torch.device, b: torch.device) -> Backend:
    """NCCL between two CUDA devices, gloo wherever a CPU is involved."""
    return Backend.NCCL if a.type == "cuda" and b.type == "cuda" else Backend.GLOO


def rank_devices(plan: Plan, local_gpu_count: int | None = None) -> list[torch.device]:
    """The torch device of every rank: CPU for a ``cpu`` device, else the next CUDA index on its host.

    A GPU device is ``cuda:i`` where ``i`` counts the GPU devices listed
    before it on the same host (so ``gpu0, gpu1, cpu0`` gives ``cuda:0,
    cuda:1, cpu``).

    Args:
        plan: the plan (its cluster says each device's kind and host).
        local_gpu_count: CUDA devices on this host, to wrap indices (None: no wrapping).
    """
    seen: dict[str, int] = {}
    index: dict[str, torch.device] = {}
    for d in plan.cluster.devices:
        if d.is_cpu:
            index[d.name] = torch.device("cpu")
            continue
        i = seen.get(d.host, 0)
        seen[d.host] = i + 1
        index[d.name] = torch.device("cuda", i % local_gpu_count if local_gpu_count else i)
    return [index[plan.stages[k].devices[r]] for k, r in rank_layout(plan)]


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a communication failure worth a retry (a broken link, not a bug)."""
    if isinstance(exc, (InjectedFault, ConnectionError, TimeoutError)):
        return True
    net = tuple(t for t in (getattr(dist, "DistNetworkError", None), getattr(dist, "DistStoreError", None))
                if isinstance(t, type))
    if net and isinstance(exc, net):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _TRANSIENT_TEXT)


def make_groups(plan: Plan, devices: list[torch.device], collectives: list[tuple[int, ...]],
                timeout: timedelta | None = None, places: Places | None = None
                ) -> tuple[dict[tuple[int, int], Any], dict[tuple[int, ...], Any]]:
    """Process groups for NCCL pairs and for each collective's stage set.

    Every rank must call it in the same order (creating a group is collective).

    Args:
        plan: the plan (the one this rank runs: a stage's replicas, without tensor parallelism).
        devices: every job rank's device (:func:`rank_devices` of the job's plan).
        collectives: the stage sets of the build's collectives, in manifest order.
        timeout: the time-out of every operation on these groups: the session's (a new group does not take the
            default group's, but torch's default, 30 minutes, so an operation left pending on a failed group, a
            prefetched parameter gather, say, would hold the group's teardown that long); None: torch's default.
        places: where the job's tensor-parallel stages run (None: no stage has ``tp > 1``). A collective's group
            is then made once per place of the groups (the ranks at one place sum the same slices), and this
            rank keeps the one it is in.

    Returns:
        ``(pairs, groups)``: a 2-rank NCCL group per adjacent GPU pair
        ``(lower rank, higher rank)``; and per stage set its group (None where one rank holds them all; the
        stages of one device group of an interleaved plan share it).
    """
    places = places if places is not None else Places.of(plan)
    every = [[places.rank(k, r, j) for r in range(n) for j in range(places.tps[k])]
             for k, n in enumerate(places.replicas)]
    me = dist.get_rank() if dist.is_initialized() else 0
    pairs: dict[tuple[int, int], Any] = {}
    for k in range(len(every) - 1):  # interleaved: the chunks' boundaries repeat pairs, and wrap back to rank 0's
        for a in every[k]:
            for b in every[k + 1]:
                key = (min(a, b), max(a, b))
                if a != b and key not in pairs and pair_backend(devices[a], devices[b]) is Backend.NCCL:
                    pairs[key] = dist.new_group(list(key), backend=Backend.NCCL.value, timeout=timeout)
    groups: dict[tuple[int, ...], Any] = {}
    made: dict[tuple[int, ...], Any] = {}
    for stages in dict.fromkeys(collectives):
        groups[stages] = None
        for place in range(places.count):  # every rank makes every place's group, in one order
            table = places.table(place)
            members = tuple(sorted({r for k in stages for r in table[k]}))
            if len(members) > 1 and members not in made:
                nccl = all(devices[r].type == "cuda" for r in members)
                made[members] = dist.new_group(list(members), backend=(Backend.NCCL if nccl else Backend.GLOO).value,
                                               timeout=timeout)
            if me in members:
                groups[stages] = made.get(members)
    return pairs, groups


class LocalComm(Comm):
    """Every stage and replica in one process: a message is a hand-off through a mailbox.

    Args:
        plan: the build's plan (replica counts, for resharding between stages).
    """

    def __init__(self, plan: Plan) -> None:
        super().__init__()
        self._reps = [len(st.devices) for st in plan.stages]
        self.rows = [st.rows for st in plan.stages]
        self._box: dict[tuple[Any, ...], Tensor] = {}
        self.stats = CommStats()  # stays empty: nothing here waits or crosses a wire

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
        """Drop undelivered messages, owed gradients and the mailbox (after an evaluation pass)."""
        self._box.clear()
        self._owed.clear()
        self.mail.clear()

    def all_reduce(self, stages: tuple[int, ...], flat: Tensor) -> None:
        pass  # one process holds every replica and every use of a tied parameter

    def reduce_scatter(self, stage: int, flat: Tensor) -> Tensor:
        return flat

    def all_gather(self, stage: int, shard: Tensor, into: Tensor | None = None) -> Tensor:
        return shard


class DistComm(Comm):
    """One rank's communicator under torch.distributed (see the module docstring).

    Args:
        plan: the build's plan.
        rank: this process's global rank.
        devices: every rank's device (:func:`rank_devices`).
        pairs: NCCL groups of GPU pairs, from :func:`make_groups`.
        groups: collective groups, from :func:`make_groups`.
        hierarchy: the sub-groups of this rank's hierarchical all-reduces, by stage set; None makes them here
            (:func:`make_hierarchy`, collective: every rank builds its DistComm at the same point).
        timeout: the time-out of the sub-groups made here (as :func:`make_groups`'); None: torch's default.
    """

    def __init__(self, plan: Plan, rank: int, devices: list[torch.device], pairs: dict[tuple[int, int], Any],
                 groups: dict[tuple[int, ...], Any], hierarchy: dict[int, HierGroups] | None = None,
                 timeout: timedelta | None = None, places: Places | None = None) -> None:
        super().__init__(devices[rank])
        # job ranks: where a stage has tp > 1, its replicas as this rank's place sees them (Places)
        self.places = places if places is not None else Places.of(plan)
        self.stage, self.replica, self.place = self.places.locate(rank)
        self.ranks = self.places.table(self.place)
        self.slot = sum(self.places.replicas[:self.stage]) + self.replica  # (stage, replica) in the plan's order
        self.rows = [st.rows for st in plan.stages]
        self.rank = rank
        self.devices = devices
        self.pairs = pairs
        self.groups = groups
        self.hierarchy = make_hierarchy(plan, devices, list(groups), timeout, self.places) \
            if hierarchy is None else hierarchy
        self.stats = CommStats()
        self.step_index = 0
        self.faults: list[CommFault] = []  # injected failures still to happen (shared with the pipeline)
        self._op_count: dict[CommOp, int] = {}
        self._pending: list[tuple[Any, Tensor]] = []
        # receives posted ahead of their tokens (:meth:`expect`): (from, to, key) -> (work, buffer)
        self._early: dict[tuple[Any, ...], tuple[Any, Tensor]] = {}
        self._posting = False
        self._chains: dict[tuple[int, ...], ChainQueue] = {}  # overlapped hierarchical buckets
        # collectives among CPU ranks the plan puts on one host go through shared memory (:mod:`.shm`)
        self.shared_memory = True
        self.direct_bytes = DIRECT_BYTES  # ... but an all-reduce of fewer bytes through gloo (.shm)
        self._hosts = {self.ranks[k][i]: plan.cluster.device(plan.stages[k].devices[i]).host
                       for k, i in rank_layout(plan)}
        self._host_reduce: dict[tuple[int, ...], tuple[Any, HostReduce | None]] = {}
        self._ride_wires: dict[tuple[int, ...], Tensor] = {}  # each group's float64 wire of _ride_in, kept

    # -- plumbing ---------------------------------------------------------------------------------
    def replicas(self, stage: int) -> int:
        return len(self.ranks[stage])

    def group_size(self, stages: tuple[int, ...]) -> int:
        return len({r for k in stages for r in self.ranks[k]})

    def _tag(self, key: tuple[int, ...]) -> int:
        # key = (src, dst, direction, microbatch, tensor index): unique between two ranks within a step.
        src, _, direction, microbatch, i = key
        return ((microbatch * len(self.ranks) + src) * 2 + direction) * _MAX_TENSORS + i

    def _group(self, peer: int) -> Any:
        return self.pairs.get((min(self.rank, peer), max(self.rank, peer)))

    def maybe_fail(self, op: CommOp) -> None:
        """Raise :class:`InjectedFault` where a :class:`CommFault` names this occurrence of ``op`` (each once)."""
        n = self._op_count.get(op, 0)
        self._op_count[op] = n + 1
        for f in self.faults:
            if f.rank == self.rank and f.step == self.step_index and f.op is op and f.index == n:
                self.faults.remove(f)  # once
                raise InjectedFault(f"injected {op.value} failure on rank {self.rank} in step {self.step_index + 1}")

    def begin_step(self, step: int) -> None:
        """Reset the per-step counters (called by the pipeline before each step)."""
        self.step_index = step
        self.stats.reset()
        self._op_count.clear()

    def forget(self) -> None:
        """Drop owed gradients, the mailbox and pending sends (after an evaluation pass or a failed step)."""
        self._owed.clear()
        self.mail.clear()
        self._pending.clear()
        self._early.clear()  # a failed step's: the pipeline re-forms the group before it steps again
        self._chains.clear()  # a failed step's chains: their groups may be gone

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # timings of async kernels need the end

    # -- point to point ---------------------------------------------------------------------------
    def _put(self, frm: tuple[int, int], to: tuple[int, int], key: tuple[int, ...], tensor: Tensor) -> None:
        self.maybe_fail(CommOp.SEND)
        # to each place of the peer's tensor-parallel group that reads from this one (Places.send_places)
        for j in self.places.send_places(frm[0], to[0], self.place):
            t0 = time.perf_counter()
            peer = self.places.rank(to[0], to[1], j)
            group = self._group(peer)
            wire = tensor if group is not None or tensor.device.type == "cpu" else tensor.cpu()  # gloo: via host
            while self._pending and self._pending[0][0].is_completed():
                self._pending.pop(0)  # delivered: its buffer need not live until the end of the step
            tag = self._tag(key)
            self._pending.append((dist.isend(wire, peer, group=group, tag=tag), wire))
            nbytes = wire.numel() * wire.element_size()
            self.stats.bytes_sent += nbytes
            t1 = time.perf_counter()
            self.stats.send_s += t1 - t0
            if self.events is not None:
                self.events.add("SEND", t0, t1, self.stage, key[3], peer, nbytes, tag)

    def expect(self, src: int, dst: int, direction: Direction, microbatch: int, replica: int,
               specs: Sequence[TensorSpec]) -> None:
        """Post the gloo receives of a message ahead of its token (the token's :meth:`recv` then waits for them).

        Why: gloo's TCP pair moves a message once both sides have posted it. A receive posted only when the
        token runs, after the sender's ``isend`` (interleaved 1F1B sends ahead more often than 1F1B), is answered
        with the payload at once, while this rank's thread still holds the pair's lock; gloo's event loop retries
        that lock without sleeping until it is released, and on a host whose cores the ranks keep busy the
        spinning loop takes the CPU the holder needs to release it (27-35 ms of loop CPU a step on 2 cores under
        interleaving, 3-5 under 1F1B). Posted ahead, the payload meets a receive that is already there. NCCL
        pairs are left as they are.
        """
        self._posting = True
        try:
            self.recv(src, dst, direction, microbatch, replica, specs)
        finally:
            self._posting = False

    def _get(self, frm: tuple[int, int], to: tuple[int, int], key: tuple[int, ...], shape: tuple[int, ...],
             dtype: torch.dtype) -> Tensor:
        peer = self.places.rank(frm[0], frm[1], self.places.recv_place(to[0], frm[0], self.place))
        group = self._group(peer)
        if self._posting:  # expect(): post the receive now (gloo only), wait in the token's recv
            buf = torch.empty(shape, dtype=dtype, device="cpu")
            if group is None and (frm, to, key) not in self._early:
                self._early[(frm, to, key)] = (dist.irecv(buf, peer, tag=self._tag(key)), buf)
            return buf
        self.maybe_fail(CommOp.RECV)
        t0 = time.perf_counter()
        tag = self._tag(key)
        early = self._early.pop((frm, to, key), None)
        if early is not None:
            work, buf = early
            self.stats.early_received += 1
        else:
            buf = torch.empty(shape, dtype=dtype, device=self.device if group is not None else "cpu")
            work = dist.irecv(buf, peer, group=group, tag=tag)
        assert work is not None  # None only for a rank outside the group, which this never is
        work.wait()
        if group is not None:
            self._sync_device()
        out = buf if buf.device == self.device else buf.to(self.device)
        t1 = time.perf_counter()
        self.stats.recv_s.append((Direction.FORWARD if key[2] == 0 else Direction.BACKWARD, t1 - t0))
        nbytes = buf.numel() * buf.element_size()
        self.stats.bytes_received += nbytes
        if self.events is not None:
            self.events.add("RECV", t0, t1, self.stage, key[3], peer, nbytes, tag)
        return out

    def flush(self) -> None:
        t0 = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        t1 = time.perf_counter()
        self.stats.send_s += t1 - t0
        if self.events is not None:
            self.events.add("WAIT", t0, t1, self.stage)

    # -- collectives ------------------------------------------------------------------------------
    def _collective(self, stages: tuple[int, ...], flat: Tensor, fn: Callable[[Tensor, Any], Tensor],
                    name: str = "ALLREDUCE", meet: Callable[[Tensor | None], None] | None = None,
                    launch: Callable[[Tensor, Any], Any] | None = None) -> Tensor:
        """Run ``fn(wire, group)`` after the members meet; the wait and the transfer counted apart.

        ``meet(carry)``: the members meet another way (the host's barrier), summing ``carry`` (a :class:`Rider`'s
        vector, or None) as they do.

        ``launch``: the same collective as an ``async_op`` call (in place on ``wire``), for gloo: issued right behind
        the meeting's, so that the transfer starts as soon as the members have met, not after this thread has woken
        to see it (two gloo ranks on the 2-core VM, busy, the meeting and a 109 KB all-reduce: 1.9 ms one after the
        other, 0.8 ms issued together, the all-reduce alone 1.1 ms).
        """
        self.maybe_fail(CommOp.COLLECTIVE)
        group = self.groups.get(stages)
        t0 = time.perf_counter()
        nccl = group is not None and all(self.devices[r].type == "cuda"
                                         for k in stages for r in self.ranks[k])
        wire = flat if nccl or flat.device.type == "cpu" else flat.cpu()
        # A one-element all-reduce first (or ``meet``, the members meeting another way): the members leave their
        # pipelines at different times, and the monitor must not count waiting for the slowest as communication
        # (it is pipeline skew). A rider for these stages (a gloo group) is that all-reduce, or goes with ``meet``.
        rider = self.rider if (self.rider is not None and self.rider.stages == stages and not self.rider.carried
                               and group is not None and not nccl) else None
        work = None
        if meet is not None:
            meet(rider.vector if rider is not None else None)
        elif launch is not None and not nccl:
            met = dist.all_reduce(rider.vector if rider is not None else torch.zeros(1), group=group, async_op=True)
            work = launch(wire, group)
            met.wait()
        else:
            dist.all_reduce(rider.vector if rider is not None else torch.zeros(1, device=wire.device), group=group)
        if rider is not None:
            rider.carried = True
        if nccl:
            self._sync_device()
        t1 = time.perf_counter()
        if work is not None:
            work.wait()
            out = wire
        else:
            out = fn(wire, group)
        if nccl:
            self._sync_device()
        t2 = time.perf_counter()
        self.stats.collective_wait_s += t1 - t0
        self.stats.collective_s += t2 - t1
        if self.events is not None:  # the peer field holds the group's size, for the bandwidth of a ring
            self.events.add("COLL_WAIT", t0, t1, self.stage)
            self.events.add(name, t1, t2, self.stage, -1, self.group_size(stages), flat.numel() * flat.element_size())
        return out if out.device == flat.device else out.to(flat.device)

    def all_reduce(self, stages: tuple[int, ...], flat: Tensor) -> None:
        if self.groups.get(stages) is None:
            return

        hier = self.hierarchy.get(stages)
        nbytes = flat.numel() * flat.element_size()  # a small one goes through gloo: one meeting, not three (.shm)
        host = (self.host_reduce(stages, nbytes) if hier is None and flat.device.type == "cpu" and flat.is_contiguous()
                and nbytes >= self.direct_bytes else None)
        if host is not None:  # through shared memory: the members meet at its first barrier, the tensor staged
            if host.elsewhere(flat):  # a piece of the slot itself, not from its start: summed from a copy
                tmp = flat.clone()
                self.all_reduce(stages, tmp)
                flat.copy_(tmp)
                return
            fits = host.fits(flat)

            def meet(carry: Tensor | None = None) -> None:
                if fits:
                    host.stage(flat)
                host.barrier(carry)

            def shared(t: Tensor, g: Any) -> Tensor:
                host.all_reduce(t, met=fits)
                return t

            self._collective(stages, flat, shared, meet=meet)
            return

        def run(t: Tensor, g: Any) -> Tensor:
            if hier is not None:  # the plan asked for it: reduce-scatter in the host, all-reduce between, gather
                return hierarchical_all_reduce(t, hier)
            dist.all_reduce(t, group=g)
            return t

        if hier is None and self._ride_in(stages, flat):
            return
        out = self._collective(stages, flat, run, launch=None if hier is not None else
                               lambda t, g: dist.all_reduce(t, group=g, async_op=True))
        if out is not flat:
            flat.copy_(out)
        if hier is not None:
            self._count_levels(stages, flat, hier)

    def _ride_in(self, stages: tuple[int, ...], flat: Tensor) -> bool:
        """Sum a small gloo all-reduce of ``flat`` and the :class:`Rider` of ``stages`` as ONE float64 all-reduce.

        Where a rider waits for this collective on a gloo group and ``flat`` with it comes to at most
        :data:`~hpml_compile.memory.RIDE_IN_BYTES` in float64, the members do not meet first:
        ``[rider's vector, flat as float64]`` is summed at once and copied back (``flat`` gets its float64 sum
        rounded once to its dtype, for two ranks what its own all-reduce gives; the rider's sums stay exact, see
        :mod:`..execute.batchcheck`). A small
        all-reduce costs mostly its fixed overhead, so the second collective cost more than the doubled bytes:
        two gloo ranks of one busy 2-core host, 109 KB of float32 gradients, meeting and all-reduce issued
        together 0.31 ms (median 0.43), the one float64 all-reduce 0.20 ms (median 0.30), the gradients' own
        all-reduce alone 0.16 ms (0.23); with 256 KiB of gradients 0.31 ms against the pair's 0.37 (medians 0.44
        and 0.49), with 512 KiB 0.44 against 0.43 (0.57 and 0.53): hence :data:`~hpml_compile.memory.RIDE_IN_BYTES`.
        The float64 wire is kept per group and written in place: concatenating casts of the two into a new tensor
        each step cost twice the copies (18 against 10 us on the small-op MLP's 27k gradients, busy 2-core VM).

        No meeting, so the monitor cannot tell here the wait for the slowest member from the transfer: the whole
        collective is counted as collective time (``collective_s``, one ``ALLREDUCE`` event with the float64
        bytes, whose duration includes that wait), none as ``collective_wait_s`` and no ``COLL_WAIT`` event.

        Returns:
            True where it ran the collective (the rider carried), False where it did nothing.
        """
        rider, group = self.rider, self.groups.get(stages)
        if (rider is None or rider.stages != stages or rider.carried or group is None
                or (flat.numel() + rider.vector.numel()) * 8 > RIDE_IN_BYTES
                or all(self.devices[r].type == "cuda" for k in stages for r in self.ranks[k])):
            return False
        self.maybe_fail(CommOp.COLLECTIVE)
        t0 = time.perf_counter()
        n = rider.vector.numel()
        wire = self._ride_wires.get(stages)
        if wire is None or wire.numel() != n + flat.numel():  # one wire per group, written in place each step
            wire = self._ride_wires[stages] = torch.empty(n + flat.numel(), dtype=torch.float64)
        wire[:n].copy_(rider.vector)
        wire[n:].copy_(flat.detach().reshape(-1))  # cast (and from a GPU, moved) as it is written
        dist.all_reduce(wire, group=group)
        rider.vector.copy_(wire[:n])
        rider.carried = True
        flat.copy_(wire[n:].view(flat.shape))
        t1 = time.perf_counter()
        self.stats.collective_s += t1 - t0
        if self.events is not None:  # the peer field holds the group's size, for the bandwidth of a ring
            self.events.add("ALLREDUCE", t0, t1, self.stage, -1, self.group_size(stages),
                            wire.numel() * wire.element_size())
        return True

    def drop_host_memory(self) -> None:
        """Let go of every shared mapping and, with it, of its group (the pipeline's re-forming of failed groups)."""
        for _, made in self._host_reduce.values():
            if made is not None:
                made.close()
        self._host_reduce.clear()

    def _host_for(self, stages: tuple[int, ...], t: Tensor, times: int = 1) -> HostReduce | None:
        """The shared mapping for a reduce-scatter or all-gather of ``t`` (gathered ``times`` over), where there is
        one and its slot is not lent to a gradient buffer (:meth:`~.shm.HostReduce.own`)."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        host = self.host_reduce(stages, t.numel() * t.element_size() * times)
        return host if host is not None and not host.lent else None

    def host_reduce(self, stages: tuple[int, ...], nbytes: int = SLOT_BYTES) -> HostReduce | None:
        """The shared mapping of the group of ``stages`` where its ranks are CPU ranks of one host, else None.

        Made at the group's first collective (every member reaches it there), with a slot of that collective's
        ``nbytes`` (at most :data:`~.shm.SLOT_BYTES`), and again for a new group (a re-formed one after a
        failure).
        """
        group = self.groups.get(stages)
        if group is None or not self.shared_memory:
            return None
        held = self._host_reduce.get(stages)
        if held is not None and held[0] is group:
            return held[1]
        if held is not None and held[1] is not None:
            held[1].close()
        members = sorted({r for k in stages for r in self.ranks[k]})
        kinds = {r: self.devices[r].type for r in members}
        made = (HostReduce.open(group, min(nbytes, SLOT_BYTES)) if HostReduce.eligible(members, self._hosts, kinds)
                else None)
        self._host_reduce[stages] = (group, made)
        return made

    def _count_levels(self, stages: tuple[int, ...], flat: Tensor, hier: HierGroups, gather: bool | None = None
                      ) -> None:
        """Add the bytes of each level of one hierarchical all-reduce of ``flat`` (for report).

        ``gather``: a hierarchical ZeRO-1's halves of it, False for the reduce-scatter in the host and the
        all-reduce between hosts, True for the all-gather in the host (and half the flat ring, each); None: all.
        """
        hosts = self.group_size(stages) // hier.per_host
        intra, inter, ring = level_bytes(flat.numel(), flat.element_size(), hier, hosts)
        if gather is not None:
            intra, inter, ring = intra // 2, (0 if gather else inter), ring // 2
        self.stats.intra_bytes += intra
        self.stats.inter_bytes += inter
        self.stats.flat_bytes += ring

    def _launch(self, stages: tuple[int, ...], flat: Tensor, out: Tensor, name: str,
                fn: Callable[[Tensor, Any], Any]) -> PendingCollective:
        """Start ``fn(wire, group)`` (a torch.distributed call with ``async_op=True``) without waiting for it."""
        self.maybe_fail(CommOp.COLLECTIVE)
        group = self.groups.get(stages)
        nccl = group is not None and all(self.devices[r].type == "cuda" for k in stages for r in self.ranks[k])
        t0 = time.perf_counter()
        wire = flat if nccl or flat.device.type == "cpu" else flat.cpu()  # gloo: a GPU tensor via the host
        work = fn(wire, group)
        return PendingCollective(work, wire, out, self.stats, name, t0,
                                 flat.numel() * flat.element_size(), self.group_size(stages), self.stage,
                                 self.events, self.device if nccl else torch.device("cpu"))

    def all_reduce_async(self, stages: tuple[int, ...], flat: Tensor) -> PendingCollective | None:
        """Start summing ``flat`` in place over the ranks of ``stages``; None where one rank holds them all.

        On a GPU in a gloo group the sum lands in a host copy and is copied back by the wait. Where the plan
        makes the all-reduce hierarchical, a :class:`PendingChain` (its three collectives one after another,
        after the stage's earlier chains); else one all-reduce.
        """
        if self.groups.get(stages) is None:
            return None
        hier = self.hierarchy.get(stages)
        if hier is not None:  # the plan asked for it: a chain of three collectives (PendingChain)
            return self._chain(stages, flat, hier)
        return self._launch(stages, flat, flat, "ALLREDUCE",
                            lambda t, g: dist.all_reduce(t, group=g, async_op=True))

    def _chain(self, stages: tuple[int, ...], flat: Tensor, hier: HierGroups, shard_out: Tensor | None = None
               ) -> PendingChain:
        """Queue the hierarchical all-reduce of ``flat`` on the stage set's :class:`ChainQueue` (``shard_out``: its
        first two levels only, a hierarchical ZeRO-1's reduce-scatter into this rank's shard of it)."""
        self.maybe_fail(CommOp.COLLECTIVE)
        nccl = all(self.devices[r].type == "cuda" for k in stages for r in self.ranks[k])
        t0 = time.perf_counter()
        staged = not nccl and flat.device.type != "cpu"  # gloo: a GPU tensor via the host
        wire = flat.cpu() if staged else flat
        out = flat if shard_out is None else shard_out
        wire_out = None if shard_out is None else (torch.empty(shard_out.shape, dtype=shard_out.dtype) if staged
                                                   else shard_out)
        levels, done = hierarchical_levels(wire, hier, wire_out)
        self._count_levels(stages, flat, hier, gather=None if shard_out is None else False)
        queue = self._chains.setdefault(stages, ChainQueue())
        return queue.add(PendingChain(queue, levels, done, wire if wire_out is None else wire_out, out, self.stats,
                                      t0, flat.numel() * flat.element_size(), self.group_size(stages), self.stage,
                                      self.events, self.device if nccl else torch.device("cpu")))

    def reduce_scatter_chain(self, stage: int, bucket: Tensor, out: Tensor) -> PendingChain | None:
        """Start a hierarchical ZeRO-1 bucket's reduce-scatter: ``out`` (``1 / L`` of ``bucket``) gets the global sum
        of this rank's piece, in the host then between hosts, queued after the stage's earlier buckets."""
        hier = self.hierarchy.get((stage,))
        if hier is None:
            raise HpmlError(f"stage {stage}: a hierarchical reduce-scatter, but the plan does not make the stage "
                            "hierarchical (no sub-groups): rebuild the pipeline from the build's plan")
        return self._chain((stage,), bucket, hier, out)

    def gather_into(self, stage: int, pieces: Sequence[tuple[Tensor, Tensor]]) -> None:
        """A hierarchical ZeRO-1's parameter all-gather in the host, in place: each ``(piece, out)`` pair's ``out``
        gets the host's pieces in order (:func:`~.hierarchy.hierarchical_gather_into`), after the skew barrier."""
        hier = self.hierarchy[(stage,)]
        self.maybe_fail(CommOp.COLLECTIVE)
        t0 = time.perf_counter()
        dist.all_reduce(torch.zeros(1, device=self.device if self.device.type == "cuda" and all(
            self.devices[r].type == "cuda" for r in self.ranks[stage]) else "cpu"), group=self.groups.get((stage,)))
        t1 = time.perf_counter()
        hierarchical_gather_into(pieces, hier)
        self._sync_device()
        t2 = time.perf_counter()
        self.stats.collective_wait_s += t1 - t0
        self.stats.collective_s += t2 - t1
        nbytes = sum(o.numel() * o.element_size() for _, o in pieces)
        if self.events is not None:
            self.events.add("COLL_WAIT", t0, t1, self.stage)
            self.events.add("ALLGATHER", t1, t2, self.stage, -1, self.group_size((stage,)), nbytes)
        hosts = self.group_size((stage,)) // hier.per_host
        for _, o in pieces:
            intra, _, ring = level_bytes(o.numel(), o.element_size(), hier, hosts)
            self.stats.intra_bytes += intra // 2
            self.stats.flat_bytes += ring // 2

    def gather_async(self, stage: int, piece: Tensor, outs: Sequence[Tensor]) -> PendingCollective | None:
        """Start a ZeRO parameter all-gather without waiting for it (the prefetch of :class:`~.zero.FlatShard`):
        ``outs`` (one per rank of the group, in rank order, each the size of ``piece``) get every rank's piece.

        The group is the stage's replicas, or the host's ranks where the plan makes the ZeRO-1 stage hierarchical
        (every host holds every shard). Only where no staging is needed (CPU tensors over gloo, or an NCCL group:
        the result lands in ``outs`` themselves); None where nothing is to be gathered (one rank). Unlike the
        blocking collectives there is no skew barrier before it: it is launched to run under the next forward.

        Raises:
            HpmlError: a GPU tensor over a gloo group (stage it and gather blocking instead, as
                :meth:`gather_into` and :meth:`all_gather` do).
        """
        hier = self.hierarchy.get((stage,))
        group = hier.intra if hier is not None else self.groups.get((stage,))
        if group is None:
            if len(outs) == 1:
                outs[0].copy_(piece)
            return None
        nccl = all(self.devices[r].type == "cuda" for r in self.ranks[stage])
        if not nccl and piece.device.type != "cpu":
            raise HpmlError(f"stage {stage}: an asynchronous all-gather of a {piece.device.type} tensor over gloo "
                            "needs a host copy: gather it blocking (FlatShard.all_gather does)")
        self.maybe_fail(CommOp.COLLECTIVE)
        t0 = time.perf_counter()
        src = piece.detach().contiguous()
        outs = list(outs)
        whole = outs[0] if len(outs) == 1 else None
        if whole is not None:  # a hierarchical bucket: one contiguous range, the host's pieces in local order
            work = dist.all_gather_into_tensor(whole, src, group=group, async_op=True)
        else:
            work = dist.all_gather(outs, src, group=group, async_op=True)
        nbytes = sum(o.numel() * o.element_size() for o in outs)
        if hier is not None:  # the third level of the hierarchical all-reduce, on parameters (for report)
            hosts = self.group_size((stage,)) // hier.per_host
            for o in outs:
                intra, _, ring = level_bytes(o.numel(), o.element_size(), hier, hosts)
                self.stats.intra_bytes += intra // 2
                self.stats.flat_bytes += ring // 2
        return PendingCollective(work, src, src, self.stats, "ALLGATHER", t0, nbytes,
                                 hier.per_host if hier is not None else len(self.ranks[stage]), self.stage,
                                 self.events, self.device if nccl else torch.device("cpu"))

    def reduce_scatter_async(self, stage: int, parts: list[Tensor], out: Tensor) -> PendingCollective | None:
        """Start the reduce-scatter of ``parts`` (one per replica, equal sizes) into ``out`` (this replica's sum).

        Args:
            stage: the replicated stage.
            parts: ``parts[s]`` is what replica ``s`` receives the sum of, on every replica.
            out: this replica's result (the size of one part).

        Returns:
            The pending collective (None where the stage has one replica).
        """
        if self.groups.get((stage,)) is None:
            return None
        group = self.groups[(stage,)]
        nccl = all(self.devices[r].type == "cuda" for r in self.ranks[stage])
        staged = not nccl and out.device.type != "cpu"
        wire_out = torch.empty(out.shape, dtype=out.dtype) if staged else out
        wire_parts = [p.cpu() for p in parts] if staged else list(parts)
        self.maybe_fail(CommOp.COLLECTIVE)
        t0 = time.perf_counter()
        work = dist.reduce_scatter(wire_out, wire_parts, group=group, async_op=True)
        return PendingCollective(work, wire_out, out, self.stats, "REDUCESCATTER", t0,
                                 sum(p.numel() * p.element_size() for p in parts), len(self.ranks[stage]), self.stage,
                                 self.events, self.device if nccl else torch.device("cpu"))

    def reduce_scatter(self, stage: int, flat: Tensor) -> Tensor:
        """This replica's shard of the sum; where the plan makes a ZeRO-1 stage hierarchical, the shard of this
        rank's host position, reduce-scattered in the host and all-reduced between hosts (:mod:`.hierarchy`)."""
        hier = self.hierarchy.get((stage,))
        d = len(self.ranks[stage])
        host = self._host_for((stage,), flat) if hier is None and flat.numel() % d == 0 else None
        if host is not None:  # through shared memory (.shm): the members meet at its barrier
            def shared(t: Tensor, g: Any) -> Tensor:
                out = torch.empty(t.numel() // d, dtype=t.dtype, device=t.device)
                host.reduce_scatter(t, out)
                return out

            return self._collective((stage,), flat, shared, "REDUCESCATTER", meet=host.barrier)

        def run(t: Tensor, g: Any) -> Tensor:
            if hier is not None:
                return hierarchical_reduce_scatter(t, hier)
            parts = list(t.chunk(len(self.ranks[stage])))
            out = torch.empty_like(parts[0])
            dist.reduce_scatter(out, parts, group=g)
            return out

        out = self._collective((stage,), flat, run, "REDUCESCATTER")
        if hier is not None:  # the host's reduce-scatter and the shard's all-reduce between hosts
            self._count_levels((stage,), flat, hier, gather=False)
        return out

    def all_gather(self, stage: int, shard: Tensor, into: Tensor | None = None) -> Tensor:
        """Every replica's shard in order; under a hierarchical ZeRO-1 stage, the host's ranks' shards. ``into``
        (the caller's flat buffer, of which ``shard`` may be this replica's chunk) is gathered into in place
        where it is on the collective's device: no copy after, as the link probe times it (``profile.links``)."""
        hier = self.hierarchy.get((stage,))
        n = len(self.ranks[stage])
        host = self._host_for((stage,), shard, n) if hier is None else None

        def run(t: Tensor, g: Any) -> Tensor:
            if hier is not None:
                return hierarchical_all_gather(t, hier)
            # straight into views of one buffer: gathering into separate tensors and concatenating them took
            # 55-65 ms for 30 MB on two gloo ranks here, against 30-33 ms into views; the backends
            # read this replica's input before they write its chunk, so the input may alias it
            size = (n * t.shape[0], *t.shape[1:])
            out = into if into is not None and into.device == t.device and into.dtype == t.dtype \
                and tuple(into.shape) == size and into.is_contiguous() else \
                torch.empty(size, dtype=t.dtype, device=t.device)
            if host is not None:  # through shared memory (.shm)
                host.all_gather(t, out)
            else:
                dist.all_gather(list(out.chunk(n)), t.contiguous(), group=g)
            return out

        out = self._collective((stage,), shard, run, "ALLGATHER", meet=host.barrier if host is not None else None)
        if hier is not None:
            self._count_levels((stage,), out, hier, gather=True)
        return out


def dist_comm(build: Build, device: torch.device | str = "cpu") -> DistComm:
    """This rank's communicator for ``build``, every rank on ``device``, with a process group per collective.

    Every rank must call it (creating a group is collective), after
    ``dist.init_process_group`` with one rank per device of the plan.

    Args:
        build: the loaded build.
        device: this rank's device (and, for choosing backends, every rank's).

    Returns:
        The communicator; set it as the rank's stage's ``hpml_comm`` (the executor does).

    Raises:
        HpmlError: if the world size is not the plan's device count.
    """
    world, want = dist.get_world_size(), len(rank_layout(build.plan))
    if world != want:
        raise HpmlError(f"the build's plan runs on {want} devices (one rank each), but the world has {world} "
                        f"ranks: start {want} processes")
    devices = [torch.device(device)] * world
    pairs, groups = make_groups(build.plan, devices, build.manifest.groups())
    return DistComm(build.plan, dist.get_rank(), devices, pairs, groups)
