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

Objective (the simulator's step time for a pipeline with overlapped sends):
    minimise ``(M - 1) T + sum_c (t_c + e_c) x_c + R``.

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
        in the LP relaxation than ``T >= t_c x_c``), and ``R >= r_c x_c``;
    memory order, :func:`_add_memory_order`: ``after_p = after_{p+1} +
        sum_{a_c = p} x_c`` and, for each candidate that does not fit at every
        position, ``after_{b_c} <= jmax_c + (D - 1 - jmax_c)(1 - x_c)``.

The memory budget itself is in the candidate set. The stage count, the
data-parallel degree and memory options of each stage, and the device kind
order along the pipeline are all decided here; the microbatch count is
searched outside (:func:`hpml_compile.solve.solve`). HiGHS is warm-started
with the DP's plan, so that a plan exists even when the time limit hits, and
its status is read from ``sol_status`` (after a time limit a status may read
"Optimal" while only a feasible solution exists).

Example:
    >>> from hpml_compile.solve.candidates import Chain, Setting
    >>> from hpml_compile.solve.testing import chain_graph, cluster_of
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

from ..ir import Cluster
from ..plan import SolverStatus
from .candidates import Candidate, Chain, Setting, classes, enumerate_candidates, kind_counts
from .dp import objective, solve_chain

__all__ = ["IlpResult", "solve_ilp"]


