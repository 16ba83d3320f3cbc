"""Interleaved 1F1B on a solved pipeline: each of its device groups holds ``v`` chunks of the model.

Why a pass after the solver: the solvers' tables price one stage per device
group, and what interleaving changes (the bubble, which shrinks about ``v``
times; ``v`` times the boundary messages; more warm-up microbatches held) is
the simulator's to price (:func:`hpml_compile.simulate.simulate` replays the
lowered lists). So the pass keeps the solver's device groups as they are
(devices, tensor parallelism, ZeRO, recompute, rows) and its microbatches,
and re-cuts the model into ``S v`` pieces in order, piece ``k`` on group
``k % S``: walking the cost graph's blocks in order, a piece takes blocks until
it holds ``1 / v`` of the compute its group had in the solver's plan (in the
group's own time: a slower group takes less of the model; the cut that keeps
the largest piece closest to its share), so each group keeps the load the
solver balanced against its memory. For each ``v`` of
:func:`chunk_counts` (:data:`CHUNKS` and a block a piece, ``S v`` blocks at
most) it checks the memory (:func:`hpml_compile.plan.validate_plan`, a device
holding all its chunks) and simulates the step, and the same with every piece
given equal time on its own group (where the solver left a group almost idle,
its share cannot hold a block per chunk), with each group's running load held
to its share instead of each piece (groups of different speeds), and where the
cut overloads an end group the solver left almost idle, the plan without that
group (:func:`without_idle_ends`); :func:`choose` keeps the fastest, over the
solver's placement and, where the driver solved one, a placement whose stages
left memory for interleaving's microbatches in flight
(:func:`hpml_compile.driver.roomy_placement`). Tensor-parallel groups keep their degree on
every chunk (each chunk priced with its group's ``tp``, a device's memory
summing its sharded chunks). Interleaving holds more
microbatches in flight than 1F1B, most on the later groups (``(v - 1) S +
2 (S - g - 1) + 1`` chunk-microbatches on group ``g`` against 1F1B's ``S - g``
whole-stage ones), so where a group's devices overflow, its chunks recompute,
those holding the most activations first, until it fits (the simulator prices
the extra forwards).

Example:
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> from hpml_compile.plan import Plan, Stage, Schedule
    >>> g = chain_graph([(1.0, 2.0)] * 8, kind="cpu")
    >>> nodes = lambda lo, hi: tuple(m for i in range(lo, hi) for m in g.node(f"n{i}").members)
    >>> placed = Plan("c", uniform_cluster(2), Schedule.ONE_F_ONE_B, 4, (Stage(0, ("d0",), nodes(0, 4)),
    ...                                                                    Stage(1, ("d1",), nodes(4, 8))))
    >>> ilv = interleave(placed, g, 2)
    >>> [(st.devices, st.nodes) for st in ilv.stages]
    [(('d0',), ('n0', 'n1')), (('d1',), ('n2', 'n3')), (('d0',), ('n4', 'n5')), (('d1',), ('n6', 'n7'))]
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Iterable

from ..costgraph import CostGraph
from ..errors import PlanError
from ..ir import Profile
from ..plan import Plan, PlanPrediction, Schedule, Stage, device_need, stage_breakdown, validate_plan
from ..tp import TensorParallel, analyze as analyze_tp
from ..simulate import _stage_of_graph_nodes, annotate, node_ms, step_ms

__all__ = ["CHUNKS", "BUDGET_S", "chunk_counts", "interleave", "without_idle_ends", "fit", "choose"]

#: The chunk counts ``v`` tried, smallest first (with the one that gives a piece a block, :func:`chunk_counts`).
CHUNKS = (2, 3, 4, 6, 8)
#: The most seconds :func:`choose` spends trying them (it says where it stopped).
BUDGET_S = 60.0


def _group_ms(placed: Plan, graph: CostGraph) -> list[dict[str, float]]:
    """Per device group of ``placed``, each block's forward, recompute and backward of one microbatch there."""
    out = []
    for st in placed.stages:
        kinds = sorted({placed.cluster.device(d).kind for d in st.devices})
        share = 1.0 / (placed.microbatches * st.replicas)
        costs = {}
        for n in graph.order:
            f, b = node_ms(graph, n, kinds, share, st.tp)
            costs[n] = f * (2 if st.recompute else 1) + b
        out.append(costs)
    return out


