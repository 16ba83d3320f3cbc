"""Uneven data parallelism, the planning side: choose_rows, the cost model with rows, validation, the
candidate plans of solve/uneven, and how show draws the rows."""

from __future__ import annotations

import itertools
import random

import pytest

from hpml_compile.costgraph import build
from hpml_compile.errors import PlanError
from hpml_compile.explain import summary
from hpml_compile.memory import GiB
from hpml_compile.plan import Plan, Schedule, Stage, stage_memory, validate_plan
from hpml_compile.simulate import EventKind, annotate, simulate
from hpml_compile.solve import solve
from hpml_compile.testing import chain_graph, chain_profile, cluster_of
from hpml_compile.solve.mixed import CONFIGS, build_plan
from hpml_compile.solve.uneven import improve, merge, stage_rows
from hpml_compile.stagecost import choose_rows
from hpml_compile.viz import chart_rows, rows_text, write_pictures


def _brute(fixed, per_row, total, caps):
    best = None
    n = len(fixed)
    for split in itertools.product(range(1, total + 1), repeat=n):
        if sum(split) != total or any(c is not None and r > c for r, c in zip(split, caps)):
            continue
        t = max(f + p * r for f, p, r in zip(fixed, per_row, split))
        best = t if best is None else min(best, t)
    return best


def test_choose_rows_is_the_exact_integer_optimum() -> None:
    rng = random.Random(15)
    for _ in range(150):
        n = rng.randint(1, 3)
        total = rng.randint(n, 9)
        fixed = [rng.choice([0.0, rng.uniform(0, 5)]) for _ in range(n)]
        per_row = [rng.uniform(0.2, 4) for _ in range(n)]
        caps = [rng.choice([None, rng.randint(1, total)]) for _ in range(n)]
        if sum(total if c is None else c for c in caps) < total:
            with pytest.raises(ValueError, match="hold"):
                choose_rows(fixed, per_row, total, caps)
            continue
        rows = choose_rows(fixed, per_row, total, caps)
        assert sum(rows) == total and min(rows) >= 1
        assert all(c is None or r <= c for r, c in zip(rows, caps))
        got = max(f + p * r for f, p, r in zip(fixed, per_row, rows))
        assert got == pytest.approx(_brute(fixed, per_row, total, caps))


def test_choose_rows_proportional_to_speed_and_refuses_bad_input() -> None:
    assert choose_rows([0.0, 0.0, 0.0], [1.0, 2.0, 4.0], 14) == (8, 4, 2)
    assert choose_rows([0.0, 0.0], [1.0, 1.0], 5) in {(3, 2), (2, 3)}
    with pytest.raises(ValueError, match="at least one"):
        choose_rows([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], 2)
    with pytest.raises(ValueError, match="fits no row"):
        choose_rows([0.0, 0.0], [1.0, 1.0], 4, caps=[0, None])
    with pytest.raises(ValueError, match="one of each"):
        choose_rows([0.0], [1.0, 1.0], 4)


def _mixed(rows: tuple[int, ...], *, memory_gib: float = 1024.0, act: int = 0):
    """One stage of two nodes on a fast and a 3x slower device, batch 8 in 2 microbatches (4 rows each)."""
    prof = chain_profile([{"fast": (8.0, 16.0), "slow": (24.0, 48.0)}] * 2, batch_size=8, activation_bytes=act,
                         param_bytes=1000)
    g = build(prof)
    c = cluster_of(["fast", "slow"], memory_gib=memory_gib)
    members = tuple(x for n in g.order for x in g.node(n).members)
    plan = Plan("toy", c, Schedule.ONE_F_ONE_B, 2, (Stage(0, ("d0", "d1"), members, rows=rows),))
    return prof, g, plan


def test_simulator_runs_each_replica_at_its_own_pace_on_its_rows() -> None:
    _, g, plan = _mixed((3, 1))
    r = simulate(plan, g)
    st = r.stages[0]
    # fast: 3 of 8 rows of 2 nodes x (8, 16) ms; slow: 1 of 8 rows of 2 x (24, 48): both 6 + 12 ms
    assert st.replica_ms == (pytest.approx((6.0, 12.0)), pytest.approx((6.0, 12.0)))
    assert (st.fwd_ms, st.bwd_ms) == (pytest.approx(6.0), pytest.approx(12.0))
    _, g, even = _mixed(())
    e = simulate(even, g)
    # equal rows on mixed kinds: the stage runs at the slow kind's pace on 2 rows each: 12 + 24 ms
    assert (e.stages[0].fwd_ms, e.stages[0].bwd_ms) == (pytest.approx(12.0), pytest.approx(24.0))
    assert r.step_ms < e.step_ms
    _, g, bad = _mixed((1, 3))  # the slow device with the most rows: it sets the pace
    assert simulate(bad, g).stages[0].fwd_ms == pytest.approx(18.0)
    # the fast replica's bars end early; the slow one's fill the stage's time
    fast = [b for b in simulate(bad, g).intervals if b.device == "d0" and b.kind is EventKind.FORWARD]
    assert fast and all(b.end_ms - b.start_ms == pytest.approx(2.0) for b in fast)  # 1 row of 8: 16 / 8


