"""Re-planning: the old plan is scored on the new costs; switch only for a predicted gain; lost devices."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hpml_compile.cli import main
from hpml_compile.errors import HpmlError
from hpml_compile.ir import Cluster, Device, Link
from hpml_compile.plan import Plan, Schedule, Stage, load_plan, save_plan, validate_plan, with_comm
from hpml_compile.profile import predict_kinds, save_profile
from hpml_compile.simulate import annotate, simulate
from hpml_compile.driver import Options, replan
from hpml_compile.replan import plan_diff, replan_graph, without_devices
from hpml_compile.solve import solve
from hpml_compile.testing import chain_graph, chain_profile, cluster_of

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
    """A CPU-only profile, re-planned for a cluster that gained a GPU kind it never measured: the kind is
    predicted (without it the cost graph has no costs for the GPU and the re-plan cannot price it)."""
    prof = chain_profile(EVEN)
    old = solve(chain_graph(EVEN), cluster_of(["cpu", "cpu"]), solver="dp", microbatches=4)
    grown = cluster_of(["cpu", "cpu", "A100-80GB"], free_links=False, name="cpu+gpu")
    assert "A100-80GB" not in prof.device_kinds
    r = replan(old, prof, cluster=grown, opts=Options(solver="dp"))
    assert r.plan.microbatches == 4 and r.plan.schedule == old.schedule
    assert r.plan.cluster.device("d2").kind == "A100-80GB"
    validate_plan(r.plan, predict_kinds(prof, ["A100-80GB"]))
    assert r.plan.predicted.step_ms > 0


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


# The user's communication options carry into the re-plan: 8 layers of 50 MB of parameters over two
# hosts joined by 10 GbE, where a dense all-reduce costs ~320 ms and compressing pays.
_KW = {"param_bytes": 50_000_000, "activation_bytes": 1_000_000, "output_bytes": 20_000_000, "batch_size": 64}
_COST = [{"A100-80GB": (1.0, 2.0)}] * 8


def _hosts(per_host: int) -> Cluster:
    devs = tuple(Device(f"g{h * per_host + i}", "A100-80GB", 80, host="ab"[h]) for h in range(2)
                 for i in range(per_host))
    links = tuple(Link(a.name, b.name, 1.25 if a.host != b.host else 300.0, 25.0)
                  for i, a in enumerate(devs) for b in devs[i + 1:])
    return Cluster(devices=devs, links=links, name="two-hosts-10gbe")


def test_an_allowed_compression_is_offered_to_the_solver_again() -> None:
    g, prof = chain_graph(_COST, **_KW), chain_profile(_COST, **_KW)
    old = replace(solve(g, _hosts(1), solver="uniform", microbatches=4), allow_compress="topk:0.01")
    assert [st.compress for st in old.stages] == ["", ""]  # a pipeline: nothing to compress yet
    r = replan(old, prof, opts=Options(solver="dp"))  # as the closed loop and the supervisor call it
    assert r.switched and r.plan.allow_compress == "topk:0.01"
    assert [(st.devices, st.compress) for st in r.plan.stages] == [(("g0", "g1"), "topk:0.01")]
    again = Plan.from_dict(r.plan.to_dict())
    assert again.allow_compress == "topk:0.01"  # recorded in plan.json, for the next re-plan
    plain = replan(replace(old, allow_compress=""), prof, opts=Options(solver="dp"))
    assert not any(st.compress for st in plain.plan.stages)  # never chosen where the user did not allow it


@pytest.mark.parametrize("opts", [{"compress": "topk:0.01"}, {"sync_every": 4, "sync_warmup": 2}])
def test_a_compression_or_local_sgd_the_user_chose_stays_after_losing_a_device(opts: dict[str, Any]) -> None:
    g, prof = chain_graph(_COST, **_KW), chain_profile(_COST, **_KW)
    every = tuple(n.name for n in prof.nodes)
    old = annotate(with_comm(Plan("toy", _hosts(2), Schedule.ONE_F_ONE_B, 4,
                                  (Stage(0, ("g0", "g1", "g2", "g3"), every),)), **opts), g)[0]
    r = replan(old, prof, lost=["g3"], opts=Options(solver="dp"))
    replicated = [st for st in r.plan.stages if len(st.devices) > 1]
    assert r.switched and replicated and "g3" not in {d for st in r.plan.stages for d in st.devices}
    assert all(st.compress == opts.get("compress", "") for st in replicated)
    assert (r.plan.sync_every, r.plan.sync_warmup) == (opts.get("sync_every", 1), opts.get("sync_warmup", 0))
    assert not r.plan.allow_compress  # chosen by the user, not left to the solver
    assert r.plan.predicted.step_ms == pytest.approx(simulate(r.plan, chain_graph(_COST, **_KW)).step_ms)


def test_the_replan_command_keeps_the_compression_of_the_plan_it_reads(tmp_path: Path) -> None:
    g, prof = chain_graph(_COST, **_KW), chain_profile(_COST, **_KW)
    every = tuple(n.name for n in prof.nodes)
    old = annotate(with_comm(Plan("toy", _hosts(2), Schedule.ONE_F_ONE_B, 4,
                                  (Stage(0, ("g0", "g1", "g2", "g3"), every),)), compress="topk:0.01"), g)[0]
    save_plan(old, tmp_path / "plan.json")
    save_profile(prof, tmp_path / "measured.json")
    assert main(["replan", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "measured.json"),
                 "--drop-device", "g3", "--solver", "dp", "-o", str(tmp_path / "new")]) == 0
    new = load_plan(tmp_path / "new" / "plan.json")
    replicated = [st for st in new.stages if len(st.devices) > 1]
    assert replicated and all(st.compress == "topk:0.01" for st in replicated)
