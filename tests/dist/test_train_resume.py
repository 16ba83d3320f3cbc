"""Exactly-once data across restarts under ``run --adapt``: a killed rank, and an imbalance switch.

A TrainSpec of 128 items in batches of 8 (16 steps = one epoch) is compiled
for 2 ranks (2 stages); rank 1 dies at step 11, the last checkpoint is step 8,
and the job resumes on the one device left (1 stage, 1 rank). The first-stage
ranks log the dataset indices of every step (``--log-samples``): the steps
whose updates survive (up to the checkpoint in the first segment, all of the
second) train on exactly one epoch, each item once, and the redone steps
reproduce the losses the first segment measured for them.

The second case slows rank 1 until the imbalance watch switches plans
(checkpoint at the switch step, resume on the new build): the steps of every
segment, each from its resume point to where the next one resumed, cover one
epoch exactly, and every loss after the switch equals that of a plain run of
the new build resumed from a copy of the same checkpoint.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpml_compile.cli import main
from hpml_compile.runtime.observe.monitor import read_metrics

# The build is compiled in this process, where profiling's notes on a busy machine's timing (which a CLI
# subprocess kept to its own stderr) would fill the summary: they are about the host, not what is tested here.
QUIET_PROFILE = [pytest.mark.filterwarnings("ignore:.*the model's blocks timed in sequence took:UserWarning"),
                 pytest.mark.filterwarnings("ignore:.*the whole-model pass took:UserWarning")]
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1800), *QUIET_PROFILE]
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


def _compile(tmp_path: Path, *extra: str) -> None:
    """tmp_path/train.py compiled to tmp_path/build, in this process (a CLI subprocess imports torch once more)."""
    assert main(["compile", f"{tmp_path / 'train.py'}:spec", "--cluster", "local-cpu-2", "--solver", "uniform",
                 "--microbatches", "2", "--repeats", "1", "-o", str(tmp_path / "build"), *extra]) == 0


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
    _compile(tmp_path, "--no-corun")  # a failure re-plans here, not a prediction: the co-run slow-down is not timed
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
    # the whole remainder equals a plain run of the new build from a copy of the same checkpoint
    assert _remainder_matches_a_plain_resume(run, tmp_path, 16) == list(range(9, 17))


def _events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]


def _remainder_matches_a_plain_resume(run: Path, tmp_path: Path, steps: int) -> list[int]:
    """Compare the last segment's losses with a plain ``run --resume`` of its build from a copy of its checkpoint.

    Returns the steps compared (every step of the last segment).
    """
    last = [e for e in _events(run) if e["event"] == "segment"][-1]
    ckpt = Path(last["resume_from"])
    shutil.copytree(ckpt, tmp_path / "ckpt" / ckpt.name)
    ref = tmp_path / "ref"
    # a plain run, in this process (as compile): a CLI subprocess would import torch and the package once more
    assert main(["run", last["build"], "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
                 "--run-dir", str(ref), "--no-report", "--no-tensorboard"]) == 0
    got = {m.step + 1: m.loss for m in read_metrics(run / f"seg{last['segment']}")[0]}
    want = {m.step + 1: m.loss for m in read_metrics(ref)[0]}
    assert sorted(got) == sorted(want) and max(got) == steps
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-7), step
    return sorted(got)


def test_an_imbalance_switch_resumes_on_the_new_plan_and_each_item_is_trained_once(tmp_path: Path) -> None:
    # 256 items = 32 steps; a stage whose forwards are slowed 1500x (their compute, not their receives) makes each
    # slowed step a second or more: a switch pays over the rest
    (tmp_path / "train.py").write_text(SPEC.replace("randn(128", "randn(256"))
    _compile(tmp_path)
    run = tmp_path / "run"
    r = _cli("run", str(tmp_path / "build"), "--adapt", "--epochs", "1", "--slow", "1:1500:6", "--adapt-patience", "2",
             "--checkpoint-every", "0", "--log-samples", "--run-dir", str(run), "--no-report", "--no-tensorboard")
    assert r.returncode == 0, r.stdout + r.stderr
    events = _events(run)
    switches = [e for e in events if e["event"] == "switch"]
    assert switches, f"no switch: {(run / 'seg0' / 'replans.jsonl').read_text()}"
    segments = [e for e in events if e["event"] == "segment"]
    assert len(segments) == len(switches) + 1 and not any(e["event"] == "failure" for e in events)
    # each segment k resumes after step start[k]; its updates survive up to where segment k+1 resumed
    start = [0] + [int(Path(s["resume_from"]).name.split("_")[1]) for s in segments[1:]]
    assert start == sorted(start) and start[1] >= 6, start
    ends = [*start[1:], 32]
    survived: list[int] = []
    for k, (lo, hi) in enumerate(zip(start, ends)):
        got = _batches(run / f"seg{k}")
        assert min(got) == lo, (k, sorted(got))  # the first batch trained is the one after the checkpoint
        assert all(b in got for b in range(lo, hi)), (k, sorted(got))
        survived += [i for b in range(lo, hi) for i in got[b]]
    assert sorted(survived) == list(range(256))  # one epoch, each item once
    # the whole remainder after the (last) switch equals a plain run of the new build from a copy of its checkpoint
    assert _remainder_matches_a_plain_resume(run, tmp_path, 32) == list(range(start[-1] + 1, 33))
