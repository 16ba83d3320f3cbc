"""The closed loop end to end (``hpml-compile run --adapt``), on 3 real gloo ranks under torchrun.

- a rank that hangs: its peers time out; it is restarted once, then dropped;
- a rank killed mid-run: the job resumes on the 2 devices left from the last
  checkpoint, loses no more steps than the checkpoint interval, and from the
  resumed step on its losses equal a plain 2-rank run started from that same
  checkpoint;
- a rank slowed 3x: the job re-plans within 20 steps and moves work off it
  (asserted by notebooks/03_closed_loop.ipynb, which runs that job);
- a loss that leaves too little memory for any plan: a clear stop, the last
  checkpoint intact.

Speeds (detection, re-plan, resume times; throughput against the prediction)
are measured in ``benchmarks/closed_loop``, not asserted here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpml_compile import models
from hpml_compile.cli import main
from hpml_compile.plan import load_plan
from hpml_compile.runtime.execute.checkpoint import latest, list_checkpoints, load_checkpoint
from hpml_compile.runtime.observe.monitor import read_metrics

# Each CLI call may take up to _cli's 600 s and a test makes two or three: longer than the default per-test limit.
# The build is compiled in this process, where profiling's notes on a busy machine's timing (which a CLI
# subprocess kept to its own stderr) would fill the summary: they are about the host, not what is tested here.
QUIET_PROFILE = [pytest.mark.filterwarnings("ignore:.*the model's blocks timed in sequence took:UserWarning"),
                 pytest.mark.filterwarnings("ignore:.*the whole-model pass took:UserWarning")]
pytestmark = [pytest.mark.dist, pytest.mark.timeout(1800), *QUIET_PROFILE]
CLI = [sys.executable, "-m", "hpml_compile"]


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]


def _losses(run: Path) -> dict[int, float]:
    """Step number (from 1) -> the batch loss, as rank 0 measured it."""
    return {m.step + 1: m.loss for m in read_metrics(run)[0]}


def _compile(out: Path, model: str, cluster: str, *extra: str) -> Path:
    # in this process: a CLI subprocess would import torch and the package once more for the same build
    assert main(["compile", model, "--cluster", cluster, "--repeats", "1", "-o", str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-tiny in 3 stages on local-cpu-3, compiled once for the tests below (a run only reads its build).

    Failures decide these tests, not time: the blocks' co-run slow-down (two forked neighbours timing the model
    dozens of times) is not timed, and the plans made after a failure are checked by their devices and losses.
    """
    return _compile(tmp_path_factory.mktemp("tiny3") / "b", "gpt-tiny", "local-cpu-3", "--solver", "uniform",
                    "--microbatches", "2", "--no-corun")


def test_killed_rank_resumes_on_the_devices_left_with_equal_losses(tiny3: Path, tmp_path: Path,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    build = tiny3
    assert [len(st.devices) for st in load_plan(build / "plan.json").stages] == [1, 1, 1]
    run, every, kill, steps = tmp_path / "run", 3, 8, 12
    r = _cli("run", str(build), "--steps", str(steps), "--adapt", "--no-replan-on-imbalance", "--checkpoint-every",
             str(every), "--kill-at", f"{kill}:2", "--retries", "1", "--run-dir", str(run), "--no-tensorboard",
             "--no-report")
    assert r.returncode == 0, r.stdout + r.stderr
    failure = next(e for e in _events(run) if e["event"] == "failure")
    assert (failure["rank"], failure["device"], failure["cause"], failure["dropped"]) == (2, "cpu2", "killed", True)
    seg1 = next(e for e in _events(run) if e["event"] == "segment" and e["segment"] == 1)
    assert seg1["devices"] == ["cpu0", "cpu1"] and seg1["resume_from"].endswith("step_00000006")
    resumed = 6
    assert kill - 1 - resumed <= every, "no more steps lost than the checkpoint interval"
    # the new plan runs on the two devices left and the job reached its last step there
    new_build = Path(seg1["build"])
    assert sorted(d for st in load_plan(new_build / "plan.json").stages for d in st.devices) == ["cpu0", "cpu1"]
    got = _losses(run / "seg1")
    assert sorted(got) == list(range(resumed + 1, steps + 1))
    # the reference: a plain 2-rank run of that build, started from a copy of the same checkpoint
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints" / "step_00000006", ckpt / "step_00000006")
    ref_run = tmp_path / "ref"
    capfd.readouterr()
    # a plain run, in this process (as compile): a CLI subprocess would import torch and the package once more
    assert main(["run", str(new_build), "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--resume",
                 "--run-dir", str(ref_run), "--no-tensorboard", "--no-report"]) == 0
    assert "resumed from" in capfd.readouterr().out  # rank 0 says so (a process of its own: fd capture)
    want = _losses(ref_run)
    assert sorted(want) == sorted(got)
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-7), step
    # and the first segment's losses before the kill continue smoothly into the resumed ones
    before = _losses(run / "seg0")
    assert before[resumed] > got[resumed + 1] > got[steps]


