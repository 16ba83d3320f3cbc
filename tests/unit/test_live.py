"""Live figures without a job: the rows' tail, the Prometheus text they give, the alerts (the dist test scrapes a run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hpml_compile.runtime.observe.live import AlertWatch, RowTail, RunCollector
from hpml_compile.runtime.observe.monitor import StepMetrics


def _row(step: int, rank: int, step_ms: float = 50.0, cpu: float = 0.9) -> StepMetrics:
    return StepMetrics(step, rank, rank, 0, "cpu", 2, 8, step_ms, step_ms, 10.0, 20.0, cpu_util=cpu,
                       peak_memory_bytes=2**20, loss=1.5, steal=0.1)


def _write(run: Path, rank: int, rows: list[StepMetrics], partial: str = "") -> None:
    path = run / "metrics" / f"rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write("".join(json.dumps(r.to_dict()) + "\n" for r in rows) + partial)


def test_tail_reads_new_lines_only_and_waits_for_a_partial_one(tmp_path: Path) -> None:
    tail = RowTail(tmp_path)
    assert tail.read() == {}
    _write(tmp_path, 0, [_row(0, 0), _row(1, 0)], partial='{"step": 2, "ra')
    _write(tmp_path, 1, [_row(0, 1)])
    assert {r: m.step for r, m in tail.read().items()} == {0: 1, 1: 0}
    (tmp_path / "metrics" / "rank0.jsonl").write_text(
        (tmp_path / "metrics" / "rank0.jsonl").read_text().rsplit("\n", 1)[0] + "\n" + json.dumps(_row(2, 0).to_dict())
        + "\n")
    assert {r: m.step for r, m in tail.read().items()} == {0: 2, 1: 0}


def test_collector_gives_prometheus_text_per_rank(tmp_path: Path) -> None:
    _write(tmp_path, 0, [_row(0, 0, 40.0)])
    _write(tmp_path, 1, [_row(0, 1, 60.0)])
    reg = CollectorRegistry()
    reg.register(RunCollector(tmp_path, ["cpu0", "cpu1"], 45.0))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    got = {(s.labels["rank"], s.labels["device"]): s.value for s in families["hpml_step_ms"].samples}
    assert got == {("0", "cpu0"): 40.0, ("1", "cpu1"): 60.0}
    assert families["hpml_predicted_step_ms"].samples[0].value == 45.0
    assert {s.value for s in families["hpml_host_steal_ratio"].samples} == {0.1}


def test_alerts_fire_once_when_a_condition_starts_and_again_after_it_ended() -> None:
    w = AlertWatch(predicted_ms=10.0, capacity={}, k=2, warmup=0, baseline=0, window=2, for_s=0)
    seq = [w.observe({0: _row(s, 0, 20.0 if s != 2 else 5.0, cpu=0.9)}) for s in range(6)]
    # the median of two steps: 20, 20 holds; 20, 5 and 5, 20 do not; 20, 20 holds again
    assert [[a.split(":")[0] for a in alerts] for alerts in seq] == [[], ["StepSlowdown"], [], [], ["StepSlowdown"], []]


def test_a_run_steadily_slower_than_predicted_is_not_alerted_a_slowdown_of_it_is() -> None:
    """The demo ran 1.2x its prediction, healthily, with stretches of five or six steps at 1.3-1.4x its
    median, and the step alert, then a level over the prediction for 5 steps in a row, fired five times in 300
    steps. Now it learns the run's pace, compares a window's median with it, and says so once that has held for
    ``for_s`` seconds of steps."""
    steady = [33.0, 34.0, 32.0, 33.5, 33.0, 32.5, 34.0, 33.0, 33.2, 32.8, 33.6, 34.1, 32.9, 33.3]
    noisy = (steady + [45.0, 46.0, 44.0, 47.0, 45.0, 46.0]) * 5  # 1.2x the prediction, six steps in 20 at 1.6x
    w = AlertWatch(predicted_ms=28.0, capacity={}, for_s=2.0)
    seen = [w.observe({0: _row(s, 0, ms)}) for s, ms in enumerate(noisy)]
    assert w.level == pytest.approx(33.1 / 28.0, rel=0.01) and not any(seen)
    old = AlertWatch(predicted_ms=28.0, capacity={}, baseline=0, window=5, for_s=0)  # the level rule as it was: it fires
    assert any(old.observe({0: _row(s, 0, ms)}) for s, ms in enumerate(noisy))
    # the same run, then a device slows the job 1.6x for good: one alert, naming the pace it left
    slowed = [w.observe({0: _row(s, 0, 1.6 * ms)}) for s, ms in enumerate(noisy[:80], start=len(noisy))]
    fired = [a for alerts in slowed for a in alerts]
    assert len(fired) == 1 and fired[0].startswith("StepSlowdown: for 2 s the last 20 steps") and "ran 1." in fired[0]
    # over for less than for_s: the window's median came back first
    brief = AlertWatch(predicted_ms=28.0, capacity={}, for_s=2.0)
    blip = steady * 2 + [53.0] * 25 + steady * 2  # 25 steps, 1.3 s, at 1.6x (as the demo once ran)
    assert not any(brief.observe({0: _row(s, 0, ms)}) for s, ms in enumerate(blip))
    assert [a for a in w.observe({0: _row(len(noisy) + 80, 0, 60.0)})] == []  # still slow: not said again


def test_a_row_seen_again_is_not_a_new_step() -> None:
    w = AlertWatch(predicted_ms=10.0, capacity={}, warmup=0, baseline=0, window=2, for_s=0)
    assert [w.observe({0: _row(0, 0, 30.0), 1: _row(0, 1, 30.0)}) for _ in range(3)] == [[], [], []]
    with pytest.raises(ValueError, match="threshold > 1"):
        AlertWatch(predicted_ms=10.0, capacity={}, threshold=0.9)


def test_a_gpu_rank_is_judged_by_its_gpu_and_its_figures_are_served(tmp_path: Path) -> None:
    from dataclasses import replace

    # the host thread of a GPU rank spins at a full core while its GPU idles: the GPU's figure counts
    gpu = lambda s: replace(_row(s, 1, cpu=1.0), device="cuda:0", gpu_util=0.2, gpu_memory_bytes=3 * 2**30,  # noqa: E731
                            gpu_power_w=71.5)
    w = AlertWatch(predicted_ms=100.0, capacity={}, k=2)
    seq = [w.observe({0: _row(s, 0, cpu=0.9), 1: gpu(s)}) for s in range(3)]
    assert seq[0] == [] and len(seq[1]) == 1 and seq[1][0].startswith("LowUtilization: rank 1 used under 50% of its GPU")
    _write(tmp_path, 0, [_row(0, 0)])
    _write(tmp_path, 1, [gpu(0)])
    reg = CollectorRegistry()
    reg.register(RunCollector(tmp_path, ["cpu0", "gpu0"], 45.0))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    # only the GPU rank has GPU figures (a CPU rank's are absent, not 0)
    assert [(s.labels["device"], s.value) for s in families["hpml_gpu_power_watts"].samples] == [("gpu0", 71.5)]
    assert [s.value for s in families["hpml_gpu_utilization"].samples] == [0.2]
    assert [s.value for s in families["hpml_gpu_memory_bytes"].samples] == [3 * 2**30]
