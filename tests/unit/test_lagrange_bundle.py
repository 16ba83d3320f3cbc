"""The cutting-plane step of the many-kind bound (solve/bundle.py) against an LP and the exact DP.

The Lagrangian dual of a threshold pair is concave and piecewise linear in a handful of prices; each shortest path
is a plane above it. ``box_argmax`` must be the exact maximiser of the planes within its box (checked against
scipy's LP), and the branch and bound over thresholds, its duals maximised by those planes, must prove the exact
DP's optimum in few shortest paths where the projected subgradient steps it replaced (aimed at the value that
would settle a box, far above what the dual reaches) needed hundreds.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.floats(0.01, 50.0), st.integers(0, 2**31 - 1))
def test_box_argmax_is_the_lp_maximiser_of_the_planes(k, p, radius, seed) -> None:
    from scipy.optimize import linprog

    from hpml_compile.solve.bundle import Planes, box_argmax

    rng = np.random.default_rng(seed)
    c, g = rng.uniform(-10, 10, p), rng.uniform(-5, 5, (p, k))
    center = rng.uniform(0, 5, k) * (rng.random(k) < 0.7)
    lam, z = box_argmax(c, g, center, radius)
    assert np.all(lam >= 0) and np.all(np.abs(lam - center) <= radius + 1e-7)
    assert z == pytest.approx(float(np.min(c + g @ lam)), abs=1e-7)  # the value at the point returned
    # maximise z s.t. z <= c_p + g_p . lam, within the box (variables lam..., z; minimise -z)
    bounds = [(max(0.0, x - radius), x + radius) for x in center] + [(None, None)]
    ref = linprog(np.r_[np.zeros(k), -1.0], A_ub=np.c_[-g, np.ones(p)], b_ub=c, bounds=bounds, method="highs")
    assert ref.status == 0 and z == pytest.approx(-ref.fun, abs=1e-6 * max(1.0, abs(ref.fun)))
    # the shared pool hands a pair only the planes of paths within its thresholds
    pool = Planes(k)
    for i in range(p):
        pool.add(float(c[i]), g[i], float(i), 0.0)
    got_c, _ = pool.valid(p / 2, 0.0, center)
    assert sorted(got_c.tolist()) == sorted(c[: int(np.floor(p / 2)) + 1].tolist())


@pytest.mark.parametrize("blocks,per,microbatches,batch", [(12, 4, 16, 64), (16, 4, 32, 128)])
def test_many_kind_bound_proves_the_exact_optimum_in_few_paths(blocks, per, microbatches, batch) -> None:
    """Three kinds (speeds 1 : 2.5 : 4) of ``per`` devices, a pipeline whose bottleneck dominates the objective:
    the Lagrangian branch and bound meets the exact DP's optimum (every count vector in the state), and with the
    box-step duals it needs at most 100 shortest paths (42 and 37 here); the target-level subgradient steps took
    316 and 269."""
    from hpml_compile.plan import Schedule
    from hpml_compile.solve.bounds import objective_bounds
    from hpml_compile.solve.candidates import Chain, Setting
    from hpml_compile.solve.lagrange import lagrangian_bounds
    from hpml_compile.solve.table import build_table
    from hpml_compile.testing import chain_graph, cluster_of

    graph = chain_graph([{"a": (1.0, 2.0), "b": (2.5, 5.0), "c": (4.0, 8.0)}] * blocks, batch_size=batch)
    cluster = cluster_of(["a"] * per + ["b"] * per + ["c"] * per)
    chain, setting = Chain.of(graph), Setting(microbatches, Schedule.ONE_F_ONE_B, batch)
    tab = build_table(chain, cluster, setting)
    exact = objective_bounds(chain, cluster, setting, tab, time_budget_s=60.0, max_evaluations=10**5)
    assert exact.complete and exact.lower == pytest.approx(exact.upper, rel=1e-9)
    b, _ = lagrangian_bounds(chain, cluster, setting, tab)
    assert b.lower <= exact.upper * (1 + 1e-9)  # a bound, never above the optimum
    assert b.lower == pytest.approx(exact.upper, rel=1e-6) and b.upper == pytest.approx(exact.upper, rel=1e-6)
    assert b.evaluations <= 100, b.evaluations


def test_one_microbatch_bound_keeps_one_bottleneck_threshold(monkeypatch) -> None:
    """At M = 1 the objective has no ``(M - 1) T`` term, so every bottleneck threshold gives a box the same bound
    and only the largest can settle one. Where the duals stop below the optimum (here: the floored DPs switched off,
    as they are too costly at scale, on a random 8-block chain with memory limits) the branch and bound used to
    settle every one of the 180 stage-time thresholds against every tail one: 43,512 shortest paths to reach the
    bound it now reaches in ~100, and no higher."""
    from hpml_compile.plan import Schedule
    from hpml_compile.solve import lagrange
    from hpml_compile.solve.bounds import objective_bounds
    from hpml_compile.solve.candidates import Chain, Setting
    from hpml_compile.solve.table import build_table
    from hpml_compile.testing import chain_graph, cluster_of

    rng = np.random.default_rng(0)
    nb, na, nbb = int(rng.integers(4, 9)), int(rng.integers(1, 8)), int(rng.integers(0, 6))
    costs = [{"a": (float(rng.uniform(0.5, 3)), float(rng.uniform(0.5, 3))),
              "b": (float(rng.uniform(1, 5)), float(rng.uniform(1, 5)))} for _ in range(nb)]
    graph = chain_graph(costs, batch_size=64, param_bytes=[int(x) for x in rng.integers(2**24, 2**27, nb)])
    cluster = cluster_of(["a"] * na + ["b"] * nbb, memory_gib=float(rng.uniform(0.5, 3)), free_links=False)
    chain, setting = Chain.of(graph), Setting(1, Schedule.ONE_F_ONE_B, 64)
    tab = build_table(chain, cluster, setting)
    assert np.unique(tab.t).size > 100  # many bottleneck thresholds
    exact = objective_bounds(chain, cluster, setting, tab, time_budget_s=60.0, max_evaluations=10**5)
    monkeypatch.setattr(lagrange, "floor_variants", lambda counts, kinds: [])
    b, _ = lagrange.lagrangian_bounds(chain, cluster, setting, tab)
    assert b.complete and b.lower <= exact.upper * (1 + 1e-9)
    assert b.lower >= exact.upper * 0.97  # the prices' bound (a duality gap of ~3% here, which the floors close)
    assert b.evaluations <= 1000, b.evaluations


@pytest.mark.dist  # a fresh process: HiGHS prints its banner once per process
@pytest.mark.parametrize("path", ["bundle", "ilp"])
def test_a_solve_prints_no_highs_banner(path: str) -> None:
    """HiGHS prints two banner lines on its first instance in a process, before any option can be set; ``plan``'s
    log had them in its middle (from the many-kind bound's box LP, or from PuLP's MILP). A fresh process that
    solves one of each prints nothing."""
    import subprocess
    import sys

    code = {"bundle": ("import numpy as np\n"
                       "from hpml_compile.solve.bundle import Planes, box_argmax\n"
                       "pl = Planes(2)\n"
                       "pl.add(6.0, np.array([-1.0, 0.0]), 1.0, 1.0)\n"
                       "box_argmax(*pl.valid(2.0, 2.0, np.zeros(2)), np.zeros(2), 5.0)\n"),
            "ilp": ("from hpml_compile.plan import Schedule\n"
                    "from hpml_compile.solve.candidates import Chain, Setting\n"
                    "from hpml_compile.solve.ilp import milp\n"
                    "from hpml_compile.solve.table import build_table\n"
                    "from hpml_compile.testing import chain_graph, uniform_cluster\n"
                    "ch, c = Chain.of(chain_graph([(1.0, 2.0)] * 6)), uniform_cluster(2)\n"
                    "st = Setting(4, Schedule.ONE_F_ONE_B, 64)\n"
                    "tab = build_table(ch, c, st)\n"
                    "warm = [tab.candidate(i) for i in range(len(tab)) if (tab.a[i], tab.b[i], tab.d[i]) == (0, 6, 2)]\n"
                    "milp(ch, c, st, tab, warm, time_limit_s=5)\n")}[path]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "", out.stdout
