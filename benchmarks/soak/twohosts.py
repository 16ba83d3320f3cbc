"""The soak's two-host mode: each leg is two ``run --adapt`` agents (hosts) on this machine, one run folder.

Leg k starts host 0 and host 1 as ``hpml-compile run BUILD --adapt --nnodes 2
--node-rank H --rdzv-endpoint localhost:PORT --run-dir RUN --steps S_k`` (a
new port each leg; the same run folder, standing in for a shared file
system), so a host killed in one leg is back in the next: a new agent joins
the job, which goes on from its latest checkpoint on both hosts' devices.
Besides the one-host kinds (``kill``, ``hang``, ``slow``: the ``run``
options, given to both agents, on a global rank of the build), a leg may kill
a whole host: ``host0`` (the lead, which holds the job's store: host 1 takes
the decisions over) or ``host1``. The soak kills it itself, once the job's
rank 0 has logged the fault's step: SIGKILL to the agent and every process
under it, as a machine that loses power.

A leg survives when every agent that was not killed exits 0, the job logged
``done``, and the checkpoints hold (:func:`legs.check_leg`). A host kill
that comes too late (the leg ended first) is recorded as not hit.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import time
from pathlib import Path

import psutil

from hpml_compile.runtime.job.launcher import free_port
from legs import Leg, check_leg, leg_command, read_events, wait_launchers

KINDS = ("kill", "hang", "slow", "host0", "host1")
_POLL_S = 0.01


def agent_command(build: Path, run: Path, leg: Leg, host: int, endpoint: str, a: argparse.Namespace) -> list[str]:
    """Host ``host``'s line for ``leg``: the one-host leg's line across 2 hosts meeting at ``endpoint``."""
    return [*leg_command(build, run, leg, a.timeout), "--nnodes", "2", "--node-rank", str(host),
            "--rdzv-endpoint", endpoint, "--host-timeout", f"{a.host_timeout:g}"]


def job_step(run: Path, seen: int) -> int:
    """The last step (from 1) rank 0 logged in the newest segment started since event ``seen``; 0 if none yet."""
    segs = [e["segment"] for e in read_events(run)[seen:] if e["event"] == "segment"]
    if not segs:
        return 0
    path = run / f"seg{segs[-1]}" / "metrics" / "rank0.jsonl"
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    for line in reversed(lines):  # the last line may be half written
        try:
            return int(json.loads(line)["step"]) + 1
        except (ValueError, KeyError):
            continue
    return 0


def kill_host(pid: int) -> int:
    """SIGKILL the agent ``pid`` and every process under it (children first listed, all sent at once).

    Returns:
        How many processes were sent the signal.
    """
    try:
        agent = psutil.Process(pid)
        tree = [agent, *agent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for q in tree:
        try:
            q.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return len(tree)


def run_leg(build: Path, run: Path, logs: Path, leg: Leg, a: argparse.Namespace) -> None:
    """Advance the two-host job to ``leg.end`` with ``leg.fault`` injected (a host kill by this process); check
    processes, checkpoints and steps after, as on one host."""
    seen = len(read_events(run))
    endpoint = f"localhost:{free_port()}"
    fault = leg.fault
    doomed = fault.rank if fault is not None and fault.kind.startswith("host") else None
    outs = [(logs / f"leg{leg.leg:03d}-host{h}.log").open("w") for h in (0, 1)]
    leg.log = str(logs / f"leg{leg.leg:03d}-host0.log")
    t0 = time.perf_counter()
    deadline = time.monotonic() + a.leg_limit
    try:
        agents = []
        for h, out in enumerate(outs):
            cmd = agent_command(build, run, leg, h, endpoint, a)
            out.write(" ".join(cmd) + "\n")
            out.flush()
            agents.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        leg.launcher_pid = agents[0].pid
        leg.launchers = [q.pid for q in agents]
        if doomed is not None:
            leg.hit = _kill_when_due(run, seen, leg, agents, doomed, deadline)
        rcs = wait_launchers(agents, deadline, leg)
    finally:
        for out in outs:
            out.close()
    leg.wall_s = time.perf_counter() - t0
    kept = [rc for h, rc in enumerate(rcs) if h != doomed or not leg.hit]
    leg.rc = next((rc for rc in kept if rc != 0), 0)
    leg.did.insert(0, f"host rc {'/'.join(map(str, rcs))}")
    check_leg(run, leg, seen, [p.pid for p in agents], all(rc == 0 for rc in kept))


def _kill_when_due(run: Path, seen: int, leg: Leg, agents: list[subprocess.Popen[bytes]], host: int,
                   deadline: float) -> bool:
    """Wait until the job's rank 0 logged ``leg.fault.step`` (or later), then kill host ``host``.

    Returns:
        Whether the host was killed (False: the agents ended, or the leg's time ran out, first).
    """
    assert leg.fault is not None
    while time.monotonic() < deadline and all(p.poll() is None for p in agents):
        step = job_step(run, seen)
        if step >= leg.fault.step:
            n = kill_host(agents[host].pid)
            leg.did.append(f"host {host} killed at step {step} ({n} processes)")
            return True
        time.sleep(_POLL_S)
    leg.did.append(f"host {host} NOT killed: the job ended before step {leg.fault.step}")
    return False
