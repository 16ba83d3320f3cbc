"""Bounds on the ILP's optimum from dynamic programs: the bottleneck enumerated, as in Alpa.

The ILP minimises ``F = (M - 1) T + S + R`` (bottleneck ``T``, ``S = sum(t +
comm)``, ``R`` the largest gradient-sync tail). For a threshold ``u`` on the
bottleneck, let ``S(u)`` be the least ``S`` over tilings whose stages all have
``t <= u``, computed exactly by the DP of :mod:`.dp` (every pipeline-position
class kept, so memory is modelled as in the ILP). ``S(u)`` does not increase
with ``u``, and every plan ``P`` has ``F(P) >= (M - 1) T_P + S(T_P) + R_min``,
so ``min_u (M - 1) u + S(u) + R_min`` over the distinct stage times ``u`` is a
lower bound, and every tiling the DP returns on the way is a plan, an upper
bound. This is the inter-operator search of Alpa (Zheng et al., OSDI 2022,
section 5.2: enumerate ``t_max``, DP the sum, stop once ``(B - 1) t_max``
alone exceeds the best), here with a one-dimensional branch and bound over
the thresholds instead of a full scan: an interval ``[u_i, u_j]`` of
thresholds costs at least ``(M - 1) u_i + S(u_j)``, and is split only while
that is below the best plan. When the bounds meet, the plan is optimal
without a MILP; otherwise they warm-start and cut the MILP (:mod:`.ilp`).

Example:
    >>> from hpml_compile.solve.candidates import Chain, Setting
    >>> from hpml_compile.solve.table import build_table
    >>> from hpml_compile.testing import chain_graph, cluster_of
    >>> from hpml_compile.plan import Schedule
    >>> ch = Chain.of(chain_graph([{"a": (1.0, 1.0), "b": (3.0, 3.0)}] * 4))
    >>> c, st = cluster_of(["a", "b"]), Setting(8, Schedule.ONE_F_ONE_B, 64)
    >>> b = objective_bounds(ch, c, st, build_table(ch, c, st))
    >>> b.complete, round(b.lower, 6) == round(b.upper, 6), sorted((x.b - x.a, x.kind) for x in b.plan)
    (True, True, [(1, 'b'), (3, 'a')])
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..ir import Cluster
from .candidates import Candidate, Chain, Setting, classes, kind_counts
from .dp import tile, objective
from .table import CandidateTable

__all__ = ["Bounds", "objective_bounds", "exact_classes"]


@dataclass(frozen=True, slots=True)
class Bounds:
    """What the DPs prove about the ILP's objective.

    Attributes:
        t_min: the least bottleneck of any tiling.
        s_min: the least ``sum(t + comm)`` of any tiling.
        r_min: the least largest tail of any tiling.
        lower: a lower bound on the objective of every tiling.
        upper: the objective of ``plan``.
        plan: the best tiling found (None if nothing tiles).
        evaluations: DP runs made.
        complete: every threshold was settled (else ``lower`` covers the unsettled ones by their bound).
    """

    t_min: float
    s_min: float
    r_min: float
    lower: float
    upper: float
    plan: list[Candidate] | None
    evaluations: int
    complete: bool


def exact_classes(tab: CandidateTable, big_j: int) -> int:
    """Position classes the DP needs to model memory exactly: one past the largest binding ``jmax``.

    A candidate with ``jmax < big_j`` fits only with at most ``jmax`` stages after it; beyond the largest
    such ``jmax`` every candidate that fits at all fits everywhere, so more classes change nothing.
    """
    binding = tab.jmax[tab.jmax < big_j]
    return 0 if binding.size == 0 else min(big_j, int(binding.max()) + 1)


def objective_bounds(chain: Chain, cluster: Cluster, setting: Setting, tab: CandidateTable, *,
                     start: list[Candidate] | None = None, time_budget_s: float = 10.0,
                     max_evaluations: int = 400,
                     progress: Callable[[float, float], None] | None = None) -> Bounds:
    """Lower and upper bounds on ``(M - 1) T + S + R`` over tilings by ``tab`` (see the module docstring).

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        tab: the candidate stages.
        start: a known plan (its objective is the first upper bound).
        time_budget_s: stop splitting threshold intervals after this long.
        max_evaluations: stop after this many DP runs.
        progress: called with ``(lower, upper)`` whenever the gap between them has at least halved since the last
            call (and once at the start of the branch and bound): the certified gap as it closes, for the log.

    Returns:
        The bounds and the best plan found.
    """
    t0 = time.perf_counter()
    m, n = setting.microbatches, chain.n
    counts = kind_counts(cluster)
    big_j = classes(setting, len(cluster.devices))
    jc = exact_classes(tab, big_j)
    zeros = np.zeros(len(tab))
    evals = 0

    def run(sel: np.ndarray | None, t: np.ndarray, own: np.ndarray) -> tuple[float, float, list[int]] | None:
        nonlocal evals
        evals += 1
        if sel is None:
            return tile(n, counts, tab, t, own, tab.jmax, big_j, jc)
        sub = tab.select(sel)
        got = tile(n, counts, sub, t[sel], own[sel], sub.jmax, big_j, jc)
        return None if got is None else (got[0], got[1], [int(i) for i in np.flatnonzero(sel)[got[2]]])

    first = run(None, tab.t, tab.t + tab.comm + tab.tail)  # least bottleneck, then least sum
    if first is None:
        return Bounds(math.inf, math.inf, math.inf, math.inf, math.inf, None, evals, True)
    best = [tab.candidate(i) for i in first[2]]
    if start and objective(start, m) < objective(best, m):
        best = start
    upper = objective(best, m)
    t_min = first[0]
    r_got = run(None, tab.tail, zeros)
    r_min = r_got[0] if r_got else 0.0
    s_all = run(None, zeros, tab.t + tab.comm)
    s_min = s_all[1] if s_all else math.inf
    if s_all:
        plan = [tab.candidate(c) for c in s_all[2]]
        if objective(plan, m) < upper:
            best, upper = plan, objective(plan, m)
    floor = (m - 1) * t_min + s_min + r_min
    # Thresholds that can matter: beyond them (M - 1) u or v alone rules a plan out.
    us, vs = np.unique(tab.t), np.unique(tab.tail)
    us = us[(us >= t_min) & ((m - 1) * us <= (upper - s_min - r_min) * (1 + 1e-12))] if m > 1 else us[-1:]
    vs = vs[(vs >= r_min) & (vs <= (upper - (m - 1) * t_min - s_min) * (1 + 1e-12))]
    if us.size == 0 or vs.size == 0:  # the best plan is already at the floor
        return Bounds(t_min, s_min, r_min, min(upper, floor), upper, best, evals, True)
    sums: dict[tuple[int, int], float] = {}  # (u index, v index) -> least sum(t + comm) with t <= u, tail <= v

    def s_at(i: int, k: int) -> float:
        nonlocal best, upper
        if (i, k) not in sums:
            got = run((tab.t <= us[i]) & (tab.tail <= vs[k]), zeros, tab.t + tab.comm)
            sums[(i, k)] = math.inf if got is None else got[1]
            if got is not None:
                plan = [tab.candidate(c) for c in got[2]]
                if objective(plan, m) < upper:
                    best, upper = plan, objective(plan, m)
        return sums[(i, k)]

    # Branch and bound over boxes of thresholds [us[i], us[j]] x [vs[k], vs[l]]: a plan whose bottleneck and
    # largest tail fall in the box costs at least (M - 1) us[i] + vs[k] + S(us[j], vs[l]).
    # Best first: the box with the least bound is split next, so the global bound (the least open box)
    # rises as fast as it can within the budget.
    settled = math.inf
    heap = [((m - 1) * us[0] + vs[0] + s_at(len(us) - 1, len(vs) - 1), 0, len(us) - 1, 0, len(vs) - 1)]
    told = math.inf  # the gap last reported
    while heap and heap[0][0] < upper * (1 - 1e-9):
        if progress is not None:
            low = max(floor, min(upper, settled, heap[0][0]))
            if upper - low <= told / 2:
                told = upper - low
                progress(low, upper)
        if evals >= max_evaluations or time.perf_counter() - t0 > time_budget_s:
            break
        _, i, j, k, l = heapq.heappop(heap)
        if j - i <= 1 and l - k <= 1:  # settle the (up to four) threshold pairs of the box
            settled = min(settled, *((m - 1) * us[a] + vs[c] + s_at(a, c) for a in {i, j} for c in {k, l}))
            continue
        if j - i >= l - k:
            mid = (i + j) // 2
            halves = [(i, mid, k, l), (mid, j, k, l)]
        else:
            mid = (k + l) // 2
            halves = [(i, j, k, mid), (i, j, mid, l)]
        for a, b, c, d in halves:
            heapq.heappush(heap, ((m - 1) * us[a] + vs[c] + s_at(b, d), a, b, c, d))
    open_low = min((h[0] for h in heap), default=math.inf)
    complete = bool(open_low >= upper * (1 - 1e-9))
    lower = float(max(floor, min(upper, settled, open_low)))
    return Bounds(t_min, s_min, r_min, min(lower, upper), upper, best, evals, complete)
