"""Placement as a mixed-integer program (PuLP + HiGHS), warm-started and bounded by the DP.

A plain node-to-device assignment model is hopeless here (a 40-node chain on
4 devices ran over 10 minutes in CBC without a proof). Instead, as in the
stage-candidate formulations of Alpa (Zheng et al., OSDI 2022), we enumerate
candidate stages with everything precomputed and let the MIP choose a tiling.

Sets and data:
    positions ``p = 0..n`` of a topological order of the (coarsened) cost graph;
    candidates ``c = (a_c, b_c, kind_c, d_c, config_c)``: the range
    ``[a_c, b_c)`` on ``d_c`` devices of ``kind_c`` (data parallel) with a
    ZeRO stage (Rajbhandari et al. 2020), recompute, optimizer offload and
    activation swap, each with its per-microbatch time ``t_c``, gradient-sync
    tail ``r_c``, boundary transfer ``e_c`` and ``jmax_c``, the most stages that
    may follow it while its activations (1F1B in flight ``min(M, j + 1)``,
    Narayanan et al. 2021; GPipe all ``M``, Huang et al. 2019) still fit.
    Candidates that do not fit anywhere are never generated; those with
    ``M t_c`` above the warm start's objective cannot be in a better plan and
    are dropped.

Variables:
    ``x_c`` in {0, 1}: candidate ``c`` is a stage;
    ``T >= 0``: the bottleneck (slowest per-microbatch stage time);
    ``R >= 0``: the longest gradient-sync tail;
    ``after_p >= 0``: number of stages starting at or after position ``p``.

Objective, a proxy of the simulated step time (:func:`.dp.objective`):
    minimise ``(M - 1) T + sum_c (t_c + e_c) x_c + R``.
    It is the step time of a pipeline whose slowest stage sets the pace, with
    every boundary transfer on the critical path once and the longest tail at
    the end; the simulator (:func:`hpml_compile.simulate.simulate`) plays the
    real schedule instead (warm-up and drain per stage, sends overlapping
    compute, the tied-parameter all-reduces, host memory contention), so the
    two differ, and :func:`hpml_compile.solve.solve` logs both by name and keeps
    the plan with the better simulated step.

Constraints (each added by the function named):
    tiling, :func:`_add_tiling`: flow conservation over positions: one stage
        starts at 0, one ends at n, and at every other position as many
        stages end as start (so the selected ranges tile ``[0, n)``, each node
        in exactly one stage, no edge backwards);
    devices, :func:`_add_devices`: ``sum_{kind_c = k} d_c x_c <= count_k``
        per kind. Identical devices are grouped by kind, so no two solutions
        differ by a permutation of interchangeable devices (symmetry broken);
        concrete devices are assigned afterwards, in cluster order;
    bottleneck, :func:`_add_bottleneck`: ``T >= sum_{c covers p} t_c x_c`` per
        position ``p`` (exactly one selected stage covers ``p``; this is tighter
        in the LP relaxation than ``T >= t_c x_c``), and likewise
        ``R >= sum_{c covers p} r_c x_c``;
    memory order, :func:`_add_memory_order`: ``after_p = after_{p+1} +
        sum_{a_c = p} x_c`` and, for each candidate that does not fit at every
        position, ``after_{b_c} <= jmax_c + (D - 1 - jmax_c)(1 - x_c)``;
    bounds (:mod:`.bounds`, valid for every plan): ``T >= T_min`` (the DP's
        least bottleneck), ``sum_c (t_c + e_c) x_c >= S_min`` and the objective
        ``>= L``, the DP's lower bound.

The memory budget itself is in the candidate set. The stage count, the
data-parallel degree and memory options of each stage, and the device kind
order along the pipeline are all decided here; the microbatch count is
searched outside (:func:`hpml_compile.solve.solve`).

Before the MILP is built, the dynamic programs of :mod:`.bounds` bound the
optimum from both sides (the bottleneck enumerated, as in Alpa). When the
bounds meet, their plan is optimal and no MILP is needed (in
benchmarks/solver_scaling, on every single-kind cluster: llama-70b on 64
A100s is proven in ~2 s, where HiGHS alone stops at a 14% gap after 30 s). Otherwise their plan
warm-starts HiGHS, their bounds cut the relaxation, and :func:`prune` drops
every candidate whose own lower bound exceeds the best plan's objective.
HiGHS's status is read from ``sol_status`` (after a time limit a status may
read "Optimal" while only a feasible solution exists), and the reported gap
is against the better of HiGHS's bound and the DP's.

Example:
    >>> from hpml_compile.solve.candidates import Chain, Setting
    >>> from hpml_compile.testing import chain_graph, cluster_of
    >>> from hpml_compile.plan import Schedule
    >>> ch = Chain.of(chain_graph([{"a": (1.0, 1.0), "b": (3.0, 3.0)}] * 4))
    >>> r = solve_ilp(ch, cluster_of(["a", "b"]), Setting(64, Schedule.ONE_F_ONE_B, 1024), time_limit_s=10)
    >>> r.status.value, sorted((c.b - c.a, c.kind) for c in r.picked)
    ('optimal', [(1, 'b'), (3, 'a')])
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import highspy
import pulp

import numpy as np

from ..ir import Cluster
from ..plan import SolverStatus
from .candidates import CONFIGS, Candidate, Chain, Setting, classes, kind_counts
from .bounds import objective_bounds
from .dp import objective, solve_chain
from .highs import quiet_banner
from .table import CandidateTable, build_table

_COLUMNS = CandidateTable.__dataclass_fields__.keys() - {"kinds"}

__all__ = ["IlpResult", "solve_ilp", "prune", "milp"]


@dataclass(frozen=True, slots=True)
class IlpResult:
    """The ILP's answer.

    Attributes:
        picked: the selected candidates in pipeline order (the warm start if HiGHS found nothing better).
        status: optimal, feasible (with ``gap``) or infeasible.
        gap: relative gap between the incumbent and the best bound (0 when optimal).
        seconds: wall time, candidate generation included.
        variables: number of binary variables (0 when the DP bounds proved the plan and no MILP was built).
    """

    picked: list[Candidate] | None
    status: SolverStatus
    gap: float
    seconds: float
    variables: int


class _WarmHiGHS(pulp.HiGHS):  # type: ignore[misc,name-defined]
    """PuLP's HiGHS (highspy) interface, plus a starting solution (PuLP's lacks warm start)."""

    def __init__(self, start: dict[str, float], **kw: object) -> None:
        super().__init__(**kw)
        self.start = start

    def callSolver(self, lp: pulp.LpProblem) -> None:  # noqa: N802 - PuLP's name
        h = lp.solverModel
        if self.start:
            sol = highspy.HighsSolution()
            sol.col_value = [float(self.start.get(v.name, 0.0)) for v in lp.variables()]
            sol.value_valid = True
            h.setSolution(sol)
        h.run()
        if self.start and not _consistent(h):
            # HiGHS 1.16 can end "optimal" with the start as its solution and an objective that is not the start's
            # (tests/unit/test_solve_fast.py, a 2-block chain at M=1: objective 1.5 reported, the start's 3.5
            # returned, the optimum 2.51): solve again without the start.
            h.clearSolver()
            h.run()


def _consistent(h: highspy.Highs) -> bool:
    """Whether HiGHS's reported objective is the objective of the solution it returns (or it has none)."""
    if h.getModelStatus() not in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit):
        return True
    values = np.asarray(h.getSolution().col_value, dtype=np.float64)
    if values.size == 0:
        return True
    reported = float(h.getInfo().objective_function_value)
    actual = float(np.asarray(h.getLp().col_cost_, dtype=np.float64) @ values) + float(h.getLp().offset_)
    return abs(reported - actual) <= 1e-6 * max(1.0, abs(actual))


