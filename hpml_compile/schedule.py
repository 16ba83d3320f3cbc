"""The pipeline schedule lowered into per-rank action lists.

Why a lowering: the plan names a schedule (GPipe, 1F1B, ZB-H1) and a microbatch
count; the runtime, the simulator and a reader of the build all need the
same thing from it, the order in which each rank runs its forwards,
backwards, messages, gradient collectives and optimizer step. Lowering
writes that order out once, as short tokens that print and parse back, so
that codegen stores it in the build's manifest, the executor runs it as it
is, and the simulator replays it (:func:`op_order` is its compute view).

Tokens (``k``: a stage, ``j``: a microbatch):

- ``kFj`` / ``kBj``: forward / backward of microbatch ``j`` on stage ``k``;
- ``kIj`` / ``kWj`` (ZB-H1 only, in place of ``kBj``): the backward's input-gradient part (what the
  previous stage waits for: its gradient is sent there) and its weight-gradient part (the parameters'
  gradients, no message), the names ``torch.distributed.pipelining`` gives them;
- ``kSENDp:j`` / ``kRECVp:j``: stage ``k`` sends to / receives from stage
  ``p`` the boundary values of microbatch ``j`` (activations from the earlier
  stage to the later, their gradients back); a receive comes before the
  forward or backward that reads it, a send after the one that produced it,
  and the executor moves the values at these tokens (the stage's
  ``ops.recv``/``ops.send`` nodes take and leave them,
  :mod:`hpml_compile.codegen.mailbox`);
- ``ALLREDUCE.flat(0,3)``, ``REDUCESCATTER.shm(1)``, ``ALLGATHER.hier(1)``: a
  collective over every rank of those stages (before ``OPTk``: gradients;
  after it: parameters); the suffix names the implementation that runs it,
  chosen from the plan by :func:`hpml_compile.plan.sync_impl`;
- ``LOSS``: every rank waits for its sends and agrees on the batch loss;
- ``OPTk``: the optimizer step of stage ``k``.

A stage's own summary of what it does (the manifest's ``stages[].actions``)
uses the same grammar without microbatches: ``0SEND1`` and ``1RECV0`` name a
boundary, ``SWAP2`` and ``RECOMPUTE2`` a region of stage 2, collectives as
above (:func:`parse_token`). One enum (:class:`ActionKind`) names every kind.

GPipe (Huang et al., NeurIPS 2019): all forwards, then all backwards. 1F1B
(PipeDream-flush, Narayanan et al., SC 2021): stage ``i`` of ``S`` runs
``S - i - 1`` warm-up forwards, then alternates, so at most ``S - i``
microbatches hold activations. ZB-H1 (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024): stage ``i`` runs ``S - i`` forwards, then ``I`` and
``F`` in turn, each ``I`` followed by the oldest owed ``W`` once more than
``i`` are owed; the ``i`` held back run last, where 1F1B waits for later
stages. Activations live until ``W``: every stage holds at most ``S``
microbatches, 1F1B's peak (its first stage's). A stage may hold back fewer,
``w`` of its ``i`` (the plan's :attr:`hpml_compile.plan.Stage.max_deferred`,
chosen where the ``S`` do not fit its memory): its ``I`` is followed by a
``W`` once more than ``w`` are owed, and it holds ``S - i + w`` microbatches;
``w = 0`` is 1F1B's order with each backward split, ``w = i`` ZB-H1's own.

Interleaved 1F1B (Narayanan et al., SC 2021; Megatron-LM's virtual pipeline): the plan's ``S * v`` stages run
on ``S`` device groups, stage ``k`` on group ``k % S`` (:func:`rank_stages`), so a rank holds ``v`` stages
(chunks) and its one list holds the tokens of all of them. Its compute order (:func:`interleaved_order`) is
Megatron-LM's: ``2 (S - g - 1) + (v - 1) S`` warm-up forwards on group ``g``, then one forward and one backward
in turn, then the remaining backwards; forwards take the chunks in turn, ``S`` microbatches each, backwards the
same from the last chunk; the message from stage ``S - 1`` to stage ``S`` goes from the last group back to the
first. Group ``g`` holds at most ``2 (S - g - 1) + (v - 1) S + 1`` chunk-microbatches of activations. A
microbatch count that is no multiple of ``S`` runs Megatron-LM's order for the next multiple with the
microbatches past ``M`` left out, which keeps it free of deadlock.

The validator that replays the lists is :mod:`hpml_compile.schedule_check`.

Example:
    >>> from hpml_compile.plan import Schedule
    >>> ranks = lower(Schedule.ONE_F_ONE_B, 2, (1, 1), sends=(True, False))
    >>> " ".join(map(str, ranks[0]))
    '0F0 0SEND1:0 0F1 0SEND1:1 0RECV1:0 0B0 0RECV1:1 0B1 LOSS OPT0'
    >>> " ".join(map(str, ranks[1]))
    '1RECV0:0 1F0 1B0 1SEND0:0 1RECV0:1 1F1 1B1 1SEND0:1 LOSS OPT1'
    >>> a = Action.parse("ALLREDUCE.hier(0,3)")
    >>> a.stages, a.impl, str(a), str(Action.parse("2B7"))
    ((0, 3), 'hier', 'ALLREDUCE.hier(0,3)', '2B7')
    >>> parse_token("0SEND1"), parse_token("SWAP2")
    ((<ActionKind.SEND: 'SEND'>, (0, 1)), (<ActionKind.SWAP: 'SWAP'>, (2,)))
    >>> zb = lower(Schedule.ZB_H1, 3, (1, 1), sends=(True, False))
    >>> " ".join(str(a) for a in zb[0] if a.kind in COMPUTE)
    '0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2'
    >>> " ".join(str(a) for a in zb[1] if a.kind in COMPUTE)
    '1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2'
    >>> capped = lower(Schedule.ZB_H1, 3, (1, 1), sends=(True, False), defer=(0, 0))
    >>> " ".join(str(a) for a in capped[1] if a.kind in COMPUTE)
    '1F0 1I0 1W0 1F1 1I1 1W1 1F2 1I2 1W2'
    >>> ilv = lower(Schedule.INTERLEAVED, 2, (1, 1, 1, 1), chunks=2)
    >>> " ".join(map(str, ilv[1]))  # doctest: +NORMALIZE_WHITESPACE
    '1RECV0:0 1F0 1SEND2:0 1RECV0:1 1F1 1SEND2:1 3RECV2:0 3F0 3B0 3SEND2:0 3RECV2:1 3F1 3B1 3SEND2:1
     1RECV2:0 1B0 1SEND0:0 1RECV2:1 1B1 1SEND0:1 LOSS OPT1 OPT3'
"""

