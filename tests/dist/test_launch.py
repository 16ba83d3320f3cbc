"""``hpml-compile launch``: with ``--adapt`` the README's own-loop script survives a killed rank on the devices left;
without it, a killed rank's script is started again on as many ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpml_compile.runtime.execute.checkpoint import latest, load_checkpoint
from hpml_compile.runtime.job.scriptlaunch import died_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1200)]
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "own_loop.py"


def test_a_killed_rank_restarts_the_script_on_one_rank_from_its_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "hpml_compile", "launch", "--adapt", "--nproc", "2", "--run-dir",
                        str(run), str(SCRIPT), "--steps", "12", "--die-at", "8", "--save-every", "5"],
                       capture_output=True, text=True, timeout=1100, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    assert "segment 0: 2 rank(s); from the start" in out and "rank(s) [1] died" in out
    assert "segment 1: 1 rank(s); resumed at step 5" in out and "launch: done in 2 segment(s)" in out
    assert died_ranks((run / "seg0" / "torchrun.stderr").read_text()) == [1]  # rank 0 was only stopped (SIGTERM)
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("cluster")) for e in events] == [("segment", "local-cpu-2"), ("failure", None),
                                                                ("segment", "local-cpu-1"), ("done", None)]
    assert (events[1]["ranks"], events[1]["dropped"], events[1]["ranks_left"]) == ([1], True, 1)
    last = latest(run / "checkpoints")
    assert last is not None and last.name == "step_00000012"
    # the final checkpoint holds the data position and the schedule after 12 steps
    sys.path.insert(0, str(SCRIPT.parent))
    from digits_cnn import net

    meta = load_checkpoint(last, net(), None, rng=False)
    assert meta["data"]["batch"] == 12 and meta["lr_scheduler"]["last_epoch"] == 12


DRILL = '''
import os, signal
if os.environ["HPML_SEGMENT"] == "0" and os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} on {os.environ['HPML_CLUSTER']}", flush=True)
'''


def test_without_adapt_a_killed_rank_is_restarted_on_as_many_ranks(tmp_path: Path) -> None:
    (tmp_path / "drill.py").write_text(DRILL)
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "hpml_compile", "launch", "--nproc", "2", "--max-failures", "1",
                        "--run-dir", str(run), str(tmp_path / "drill.py")],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "rank 1 of 2 on local-cpu-2" in r.stdout and "launch: done in 2 segment(s)" in r.stdout
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("cluster")) for e in events] == [("segment", "local-cpu-2"), ("failure", None),
                                                                ("segment", "local-cpu-2"), ("done", None)]
    assert (events[1]["ranks"], events[1]["dropped"]) == ([1], False)
