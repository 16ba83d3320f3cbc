"""Monitoring and the run report: JSON lines, TensorBoard events, the per-stage table, advice, the measured profile."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hpml_compile import load_profile, profile, save_profile
from hpml_compile.cli import main
from hpml_compile.codegen.comm import Direction
from hpml_compile.cluster import load_cluster
from hpml_compile.plan import Plan, PlanPrediction, Schedule, Stage, StagePrediction, save_plan
from hpml_compile.runtime.sync.comm import CommStats
from hpml_compile.runtime.observe.monitor import Monitor, StepMetrics, read_metrics, split_wait
from hpml_compile.runtime.observe.summary import (analyse, export_profile, format_summary, measured_profile, summarise,
                                                  wall_ms)


def _row(step: int, rank: int, fwd: float, bwd: float, pipeline: float = 100.0) -> StepMetrics:
    return StepMetrics(step=step, rank=rank, stage=rank, replica=0, device="cpu", microbatches=4, samples=8,
                       step_ms=pipeline + 10, pipeline_ms=pipeline, fwd_ms=fwd, bwd_ms=bwd, wait_ms=10.0,
                       p2p_ms=2.0, send_ms=1.0, allreduce_ms=3.0, optimizer_ms=5.0, peak_memory_bytes=2**20,
                       loss=5.0 - step)


def _run_dir(tmp: Path, slow_stage: int | None = None) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    prof = profile(model, (torch.randn(8, 8),), name="toy", repeats=1, warmup=0, progress=False)
    names = [n.name for n in prof.nodes]
    st = (Stage(0, ("cpu0",), tuple(names[:2]), predicted=StagePrediction(5.0, 10.0)),
          Stage(1, ("cpu1",), tuple(names[2:]), predicted=StagePrediction(5.0, 10.0)))
    plan = Plan("toy", load_cluster("local-cpu-2"), Schedule.ONE_F_ONE_B, 4, st, PlanPrediction(70.0, 1, 0.2))
    run = tmp / "run"
    run.mkdir()
    save_plan(plan, run / "plan.json")
    save_profile(prof, run / "plan_profile.json")
    for rank in (0, 1):
        mon = Monitor(run, rank, tensorboard=rank == 1)
        for step in range(6):
            slow = 3.0 if rank == slow_stage else 1.0
            mon.record(_row(step, rank, 20.0 * slow, 40.0 * slow))
        mon.close()
    return run


def test_metrics_derive_comm_idle_bubble_and_round_trip() -> None:
    m = _row(0, 0, 30.0, 45.0)
    assert m.comm_ms == pytest.approx(6.0) and m.idle_ms == pytest.approx(100 - 30 - 45 - 2 - 1)
    assert m.bubble == pytest.approx(0.25) and m.samples_per_s == pytest.approx(8 / 0.11)
    assert StepMetrics.from_dict(m.to_dict()) == m


def test_receive_waits_split_into_transfer_and_idle() -> None:
    s = CommStats(recv_s=[(Direction.FORWARD, 0.010), (Direction.FORWARD, 0.002), (Direction.BACKWARD, 0.004),
                          (Direction.BACKWARD, 0.001)])
    total, transfer = split_wait(s)
    assert total == pytest.approx(17.0) and transfer == pytest.approx(2 * 2.0 + 2 * 1.0)


@pytest.mark.dist
def test_peak_memory_of_a_process_follows_its_allocations() -> None:
    # A fresh process: in this one, freed memory that is still resident would absorb the allocation.
    code = ("import torch; from hpml_compile.runtime.observe.monitor import peak_memory, reset_peak_memory; "
            "d = torch.device('cpu'); reset_peak_memory(d); a, k = peak_memory(d); "
            "t = torch.ones(96 * 2**20 // 4); b, _ = peak_memory(d); print(k, b - a)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "rss" and int(out[1]) >= 64 * 2**20


def test_monitor_writes_json_lines_and_tensorboard(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    rows = read_metrics(run)
    assert sorted(rows) == [0, 1] and [m.step for m in rows[1]] == list(range(6))
    assert list((run / "tb" / "rank1").glob("events.out.tfevents.*")) and not (run / "tb" / "rank0").exists()


def test_report_names_the_bottleneck_and_suggests_a_replan(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, slow_stage=1)
    s = analyse(run)
    assert s.skipped == 2 and s.steps == 6 and s.bottleneck == 1
    assert s.stages[1].compute_ms == pytest.approx(180.0) and s.stages[1].predicted_compute_ms == pytest.approx(60.0)
    assert s.stages[1].ratio == pytest.approx(3.0) and s.stages[0].ratio == pytest.approx(1.0)
    text = format_summary(s)
    assert "bottleneck: stage 1 on cpu1" in text and "hpml-compile replan" in text and "imbalance" in text
    assert f"step: measured {s.step_ms:.1f} ms, predicted 70.0 ms" in text


def test_measured_profile_scales_each_stage(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, slow_stage=1)
    s = analyse(run)
    base = load_profile(run / "plan_profile.json")
    got = measured_profile(base, s)
    stage1 = set(s.plan.stages[1].nodes)
    for old, new in zip(base.nodes, got.nodes):
        f = 60 / 20 if old.name in stage1 else 20 / 20  # measured fwd / (predicted 5 ms x 4 microbatches)
        assert new.cost["cpu"].fwd_ms == pytest.approx(old.cost["cpu"].fwd_ms * f)
        assert new.cost["cpu"].measured
    assert got.devices["cpu"]["measured"] is True
    path = export_profile(run, s)
    assert path == run / "profile.json" and load_profile(path).model == "toy"


def test_report_command_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run_dir(tmp_path)
    assert main(["report", str(run), "--skip", "1"]) == 0
    out = capsys.readouterr().out
    assert "5 steps measured (first 1 skipped" in out and "meas/pred" in out and (run / "profile.json").is_file()
    # beside predicted against measured: the machine the prediction's costs were measured on
    host = load_profile(run / "plan_profile.json").devices["cpu"]
    assert f"prediction profiled on {host['cpu_model']}" in out and "GB/s one thread" in out
    assert any(f"{level} " in out for level in host["cache_bytes"])


def test_every_column_of_the_report_table_is_one_report_help_explains(tmp_path: Path) -> None:
    from hpml_compile.runtime.observe.summary import COLUMNS, format_summary

    header = format_summary(analyse(_run_dir(tmp_path), skip=1)).splitlines()[1]
    for name, _ in COLUMNS:
        assert name in header, name
        header = header.replace(name, "", 1)
    assert not header.strip(), f"columns without an entry in summary.COLUMNS (report --help): {header.split()}"


def test_a_balanced_run_gets_no_alarm(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    plan = analyse(run).plan
    save_plan(replace(plan, predicted=PlanPrediction(110.0, 0, 0.2)), run / "plan.json")
    s = analyse(run)
    assert not any("imbalance" in a or "re-plan" in a for a in s.advice)


def test_the_report_compares_the_bubble_the_ranks_measure() -> None:
    from hpml_compile.runtime.observe.summary import predicted_bubble

    c = load_cluster("local-cpu-2")
    stages = (Stage(0, ("cpu0",), ("a",), predicted=StagePrediction(1, 2, 0, 0.4)),
              Stage(1, ("cpu1",), ("b",), predicted=StagePrediction(1, 2, 0, 0.1)))
    plan = Plan("toy", c, Schedule.GPIPE, 2, stages, PlanPrediction(10.0, 0, 0.3))
    assert predicted_bubble(plan) == pytest.approx(0.25)  # the mean of the stages' own, not the pipeline's 0.3
    old = replace(plan, stages=tuple(replace(s, predicted=StagePrediction(1, 2, 0)) for s in stages))
    assert predicted_bubble(old) == pytest.approx(0.3)  # a plan from before per-stage bubbles


def test_the_replan_advice_names_a_build_folder_that_does_not_exist(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, slow_stage=1)
    for name in ("build3", "build4"):  # the run used build3; build4 is taken too
        (tmp_path / name).mkdir()
    (run / "run.json").write_text(json.dumps({"build": str(tmp_path / "build3")}))
    advice = [a for a in analyse(run).advice if "hpml-compile replan" in a]
    assert advice and all(f"-o {tmp_path / 'build5'}" in a for a in advice)
    assert not any("build2" in a for a in advice)


def test_report_names_a_device_whose_peak_exceeds_its_capacity(tmp_path: Path) -> None:
    from hpml_compile.ir import Cluster, Device

    run = _run_dir(tmp_path)
    plan = analyse(run).plan
    small = Cluster(devices=(Device("cpu0", "cpu", 64 / 1024), Device("cpu1", "cpu", 64 / 1024)), name="small")
    stages = tuple(replace(st, predicted=replace(st.predicted, memory_bytes=60 * 2**20)) for st in plan.stages)
    save_plan(replace(plan, cluster=small, stages=stages), run / "plan.json")
    for rank, held in ((0, 50 * 2**20), (1, 70 * 2**20)):  # cpu1 holds 70 MiB of its 64
        mon = Monitor(run, rank, tensorboard=False)
        mon.record(replace(_row(6, rank, 20.0, 40.0), held_bytes=held, held_activation_bytes=2**20))
        mon.close()
    s = analyse(run)
    assert s.held == {"cpu0": 50 * 2**20, "cpu1": 70 * 2**20} and s.shortfalls == {"cpu1": 6 * 2**20}
    text = format_summary(s)
    # a CPU device's process beside its tensors (the rows' peak RSS: 1 MiB), against the prediction
    assert ("cpu0 50.0 MiB in tensors, its process 1.0 MiB (peak RSS) of 64.0 MiB (predicted 60.0 MiB), "
            "cpu1 70.0 MiB in tensors, its process 1.0 MiB (peak RSS) of 64.0 MiB (predicted 60.0 MiB)") in text
    assert ("over memory: cpu1 (cpu) held 70.0 MiB at its peak, above its capacity of 64.0 MiB: short by 6.0 MiB"
            in text) and "over memory: cpu0" not in text


def test_a_line_cut_short_by_a_stopped_rank_is_left_out_and_a_damaged_one_named(tmp_path: Path) -> None:
    from hpml_compile.errors import OutputError
    run = _run_dir(tmp_path)
    path = run / "metrics" / "rank0.jsonl"
    whole = path.read_text()
    kept = len(read_metrics(run)[0])
    path.write_text(whole + whole.splitlines()[0][:25])  # the rank was stopped while writing a line
    assert len(read_metrics(run)[0]) == kept
    path.write_text("{not json\n" + whole)
    with pytest.raises(OutputError, match=r"rank0\.jsonl: line 1 is not JSON"):
        read_metrics(run)


def test_the_report_compares_the_prediction_with_pipeline_steps_wall_clock(tmp_path: Path) -> None:
    """The measured step is what the rank spent in Pipeline.step (wall_ms), not the executor's inner span."""
    run = _run_dir(tmp_path)
    rows = read_metrics(run)
    plan = analyse(run).plan
    walled = {r: [replace(m, wall_ms=m.step_ms + 7.0) for m in ms] for r, ms in rows.items()}
    inner, outer = summarise(plan, rows), summarise(plan, walled)
    assert outer.step_ms == pytest.approx(inner.step_ms + 7.0)
    assert outer.error == pytest.approx((inner.step_ms + 7.0 - 70.0) / 70.0)
    assert wall_ms(replace(rows[0][0], wall_ms=0.0)) == rows[0][0].step_ms  # rows that predate it


def test_tensorboard_writes_the_loss_every_step_and_the_times_as_means_of_ten(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mon = Monitor(tmp_path, 0, events=False)
    for step in range(25):
        mon.record(_row(step, 0, fwd=float(step), bwd=1.0))
    mon.close()
    acc = EventAccumulator(str(tmp_path / "tb" / "rank0"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == list(range(25))
    fwd = acc.Scalars("time/fwd_ms")
    assert [e.step for e in fwd] == [9, 19, 24]  # each window's last step; the last, short window at close
    assert [e.value for e in fwd] == pytest.approx([4.5, 14.5, 22.0])
