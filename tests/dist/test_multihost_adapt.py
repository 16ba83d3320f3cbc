"""``run --adapt`` across hosts: two ``hpml-compile run`` agents on this machine stand in for two hosts.

A TrainSpec of 128 items in batches of 8 (16 steps, one epoch) is compiled
for 2 devices (2 stages); host 0 runs cpu0, host 1 cpu1, both writing the one
run folder (a shared file system between real hosts). Mid-run, host 1's
agent and its rank are killed (SIGKILL, the whole process tree; host 1's
rank is slowed from step 9, ``--slow``, so that the kill lands before the last step
however fast the machine is). Host 0
sees the host lost, drops its device, re-plans for cpu0 alone and resumes
from the last checkpoint:

- the job reaches its last step on cpu0 under the new plan;
- the resumed steps' losses equal a plain run of the new build from a copy of
  the same checkpoint;
- the steps whose updates survive train on one epoch, each item once;
- no process of the job is left on the machine.

``launch --adapt`` across hosts runs the user's own script on the same
machinery: two launch agents, one rank each, the same TrainSpec trained by a
short loop of its own (:data:`LOOP`); host 1's agent and rank are killed
after the checkpoint of step 4, and host 0 restarts the script alone, told
(``HPML_CLUSTER``) that only its own device is left, from that checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hpml_compile.cli import main
from hpml_compile.plan import load_plan
from hpml_compile.runtime.execute.checkpoint import latest
from hpml_compile.runtime.job.launcher import free_port
from hpml_compile.runtime.observe.monitor import read_metrics

QUIET_PROFILE = [pytest.mark.filterwarnings("ignore:.*the model's blocks timed in sequence took:UserWarning"),
                 pytest.mark.filterwarnings("ignore:.*the whole-model pass took:UserWarning")]
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(600), *QUIET_PROFILE]
ROOT = Path(__file__).resolve().parents[2]
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
    return TrainSpec(net, TensorDataset(x, x[:, :3].argmax(1)), nn.functional.cross_entropy, batch_size=8, seed=5)
'''


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1"}


def _batches(seg: Path) -> dict[int, list[int]]:
    """Global batch number -> the dataset indices the first-stage ranks of a segment trained on."""
    out: dict[int, list[int]] = {}
    for path in sorted((seg / "samples").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row["batch"], []).extend(row["indices"])
    return out


def _steps_done(seg: Path) -> int:
    path = seg / "metrics" / "rank0.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _job_processes(run: Path) -> list[psutil.Process]:
    """Processes on this machine whose command line names the run folder (agents and ranks of this job)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(run) in part for part in p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job's build: 2 stages, cpu0 then cpu1 (each test runs it in a run folder of its own); a lost host
    re-plans it, not a prediction, so the blocks' co-run slow-down is not timed."""
    here = tmp_path_factory.mktemp("build")
    (here / "train.py").write_text(SPEC)
    out = here / "build"
    assert main(["compile", f"{here / 'train.py'}:spec", "--cluster", "local-cpu-2", "--solver", "uniform",
                 "--microbatches", "2", "--repeats", "1", "--no-corun", "-o", str(out)]) == 0
    assert [st.devices for st in load_plan(out / "plan.json").stages] == [("cpu0",), ("cpu1",)]
    return out


def _kill_a_host_mid_run(build: Path, run: Path, kill: int) -> tuple[str, int, list[psutil.Process], str]:
    """Start both hosts (the one to be killed slowed from step 9), kill host ``kill``'s agent and its ranks once
    step 10 is done (past the checkpoint of step 8), and wait for the host left.

    Returns:
        The host left's output, its exit status, the processes killed, and the job's first store endpoint.
    """
    endpoint = f"localhost:{free_port()}"

    def host(rank: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*CLI, "run", str(build), "--adapt", "--no-replan-on-imbalance", "--epochs", "1", "--checkpoint-every",
             "4", "--log-samples", "--retries", "1", "--slow", f"{kill}:300:9", "--nnodes", "2", "--node-rank",
             str(rank), "--rdzv-endpoint", endpoint, "--host-timeout", "3", "--run-dir", str(run), "--no-report",
             "--no-tensorboard"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), stdin=subprocess.DEVNULL)

    hosts = [host(0), host(1)]
    victim, left = hosts[kill], hosts[1 - kill]
    killed: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while _steps_done(run / "seg0") < 10:
            if any(p.poll() is not None for p in hosts) or time.monotonic() > deadline:
                for p in hosts:
                    if p.poll() is None:
                        p.kill()
                said = [p.communicate()[0] for p in hosts]
                pytest.fail(f"segment 0 did not reach step 10 with both hosts running:\n{said[0]}\n---\n{said[1]}")
            time.sleep(0.02)
        agent = psutil.Process(victim.pid)
        killed = [agent, *agent.children(recursive=True)]
        assert len(killed) >= 2  # the agent and its rank (torchrun's workers are its children)
        for p in killed:
            p.send_signal(signal.SIGKILL)
        out, _ = left.communicate(timeout=300)
    finally:
        for p in hosts:
            if p.poll() is None:
                p.kill()
        victim.wait()
    return out, left.returncode, killed, endpoint


