"""Exactly-once data across a failure: a rank killed mid-run under ``run --adapt``, resumed on another plan.

A TrainSpec of 128 items in batches of 8 (16 steps = one epoch) is compiled
for 2 ranks (2 stages); rank 1 dies at step 11, the last checkpoint is step 8,
and the job resumes on the one device left (1 stage, 1 rank). The first-stage
ranks log the dataset indices of every step (``--log-samples``): the steps
whose updates survive (up to the checkpoint in the first segment, all of the
second) train on exactly one epoch, each item once, and the redone steps
reproduce the losses the first segment measured for them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpml_compile.runtime.monitor import read_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1800)]
CLI = [sys.executable, "-m", "hpml_compile"]
SPEC = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset
from hpml_compile import TrainSpec

def spec():
    net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 6, generator=g)
    return TrainSpec(net, TensorDataset(x, x[:, :3].argmax(1)), nn.functional.cross_entropy, batch_size=8, seed=5,
                     lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 4, 0.8))
'''


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)


def _batches(seg: Path) -> dict[int, list[int]]:
    """Global batch number -> the dataset indices the first-stage ranks of a segment trained on (rows joined)."""
    out: dict[int, list[int]] = {}
    for path in sorted((seg / "samples").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row["batch"], []).extend(row["indices"])
    return out


def test_a_killed_rank_resumes_on_another_plan_and_each_item_is_trained_once(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SPEC)
    r = _cli("compile", f"{tmp_path / 'train.py'}:spec", "--cluster", "local-cpu-2", "--solver", "uniform",
             "--microbatches", "2", "--repeats", "1", "-o", str(tmp_path / "build"))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    r = _cli("run", str(tmp_path / "build"), "--adapt", "--no-replan-on-imbalance", "--epochs", "1",
             "--kill-at", "11:1", "--checkpoint-every", "4", "--log-samples", "--run-dir", str(run), "--no-report")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 epoch(s) of 16 batches of 8 = 16 steps" in r.stdout and "resuming from step_00000008" in r.stdout
    first, second = _batches(run / "seg0"), _batches(run / "seg1")
    assert sorted(first)[:11] == list(range(11)) and sorted(second) == list(range(8, 16))  # resumed after step 8
    survived = [i for b in range(8) for i in first[b]] + [i for b in range(8, 16) for i in second[b]]
    assert sorted(survived) == list(range(128))  # one epoch, each item once
    for b in range(8, 11):  # the redone steps trained on the same items as before the failure
        assert sorted(second[b]) == sorted(first[b])
    before = {m.step + 1: m.loss for m in read_metrics(run / "seg0")[0]}
    after = {m.step + 1: m.loss for m in read_metrics(run / "seg1")[0]}
    assert min(after) == 9 and max(after) == 16
    for step in (9, 10):  # measured by both segments: the same model, data and learning rate
        assert after[step] == pytest.approx(before[step], rel=1e-5)
