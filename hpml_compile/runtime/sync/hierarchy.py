"""Hierarchical all-reduce: inside each host, between hosts, inside each host again.

A stage whose
plan says ``allreduce: hierarchical`` (and, under the plan's
``tied_allreduce: hierarchical``, a group of stages sharing parameters
spread over hosts) sums its gradients in three
collectives on sub-groups made once per stage (:func:`make_hierarchy`): a
reduce-scatter among the ranks of each host, an all-reduce of each shard
among the ranks holding it on the other hosts, an all-gather inside each
host (Horovod's hierarchical all-reduce; Mikami et al. 2018). The same sum
as the flat all-reduce, with ``1 / h`` of the bytes on each link between
hosts. torch.distributed has no such collective (NCCL picks its own rings
and trees inside one communicator, gloo has none), hence these few lines.
Overlapped with the backward (:meth:`.comm.DistComm.all_reduce_async` on such a
stage, the buckets of :mod:`.zero`), each bucket is a chain of those three
collectives (:class:`PendingChain`), each level started only once the
previous one's work is done; a stage's chains go through one
:class:`ChainQueue`, which issues every collective in one fixed order,
bucket by bucket and level by level, advanced without blocking at each
gradient hook (``is_completed``) and by blocking at the final wait.
Why not torch futures (``work.get_future().then(...)``, as DDP's PowerSGD
hook chains its all-reduces): a callback runs when its work completes, on
the backend's thread, so two buckets' next levels would reach a group in
the order they happen to complete, which may differ between ranks, and
collectives on one group must be issued in one order on every rank (gloo
matches them by a per-group sequence number, NCCL by call order); and
gloo's reduce-scatter work has no future at all (torch 2.13: "getFuture
not implemented") and reports completion only once waited for, so on a
gloo host group the reduce-scatter is an all-to-all plus a local sum. The
fixed order also keeps the plan's price true: the collectives run one
after another, the last bucket's chain after the backward.

A ZeRO-1 stage whose plan says ``hierarchical`` (HSDP-like: the optimizer
sharded over the ``L`` ranks of each host, replicated across hosts) uses
the first two levels and the third apart: the reduce-scatter in the host and
the all-reduce of each piece between hosts (each rank then holds the global
sum of its shard: :func:`hierarchical_levels` with ``shard_out``, chained per
bucket during the backward, or :func:`hierarchical_reduce_scatter` after it),
the optimizer steps that shard, and :func:`hierarchical_gather_into` brings
the host's ranks the other pieces' new values, in place in the flat buffer
(:class:`~.zero.FlatShard` with ``hier``). The bytes between hosts are the
hierarchical all-reduce's; inside the host a reduce-scatter and an
all-gather, of gradients then of parameters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ...errors import HpmlError
from ...plan import AllReduce, Plan
from ...schedule import stage_ranks

if TYPE_CHECKING:
    from .comm import CommStats

__all__ = ["HierGroups", "make_hierarchy", "level_bytes", "hierarchical_levels", "hierarchical_all_reduce",
           "hierarchical_reduce_scatter", "hierarchical_all_gather", "hierarchical_gather_into", "PendingChain",
           "ChainQueue"]

_GLOO, _NCCL = "gloo", "nccl"  # torch.distributed's backend names (comm.Backend's values; comm imports this module)


@dataclass(frozen=True)
class HierGroups:
    """This rank's two sub-groups for a stage's hierarchical all-reduce.

    Attributes:
        intra: the ranks of the stage on this rank's host (None: this rank is alone on its host).
        inter: the ranks at this rank's position on every host.
        per_host: ranks per host (``h``).
        local: this rank's index among the stage's ranks on its host (the shard it owns under a hierarchical
            ZeRO-1, :func:`hierarchical_reduce_scatter`).
    """

    intra: Any
    inter: Any
    per_host: int
    local: int = 0


def make_hierarchy(plan: Plan, devices: list[torch.device], collectives: Sequence[tuple[int, ...]] = (),
                   timeout: timedelta | None = None, places: Any = None) -> dict[tuple[int, ...], HierGroups]:
    """Sub-groups for every all-reduce the plan makes hierarchical; this rank's, by stage set.

    That is each stage whose ``allreduce`` is hierarchical (its replicas), and, under the plan's
    ``tied_allreduce: hierarchical``, each group of stages sharing parameters (``collectives`` of more than one
    stage) whose devices span hosts evenly. Every rank must call it, in the same order relative to other
    group creations (creating a group is collective: every rank of the world takes part in every
    ``new_group``, even one it is not in).

    Args:
        plan: the plan (each stage's devices and their hosts).
        devices: every rank's torch device (:func:`rank_devices`): NCCL for a sub-group of GPUs, gloo otherwise.
        collectives: the stage sets of the build's collectives, in manifest order (for the tied groups).
        timeout: the time-out of every operation on the sub-groups (:func:`~.comm.make_groups`'); None: torch's
            default for a new group.
        places: the job's :class:`~hpml_compile.codegen.tensor_parallel.Places` where stages have ``tp > 1``
            (``plan`` is then the plan one place runs): the sub-groups are made for every place, and this rank
            keeps its own; None: ``plan``'s ranks.

    Returns:
        For each hierarchical all-reduce this rank takes part in, its groups, keyed by the stage set
        (``(k,)`` for stage ``k``'s replicas).

    Raises:
        HpmlError: a hierarchical stage whose hosts hold different numbers of its devices.
    """
    tables = [places.table(t) for t in range(places.count)] if places is not None else [stage_ranks(plan)]
    out: dict[tuple[int, ...], HierGroups] = {}
    made: dict[tuple[int, ...], Any] = {}

    def group(members: list[int]) -> Any:
        if tuple(members) not in made:  # places sharing a stage (tp 1 beside tp 2) share its groups
            nccl = all(devices[r].type == "cuda" for r in members)
            made[tuple(members)] = dist.new_group(members, backend=(_NCCL if nccl else _GLOO), timeout=timeout)
        return made[tuple(members)]

    wanted: list[tuple[int, ...]] = [(st.index,) for st in plan.stages
                                     if st.allreduce is AllReduce.HIERARCHICAL and len(st.devices) > 1]
    if plan.tied_allreduce is AllReduce.HIERARCHICAL:
        wanted += [s for s in dict.fromkeys(collectives) if len(s) > 1]
    me = dist.get_rank()
    for stages in wanted:
        for ranks in tables:
            by_host: dict[str, list[int]] = {}
            for k in stages:
                for replica, name in enumerate(plan.stages[k].devices):
                    by_host.setdefault(plan.cluster.device(name).host, []).append(ranks[k][replica])
            hosts = list(by_host.values())
            h = len(hosts[0])
            if len(hosts) < 2 or any(len(x) != h for x in hosts):
                if len(stages) > 1:
                    continue  # a tied group on one host, or uneven: it stays flat
                raise HpmlError(f"stage {stages[0]} asks for a hierarchical all-reduce, but its ranks are not spread "
                                f"evenly over two or more hosts ({ {k: len(v) for k, v in by_host.items()} }); set "
                                "its allreduce to flat")
            intra: dict[int, Any] = {}
            inter: dict[int, Any] = {}
            for x in hosts:  # every rank creates every group, once each, in one order
                g = group(x)
                intra.update((r, g) for r in x)
            for i in range(h):
                column = [x[i] for x in hosts]
                g = group(column)
                inter.update((r, g) for r in column)
            if me in intra:
                host = next(x for x in hosts if me in x)
                out[stages] = HierGroups(intra[me] if h > 1 else None, inter[me], h, host.index(me))
    return out


def level_bytes(numel: int, element_size: int, groups: HierGroups, hosts: int) -> tuple[int, int, int]:
    """``(inside the host, between hosts, flat)``: bytes one rank sends in :func:`hierarchical_all_reduce` of
    ``numel`` elements, and in a flat ring all-reduce of them, counted as rings send them: a reduce-scatter and an
    all-gather of the padded tensor inside the host (``2 (h-1)/h``), an all-reduce of its ``1/h`` shard between
    the ``hosts`` (``2 (H-1)/H``); a flat ring over all ``h H`` ranks sends ``2 (hH-1)/(hH)`` of it.

    >>> level_bytes(1000, 4, HierGroups(None, None, 2), hosts=2)  # 2 hosts x 2 ranks, 4000 bytes each
    (4000, 2000, 6000)

    Between hosts a rank sends 2000 bytes where a flat ring's hop between the hosts carries 6000 (a ring is as
    fast as its slowest hop)."""
    h = groups.per_host
    padded = -(-numel // h) * h * element_size
    n, world = numel * element_size, h * hosts
    return 2 * (h - 1) * padded // h, 2 * (hosts - 1) * (padded // h) // hosts, 2 * (world - 1) * n // world


def hierarchical_levels(flat: Tensor, groups: HierGroups, shard_out: Tensor | None = None
                        ) -> tuple[list[Callable[[], Any]], Callable[[], None]]:
    """The collectives of a hierarchical all-reduce of ``flat``, to be started in order, each after the last is done.

    Args:
        flat: a 1-D tensor, the same length on every rank of the stage (padded here to a multiple of the
            ranks per host).
        groups: this rank's sub-groups (:func:`make_hierarchy`).
        shard_out: a hierarchical ZeRO-1's reduce-scatter instead: only the first two levels, leaving the global
            sum of this rank's ``1 / h`` of ``flat`` (whose length must then split into ``h``) in ``shard_out``.

    Returns:
        ``(levels, done)``: each level, called, starts one collective with ``async_op=True`` and returns its
        work (reduce-scatter in the host, all-reduce of the shard between hosts, all-gather in the host; only
        the middle one where this rank is alone on its host); ``done()`` then puts the sum in ``flat``. On a
        gloo host group the reduce-scatter is an all-to-all whose pieces the next level sums (see below).
    """
    n, h = flat.numel(), groups.per_host
    if shard_out is not None and (n % h or shard_out.numel() * h != n):
        raise ValueError(f"hierarchical_levels: {n} elements do not split into {h} shards of {shard_out.numel()}")
    if groups.intra is None:
        if shard_out is not None:
            return [lambda: dist.all_reduce(shard_out.copy_(flat), group=groups.inter, async_op=True)], lambda: None
        return [lambda: dist.all_reduce(flat, group=groups.inter, async_op=True)], lambda: None
    pad = (-n) % h
    buf = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    parts = list(buf.chunk(h))  # equal chunks: len(buf) is a multiple of h
    shard = torch.empty_like(parts[0]) if shard_out is None else shard_out
    gathered = [torch.empty_like(shard) for _ in range(h)] if shard_out is None else []

    def done() -> None:
        flat.copy_(torch.cat(gathered)[:n])

    if dist.get_backend(groups.intra) == _GLOO:
        # gloo's reduce-scatter work never reports completion before its wait() (is_completed stays False,
        # get_future is not implemented: torch 2.13), so a poll could not tell when to start the next level. An
        # all-to-all (each rank's chunk j to rank j, the same bytes as a ring reduce-scatter) does report it; the
        # next level first sums what arrived, in rank order.
        recv = torch.empty_like(buf)

        def scatter() -> Any:
            return dist.all_to_all_single(recv, buf, group=groups.intra, async_op=True)

        def between() -> Any:
            torch.sum(recv.view(h, -1), 0, out=shard)
            return dist.all_reduce(shard, group=groups.inter, async_op=True)
    else:
        def scatter() -> Any:
            return dist.reduce_scatter(shard, parts, group=groups.intra, async_op=True)

        def between() -> Any:
            return dist.all_reduce(shard, group=groups.inter, async_op=True)

    if shard_out is not None:
        return [scatter, between], lambda: None
    return [scatter, between, lambda: dist.all_gather(gathered, shard, group=groups.intra, async_op=True)], done


def hierarchical_all_reduce(flat: Tensor, groups: HierGroups) -> Tensor:
    """Sum ``flat`` over a stage's ranks in place: reduce-scatter in the host, all-reduce between hosts, all-gather.

    Exact in the sense that matters: every rank ends with the sum of every rank's tensor, as the flat
    all-reduce gives (the additions run in another order, so floats may differ in the last bits).

    Args:
        flat: a 1-D tensor, the same length on every rank of the stage (padded here to a multiple of the
            ranks per host).
        groups: this rank's sub-groups (:func:`make_hierarchy`).

    Returns:
        ``flat``, now holding the sum.
    """
    levels, done = hierarchical_levels(flat, groups)
    for start in levels:  # the same collectives as the overlapped chain (PendingChain), waited one by one
        start().wait()
    done()
    return flat


def hierarchical_reduce_scatter(flat: Tensor, groups: HierGroups) -> Tensor:
    """This rank's shard of the sum of ``flat`` over a stage's ranks: reduce-scatter in the host, all-reduce between.

    The first two levels of :func:`hierarchical_all_reduce`: shard ``l`` (``flat``'s ``l``-th of ``h`` equal
    chunks, ``l`` = :attr:`HierGroups.local`) summed over the host's ranks, then over the ranks holding shard ``l``
    on the other hosts. Blocking.

    Args:
        flat: a 1-D tensor whose length is a multiple of the ranks per host, the same on every rank.
        groups: this rank's sub-groups (:func:`make_hierarchy`).

    Returns:
        A new tensor of ``len(flat) / h`` elements: the global sum of this rank's shard.
    """
    h = groups.per_host
    if flat.numel() % h:
        raise ValueError(f"hierarchical_reduce_scatter: {flat.numel()} elements do not split into {h} shards")
    if groups.intra is None:
        shard = flat.clone()
    else:
        shard = torch.empty(flat.numel() // h, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter(shard, list(flat.chunk(h)), group=groups.intra)
    dist.all_reduce(shard, group=groups.inter)
    return shard


def hierarchical_gather_into(pieces: Sequence[tuple[Tensor, Tensor]], groups: HierGroups) -> None:
    """The third level on parameters, in place: for each ``(shard piece, out)``, ``out`` (``h`` times as long) gets
    the host's ranks' pieces in local order (``all_gather_into_tensor``: no copy). Blocking, one after another.

    Args:
        pieces: ``(this rank's piece, where the host's pieces go)``, the same sizes on every rank.
        groups: this rank's sub-groups (:func:`make_hierarchy`).
    """
    for piece, out in pieces:
        if groups.intra is None:
            out.copy_(piece)
            continue
        if out.device.type != "cpu" and dist.get_backend(groups.intra) == _GLOO:  # a GPU tensor over gloo: via host
            host = torch.empty(out.shape, dtype=out.dtype)
            dist.all_gather_into_tensor(host, piece.detach().cpu(), group=groups.intra)
            out.copy_(host)
        else:
            dist.all_gather_into_tensor(out, piece.detach().contiguous(), group=groups.intra)


def hierarchical_all_gather(shard: Tensor, groups: HierGroups) -> Tensor:
    """Every shard of the host's ranks, concatenated in local order (the third level, on parameters). Blocking.

    Args:
        shard: this rank's shard, the same length on every rank.
        groups: this rank's sub-groups (:func:`make_hierarchy`).

    Returns:
        ``h * len(shard)`` elements (``shard`` itself where the rank is alone on its host).
    """
    if groups.intra is None:
        return shard
    parts = [torch.empty_like(shard) for _ in range(groups.per_host)]
    dist.all_gather(parts, shard.contiguous(), group=groups.intra)
    return torch.cat(parts)


@dataclass(eq=False)
class PendingChain:
    """One bucket's hierarchical all-reduce launched during the backward: its levels run through a :class:`ChainQueue`.

    Attributes:
        queue: the stage's queue, which starts each level (in one order on every rank).
        levels: the collectives still to start, in order (:func:`hierarchical_levels`).
        done: puts the sum in :attr:`wire` once the last level is done.
        wire: the tensor summed (a host copy where a GPU tensor crosses gloo groups).
        out: where the sum must end up (``wire``, or the GPU tensor it was staged from).
        stats: the communicator's counters (the blocked wait is added to ``collective_s``).
        start: ``perf_counter`` at the launch.
        nbytes: bytes summed.
        group_size: ranks of the stage.
        stage: the stage, for the event log.
        events: the event log (None: none).
        device: this rank's device, synchronised after NCCL collectives for the timings.
        work: the level in flight (None: none yet, or between levels).
        issued: levels started so far (:attr:`started`: at least one).
        finished: the sum is in :attr:`out`.
    """

    queue: ChainQueue
    levels: list[Callable[[], Any]]
    done: Callable[[], None]
    wire: Tensor
    out: Tensor
    stats: CommStats
    start: float
    nbytes: int
    group_size: int
    stage: int
    events: Any = None
    device: torch.device = torch.device("cpu")
    work: Any = None
    issued: int = 0
    finished: bool = False

    @property
    def started(self) -> bool:
        """Whether its first collective has been started."""
        return self.issued > 0

    def poll(self) -> None:
        """Start whatever the finished levels allow, without blocking (called at each gradient hook)."""
        self.queue.advance()

    def wait(self) -> None:
        """Block until this bucket's sum is in :attr:`out` (the buckets before it finish first: one order)."""
        if self.finished:
            return
        t0 = time.perf_counter()
        self.queue.advance(until=self)
        if self.device.type == "cuda":  # here only, not in a poll: a hook must not stall the backward's queue
            torch.cuda.current_stream(self.device).synchronize()
        self.stats.collective_s += time.perf_counter() - t0

    def _finish(self) -> None:
        self.done()
        if self.wire is not self.out:
            self.out.copy_(self.wire)  # a GPU tensor staged through the host for gloo
        self.finished = True
        if self.events is not None:  # from the launch: the time it was in flight, overlapped or not
            self.events.add("ALLREDUCE", self.start, time.perf_counter(), self.stage, -1, self.group_size,
                            self.nbytes)


class ChainQueue:
    """A stage's pending hierarchical chains, whose collectives start in one fixed order on every rank.

    The order is bucket by bucket and, within a bucket, level by level: a bucket's reduce-scatter starts
    only once the bucket before it is done (its all-gather included). So each sub-group sees its collectives in
    bucket order whatever the timing of a rank's hooks and of the network (see the module docstring), and
    the collectives run one after another, as :func:`hpml_compile.stagecost.sync_ms` prices them.
    """

    def __init__(self) -> None:
        self.chains: list[PendingChain] = []

    def add(self, chain: PendingChain) -> PendingChain:
        """Queue ``chain`` after the others and start what can start now."""
        self.chains.append(chain)
        self.advance()
        return chain

    def advance(self, until: PendingChain | None = None) -> None:
        """Start each level whose predecessor is done, in order; ``until``: block until that chain finishes."""
        while self.chains:
            c = self.chains[0]
            if c.work is not None:
                if until is None and not c.work.is_completed():
                    return  # the level in flight is not done: nothing after it may start
                c.work.wait()  # done already (a no-op), or block: a later chain is waited for
                c.work = None
            if c.issued < len(c.levels):
                c.work = c.levels[c.issued]()
                c.issued += 1
                continue
            c._finish()
            self.chains.pop(0)
            if c is until:
                return
