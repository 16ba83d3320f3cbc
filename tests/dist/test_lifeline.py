"""No orphan ranks: a launcher killed with SIGKILL takes its torchrun ranks with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hpml_compile.cli import main
from hpml_compile.runtime.job.lifeline import LAUNCHER_PID_ENV

# The build is compiled in this process, where profiling's notes on a busy machine's timing (which a CLI
# subprocess kept to its own stderr) would fill the summary: they are about the host, not what is tested here.
QUIET_PROFILE = [pytest.mark.filterwarnings("ignore:.*the model's blocks timed in sequence took:UserWarning"),
                 pytest.mark.filterwarnings("ignore:.*the whole-model pass took:UserWarning")]
pytestmark = [pytest.mark.dist, *QUIET_PROFILE]

CLI = [sys.executable, "-m", "hpml_compile"]


def _ranks_of(launcher: int) -> list[int]:
    """PIDs of live processes whose environment names ``launcher`` as theirs (the ranks it started)."""
    mark = f"{LAUNCHER_PID_ENV}={launcher}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == launcher:
            continue
        try:
            env = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark in env.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lifeline") / "build"
    # compiled in this process: a CLI subprocess would import torch and the package once more; the plan's
    # predicted times are not what this checks, so the blocks' co-run slow-down is not timed
    assert main(["compile", "gpt-tiny", "--cluster", "local-cpu-2", "--solver", "uniform", "--microbatches", "2",
                 "--repeats", "1", "--no-corun", "-o", str(out)]) == 0
    return out


def _wait(cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.2)
    return bool(cond())


@pytest.mark.parametrize("adapt", [False, True], ids=["run", "run-adapt"])
def test_sigkilled_launcher_leaves_no_rank_alive(build: Path, tmp_path: Path, adapt: bool) -> None:
    run = tmp_path / "run"
    ck = run / "checkpoints" if adapt else tmp_path / "ck"
    cmd = [*CLI, "run", str(build), "--steps", "100000", "--run-dir", str(run), "--checkpoint-every", "2",
           *(["--adapt"] if adapt else ["--checkpoint-dir", str(ck)])]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert _wait(lambda: len(_ranks_of(launcher.pid)) == 2 and ck.is_dir() and any(ck.iterdir()), 120), \
            "the ranks did not start training"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        assert _wait(lambda: not _ranks_of(launcher.pid), 10), f"orphan ranks: {_ranks_of(launcher.pid)}"
        written = sorted(p.name for p in ck.iterdir())
        time.sleep(2)
        assert sorted(p.name for p in ck.iterdir()) == written, "checkpoints are still being written"
    finally:
        for pid in _ranks_of(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.parametrize("sig, code, when", [(signal.SIGINT, 130, "training"), (signal.SIGINT, 130, "starting"),
                                             (signal.SIGTERM, 143, "training")],
                         ids=["ctrl-c-training", "ctrl-c-starting", "sigterm-training"])
def test_a_stopped_run_says_so_in_one_line_and_leaves_a_readable_run_folder(
        build: Path, tmp_path: Path, sig: int, code: int, when: str) -> None:
    run = tmp_path / "run"
    launcher = subprocess.Popen([*CLI, "run", str(build), "--steps", "100000", "--run-dir", str(run)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if when == "training":
            # a step recorded by both ranks (their step rows, not the event files beside them)
            started = _wait(lambda: all((run / "metrics" / f"rank{r}.jsonl").is_file() and
                                        "\n" in (run / "metrics" / f"rank{r}.jsonl").read_text() for r in (0, 1)),
                            120)
        else:  # the ranks exist but are still importing torch and building the model
            started = _wait(lambda: len(_ranks_of(launcher.pid)) == 2, 120)
        assert started, "the run did not get that far"
        launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=60)
        assert launcher.returncode == code
        assert "Traceback" not in err and "Traceback" not in out
        # the stop's own lines; the monitor's alerts of a run that got far enough (a loaded CI host) are not it
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("ALERT ")]
        assert len(lines) <= 3, err
        assert f"stopped by {signal.Signals(sig).name}" in err
        assert _wait(lambda: not _ranks_of(launcher.pid), 10)
        if when == "training":
            r = subprocess.run([*CLI, "report", str(run)], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0 and "step: measured" in r.stdout, r.stdout + r.stderr
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _ranks_of(launcher.pid):
            os.kill(pid, signal.SIGKILL)


# A user's script that never ends by itself and never watches anything: each rank writes its PID, then sleeps.
SLEEPER = '''
import os, time
from pathlib import Path
Path(os.environ["PIDS"], os.environ["RANK"]).write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
'''

# A launch agent of a host, as ``launch --adapt --nnodes N`` runs one per segment: torchrun's agent in this process.
AGENT = '''
import sys
from pathlib import Path
from hpml_compile.runtime.job.launcher import LaunchSpec, launch
launch(LaunchSpec(Path(sys.argv[1]), Path(sys.argv[2]), 2, program=(sys.argv[1],)))
'''


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("killed", ["launch", "torchrun-agent", "host-agent"])
def test_a_sigkilled_launch_agent_leaves_no_rank_of_the_users_script(tmp_path: Path, killed: str) -> None:
    """``launch``'s ranks run the user's script, which watches nothing itself; they still end with their launcher:
    the ``launch`` process (its torchrun agent and ranks go), torchrun's agent alone, or a host's in-process agent."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PIDS": str(pids)}
    if killed == "host-agent":
        (tmp_path / "agent.py").write_text(AGENT)
        cmd = [sys.executable, str(tmp_path / "agent.py"), str(tmp_path / "sleeper.py"), str(tmp_path / "run")]
    else:
        cmd = [*CLI, "launch", "--nproc", "2", "--max-failures", "0", "--run-dir", str(tmp_path / "run"),
               str(tmp_path / "sleeper.py")]
    top = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                           stdin=subprocess.DEVNULL, start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        assert _wait(lambda: len(list(pids.iterdir())) == 2, 120), "the ranks did not start"
        ranks = [int(p.read_text()) for p in pids.iterdir()]
        tree = [psutil.Process(top.pid), *psutil.Process(top.pid).children(recursive=True)]
        assert set(ranks) <= {p.pid for p in tree}
        victim = top.pid if killed != "torchrun-agent" else psutil.Process(top.pid).children()[0].pid
        assert victim not in ranks
        os.kill(victim, signal.SIGKILL)
        if victim == top.pid:
            top.wait(10)
        assert _wait(lambda: all(_gone(pid) for pid in ranks), 10), \
            f"ranks left running: {[pid for pid in ranks if not _gone(pid)]}"
        assert _wait(lambda: all(_gone(p.pid) for p in tree), 30), \
            f"processes left: {[p.pid for p in tree if not _gone(p.pid)]}"
        if killed == "torchrun-agent":  # the launch itself sees the failure and stops, in one line
            _, err = top.communicate(timeout=30)
            assert top.returncode == 2 and "Traceback" not in err, err
    finally:
        for p in tree:
            if not _gone(p.pid):
                p.kill()
        if top.poll() is None:
            top.kill()
