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
group's own time: a slower group takes less of the model), so each group keeps
the load the solver balanced against its memory. For each ``v`` of
:data:`CHUNKS` (``S v`` blocks at most) it checks the memory
(:func:`hpml_compile.plan.validate_plan`, a device holding all its chunks) and
simulates the step; :func:`choose` keeps the fastest. Interleaving holds more
microbatches in flight than 1F1B, most on the later groups (``(v - 1) S +
2 (S - g - 1) + 1`` chunk-microbatches on group ``g`` against 1F1B's ``S - g``
whole-stage ones), so where a group's devices overflow, its chunks recompute
(the simulator prices the extra forward) and the plan is tried again.

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
from typing import Callable

from ..costgraph import CostGraph
from ..errors import PlanError
from ..ir import Profile
from ..plan import Plan, PlanPrediction, Schedule, Stage, device_need, validate_plan
from ..simulate import _stage_of_graph_nodes, annotate, node_ms, step_ms

__all__ = ["CHUNKS", "BUDGET_S", "interleave", "fit", "choose"]

#: The chunk counts ``v`` tried, smallest first.
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


def interleave(placed: Plan, graph: CostGraph, chunks: int) -> Plan | None:
    """``placed``'s device groups holding ``chunks`` pieces each (module docstring); unpredicted.

    Args:
        placed: a solved plan with one stage per device group (any schedule but interleaved).
        graph: the cost graph it was solved on (each block in one stage).
        chunks: ``v`` (2 or more).

    Returns:
        The interleaved plan, or None where it cannot be made: fewer than 2 groups, fewer blocks than pieces.
    """
    s = len(placed.stages)
    if chunks < 2 or s < 2 or placed.chunks != 1 or s * chunks > len(graph.order):
        return None
    owner = _stage_of_graph_nodes(placed, graph)
    costs = _group_ms(placed, graph)
    target = [sum(costs[g][n] for n in graph.order if owner[n] == g) / chunks for g in range(s)]
    blocks, pieces = list(graph.order), s * chunks
    cuts, i = [], 0
    for k in range(pieces - 1):
        acc, start, limit = 0.0, i, len(blocks) - (pieces - 1 - k)  # leave a block for every later piece
        while i < limit:
            c = costs[k % s][blocks[i]]
            if i > start and acc + c / 2 > target[k % s]:  # the nearest boundary to the target
                break
            acc += c
            i += 1
        cuts.append(i)
    bounds = list(zip([0, *cuts], [*cuts, len(blocks)]))
    stages = []
    for k, (lo, hi) in enumerate(bounds):
        st = placed.stages[k % s]
        nodes = tuple(x for b in blocks[lo:hi] for x in graph.node(b).members)
        stages.append(Stage(k, st.devices, nodes, st.zero, st.recompute, (), st.offload_optimizer, rows=st.rows,
                            compress=st.compress, allreduce=st.allreduce, tp=st.tp))
    return replace(placed, schedule=Schedule.INTERLEAVED, chunks=chunks, stages=tuple(stages),
                   predicted=PlanPrediction(), certificate=None)


def _overflowing(plan: Plan, prof: Profile) -> set[int]:
    """The device groups (first ``S`` stages) with a device over its memory, all chunks counted."""
    groups, out = len(plan.stages) // plan.chunks, set()
    for st in plan.stages[:groups]:
        seen = set()
        for j, d in enumerate(st.devices):
            dev = plan.cluster.device(d)
            key = (dev.kind, st.rows[j] if st.rows else None)
            if key not in seen:
                seen.add(key)
                if device_need(plan, prof, d) > dev.memory_bytes:
                    out.add(st.index)
                    break
    return out


def fit(plan: Plan, prof: Profile) -> Plan:
    """``plan`` with every chunk of each device group that overflows its memory recomputing (once): what the pass
    tries where the interleaved plan holds more than the devices do; :func:`hpml_compile.plan.validate_plan` still
    decides whether it fits."""
    over = _overflowing(plan, prof)
    if not over:
        return plan
    groups = len(plan.stages) // plan.chunks
    return replace(plan, stages=tuple(replace(st, recompute=True) if st.index % groups in over else st
                                      for st in plan.stages))


def choose(placed: Plan, graph: CostGraph, prof: Profile, *, forced: bool = False,
           say: Callable[[str], None] | None = None, budget_s: float = BUDGET_S) -> Plan:
    """The fastest interleaved plan on ``placed``'s device groups that fits, where it is faster than ``placed``
    (``forced``: even where it is not); else ``placed``. One line says which and why.

    Args:
        placed: the solver's plan (annotated: its predicted step is what the candidates are weighed against).
        graph: the cost graph it was solved on.
        prof: the profile (for the memory check).
        forced: the user asked for interleaved 1F1B.
        say: where the line goes.
        budget_s: the most seconds spent trying chunk counts.

    Returns:
        The chosen plan, annotated.
    """
    tell = say or (lambda _: None)
    s = len(placed.stages)
    if s < 2:
        tell(f"schedule: {placed.schedule.value} (interleaved 1F1B is not an option for one stage)")
        return placed
    t0, best, notes = time.perf_counter(), None, []
    for v in CHUNKS:
        if time.perf_counter() - t0 > budget_s:
            notes.append(f"stopped before {v} chunks after {budget_s:g} s")
            break
        cand = interleave(replace(placed, precision=prof.precision), graph, v)
        if cand is None:
            notes.append(f"{v} chunks: fewer than {s * v} blocks")
            break
        try:
            cand = fit(cand, prof)
            validate_plan(cand, prof)
            ms = step_ms(cand, graph, prof.dtype)
        except PlanError as e:
            notes.append(f"{v} chunks: {str(e).split(';')[0]}")
            continue
        if best is None or ms < best[0]:
            best = (ms, cand)
    extra = f" ({'; '.join(notes)})" if notes else ""
    if best is None:
        tell(f"schedule: {placed.schedule.value} (no interleaved plan fits{extra})")
        return placed
    chosen = annotate(best[1], graph, prof.dtype)[0]
    redone = sum(1 for a, b in zip(chosen.stages, placed.stages * chosen.chunks) if a.recompute and not b.recompute)
    name = f"interleaved-1f1b with {chosen.chunks} chunks" + (
        f" ({redone // chosen.chunks} device groups recomputing to fit)" if redone else "")
    if forced or chosen.predicted.step_ms < placed.predicted.step_ms:
        tell(f"schedule: {name}, {chosen.predicted.step_ms:.4g} ms a step against {placed.predicted.step_ms:.4g} ms "
             f"under {placed.schedule.value} (bubble {chosen.predicted.bubble:.1%} against "
             f"{placed.predicted.bubble:.1%}){extra}")
        return chosen
    tell(f"schedule: {placed.schedule.value}, {name} is not faster here ({chosen.predicted.step_ms:.4g} ms a step)"
         f"{extra}")
    return placed