def _by_position(tab: CandidateTable, n: int, key: np.ndarray) -> list[np.ndarray]:
    """Candidate indices grouped by ``key`` (their start ``a`` or end ``b``), one array per position 0..n."""
    order = np.argsort(key, kind="stable")
    cuts = np.searchsorted(key[order], np.arange(n + 2))
    return [order[cuts[p]:cuts[p + 1]] for p in range(n + 1)]


def _expr(x: list[pulp.LpVariable], idx: np.ndarray, coef: np.ndarray | float = 1.0) -> pulp.LpAffineExpression:
    c = np.broadcast_to(np.asarray(coef, dtype=np.float64), idx.shape)
    return pulp.LpAffineExpression([(x[i], float(v)) for i, v in zip(idx.tolist(), c.tolist())])


def _add_tiling(prob: pulp.LpProblem, x: list[pulp.LpVariable], tab: CandidateTable, n: int) -> None:
    starts, ends = _by_position(tab, n, tab.a), _by_position(tab, n, tab.b)
    prob += _expr(x, starts[0]) == 1, "tile_start"
    prob += _expr(x, ends[n]) == 1, "tile_end"
    for p in range(1, n):
        if starts[p].size or ends[p].size:
            prob += _expr(x, ends[p]) - _expr(x, starts[p]) == 0, f"tile_{p}"


