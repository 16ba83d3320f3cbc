"""The local search on plans (:func:`hpml_compile.solve.polish.polish`).

Each move must keep a plan a plan (a tiling of the chain within every kind's devices and every stage's memory
class), never make it worse, and never beat brute force; moved to another microbatch count (``same=False``)
it must still be a plan at that count.
"""

from __future__ import annotations

from hypothesis import given

from hpml_compile.plan import Schedule
from hpml_compile.solve.candidates import Chain, Setting, classes, kind_counts
from hpml_compile.solve.dp import objective
from hpml_compile.solve.polish import polish
from hpml_compile.solve.restricted import feasible
from hpml_compile.solve.table import build_table
from hpml_compile.testing import chain_graph, cluster_of
from test_solve_fast import HYP, _setup, brute_force_objective, cases


def _is_tiling(plan, n: int) -> bool:
    return plan[0].a == 0 and plan[-1].b == n and all(x.b == y.a for x, y in zip(plan, plan[1:]))


@HYP
@given(cases())
def test_polished_plans_fit_are_never_worse_and_never_beat_brute_force(case) -> None:
    """On random DAGs and clusters: the first plan polished is a tiling within the devices and memory classes,
    no worse than the first plan, no better than brute force; the plan of another count moved here and polished
    is a plan of this count too."""
    from hpml_compile.solve import _first_plan

    chain, cluster, setting = _setup(case)
    m, counts, big_j = setting.microbatches, kind_counts(cluster), classes(setting, len(cluster.devices))
    first = _first_plan(chain, cluster, setting)
    if first is None:
        return
    tab = build_table(chain, cluster, setting)
    got = polish(tab, first, counts, big_j, m, until=float("inf"))
    assert _is_tiling(got, chain.n) and feasible(got, counts, big_j)
    assert objective(got, m) <= objective(first, m) * (1 + 1e-12)
    if len(tab) <= 150:
        assert objective(got, m) >= brute_force_objective(chain, cluster, setting, tab) * (1 - 1e-9)
    other = Setting(1 if m > 1 else 4, setting.schedule, setting.batch_size)  # the move "change M"
    moved = polish(build_table(chain, cluster, other), first, counts, classes(other, len(cluster.devices)), other.microbatches,
                   until=float("inf"), same=False)
    if moved is not first:
        assert _is_tiling(moved, chain.n) and feasible(moved, counts, classes(other, len(cluster.devices)))


def test_polish_reaches_brute_force_from_an_unbalanced_plan() -> None:
    """Two kinds, the slow one given as many blocks as the fast one: polished, brute force's optimum."""
    chain = Chain.of(chain_graph([{"a": (1.0, 1.0), "b": (2.0, 2.0)}] * 12, batch_size=64))
    cluster = cluster_of(["a", "a", "b", "b"])
    setting = Setting(16, Schedule.ONE_F_ONE_B, 64)
    counts, big_j = kind_counts(cluster), classes(setting, len(cluster.devices))
    tab = build_table(chain, cluster, setting)
    bad = _plan(tab, [(0, 2, "a"), (2, 4, "a"), (4, 8, "b"), (8, 12, "b")])
    assert feasible(bad, counts, big_j)
    best = brute_force_objective(chain, cluster, setting, tab)
    assert objective(bad, 16) > best * 1.05
    got = polish(tab, bad, counts, big_j, 16, until=float("inf"))
    assert feasible(got, counts, big_j) and _is_tiling(got, chain.n)
    assert abs(objective(got, 16) - best) <= 1e-9 * best


def test_polish_walks_a_plateau_of_equal_bottlenecks() -> None:
    """Four slow stages all at the bottleneck: no single move lowers ``T`` (one stage shorter leaves three at it),
    so a search on the objective alone stops at the start; with the stages at the bottleneck as the tie-break it
    walks the plateau down (one fewer stage at ``T`` a move) and then lowers ``T``."""
    chain = Chain.of(chain_graph([{"a": (1.0, 1.0), "b": (2.0, 2.0)}] * 16, batch_size=64))
    cluster = cluster_of(["a", "a", "b", "b", "b", "b"])
    setting = Setting(16, Schedule.ONE_F_ONE_B, 64)
    counts, big_j = kind_counts(cluster), classes(setting, len(cluster.devices))
    tab = build_table(chain, cluster, setting)
    tab = tab.select((tab.d == 1) & (tab.cfg == 0))  # one device a stage: no merge into a wider stage escapes
    bad = _plan(tab, [(0, 2, "a"), (2, 4, "a"), (4, 7, "b"), (7, 10, "b"), (10, 13, "b"), (13, 16, "b")])
    assert feasible(bad, counts, big_j)
    got = polish(tab, bad, counts, big_j, 16, until=float("inf"))
    assert feasible(got, counts, big_j) and _is_tiling(got, chain.n)
    assert max(c.t for c in got) < max(c.t for c in bad) and objective(got, 16) < objective(bad, 16) * 0.95


def _plan(tab, cuts):
    """The one-device, plain-options candidates of ``cuts`` ((a, b, kind) each)."""
    ones = [i for i in range(len(tab)) if tab.d[i] == 1 and tab.cfg[i] == 0]
    return [next(tab.candidate(i) for i in ones if (tab.a[i], tab.b[i], tab.kinds[tab.kind[i]]) == c) for c in cuts]


def test_a_count_where_nothing_fits_leaves_the_plan_as_it_is() -> None:
    """Moved to a count whose table is empty (one microbatch: the whole batch's activations fit on no device),
    the plan is returned as it is, not an IndexError (the property test above found it on the CI machine)."""
    from hpml_compile.solve import _first_plan

    chain, cluster, two = _setup((1, [[]], ["A100-80GB", "A100-80GB"], [{"A100-80GB": (1.0, 1.0)}], [271], [965],
                                  1.0, 1, 2, Schedule.GPIPE, 0, False))
    first = _first_plan(chain, cluster, two)
    one = Setting(1, two.schedule, two.batch_size)
    tab = build_table(chain, cluster, one)
    assert first is not None and len(tab) == 0
    got = polish(tab, first, kind_counts(cluster), classes(one, 2), 1, until=float("inf"), same=False)
    assert got is first
