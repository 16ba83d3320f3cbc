"""The closed loop's decisions without processes: who is blamed for a failure, which device slowed down,
what the solver is told about it, the times read back from a run's events, and the rows moved in place that a
restart carries."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hpml_compile.costgraph import build as build_costgraph
from hpml_compile.ir import base_kind
from hpml_compile.replan import replan_graph
from hpml_compile.runtime.observe.monitor import StepMetrics
from hpml_compile.runtime.observe.summary import device_slowdowns, measured_setup, summarise
from hpml_compile.plan import Stage, save_plan
from hpml_compile.runtime.job.supervisor import blame, in_place_moves, plan_devices, rows_in_force, timings
from hpml_compile.runtime.observe.runfolder import RunFolder
from hpml_compile.solve import solve
from hpml_compile.testing import chain_profile, cluster_of


def _report(run: Path, rank: int, t: float, kind: str, message: str = "boom") -> None:
    path = RunFolder(run).error(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "time": t, "kind": kind, "message": message,
                                "user_error": kind == "user"}))


def test_blame_a_killed_rank_not_the_peers_that_lost_it(tmp_path: Path) -> None:
    # what torchrun reported for `--kill-at 3:1` on 3 ranks: 137 for the dead one, SIGTERM for the others,
    # whose own reports (a connection closed by the peer) came *later*
    _report(tmp_path, 1, 100.0, "killed", "killed at step 3")
    _report(tmp_path, 0, 100.1, "comm")
    _report(tmp_path, 2, 100.05, "comm")
    c = blame({1: (137, "x"), 0: (-15, "SIGTERM"), 2: (-15, "SIGTERM")}, tmp_path)
    assert (c.rank, c.cause, c.time) == (1, "killed", 100.0)


def test_blame_a_rank_killed_without_a_word(tmp_path: Path) -> None:
    _report(tmp_path, 0, 50.0, "comm")  # its peer's echo; the dead one wrote nothing
    c = blame({0: (-15, "SIGTERM"), 2: (-9, "Signal 9")}, tmp_path)
    assert (c.rank, c.cause) == (2, "killed")


def test_blame_a_crash_before_the_echoes(tmp_path: Path) -> None:
    _report(tmp_path, 0, 10.2, "comm")
    _report(tmp_path, 1, 10.0, "crash", "RuntimeError: out of memory")
    c = blame({0: (1, ""), 1: (1, "")}, tmp_path)
    assert (c.rank, c.cause, c.message) == (1, "crash", "RuntimeError: out of memory")


def test_blame_the_silent_rank_when_the_others_timed_out(tmp_path: Path) -> None:
    _report(tmp_path, 0, 10.0, "comm", "[/src/gloo/transport/tcp/unbound_buffer.cc:78] timed out")
    _report(tmp_path, 2, 10.1, "comm", "timed out")
    c = blame({0: (2, ""), 1: (-15, "SIGTERM"), 2: (2, "")}, tmp_path)
    assert (c.rank, c.cause) == (1, "comm")
    # its own line from torchrun says nothing; the message says what its peers saw
    assert c.message.startswith("it stopped responding") and "rank 0: timed out" in c.message


def test_blame_a_user_error_as_such(tmp_path: Path) -> None:
    _report(tmp_path, 0, 1.0, "user", "a batch of 7 rows does not split")
    assert blame({0: (2, "")}, tmp_path).cause == "user"


def _rows(rank: int, compute: list[float]) -> list[StepMetrics]:
    return [StepMetrics(i, rank, rank, 0, "cpu", 2, 8, 3 * c, 3 * c, c / 3, 2 * c / 3) for i, c in enumerate(compute)]


def test_device_slowdown_is_measured_against_the_plans_own_first_steps() -> None:
    plan = solve(build_costgraph(chain_profile([(1.0, 2.0)] * 6)).coarsen(), cluster_of(["cpu"] * 3),
                 solver="uniform", microbatches=2)
    rows = {0: _rows(0, [10, 10, 10, 11, 10, 10]), 1: _rows(1, [10, 10, 10, 31, 30, 29]),
            2: _rows(2, [20, 20, 20, 21, 22, 20])}  # device 2 is as slow as it always was: not a slow-down
    slow = device_slowdowns(plan, {r: rs[:3] for r, rs in rows.items()}, {r: rs[3:] for r, rs in rows.items()}, 1.25)
    assert list(slow) == [plan_devices(plan)[1]] and slow[plan_devices(plan)[1]] == pytest.approx(3.0)


def test_a_slowed_device_gets_its_own_kind_and_the_solver_moves_work_off_it() -> None:
    prof = chain_profile([(1.0, 2.0)] * 6)
    cluster = cluster_of(["cpu"] * 3)
    plan = solve(build_costgraph(prof).coarsen(), cluster, solver="uniform", microbatches=2)
    # measured: as predicted, except the middle device, 3x slower than its own first steps
    micro = 2
    rows = {}
    for r, st in enumerate(plan.stages):
        c = (st.predicted.fwd_ms + st.predicted.bwd_ms) * micro
        rows[r] = _rows(r, [c] * 3 + [c * (3.0 if r == 1 else 1.0)] * 3)
    recent = {r: rs[3:] for r, rs in rows.items()}
    slow = device_slowdowns(plan, {r: rs[:3] for r, rs in rows.items()}, recent, 1.25)
    measured, now = measured_setup(prof, summarise(plan, recent, skip=0), slow)
    dev = plan_devices(plan)[1]
    kind = now.device(dev).kind
    assert kind != "cpu" and base_kind(kind) == "cpu" and now.device(dev).is_cpu
    assert {d.kind for d in now.devices if d.name != dev} == {"cpu"}
    for n in measured.nodes:  # the nodes keep a healthy device's cost; the variant costs 3x
        assert n.cost["cpu"].fwd_ms == pytest.approx(1.0, rel=1e-6)
        assert n.cost[kind].fwd_ms == pytest.approx(3.0, rel=1e-6)
    r = replan_graph(plan, build_costgraph(measured).coarsen(), cluster=now, solver="dp")
    assert r.switched and r.diff.old_step_ms > r.diff.new_step_ms
    share = {d: len(st.nodes) for st in r.plan.stages for d in st.devices}
    assert share.get(dev, 0) < len(plan.stages[1].nodes), "the slowed device runs less than before"


def test_timings_read_a_failure_and_a_switch(tmp_path: Path) -> None:
    events = [
        {"event": "segment", "segment": 0, "time": 0.0},
        {"event": "switch", "segment": 0, "time": 21.0, "step": 20, "build": "b1",
         "decision": {"time": 20.0, "step": 20, "solve_s": 0.5, "codegen_s": 1.0}},
        {"event": "segment", "segment": 1, "time": 21.5},
        {"event": "failure", "segment": 1, "time": 40.2, "cause": "killed", "device": "cpu2",
         "failed_at": 40.0, "detected_at": 40.2},
        {"event": "replan", "segment": 1, "time": 41.0, "solve_s": 0.1, "codegen_s": 0.7},
        {"event": "segment", "segment": 2, "time": 41.1},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for seg, first in ((1, 30.0), (2, 49.0)):
        (tmp_path / f"seg{seg}").mkdir()
        (tmp_path / f"seg{seg}" / "started.json").write_text(json.dumps({"first_step_at": first}))
    switch, failure = timings(tmp_path)
    assert switch["replan_s"] == pytest.approx(1.5) and switch["resume_s"] == pytest.approx(10.0)
    assert failure["detect_s"] == pytest.approx(0.2) and failure["replan_s"] == pytest.approx(0.8)
    assert failure["resume_s"] == pytest.approx(9.0) and "cpu2" in failure["kind"]


def test_timings_read_rows_moved_in_place_beside_a_restart(tmp_path: Path) -> None:
    events = [
        {"event": "segment", "segment": 0, "time": 0.0},
        {"event": "rows_moved", "segment": 0, "time": 9.0, "step": 9, "rows": [[35, 13]], "switch_s": 0.012,
         "choose_s": 0.01, "decision": {"step": 9}},
        {"event": "failure", "segment": 0, "time": 30.2, "cause": "comm", "device": "cpu0",
         "failed_at": 30.0, "detected_at": 30.2},
        {"event": "segment", "segment": 1, "time": 30.5, "rows": [[35, 13]]},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "seg1").mkdir()
    (tmp_path / "seg1" / "started.json").write_text(json.dumps({"first_step_at": 45.0}))
    moved, failure = timings(tmp_path)
    assert moved["in_place"] and moved["move"] == "rows" and moved["rows"] == [[35, 13]] and moved["step"] == 9
    assert moved["resume_s"] == moved["switch_s"] == 0.012 and moved["codegen_s"] == 0.0  # no restart to wait for
    assert not moved["kind"].startswith("switch")  # the benchmarks take a "switch" for a restart on a new build
    assert failure["resume_s"] == pytest.approx(15.0)  # the restart after it still finds its own next segment


def test_the_rows_in_force_are_what_a_segment_moved_in_place(tmp_path: Path) -> None:
    plan = solve(build_costgraph(chain_profile([(1.0, 2.0)] * 4)).coarsen(), cluster_of(["cpu"] * 2),
                 solver="uniform", microbatches=2)
    one = replace(plan, stages=(Stage(0, tuple(plan_devices(plan)), tuple(n for st in plan.stages for n in st.nodes)),))
    seg = tmp_path / "seg0"
    seg.mkdir()
    assert in_place_moves(seg) == [] and rows_in_force(seg, one) is None  # nothing ran
    save_plan(one, seg / "plan.json")
    assert rows_in_force(seg, one) is None  # the build's own rows
    moved = replace(one, stages=(replace(one.stages[0], rows=(5, 3)),))
    save_plan(moved, seg / "plan.json")
    assert rows_in_force(seg, one) == moved
    save_plan(replace(moved, microbatches=4), seg / "plan.json")
    assert rows_in_force(seg, one) is None  # more than rows changed: not a row move of this build
    # the decisions carried out in place, in order; kept plans and a line cut short by a failure are not moves
    (seg / "replans.jsonl").write_text(json.dumps({"step": 8, "switch": False}) + "\n"
                                       + json.dumps({"step": 9, "in_place": True, "switch_s": 0.01}) + "\n"
                                       + json.dumps({"step": 14, "in_place": True, "switch_s": 0.02}) + "\n"
                                       + '{"step": 19, "in_pl')
    assert [d["step"] for d in in_place_moves(seg)] == [9, 14]