def _add_devices(prob: pulp.LpProblem, x: list[pulp.LpVariable], tab: CandidateTable, counts: dict[str, int]) -> None:
    for j, count in enumerate(counts.values()):
        idx = np.flatnonzero(tab.kind == j)
        prob += _expr(x, idx, tab.d[idx]) <= count, f"devices_{j}"


def _add_bottleneck(prob: pulp.LpProblem, x: list[pulp.LpVariable], tab: CandidateTable, n: int,
                    t_var: pulp.LpVariable, r_var: pulp.LpVariable) -> None:
    for p in range(n):
        cover = np.flatnonzero((tab.a <= p) & (tab.b > p))
        if cover.size == 0:
            continue
        prob += _expr(x, cover, tab.t[cover]) - t_var <= 0, f"bottleneck_{p}"
        tails = cover[tab.tail[cover] > 0]
        if tails.size:
            prob += _expr(x, tails, tab.tail[tails]) - r_var <= 0, f"tail_{p}"


def _add_memory_order(prob: pulp.LpProblem, x: list[pulp.LpVariable], tab: CandidateTable, n: int,
                      devices: int, big_j: int) -> None:
    binding = np.flatnonzero(tab.jmax < big_j)
    if binding.size == 0:
        return
    after = [prob.add_variable(f"after_{p}", lowBound=0) for p in range(n + 1)]
    prob += after[n] == 0, "after_end"
    starts = _by_position(tab, n, tab.a)
    for p in range(n - 1, -1, -1):
        prob += after[p] - after[p + 1] - _expr(x, starts[p]) == 0, f"after_{p}"
    for i in binding.tolist():
        slack = max(0, devices - 1 - int(tab.jmax[i]))
        prob += after[int(tab.b[i])] + slack * x[i] <= int(tab.jmax[i]) + slack, f"memory_order_{i}"


def _find(tab: CandidateTable, c: Candidate) -> int | None:
    hit = np.flatnonzero((tab.a == c.a) & (tab.b == c.b) & (tab.d == c.d) & (tab.cfg == CONFIGS.index(c.config))
                         & (tab.kind == tab.kinds.index(c.kind)))
    return int(hit[0]) if hit.size else None


def prune(chain: Chain, cluster: Cluster, setting: Setting, tab: CandidateTable, ub: float, t_min: float
          ) -> CandidateTable:
    """Drop candidates that cannot be in a plan whose objective is below ``ub``.

    A plan holding candidate ``c`` costs at least ``(M - 1) max(T_min, t_c) + t_c + comm_c + tail_c +
    (M - 1) L + L`` with ``L = W / (M (D - d_c))``, ``W`` the least work of the blocks outside ``c``
    (fastest kind per block) and ``D`` the device count: the other stages share at most ``D - d_c``
    devices, so both their largest and their summed per-microbatch time are at least ``L`` (the
    bottleneck term counts ``max(T_min, t_c, L)`` once).

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        tab: the candidates.
        ub: a known plan's objective.
        t_min: a lower bound on the bottleneck of every plan.

    Returns:
        The candidates that may still improve on ``ub``.
    """
    m, n_dev = setting.microbatches, len(cluster.devices)
    work = np.min(np.stack([np.asarray(chain.fwd[k]) + np.asarray(chain.bwd[k]) for k in tab.kinds]), 0)
    rest = work[-1] - (work[tab.b] - work[tab.a])
    left = rest > 1e-12 * max(float(work[-1]), 1e-300)  # work outside c (rounding aside)
    free = n_dev - tab.d
    share = np.where(left, rest / (m * np.maximum(free, 1)), 0.0)
    bound = (m - 1) * np.maximum(np.maximum(t_min, tab.t), share) + tab.t + tab.comm + tab.tail + share
    bound = np.where(left & (free <= 0), np.inf, bound)  # work left but no device left for it
    return tab.select(bound <= ub * (1 + 1e-9))


