"""The many-kind path's first plans (solve._first_plan, restricted.proxy_sweep) are chosen on the ILP's objective.

The restricted DPs (coarse units, kinds in blocks) used to return their min-bottleneck tilings only, so at few
microbatches a count was ranked (and its bound cut off) by a pipeline run stage after stage where one wide stage is
better on the proxy ``(M - 1) T + S + R``. Now each DP also takes its least-sum tiling and least-sum tilings under
bottleneck thresholds between; checked here against the old choice, brute force and the exact least-sum DP.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given

from hpml_compile.plan import Schedule
from hpml_compile.solve.candidates import Chain, Setting, classes, kind_counts
from hpml_compile.solve.dp import objective, tile
from test_solve_fast import HYP, _setup, brute_force_objective, cases


def _wide() -> tuple[Chain, object]:
    """8 equal blocks, 4 fast + 4 slow devices: at M=1 one stage of the 4 fast devices (6 ms on the proxy) beats
    the min-bottleneck pipeline of 6 blocks on the fast and 2 on the slow devices (7.5 ms)."""
    from hpml_compile.testing import chain_graph, cluster_of

    chain = Chain.of(chain_graph([{"fast": (1.0, 2.0), "slow": (2.0, 4.0)}] * 8))
    return chain, cluster_of(["fast"] * 4 + ["slow"] * 4)


def test_first_plan_at_one_microbatch_is_one_wide_stage() -> None:
    """At M=1 the first plan is the proxy's best (one stage of all fast devices), not the min-bottleneck pipeline;
    at M=8, where the bottleneck dominates, the min-bottleneck plan stays."""
    from hpml_compile.solve import _first_plan

    chain, cluster = _wide()
    one = Setting(1, Schedule.ONE_F_ONE_B, 64)
    got = _first_plan(chain, cluster, one)
    assert got is not None and [(c.kind, c.b - c.a, c.d) for c in got] == [("fast", 8, 4)]
    assert objective(got, 1) == pytest.approx(6.0)
    old = _first_plan(chain, cluster, one, sweep=False)
    assert old is not None and [(c.kind, c.b - c.a, c.d) for c in old] == [("fast", 6, 4), ("slow", 2, 4)]
    assert objective(old, 1) == pytest.approx(7.5)
    eight = Setting(8, Schedule.ONE_F_ONE_B, 64)
    assert objective(_first_plan(chain, cluster, eight), 8) == pytest.approx(
        objective(_first_plan(chain, cluster, eight, sweep=False), 8))


def test_many_kind_solve_ranks_its_first_count_by_the_swept_plan() -> None:
    """On the many-kind path (12 + 12 devices: 169 count vectors) the first count is planned with the
    min-bottleneck tilings alone (a first plan early), then swept: the log shows both, and the solve at M=1
    returns the one wide stage, proven optimal."""
    from hpml_compile.plan import SolverStatus
    from hpml_compile.solve import solve
    from hpml_compile.solve.lagrange import EXACT_VECTORS, vectors
    from hpml_compile.testing import chain_graph, cluster_of

    graph = chain_graph([{"fast": (1.0, 2.0), "slow": (2.0, 4.0)}] * 8)
    cluster = cluster_of(["fast"] * 12 + ["slow"] * 12)
    assert vectors(kind_counts(cluster)) > EXACT_VECTORS
    lines: list[str] = []
    plan = solve(graph, cluster, solver="ilp", microbatches=1, time_limit_s=10, progress=lines.append)
    first = [float(m.group(1)) for x in lines if (m := re.match(r"portfolio: M=1: \d+ stages, proxy objective ([0-9.e+]+) "
                                                              r"ms \(first plan after", x))]
    swept = [float(m.group(1)) for x in lines if (m := re.match(r"portfolio: M=1: \d+ stages, proxy objective ([0-9.e+]+) "
                                                              r"ms \(its first plan swept", x))]
    assert first and swept and swept[0] < first[0], lines
    assert len(plan.stages) == 1 and plan.solver.status is SolverStatus.OPTIMAL


@HYP
@given(cases())
def test_swept_first_plans_fit_and_are_never_worse(case) -> None:
    """On random DAGs and clusters: the swept first plan exists exactly when the min-bottleneck one does, tiles
    the chain within every kind's devices and memory class, is no worse on the proxy than the min-bottleneck
    plan or either DP's least-sum plan, and no better than brute force over all plans."""
    from hpml_compile.solve import _first_plan
    from hpml_compile.solve.restricted import coarse_chain, feasible, ordered_chain, ordered_units, speed_order
    from hpml_compile.solve.table import build_table

    chain, cluster, setting = _setup(case)
    m = setting.microbatches
    old = _first_plan(chain, cluster, setting, sweep=False)
    got = _first_plan(chain, cluster, setting)
    if old is None:
        assert got is None
        return
    assert got is not None
    assert got[0].a == 0 and got[-1].b == chain.n and all(x.b == y.a for x, y in zip(got, got[1:]))
    assert feasible(got, kind_counts(cluster), classes(setting, len(cluster.devices)))
    tab = build_table(chain, cluster, setting)
    order, unit = speed_order(chain, tab.kinds), ordered_units(cluster, setting)
    least = [coarse_chain(chain, cluster, setting, tab, bottleneck=False),
             ordered_chain(chain, cluster, setting, tab, order, unit=unit, bottleneck=False)]
    assert objective(got, m) <= min(objective(p, m) for p in [old] + [p for p in least if p]) * (1 + 1e-12)
    if len(tab) <= 150:
        assert objective(got, m) >= brute_force_objective(chain, cluster, setting, tab) * (1 - 1e-9)


@HYP
@given(cases())
def test_least_sum_tilings_are_the_exact_least_sum_with_one_kind(case) -> None:
    """With one kind both restricted DPs are the exact DP (unit 1, one block): their least-sum tilings
    (``bottleneck=False``) reach the least ``sum(t + comm + tail)`` of :func:`~hpml_compile.solve.dp.tile` with
    the bottleneck key at zero, and fit."""
    from hpml_compile.solve.restricted import coarse_chain, feasible, ordered_chain
    from hpml_compile.solve.table import build_table

    chain, cluster, setting = _setup(case)
    counts = kind_counts(cluster)
    if len(counts) != 1 or len(cluster.devices) > 8:  # coarse units stay 1 up to 99 devices; keep it small
        return
    tab = build_table(chain, cluster, setting)
    big_j = classes(setting, len(cluster.devices))
    own = tab.t + tab.comm + tab.tail
    want = tile(chain.n, counts, tab, np.zeros(len(tab)), own, tab.jmax, big_j, min(big_j, 4))
    for got in (ordered_chain(chain, cluster, setting, tab, bottleneck=False),
                coarse_chain(chain, cluster, setting, tab, bottleneck=False)):
        if want is None:
            assert got is None
            continue
        assert got is not None and feasible(got, counts, big_j)
        assert sum(c.t + c.comm + c.tail for c in got) == pytest.approx(want[1], rel=1e-9)