def _trained_once(run: Path, resumed: int) -> None:
    """The steps whose updates survive trained the epoch's 128 items once each."""
    first, second = _batches(run / "seg0"), _batches(run / "seg1")
    assert sorted(second) == list(range(resumed, 16))
    survived = [i for b in range(resumed) for i in first[b]] + [i for b in range(resumed, 16) for i in second[b]]
    assert sorted(survived) == list(range(128))


def _nothing_left(run: Path, killed: list[psutil.Process]) -> None:
    """Nothing of the job is left: the killed tree, and every agent and rank that named the run folder."""
    time.sleep(0.5)
    assert not [p.pid for p in killed if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not [p.pid for p in _job_processes(run) if p.status() != psutil.STATUS_ZOMBIE]


def test_a_lost_host_is_planned_out_and_the_job_resumes_on_the_host_left(build: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    out, code, killed, _ = _kill_a_host_mid_run(build, run, kill=1)
    assert code == 0, out
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    lost = [e for e in events if e["event"] == "failure"]
    assert [(e["cause"], e["host"], e["devices"], e["dropped"]) for e in lost] == [("host lost", 1, ["cpu1"], True)]
    segments = [e for e in events if e["event"] == "segment"]
    assert [s["devices"] for s in segments] == [["cpu0", "cpu1"], ["cpu0"]]
    resumed = int(Path(segments[1]["resume_from"]).name.split("_")[1])
    assert resumed in (8, 12)  # the last checkpoint before the kill (every 4 steps)
    new_build = Path(segments[1]["build"])
    assert [st.devices for st in load_plan(new_build / "plan.json").stages] == [("cpu0",)]  # a new plan, host 0
    assert "host(s) 1 lost" in out and "re-planned for 1 device(s) without cpu1" in out

    _trained_once(run, resumed)

    # the resumed losses equal a plain run of the new build from a copy of the same checkpoint
    ckpt = Path(segments[1]["resume_from"])
    shutil.copytree(ckpt, tmp_path / "ckpt" / ckpt.name)
    ref = tmp_path / "ref"
    r = subprocess.run([*CLI, "run", str(new_build), "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
                        "--resume", "--run-dir", str(ref), "--no-report", "--no-tensorboard"],
                       capture_output=True, text=True, timeout=300, env=_env(), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    got = {m.step + 1: m.loss for m in read_metrics(run / "seg1")[0]}
    want = {m.step + 1: m.loss for m in read_metrics(ref)[0]}
    assert sorted(got) == sorted(want) == list(range(resumed + 1, 17))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-7), step

    _nothing_left(run, killed)


def test_a_lost_host_0_is_taken_over_by_the_host_left(build: Path, tmp_path: Path) -> None:
    """Host 0 holds the job's store and decides; killed with its rank, host 1 opens a store of its own, re-plans
    for cpu1 alone and resumes from the last checkpoint, each item still trained once."""
    run = tmp_path / "run"
    out, code, killed, endpoint = _kill_a_host_mid_run(build, run, kill=0)
    assert code == 0, out
    assert "taking over the job's decisions" in out and "re-planned for 1 device(s) without cpu0" in out
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    lost = [e for e in events if e["event"] == "failure"]
    assert [(e["cause"], e["host"], e["devices"], e["segment"]) for e in lost] == [("host lost", 0, ["cpu0"], 0)]
    segments = [e for e in events if e["event"] == "segment"]
    assert [s["devices"] for s in segments] == [["cpu0", "cpu1"], ["cpu1"]]
    moved = next(e for e in events if e["event"] == "lead_moved")
    assert (moved["host"], moved["renumbered"]) == (1, {"1": 0})  # host 1 decides, as host 0 of a new store
    assert (run / ".lead").read_text() == moved["endpoint"] != endpoint  # named lead in the shared folder
    assert events[-1]["event"] == "done"
    resumed = int(Path(segments[1]["resume_from"]).name.split("_")[1])
    assert resumed in (8, 12)
    _trained_once(run, resumed)
    _nothing_left(run, killed)


LOOP = '''
import os, sys, time
from pathlib import Path
import torch
import hpml_compile
from hpml_compile.cluster import load_cluster
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import spec

torch.manual_seed(0)
pipe = hpml_compile.compile(spec(), cluster=os.environ["HPML_CLUSTER"], microbatches=2, solver="uniform",
                            profile_repeats=1, run_dir=os.environ["HPML_RUN_DIR"], corun=False,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
ck = os.environ["HPML_CHECKPOINT_DIR"]
resumed = pipe.load(ck, missing_ok=True)
if pipe.rank == 0:
    names = [d.name for d in load_cluster(os.environ["HPML_CLUSTER"]).devices]
    print(f"segment {os.environ['HPML_SEGMENT']}: {pipe.world_size} rank(s) on {','.join(names)}; "
          f"from step {resumed['step'] if resumed else 0}", flush=True)
while pipe.steps_done < 12:
    if os.environ.get("SLOW_AFTER_4") and pipe.steps_done >= 4:  # host 1 only: the kill lands mid-run
        time.sleep(0.5)
    pipe.trainer.step()
    if pipe.steps_done % 4 == 0:
        pipe.save(ck)
pipe.close()
'''


def test_launch_across_hosts_drops_a_lost_hosts_ranks_and_the_script_resumes(tmp_path: Path) -> None:
    """Two ``launch --adapt`` agents as two hosts; host 1 (agent and rank) killed after step 4's checkpoint: the
    script restarts on host 0 alone, HPML_CLUSTER naming cpu0 only, from that checkpoint, to its last step."""
    (tmp_path / "train.py").write_text(SPEC)
    (tmp_path / "loop.py").write_text(LOOP)
    run, endpoint = tmp_path / "run", f"localhost:{free_port()}"

    def host(rank: int, env: dict[str, str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*CLI, "launch", "--adapt", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint,
             "--nproc", "1", "--host-timeout", "3", "--run-dir", str(run), str(tmp_path / "loop.py")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, stdin=subprocess.DEVNULL)

    left, victim = host(0, _env()), host(1, {**_env(), "SLOW_AFTER_4": "1"})
    killed: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while latest(run / "checkpoints") is None:
            if left.poll() is not None or victim.poll() is not None or time.monotonic() > deadline:
                for p in (left, victim):
                    if p.poll() is None:
                        p.kill()
                pytest.fail("no checkpoint with both hosts running:\n" + left.communicate()[0] + "\n---\n"
                            + victim.communicate()[0])
            time.sleep(0.02)
        agent = psutil.Process(victim.pid)
        killed = [agent, *agent.children(recursive=True)]
        assert len(killed) >= 2  # the agent and its rank
        for p in killed:
            p.send_signal(signal.SIGKILL)
        out, _ = left.communicate(timeout=300)
    finally:
        for p in (left, victim):
            if p.poll() is None:
                p.kill()
        victim.wait()
    assert left.returncode == 0, out
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    lost = [e for e in events if e["event"] == "failure"]
    assert [(e["cause"], e["host"], e["devices"], e["dropped"]) for e in lost] == [("host lost", 1, ["cpu1"], True)]
    segments = [e for e in events if e["event"] == "segment"]
    assert [s["devices"] for s in segments] == [["cpu0", "cpu1"], ["cpu0"]] and events[-1]["event"] == "done"
    told = json.loads(Path(segments[1]["cluster"]).read_text())  # HPML_CLUSTER of the restart
    assert [(d["name"], d["host"]) for d in told["devices"]] == [("cpu0", "host0")]
    assert "segment 0: 2 rank(s) on cpu0,cpu1; from step 0" in out
    resumed = next(int(line.rsplit(" ", 1)[1]) for line in out.splitlines()
                   if line.startswith("segment 1: 1 rank(s) on cpu0; from step"))
    assert resumed in (4, 8)  # the last checkpoint before the kill (every 4 steps)
    last = latest(run / "checkpoints")
    assert last is not None and last.name == "step_00000012"
    _nothing_left(tmp_path, killed)
