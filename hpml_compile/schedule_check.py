"""The validator of lowered action lists: it replays them and names the rank, the action and why one cannot run.

The validator (:func:`validate`) replays the lists with blocking receives,
non-blocking sends and collectives that wait for all their members, until
every rank is done or none can move; it names the rank, the action and why.
A boundary message of a replicated stage reaches only some replicas of its
peer; the replay waits for all of them, which is stricter than the
runtime, so an order it accepts cannot deadlock. Under interleaved 1F1B
(``chunks`` above 1) a rank holds several stages and runs their actions in
one list, one at a time; the same replay proves that list deadlock-free.

Example:
    >>> from hpml_compile.plan import Schedule
    >>> from hpml_compile.schedule import lower, parse_actions
    >>> validate(lower(Schedule.ONE_F_ONE_B, 2, (1, 1), sends=(True, False)), (1, 1))
    >>> validate(lower(Schedule.ZB_H1, 3, (1, 1), sends=(True, False)), (1, 1))
    >>> validate(lower(Schedule.ZB_H1, 3, (1, 1), sends=(True, False)), (1, 1), defer=(0, 0))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hpml_compile.errors.ScheduleError: rank 1 (stage 1, replica 0): 1F1 runs while 1 weight-gradient part(s) ...
    >>> replay(parse_actions([["0RECV1:0", "0SEND1:0"], ["1RECV0:0", "1SEND0:0"]]), (1, 1))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hpml_compile.errors.ScheduleError: the action order deadlocks: rank 0 (stage 0, replica 0) waits at 0RECV1:0 ...
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

from .errors import ScheduleError
from .schedule import (COLLECTIVES, COMPUTE, MARKERS, Action, ActionKind, RankActions, _layout, _rank_stages,
                       _stage_ranks, held_back)

__all__ = ["validate", "replay"]


def _name(rank: int, layout: Sequence[tuple[int, int]], held: Sequence[tuple[int, ...]] | None = None) -> str:
    k, r = layout[rank]
    if held is not None and len(held[rank]) > 1:
        return f"rank {rank} (stages {','.join(map(str, held[rank]))}, replica {r})"
    return f"rank {rank} (stage {k}, replica {r})"


def _check_shape(ranks: Sequence[RankActions], replicas: Sequence[int], chunks: int = 1) -> None:
    """Each action belongs to one of its rank's stages, no rank waits on itself, every F has one B after it."""
    layout, held = _layout(replicas, chunks), _rank_stages(replicas, chunks)
    if len(ranks) != len(layout):
        raise ScheduleError(f"{len(ranks)} action lists for {len(layout)} ranks (replicas {list(replicas)}"
                            f"{f', {chunks} chunks' if chunks > 1 else ''}): one list per rank is needed; "
                            "regenerate the build")
    s = len(replicas)
    for rank, acts in enumerate(ranks):
        mine = held[rank]
        who = _name(rank, layout, held)
        whose = f"stage {mine[0]}'s" if len(mine) == 1 else f"stages {', '.join(map(str, mine))}'s"
        seen: dict[int, dict[tuple[ActionKind, int | None], int]] = {k: {} for k in mine}
        for a in acts:
            if a.kind in COLLECTIVES:
                bad = not set(mine) & set(a.stages) or any(not 0 <= x < s for x in a.stages)
            else:
                bad = a.kind is not ActionKind.LOSS and a.stage not in mine
            if bad:
                raise ScheduleError(f"{who}: action {a} is not one of {whose}; each rank runs only its own "
                                    "stages' actions")
            k = a.stage
            if a.kind in MARKERS and a.stages[1] == k:
                raise ScheduleError(f"{who}: action {a} waits on its own stage: a stage never sends to or "
                                    "receives from itself")
            if a.kind in MARKERS and abs(a.stages[1] - k) != 1:
                raise ScheduleError(f"{who}: action {a} talks to stage {a.stages[1]}, not a neighbour of stage "
                                    f"{k}: values skipping stages are relayed")
            if a.kind in COMPUTE:
                key = (a.kind, a.microbatch)
                seen[k][key] = seen[k].get(key, 0) + 1
                before = _BEFORE.get(a.kind)
                if before is not None and (before, a.microbatch) not in seen[k]:
                    what = "its forward" if before is ActionKind.FORWARD else "its input-gradient part"
                    raise ScheduleError(f"{who}: {a} comes before {what} {k}{before.value}{a.microbatch}: "
                                        f"{_NEEDS.get(a.kind, 'a backward needs its forward activations')}")
        for k in mine:
            _check_parts(seen[k], who if len(mine) == 1 else f"{who}, stage {k}")