def test_memory_per_device_from_its_own_rows() -> None:
    prof, g, plan = _mixed((3, 1), act=8 * 2**20)
    r = simulate(plan, g)
    m0, m1 = r.stages[0].device_memory
    assert m0.stored_per_microbatch == 3 * m1.stored_per_microbatch  # 3 rows against 1
    assert r.peak["d0"] > r.peak["d1"]
    assert stage_memory(plan, prof, plan.stages[0], "d0") == r.peak["d0"]
    assert stage_memory(plan, prof, plan.stages[0], "d1") == r.peak["d1"]
    assert stage_memory(plan, prof, plan.stages[0]) == r.peak["d0"]  # the largest


def test_validate_plan_checks_rows_sum_and_each_device_memory() -> None:
    prof, _, plan = _mixed((3, 1))
    validate_plan(plan, prof)
    bad = Plan("toy", plan.cluster, plan.schedule, 2, (Stage(0, ("d0", "d1"), plan.stages[0].nodes, rows=(3, 2)),))
    with pytest.raises(PlanError, match=r"rows \[3, 2\] \(sum 5\).* holds 4 rows"):
        validate_plan(bad, prof)
    # 1 GiB each: d0 with 3 rows of 3/8 GiB of activations each (1F1B, one stage: one in flight) is over
    prof, _, plan = _mixed((3, 1), memory_gib=1.0, act=int(2.9 * GiB))
    with pytest.raises(PlanError, match=r"stage 0 needs .* on d0 .* with its 3 rows per microbatch.*fewer rows"):
        validate_plan(plan, prof)


def test_annotate_keeps_rows() -> None:
    _, g, plan = _mixed((3, 1))
    new, _ = annotate(plan, g)
    assert new.stages[0].rows == (3, 1)
    assert Plan.from_dict(new.to_dict()).stages[0].rows == (3, 1)


def test_stage_rows_balances_and_respects_memory() -> None:
    _, g, plan = _mixed(())
    kw = dict(microbatches=2, schedule=Schedule.ONE_F_ONE_B, index=0, stages=1)
    assert stage_rows(g, plan.cluster, g.order, ("d0", "d1"), **kw) == (3, 1)
    # activations of 1 GiB per row per microbatch-row: d0 (2.5 GiB) holds only 2 rows, d1 the rest
    prof = chain_profile([{"fast": (8.0, 16.0), "slow": (24.0, 48.0)}], batch_size=8, activation_bytes=8 * GiB)
    g2 = build(prof)
    small = cluster_of(["fast", "slow"], memory_gib=2.5)
    assert stage_rows(g2, small, g2.order, ("d0", "d1"), **kw) == (2, 2)
    tiny = cluster_of(["fast", "slow"], memory_gib=0.5)
    assert stage_rows(g2, tiny, g2.order, ("d0", "d1"), **kw) is None


def test_improve_mixes_kinds_and_is_never_worse() -> None:
    g = chain_graph([{"fast": (1.0, 2.0), "slow": (3.0, 6.0)}] * 4, param_bytes=1000)
    c = cluster_of(["fast", "slow", "slow"])
    base = solve(g, c, solver="dp", microbatches=4)
    got = improve(g, c, base)
    assert got.plan.predicted.step_ms < base.predicted.step_ms
    assert got.chosen != "solver" and got.plan.solver.name.startswith("dp+uneven:")
    assert any(len({c.device(d).kind for d in st.devices}) > 1 for st in got.plan.stages)
    prof = chain_profile([{"fast": (1.0, 2.0), "slow": (3.0, 6.0)}] * 4, param_bytes=1000)
    validate_plan(got.plan, prof)
    # one kind and every device used: nothing to try, the solver's plan comes back unchanged
    same = cluster_of(["fast", "fast"])
    base2 = solve(g, same, solver="dp", microbatches=4)
    assert improve(g, same, base2).plan is base2


def test_improve_keeps_the_solver_plan_when_sync_costs_more_than_mixing_saves() -> None:
    # huge parameters over a slow link: replicating costs more than the second device saves
    g = chain_graph([{"fast": (1.0, 2.0), "slow": (1.5, 3.0)}] * 2, param_bytes=2**30)
    c = cluster_of(["fast", "slow"], free_links=False)
    base = solve(g, c, solver="dp", microbatches=2)
    got = improve(g, c, base)
    assert got.plan.predicted.step_ms <= base.predicted.step_ms
    assert got.chosen == "solver" or got.plan.predicted.step_ms < base.predicted.step_ms


