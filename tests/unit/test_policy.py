"""Re-plan policy: sustained imbalance only, a cooldown, switch when it pays, drop a device that keeps failing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpml_compile.runtime.observe.policy import (FailureLedger, ImbalanceWatch, memory_shortfalls, replan_capacity,
                                         worth_switching)


def test_fires_after_patience_slow_steps_then_cools_down() -> None:
    w = ImbalanceWatch(threshold=1.5, patience=3, cooldown=2)
    fired = [w.observe(20.0, 10.0) for _ in range(8)]
    assert fired == [False, False, True, False, False, False, False, True]


def test_one_fast_step_resets_the_streak() -> None:
    w = ImbalanceWatch(threshold=1.5, patience=2)
    assert [w.observe(m, 10.0) for m in (20, 10, 20, 20)] == [False, False, False, True]


@given(st.lists(st.floats(0, 12.4), max_size=50))
def test_never_fires_within_threshold(measured: list[float]) -> None:
    w = ImbalanceWatch(threshold=1.25, patience=1)
    assert not any(w.observe(m, 10.0) for m in measured)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold > 1"):
        ImbalanceWatch(threshold=0.9)


def test_worth_switching() -> None:
    assert worth_switching(30, 20, switch_cost_ms=5_000, steps_left=1_000)
    assert not worth_switching(30, 20, switch_cost_ms=50_000, steps_left=1_000), "too few steps left to pay back"
    assert not worth_switching(30, 29.5, switch_cost_ms=0, steps_left=10**6), "below the minimum gain"


def test_failure_ledger_drops_a_repeat_offender() -> None:
    ledger = FailureLedger(max_failures=2)
    assert not ledger.record("cpu1")
    assert not ledger.record("cpu2")
    assert ledger.record("cpu1") and ledger.failures("cpu1") == 2


def test_a_device_over_its_capacity_is_a_reason_to_replan_with_less_memory() -> None:
    from dataclasses import replace

    from hpml_compile.replan import replan_graph
    from hpml_compile.solve import solve
    from hpml_compile.testing import chain_graph, cluster_of

    assert memory_shortfalls({"d0": 90, "d1": 120}, {"d0": 100, "d1": 100}) == {"d1": 20}
    assert memory_shortfalls({"d0": 100}, {"d0": 100}) == {}  # at the capacity is not over
    assert replan_capacity(capacity=100, held=120, predicted=95) == 75  # cut by the 25 bytes the model missed
    assert replan_capacity(capacity=100, held=90, predicted=95) == 100
    # a plan solved with room to spare, then a device found to hold more than predicted: the cut budget is one the
    # old plan no longer fits, so re-planning switches even though the new plan is slower
    costs = [{"cpu": (1.0, 2.0)}] * 6
    graph = chain_graph(costs, param_bytes=2**16, activation_bytes=2**22)  # recompute would save much
    roomy = cluster_of(["cpu", "cpu"], memory_gib=1.0)
    old = solve(graph, roomy, solver="ilp", microbatches=4, schedule="gpipe")  # GPipe: 4 microbatches in flight
    need = max(st.predicted.memory_bytes for st in old.stages)
    held = need + need // 4
    cut = replan_capacity(need, held, need)  # as if the device had exactly what the plan predicted
    smaller = replace(roomy, devices=tuple(replace(d, memory_gib=cut / 2**30) for d in roomy.devices))
    r = replan_graph(old, graph, cluster=smaller, solver="ilp")
    assert r.switched and r.diff.old_step_ms == float("inf")
    assert all(st.predicted.memory_bytes <= cut for st in r.plan.stages)
    assert r.plan.predicted.step_ms >= old.predicted.step_ms and any(st.recompute for st in r.plan.stages)


def _step_series(steps: int, predicted: float, misprediction: float, slow_rank: int | None = None,
                 slow_from: int = 0, slowdown: float = 1.0, seed: int = 0) -> list[float]:
    """Synthetic step times of a 2-rank job as the Adapter feeds them: the slowest rank's step, per step.

    Each rank runs ``misprediction`` x the prediction with +-5% noise; from step ``slow_from`` rank
    ``slow_rank`` runs ``slowdown`` x slower.
    """
    import random

    rng = random.Random(seed)
    out = []
    for step in range(steps):
        ranks = [predicted * misprediction * rng.uniform(0.95, 1.05) for _ in range(2)]
        if slow_rank is not None and step >= slow_from:
            ranks[slow_rank] *= slowdown
        out.append(max(ranks))
    return out


def test_a_constant_misprediction_never_fires_once_learned() -> None:
    """A healthy run on a machine that runs every step 30% over its prediction must not re-plan."""
    series = _step_series(400, predicted=100.0, misprediction=1.3)
    w = ImbalanceWatch(threshold=1.25, patience=5, cooldown=5, baseline=3)
    assert not any(w.observe(m, 100.0) for m in series)
    assert w.level == pytest.approx(1.3, rel=0.06)
    # the same series against the level (the watch as it was) fires: the test can tell the two apart
    level = ImbalanceWatch(threshold=1.25, patience=5, cooldown=5)
    assert any(level.observe(m, 100.0) for m in series)


def test_a_3x_slowdown_of_one_rank_after_the_baseline_fires() -> None:
    series = _step_series(60, predicted=100.0, misprediction=1.3, slow_rank=1, slow_from=20, slowdown=3.0)
    w = ImbalanceWatch(threshold=1.25, patience=5, cooldown=5, baseline=3)
    fired = [i for i, m in enumerate(series) if w.observe(m, 100.0)]
    assert fired and fired[0] == 20 + 5 - 1  # the fifth slow step in a row


def test_a_small_change_and_a_fast_machine_are_watched_from_their_level() -> None:
    small = _step_series(200, predicted=100.0, misprediction=1.3, slow_rank=0, slow_from=20, slowdown=1.1)
    w = ImbalanceWatch(threshold=1.25, patience=5, baseline=3)
    assert not any(w.observe(m, 100.0) for m in small)  # 10% slower: under the threshold
    fast = _step_series(60, predicted=100.0, misprediction=0.6, slow_rank=0, slow_from=20, slowdown=1.5)
    w = ImbalanceWatch(threshold=1.25, patience=5, baseline=3)
    assert any(w.observe(m, 100.0) for m in fast)  # 0.9x the prediction, but 1.5x its own level


def test_rebase_to_a_measured_reference_forgets_the_level() -> None:
    w = ImbalanceWatch(threshold=1.25, patience=2, cooldown=0, baseline=2)
    for m in (130.0, 130.0):
        w.observe(m, 100.0)
    assert w.level == pytest.approx(1.3) and not w.learning
    w.rebase(level=1.0)  # the reference becomes the measured 130 ms
    assert [w.observe(m, 130.0) for m in (150.0, 150.0, 170.0, 170.0)] == [False, False, False, True]