# Each compute action after the one it needs, and why
_BEFORE = {ActionKind.BACKWARD: ActionKind.FORWARD, ActionKind.BACKWARD_INPUT: ActionKind.FORWARD,
           ActionKind.BACKWARD_WEIGHT: ActionKind.BACKWARD_INPUT}
_NEEDS = {ActionKind.BACKWARD_WEIGHT: "the weight-gradient part starts from what the input-gradient part left"}
_PARTS = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)


def _check_parts(seen: dict[tuple[ActionKind, int | None], int], who: str) -> None:
    """Each microbatch: one F and either one B or one I and one W (never both forms)."""
    for j in sorted({j for _, j in seen}, key=lambda x: -1 if x is None else x):
        n = {kind: seen.get((kind, j), 0) for kind in _PARTS}
        whole = n[ActionKind.BACKWARD] == 1 and n[ActionKind.BACKWARD_INPUT] == n[ActionKind.BACKWARD_WEIGHT] == 0
        split = n[ActionKind.BACKWARD] == 0 and n[ActionKind.BACKWARD_INPUT] == n[ActionKind.BACKWARD_WEIGHT] == 1
        if n[ActionKind.FORWARD] != 1 or not (whole or split):
            raise ScheduleError(f"{who}: microbatch {j} has " + ", ".join(f"{c} {kind.name.lower()}(s)"
                                                                           for kind, c in n.items())
                                + ": each needs one forward and either one backward or one input-gradient part "
                                "and one weight-gradient part")


def _check_deferred(ranks: Sequence[RankActions], replicas: Sequence[int], defer: Sequence[int | None]) -> None:
    """ZB-H1's cap: before each forward and each input-gradient part a rank holds back at most its stage's cap of
    weight-gradient parts (microbatches whose ``I`` ran and ``W`` not yet): the memory the plan priced."""
    layout = _layout(replicas)
    for rank, acts in enumerate(ranks):
        k = layout[rank][0]
        cap = held_back(k, defer[k])
        owed = 0
        for a in acts:
            if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT) and owed > cap:
                raise ScheduleError(f"{_name(rank, layout)}: {a} runs while {owed} weight-gradient part(s) are held "
                                    f"back, over stage {k}'s cap of {cap}: run the oldest W before it "
                                    "(the cap is what the plan priced its memory for)")
            owed += (a.kind is ActionKind.BACKWARD_INPUT) - (a.kind is ActionKind.BACKWARD_WEIGHT)