def test_show_draws_and_explains_rows(tmp_path) -> None:
    _, g, plan = _mixed((3, 1))
    plan, r = annotate(plan, g)
    written = write_pictures(plan, g, r, tmp_path, graph_formats=())
    assert {p.name for p in written} >= {"timeline.png", "memory.png", "plan_graph.dot"}
    assert "rows per microbatch: d0 3, d1 1" in (tmp_path / "plan_graph.dot").read_text()
    assert rows_text(plan.stages[0]) == "rows per microbatch: d0 3, d1 1"
    labels = [label for label, _, _ in chain_rows_of(plan)]
    assert "d0 (fast)\nstage 0, 3 rows" in labels and "d1 (slow)\nstage 0, 1 rows" in labels
    text = summary(plan, g, r)
    assert "1 x fast + 1 x slow" in text and "uneven rows per microbatch: d0 3 (18 ms), d1 1 (18 ms)" in text


def chain_rows_of(plan: Plan):
    return chart_rows(plan, per_device=True)


def test_merge_shortens_the_pipeline_with_a_mixed_stage() -> None:
    g = chain_graph([{"fast": (1.0, 2.0), "slow": (3.0, 6.0)}] * 4, param_bytes=1000)
    c = cluster_of(["fast", "slow"])
    # one microbatch through two stages: each waits for the other, so one mixed stage is faster
    base = solve(g, c, solver="dp", microbatches=1)
    assert len(base.stages) == 2
    plans = merge(g, c, base, lambda p: annotate(p, g)[1].step_ms, microbatches=1)
    assert len(plans) == 1 and len(plans[0].stages) == 1 and plans[0].stages[0].rows
    assert annotate(plans[0], g)[1].step_ms < base.predicted.step_ms


def test_driver_plan_returns_the_uneven_plan_and_can_be_told_not_to() -> None:
    from hpml_compile.driver import Options, plan

    prof = chain_profile([{"fast": (1.0, 2.0), "slow": (3.0, 6.0)}] * 4, param_bytes=1000)
    c = cluster_of(["fast", "slow", "slow"])
    got = plan(prof, c, Options(solver="dp", microbatches=4))
    off = plan(prof, c, Options(solver="dp", microbatches=4, uneven=False))
    assert got.predicted.step_ms < off.predicted.step_ms
    assert "+uneven:" in got.solver.name and any(st.rows for st in got.stages)
    assert not any(st.rows for st in off.stages) and "+uneven" not in off.solver.name


def test_improve_stops_at_its_time_limit_with_the_best_so_far() -> None:
    g = chain_graph([{"fast": (1.0, 2.0), "slow": (3.0, 6.0)}] * 4, param_bytes=1000)
    c = cluster_of(["fast", "slow", "slow"])
    base = solve(g, c, solver="dp", microbatches=4)
    lines: list[str] = []
    got = improve(g, c, base, time_limit_s=0.0, progress=lines.append)
    assert got.plan is base and got.tried == 1  # only the solver's plan, scored before the search
    assert any("time limit" in line for line in lines)


def test_a_mixed_stage_offloads_the_adam_state_where_nothing_else_fits() -> None:
    """1 GiB of parameters on two 2.5 GiB devices: parameters and gradients fit, the Adam state does not (2 GiB
    under ZeRO-0, 1 GiB a replica under ZeRO-1/2), recompute saves none of it. The uneven search offloads it to
    host memory on a group of GPUs (e.g. a T4 beside an A100 for gpt2-xl), never on a group with a CPU,
    whose host memory is its own (validate_plan refuses it there)."""
    costs = [{"fast": (1.0, 2.0), "slow": (3.0, 6.0), "cpu": (3.0, 6.0)}] * 4
    prof = chain_profile(costs, param_bytes=2**28, batch_size=8)
    g = build(prof)
    gpus = cluster_of(["fast", "slow"], memory_gib=2.5)
    plan = build_plan(g, gpus, [["d0", "d1"]], [0, 4], 2, Schedule.ONE_F_ONE_B, "float32", "test")
    assert plan is not None and plan.stages[0].offload_optimizer and plan.stages[0].rows == (3, 1)
    validate_plan(plan, prof)
    assert build_plan(g, gpus, [["d0", "d1"]], [0, 4], 2, Schedule.ONE_F_ONE_B, "float32", "test",
                      CONFIGS[:6]) is None  # nothing fits without offload
    with_cpu = cluster_of(["fast", "cpu"], memory_gib=2.5)
    assert build_plan(g, with_cpu, [["d0", "d1"]], [0, 4], 2, Schedule.ONE_F_ONE_B, "float32", "test") is None
