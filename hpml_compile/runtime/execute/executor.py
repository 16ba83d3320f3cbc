"""The one executor: run a build's per-rank action lists, in one process or on this rank.

Codegen lowered the plan's schedule into one action list per rank
(:mod:`hpml_compile.schedule`: ``0F3``, ``1RECV0:3``, ``1B3``,
``ALLREDUCE.flat(0,1)``, ``LOSS``, ``OPT0``); :func:`run_actions` carries them out
and decides nothing: each token goes to the handler of its kind
(:data:`HANDLERS`, one for every kind a rank's list may hold):

- ``kFj``: the forward of microbatch ``j`` on stage ``k`` (the last stage adds
  the loss of its slice, scaled by ``1 / (microbatches x replicas)``, or by
  ``rows[r] / (microbatches x microbatch rows)`` where the plan gives the
  replicas uneven rows (``Stage.rows``), so that the gradients sum to the
  batch mean's and the gradient all-reduce stays a plain sum); ``kBj``: its backward, then the
  zero gradients a replica still owes (:meth:`~hpml_compile.codegen.comm.Comm.settle`);
- ``kIj`` / ``kWj`` (ZB-H1): the backward in two parts (:mod:`.split`): ``I`` the gradients of
  what the stage received (left in the mailbox for the next ``SEND``) and the zero gradients owed,
  ``W`` later the parameters' gradients;
- ``kRECVp:j``: receive microbatch ``j``'s values from stage ``p`` (activations
  from an earlier stage, shaped by the stage's ``RECV`` specs; gradients of
  what was sent to a later one) into the communicator's mailbox, where the
  next forward's ``ops.recv`` (or backward's ``ops.send``) takes them;
  ``kSENDp:j``: send what the forward's ``ops.send`` (or the backward's
  ``ops.recv``: the gradients owed) left there, without waiting
  (:mod:`hpml_compile.codegen.mailbox`);
- a collective (``ALLREDUCE.shm(0)``): the :class:`~..sync.stage.StageSync`
  of its stages runs it (the implementation its suffix names, chosen from
  the plan), on the parameters the stage lists for the token
  (``COLLECTIVES``); before ``OPTk`` it sums gradients, after it (ZeRO's
  all-gather, local SGD's average) it moves parameters;
- ``LOSS``: wait for this process's sends, and agree on the loss (ranks: an
  all-reduce, or what rode the gradient collective where ``agree`` boards one,
  :mod:`.batchcheck`); ``OPTk``: the optimizer step (once per process).

Each token runs on the stage it names: under interleaved 1F1B a rank holds
several stages (``v`` chunks, :func:`hpml_compile.schedule.rank_stages`) and its
one list interleaves their tokens; a collective moves the parameters that the
rank's stages of its group list for it (a parameter two of them share, once),
and ``OPTk`` steps every stage of the process at the first of them.

On a rank the list is its own (:func:`step_rank`, :class:`~.pipeline.Pipeline`);
in one process (:func:`step_local`, a Pipeline without a process group) the
lists of all ranks are merged by :func:`local_order`, a replay of the
validator's with every forward of a microbatch before the next and later
stages first in backward (for GPipe the order of the single-process runs
before the schedule was lowered), all stages chained through a mailbox
(:class:`~.comm.LocalComm`). A batch of ``c`` build batches runs the lists
lowered again for ``c x M`` microbatches (:func:`actions_for`).

Why our own and not torch.distributed.pipelining: its ``PipelineStage`` does
the point-to-point itself around a module, whereas codegen makes the
stage boundaries explicit nodes of each stage's graph (so a reader sees
them) and the lowered lists say when each message moves; this executor
runs the tokens in that order, as its ``_perform_action`` does.

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
    >>> [str(a) for a in build.actions[1]][:4]
    ['1RECV0:0', '1F0', '1RECV0:1', '1F1']
    >>> result = step_local(build, (x,), y, torch.nn.functional.mse_loss)
    >>> expected = torch.nn.functional.mse_loss(model(x), y)
    >>> bool(torch.isclose(result.loss, expected))
    True
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from ...codegen import Build
from ...codegen.comm import Comm
from ...codegen.mailbox import expect_recv, post_recv, post_send
from ...codegen.stage import StageModule
from ...errors import HpmlError, UpdateApplied
from ...precision import autocast
from ...plan import Plan
from ...schedule import (MARKERS, Action, ActionKind, RankActions, SyncImpl, deferral, rank_layout, rank_stages,
                        relower, stage_ranks, sync_impl, with_averages)
from ...schedule_check import replay, validate
from ...trainspec import Split, split_of
from ..sync.comm import DistComm, LocalComm, dist_comm
from ..sync.stage import UNBUFFERED, StageSync
from .ahead import Ahead
from .scaler import LossScaler
from .slices import loss_share, merge_outputs, split_microbatches, split_replicas, to_device
from ...backsplit import Deferred, backward_input, backward_weight

__all__ = ["StepResult", "StepRun", "stage_ranks", "rank_layout", "split_microbatches", "split_replicas",
           "loss_share", "stage_splits", "stage_sends", "merge_outputs",
           "to_device", "forward_stage", "actions_for", "local_order", "run_actions", "step_local", "step_rank",
           "LocalComm", "DistComm", "dist_comm", "HANDLERS"]


def stage_splits(build: Build) -> list[Split]:
    """Each stage's :data:`~hpml_compile.trainspec.Split` in ``build``'s plan."""
    return [split_of(len(st.devices), st.rows) for st in build.plan.stages]


def stage_sends(build: Build) -> list[bool]:
    """Per stage, whether it sends values to the next one (its lowered list holds ``kSENDk+1`` tokens)."""
    lists = actions_for(build, build.plan.microbatches)
    return [any(a.kind is ActionKind.SEND and a.stages == (k, k + 1) for a in lists[ranks[0]])
            for k, ranks in enumerate(stage_ranks(build.plan))]


def forward_stage(build: Build, stage: StageModule, micro: Sequence[Any], device: torch.device) -> Any:
    """Call a stage on the model inputs it reads, taken by name from one microbatch's positional inputs.

    Under a mixed-precision plan the call runs under ``torch.autocast`` on ``device``'s type
    (:func:`hpml_compile.precision.autocast`; the weight casts are cached for this one call).
    """
    names = [s.name for s in build.manifest.inputs]
    by_name = dict(zip(names, [x for x in micro if isinstance(x, Tensor)]))
    with autocast(device.type, build.plan.precision):
        return stage(*[to_device(by_name[n], device) for n in stage.INPUTS])


def actions_for(build: Build, microbatches: int, plan: Plan | None = None) -> list[RankActions]:
    """The build's action lists for a batch of ``microbatches`` (the manifest's own for the build's count).

    Args:
        build: the loaded build.
        microbatches: the batch's microbatches.
        plan: the running plan, where the run's sync options changed the build's
            (:func:`hpml_compile.plan.with_comm`): a stage it gives local SGD averages its parameters after the
            optimizer step (:func:`hpml_compile.schedule.with_averages`).

    Raises:
        ScheduleError: the lists lowered again do not validate.
    """
    replicas, v = [len(st.devices) for st in build.plan.stages], build.plan.chunks
    if microbatches == build.plan.microbatches and build.actions:
        out = list(build.actions)
    else:
        out = relower(build.actions, replicas, build.plan.schedule, microbatches, deferral(build.plan), chunks=v)
        validate(out, replicas, deferral(build.plan), chunks=v)
    if plan is not None and plan is not build.plan:
        local = [k for k, st in enumerate(plan.stages) if st.replicas > 1 and sync_impl(plan, (k,)) is SyncImpl.LOCAL]
        out = with_averages(out, replicas, local, chunks=v)
    return out


def _local_key(rank: int, a: Action) -> tuple[int, ...]:
    if a.kind in MARKERS:
        return (0,)  # a message as soon as it can: a send right after its compute, a receive when sent
    if a.kind is ActionKind.FORWARD:
        return (1, 0, a.microbatch or 0, a.stage, rank)
    if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
        return (1, 1, a.microbatch or 0, -a.stage, rank)
    if a.kind is ActionKind.BACKWARD_WEIGHT:
        return (1, 2, a.microbatch or 0, -a.stage, rank)
    return (2, rank)


def local_order(build: Build, microbatches: int) -> list[tuple[int, Action]]:
    """Every rank's actions merged into one order for a single process (see the module docstring).

    Raises:
        ScheduleError: the lists deadlock.
    """
    return replay(actions_for(build, microbatches), [len(st.devices) for st in build.plan.stages], _local_key,
                  chunks=build.plan.chunks)


@dataclass
class StepRun:
    """What one run of action lists did on this process.

    Attributes:
        shares: ``(microbatch, replica, loss share)`` of each slice whose last stage ran here, in run order.
        loss_sum: their sum in float64 on the CPU (after ``LOSS`` on ranks: what ``agree`` made of it).
        outputs: ``(microbatch, replica, detached model output)`` where asked for.
        busy: ``(stage, forward?)`` -> seconds computing, not counting receive waits nor the collectives run
            inside the forward and backward calls.
        inner_comm_s, inner_wait_s: seconds of collectives inside the forward and backward calls (ZeRO-3's
            parameter all-gathers, a prefetched gather waited for), and of waiting there for their other members.
        t_start, t_pipe, t_synced, t_opt, t_end: ``perf_counter`` at the start, the end of the last
            backward, the end of the gradient sync, after ``LOSS``, and the end.
        tokens_s: seconds inside the tokens' handlers, all of them (the rest of ``t_end - t_start`` is the run's
            own set-up and its loop between tokens).
        loss_s: seconds in ``LOSS`` (waiting for this process's sends, the loss agreement).
        skipped: the optimizer step was skipped (fp16: a gradient overflowed on some rank).
        regrouped: the loss agreement failed here after reaching the others, who committed the step; the process
            group was re-formed (``agree`` returned True), this rank takes the update too, and the parameter
            collectives after the optimizer step are owed to the next step (as after
            :class:`~hpml_compile.errors.UpdateApplied`).
    """

    shares: list[tuple[int, int, Tensor]] = field(default_factory=list)
    loss_sum: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    outputs: list[tuple[int, int, Any]] = field(default_factory=list)
    busy: dict[tuple[int, bool], float] = field(default_factory=dict)
    t_start: float = 0.0
    t_pipe: float = 0.0
    t_synced: float = 0.0
    t_opt: float = 0.0
    t_end: float = 0.0
    inner_comm_s: float = 0.0
    inner_wait_s: float = 0.0
    tokens_s: float = 0.0
    loss_s: float = 0.0
    skipped: bool = False
    regrouped: bool = False


def _unscaled_finite(optimizer: torch.optim.Optimizer, scaler: LossScaler,
                     agree_inf: Callable[[Tensor], None] | None, run: StepRun) -> bool:
    """Unscale the gradients, agree on found-inf (one all-reduce), update the scale: whether to step."""
    found = scaler.unscale_(p for g in optimizer.param_groups for p in g["params"])
    if agree_inf is not None:
        agree_inf(found)
    run.skipped = bool(found.item() > 0)
    scaler.update(run.skipped)
    return not run.skipped


class _Slices:
    """Microbatch ``j``'s rows for replica ``r`` of ``d``, split once and kept.

    ``own``: ``value`` holds only this rank's rows already (its part of each microbatch, in microbatch order,
    :func:`hpml_compile.trainspec.rank_rows`), so microbatch ``j`` is all a replica gets.
    """

    def __init__(self, value: Any, microbatches: int, own: bool = False) -> None:
        self._micro = [value] if microbatches == 1 else split_microbatches(value, microbatches)
        self._parts: dict[tuple[int, int], list[Any]] = {}
        self._own = own

    def get(self, j: int, d: Split, r: int) -> Any:
        if self._own:
            return self._micro[j]
        if (d, j) not in self._parts:
            self._parts[(d, j)] = split_replicas(self._micro[j], d)
        return self._parts[(d, j)][r]


def run_actions(build: Build, order: Sequence[tuple[int, Action]], stages: dict[int, StageModule], comm: Comm,
                inputs: Sequence[Any], targets: Any, loss_fn: Callable[[Any, Any], Tensor], microbatches: int, *,
                device: torch.device = torch.device("cpu"), optimizer: torch.optim.Optimizer | None = None,
                agree: Callable[[Tensor], bool | None] | None = None, keep_outputs: bool = False,
                own_rows: bool = False, scaler: LossScaler | None = None,
                agree_inf: Callable[[Tensor], None] | None = None,
                arm: Callable[[int], None] | None = None,
                syncs: Mapping[tuple[int, ...], StageSync] | None = None) -> StepRun:
    """Carry out ``order`` (see the module docstring): the one code path of every training step.

    Args:
        build: the loaded build.
        order: ``(rank, action)`` in the order to run them: one rank's list, or :func:`local_order`.
        stages: the stage modules this process holds, by index (their ``hpml_comm`` set to ``comm``).
        comm: this process's communicator.
        inputs: the model's positional inputs for the whole batch.
        targets: the targets for ``loss_fn`` (split like the inputs).
        loss_fn: ``(output, targets) -> loss``, a mean over the rows it is given.
        microbatches: how many microbatches the batch splits into (the lists were lowered for it).
        device: where this process's stages run.
        optimizer: stepped at ``OPT`` (None: gradients only; ``after_step`` is then skipped too).
        agree: called at ``LOSS`` with the float64 loss sum, to make it the batch's (an all-reduce on ranks);
            True when it had to re-form the process group to learn it (:attr:`StepRun.regrouped`). Where it has a
            ``board(stages, loss_sum)`` (:class:`.batchcheck.StepAgreement`), each gradient collective first asks
            it for a :class:`~..sync.comm.Rider` to carry (set as ``comm.rider`` for that collective only).
        keep_outputs: keep the last stage's outputs.
        own_rows: ``inputs`` and ``targets`` hold only this rank's rows (one stage replica on this process;
            see :class:`_Slices`), not the whole batch.
        scaler: fp16 loss scaling: the backward starts from the scaled loss; at ``OPT`` the gradients are
            unscaled, ``agree_inf`` makes the found-inf flag the job's, and the step is taken or skipped
            (``run.skipped``) and the scale updated alike on every rank (:mod:`.scaler`).
        agree_inf: called with the float32 found-inf flag to make it every rank's (a MAX all-reduce on ranks).
        arm: called with stage ``k`` just before ``k``'s last backward in ``order`` (the overlapped gradient
            buckets of :mod:`.zero` launch during it; earlier backwards only accumulate).
        syncs: the sync of each group of stages that has one on this process (:func:`..sync.stage.for_stage`);
            any other collective runs unbuffered (:class:`..sync.stage.Unbuffered`).

    Returns:
        The losses, outputs, busy times and phase timestamps.
    """
    step = _Step(build, stages, comm, inputs, targets, loss_fn, microbatches, device=device, optimizer=optimizer,
                 agree=agree, keep_outputs=keep_outputs, own_rows=own_rows, scaler=scaler, agree_inf=agree_inf,
                 arm=arm, order=order, syncs=syncs)
    run = step.run
    if step.ahead is not None:
        for rank, k, p, j in step.ahead.first:
            expect_recv(comm, k, p, j, step.layout[rank][1], stages[k].RECV)
    for index, (rank, a) in enumerate(order):
        t0 = time.perf_counter()
        HANDLERS[a.kind](step, index, rank, a)
        run.tokens_s += time.perf_counter() - t0
    run.t_end = time.perf_counter()
    return step.run


class _Step:
    """One run of action lists in progress: what the handlers share (see :data:`HANDLERS`)."""

    def __init__(self, build: Build, stages: dict[int, StageModule], comm: Comm, inputs: Sequence[Any],
                 targets: Any, loss_fn: Callable[[Any, Any], Tensor], microbatches: int, *, device: torch.device,
                 optimizer: torch.optim.Optimizer | None, agree: Callable[[Tensor], bool | None] | None,
                 keep_outputs: bool, own_rows: bool, scaler: LossScaler | None,
                 agree_inf: Callable[[Tensor], None] | None, arm: Callable[[int], None] | None,
                 order: Sequence[tuple[int, Action]], syncs: Mapping[tuple[int, ...], StageSync] | None) -> None:
        self.build, self.stages, self.comm, self.loss_fn, self.n = build, stages, comm, loss_fn, microbatches
        self.device, self.optimizer, self.agree, self.keep_outputs = device, optimizer, agree, keep_outputs
        self.scaler, self.agree_inf, self.arm = scaler, agree_inf, arm
        self.reps = stage_splits(build)
        self.layout = rank_layout(build.plan)
        self.last = len(self.reps) - 1
        self.run = StepRun(t_start=time.perf_counter())
        self.xs = _Slices(tuple(inputs), microbatches, own_rows)
        self.ys = _Slices(targets, microbatches, own_rows) if self.last in stages else None
        self.roots: dict[tuple[int, int, int], list[Tensor]] = {}
        self.deferred: dict[tuple[int, int, int], Deferred] = {}  # ZB-H1: what each I left for its W
        self.syncs = syncs or {}
        self.synced: set[tuple[int, Action]] = set()
        self.stepped: set[tuple[int, Action]] = set()
        self.optimized = self.done_compute = self.done_sync = False
        self.cuda = device.type == "cuda"
        self.last_bwd = {a.stage: i for i, (rank, a) in enumerate(order)
                         if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)}  # where gradients land
        self.ev = comm.events  # an EventLog (.events) where the pipeline records this step's events
        # receives posted ahead of their tokens, where the transport gains from it (gloo, .ahead)
        self.ahead = Ahead(order) if type(comm).expect is not Comm.expect else None

    def event(self, kind: str, t0: float, t1: float, stage: int, microbatch: int = -1) -> None:
        if self.ev is not None:
            self.ev.add(kind, t0, t1, stage, *((microbatch,) if microbatch >= 0 else ()))

    def phase(self, synced: bool) -> None:
        """Mark the end of the compute (at the first action after it) and, with ``synced``, of the gradient sync."""
        if not self.done_compute:
            self.run.t_pipe, self.done_compute = time.perf_counter(), True
        if synced and not self.done_sync:
            self.run.t_synced, self.done_sync = time.perf_counter(), True


def _compute(step: _Step, index: int, rank: int, a: Action) -> None:
    """``kFj`` / ``kBj`` / ``kIj`` / ``kWj``: the forward (the last stage adds its slice's loss share), the backward
    of one slice, or one of its two parts (:mod:`.split`)."""
    k, r = a.stage, step.layout[rank][1]  # a rank of an interleaved plan holds several stages
    j, comm, run = a.microbatch or 0, step.comm, step.run
    comm.microbatch, comm.replica = j, r
    stats = getattr(comm, "stats", None)  # a DistComm's: the collectives that run inside this call
    c0 = (stats.collective_s, stats.collective_wait_s) if stats is not None else (0.0, 0.0)
    t0 = time.perf_counter()
    fwd = a.kind is ActionKind.FORWARD
    if fwd:
        _forward(step, k, r, j)
    elif a.kind is ActionKind.BACKWARD_WEIGHT:
        if step.arm is not None and step.last_bwd.get(k) == index:
            step.arm(k)
        backward_weight(step.deferred.pop((k, r, j)))
    else:
        root = step.roots.pop((k, r, j))
        if a.kind is ActionKind.BACKWARD_INPUT:
            step.deferred[(k, r, j)] = backward_input(root, list(step.stages[k].parameters()))
        else:
            if step.arm is not None and step.last_bwd.get(k) == index:
                step.arm(k)
            if root:
                torch.autograd.backward(root)
        comm.settle(k, r, j)
    if step.cuda:
        torch.cuda.current_stream(step.device).synchronize()
    t1 = time.perf_counter()
    # a collective inside the call (ZeRO-3 gathers the stage's parameters in its hooks) is communication and waiting
    # for peers, not compute: the plan prices it with the stage's sync, and the report shows it apart
    moved, waited = (stats.collective_s - c0[0], stats.collective_wait_s - c0[1]) if stats is not None else (0.0, 0.0)
    run.inner_comm_s += moved
    run.inner_wait_s += waited
    run.busy[(k, fwd)] = run.busy.get((k, fwd), 0.0) + max(0.0, t1 - t0 - moved - waited)
    step.event("F" if fwd else "B", t0, t1, k, j)  # I and W are backward work (the event kinds of .observe)


def _forward(step: _Step, k: int, r: int, j: int) -> None:
    build, device, run, n = step.build, step.device, step.run, step.n
    out = forward_stage(build, step.stages[k], step.xs.get(j, step.reps[k], r), device)
    if k != step.last:
        step.roots[(k, r, j)] = [out] if isinstance(out, Tensor) and out.requires_grad else []
        return
    assert step.ys is not None
    out = build.model_output(out)  # what the model returns, as the user's loss expects it
    with autocast(device.type, build.plan.precision):  # as an autocast training loop does
        loss = loss_share(step.loss_fn(out, to_device(step.ys.get(j, step.reps[k], r), device)), step.reps[k], r, n)
    run.loss_sum += loss.detach().double().cpu()
    run.shares.append((j, r, loss.detach()))
    if step.keep_outputs:
        run.outputs.append((j, r, tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out)))
    # fp16: backward from the scaled loss (unscaled at OPT; no optimizer: the true gradients)
    scaled = step.scaler is not None and step.optimizer is not None
    step.roots[(k, r, j)] = [step.scaler.scale_loss(loss) if scaled else loss]  # type: ignore[union-attr]


def _message(step: _Step, index: int, rank: int, a: Action) -> None:
    """``kRECVp:j``: receive into the mailbox what the next forward or backward takes (blocks); ``kSENDp:j``:
    send what the last one left there (never blocks; waited for at ``LOSS``)."""
    k, r, p, j = a.stage, step.layout[rank][1], a.stages[1], a.microbatch or 0
    ahead = step.ahead
    if a.kind is ActionKind.RECV:
        if ahead is not None and (after := ahead.next.get((rank, k, p, j))) is not None:
            expect_recv(step.comm, k, p, after, r, step.stages[k].RECV)  # the stream's next, one buffer ahead
        post_recv(step.comm, k, p, j, r, step.stages[k].RECV)
    else:
        post_send(step.comm, k, p, j, r)
        if ahead is not None and (rank, k, p, j) in ahead.grads:
            expect_recv(step.comm, k, p, j, r)  # the gradients this forward's values will be answered with


def _collective(step: _Step, index: int, rank: int, a: Action) -> None:
    """A collective token: handed to the sync of its stages (:mod:`..sync.stage`, the implementation its suffix
    names), with the parameters the stage lists for it; before ``OPTk`` it sums gradients, after it (ZeRO's
    all-gather, local SGD's average) it moves parameters, and a failure there leaves the update applied."""
    k = next(x for x in a.stages if x in step.stages)  # the token's stages this process holds, the first
    step.phase(synced=step.optimized)
    key = (k, a)  # one process running several replicas of a stage, or several of its stages: each token once
    sync = step.syncs.get(a.stages, UNBUFFERED)
    params = sync.token_params(lambda: _token_params(step, a))
    if not step.optimized:
        if key not in step.synced:
            step.synced.add(key)
            t0 = time.perf_counter()
            board = getattr(step.agree, "board", None)  # the loss agreement may ride this collective (.batchcheck)
            step.comm.rider = board(a.stages, step.run.loss_sum) if board is not None else None
            try:
                sync.run(a, step.comm, params)
            finally:
                step.comm.rider = None
            step.event("SYNC", t0, time.perf_counter(), k)
        return
    if step.optimizer is None or key in step.stepped:
        return
    step.stepped.add(key)
    if step.run.regrouped:
        return  # the others ran these on the old group and failed there: the next step gathers first
    t0 = time.perf_counter()
    try:
        sync.run(a, step.comm, params, stepped=True)
    except Exception as e:
        step.run.t_end = time.perf_counter()
        raise UpdateApplied(step.run) from e
    step.event("GATHER", t0, time.perf_counter(), k)


def _token_params(step: _Step, a: Action) -> list[Tensor]:
    """The parameters a collective token moves on this process: each stage it holds of the token lists its own
    (a parameter tied between two stages of one rank counts once).

    One stage of the token on this process (a data-parallel stage, the common case): its list as it stands (codegen
    names each of a stage's parameters once, by its graph target), without the per-parameter walk that merges
    several stages' lists (a Python loop over a hundred parameters was 80 us of the small-op MLP's 5 ms step on
    two ranks, benchmarks/runtime_overhead).
    """
    token = str(a)
    held = [stage for k in a.stages if (stage := step.stages.get(k)) is not None and token in stage.COLLECTIVES]
    if len(held) == 1:
        return held[0].params(*held[0].COLLECTIVES[token])
    seen: set[int] = set()
    out: list[Tensor] = []
    for stage in held:
        for p in stage.params(*stage.COLLECTIVES[token]):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _loss(step: _Step, index: int, rank: int, a: Action) -> None:
    """``LOSS``: wait for this process's sends, and agree on the loss (ranks)."""
    step.phase(synced=True)
    run, t0 = step.run, time.perf_counter()
    step.comm.flush()
    if step.agree is not None:
        run.regrouped = bool(step.agree(run.loss_sum))
    run.t_opt = time.perf_counter()
    run.loss_s += run.t_opt - t0
    step.event("LOSS", t0, run.t_opt, step.layout[rank][0])  # a rank's first stage (interleaved: its group)


def _optimize(step: _Step, index: int, rank: int, a: Action) -> None:
    """``OPTk``: the optimizer step, once per process (over every parameter of this process's stages)."""
    step.phase(synced=True)
    t0 = time.perf_counter()
    if step.optimizer is not None and not step.optimized:
        if step.scaler is None or _unscaled_finite(step.optimizer, step.scaler, step.agree_inf, step.run):
            step.optimizer.step()
        step.event("OPT", t0, time.perf_counter(), a.stage)
    step.optimized = True


# Every kind a rank's list may hold, and its handler: the lowered lists are what runs.
HANDLERS: dict[ActionKind, Callable[[_Step, int, int, Action], None]] = {
    ActionKind.FORWARD: _compute, ActionKind.BACKWARD: _compute,
    ActionKind.BACKWARD_INPUT: _compute, ActionKind.BACKWARD_WEIGHT: _compute,
    ActionKind.SEND: _message, ActionKind.RECV: _message,
    ActionKind.ALL_REDUCE: _collective, ActionKind.REDUCE_SCATTER: _collective, ActionKind.ALL_GATHER: _collective,
    ActionKind.LOSS: _loss, ActionKind.OPTIMIZER: _optimize,
}


@dataclass
class StepResult:
    """What :func:`step_local` and :func:`step_rank` return on this process.

    Attributes:
        loss: the batch loss (mean over the batch) where this process ran the
            last stage: the sum of its slices' shares; else None.
        outputs: ``(microbatch, replica, model output)`` for each slice whose last stage ran here.
        swap_bytes: bytes swapped out to host memory by this process's stages.
    """

    loss: Tensor | None = None
    outputs: list[tuple[int, int, Any]] = field(default_factory=list)
    swap_bytes: int = 0


def _check_inputs(build: Build, inputs: Sequence[Any]) -> None:
    micro = split_microbatches(tuple(inputs), build.plan.microbatches)[0]
    tensors = [x for x in micro if isinstance(x, Tensor)]
    for spec, x in zip(build.manifest.inputs, tensors):
        if tuple(x.shape) != spec.shape:
            raise HpmlError(f"input {spec.name}: a microbatch has shape {tuple(x.shape)}, but the build was "
                            f"generated for {spec.shape} ({build.manifest.microbatches} microbatches): feed a "
                            f"batch of {spec.shape[0] * build.manifest.microbatches} rows or recompile")


def _result(run: StepRun, stages: dict[int, StageModule]) -> StepResult:
    loss = None
    for _, _, share in run.shares:
        loss = share if loss is None else loss + share
    return StepResult(loss, run.outputs, sum(st.hpml_swap.bytes_out for _, st in sorted(stages.items())))


def step_local(build: Build, inputs: Sequence[Any], targets: Any, loss_fn: Callable[[Any, Any], Tensor], *,
               optimizer: torch.optim.Optimizer | None = None, scaler: LossScaler | None = None) -> StepResult:
    """One training step with every stage and replica in this process, chained through a mailbox.

    Args:
        build: a loaded build.
        inputs: the model's positional inputs for the whole batch.
        targets: the targets for ``loss_fn`` (split like the inputs).
        loss_fn: ``(output, targets) -> loss``, a mean over the batch.
        optimizer: stepped after the gradients are complete (None: gradients only).
        scaler: fp16 loss scaling (see :func:`run_actions`).

    Returns:
        The loss, the outputs of every slice and the swap traffic.

    Raises:
        HpmlError: a batch whose microbatches have another shape than the build's.
    """
    _check_inputs(build, inputs)
    comm = LocalComm(build.plan)
    stages = dict(enumerate(build.stages))
    for stage in stages.values():
        stage.hpml_comm = comm
    m = build.plan.microbatches
    run = run_actions(build, local_order(build, m), stages, comm, inputs, targets, loss_fn, m,
                      optimizer=optimizer, keep_outputs=True, scaler=scaler)
    return _result(run, stages)


def step_rank(build: Build, comm: DistComm, inputs: Sequence[Any], targets: Any,
              loss_fn: Callable[[Any, Any], Tensor], *, optimizer: torch.optim.Optimizer | None = None) -> StepResult:
    """One training step of this rank's stage replica (every rank calls it with the same batch).

    Args:
        build: a loaded build.
        comm: this rank's communicator (:func:`~.comm.dist_comm`).
        inputs: the model's positional inputs for the whole batch.
        targets: the targets for ``loss_fn``.
        loss_fn: ``(output, targets) -> loss``, a mean over the batch.
        optimizer: stepped after the gradient collectives (None: gradients only).

    Returns:
        This rank's share: the loss and outputs where it runs the last stage.

    Raises:
        HpmlError: a batch whose microbatches have another shape than the build's.
    """
    _check_inputs(build, inputs)
    stages = {k: build.stages[k] for k in rank_stages(build.plan)[comm.slot]}
    for stage in stages.values():
        stage.hpml_comm = comm
    m = build.plan.microbatches
    order = [(comm.slot, a) for a in actions_for(build, m)[comm.slot]]
    run = run_actions(build, order, stages, comm, inputs, targets, loss_fn, m, device=comm.device,
                      optimizer=optimizer, keep_outputs=True)
    return _result(run, stages)