@dataclass(frozen=True, slots=True)
class IlpResult:
    """The ILP's answer.

    Attributes:
        picked: the selected candidates in pipeline order (the warm start if HiGHS found nothing better).
        status: optimal, feasible (with ``gap``) or infeasible.
        gap: relative gap between the incumbent and the best bound (0 when optimal).
        seconds: wall time, candidate generation included.
        variables: number of binary variables.
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
        if self.start:
            sol = highspy.HighsSolution()
            sol.col_value = [float(self.start.get(v.name, 0.0)) for v in lp.variables()]
            sol.value_valid = True
            lp.solverModel.setSolution(sol)
        lp.solverModel.run()


def _add_tiling(prob: pulp.LpProblem, x: dict[int, pulp.LpVariable], cands: list[Candidate], n: int) -> None:
    starts: list[list[int]] = [[] for _ in range(n + 1)]
    ends: list[list[int]] = [[] for _ in range(n + 1)]
    for i, c in enumerate(cands):
        starts[c.a].append(i)
        ends[c.b].append(i)
    prob += pulp.lpSum(x[i] for i in starts[0]) == 1, "tile_start"
    prob += pulp.lpSum(x[i] for i in ends[n]) == 1, "tile_end"
    for p in range(1, n):
        if starts[p] or ends[p]:
            prob += (pulp.lpSum(x[i] for i in ends[p]) - pulp.lpSum(x[i] for i in starts[p]) == 0,
                     f"tile_{p}")


def _add_devices(prob: pulp.LpProblem, x: dict[int, pulp.LpVariable], cands: list[Candidate],
                 counts: dict[str, int]) -> None:
    for j, (kind, count) in enumerate(counts.items()):
        prob += pulp.LpAffineExpression([(x[i], c.d) for i, c in enumerate(cands) if c.kind == kind]) <= count, \
            f"devices_{j}"


def _add_bottleneck(prob: pulp.LpProblem, x: dict[int, pulp.LpVariable], cands: list[Candidate], n: int,
                    t_var: pulp.LpVariable, r_var: pulp.LpVariable) -> None:
    cover: list[list[tuple[pulp.LpVariable, float]]] = [[] for _ in range(n)]
    for i, c in enumerate(cands):
        for p in range(c.a, c.b):
            cover[p].append((x[i], c.t))
        if c.tail > 0:
            prob += r_var >= c.tail * x[i], f"tail_{i}"
    for p in range(n):
        if cover[p]:
            prob += pulp.LpAffineExpression(cover[p]) - t_var <= 0, f"bottleneck_{p}"


def _add_memory_order(prob: pulp.LpProblem, x: dict[int, pulp.LpVariable], cands: list[Candidate], n: int,
                      devices: int, big_j: int) -> None:
    binding = [i for i, c in enumerate(cands) if c.jmax < big_j]
    if not binding:
        return
    after = [prob.add_variable(f"after_{p}", lowBound=0) for p in range(n + 1)]
    prob += after[n] == 0, "after_end"
    starts: list[list[int]] = [[] for _ in range(n + 1)]
    for i, c in enumerate(cands):
        starts[c.a].append(i)
    for p in range(n - 1, -1, -1):
        prob += after[p] - after[p + 1] - pulp.lpSum(x[i] for i in starts[p]) == 0, f"after_{p}"
    for i in binding:
        c = cands[i]
        slack = max(0, devices - 1 - c.jmax)
        prob += after[c.b] + slack * x[i] <= c.jmax + slack, f"memory_order_{i}"


def _key(c: Candidate) -> tuple[object, ...]:
    return (c.a, c.b, c.kind, c.d, c.config)


def solve_ilp(chain: Chain, cluster: Cluster, setting: Setting, *, time_limit_s: float = 30.0,
              warm: list[Candidate] | None = None, progress: Callable[[str], None] | None = None) -> IlpResult:
    """Solve the placement MILP (see the module docstring).

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        time_limit_s: HiGHS time limit.
        warm: a known plan (by default the DP's), used as the start and to prune candidates.
        progress: called with a line of text at each phase.

    Returns:
        The result; ``picked`` is None only when no plan fits.
    """
    say = progress or (lambda _: None)
    t0 = time.perf_counter()
    m = setting.microbatches
    if warm is None:
        warm = solve_chain(chain, cluster, setting, enumerate_candidates(chain, cluster, setting))
    ub = objective(warm, m) if warm else float("inf")
    cands = enumerate_candidates(chain, cluster, setting, max_time=ub * (1 + 1e-9))
    index = {_key(c): i for i, c in enumerate(cands)}
    if warm:
        for c in warm:  # the warm start always stays representable
            if _key(c) not in index:
                index[_key(c)] = len(cands)
                cands.append(c)
    if not cands:
        return IlpResult(None, SolverStatus.INFEASIBLE, 0.0, time.perf_counter() - t0, 0)
    say(f"ilp: {len(cands)} candidate stages over {chain.n} positions, M={m}")
    prob = pulp.LpProblem("placement", pulp.LpMinimize)
    x = {i: prob.add_variable(f"x_{i}", 0, 1, cat=pulp.LpBinary) for i in range(len(cands))}
    t_var, r_var = prob.add_variable("T", lowBound=0), prob.add_variable("R", lowBound=0)
    prob += (m - 1) * t_var + pulp.LpAffineExpression([(x[i], c.t + c.comm) for i, c in enumerate(cands)]) + r_var
    _add_tiling(prob, x, cands, chain.n)
    _add_devices(prob, x, cands, kind_counts(cluster))
    _add_bottleneck(prob, x, cands, chain.n, t_var, r_var)
    _add_memory_order(prob, x, cands, chain.n, len(cluster.devices), classes(setting, len(cluster.devices)))
    start: dict[str, float] = {}
    if warm:
        start = {f"x_{index[_key(c)]}": 1.0 for c in warm}
        start["T"], start["R"] = max(c.t for c in warm), max(c.tail for c in warm)
        after = 0
        for c in reversed(warm):
            after += 1
            start[f"after_{c.a}"] = after
        # positions between stage starts carry the count of the next start
        carry = 0.0
        for p in range(chain.n, -1, -1):
            carry = start.get(f"after_{p}", carry)
            start[f"after_{p}"] = carry
    say(f"ilp: solving with HiGHS (time limit {time_limit_s:g} s)")
    solver = _WarmHiGHS(start, msg=False, timeLimit=time_limit_s, gapRel=1e-6)
    prob.solve(solver)
    sol = prob.sol_status
    gap = 0.0
    if sol == pulp.LpSolutionOptimal:
        status = SolverStatus.OPTIMAL
    elif sol == pulp.LpSolutionIntegerFeasible:
        status = SolverStatus.FEASIBLE
        gap = float(prob.solverModel.getInfo().mip_gap)
    elif sol == pulp.LpSolutionInfeasible and not warm:
        return IlpResult(None, SolverStatus.INFEASIBLE, 0.0, time.perf_counter() - t0, len(cands))
    else:  # no incumbent within the time limit: fall back to the warm start, gap against HiGHS's bound
        bound = float(prob.solverModel.getInfo().mip_dual_bound)
        gap = max(0.0, (ub - bound) / ub) if warm and ub > 0 and bound > -1e30 else 1.0
        say(f"ilp: no solution from HiGHS within {time_limit_s:g} s; keeping the warm start")
        return IlpResult(warm, SolverStatus.FEASIBLE, gap, time.perf_counter() - t0, len(cands))
    chosen = [cands[i] for i in x if (x[i].varValue or 0.0) > 0.5]
    chosen.sort(key=lambda c: c.a)
    say(f"ilp: {status.value}, objective {pulp.value(prob.objective):.4g} ms, gap {gap:.2%}")
    return IlpResult(chosen, status, gap, time.perf_counter() - t0, len(cands))
