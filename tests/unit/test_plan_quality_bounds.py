"""The lower bounds that benchmarks/plan_quality measures plans against (its ``main.py``).

- ``row_bound`` is one row's forward and backward through the whole model: where the batch is small against
  the devices it is above ``compute_bound``, and a plan reaches it exactly (data parallel, one row each);
- no plan the solvers make, flat, hierarchical or compressed, simulates below ``tight_bound``;
- ``step_terms`` splits a plan's simulated step into parts that add up to it;
- the hierarchical table orders its plans (flat >= hierarchical >= compression allowed) and its bounds.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from hpml_compile.cluster import load_cluster
from hpml_compile.ir import Cluster
from hpml_compile.plan import Plan, Schedule, Stage
from hpml_compile.simulate import simulate
from hpml_compile.solve import solve
from hpml_compile.testing import chain_graph

MAIN = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_quality" / "main.py"


@pytest.fixture(scope="module")
def pq() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plan_quality_main", MAIN)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def two_by_two() -> Cluster:
    c = load_cluster("2node-a100-16")
    return Cluster(devices=tuple(d for d in c.devices if d.name in {"gpu0", "gpu1", "gpu8", "gpu9"}), name="2x2")


def test_one_row_through_the_model_bounds_a_small_batch_and_is_reached(pq: ModuleType) -> None:
    c = two_by_two()
    g = chain_graph([(1.0, 2.0)] * 4, kind="A100-80GB", batch_size=4)  # no parameters: nothing to sync or step
    assert pq.compute_bound(g, c) == pytest.approx(12.0 / 4)
    assert pq.row_bound(g, c) == pytest.approx(12.0 / 4)  # 4 rows on 4 devices: the two bounds meet
    g8 = chain_graph([(1.0, 2.0)] * 4, kind="A100-80GB", batch_size=2)  # 2 rows for 4 devices
    assert pq.row_bound(g8, c) == pytest.approx(12.0 / 2)
    assert pq.compute_bound(g8, c) == pytest.approx(3.0)  # what the device count alone allows: half of it
    everyone = Plan("toy", c, Schedule.ONE_F_ONE_B, 1, (Stage(0, ("gpu0", "gpu1", "gpu8", "gpu9"),
                                                              tuple(f"n{i}" for i in range(4))),))
    r = simulate(everyone, g)  # data parallel, a row each: exact but for the ranks' loss agreement
    assert r.agree_ms > 0 and r.step_ms == pytest.approx(pq.row_bound(g, c) + r.agree_ms)
    assert pq.optimizer_floor(g, c) == 0.0  # the toy graph times no optimizer


@pytest.mark.parametrize("batch", [2, 8, 64])
def test_no_plan_of_any_solver_beats_the_tight_bound(pq: ModuleType, batch: int) -> None:
    c = two_by_two()
    g = chain_graph([(4.0, 8.0), (2.0, 4.0), (6.0, 12.0), (1.0, 2.0)], kind="A100-80GB", param_bytes=2**24,
                    batch_size=batch)
    bound = pq.tight_bound(g, c)
    steps = {}
    for solver in ("ilp", "dp", "uniform"):
        for hier in (False, True):
            steps[solver, hier] = solve(g, c, solver=solver, hierarchical=hier).predicted.step_ms
    for comp in pq.COMPRESSIONS:
        steps["ilp", comp] = solve(g, c, solver="ilp", compress=comp).predicted.step_ms
    assert all(s >= bound * (1 - 1e-9) for s in steps.values()), (bound, steps)
    assert min(steps.values()) < 2 * bound  # and not a vacuous bound


def test_the_terms_of_a_step_add_up_to_it(pq: ModuleType) -> None:
    c = two_by_two()
    g = chain_graph([(4.0, 8.0), (2.0, 4.0), (6.0, 12.0), (1.0, 2.0)], kind="A100-80GB", param_bytes=2**24,
                    batch_size=8)
    for plan in (solve(g, c, solver="ilp", microbatches=4), solve(g, c, solver="uniform", microbatches=2)):
        t = pq.step_terms(plan, g)
        assert sum(t[k] for k in ("compute", "bubble", "sync", "tied", "agree", "optimizer")) == pytest.approx(t["step"])
        assert t["step"] == pytest.approx(plan.predicted.step_ms) and min(t.values()) >= -1e-9, t
    pipe = solve(g, c, solver="uniform", microbatches=2)
    assert len(pipe.stages) > 1 and pq.step_terms(pipe, g)["bubble"] > 0  # a pipeline of 2 microbatches idles


def test_the_hierarchical_table_orders_its_plans_and_bounds(pq: ModuleType, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    c = two_by_two()
    g = chain_graph([(10.0, 20.0)] * 4, kind="A100-80GB", param_bytes=2**26, batch_size=4)  # one row per GPU
    (row,) = pq.hierarchical_rows({"toy": g}, c, 10.0)
    assert row["tight_bound_ms"] >= row["bound_ms"] and row["flat_ms"] >= row["tight_bound_ms"]
    assert row["hierarchical_ms"] <= row["flat_ms"] * (1 + 1e-9)  # the exact solver's space only grew
    assert row["hierarchical_ms"] < row["flat_ms"] and "hier" in row["hierarchical_stages"]  # 256 MiB, 2 hosts
    for e in row["compressed"].values():
        assert e["step_ms"] <= row["hierarchical_ms"] * (1 + 1e-9)
        assert e["step_ms"] == pytest.approx(e["terms"]["step"])
    want = (row["flat_ms"] - row["hierarchical_ms"]) / (row["flat_ms"] - row["bound_ms"])
    assert row["closed"] == pytest.approx(want) and 0 < row["closed"] <= 1
    assert "hierarchical all-reduce on" in capsys.readouterr().out


@pytest.mark.parametrize("batch", [4, 16, 64])
def test_no_plan_beats_the_fixed_part_bound_and_it_is_above_the_tight_bound(pq: ModuleType, batch: int) -> None:
    """Nodes mostly fixed (a GPU's per-op cost): ``fixed_bound`` is above ``tight_bound`` once the batch is more
    than a row per device, no plan of any solver simulates below it, and the best comes near it."""
    from dataclasses import replace

    from hpml_compile.costgraph import build
    from hpml_compile.ir import NodeCost
    from hpml_compile.testing import chain_profile

    c = two_by_two()
    full = [(4.0, 8.0), (2.0, 4.0), (6.0, 12.0), (1.0, 2.0)]
    prof = chain_profile(full, kind="A100-80GB", param_bytes=2**24, batch_size=batch)
    nodes = tuple(replace(n, cost={"A100-80GB": NodeCost(f, b, False, fwd_fixed_ms=f / 2, bwd_fixed_ms=b / 2)})
                  for n, (f, b) in zip(prof.nodes, full))
    g = build(replace(prof, nodes=nodes))
    bound, tight = pq.fixed_bound(g, c), pq.tight_bound(g, c)
    assert bound >= tight * (1 - 1e-12)
    if batch > len(c.devices):
        assert bound > 1.05 * tight  # the fixed halves are paid per microbatch per replica, not spread
    steps = {(s, h): solve(g, c, solver=s, hierarchical=h).predicted.step_ms
             for s in ("ilp", "dp", "uniform") for h in (False, True)}
    assert all(s >= bound * (1 - 1e-9) for s in steps.values()), (bound, steps)
    assert min(steps.values()) < 1.25 * bound, (bound, steps)