from __future__ import annotations

import enum
import functools
import re
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from .interleave import order as _interleave
from .memory import ZeroStage
from .plan import AllReduce, Plan, Schedule

__all__ = ["ActionKind", "COMPUTE", "SyncImpl", "sync_impl", "Action", "RankActions", "op_order", "lower", "relower",
           "parse_actions", "parse_token", "with_averages", "stage_lists", "stage_ranks", "deferral", "held_back",
           "rank_layout", "rank_stages", "interleaved_order", "COLLECTIVES", "MARKERS", "REGIONS", "RANK_KINDS"]


class ActionKind(str, enum.Enum):
    """What an action token names: a rank's action, or (SWAP, RECOMPUTE) a region in a stage's summary."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"  # ZB-H1: the input-gradient part of a backward
    BACKWARD_WEIGHT = "W"  # ZB-H1: its weight-gradient part
    SEND = "SEND"
    RECV = "RECV"
    ALL_REDUCE = "ALLREDUCE"
    REDUCE_SCATTER = "REDUCESCATTER"
    ALL_GATHER = "ALLGATHER"
    LOSS = "LOSS"
    OPTIMIZER = "OPT"
    SWAP = "SWAP"
    RECOMPUTE = "RECOMPUTE"


class SyncImpl(str, enum.Enum):
    """Which implementation runs a collective: the suffix of its token (``ALLREDUCE.hier(0,3)``).

    One per class of :mod:`hpml_compile.runtime.sync.stage` (where the table of classes is) and, for its
    cost, per formula of :mod:`hpml_compile.stagecost`; :func:`sync_impl` picks it from the plan.
    """

    FLAT = "flat"  # one ring collective over the group (gloo, or NCCL between GPUs)
    SHM = "shm"  # the group's CPU ranks share one host: through shared memory
    HIER = "hier"  # within each host, then between hosts, then within each host again
    ZERO3 = "zero3"  # ZeRO-3: parameters sharded between uses, gathered around the stage's compute
    TOPK = "topk"  # top-k compressed gradients with error feedback
    POWERSGD = "powersgd"  # PowerSGD low-rank compressed gradients with error feedback
    LOCAL = "local"  # local SGD: the replicas step alone and average their parameters every few steps


def sync_impl(plan: Plan, stages: Sequence[int]) -> SyncImpl:
    """The implementation of the collectives over ``stages`` (a replicated stage, or the stages of a tied
    parameter): the one decision codegen writes into the tokens and the runtime builds from.

    Args:
        plan: the plan.
        stages: ``(k,)`` for stage ``k``'s replicas; several for a tied parameter's stages.

    Returns:
        ZeRO-3 first; then compression or local SGD (a ZeRO-0 stage); then the transport: hierarchical where the
        plan asks for it (for a tied group: and its devices span hosts evenly), shared memory where every
        member is a CPU of one host, else flat.

    Example:
        >>> from hpml_compile.cluster import load_cluster
        >>> from hpml_compile.plan import Stage
        >>> p = Plan("mlp", load_cluster("local-cpu-2"), Schedule.GPIPE, 1, (Stage(0, ("cpu0", "cpu1"), ("x",)),))
        >>> sync_impl(p, (0,)).value
        'shm'
    """
    devices = [d for k in stages for d in plan.stages[k].devices]
    if len(stages) == 1:
        st = plan.stages[stages[0]]
        if st.zero == ZeroStage.OS_G_P:
            return SyncImpl.ZERO3
        if st.zero == ZeroStage.NONE and st.compress:
            return SyncImpl.TOPK if st.compress.startswith("topk") else SyncImpl.POWERSGD
        if st.zero == ZeroStage.NONE and plan.sync_every > 1:
            return SyncImpl.LOCAL
        if st.allreduce is AllReduce.HIERARCHICAL:
            return SyncImpl.HIER
    elif plan.tied_allreduce is AllReduce.HIERARCHICAL:
        per_host = Counter(plan.cluster.device(d).host for d in devices)
        if len(per_host) > 1 and len(set(per_host.values())) == 1:
            return SyncImpl.HIER
    one_host = len({plan.cluster.device(d).host for d in devices}) == 1
    if one_host and all(plan.cluster.device(d).is_cpu for d in devices):
        return SyncImpl.SHM
    return SyncImpl.FLAT


COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT})
COLLECTIVES = frozenset({ActionKind.ALL_REDUCE, ActionKind.REDUCE_SCATTER, ActionKind.ALL_GATHER})
MARKERS = frozenset({ActionKind.SEND, ActionKind.RECV})  # the messages around F/B
REGIONS = frozenset({ActionKind.SWAP, ActionKind.RECOMPUTE})  # a stage's summary only, never in a rank's list
RANK_KINDS = frozenset(ActionKind) - REGIONS  # what a rank's list holds: the executor has a handler for each

# The one token grammar (``:j``, the microbatch, is absent from a stage's summary).
_COMPUTE = re.compile(r"^(\d+)([FBIW])(\d+)$")
_POINT = re.compile(r"^(\d+)(SEND|RECV)(\d+)(?::(\d+))?$")
_SYNC = re.compile(r"^(ALLREDUCE|REDUCESCATTER|ALLGATHER)(?:\.([a-z0-9]+))?\((\d+(?:,\d+)*)\)$")
_OPT = re.compile(r"^OPT(\d+)$")
_REGION = re.compile(r"^(SWAP|RECOMPUTE)(\d+)$")
_FORMS = "'0F3', '1B0', '1I0', '1W0', '0SEND1:3', '1RECV0:3', 'ALLREDUCE.flat(0,3)', 'LOSS' or 'OPT0'"


def _impl(text: str | None, token: str) -> str:
    """A collective token's implementation suffix, checked against the known ones ("" where there is none)."""
    if not text:
        return ""
    try:
        return SyncImpl(text).value
    except ValueError:
        raise ValueError(f"{token!r} names no collective implementation {text!r} (known: "
                         f"{', '.join(i.value for i in SyncImpl)})") from None