def solve_ilp(chain: Chain, cluster: Cluster, setting: Setting, *, time_limit_s: float = 30.0,
              warm: list[Candidate] | None = None, progress: Callable[[str], None] | None = None,
              cuts: bool = True) -> IlpResult:
    """Solve the placement MILP (see the module docstring).

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        time_limit_s: time limit: the DP bounds take up to two thirds of it, HiGHS the rest.
        warm: a known plan (by default the DP's), used as the start and to prune candidates.
        progress: called with a line of text at each phase.
        cuts: bound with the DPs, prune and cut with the bounds (off only to cross-check or to
            measure what they buy: then HiGHS alone, from the warm start).

    Returns:
        The result; ``picked`` is None only when no plan fits.
    """
    say = progress or (lambda _: None)
    t0 = time.perf_counter()
    m = setting.microbatches
    if warm is None:
        warm = solve_chain(chain, cluster, setting, build_table(chain, cluster, setting))
    if not warm:
        return IlpResult(None, SolverStatus.INFEASIBLE, 0.0, time.perf_counter() - t0, 0)
    tab = build_table(chain, cluster, setting, max_time=objective(warm, m) * (1 + 1e-9))
    full = len(tab)
    t_min, s_min, lower = 0.0, 0.0, 0.0
    if cuts:
        def closing(lo: float, up: float) -> None:
            say(f"ilp: DP bounds so far: {lo:.7g} <= ILP proxy objective <= {up:.7g} ms, gap {100 * (up - lo) / up:.3f}%")

        b = objective_bounds(chain, cluster, setting, tab, start=warm, time_budget_s=2 * time_limit_s / 3,
                             progress=closing)
        t_min, s_min, lower = b.t_min, b.s_min, b.lower
        warm = b.plan or warm
        say(f"ilp: DP bounds after {b.evaluations} runs: {lower:.6g} <= ILP proxy objective <= {b.upper:.6g} ms")
        if b.upper - lower <= 1e-6 * b.upper:  # the DP's plan is proven optimal: no MILP needed
            say("ilp: optimal by the DP bounds")
            return IlpResult(warm, SolverStatus.OPTIMAL, 0.0, time.perf_counter() - t0, 0)
        tab = prune(chain, cluster, setting, tab, b.upper, t_min)
    return milp(chain, cluster, setting, tab, warm, t_min=t_min, s_min=s_min, lower=lower,
                time_limit_s=max(1.0, time_limit_s - (time.perf_counter() - t0)), progress=say, cuts=cuts,
                full=full, t0=t0)


