"""benchmarks/prediction: each plan's error with the machine's minute taken out (its model's single-rank plan of
the same round as the machine's speed then), the figure that tells the simulator's misses from the VM's drift."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

MAIN = Path(__file__).resolve().parents[2] / "benchmarks" / "prediction" / "main.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prediction_main", MAIN)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _row(plan: str, pairs: list[tuple[float, float]]) -> dict:
    rounds = [{"plan": plan, "predicted_ms": p, "measured_ms": m} for p, m in pairs]
    return {"plan": plan, "predicted_ms": pairs[0][0], "measured_ms": pairs[0][1], "rounds": rounds}


def test_a_round_where_the_machine_ran_slow_is_divided_out(bench: ModuleType) -> None:
    # round 2 ran the single-rank plan 20% over its prediction: a plan 20% over there missed nothing more
    rows = [_row("toy single gpipe M=1", [(100.0, 100.0), (100.0, 120.0)]),
            _row("toy dp gpipe M=1", [(50.0, 50.0), (50.0, 60.0)]),
            _row("toy pipe 1f1b M=4", [(80.0, 88.0), (80.0, 105.6)]),  # +10% beyond the machine, both rounds
            _row("other dp gpipe M=1", [(10.0, 15.0), (10.0, 15.0)])]  # no single-rank plan of its model
    got = bench.machine_adjusted(rows)
    assert set(got) == {"toy dp gpipe M=1", "toy pipe 1f1b M=4"}
    assert got["toy dp gpipe M=1"] == pytest.approx(0.0)
    assert got["toy pipe 1f1b M=4"] == pytest.approx(0.10)
    # one round (rows without "rounds"): the same rule
    one = [{"plan": r["plan"], "predicted_ms": r["rounds"][1]["predicted_ms"],
            "measured_ms": r["rounds"][1]["measured_ms"]} for r in rows]
    assert bench.machine_adjusted(one)["toy pipe 1f1b M=4"] == pytest.approx(0.10)