def _check_messages(ranks: Sequence[RankActions], replicas: Sequence[int], chunks: int = 1) -> None:
    """A receive comes before the forward or backward (ZB-H1: its input-gradient part) that reads it, a send after
    the one that produced it (the executor moves the values at these tokens, :mod:`hpml_compile.codegen.mailbox`)."""
    layout, held = _layout(replicas, chunks), _rank_stages(replicas, chunks)
    for rank, acts in enumerate(ranks):
        at: dict[tuple[int, ActionKind, int | None], int] = {  # ZB-H1's input-gradient part is the backward here
            (a.stage, ActionKind.BACKWARD if a.kind is ActionKind.BACKWARD_INPUT else a.kind, a.microbatch): i
            for i, a in enumerate(acts) if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD,
                                                      ActionKind.BACKWARD_INPUT)}
        for i, a in enumerate(acts):
            if a.kind not in MARKERS:
                continue
            k, p = a.stages
            send = a.kind is ActionKind.SEND
            compute = ActionKind.FORWARD if send == (k < p) else ActionKind.BACKWARD
            c = at.get((k, compute, a.microbatch))
            if c is None or (c > i if send else c < i):
                word = "after" if send else "before"
                raise ScheduleError(f"{_name(rank, layout, held)}: {a} must come {word} {k}{compute.value}{a.microbatch}, "
                                    f"the {compute.name.lower()} that {'produces' if send else 'reads'} its values")


def _check_pairs(ranks: Sequence[RankActions], replicas: Sequence[int], chunks: int = 1) -> None:
    """Every send has its receive on every rank of the peer stage, and every receive its send."""
    layout, held = _layout(replicas, chunks), _rank_stages(replicas, chunks)
    groups = _stage_ranks(replicas, chunks)
    counts = [Counter((a.kind, a.stages, a.microbatch) for a in acts if a.kind in MARKERS) for acts in ranks]
    for rank, acts in enumerate(ranks):
        for a in dict.fromkeys(x for x in acts if x.kind in MARKERS):
            k = a.stage
            peer_kind = ActionKind.RECV if a.kind is ActionKind.SEND else ActionKind.SEND
            want = Action(peer_kind, (a.stages[1], k), a.microbatch)
            mine = counts[rank][(a.kind, a.stages, a.microbatch)]
            for q in groups[a.stages[1]]:
                theirs = counts[q][(peer_kind, want.stages, want.microbatch)]
                if theirs != mine:
                    what = "receive" if a.kind is ActionKind.SEND else "send"
                    raise ScheduleError(f"{_name(rank, layout, held)}: {a} (x{mine}) has no matching {what}: "
                                        f"{_name(q, layout, held)} runs {want} {theirs} time(s); a send without its "
                                        "receive is never delivered, a receive without its send waits forever")