def test_a_rank_that_keeps_hanging_is_retried_then_dropped(tiny3: Path, tmp_path: Path) -> None:
    build = tiny3
    run = tmp_path / "run"
    r = _cli("run", str(build), "--steps", "6", "--adapt", "--no-replan-on-imbalance", "--checkpoint-every", "2",
             "--hang-at", "4:2", "--timeout", "6", "--retries", "1", "--max-failures", "2", "--run-dir", str(run),
             "--no-tensorboard", "--no-report")
    assert r.returncode == 0, r.stdout + r.stderr
    failures = [e for e in _events(run) if e["event"] == "failure"]
    assert [(e["device"], e["cause"], e["dropped"]) for e in failures] == [("cpu2", "comm", False),
                                                                           ("cpu2", "comm", True)]
    segments = [e for e in _events(run) if e["event"] == "segment"]
    assert [s["devices"] for s in segments] == [["cpu0", "cpu1", "cpu2"]] * 2 + [["cpu0", "cpu1"]]
    assert max(_losses(run / "seg2")) == 6


# A rank slowed 3x is re-planned within 20 steps, moving work off its device: notebooks/03_closed_loop.ipynb runs
# exactly that run (gpt-mini on 3 ranks, --slow 1:3:8, 32 steps) and asserts it (tests/unit/test_notebooks.py);
# the same run here cost the suite another 80-130 s.


def test_too_little_memory_left_stops_with_the_checkpoint_intact(tmp_path: Path) -> None:
    # three devices of 82 MiB hold mlp (30 MiB of parameters, 4x that with gradients and Adam) in a pipeline; two
    # do not: each CPU rank's process also holds the whole model as built (memory.process_bytes; the suite's
    # baseline is 0), so three fit from about 76 MiB and two from about 88. (Not gpt-tiny: its tied embedding is held by the first and the last stage, so no capacity lets three
    # devices hold it and two not.)
    cluster = tmp_path / "tight.json"
    cluster.write_text(json.dumps({"schema_version": 1, "name": "tight", "devices": [
        {"name": f"cpu{i}", "kind": "cpu", "memory_gib": 82 / 1024, "host": "localhost"} for i in range(3)]}))
    # memory decides this plan, not time: the blocks' co-run slow-down (a fifth of mlp's compile) is not timed
    build = _compile(tmp_path / "b", "mlp", str(cluster), "--microbatches", "2", "--no-corun")
    assert sum(len(st.devices) for st in load_plan(build / "plan.json").stages) == 3
    run = tmp_path / "run"
    r = _cli("run", str(build), "--steps", "8", "--adapt", "--no-replan-on-imbalance", "--checkpoint-every", "2",
             "--kill-at", "4:2", "--retries", "1", "--run-dir", str(run), "--no-tensorboard", "--no-report")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot go on without cpu" in r.stderr and "Traceback" not in r.stderr
    assert "MiB" in r.stderr or "GiB" in r.stderr or "KiB" in r.stderr, "the shortfall is named"
    last = latest(run / "checkpoints")
    assert last is not None and last.name == "step_00000002" and str(last) in r.stderr
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000002"]
    # intact: the whole model loads from it
    loaded = models.load("mlp")
    before = {k: v.clone() for k, v in loaded.module.state_dict().items()}
    assert load_checkpoint(last, loaded.module)["step"] == 2
    assert any(not torch.equal(before[k], v) for k, v in loaded.module.state_dict().items()), "trained weights"