def _balanced_cuts(costs: list[list[float]], target: list[float], running: bool = False) -> list[int]:
    """Where to cut a sequence of blocks into ``len(target)`` pieces, piece ``k`` (chunk ``k // S`` of group
    ``k % S``) pricing block ``i`` at ``costs[k % S][i]``: the cut whose largest ratio of a piece's cost to its
    target is smallest (a binary search on that ratio, each piece filled greedily up to it; every piece keeps at
    least one block).

    ``running``: the ratio is of a group's running load (its pieces so far) to its running target instead, so a
    group whose share is 3 blocks over 2 chunks takes 1 block then 2 rather than 2 and 2: the group totals stay
    balanced where the pieces cannot all be (groups of different speeds, blocks coarser than a piece), at the price
    of uneven pieces, which interleaving's fixed order also pays for; :func:`choose` tries both.

    >>> _balanced_cuts([[1.0] * 6], [1.0, 1.0, 1.0])
    [2, 4]
    >>> _balanced_cuts([[1.0] * 6, [1.0] * 6], [1.0, 2.0])
    [2]

    Nine equal blocks, group 0's share 3 and group 1's 6, over 2 chunks: held piece by piece, group 0 takes 2 + 2
    blocks (a third over its share); held as running loads, 1 + 2:

    >>> _balanced_cuts([[1.0] * 9] * 2, [1.5, 3.0] * 2), _balanced_cuts([[1.0] * 9] * 2, [1.5, 3.0] * 2, True)
    ([2, 6, 8], [1, 4, 6])
    """
    s, pieces, n = len(costs), len(target), len(costs[0])

    def fill(scale: float) -> list[int] | None:
        cuts, i, load, goal = [], 0, [0.0] * s, [0.0] * s
        for k in range(pieces - 1):
            g = k % s
            if not running:
                load[g] = goal[g] = 0.0
            goal[g] += target[k]
            start, limit = i, n - (pieces - 1 - k)
            while i < limit and (i == start or load[g] + costs[g][i] <= scale * goal[g]):
                load[g] += costs[g][i]
                i += 1
            cuts.append(i)
        g = (pieces - 1) % s
        if not running:
            load[g] = goal[g] = 0.0
        return cuts if load[g] + sum(costs[g][i:]) <= scale * (goal[g] + target[-1]) else None

    lo, hi = 0.0, max(sum(c) for c in costs) / max(min(target), 1e-12) + 1.0
    best = fill(hi)
    for _ in range(50):
        mid = (lo + hi) / 2
        got = fill(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    assert best is not None  # at the top of the range every block fits
    return best


def interleave(placed: Plan, graph: CostGraph, chunks: int, even: bool = False, running: bool = False) -> Plan | None:
    """``placed``'s device groups holding ``chunks`` pieces each (module docstring); unpredicted.

    Args:
        placed: a solved plan with one stage per device group (any schedule but interleaved).
        graph: the cost graph it was solved on (each block in one stage).
        chunks: ``v`` (2 or more).
        even: give every piece the same time on its own group instead of its group's share of the solver's plan
            (where the solver left a group almost idle, say a slow one holding only the embedding, that share
            cannot hold a whole block per chunk).
        running: hold each group's running load to its share rather than each piece (:func:`_balanced_cuts`).

    Returns:
        The interleaved plan, or None where it cannot be made: fewer than 2 groups, fewer blocks than pieces.
    """
    s = len(placed.stages)
    if chunks < 2 or s < 2 or placed.chunks != 1 or s * chunks > len(graph.order):
        return None
    owner = _stage_of_graph_nodes(placed, graph)
    costs = _group_ms(placed, graph)
    target = [1.0 if even else sum(costs[g][n] for n in graph.order if owner[n] == g) / chunks for g in range(s)]
    blocks, pieces = list(graph.order), s * chunks
    cuts = _balanced_cuts([[costs[k % s][b] for b in blocks] for k in range(s)], [target[k % s] for k in range(pieces)],
                          running)
    bounds = list(zip([0, *cuts], [*cuts, len(blocks)]))
    stages = []
    for k, (lo, hi) in enumerate(bounds):
        st = placed.stages[k % s]
        nodes = tuple(x for b in blocks[lo:hi] for x in graph.node(b).members)
        stages.append(Stage(k, st.devices, nodes, st.zero, st.recompute, (), st.offload_optimizer, rows=st.rows,
                            compress=st.compress, allreduce=st.allreduce, tp=st.tp))
    return replace(placed, schedule=Schedule.INTERLEAVED, chunks=chunks, stages=tuple(stages),
                   predicted=PlanPrediction(), certificate=None)


def _loads(plan: Plan, graph: CostGraph, costs: list[dict[str, float]]) -> list[float]:
    """Each device group's compute of one microbatch in ``plan`` (stage ``k`` on group ``k % S``, ``S`` being
    ``len(costs)``), each block in its group's own time (:func:`_group_ms`)."""
    s, out = len(costs), [0.0] * len(costs)
    for n, k in _stage_of_graph_nodes(plan, graph).items():
        out[k % s] += costs[k % s][n]
    return out


def without_idle_ends(placed: Plan, graph: CostGraph, ilv: Plan) -> Plan | None:
    """``placed`` with an end device group left out where interleaving overloads it: its blocks join its neighbour.

    A group the solver left almost idle (a slow kind holding the embedding alone, say) cannot hold a block per
    chunk: every piece holds at least one, so under ``ilv`` it computes more than the solver's slowest group did,
    and the whole pipeline waits on it. Only the first and the last group can be left out (the model's order
    stays), and only where at least 2 groups remain; the devices left out are idle in the plan.

    Args:
        placed: the solver's plan (one stage per device group).
        graph: the cost graph.
        ilv: ``placed`` interleaved (:func:`interleave`).

    Returns:
        The plan without the overloaded end groups, or None where no end group is overloaded.
    """
    s, costs = len(placed.stages), _group_ms(placed, graph)
    before, after = max(_loads(placed, graph, costs)), _loads(ilv, graph, costs)
    drop = [g for g in (0, s - 1) if after[g] > before]
    if not drop or s - len(set(drop)) < 2:
        return None
    stages = list(placed.stages)
    if 0 in drop:
        stages[1] = replace(stages[1], nodes=stages[0].nodes + stages[1].nodes)
    if s - 1 in drop:
        stages[-2] = replace(stages[-2], nodes=stages[-2].nodes + stages[-1].nodes)
    kept = [st for g, st in enumerate(stages) if g not in drop]
    return replace(placed, stages=tuple(replace(st, index=k) for k, st in enumerate(kept)),
                   predicted=PlanPrediction(), certificate=None)


def _overflowing(plan: Plan, prof: Profile) -> set[int]:
    """The device groups (first ``S`` stages) with a device over its memory, all chunks counted."""
    sharding = analyze_tp(prof) if any(st.tp > 1 for st in plan.stages) else None
    return _overflowing_groups(plan, prof, range(len(plan.stages) // plan.chunks), sharding)


def _overflowing_groups(plan: Plan, prof: Profile, groups: Iterable[int], sharding: TensorParallel | None) -> set[int]:
    """Those of ``groups`` with a device over its memory (one device of each kind and rows checked)."""
    out = set()
    for st in (plan.stages[g] for g in groups):
        seen = set()
        for j, d in enumerate(st.devices):
            dev = plan.cluster.device(d)
            key = (dev.kind, st.rows[j] if st.rows else None)
            if key not in seen:
                seen.add(key)
                if device_need(plan, prof, d, sharding) > dev.memory_bytes:
                    out.add(st.index)
                    break
    return out


def fit(plan: Plan, prof: Profile) -> Plan:
    """``plan`` with chunks of each device group that overflows its memory recomputing, the ones holding the most
    activations first, until the group fits (or every chunk recomputes): what the pass tries where the interleaved
    plan holds more than the devices do. :func:`hpml_compile.plan.validate_plan` still decides whether it fits."""
    groups = len(plan.stages) // plan.chunks
    sharding = analyze_tp(prof) if any(st.tp > 1 for st in plan.stages) else None
    for g in sorted(_overflowing(plan, prof)):
        mine = list(range(g, len(plan.stages), groups))
        dev = plan.stages[g].devices[0]
        held = {k: stage_breakdown(plan, prof, plan.stages[k], dev, sharding).activations for k in mine}
        for k in sorted(mine, key=lambda x: -held[x]):
            if plan.stages[k].recompute:
                continue
            stages = list(plan.stages)
            stages[k] = replace(stages[k], recompute=True)
            plan = replace(plan, stages=tuple(stages))
            if g not in _overflowing_groups(plan, prof, [g], sharding):
                break
    return plan


def _not_run(plan: Plan) -> str | None:
    """What in ``plan`` the runtime does not combine with several stages per rank
    (:func:`hpml_compile.runtime.execute.chunks.interleave_refusal` refuses the same at run time), or None."""
    for st in plan.stages:
        if st.offload_optimizer or st.compress:
            return f"{'optimizer offload' if st.offload_optimizer else 'gradient compression'} (stage {st.index})"
    if plan.sync_every > 1:
        return "local SGD"
    if plan.compile_stages == "on":
        return "compiled stages"
    return None


def chunk_counts(groups: int, blocks: int) -> list[int]:
    """The chunk counts ``v`` tried for ``S`` device groups over ``blocks`` blocks: :data:`CHUNKS` and ``blocks //
    S``, the count at which every piece holds about one block (where ``S v`` divides the blocks, as 80 layers over 16
    groups of 5 chunks, the pieces are equal: uneven pieces stall interleaving's fixed order), those with ``S v``
    at most the blocks.

    >>> chunk_counts(16, 87), chunk_counts(24, 87), chunk_counts(2, 3)
    ([2, 3, 4, 5], [2, 3], [])
    """
    return sorted(v for v in {*CHUNKS, blocks // max(groups, 1)} if v >= 2 and groups * v <= blocks)


def _best(placed: Plan, graph: CostGraph, prof: Profile, budget_s: float,
          notes: list[str]) -> tuple[float, Plan, Plan] | None:
    """The fastest interleaved plan that fits on ``placed``'s device groups (:func:`choose`): ``(step, plan, the
    placement it interleaves: placed, or placed without an overloaded end group)``, or None; ``notes`` gets why
    counts were left out."""
    t0, best, s = time.perf_counter(), None, len(placed.stages)
    trimmed: Plan | None = None  # placed without an end group interleaving overloads (:func:`without_idle_ends`)
    one = len(graph.order) // s  # a block a piece first: the even pieces a placement with room is solved for
    for v in sorted(chunk_counts(s, len(graph.order)), key=lambda c: c != one):
        first = interleave(replace(placed, precision=prof.precision), graph, v)
        if first is None:
            continue
        trimmed = trimmed or without_idle_ends(placed, graph, first)
        bases = (placed, trimmed) if trimmed else (placed,)
        for base, even, running in [(b, False, False) for b in bases] + [(placed, True, False)] + \
                [(b, False, True) for b in bases]:
            if time.perf_counter() - t0 > budget_s:
                notes.append(f"stopped at {v} chunks after {budget_s:g} s")
                return best
            cand = first if base is placed and not even and not running else \
                interleave(replace(base, precision=prof.precision), graph, v, even, running)
            if cand is None:
                continue
            try:
                cand = fit(cand, prof)
                validate_plan(cand, prof)
                ms = step_ms(cand, graph, prof.dtype)
            except PlanError as e:
                if base is placed and not even and not running:
                    notes.append(f"{v} chunks: {str(e).split(';')[0]}")
                continue
            if best is None or ms < best[0]:
                best = (ms, cand, base)
    if best is None and not notes:
        notes.append(f"fewer than {2 * s} blocks")
    return best


def choose(placed: Plan, graph: CostGraph, prof: Profile, *, forced: bool = False,
           say: Callable[[str], None] | None = None, budget_s: float = BUDGET_S, roomy: Plan | None = None) -> Plan:
    """The fastest interleaved plan that fits, on ``placed``'s device groups or on ``roomy``'s, where it is faster
    than ``placed`` (``forced``: even where it is not); else ``placed``. One line says which and why.

    For each chunk count of :func:`chunk_counts` it tries the pieces cut by each group's share, the same with the
    groups' running loads held to their shares, the same without an overloaded end group
    (:func:`without_idle_ends`), and pieces of equal time (module docstring).

    Args:
        placed: the solver's plan (annotated: its predicted step is what the candidates are weighed against).
        graph: the cost graph it was solved on.
        prof: the profile (for the memory check).
        forced: the user asked for interleaved 1F1B.
        say: where the line goes.
        budget_s: the most seconds spent trying chunk counts, on each placement.
        roomy: a placement solved with memory left for interleaving's microbatches in flight
            (:func:`hpml_compile.solve.solve`'s ``room``), tried too; None: ``placed``'s alone.

    Returns:
        The chosen plan, annotated.
    """
    tell = say or (lambda _: None)
    s = len(placed.stages)
    if s < 2:
        tell(f"schedule: {placed.schedule.value} (interleaved 1F1B is not an option for one stage)")
        return placed
    if (why := _not_run(placed)) is not None:
        tell(f"schedule: {placed.schedule.value} (interleaved 1F1B is not combined with {why} by the runtime)")
        return placed
    notes: list[str] = []
    best = _best(placed, graph, prof, budget_s, notes)
    origin = placed
    if roomy is not None and len(roomy.stages) > 1 and _not_run(roomy) is None:
        other: list[str] = []
        got = _best(replace(roomy, compile_stages=placed.compile_stages), graph, prof, budget_s, other)
        if got is not None and (best is None or got[0] < best[0]):
            best, origin = got, roomy
        notes += [f"on the placement with room: {n}" for n in other]
    extra = f" ({'; '.join(notes)})" if notes else ""
    if best is None:
        tell(f"schedule: {placed.schedule.value} (no interleaved plan fits{extra})")
        return placed
    chosen, base = annotate(best[1], graph, prof.dtype)[0], best[2]
    groups = len(origin.stages)
    redone = sum(1 for a, b in zip(chosen.stages, base.stages * chosen.chunks) if a.recompute and not b.recompute)
    left = [f"{origin.stages[g].devices[0]}'s group" for g in (0, groups - 1)
            if origin.stages[g].devices not in {st.devices for st in base.stages}]
    name = f"interleaved-1f1b with {chosen.chunks} chunks" + (
        f" over {groups} device groups placed with room for its microbatches in flight" if origin is roomy else "") + (
        f" ({redone} of its {len(chosen.stages)} stages recomputing to fit)" if redone else "") + (
        f" ({' and '.join(left)} left idle: a block per chunk overloads it)" if left else "")
    if forced or chosen.predicted.step_ms < placed.predicted.step_ms:
        tell(f"schedule: {name}, {chosen.predicted.step_ms:.4g} ms a step against {placed.predicted.step_ms:.4g} ms "
             f"under {placed.schedule.value} (bubble {chosen.predicted.bubble:.1%} against "
             f"{placed.predicted.bubble:.1%}){extra}")
        return chosen
    tell(f"schedule: {placed.schedule.value}, {name} is not faster here ({chosen.predicted.step_ms:.4g} ms a step)"
         f"{extra}")
    return placed