def replay(ranks: Sequence[RankActions], replicas: Sequence[int],
           key: Callable[[int, Action], tuple[int, ...]] | None = None, chunks: int = 1) -> list[tuple[int, Action]]:
    """Play the lists with blocking receives, non-blocking sends and collectives that wait for all members.

    Args:
        ranks: each rank's actions.
        replicas: ranks of each stage.
        key: among the ranks whose next action can run, the smallest ``key(rank, action)`` goes first
            (default: the lowest rank).
        chunks: interleaved 1F1B's ``v`` (stage ``k`` on stage ``k % S``'s ranks); 1 for the other schedules.

    Returns:
        Every action in one order that respects the waits, as ``(rank, action)`` (a collective once per member).

    Raises:
        ScheduleError: the order deadlocks; names each stuck rank, its action and what it waits for.
    """
    layout, held = _layout(replicas, chunks), _rank_stages(replicas, chunks)
    groups = _stage_ranks(replicas, chunks)
    everyone = list(range(len(layout)))
    ptr = [0] * len(ranks)
    sent: Counter[tuple[int, int, int, int | None]] = Counter()  # (sender rank, from stage, to stage, microbatch)
    got: Counter[tuple[int, int, int, int | None]] = Counter()  # (receiver rank, at stage, from stage, microbatch)
    order: list[tuple[int, Action]] = []

    def members(a: Action) -> list[int]:
        return everyone if a.kind is ActionKind.LOSS else list(dict.fromkeys(q for x in a.stages for q in groups[x]))

    def ready(rank: int) -> bool:
        a = ranks[rank][ptr[rank]]
        if a.kind is ActionKind.RECV:
            k, p = a.stages
            return all(sent[(q, p, k, a.microbatch)] > got[(rank, k, p, a.microbatch)] for q in groups[p])
        if a.kind in COLLECTIVES or a.kind is ActionKind.LOSS:
            return all(ptr[q] < len(ranks[q]) and ranks[q][ptr[q]] == a for q in members(a))
        return True

    def at(q: int) -> str:
        return str(ranks[q][ptr[q]]) if ptr[q] < len(ranks[q]) else "the end of its list"

    def why(rank: int) -> str:
        a = ranks[rank][ptr[rank]]
        if a.kind is ActionKind.RECV:
            k, p = a.stages
            src = next(q for q in groups[p] if sent[(q, p, k, a.microbatch)] <= got[(rank, k, p, a.microbatch)])
            return (f"{_name(rank, layout, held)} waits at {a} for {p}SEND{k}:{a.microbatch} from rank {src}, "
                    f"which sits at {at(src)}")
        late = [q for q in members(a) if ptr[q] >= len(ranks[q]) or ranks[q][ptr[q]] != a]
        return (f"{_name(rank, layout, held)} waits at collective {a} for rank(s) {late}, which sit at "
                f"{', '.join(at(q) for q in late)}")

    pick = key or (lambda rank, a: (rank,))
    while True:
        live = [r for r in everyone if ptr[r] < len(ranks[r])]
        if not live:
            return order
        can = [r for r in live if ready(r)]
        if not can:
            raise ScheduleError("the action order deadlocks: " + "; ".join(why(r) for r in live))
        rank = min(can, key=lambda r: pick(r, ranks[r][ptr[r]]))
        a = ranks[rank][ptr[rank]]
        if a.kind in COLLECTIVES or a.kind is ActionKind.LOSS:
            for q in members(a):
                order.append((q, a))
                ptr[q] += 1
            continue
        if a.kind is ActionKind.SEND:
            sent[(rank, a.stages[0], a.stages[1], a.microbatch)] += 1
        elif a.kind is ActionKind.RECV:
            got[(rank, a.stages[0], a.stages[1], a.microbatch)] += 1
        order.append((rank, a))
        ptr[rank] += 1


def validate(ranks: Sequence[RankActions], replicas: Sequence[int],
             defer: Sequence[int | None] | None = None, chunks: int = 1) -> None:
    """Check per-rank lists before anything runs: own stages only, each message next to its compute, matched
    messages, ZB-H1's held-back weight-gradient parts within each stage's cap, no deadlock.

    Args:
        ranks: each rank's actions.
        replicas: ranks of each stage.
        defer: ZB-H1: the plan's cap per stage (:func:`hpml_compile.schedule.deferral`; None, or an entry None:
            the stage's index, ZB-H1's own).
        chunks: interleaved 1F1B's ``v``: ``replicas`` has ``S * v`` entries and stage ``k`` runs on stage
            ``k % S``'s ranks, each rank one list over its stages; 1 for the other schedules.

    Raises:
        ScheduleError: naming the rank, the action and the rule it breaks.

    Example:
        >>> from hpml_compile.plan import Schedule
        >>> from hpml_compile.schedule import lower
        >>> validate(lower(Schedule.INTERLEAVED, 4, (1, 1, 1, 1), chunks=2), (1, 1, 1, 1), chunks=2)
    """
    n = len(replicas)
    if chunks < 1 or n % chunks or (chunks > 1 and n // chunks < 2) or \
            any(replicas[k] != replicas[k % (n // chunks)] for k in range(n)):
        raise ScheduleError(f"replicas {list(replicas)} in {chunks} chunks: interleaved 1F1B needs S x {chunks} "
                            "stages for S >= 2 device groups, stage k on stage k % S's ranks; regenerate the build")
    _check_shape(ranks, replicas, chunks)
    if chunks == 1:
        _check_deferred(ranks, replicas, defer or [None] * len(replicas))
    _check_messages(ranks, replicas, chunks)
    _check_pairs(ranks, replicas, chunks)
    replay(ranks, replicas, chunks=chunks)
