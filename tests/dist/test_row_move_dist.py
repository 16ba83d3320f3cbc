"""``run --adapt`` answers a slowed data-parallel replica by moving rows off it, and training stays exact.

gpt-tiny on a 2-rank data-parallel plan (what ``compile`` makes for
``local-cpu-2`` at batch 48 in 2 microbatches: one stage on cpu0 and cpu1),
rank 1 slowed 3x from step 6. The closed loop prices both candidates, the
row move (same stage, same devices, new rows) and the full re-plan, and
switches by the row move: the cheaper to switch to that pays. The restart
cost is given (``HPML_ADAPT_SWITCH_COST_S``) so that a switch pays within a
test's few steps; what the switch costs on this machine is measured in
``benchmarks/uneven_rows`` (``--adapt``).

The switch goes through the checkpoint/resume path of every switch. After it,
the job's losses are those of a plain run of the original even plan: the
gradient is the exact batch mean whatever the rows, so moving rows changes
only the summation order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpml_compile.plan import load_plan
from hpml_compile.runtime.monitor import read_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1800)]
CLI = [sys.executable, "-m", "hpml_compile"]
STEPS, SLOW_FROM = 16, 6


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"hpml-compile {' '.join(args)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _losses(run: Path) -> dict[int, float]:
    """Step number (from 1) -> the batch loss, as rank 0 measured it."""
    return {m.step + 1: m.loss for m in read_metrics(run)[0] if m.loss is not None}


def test_a_slowed_replica_loses_rows_by_a_row_move_and_the_losses_stay_exact(tmp_path: Path) -> None:
    build = tmp_path / "b"
    _cli("compile", "gpt-tiny", "--cluster", "local-cpu-2", "--batch-size", "48", "--microbatches", "2",
         "--repeats", "1", "-o", str(build))
    plan = load_plan(build / "plan.json")
    assert [st.devices for st in plan.stages] == [("cpu0", "cpu1")] and not plan.stages[0].rows, \
        "the test needs compile's one-stage data-parallel plan for local-cpu-2"
    run = tmp_path / "run"
    r = _cli("run", str(build), "--steps", str(STEPS), "--adapt", "--adapt-patience", "3", "--slow",
             f"1:3:{SLOW_FROM}", "--run-dir", str(run), "--no-tensorboard", "--no-report",
             env={"HPML_ADAPT_SWITCH_COST_S": "0.1"})
    out = r.stdout + r.stderr  # the ranks' decisions go to stderr
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    switches = [e for e in events if e["event"] == "switch"]
    assert switches, f"no switch:\n{out[-3000:]}"
    d = switches[0]["decision"]
    assert d["chosen"] == "rows" and set(d["candidates"]) == {"rows", "replan"}, d
    for c in d["candidates"].values():  # both priced: predicted step and switch cost
        assert c["predicted_step_ms"] > 0 and c["switch_cost_s"] >= 0.1
    assert d["candidates"]["rows"]["switch_cost_s"] <= d["candidates"]["replan"]["switch_cost_s"]
    assert "cpu1" in d["slow_devices"] and "switching by rows" in out
    # the new build: the same stage on the same devices, fewer rows for the slowed cpu1
    moved = load_plan(Path(switches[0]["build"]) / "plan.json")
    st = moved.stages[0]
    assert len(moved.stages) == 1 and st.devices == ("cpu0", "cpu1") and st.nodes == plan.stages[0].nodes
    assert sum(st.rows) == 24 and st.rows[1] < st.rows[0]
    seg = next(e for e in events if e["event"] == "segment" and e["segment"] == switches[0]["segment"] + 1)
    assert seg["resume_from"] and Path(seg["resume_from"]).name == f"step_{switches[0]['step']:08d}"
    assert events[-1]["event"] == "done"
    # exact: every step's loss, before and after the switch, as a plain run of the original even plan
    plain = tmp_path / "plain"
    _cli("run", str(build), "--steps", str(STEPS), "--run-dir", str(plain), "--no-tensorboard", "--no-report")
    want = _losses(plain)
    got = {**_losses(run / "seg0"), **_losses(run / f"seg{seg['segment']}")}
    assert sorted(got) == list(range(1, STEPS + 1)) and max(got) > switches[0]["step"] + 2
    for step in sorted(got):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), (step, got, want)
