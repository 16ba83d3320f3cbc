"""benchmarks/prediction: the plan kinds its grid names, tensor-parallel ones included, and the ranks each runs on."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest

MAIN = Path(__file__).resolve().parents[2] / "benchmarks" / "prediction" / "main.py"


@pytest.fixture(scope="module")
def bench() -> dict[str, Any]:
    return runpy.run_path(str(MAIN), run_name="prediction_main")


def test_tensor_parallel_kinds_run_on_replicas_times_tp_ranks(bench: dict[str, Any]) -> None:
    grid = bench["_grid"]("tp2:gpipe:1,tp2pipe:1f1b:2,single:gpipe:1")
    assert [(kind, ranks, m) for kind, ranks, _, m, _ in grid] == [("tp2", 2, 1), ("tp2pipe", 4, 2), ("single", 1, 1)]
    assert grid[1][2].value == "1f1b"


def test_the_default_grid_measures_tensor_parallel_plans(bench: dict[str, Any]) -> None:
    kinds = {kind for kind, *_ in bench["_grid"](bench["GRID"])}
    assert set(bench["TP_KINDS"]) <= kinds


def test_an_unknown_kind_is_named(bench: dict[str, Any]) -> None:
    with pytest.raises(SystemExit, match="tp3"):
        bench["_grid"]("tp3:gpipe:1")


def test_the_default_grid_measures_every_schedule(bench: dict[str, Any]) -> None:
    from hpml_compile.plan import Schedule
    assert {sched for _, _, sched, _, _ in bench["_grid"](bench["GRID"])} == set(Schedule)
