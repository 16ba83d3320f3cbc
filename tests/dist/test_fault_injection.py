"""Fault injection: `run --kill-at STEP:RANK` kills a rank abruptly; the launcher names it and keeps the measurements."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpml_compile.cli import main

pytestmark = pytest.mark.dist
CLI = [sys.executable, "-m", "hpml_compile"]


def test_killed_rank_is_named_and_earlier_steps_are_kept(tmp_path: Path) -> None:
    build = tmp_path / "b"
    assert main(["compile", "gpt-tiny", "--cluster", "local-cpu-2", "--solver", "uniform", "-o", str(build)]) == 0
    run = tmp_path / "run"
    r = subprocess.run([*CLI, "run", str(build), "--steps", "5", "--run-dir", str(run), "--kill-at", "3:1",
                        "--retries", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "rank 1 failed first: killed at step 3 by --kill-at" in r.stderr and "Traceback" not in r.stderr
    rows = [json.loads(line) for line in (run / "metrics" / "rank1.jsonl").read_text().splitlines()]
    assert len(rows) == 2, "the two steps before the kill were measured and kept"


def test_bad_kill_spec_is_refused() -> None:
    r = subprocess.run([sys.executable, "-m", "hpml_compile.runtime.worker", "b", "r", "--kill-at", "three"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "expected STEP:RANK" in r.stderr
