"""The local search of solve/uneven (its moves, one test each, and the descent), solve/mixed's plan builder and
keep-best helper, and the plan_quality benchmark's compute bound."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest

from hpml_compile.plan import Plan, Schedule, SolverInfo, Stage, validate_plan
from hpml_compile.simulate import annotate
from hpml_compile.testing import chain_graph, chain_profile, cluster_of
from hpml_compile.solve.mixed import build_plan, fastest
from hpml_compile.solve.uneven import improve, local_search, moved_devices, other_counts, shape_of, shifted_cuts

COSTS = [{"fast": (1.0, 2.0), "slow": (3.0, 6.0)}] * 4


def test_moved_devices_moves_drops_adds_and_swaps_one_device() -> None:
    shape = ((("a", "b"), ("c",)), (0, 2, 4), 2)
    got = {s[0] for s in moved_devices(shape, ["a", "b", "c", "d"])}
    assert all(s[1:] == ((0, 2, 4), 2) for s in moved_devices(shape, ["a", "b", "c", "d"]))
    assert got == {
        (("b",), ("c",)), (("a",), ("c",)),              # a device of the 2-device stage left out
        (("b",), ("c", "a")), (("a",), ("c", "b")),      # ... or moved to the other stage
        (("a", "b", "d"), ("c",)), (("a", "b"), ("c", "d")),  # the idle device added to a stage
        (("c", "b"), ("a",)), (("a", "c"), ("b",)),      # two devices of different stages swapped
    }
    # a stage of one device keeps it: no shape leaves a stage empty
    assert all(all(g) for g, _, _ in moved_devices(((("a",), ("c",)), (0, 2, 4), 1), ["a", "c"]))


def test_shifted_cuts_moves_one_boundary_within_its_neighbours() -> None:
    shape = ((("a",), ("b",)), (0, 2, 4), 1)
    assert {s[1] for s in shifted_cuts(shape, [0, 1, 2, 3, 4])} == {(0, 1, 4), (0, 3, 4)}  # +-2 would empty one
    # only where a stage may end: position 3 is not a cut point
    assert {s[1] for s in shifted_cuts(shape, [0, 1, 2, 4])} == {(0, 1, 4)}
    three = ((("a",), ("b",), ("c",)), (0, 2, 4, 8), 1)
    assert {s[1] for s in shifted_cuts(three, range(9))} == {(0, 1, 4, 8), (0, 3, 4, 8), (0, 2, 3, 8), (0, 2, 5, 8),
                                                             (0, 2, 6, 8)}


def test_other_counts_are_the_neighbouring_divisors() -> None:
    shape = ((("a",),), (0, 4), 4)
    assert [s[2] for s in other_counts(shape, [1, 2, 4, 8, 16])] == [2, 8]
    assert [s[2] for s in other_counts(((("a",),), (0, 4), 1), [1, 2])] == [2]


def test_shape_of_reads_the_plan_back() -> None:
    g = chain_graph(COSTS, param_bytes=1000)
    c = cluster_of(["fast", "slow", "slow"])
    p = build_plan(g, c, [["d0"], ["d1", "d2"]], [0, 1, 4], 2, Schedule.ONE_F_ONE_B, "float32", "x")
    assert p is not None and shape_of(g, p) == ((("d0",), ("d1", "d2")), (0, 1, 4), 2)


def test_local_search_descends_to_a_faster_valid_plan_and_stops_at_a_local_optimum() -> None:
    g = chain_graph(COSTS, param_bytes=1000)
    c = cluster_of(["fast", "slow", "slow"])

    def score(p: Plan) -> float:
        return annotate(p, g)[1].step_ms

    # a poor start: the fast device on three blocks, a slow one on one, the other slow device idle
    start = build_plan(g, c, [["d0"], ["d1"]], [0, 3, 4], 2, Schedule.ONE_F_ONE_B, "float32", "start")
    assert start is not None
    found = local_search(g, c, start, score)
    assert len(found) == 1 and score(found[0]) < score(start)
    validate_plan(found[0], chain_profile(COSTS, param_bytes=1000))
    # from where it stopped, no neighbour is faster
    assert local_search(g, c, found[0], score) == []
    # a microbatch count the user fixed stays fixed
    fixed = local_search(g, c, start, score, microbatches=2)
    assert fixed and fixed[0].microbatches == 2


def test_local_search_improves_on_every_random_start_or_proves_it_cannot() -> None:
    # every plan local_search returns beats its start, and the neighbours of that plan do not beat it
    rng = random.Random(15)
    g = chain_graph([{"fast": (rng.uniform(0.5, 2), rng.uniform(1, 4)), "slow": (rng.uniform(2, 4), rng.uniform(4, 8))}
                     for _ in range(4)], param_bytes=1000)
    c = cluster_of(["fast", "slow", "slow"])

    def score(p: Plan) -> float:
        return annotate(p, g)[1].step_ms

    for _ in range(2):
        cut = rng.randint(1, 3)
        start = build_plan(g, c, [["d0", "d1"], ["d2"]], [0, cut, 4], rng.choice([1, 2, 4]), Schedule.ONE_F_ONE_B,
                       "float32", "start")
        assert start is not None
        found = local_search(g, c, start, score)
        if found:
            assert score(found[0]) < score(start)
            assert local_search(g, c, found[0], score) == []


def testfastest_skips_plans_that_did_not_fit() -> None:
    g = chain_graph(COSTS, param_bytes=1000)
    c = cluster_of(["fast", "slow"])
    slow = build_plan(g, c, [["d1"]], [0, 4], 1, Schedule.ONE_F_ONE_B, "float32", "slow")
    both = build_plan(g, c, [["d0", "d1"]], [0, 4], 1, Schedule.ONE_F_ONE_B, "float32", "both")

    def score(p: Plan) -> float:
        return annotate(p, g)[1].step_ms

    assert fastest([None, slow, None, both], score) is both
    assert fastest([None], score) is None


def test_improve_reports_the_local_search_when_it_wins() -> None:
    g = chain_graph(COSTS, param_bytes=1000)
    c = cluster_of(["fast", "slow", "slow"])
    poor = Plan("toy", c, Schedule.ONE_F_ONE_B, 2,
                (Stage(0, ("d0",), tuple(m for n in g.order[:3] for m in g.node(n).members)),
                 Stage(1, ("d1",), tuple(m for n in g.order[3:] for m in g.node(n).members))),
                solver=SolverInfo("hand"))
    got = improve(g, c, poor)
    assert got.plan.predicted.step_ms < got.base_ms
    assert got.plan.solver.name.startswith("hand+uneven:")


def _bench_main():
    path = Path(__file__).parents[2] / "benchmarks" / "plan_quality" / "main.py"
    spec = importlib.util.spec_from_file_location("plan_quality_main", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_spread_bound_is_the_linear_programs_optimum() -> None:
    spread = _bench_main().spread_bound
    rng = np.random.default_rng(15)
    f = np.linspace(0, 1, 401)
    ff, gg = np.meshgrid(f, f, indexing="ij")
    for _ in range(20):
        (w1, o1), (w2, o2) = rng.uniform(1, 10, 2), rng.uniform(0.1, 5, 2)
        # two devices: device 1 does shares (f, g), device 2 the rest; the step is the busier one
        brute = np.max([ff * w1 + gg * o1, (1 - ff) * w2 + (1 - gg) * o2], axis=0).min()
        got = spread([(w1, o1), (w2, o2)])
        assert got <= brute + 1e-9 and got == pytest.approx(brute, rel=0.01)
    # no optimizer: the harmonic bound; equal devices: the whole work over their count
    assert spread([(2.0, 0.0), (6.0, 0.0)]) == pytest.approx(1.5)
    assert spread([(3.0, 1.0)] * 4) == pytest.approx(1.0)
