"""The closed loop's cheap answer to a slowed replica, without processes: rows moved off it, priced against a full
re-plan, and the per-replica summary of a stage with uneven rows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpml_compile.costgraph import build as build_costgraph
from hpml_compile.plan import Plan, Schedule, Stage
from hpml_compile.replan import move_rows, replan_graph
from hpml_compile.runtime.observe.monitor import StepMetrics
from hpml_compile.runtime.observe.policy import Candidate, choose_switch
from hpml_compile.runtime.observe.summary import device_slowdowns, format_summary, measured_setup, summarise
from hpml_compile.simulate import annotate
from hpml_compile.testing import chain_profile, cluster_of

BATCH, MICRO = 24, 2


def _dp_plan(rows: tuple[int, ...] = ()) -> tuple[Plan, object]:
    """One stage on d0 and d1 (data parallelism), annotated on a chain of 6 equal nodes."""
    prof = chain_profile([(1.0, 2.0)] * 6, batch_size=BATCH)
    graph = build_costgraph(prof)
    cluster = cluster_of(["cpu", "cpu"])
    stage = Stage(0, ("d0", "d1"), tuple(n.name for n in prof.nodes), rows=rows)
    base = Plan(model="toy", cluster=cluster, schedule=Schedule.GPIPE, microbatches=MICRO, stages=(stage,))
    plan, _ = annotate(base, graph)
    return plan, prof


def _rows(rank: int, compute: list[float], step_ms: float = 100.0) -> list[StepMetrics]:
    return [StepMetrics(i, rank, 0, rank, f"d{rank}", MICRO, BATCH, step_ms, step_ms, c / 3, 2 * c / 3)
            for i, c in enumerate(compute)]


def _slowed(plan: Plan, prof: object, factor: float) -> tuple[object, object, dict[str, float]]:
    """The measured profile and cluster after d1 computed ``factor`` x its first steps."""
    c = (plan.stages[0].predicted.fwd_ms + plan.stages[0].predicted.bwd_ms) * MICRO
    rows = {0: _rows(0, [c] * 6), 1: _rows(1, [c] * 3 + [c * factor] * 3)}
    recent = {r: rs[3:] for r, rs in rows.items()}
    slow = device_slowdowns(plan, {r: rs[:3] for r, rs in rows.items()}, recent, 1.25)
    measured, cluster = measured_setup(prof, summarise(plan, recent, skip=0), slow)  # type: ignore[arg-type]
    return measured, cluster, slow


def test_rows_move_off_a_slowed_replica_and_nothing_else_changes() -> None:
    plan, prof = _dp_plan()
    measured, cluster, slow = _slowed(plan, prof, 2.0)
    assert slow == {"d1": pytest.approx(2.0)}
    r = move_rows(plan, build_costgraph(measured), cluster=cluster)  # type: ignore[arg-type]
    assert r.switched
    new = r.plan.stages[0]
    # 2x slower: a third of each microbatch's 12 rows, the same stage on the same devices, the same nodes
    assert new.rows == (8, 4) and new.devices == plan.stages[0].devices and new.nodes == plan.stages[0].nodes
    assert r.plan.microbatches == plan.microbatches and r.plan.schedule == plan.schedule
    # even rows on the slowed device: 6 rows at 2x, the step waits for it; 8:4 balances at 8 rows' time
    assert r.diff.new_step_ms < r.diff.old_step_ms and r.diff.gain > 1.3
    assert not r.diff.moved and "rows of stage 0 (d0,d1): even -> 8:4" in r.diff.summary()


def test_rows_stay_when_no_replica_slowed() -> None:
    plan, prof = _dp_plan()
    r = move_rows(plan, build_costgraph(prof))  # type: ignore[arg-type]
    assert not r.switched and r.plan.stages[0].rows == ()
    assert r.diff.new_step_ms == pytest.approx(r.diff.old_step_ms)


def test_the_full_replan_is_scored_on_the_same_costs_as_the_row_move() -> None:
    plan, prof = _dp_plan()
    measured, cluster, _ = _slowed(plan, prof, 2.0)
    graph = build_costgraph(measured)  # type: ignore[arg-type]
    rows = move_rows(plan, graph, cluster=cluster)  # type: ignore[arg-type]
    full = replan_graph(plan, graph.coarsen(), cluster=cluster, solver="dp", score_graph=graph)  # type: ignore
    assert rows.diff.old_step_ms == pytest.approx(full.diff.old_step_ms)


def test_choose_switch_takes_the_largest_net_gain_over_the_steps_left() -> None:
    rows = Candidate("rows", step_ms=60.0, gain=1.5, switch_cost_ms=50)
    full = Candidate("replan", step_ms=55.0, gain=1.64, switch_cost_ms=6_000)
    # 1,000 steps at 90 ms: rows save 30 s for 0.05 s; the re-plan saves 35.1 s for 6 s
    best, why = choose_switch([full, rows], measured_ms=90.0, steps_left=1000)
    assert best is rows and "replan" in why and "net" in why
    # 10,000 steps left: the re-plan's faster steps win back its dearer switch
    assert choose_switch([full, rows], measured_ms=90.0, steps_left=10_000)[0] is full
    # few steps left: neither pays for its switch
    slow_rows = Candidate("rows", step_ms=60.0, gain=1.5, switch_cost_ms=5_000)
    best, why = choose_switch([full, slow_rows], measured_ms=90.0, steps_left=100)
    assert best is None and why.startswith("no candidate pays")
    # a row move that gains too little is passed over for a re-plan that pays
    weak = Candidate("rows", step_ms=88.0, gain=1.02, switch_cost_ms=50)
    assert choose_switch([weak, full], measured_ms=90.0, steps_left=1000)[0] is full


def test_a_stage_with_uneven_rows_is_summarised_per_replica() -> None:
    plan, _ = _dp_plan(rows=(8, 4))
    # d1 (4 rows) computes at 3x its rows' share: slower than d0 with twice its rows; a mean would hide it
    rows = {0: _rows(0, [40.0] * 4), 1: _rows(1, [60.0] * 4)}
    s = summarise(plan, rows, skip=0)
    st = s.stages[0]
    assert [r.device for r in st.replicas] == ["d0", "d1"] and [r.rows for r in st.replicas] == [8, 4]
    assert st.slowest == "d1" and st.compute_ms == pytest.approx(60.0)  # the slowest replica's, not the mean 50
    assert st.replicas[1].per_row_ms == pytest.approx(15.0) and st.replicas[0].per_row_ms == pytest.approx(5.0)
    text = format_summary(s)
    assert "rows 4, 15.00 ms per row (the slowest: the stage line)" in text and "rows 8, 5.00 ms per row" in text


def test_an_even_stage_is_still_summarised_by_its_mean() -> None:
    plan, _ = _dp_plan()
    s = summarise(plan, {0: _rows(0, [40.0] * 4), 1: _rows(1, [60.0] * 4)}, skip=0)
    assert s.stages[0].replicas == () and s.stages[0].compute_ms == pytest.approx(50.0)


def test_measured_profile_divides_out_the_slowest_replicas_own_slowdown() -> None:
    plan, prof = _dp_plan(rows=(8, 4))
    c = (plan.stages[0].predicted.fwd_ms + plan.stages[0].predicted.bwd_ms) * MICRO
    # d1 was at the prediction, then slowed 2x; d0 as predicted for its 8 rows
    rows = {0: _rows(0, [c] * 6), 1: _rows(1, [c] * 3 + [2 * c] * 3)}
    recent = {r: rs[3:] for r, rs in rows.items()}
    slow = device_slowdowns(plan, {r: rs[:3] for r, rs in rows.items()}, recent, 1.25)
    measured, _ = measured_setup(prof, summarise(plan, recent, skip=0), slow)  # type: ignore[arg-type]
    # the healthy kind keeps the profile's costs: the slowdown is d1's own, divided out
    assert measured.nodes[0].cost["cpu"].fwd_ms == pytest.approx(1.0, rel=1e-6)


def test_rows_are_refused_for_a_batch_that_does_not_split() -> None:
    from hpml_compile.errors import HpmlError

    plan, prof = _dp_plan()
    odd = replace(plan, microbatches=5)
    with pytest.raises(HpmlError, match="does not split into 5 microbatches"):
        move_rows(odd, build_costgraph(prof))  # type: ignore[arg-type]


def test_the_forcing_knobs_refuse_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpml_compile.errors import HpmlError
    from hpml_compile.runtime.job.adapt import AdaptOptions
    from hpml_compile.runtime.job.adapt import env_seconds as _env_seconds

    with pytest.raises(HpmlError, match="candidates must be one of both, rows, replan"):
        AdaptOptions(candidates="fast")
    monkeypatch.setenv("HPML_ADAPT_SWITCH_COST_S", "soon")
    with pytest.raises(HpmlError, match="HPML_ADAPT_SWITCH_COST_S='soon': expected a number of seconds"):
        _env_seconds("HPML_ADAPT_SWITCH_COST_S")
    monkeypatch.setenv("HPML_ADAPT_SWITCH_COST_S", "0.5")
    assert _env_seconds("HPML_ADAPT_SWITCH_COST_S") == 0.5
    monkeypatch.delenv("HPML_ADAPT_SWITCH_COST_S")
    assert _env_seconds("HPML_ADAPT_SWITCH_COST_S") is None
