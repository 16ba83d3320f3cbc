"""Re-planning: the old plan is scored on the new costs; switch only for a predicted gain; lost devices."""

from __future__ import annotations

import pytest

from hpml_compile.errors import HpmlError
from hpml_compile.plan import validate_plan
from hpml_compile.driver import Options, replan
from hpml_compile.replan import plan_diff, replan_graph, without_devices
from hpml_compile.solve import solve
from hpml_compile.solve.testing import chain_graph, chain_profile, cluster_of

EVEN = [{"cpu": (1.0, 2.0)}] * 6


def test_slowed_stage_moves_work_away() -> None:
    old = solve(chain_graph(EVEN), cluster_of(["cpu", "cpu"]), solver="uniform", microbatches=8)
    assert [len(st.nodes) for st in old.stages] == [3, 3]
    slow_tail = chain_graph([{"cpu": (1.0, 2.0)}] * 3 + [{"cpu": (3.0, 6.0)}] * 3)
    r = replan_graph(old, slow_tail, solver="dp")
    assert r.switched and r.diff.gain > 1.2
    assert r.diff.old_step_ms > old.predicted.step_ms, "the old plan is re-scored on the slower costs"
    assert r.diff.moved and all(a == 1 and b == 0 for _, a, b in r.diff.moved)
    assert "moved" in r.diff.summary() and "->" in r.diff.summary()


def test_no_switch_without_a_gain() -> None:
    old = solve(chain_graph(EVEN), cluster_of(["cpu", "cpu"]), solver="dp", microbatches=8)
    r = replan_graph(old, chain_graph(EVEN), solver="dp")
    assert not r.switched and not r.diff.moved and r.diff.gain == pytest.approx(1.0)
    assert "no node moved" in r.diff.summary()


def test_lost_device_replans_on_the_rest() -> None:
    cluster = cluster_of(["cpu", "cpu", "cpu"])
    old = solve(chain_graph(EVEN), cluster, solver="dp", microbatches=8)
    lost = old.stages[-1].devices[0]
    smaller = without_devices(cluster, [lost])
    r = replan_graph(old, chain_graph(EVEN), cluster=smaller, solver="ilp")
    assert r.switched and r.diff.old_step_ms == float("inf")
    used = {d for st in r.plan.stages for d in st.devices}
    assert lost not in used and used <= {d.name for d in smaller.devices}
    validate_plan(r.plan, chain_profile(EVEN))


def test_without_devices_errors() -> None:
    cluster = cluster_of(["cpu", "cpu"])
    with pytest.raises(HpmlError, match="cannot drop \\['gpu9'\\]"):
        without_devices(cluster, ["gpu9"])
    with pytest.raises(HpmlError, match="no device"):
        without_devices(cluster, [d.name for d in cluster.devices])


def test_replan_from_a_profile_predicts_missing_kinds() -> None:
    prof = chain_profile(EVEN)
    old = solve(chain_graph(EVEN), cluster_of(["cpu", "cpu"]), solver="dp", microbatches=4)
    r = replan(old, prof, opts=Options(solver="dp"))
    assert r.plan.microbatches == 4 and r.plan.schedule == old.schedule


def test_diff_lists_each_moved_node_once() -> None:
    old = solve(chain_graph(EVEN), cluster_of(["cpu", "cpu"]), solver="uniform", microbatches=4)
    new = solve(chain_graph([{"cpu": (5.0, 10.0)}] + EVEN[1:]), cluster_of(["cpu", "cpu"]), solver="dp",
                microbatches=4)
    d = plan_diff(old, new, old_step_ms=10.0)
    names = [n for n, _, _ in d.moved]
    assert len(names) == len(set(names))
    before = {n: st.index for st in old.stages for n in st.nodes}
    after = {n: st.index for st in new.stages for n in st.nodes}
    assert set(names) == {n for n in before if before[n] != after[n]}
