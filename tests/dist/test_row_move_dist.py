"""``run --adapt`` answers a slowed data-parallel replica by moving rows off it in place, and training stays exact.

gpt-tiny on a 2-rank data-parallel plan (what ``compile`` makes for
``local-cpu-2`` at batch 48 in 2 microbatches: one stage on cpu0 and cpu1),
rank 1 slowed 3x from step 6. The closed loop prices both candidates, the
row move (same stage, same devices, new rows) and the full re-plan, and
switches by the row move: the cheaper to switch to that pays. The restart a
re-plan needs is priced at 0.1 s (``HPML_ADAPT_SWITCH_COST_S``) so that both
pay within a test's few steps; the row move is priced at the in-place cost
(``policy.ROW_MOVE_PRIOR_S`` before a move was measured), and wins.

The running ranks take the new rows between two steps: one segment, one
launch, no checkpoint loaded; the run folder's plan.json is re-published with
the rows, and replans.jsonl records the move with its measured cost. After
it, the job's losses are those of a plain run of the original even plan: the
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


def test_a_slowed_replica_loses_rows_in_place_and_the_losses_stay_exact(tmp_path: Path) -> None:
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
    # no restart: one segment (one torchrun launch, the same processes throughout), nothing resumed
    assert [e["event"] for e in events] == ["segment", "done"], events
    assert events[0]["resume_from"] is None and "resuming from" not in out
    decisions = [json.loads(x) for x in (run / "seg0" / "replans.jsonl").read_text().splitlines() if x.strip()]
    moves = [d for d in decisions if d.get("in_place")]
    assert moves, f"no in-place row move:\n{decisions}\n{out[-3000:]}"
    d = moves[0]
    assert d["switch"] and d["chosen"] == "rows" and set(d["candidates"]) == {"rows", "replan"}, d
    assert "cpu1" in d["slow_devices"] and "switching by rows in place" in out and "rows moved in place" in out
    rows, full = d["candidates"]["rows"], d["candidates"]["replan"]
    assert rows["in_place"] and rows["predicted_step_ms"] > 0 and full["predicted_step_ms"] > 0
    assert rows["switch_cost_s"] < 0.1 < full["switch_cost_s"]  # in place against a restart plus a solve
    assert 0 < d["switch_s"] < 5.0 and d["codegen_s"] == 0.0 and "build" not in d  # measured, no new build
    # the run's plan.json has the new rows: the same stage on the same devices, fewer rows for the slowed cpu1
    moved = load_plan(run / "seg0" / "plan.json")
    st = moved.stages[0]
    assert len(moved.stages) == 1 and st.devices == ("cpu0", "cpu1") and st.nodes == plan.stages[0].nodes
    assert sum(st.rows) == 24 and st.rows[1] < st.rows[0] and [list(st.rows)] == d["rows"]
    # exact: every step's loss, before and after the move, as a plain run of the original even plan
    plain = tmp_path / "plain"
    _cli("run", str(build), "--steps", str(STEPS), "--run-dir", str(plain), "--no-tensorboard", "--no-report")
    want = _losses(plain)
    got = _losses(run / "seg0")
    assert sorted(got) == list(range(1, STEPS + 1)) and STEPS > d["step"] + 2
    for step in sorted(got):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), (step, got, want)
