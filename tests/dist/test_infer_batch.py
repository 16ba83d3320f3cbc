"""`hpml-compile infer` killed mid-run (rank 0 and its worker) resumes without repeating or skipping an item,
a line cut by the kill included; the worker rank does not outlive its driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hpml_compile.infer.api import compile_inference

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _infer(build: Path, data: Path, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hpml_compile", "infer", str(build), "--data", str(data), "-o",
                             str(out), "--batch-size", "2", "--max-new-tokens", "12"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_infer_resumes_after_a_kill_without_repeating_or_skipping(tmp_path: Path) -> None:
    build = tmp_path / "build"
    compile_inference("gpt-mini", "local-cpu-2", build, batch=2, prompt_len=16, new_tokens=12)
    items = [{"prompt": f"item {i}: " + "x" * (i % 5), "id": i} for i in range(40)]
    data, out = tmp_path / "data.jsonl", tmp_path / "out.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in items))
    partial = out.with_name(out.name + ".partial")

    run = _infer(build, data, out)
    worker_pids: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and run.poll() is None:
        worker_pids = worker_pids or [c.pid for c in psutil.Process(run.pid).children()]
        if partial.exists() and partial.read_text().count("\n") >= 4:
            break
        time.sleep(0.02)
    run.send_signal(signal.SIGKILL)
    run.communicate(timeout=30)
    assert not out.exists() and partial.exists(), "the kill must land mid-run"
    done = partial.read_text().count("\n")
    assert 4 <= done < len(items)
    with open(partial, "a") as f:
        f.write('{"index": %d, "tok' % done)  # a line the kill cut short
    for pid in worker_pids:  # the worker sees its driver's connection close and exits
        try:
            psutil.Process(pid).wait(timeout=60)
        except psutil.NoSuchProcess:
            pass

    text, _ = _infer(build, data, out).communicate(timeout=300)
    assert f"resuming after item {done - 1}" in text, text
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(items)))
    assert [r["id"] for r in rows] == list(range(len(items)))
    assert not partial.exists()

    fresh = tmp_path / "fresh.jsonl"
    _infer(build, data, fresh).communicate(timeout=300)
    assert [json.loads(x) for x in fresh.read_text().splitlines()] == rows
