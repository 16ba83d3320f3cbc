"""ZeRO over a stage's replicas: one flat buffer per stage, the optimizer built over this replica's shard only.

A stage replicated over ``d`` ranks with ZeRO-1 or ZeRO-2 (Rajbhandari et
al., SC 2020) runs with a :class:`FlatShard`:

- the stage's parameters (all but those tied to another stage, which stay
  replicated and all-reduced) are *views* into one flat buffer of
  ``n * d`` elements (``n = ceil(N / d)``), in the same order on every replica;
- the optimizer is built over one parameter, the slice ``[r n, (r+1) n)`` of
  that buffer (a view too), so its state (Adam's two moments) is ``1 / d`` of
  the stage's: **ZeRO-1 and ZeRO-2 hold only the owned shard of the optimizer
  state**;
- gradients accumulate, over every microbatch of the step, into a flat
  gradient buffer whose views are the parameters' ``.grad`` (autograd adds
  into an existing ``.grad`` in place, as DDP's ``gradient_as_bucket_view``);
  after the last backward one reduce-scatter leaves each replica the summed
  gradient of its shard, the optimizer steps the shard in place, and one
  all-gather brings every replica the other shards' new values;
- ZeRO-1 keeps the flat gradient buffer from step to step (reused: no fresh
  pages to fault in); **ZeRO-2 frees it after the reduce-scatter and keeps only
  the owned shard of the gradients** until the optimizer step.

ZeRO-0 (plain data parallel) on ranks uses :class:`FlatGrads`: the same flat
gradient buffer, all-reduced in place, so that no second flattened copy of
the gradients is made for the collective.

What this does not lower, said plainly: the *peak*. The gradients of a step
accumulate full-size over all microbatches before the one reduce-scatter, so
at the end of the backward every replica holds the whole stage's gradients
under ZeRO-2 as under ZeRO-1, and the parameters stay whole throughout. The
memory model (:func:`hpml_compile.stagecost.memory_parts`) counts exactly that
(parameters and gradients whole, optimizer state ``/ d``), so the solver does
not choose ZeRO-2 (it saves nothing at the peak over ZeRO-1). ZeRO-3 is
:class:`~.zero3.FlatShard3` (a subclass: the parameters sharded between uses,
gathered whole for the stage's compute, so not lower at the peak either).
Lowering the peak needs what FSDP2 does (per-layer gather units, a
reduce-scatter per microbatch during the backward); see below.

Why our own buffers and not torch's machinery:

- ``torch.distributed.fsdp.fully_shard`` (FSDP2), tried with torch 2.13 on
  two gloo CPU ranks: ``fully_shard`` of a *whole* generated gpt-tiny stage
  (1 stage x 2 replicas, 2 microbatches, our own gradient collectives turned
  off) trains two AdamW steps to the reference losses to 5 digits, its hooks
  working through our send/recv autograd functions. Per-layer units, the
  ones that lower the peak, fail: ``fully_shard`` of the model's blocks and
  then of the stage raises ``TypeError`` in ``DeviceMesh._concatenate``,
  because a stage binds some parameters directly (fx ``get_attr`` targets
  registered on container modules), which the stage's unit then meets as
  DTensors already. A whole-stage unit gathers every parameter for the
  compute, so it lowers no peak either. And every rank holds the whole model
  whose parameters the stages bind, so DTensor parameters would reach the
  checkpoints (saved by original names, loadable under any plan), the full
  state dict gathered across stages, the evaluation pass, the retry snapshot
  and the tied-parameter all-reduce between stages, which all read plain
  tensors. FSDP2 with per-layer units (binding modules, not parameters) is the
  way to lower the peak (ZeRO-2 with a reduce-scatter per microbatch, ZeRO-3
  per layer); it is not done here (:mod:`.zero3` gathers one unit per stage).
- ``torch.distributed.optim.ZeroRedundancyOptimizer`` shards by whole
  parameters (a greedy partition by size), so a replica's share is uneven and
  the memory model's ``1 / d`` would not hold; it also broadcasts every
  parameter from its owner after the step instead of one all-gather.

A flat shard keeps the hyper-parameters of one parameter group for the
whole shard: the factory passed as ``optimizer`` is called with the shard and
the stage's tied parameters, so per-parameter groups are not supported under
ZeRO (a plain ``lambda ps: AdamW(ps, lr=...)`` is).

**Overlapped sync** (:class:`GradBuckets`, as DDP's reducer), where the plan
overlaps the stage's sync (:func:`hpml_compile.plan.sync_overlap` above 0: GPU
groups; CPU ranks sync after the backward, since gloo's threads would take the
backward's cores) or ``Pipeline(overlap=True)`` forces it: on ranks the
flat gradient buffer is cut into buckets (by size, in reverse order of the
parameters, which is roughly the order the backward finishes them: DDP's
1 MiB first bucket, then 25 MiB). A ``post_accumulate_grad`` hook on each
parameter marks it ready; during the step's *last* backward (the pipeline
arms the buckets just before it: earlier microbatches only accumulate), a
bucket whose gradients are all ready is launched at once with
``async_op=True`` on the stage's group, so its collective runs while autograd
computes the rest. Buckets launch strictly in their fixed order (a ready
bucket waits for the ones before it), so every replica issues the same
collectives in the same order whatever its hooks' timing; whatever did not
launch during the backward (a parameter with no gradient this step) launches
at the stage's gradient collective (:meth:`.stage.StageSync.reduce`), which
then waits for all of them before the optimizer.
Under ZeRO-0 a bucket is a contiguous range of the buffer, all-reduced in
place (where the plan makes the stage's all-reduce hierarchical, each bucket
is a chain of a reduce-scatter in the host, an all-reduce between hosts and an
all-gather in the host, started level by level in one order on every rank by
:class:`~.comm.ChainQueue`; each gradient hook polls it, so a bucket's next
level starts during the backward once its previous one is done). Under ZeRO-1/2 the shard layout (replica ``r`` owns ``[r n, (r+1) n)``)
is kept, so a bucket is the same sub-range ``[a, b)`` *of every shard*: its
reduce-scatter gives each replica the sum of its own ``[r n + a, r n + b)``,
equal sizes on every rank. Such a bucket is ready only when every shard's
piece is, so under ZeRO the first launch waits until the backward has reached
the end of shard 0 (about ``(d-1)/d`` of it for the last buckets' pieces): less
overlap than ZeRO-0's, with the layout (and the checkpoint mapping) unchanged.
The collective of a bucket goes through one method, :meth:`GradBuckets.launch`
(where a compressing reducer would plug in).

**Hierarchical ZeRO-1** (a ZeRO-1 stage whose plan says ``allreduce:
hierarchical``, its replicas spread evenly over hosts; HSDP-like): the
optimizer is sharded over the ``L`` ranks of each host, not over all ``d``,
so each rank holds ``1 / L`` of the optimizer state (the same shard as the
rank at its position on every other host). The flat buffer is cut into
contiguous buckets, as ZeRO-0's (``[L a, L b)`` for the shard sub-range
``[a, b)``), each split into ``L`` pieces; a rank's shard is its piece of
every bucket, a tensor of its own (``P / L`` bytes, beside the flat
buffer), and so is the shard's summed gradient. A bucket's gradients are
reduce-scattered inside the host and the piece all-reduced between hosts
(the first two levels of the hierarchical all-reduce,
:meth:`.comm.DistComm.reduce_scatter_chain`, through the stage's
:class:`~.comm.ChainQueue`), launched by the gradient
hooks during the last backward where the stage overlaps (GPU groups; since
the buckets are contiguous ranges of the buffer they are ready as early as
ZeRO-0's), after it otherwise (one bucket: the contiguous layout,
:func:`~.hierarchy.hierarchical_reduce_scatter`). The optimizer steps the
shard, and the host's ranks all-gather each bucket's pieces straight into
the flat buffer (``all_gather_into_tensor``: no copy), after the step (prefetched
where the stage overlaps, below). Between hosts: the hierarchical all-reduce's bytes; inside: a
reduce-scatter of gradients and an all-gather of parameters. The same exact
sum as the flat reduce-scatter, added in another order.

**Prefetched parameter all-gather** (ZeRO-1/2 where the stage overlaps its sync, as the buckets):
after the optimizer step each bucket's all-gather is launched with ``async_op=True``
(:meth:`.comm.DistComm.gather_async`) in the order the forward reads the flat buffer (from its bottom), and
waited in a forward pre-hook on the first submodule of the stage that owns the bucket's parameters (parameters
the stage reads directly wait at its own pre-hook), as FSDP2's forward prefetch and DeepSpeed's ZeRO-3
prefetch hide theirs; our own hooks because the gather goes into our flat buffer (see above for why not FSDP2).
Every other reader waits for all of them first (:meth:`FlatShard.settle`: the state dict and checkpoints through
``whole``, the optimizer-state gather, the next reduce-scatter, ``Pipeline.close``/``settle``); an eval forward
goes through the hooks. A failed step drops its pending gathers (:meth:`FlatShard.forget`) and the retry gathers
again, blocking, before its forward (a dropped gather is not cancelled: the group's teardown waits for it to finish
or time out, see :meth:`FlatShard.forget`). Code that reads the model's parameters directly between steps must call
``Pipeline.settle()`` first; a gather left pending when the process group is destroyed can abort the rank.

Checkpoints stay plan-independent: :func:`full_optimizer_state` gathers the
shard's state back to whole per-parameter tensors under the original names
(what :mod:`.checkpoint` writes for any plan), and
:func:`load_full_optimizer_state` takes this replica's slice of them, so a run
saved under ZeRO resumes under another plan or replica count and the other
way round.

Example (one process: a stage "replicated" once, so the shard is everything):
    >>> import torch
    >>> lin = torch.nn.Linear(3, 2)
    >>> sh = FlatShard(0, list(lin.parameters()), replicas=1, replica=0, zero=1)
    >>> sh.numel, sh.shard_numel, lin.weight.untyped_storage().data_ptr() == sh.flat.untyped_storage().data_ptr()
    (8, 8, True)
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...codegen.comm import Comm
from ...errors import HpmlError
from ...memory import BUCKET_BYTES, FIRST_BUCKET_BYTES, ZeroStage, bucket_ranges
from .comm import DistComm
from .hierarchy import HierGroups
from .reducecast import down, launched

__all__ = ["FlatShard", "FlatGrads", "GradBuckets", "shards_of", "full_optimizer_state", "optimizer_templates",
           "load_full_optimizer_state"]


class GradBuckets:
    """The buckets of one flat gradient buffer, each launched asynchronously once its gradients are ready.

    Args:
        params: the parameters whose ``.grad`` are views of the buffer.
        members: per bucket (in launch order), the indices into ``params`` it needs ready.
        launch: ``launch(i)`` starts bucket ``i``'s collective and returns its pending handle (or None): a
            :class:`~.comm.PendingCollective`, or a :class:`~.comm.PendingChain` (a hierarchical all-reduce,
            whose later levels start as earlier ones finish: each hook polls it, without blocking).
    """

    def __init__(self, params: list[nn.Parameter], members: list[list[int]],
                 launch: Callable[[int], Any]) -> None:
        self.members = members
        self.launch = launch
        self._of: list[list[int]] = [[] for _ in params]
        for b, ms in enumerate(members):
            for i in ms:
                self._of[i].append(b)
        self.armed = False
        self._ready: set[int] = set()
        self._left: list[int] = []
        self._next = 0
        self.pending: list[Any] = []
        self.launched_in_backward = 0  # buckets started by a hook (not by finish) in the last step
        self.launched_early = 0  # ... of them, while some parameter's gradient was still to come (overlapped)
        self.started_in_backward = 0  # buckets whose first collective had started when the backward ended
        self.levels_in_backward = 0  # collectives started by then (a hierarchical bucket has three)
        self._count = len(params)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    def _hook(self, i: int) -> Callable[[Tensor], None]:
        def ready(_: Tensor) -> None:
            if self.armed and i not in self._ready:
                self._ready.add(i)
                for b in self._of[i]:
                    self._left[b] -= 1
                self._drain(in_backward=True)
                if self.pending:
                    self.pending[-1].poll()  # a hierarchical chain: start the levels its finished ones allow
        return ready

    def reset(self) -> None:
        """Forget the last step (its handles too: a failed step's group is gone)."""
        self.armed = False
        self._ready.clear()
        self._left = [len(ms) for ms in self.members]
        self._next = 0
        self.pending = []

    def arm(self) -> None:
        """The step's last backward is next: launch each bucket as soon as its gradients are all accumulated."""
        self.reset()
        self.launched_in_backward = self.launched_early = 0
        self.started_in_backward = self.levels_in_backward = 0
        self.armed = True
        self._drain(in_backward=True)  # a bucket of parameters no backward reaches (none) is ready at once

    def _drain(self, in_backward: bool) -> None:
        while self._next < len(self.members) and (not in_backward or self._left[self._next] <= 0):
            handle = self.launch(self._next)
            if handle is not None:
                self.pending.append(handle)
            self._next += 1
            self.launched_in_backward += in_backward
            self.launched_early += in_backward and len(self._ready) < self._count

    def finish(self) -> None:
        """Launch what has not started (in order), then wait for every bucket."""
        if self.armed:  # the backward is over: what it overlapped
            self.started_in_backward = sum(bool(h.started) for h in self.pending)
            self.levels_in_backward = sum(h.issued for h in self.pending)
        self._drain(in_backward=False)
        for h in self.pending:
            h.wait()
        self.pending = []
        self.armed = False

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self._handles:
            h.remove()


class FlatShard:
    """One stage's ZeRO-1/2 state on one replica (see the module docstring).

    Args:
        stage: the stage index.
        params: the stage's parameters to shard, in the same order on every replica.
        replicas: ``d``, the ranks the shards are spread over (under ``hier``: the ranks of one host, ``L``).
        replica: this rank's replica index ``r`` (under ``hier``: its index on its host).
        zero: the ZeRO stage (1 or 2).
        hier: this rank's sub-groups where the plan makes the ZeRO-1 stage hierarchical (HSDP-like: the shards
            over the host's ``L`` ranks, every host holding all of them; each bucket's reduce-scatter in the host
            and all-reduce between hosts through the communicator's ``reduce_scatter_chain``, or one
            ``reduce_scatter`` after the backward where not bucketed; the parameters gathered in place by its
            ``gather_into``). None: flat, over all ``d`` replicas.

    Raises:
        HpmlError: parameters of different dtypes or devices (one flat buffer holds them all), ZeRO-3, or
            ``hier`` not ZeRO-1 or not matching ``replicas``/``replica``.
    """

    def __init__(self, stage: int, params: list[nn.Parameter], *, replicas: int, replica: int,
                 zero: ZeroStage | int, hier: HierGroups | None = None) -> None:
        self.stage, self.replicas, self.replica = stage, replicas, replica
        self.zero = ZeroStage(zero)
        self.hier = hier
        if self.zero not in (ZeroStage.OS, ZeroStage.OS_G):
            raise HpmlError(f"stage {stage}: FlatShard shards ZeRO-1 and ZeRO-2, not ZeRO-{int(self.zero)} (ZeRO-3 is "
                            "runtime.sync.zero3.FlatShard3)")
        if hier is not None and (self.zero != ZeroStage.OS or (hier.per_host, hier.local) != (replicas, replica)):
            raise HpmlError(f"stage {stage}: a hierarchical shard is ZeRO-1 over the {hier.per_host} ranks of a host "
                            f"(this one at {hier.local}), but got ZeRO-{int(self.zero)} over {replicas} at {replica}")
        if not params:
            raise HpmlError(f"stage {stage}: ZeRO-{int(self.zero)} over no parameters")
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise HpmlError(f"stage {stage}: ZeRO keeps one flat buffer per stage, but its parameters have dtypes/"
                            f"devices {sorted(map(str, kinds))}: give them one dtype and device")
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = math.ceil(self.numel / replicas)
        dtype, device = params[0].dtype, params[0].device
        self.flat = torch.zeros(self.shard_numel * replicas, dtype=dtype, device=device)
        offset = 0
        self._views: list[tuple[int, int]] = []
        with torch.no_grad():
            for p in params:
                n = p.numel()
                self.flat[offset:offset + n].copy_(p.detach().reshape(-1))
                p.data = self.flat[offset:offset + n].view_as(p)
                self._views.append((offset, n))
                offset += n
        lo = replica * self.shard_numel
        self.param = nn.Parameter(self.flat[lo:lo + self.shard_numel])  # the optimizer steps this, in place
        if hier is not None:  # its own storage: one piece of every bucket (enable_overlap), gathered into the flat
            self.param = nn.Parameter(self.flat[lo:lo + self.shard_numel].clone())
        self.grad_flat: Tensor | None = None
        self.wire: torch.dtype | None = None  # the plan's reduce dtype where it is not the buffer's (.reducecast)
        self.comm: Comm | None = None  # the stage's communicator, set by the pipeline (and after a reconnect)
        self.checked = False
        self.buckets: GradBuckets | None = None  # overlapped reduce-scatter (enable_overlap)
        # shard sub-ranges in launch order; a hierarchical shard's bucket ``[a, b)`` is the flat range ``[L a, L b)``,
        # of which this rank owns piece ``replica`` (:meth:`_piece`); one bucket: the contiguous layout
        self._ranges: list[tuple[int, int]] = [(0, self.shard_numel)] if hier is not None else []
        self._out: Tensor | None = None  # this replica's summed shard, filled bucket by bucket
        # the prefetch (enable_prefetch): per bucket, its pending parameter all-gather; per parameter, its buckets
        self.prefetch = False
        self._gathers: dict[int, Any] = {}
        self._buckets_of: list[list[int]] = []
        self._owed = False  # a failed step may have lost gathers: re-gather (blocking) before the next forward
        self._hooks: list[Any] = []
        self.prefetched = 0  # bucket gathers waited by a forward pre-hook (launched after a step, not waited there)

    def enable_overlap(self, first_bytes: int = FIRST_BUCKET_BYTES, cap_bytes: int = BUCKET_BYTES) -> None:
        """Reduce-scatter bucket by bucket during the last backward (see the module docstring).

        A bucket is the sub-range ``[a, b)`` of every replica's shard; its size in bytes over all replicas
        is about ``first_bytes`` for the first bucket and ``cap_bytes`` for the others. A hierarchical shard
        (``hier``) cuts the flat buffer into contiguous buckets instead (as ZeRO-0 does), each split into the
        host's ``L`` pieces: its shard is this rank's piece of every bucket (see the module docstring).
        """
        if self.hier is not None:
            return self._enable_hier_overlap(first_bytes, cap_bytes)
        d, n = self.replicas, self.shard_numel
        size = self.flat.element_size()
        self._ranges = bucket_ranges(n, size, max(size, first_bytes // d), max(size, cap_bytes // d))
        members = []
        for a, b in self._ranges:
            members.append([i for i, (off, m) in enumerate(self._views)
                            if any(off < s * n + b and off + m > s * n + a for s in range(d))])
        self.buckets = GradBuckets(self.params, members, self.launch)

    def launch(self, i: int) -> Any:
        """Start bucket ``i``'s reduce-scatter into this replica's summed shard (the one collective call)."""
        self.settle()  # a parameter the forward never read: its gather goes first (the same order on every rank)
        assert self.grad_flat is not None and self.comm is not None
        if self._out is None:
            self._out = torch.empty(self.shard_numel, dtype=self.flat.dtype, device=self.flat.device)
        a, b = self._ranges[i]
        n = self.shard_numel
        parts = [down(self.grad_flat[s * n + a:s * n + b], self.wire) for s in range(self.replicas)]
        dst = self._out[a:b]
        out = dst if self.wire is None else torch.empty(b - a, dtype=self.wire, device=dst.device)
        return launched(self.comm.reduce_scatter_async(self.stage, parts, out), out, dst)  # type: ignore[attr-defined]

    def _piece(self, a: int, b: int, replica: int | None = None) -> slice:
        """The flat elements of ``replica``'s (default: this one's) piece of the hierarchical bucket ``[a, b)``."""
        r = self.replica if replica is None else replica
        return slice(self.replicas * a + r * (b - a), self.replicas * a + (r + 1) * (b - a))

    def _enable_hier_overlap(self, first_bytes: int, cap_bytes: int) -> None:
        L, n = self.replicas, self.shard_numel
        size = self.flat.element_size()
        self._ranges = bucket_ranges(n, size, max(size, first_bytes // L), max(size, cap_bytes // L))
        with torch.no_grad():  # the shard is now this rank's piece of every bucket
            for a, b in self._ranges:
                self.param[a:b].copy_(self.flat[self._piece(a, b)])
        members = [[i for i, (off, m) in enumerate(self._views) if off < L * b and off + m > L * a]
                   for a, b in self._ranges]
        self.buckets = GradBuckets(self.params, members, self._launch_hier)

    def _launch_hier(self, i: int) -> Any:
        """Start bucket ``i``'s reduce-scatter in the host and all-reduce between hosts into its part of the shard."""
        self.settle()  # a parameter the forward never read: its gather goes first (the same order on every rank)
        assert self.grad_flat is not None and self.comm is not None
        if self._out is None:
            self._out = torch.empty(self.shard_numel, dtype=self.flat.dtype, device=self.flat.device)
        a, b = self._ranges[i]
        bucket = down(self.grad_flat[self.replicas * a:self.replicas * b], self.wire)
        dst = self._out[a:b]
        out = dst if self.wire is None else torch.empty(b - a, dtype=self.wire, device=dst.device)
        return launched(self.comm.reduce_scatter_chain(self.stage, bucket, out), out, dst)  # type: ignore[attr-defined]

    # -- the prefetch: the parameter all-gather under the next forward ------------------------------
    def enable_prefetch(self, module: nn.Module) -> None:
        """Launch each bucket's parameter all-gather after the optimizer step without waiting for it, and wait for
        it just before the first module of ``module`` (the stage) that reads the bucket's parameters computes.

        Needs the buckets (:meth:`enable_overlap`). A forward pre-hook on each submodule the stage calls
        (its ``TARGETS`` that are modules; any module where it has none) waits for the buckets of the parameters
        under it; one on ``module`` itself waits, before anything, for those no called submodule owns (read
        directly, as fx ``get_attr`` does). Every other reader waits for all of them first (:meth:`settle`).
        """
        if self.buckets is None:
            raise HpmlError(f"stage {self.stage}: the parameter prefetch gathers by bucket: enable_overlap first")
        self._buckets_of = [[] for _ in self.params]
        for b, ms in enumerate(self.buckets.members):
            for i in ms:
                self._buckets_of[i].append(b)
        index = {id(p): i for i, p in enumerate(self.params)}
        called: list[nn.Module] = []
        for t in getattr(module, "TARGETS", None) or ():
            try:
                m = module.get_submodule(t)
            except AttributeError:
                continue  # a parameter or buffer target: read directly, waited at the stage's start
            called.append(m)
        covered: set[int] = set()
        for m in called:
            mine = sorted({b for p in m.parameters() if id(p) in index for b in self._buckets_of[index[id(p)]]})
            covered.update(index[id(p)] for p in m.parameters() if id(p) in index)
            if mine:
                self._hooks.append(m.register_forward_pre_hook(self._waiter(mine)))
        rest = sorted({b for i in range(len(self.params)) if i not in covered for b in self._buckets_of[i]})
        if rest or not called:
            self._hooks.append(module.register_forward_pre_hook(
                self._waiter(rest if called else list(range(len(self.buckets.members))))))
        self.prefetch = True

    def _waiter(self, buckets: list[int]) -> Callable[[nn.Module, Any], None]:
        def pre(_m: nn.Module, _args: Any) -> None:
            if self._gathers:
                self.wait_buckets(buckets, forward=True)
        return pre

    def wait_buckets(self, buckets: Iterable[int], *, forward: bool = False) -> None:
        """Wait for these buckets' pending parameter all-gathers (each at most once); ``forward``: a forward
        pre-hook asks (counted in :attr:`prefetched`)."""
        for b in buckets:
            h = self._gathers.pop(b, None)
            if h is not None:
                self.prefetched += forward
                try:
                    h.wait()
                except BaseException:
                    self.forget()
                    raise

    def settle(self) -> None:
        """Wait for every pending parameter all-gather: whoever reads or writes the parameters other than the
        stage's forward (checkpoints, the state dict, the next collective on the group, the end of the run)."""
        if self._gathers:
            self.wait_buckets(sorted(self._gathers))

    def forget(self) -> None:
        """A failed step: drop the pending gathers (their group is broken, about to be torn down); the step's retry
        gathers again, blocking, before its forward (:meth:`begin_step`), even where its forward had waited them all.

        Dropping a handle does not cancel its collective. On gloo (seen on two ranks, torch 2.13) it runs on, and
        tearing the group down (:meth:`.session.Session.reopen`) waits for it: it finishes once every peer has
        launched its side (the values land in the flat buffer before the retry), or fails at the group's time-out
        (the session's: :func:`.comm.make_groups`), and the retry's gather brings the values. Nothing may keep a
        dropped handle: it holds the group's gloo context, whose open sockets would keep a peer's pending collective
        on the failed group from failing, so the peer would not join the retry until its time-out
        (tests/dist/test_zero_retry_dist.py).

        Without the prefetch the gather is blocking, after the optimizer step; a step that failed there has its update
        applied and is not re-run (:class:`~hpml_compile.errors.UpdateApplied`), but this replica may still hold the
        other shards' old values: the next step gathers them first. Every rank that re-forms the group owes the
        gather, whatever failed, so that the replicas of the stage all run it."""
        self._gathers.clear()
        self._owed = True

    def _gather_order(self) -> list[int]:
        """The buckets in the order the forward reads them: from the bottom of the buffer (:attr:`_ranges`
        run from the top, the backward's order)."""
        return sorted(range(len(self._ranges)), key=lambda i: self._ranges[i][0])

    @property
    def owned(self) -> slice:
        """This replica's elements of the flat buffers."""
        lo = self.replica * self.shard_numel
        return slice(lo, lo + self.shard_numel)

    def begin_step(self) -> None:
        """Point every parameter's ``.grad`` at its slice of a zeroed flat gradient buffer."""
        if self.grad_flat is None:
            self.grad_flat = torch.zeros_like(self.flat)
        else:
            self.grad_flat.zero_()
        for p, (off, n) in zip(self.params, self._views):
            p.grad = self.grad_flat[off:off + n].view_as(p)
        self.param.grad = None
        self._out = None
        if self.buckets is not None:
            self.buckets.reset()
        if self._owed and self.comm is not None:  # after a failure: the parameters from the shards again, blocking
            self._gather_now(self.comm)

    def check(self, params: Iterable[Tensor]) -> None:
        """The generated code's parameter list must be this shard's (once: :attr:`checked` after)."""
        if self.checked:
            return
        got = {id(p) for p in params}
        if got != {id(p) for p in self.params}:
            raise HpmlError(f"stage {self.stage}: the build reduce-scatters {len(got)} parameter(s) but the runtime "
                            f"sharded {len(self.params)}: the build and the runtime disagree on the stage's "
                            "parameters (regenerate the build)")
        self.checked = True

    def reduce_scatter(self, comm: Comm) -> None:
        """After the last backward: this replica's shard of the summed gradient becomes the shard's ``.grad``."""
        self.settle()
        if self.grad_flat is None:
            self.begin_step()  # no backward ran (an empty step): zero gradients
        assert self.grad_flat is not None
        if self.buckets is not None:
            self.comm = comm
            self.buckets.finish()  # the buckets the backward did not launch, then the wait for all
            assert self._out is not None
            shard, self._out = self._out, None
        for p in self.params:
            p.grad = None  # the full gradient is not the summed one: nobody may read it as such
        if self.buckets is None:  # hierarchical: one bucket, contiguous pieces
            shard = comm.reduce_scatter(self.stage, down(self.grad_flat, self.wire))
            if self.wire is not None:
                shard = shard.to(self.flat.dtype)
        if self.hier is not None:
            self.param.grad = shard  # the shard is not a view of the flat buffer: its gradient is not either
            return
        if self.zero is ZeroStage.OS:
            own = self.grad_flat[self.owned]
            own.copy_(shard)
            self.param.grad = own  # the buffer stays for the next step
        else:
            self.param.grad = shard if shard.data_ptr() != self.grad_flat.data_ptr() else shard.clone()
            self.grad_flat = None  # ZeRO-2: only the shard of the gradients is held from here on

    def all_gather(self, comm: Comm) -> None:
        """After the optimizer step: every replica takes the other shards' new values (hierarchical: the host's
        ranks' pieces of each bucket, gathered into the flat buffer in place). With the prefetch on, each bucket's
        gather is only launched here, in the forward's order, and waited where the next forward first reads it."""
        self.settle()
        self._owed = False
        launch = comm.gather_async if isinstance(comm, DistComm) else None
        if self.prefetch and launch is not None and (self.flat.device.type == "cpu" or all(
                comm.devices[r].type == "cuda" for r in comm.ranks[self.stage])):  # type: ignore[attr-defined]
            L, n = self.replicas, self.shard_numel
            for i in self._gather_order():
                a, b = self._ranges[i]
                piece = self.param.detach()[a:b]
                outs = [self.flat[L * a:L * b]] if self.hier is not None else [
                    self.flat[s * n + a:s * n + b] for s in range(L)]
                handle = launch(self.stage, piece, outs)
                if handle is not None:
                    self._gathers[i] = handle
            if self.zero is ZeroStage.OS_G:
                self.param.grad = None
            return
        self._gather_now(comm)

    def _gather_now(self, comm: Comm) -> None:
        """The parameter all-gather, blocking; owed (:meth:`forget`) until it has succeeded."""
        self._owed = True
        if self.hier is not None:
            L = self.replicas
            pieces = [(self.param.detach()[a:b], self.flat[L * a:L * b]) for a, b in self._ranges]
            with torch.no_grad():
                comm.gather_into(self.stage, pieces)  # type: ignore[attr-defined]
            self._owed = False
            return
        with torch.no_grad():
            full = comm.all_gather(self.stage, self.param.detach(), into=self.flat)
            if full.data_ptr() != self.flat.data_ptr():
                self.flat.copy_(full)
        self._owed = False
        if self.zero is ZeroStage.OS_G:
            self.param.grad = None  # ZeRO-2: the shard's gradient is used up (ZeRO-1 keeps its buffer, seen here)

    @contextlib.contextmanager
    def whole(self, *, changed: bool = False) -> Iterator[None]:
        """A block that reads or writes the stage's parameters outside a step (checkpoints, as
        :class:`~.zero3.FlatShard3`'s); ``changed``: it wrote them, so a hierarchical shard, a tensor of its own,
        takes its pieces of the flat buffer after (a flat shard is a view of it: nothing to do). Pending prefetched
        gathers are waited first."""
        self.settle()
        yield
        if changed and self.hier is not None:
            with torch.no_grad():
                self.param.copy_(self._own(self.flat))

    # -- checkpoints: whole per-parameter state ------------------------------------------------------
    def _gather(self, t: Tensor) -> Tensor:
        """The whole flat tensor from every replica's shard (a collective over the stage's replicas)."""
        if self.replicas == 1:
            return t
        self.settle()  # the same group: every rank's pending gathers first, in one order
        comm = self.comm
        group = comm.groups.get((self.stage,)) if isinstance(comm, DistComm) else None
        if self.hier is not None:
            group = self.hier.intra  # every host holds every shard: gather inside this one
        parts = [torch.empty_like(t) for _ in range(self.replicas)]
        dist.all_gather(parts, t.contiguous(), group=group)
        if self.hier is None:
            return torch.cat(parts)
        whole = torch.empty(self.flat.numel(), dtype=t.dtype, device=t.device)  # each bucket's pieces in place
        for a, b in self._ranges:
            for r, part in enumerate(parts):
                whole[self._piece(a, b, r)] = part[a:b]
        return whole

    def _own(self, whole: Tensor) -> Tensor:
        """This replica's shard of a tensor laid out as the flat buffer."""
        if self.hier is None:
            return whole[self.owned]
        out = torch.empty(self.shard_numel, dtype=whole.dtype, device=whole.device)
        for a, b in self._ranges:  # bucket [a, b)'s piece at [a, b) of the shard (the ranges run from the top)
            out[a:b] = whole[self._piece(a, b)]
        return out

    def _per_element(self, t: Tensor) -> bool:
        if t.numel() == self.shard_numel and t.dim() == 1 and self.shard_numel > 1:
            return True
        if t.numel() <= 1:
            return False
        raise HpmlError(f"stage {self.stage}: optimizer state of shape {tuple(t.shape)} is neither per element "
                        f"({self.shard_numel}) nor a scalar: ZeRO supports element-wise optimizers (Adam, SGD, ...)")

    def full_state(self, state: dict[str, Any], *, gather: bool = True) -> list[dict[str, Tensor]]:
        """Per parameter, the optimizer state of the shard made whole (``gather=False``: empty tensors of its shape)."""
        out: list[dict[str, Tensor]] = [{} for _ in self.params]
        for key, value in state.items():
            if value is None:
                continue  # SGD without momentum keeps a None buffer: nothing to save
            t = value if isinstance(value, Tensor) else torch.tensor(value)
            if self._per_element(t):
                whole = self._gather(t) if gather else torch.empty(self.flat.numel(), dtype=t.dtype,
                                                                   device=t.device)
                for i, (p, (off, n)) in enumerate(zip(self.params, self._views)):
                    out[i][key] = whole[off:off + n].view_as(p).clone() if gather else whole[off:off + n].view_as(p)
            else:
                for i in range(len(self.params)):
                    out[i][key] = t.detach().clone()
        return out

    def load_state(self, state: dict[str, Any], per_param: list[dict[str, Tensor]]) -> None:
        """Set the shard's optimizer state (``state``, in place) from whole per-parameter tensors."""
        for key, value in list(state.items()):
            if value is None or not all(key in s for s in per_param):
                continue
            t = value if isinstance(value, Tensor) else torch.tensor(value)
            if self._per_element(t):
                whole = torch.zeros(self.flat.numel(), dtype=t.dtype, device=t.device)
                for (off, n), s in zip(self._views, per_param):
                    whole[off:off + n].copy_(s[key].reshape(-1))
                src = self._own(whole)
            else:
                src = per_param[0][key].reshape(t.shape)
            if isinstance(value, Tensor):
                with torch.no_grad():
                    value.copy_(src)
            else:
                state[key] = type(value)(src.item())


class FlatGrads:
    """ZeRO-0 of a replicated stage: gradients accumulate into one flat buffer, all-reduced in place.

    The parameters' ``.grad`` are views of the buffer (as DDP's ``gradient_as_bucket_view``), so the
    all-reduce needs no second, flattened copy of the gradients: the stage holds ``P`` bytes of gradients,
    as the memory model says, not ``2 P``.

    Args:
        stage: the stage index.
        params: its parameters not tied to another stage, in the same order on every replica.
    """

    def __init__(self, stage: int, params: list[nn.Parameter]) -> None:
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise HpmlError(f"stage {stage}: one gradient buffer per stage, but its parameters have dtypes/devices "
                            f"{sorted(map(str, kinds))}: give them one dtype and device")
        self.stage, self.params = stage, params
        self.reducer: Any = None  # a .compress.Reducer where the plan compresses or runs local SGD
        self.grad_flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.wire: torch.dtype | None = None  # the plan's reduce dtype where it is not the buffer's (.reducecast)
        self.checked = False
        self.comm: Comm | None = None  # set by the pipeline (and after a reconnect)
        self.buckets: GradBuckets | None = None  # overlapped all-reduce (enable_overlap)
        self._ranges: list[tuple[int, int]] = []
        self._grads: list[Tensor] = []  # each parameter's slice of grad_flat, its .grad (_point, at the first step)

    def enable_overlap(self, first_bytes: int = FIRST_BUCKET_BYTES, cap_bytes: int = BUCKET_BYTES) -> None:
        """All-reduce bucket by bucket during the last backward (see the module docstring)."""
        self._ranges = bucket_ranges(self.grad_flat.numel(), self.grad_flat.element_size(), first_bytes, cap_bytes)
        offsets, off = [], 0
        for p in self.params:
            offsets.append((off, p.numel()))
            off += p.numel()
        members = [[i for i, (o, m) in enumerate(offsets) if o < hi and o + m > lo] for lo, hi in self._ranges]
        self.buckets = GradBuckets(self.params, members, self.launch)

    def launch(self, i: int) -> Any:
        """Start bucket ``i``'s all-reduce, in place in the buffer (the one collective call)."""
        assert self.comm is not None
        lo, hi = self._ranges[i]
        piece = self.grad_flat[lo:hi]
        wire = down(piece, self.wire)
        return launched(self.comm.all_reduce_async((self.stage,), wire), wire, piece)  # type: ignore[attr-defined]

    def begin_step(self) -> None:
        """Zero the buffer and point every parameter's ``.grad`` at its slice.

        The slices are made once (:meth:`_point`) and a parameter's ``.grad`` is set only where it is not its
        slice already (after a ``p.grad = None``, say): making a hundred views and setting a hundred gradients
        each step cost about as much as a third of the small-op MLP's forward (benchmarks/runtime_overhead).
        """
        self.grad_flat.zero_()
        if not self._grads:
            self._point()
        for p, view in zip(self.params, self._grads):
            if p.grad is not view:
                p.grad = view
        if self.buckets is not None:
            self.buckets.reset()

    def _point(self) -> None:
        """Make each parameter's slice of the buffer (kept in ``_grads``) and point its ``.grad`` at it."""
        offset, self._grads = 0, []
        for p in self.params:
            view = self.grad_flat[offset:offset + p.numel()].view_as(p)
            self._grads.append(view)
            p.grad = view
            offset += p.numel()

    def _move_to_host_slot(self, comm: Comm) -> None:
        """After the first all-reduce through shared memory: the buffer moves into this rank's slot of it, so
        that the next steps' gradients accumulate where the sum reads them (no copy in; one buffer, as before). A
        buffer summed through gloo (a small one: :attr:`~.comm.DistComm.direct_bytes`) stays where it is."""
        nbytes = self.grad_flat.numel() * self.grad_flat.element_size()
        host = comm.host_reduce if isinstance(comm, DistComm) and nbytes >= comm.direct_bytes else None
        mapped = host((self.stage,), nbytes) if host else None
        slot = mapped.own(self.grad_flat.numel(), self.grad_flat.dtype) if mapped is not None else None
        if slot is not None and slot.data_ptr() != self.grad_flat.data_ptr():
            slot.copy_(self.grad_flat)
            self.grad_flat = slot
            self._point()

    check = FlatShard.check

    def all_reduce(self, comm: Comm) -> None:
        """Sum the gradients over the stage's replicas, in place: what the plan's reducer leaves (compression,
        local SGD: never overlapped), else the buckets' all-reduces under overlap, else one all-reduce."""
        if self.reducer is not None:
            return self.reducer.reduce(comm, self.stage, self.grad_flat, self.params)
        if self.buckets is not None:
            self.comm = comm
            self.buckets.finish()
            return
        if self.wire is not None:  # summed in the reduce dtype, on a copy (.reducecast)
            wire = down(self.grad_flat, self.wire)
            comm.all_reduce((self.stage,), wire)
            self.grad_flat.copy_(wire)
            return
        comm.all_reduce((self.stage,), self.grad_flat)
        self._move_to_host_slot(comm)


def shards_of(optimizer: torch.optim.Optimizer | None) -> list[FlatShard]:
    """The ZeRO shards an optimizer steps (set by the pipeline as ``optimizer.hpml_zero``); [] for none."""
    return list(getattr(optimizer, "hpml_zero", ()) or ())


def _names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return names


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Materialise the optimizer state (a step with zero gradients and lr 0), as DCP's state_dict helpers do."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, gather: bool = True
                         ) -> dict[str, dict[str, Tensor]]:
    """The optimizer state per original parameter name, shards made whole (a collective when ``gather``).

    Args:
        model: this rank's module, parameters named as in the original model.
        optimizer: an optimizer over ZeRO shards (:func:`shards_of`) and plain parameters.
        gather: gather the shards (saving); False gives empty tensors of the right shapes (loading).

    Returns:
        ``{name: {state key: tensor}}``, one name per parameter (its first).
    """
    _init_state(optimizer)
    names = _names(model)
    shards = {id(s.param): s for s in shards_of(optimizer)}
    out: dict[str, dict[str, Tensor]] = {}
    for group in optimizer.param_groups:
        for q in group["params"]:
            state = optimizer.state.get(q, {})
            sh = shards.get(id(q))
            if sh is not None:
                for p, s in zip(sh.params, sh.full_state(state, gather=gather)):
                    out[names[id(p)]] = s
            elif id(q) in names:
                out[names[id(q)]] = {k: v if isinstance(v, Tensor) else torch.tensor(v) for k, v in state.items()
                                     if v is not None}
    return out


def optimizer_templates(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Tensor]]:
    """What :func:`load_full_optimizer_state` reads into: :func:`full_optimizer_state` without the collective."""
    return full_optimizer_state(model, optimizer, gather=False)


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                              per_name: dict[str, dict[str, Tensor]]) -> None:
    """Set the optimizer state from whole per-parameter tensors by original name (each shard takes its slice).

    Args:
        model: this rank's module.
        optimizer: the optimizer (over shards and plain parameters).
        per_name: ``{name: {state key: tensor}}``; names it lacks keep their current state.
    """
    _init_state(optimizer)
    names = _names(model)
    shards = {id(s.param): s for s in shards_of(optimizer)}
    for group in optimizer.param_groups:
        for q in group["params"]:
            state = optimizer.state[q]
            sh = shards.get(id(q))
            if sh is not None:
                per = [per_name.get(names[id(p)], {}) for p in sh.params]
                sh.load_state(state, per)
            elif id(q) in names and names[id(q)] in per_name:
                for k, v in per_name[names[id(q)]].items():
                    if k in state and isinstance(state[k], Tensor):
                        with torch.no_grad():
                            state[k].copy_(v.reshape(state[k].shape))
                    elif k in state:
                        state[k] = type(state[k])(v.item())