def milp(chain: Chain, cluster: Cluster, setting: Setting, tab: CandidateTable, warm: list[Candidate], *,
         t_min: float = 0.0, s_min: float = 0.0, lower: float = 0.0, time_limit_s: float = 30.0,
         progress: Callable[[str], None] | None = None, cuts: bool = True, full: int | None = None,
         t0: float | None = None) -> IlpResult:
    """HiGHS over the candidates of ``tab``, from ``warm``, cut by bounds valid for every plan.

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        tab: the (pruned) candidates; the warm start's are added if missing.
        warm: a plan (the start, and the fallback).
        t_min, s_min, lower: lower bounds on the bottleneck, on ``sum(t + comm)`` and on the objective.
        time_limit_s: HiGHS's time limit.
        progress: called with a line of text at each phase.
        cuts: add the bounds as constraints.
        full: candidates before pruning (for the log).
        t0: when the solve began (``seconds`` counts from it).

    Returns:
        The result; the gap is against the better of HiGHS's bound and ``lower``.
    """
    say = progress or (lambda _: None)
    t0 = time.perf_counter() if t0 is None else t0
    m = setting.microbatches
    full = len(tab) if full is None else full
    ub = objective(warm, m)
    missing = [c for c in warm if _find(tab, c) is None]
    if missing:  # the warm start always stays representable
        extra = CandidateTable.of(missing, tab.kinds)
        tab = CandidateTable.concat(tab.kinds, [{f: getattr(t, f) for f in _COLUMNS} for t in (tab, extra)])
    say(f"ilp: {len(tab)} candidate stages ({full} before pruning) over {chain.n} positions, M={m}")
    prob = pulp.LpProblem("placement", pulp.LpMinimize)
    x = [prob.add_variable(f"x_{i}", 0, 1, cat=pulp.LpBinary) for i in range(len(tab))]
    t_var, r_var = prob.add_variable("T", lowBound=t_min), prob.add_variable("R", lowBound=0)
    every = np.arange(len(tab))
    prob += (m - 1) * t_var + _expr(x, every, tab.t + tab.comm) + r_var
    _add_tiling(prob, x, tab, chain.n)
    _add_devices(prob, x, tab, kind_counts(cluster))
    _add_bottleneck(prob, x, tab, chain.n, t_var, r_var)
    _add_memory_order(prob, x, tab, chain.n, len(cluster.devices), classes(setting, len(cluster.devices)))
    if cuts:  # valid for every plan (bounds.py); they tighten the LP relaxation
        prob += _expr(x, every, tab.t + tab.comm) >= s_min * (1 - 1e-9), "sum_bound"
        prob += (m - 1) * t_var + _expr(x, every, tab.t + tab.comm) + r_var >= lower * (1 - 1e-9), "objective_bound"
    start = _start(tab, warm, chain.n)
    left = max(0.5, time_limit_s)
    say(f"ilp: solving with HiGHS (time limit {left:.3g} s)")
    quiet_banner()  # PuLP makes its HiGHS before it sets msg=False
    solver = _WarmHiGHS(start, msg=False, timeLimit=left, gapRel=1e-6)
    prob.solve(solver)
    sol = prob.sol_status
    gap = 0.0
    if sol == pulp.LpSolutionOptimal:
        status = SolverStatus.OPTIMAL
    elif sol == pulp.LpSolutionIntegerFeasible:
        status = SolverStatus.FEASIBLE
        # HiGHS's own gap is inf when the time limit hit before its root bound; the DP's bound still holds.
        incumbent = float(pulp.value(prob.objective))
        bound = max(float(prob.solverModel.getInfo().mip_dual_bound), lower)
        gap = max(0.0, (incumbent - bound) / incumbent) if incumbent > 0 else 0.0
    else:  # no incumbent within the time limit: fall back to the warm start, gap against HiGHS's bound
        bound = max(float(prob.solverModel.getInfo().mip_dual_bound), lower)
        gap = max(0.0, (ub - bound) / ub) if ub > 0 and bound > -1e30 else 1.0
        say(f"ilp: no solution from HiGHS within {left:.3g} s; keeping the warm start")
        return IlpResult(warm, SolverStatus.FEASIBLE, gap, time.perf_counter() - t0, len(tab))
    chosen = sorted((tab.candidate(i) for i in range(len(tab)) if (x[i].varValue or 0.0) > 0.5), key=lambda c: c.a)
    say(f"ilp: {status.value}, ILP proxy objective {pulp.value(prob.objective):.4g} ms, gap {gap:.2%}")
    return IlpResult(chosen, status, gap, time.perf_counter() - t0, len(tab))


def _start(tab: CandidateTable, warm: list[Candidate], n: int) -> dict[str, float]:
    """The warm start as variable values: its candidates, bottleneck, tail and stage counts."""
    start: dict[str, float] = {f"x_{_find(tab, c)}": 1.0 for c in warm}
    start["T"], start["R"] = max(c.t for c in warm), max(c.tail for c in warm)
    after = 0
    for c in reversed(warm):
        after += 1
        start[f"after_{c.a}"] = after
    carry = 0.0
    for p in range(n, -1, -1):  # positions between stage starts carry the count of the next start
        carry = start.get(f"after_{p}", carry)
        start[f"after_{p}"] = carry
    return start