def parse_token(token: str) -> tuple[ActionKind, tuple[int, ...]]:
    """The kind and stages of any token of the grammar, with or without its microbatch.

    Besides a rank's actions this reads a stage's summary (``0SEND1``, ``1RECV0``, ``SWAP2``, ``RECOMPUTE2``,
    ``ALLREDUCE.flat(0,3)``).

    Raises:
        ValueError: for text that is no action token.
    """
    if m := _POINT.match(token):
        return ActionKind(m.group(2)), (int(m.group(1)), int(m.group(3)))
    a = Action.parse(token)
    return a.kind, a.stages


@dataclass(frozen=True, slots=True)
class Action:
    """One action of a rank's list (see the module docstring for its token).

    Attributes:
        kind: what it does.
        stages: ``(k,)`` for F, B, I, W and OPT; ``(k, peer)`` for SEND and RECV; the group of a
            collective; ``()`` for LOSS.
        microbatch: the microbatch of F, B, I, W, SEND and RECV; else None.
        impl: a collective's implementation (:class:`~hpml_compile.plan.SyncImpl`'s value; "" where the
            token names none); "" for every other kind.
    """

    kind: ActionKind
    stages: tuple[int, ...] = ()
    microbatch: int | None = None
    impl: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.impl and self.kind not in COLLECTIVES:
            raise ValueError(f"{self.kind.value} names no implementation, got {self.impl!r}")
        want = {ActionKind.SEND: 2, ActionKind.RECV: 2, ActionKind.LOSS: 0}.get(self.kind, 1)
        if (len(self.stages) != want and self.kind not in COLLECTIVES) or (self.kind in COLLECTIVES
                                                                           and not self.stages):
            raise ValueError(f"{self.kind.value} takes {want} stage(s), got {self.stages}")
        if (self.microbatch is None) != (self.kind not in (*COMPUTE, *MARKERS)):
            raise ValueError(f"{self.kind.value}: microbatch {self.microbatch} given where "
                             f"{'none' if self.microbatch is not None else 'one'} belongs")

    @property
    def stage(self) -> int:
        """The stage that runs it (F, B, I, W, SEND, RECV, OPT), or the first of a collective's group."""
        return self.stages[0] if self.stages else -1

    def __str__(self) -> str:
        k = self.kind
        if k in COMPUTE:
            return f"{self.stages[0]}{k.value}{self.microbatch}"
        if k in MARKERS:
            return f"{self.stages[0]}{k.value}{self.stages[1]}:{self.microbatch}"
        if k in COLLECTIVES:
            return f"{k.value}{'.' + self.impl if self.impl else ''}({','.join(map(str, self.stages))})"
        if k in REGIONS:
            return f"{k.value}{self.stages[0]}"
        return "LOSS" if k is ActionKind.LOSS else f"OPT{self.stages[0]}"

    @classmethod
    def parse(cls, token: str) -> "Action":
        """The action a token names.

        Raises:
            ValueError: for text that is no action token.
        """
        if m := _COMPUTE.match(token):
            return cls(ActionKind(m.group(2)), (int(m.group(1)),), int(m.group(3)))
        if (m := _POINT.match(token)) and m.group(4) is not None:
            return cls(ActionKind(m.group(2)), (int(m.group(1)), int(m.group(3))), int(m.group(4)))
        if m := _SYNC.match(token):
            return cls(ActionKind(m.group(1)), tuple(int(x) for x in m.group(3).split(",")),
                       impl=_impl(m.group(2), token))
        if m := _OPT.match(token):
            return cls(ActionKind.OPTIMIZER, (int(m.group(1)),))
        if m := _REGION.match(token):
            return cls(ActionKind(m.group(1)), (int(m.group(2)),))
        if token == "LOSS":
            return cls(ActionKind.LOSS)
        raise ValueError(f"not a schedule action token: {token!r} (expected e.g. {_FORMS})")


