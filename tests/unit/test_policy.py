"""Re-plan policy: sustained imbalance only, a cooldown, switch when it pays, drop a device that keeps failing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpml_compile.runtime.policy import FailureLedger, ImbalanceWatch, worth_switching


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
