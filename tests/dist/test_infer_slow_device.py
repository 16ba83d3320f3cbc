"""`hpml-compile serve` re-plans around a device that becomes slow while it serves: a 2-stage pipeline whose
second rank is made 8 times slower from its 6th batch on (``--slow``) serves its first batches on the plan,
then, under concurrent load, moves the model off the slow device between two batches; every request is
answered with the eager model's tokens, none is dropped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hpml_compile import models
from hpml_compile.infer.plan import save_inference_plan
from hpml_compile.runtime.job.launcher import free_port

from test_infer_serve import LLAMA, _call, _wait_healthy, two_stage_plan

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _replans(port: int) -> float:
    text = _call(port, "", "/metrics", "GET")[1]
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("hpml_speed_replans_total")))


def test_a_device_slowed_while_serving_is_planned_around_without_dropping_a_request(tmp_path: Path) -> None:
    build = tmp_path / "build"
    build.mkdir()
    save_inference_plan(two_stage_plan(LLAMA, [(0, 2), (2, 3)], lanes=2), build / "plan.json")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hpml_compile", "serve", str(build), "--port", str(port),
                             "--max-new-tokens", "8", "--max-batch", "4", "--slow", "1:8:6", "--adapt-baseline", "3",
                             "--adapt-threshold", "3", "--adapt-patience", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_healthy(port, proc)
        prompts = [[i + 1, (5 * i) % 256, 9, i % 7 + 1] for i in range(21)]
        answers = [_call(port, json.dumps({"tokens": p, "max_new_tokens": 8})) for p in prompts[:5]]  # batches 1-5
        assert _replans(port) == 0, "no re-plan while every device runs at its usual speed"
        with ThreadPoolExecutor(max_workers=4) as pool:  # from batch 6 rank 1 is slow: re-planned under this load
            answers += list(pool.map(lambda p: _call(port, json.dumps({"tokens": p, "max_new_tokens": 8})),
                                     prompts[5:], timeout=300))
        eager = models.load(LLAMA, seed=0).module.eval()
        for p, (status, text) in zip(prompts, answers):
            seq = list(p)
            with torch.no_grad():
                for _ in range(8):
                    seq.append(int(eager(torch.tensor([seq]))[0, -1].argmax()))
            assert status == 200 and json.loads(text)["tokens"] == seq[len(p):], (p, status, text)
        assert _replans(port) == 1
        status, health = _call(port, "", "/health", "GET")
        assert status == 200 and json.loads(health)["devices"] == ["cpu0"], health  # cpu1 held one block: now none
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            said = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            said = proc.communicate()[0]
    assert "measured slower than planned: cpu1" in said, said
    assert "re-planned on the measured speeds: cpu0 blocks 0-2" in said, said