RankActions = tuple[Action, ...]


def parse_actions(tokens: Sequence[Sequence[str]]) -> list[RankActions]:
    """Per-rank token lists (as the manifest stores them) parsed into actions.

    Raises:
        ValueError: naming the rank and the token that does not parse.
    """
    out = []
    for rank, row in enumerate(tokens):
        try:
            acts = tuple(Action.parse(t) for t in row)
        except ValueError as e:
            raise ValueError(f"rank {rank}: {e}") from None
        if region := next((a for a in acts if a.kind in REGIONS), None):
            raise ValueError(f"rank {rank}: {region} names a region of a stage, not an action of a rank "
                             f"(expected e.g. {_FORMS})")
        out.append(acts)
    return out


def stage_ranks(plan: Plan) -> list[list[int]]:
    """The ranks of each stage: one rank per device, stages in order, replicas in device order (interleaved
    1F1B: ranks numbered over the first ``S`` stages, stage ``k`` on stage ``k % S``'s)."""
    return _stage_ranks([len(st.devices) for st in plan.stages], plan.chunks)


def rank_layout(plan: Plan) -> list[tuple[int, int]]:
    """``(stage, replica)`` of each rank (interleaved 1F1B: its first stage, one of the first ``S``)."""
    return _layout([len(st.devices) for st in plan.stages], plan.chunks)


