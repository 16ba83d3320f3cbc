"""benchmarks/prediction: each plan's error with the machine's minute taken out (its model's single-rank plan of
the same round as the machine's speed then), the figure that tells the simulator's misses from the VM's drift."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any, Callable

import pytest

MAIN = Path(__file__).resolve().parents[2] / "benchmarks" / "prediction" / "main.py"


@pytest.fixture(scope="module")
def machine_adjusted() -> Callable[[list[dict[str, Any]]], dict[str, float]]:
    return runpy.run_path(str(MAIN), run_name="prediction_main")["machine_adjusted"]


def _row(plan: str, pairs: list[tuple[float, float]]) -> dict:
    rounds = [{"plan": plan, "predicted_ms": p, "measured_ms": m} for p, m in pairs]
    return {"plan": plan, "predicted_ms": pairs[0][0], "measured_ms": pairs[0][1], "rounds": rounds}


def test_a_round_where_the_machine_ran_slow_is_divided_out(machine_adjusted: Callable[..., dict[str, float]]
                                                                  ) -> None:
    # round 2 ran the single-rank plan 20% over its prediction: a plan 20% over there missed nothing more
    rows = [_row("toy single gpipe M=1", [(100.0, 100.0), (100.0, 120.0)]),
            _row("toy dp gpipe M=1", [(50.0, 50.0), (50.0, 60.0)]),
            _row("toy pipe 1f1b M=4", [(80.0, 88.0), (80.0, 105.6)]),  # +10% beyond the machine, both rounds
            _row("other dp gpipe M=1", [(10.0, 15.0), (10.0, 15.0)])]  # no single-rank plan of its model
    got = machine_adjusted(rows)
    assert set(got) == {"toy dp gpipe M=1", "toy pipe 1f1b M=4"}
    assert got["toy dp gpipe M=1"] == pytest.approx(0.0)
    assert got["toy pipe 1f1b M=4"] == pytest.approx(0.10)
    # one round (rows without "rounds"): the same rule
    one = [{"plan": r["plan"], "predicted_ms": r["rounds"][1]["predicted_ms"],
            "measured_ms": r["rounds"][1]["measured_ms"]} for r in rows]
    assert machine_adjusted(one)["toy pipe 1f1b M=4"] == pytest.approx(0.10)


def test_the_goal_is_taken_per_round_so_opposite_errors_do_not_cancel() -> None:
    """A plan 30% over in one round and 30% under in the next has the median of its times exact; per round it
    misses the goal both times."""
    summary = runpy.run_path(str(MAIN), run_name="prediction_main")["round_summary"]

    def row(error: float) -> dict[str, float]:
        return {"error": error, "error_without_optimizer": error / 2}

    got = summary([[row(0.30), row(0.02), row(0.04)], [row(-0.30), row(0.02), row(0.04)]])
    assert [r["median_abs_error"] for r in got["rounds"]] == pytest.approx([0.04, 0.04])
    assert [r["p90_abs_error"] for r in got["rounds"]] == pytest.approx([0.30, 0.30])
    assert got["rounds"][0]["p90_abs_error_without_optimizer"] == pytest.approx(0.15)
    assert not got["meets_goal_every_round"]
    assert summary([[row(0.05), row(-0.08)], [row(0.01), row(0.15)]])["meets_goal_every_round"]
