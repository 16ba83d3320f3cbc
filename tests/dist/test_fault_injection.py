"""Fault injection: `run --kill-at STEP:RANK` kills a rank abruptly; the launcher names it and keeps the measurements."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hpml_compile.cli import main

pytestmark = pytest.mark.dist
CLI = [sys.executable, "-m", "hpml_compile"]


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "b"
    # the faults are measured against the run's own steps, not the plan's predicted times: the blocks' co-run
    # slow-down is not timed
    assert main(["compile", "gpt-tiny", "--cluster", "local-cpu-2", "--solver", "uniform", "--no-corun",
                 "-o", str(out)]) == 0
    return out


def _compute(run: Path, rank: int) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]
    return [r["fwd_ms"] + r["bwd_ms"] for r in rows]


def test_slowed_rank_computes_slower_from_the_given_step(build: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = subprocess.run([*CLI, "run", str(build), "--steps", "7", "--run-dir", str(run), "--slow", "1:4:5",
                        "--no-report"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    before, after = _compute(run, 1)[1:4], _compute(run, 1)[4:]
    # medians: one step of a busy machine must not decide it
    assert statistics.median(after) > 2 * statistics.median(before), (before, after)


def test_killed_rank_is_named_and_earlier_steps_are_kept(build: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = subprocess.run([*CLI, "run", str(build), "--steps", "5", "--run-dir", str(run), "--kill-at", "3:1",
                        "--retries", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "rank 1 failed first: killed at step 3 by --kill-at" in r.stderr and "Traceback" not in r.stderr
    rows = [json.loads(line) for line in (run / "metrics" / "rank1.jsonl").read_text().splitlines()]
    assert len(rows) == 2, "the two steps before the kill were measured and kept"


@pytest.mark.parametrize(("flag", "value", "needle"), [("--kill-at", "three", "expected STEP:RANK"),
                                                       ("--slow", "1:0.5:3", "FACTOR must be a number >= 1")])
def test_bad_fault_spec_is_refused(flag: str, value: str, needle: str) -> None:
    # refused by `run` before anything is read or started: the ranks get their faults typed, from run.json
    r = subprocess.run([*CLI, "run", "no-such-build", flag, value], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