def rank_stages(plan: Plan) -> list[tuple[int, ...]]:
    """The stages each rank holds, in model order: ``(k,)`` for one chunk; ``(g, g + S, ...)`` under interleaved
    1F1B, ``g`` the rank's group.

    Example:
        >>> from hpml_compile.cluster import load_cluster
        >>> from hpml_compile.plan import Stage
        >>> st = [Stage(k, (f"cpu{k % 2}",), (f"n{k}",)) for k in range(4)]
        >>> rank_stages(Plan("m", load_cluster("local-cpu-2"), Schedule.INTERLEAVED, 2, tuple(st), chunks=2))
        [(0, 2), (1, 3)]
    """
    return _rank_stages([len(st.devices) for st in plan.stages], plan.chunks)


def _stage_ranks(replicas: Sequence[int], chunks: int = 1) -> list[list[int]]:
    """The ranks of each of ``len(replicas)`` stages; with ``chunks``, stage ``k`` on stage ``k % S``'s ranks."""
    groups = len(replicas) // chunks
    out, r = [], 0
    for d in replicas[:groups]:
        out.append(list(range(r, r + d)))
        r += d
    return [out[k % groups] for k in range(len(replicas))]


def _layout(replicas: Sequence[int], chunks: int = 1) -> list[tuple[int, int]]:
    """``(stage, replica)`` of each rank, its stage one of the first ``S``."""
    return [(k, i) for k, d in enumerate(replicas[:len(replicas) // chunks]) for i in range(d)]


def _rank_stages(replicas: Sequence[int], chunks: int = 1) -> list[tuple[int, ...]]:
    """The stages of each rank, in model order."""
    groups = len(replicas) // chunks
    return [tuple(range(k, len(replicas), groups)) for k, _ in _layout(replicas, chunks)]


def op_order(schedule: Schedule, stage: int, stages: int, microbatches: int,
             defer: int | None = None) -> list[tuple[ActionKind, int]]:
    """The compute view of a stage's lowered list: ``(kind, microbatch)`` in execution order.

    Args:
        schedule: GPipe, 1F1B or ZB-H1.
        stage: stage index ``i``.
        stages: stage count ``S``.
        microbatches: ``M``.
        defer: ZB-H1: the most weight-gradient parts the stage holds back at once (:func:`held_back`; None:
            ``i``, ZB-H1's own); ignored by the other schedules.

    Returns:
        F and B (GPipe, 1F1B) or F, I and W (ZB-H1) actions; under 1F1B at most ``S - i`` forwards are ahead of
        their backward, under ZB-H1 at most ``S - i + w`` ahead of their weight-gradient part (``w`` the
        parts held back, ``S`` uncapped).

    Example:
        >>> [f"{k.value}{j}" for k, j in op_order(Schedule.ZB_H1, 1, 3, 4)]
        ['F0', 'F1', 'I0', 'F2', 'I1', 'W0', 'F3', 'I2', 'W1', 'I3', 'W2', 'W3']
        >>> [f"{k.value}{j}" for k, j in op_order(Schedule.ZB_H1, 2, 3, 3, defer=1)]
        ['F0', 'I0', 'F1', 'I1', 'W0', 'F2', 'I2', 'W1', 'W2']
    """
    m, fwd, bwd = microbatches, ActionKind.FORWARD, ActionKind.BACKWARD
    if schedule is Schedule.GPIPE:
        return [(fwd, k) for k in range(m)] + [(bwd, k) for k in range(m)]
    if schedule is Schedule.ZB_H1:
        return _zb_h1(stage, stages, m, held_back(stage, defer))
    w = min(stages - stage - 1, m)
    ops = [(fwd, k) for k in range(w)]
    for k in range(m - w):
        ops += [(fwd, w + k), (bwd, k)]
    return ops + [(bwd, k) for k in range(m - w, m)]


def interleaved_order(group: int, groups: int, chunks: int, microbatches: int) -> list[tuple[ActionKind, int, int]]:
    """Interleaved 1F1B's compute order on device group ``g``: ``(kind, stage, microbatch)``, Megatron-LM's
    (``forward_backward_pipelining_with_interleaving``; :mod:`hpml_compile.interleave`).

    Args:
        group: ``g``, from 0 to ``S - 1``.
        groups: ``S``.
        chunks: ``v``; group ``g`` holds stages ``g, g + S, ..., g + (v - 1) S``.
        microbatches: ``M`` (Megatron-LM's order for a multiple of ``S``; :mod:`hpml_compile.interleave`).

    Returns:
        ``v M`` forwards and as many backwards.

    Raises:
        ValueError: ``g`` outside the groups.

    Example:
        >>> " ".join(f"{k}{kind.value}{j}" for kind, k, j in interleaved_order(0, 2, 2, 4))
        '0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3'
    """
    return [(ActionKind.FORWARD if f else ActionKind.BACKWARD, group + c * groups, j)
            for f, c, j in _interleave(group, groups, chunks, microbatches)]


def held_back(stage: int, defer: int | None) -> int:
    """How many weight-gradient parts stage ``i`` holds back at once under ZB-H1: ``i`` (its own maximum), or
    ``defer`` where that is smaller (a plan's cap, :attr:`hpml_compile.plan.Stage.max_deferred`).

    >>> held_back(3, None), held_back(3, 1), held_back(1, 5)
    (3, 1, 1)
    """
    return stage if defer is None else max(0, min(stage, defer))


def deferral(plan: Plan) -> tuple[int | None, ...] | None:
    """The plan's caps on held-back weight-gradient parts, one per stage (None: ZB-H1's own), for :func:`lower`,
    :func:`stage_lists` and :func:`relower`; None where no stage has one (or the schedule is not ZB-H1)."""
    caps = tuple(st.max_deferred for st in plan.stages)
    return caps if plan.schedule is Schedule.ZB_H1 and any(c is not None for c in caps) else None


def _zb_h1(stage: int, stages: int, microbatches: int, hold: int) -> list[tuple[ActionKind, int]]:
    """ZB-H1's order for stage ``i`` (module docstring): ``S - i`` forwards, then I (with a W once more than
    ``hold`` are owed) and F in turn, the held-back W last."""
    fwd, inp, wgt = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
    f = min(stages - stage, microbatches)
    ops = [(fwd, k) for k in range(f)]
    w = 0
    for b in range(microbatches):
        ops.append((inp, b))
        if b + 1 - w > hold:  # more weight parts owed than this stage holds back
            ops.append((wgt, w))
            w += 1
        if f < microbatches:
            ops.append((fwd, f))
            f += 1
    return ops + [(wgt, k) for k in range(w, microbatches)]


def lower(schedule: Schedule, microbatches: int, replicas: Sequence[int], *,
          sends: Sequence[bool] | None = None, grad_sync: Sequence[Sequence[str]] | None = None,
          after_step: Sequence[Sequence[str]] | None = None,
          defer: Sequence[int | None] | None = None, chunks: int = 1) -> list[RankActions]:
    """Every rank's action list: compute in schedule order with its messages, then syncs, loss, optimizer.

    Args:
        schedule: GPipe, 1F1B, ZB-H1 or interleaved 1F1B.
        microbatches: ``M``.
        replicas: devices (ranks) of each stage (interleaved 1F1B: ``S * v`` entries, stage ``k``'s equal to stage
            ``k % S``'s).
        sends: per stage, whether boundary ``k -> k+1`` carries values (default: every one but the last's).
        grad_sync: per stage, its gradient collective tokens, in the order they run.
        after_step: per stage, its parameter collective tokens after the optimizer step.
        defer: ZB-H1: per stage, the most weight-gradient parts it holds back at once (:func:`deferral`; None, or
            an entry None: ZB-H1's own).
        chunks: interleaved 1F1B's ``v`` (the plan's ``chunks``); 1 for the other schedules.

    Returns:
        One tuple of actions per rank (ranks as :func:`rank_layout` numbers them). Under interleaved 1F1B a rank's
        list holds all its stages' tokens: their syncs (each collective once, ordered by the stages it spans so
        that every rank meets shared ones in one order), one ``LOSS``, each stage's ``OPT``, the after-step
        collectives.

    Raises:
        ValueError: a malformed collective token, or chunks that do not fit the schedule or the replicas.
    """
    n = len(replicas)
    groups = _check_lowering(schedule, microbatches, replicas, chunks)
    links = list(sends) if sends is not None else [k < n - 1 for k in range(n)]
    if chunks > 1:
        orders = [interleaved_order(g, groups, chunks, microbatches) for g in range(groups)]
    else:
        orders = [[(kind, k, j) for kind, j in op_order(schedule, k, n, microbatches, defer[k] if defer else None)]
                  for k in range(n)]
    per_group = []
    for g, order in enumerate(orders):
        acts: list[Action] = []
        for kind, k, j in order:
            fwd = kind is ActionKind.FORWARD
            came, goes = (k - 1, k + 1) if fwd else (k + 1, k - 1)
            talks = kind is not ActionKind.BACKWARD_WEIGHT  # W moves nothing: its gradients stay on the stage
            if talks and 0 <= came < n and links[min(k, came)]:
                acts.append(Action(ActionKind.RECV, (k, came), j))
            acts.append(Action(kind, (k,), j))
            if talks and 0 <= goes < n and links[min(k, goes)]:
                acts.append(Action(ActionKind.SEND, (k, goes), j))
        mine = range(g, n, groups)
        acts += _syncs(grad_sync, mine)
        acts += [Action(ActionKind.LOSS), *(Action(ActionKind.OPTIMIZER, (k,)) for k in mine)]
        acts += _syncs(after_step, mine)
        per_group.append(tuple(acts))
    return [per_group[g] for g, d in enumerate(replicas[:groups]) for _ in range(d)]


def _check_lowering(schedule: Schedule, microbatches: int, replicas: Sequence[int], chunks: int) -> int:
    """The device groups ``S`` of a lowering; ValueError naming what does not fit interleaved 1F1B's layout."""
    n = len(replicas)
    if chunks < 1 or (chunks > 1) != (schedule is Schedule.INTERLEAVED):
        raise ValueError(f"schedule {schedule.value} with chunks {chunks}: interleaved 1F1B takes chunks >= 2, "
                         "the other schedules 1")
    groups = n // chunks
    if n % chunks or (chunks > 1 and groups < 2):
        raise ValueError(f"{n} stages in {chunks} chunks: interleaved 1F1B needs S x {chunks} stages, S >= 2")
    if any(replicas[k] != replicas[k % groups] for k in range(n)):
        raise ValueError(f"replicas {list(replicas)}: stage k runs on stage k % {groups}'s ranks, so their counts "
                         "must repeat")
    return groups


def _syncs(tokens: Sequence[Sequence[str]] | None, mine: range) -> list[Action]:
    """The collectives of a rank's stages ``mine``, each once; with several stages ordered by the stages each spans
    (stably), so that any two collectives two ranks share come in the same order on both."""
    out: list[Action] = []
    for k in mine:
        out += [a for a in (Action.parse(t) for t in (tokens[k] if tokens else ())) if a not in out]
    return sorted(out, key=lambda a: a.stages) if len(mine) > 1 else out


@functools.lru_cache(maxsize=256)
def stage_lists(schedule: Schedule, stages: int, microbatches: int,
                defer: tuple[int | None, ...] | None = None, chunks: int = 1) -> tuple[RankActions, ...]:
    """Each stage's lowered list of computations (F, B, I, W), sends and receives (one rank per stage, every
    boundary carrying values): what the simulator replays (:mod:`hpml_compile.simulate`; replicas run their
    stage's list). ``defer``: ZB-H1's caps per stage (:func:`deferral`). ``chunks``: interleaved 1F1B's ``v``:
    one list per device group (``stages / v`` of them), holding all its stages' actions.

    Example:
        >>> " ".join(map(str, stage_lists(Schedule.GPIPE, 2, 2)[0]))
        '0F0 0SEND1:0 0F1 0SEND1:1 0RECV1:0 0B0 0RECV1:1 0B1'
    """
    kinds = (*COMPUTE, *MARKERS)
    return tuple(tuple(a for a in acts if a.kind in kinds)
                 for acts in lower(schedule, microbatches, [1] * stages, defer=defer, chunks=chunks))


def relower(ranks: Sequence[RankActions], replicas: Sequence[int], schedule: Schedule,
            microbatches: int, defer: Sequence[int | None] | None = None, chunks: int = 1) -> list[RankActions]:
    """The same lists lowered for another microbatch count (a batch of several build batches).

    The boundaries and the collectives are read from each stage's first rank; ``defer`` is the plan's ZB-H1 caps
    (:func:`deferral`), which the lists cannot tell at every count; ``chunks`` the plan's (interleaved 1F1B: a
    rank's collectives go with its first stage, which lowers them as they were).
    """
    first = [ranks[r[0]] for r in _stage_ranks(replicas, chunks)]
    sends = [any(a.kind is ActionKind.SEND and a.stages[:2] == (k, k + 1) for a in acts)
             for k, acts in enumerate(first)]
    groups = len(replicas) // chunks
    grad: list[list[str]] = []
    after: list[list[str]] = []
    for k, acts in enumerate(first):
        opt = next(i for i, a in enumerate(acts) if a.kind is ActionKind.OPTIMIZER)
        own = k < groups  # a rank's collectives are read once, for its first stage
        grad.append([str(a) for a in acts[:opt] if a.kind in COLLECTIVES] if own else [])
        after.append([str(a) for a in acts[opt:] if a.kind in COLLECTIVES] if own else [])
    return lower(schedule, microbatches, replicas, sends=sends, grad_sync=grad, after_step=after, defer=defer,
                 chunks=chunks)


def with_averages(ranks: Sequence[RankActions], replicas: Sequence[int],
                  stages: Sequence[int], chunks: int = 1) -> list[RankActions]:
    """The lists with local SGD's parameter average after the optimizer step of each of ``stages``, where a list
    lacks it: its gradient ``ALLREDUCE`` token again after ``OPTk`` (what codegen writes for a plan with local SGD;
    a run may turn local SGD on over a build lowered without it, :func:`hpml_compile.plan.with_comm`).

    Example:
        >>> lists = lower(Schedule.GPIPE, 1, (2,), grad_sync=[["ALLREDUCE.shm(0)"]])
        >>> " ".join(map(str, with_averages(lists, (2,), [0])[1]))
        '0F0 0B0 ALLREDUCE.shm(0) LOSS OPT0 ALLREDUCE.shm(0)'
    """
    out = list(ranks)
    for k in stages:
        for r in _stage_ranks(replicas, chunks)[k]:
            acts = out[r]
            opt = next(i for i, a in enumerate(acts) if a.kind is ActionKind.OPTIMIZER)
            grad = [a for a in acts[:opt] if a.kind is ActionKind.ALL_REDUCE and a.stages == (k,)]
            if grad and grad[0] not in acts[opt:]:
                out[r] = (*acts, grad[0])
    return out
