"""``hpml-compile launch``: run a user's own training script on every rank, as torchrun does, and restart it.

For users who own their loop: their script calls ``hpml_compile.compile(...)``,
loads its latest checkpoint at start (``pipe.load(dir, missing_ok=True)``)
and saves now and then (``pipe.save(dir)``). ``launch`` starts it on ``N``
local ranks with torchrun (``python -m torch.distributed.run --standalone``)
and, when a rank fails, starts it again from the last checkpoint:

- without ``adapt``: on as many ranks as before, whatever the failure (as
  torchrun's ``--max-restarts`` would), at most ``max_failures`` times;
- with ``adapt`` (``launch --adapt``): a rank that *died* (killed by a
  signal) is taken to have lost its device; the device is dropped and the
  next start has one rank fewer, with ``HPML_CLUSTER`` naming the devices
  left, so the script's ``compile`` re-plans for them and its ``load``
  resumes there (checkpoints are regrouped by parameter name under any
  plan). A rank that failed otherwise is restarted on as many ranks, at most
  ``max_failures`` times in all. Every start and failure is a line of
  ``RUN_DIR/events.jsonl``.

The contract, through the environment of every rank (each start is a
*segment* ``k``):

- ``HPML_CLUSTER``: the cluster to compile for (``local-cpu-<ranks>``);
- ``HPML_CHECKPOINT_DIR``: where to save and load checkpoints (the same for
  every segment);
- ``HPML_RUN_DIR``: this segment's run folder (``RUN_DIR/seg<k>``; give it to
  ``compile(run_dir=...)`` for the per-step measurements);
- ``HPML_SEGMENT``: ``k``, from 0.

Each rank runs the script through :mod:`.script_entry`, which ends the rank
when its launcher (this process, or torchrun's agent) is gone, SIGKILL
included (:mod:`.lifeline`): a killed launch leaves no rank running.

Across hosts (:func:`launch_hosts`: ``launch --adapt --nnodes N --node-rank
R --rdzv-endpoint HOST:PORT --run-dir SHARED`` on each host) the hosts'
machinery is ``run --adapt``'s (:mod:`.multihost`: the job's store at the
endpoint, one decider, a silent host lost, host 0 taken over by the next);
:class:`ScriptWork` is what is ``launch``'s own. Each segment is one torchrun
launch of the script per host taking part, ``--nproc`` ranks each at first,
and host ``h`` holds the devices ``cpu<h x nproc> ..`` of the job. A lost
host's devices, and a dead rank's, are dropped; ``HPML_CLUSTER`` is then a
``cluster.json`` in the segment's folder naming the devices left and the
host of each, so the script's ``compile`` plans for exactly those. The run
folder, and the checkpoint folder, must be one that every host mounts (the
hosts left resume from checkpoints a lost host helped write).

What this does not do (said here so that nobody counts on it): re-plan on a
measured imbalance, even with ``adapt`` (the script's step times are
measured by its Pipeline, but nothing here reads them; ``run --adapt`` does
re-plan on imbalance, for builds of a model file or TrainSpec). Writing the
re-planning into the supervisor rather than into the script is deliberate:
the script stays an ordinary torchrun script.

Example:
    >>> died_ranks("[0]:\\n  rank      : 1 (local_rank: 1)\\n  exitcode  : -9 (pid: 12)\\n[1]:\\n  rank : 0\\n"
    ...            "  exitcode : 1")
    [1]
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ...cluster import usable_memory_gib
from ...errors import HpmlError, SupervisorError
from ...ir import Cluster, Device
from ...schema import write_json_atomic
from ..observe.runfolder import RunFolder
from .hostranks import died
from .hosts import LOST_AFTER_S
from .launcher import SCRIPT_ENTRY, LaunchSpec, launch
from .lifeline import mark_launcher
from .multihost import HostWork, host_job

__all__ = ["launch_script", "launch_hosts", "ScriptWork", "died_ranks", "ENV_CLUSTER", "ENV_CHECKPOINT_DIR",
           "ENV_RUN_DIR", "ENV_SEGMENT"]

ENV_CLUSTER, ENV_CHECKPOINT_DIR, ENV_RUN_DIR, ENV_SEGMENT = ("HPML_CLUSTER", "HPML_CHECKPOINT_DIR", "HPML_RUN_DIR",
                                                             "HPML_SEGMENT")
_KILLED = {-9, 137}  # -15 (SIGTERM) is torchrun stopping the others after a failure
_BLOCK = re.compile(r"\n\s*\[\d+\]:")
_RANK = re.compile(r"\brank\s*:\s*(\d+)")
_CODE = re.compile(r"\bexitcode\s*:\s*(-?\d+)")


def died_ranks(torchrun_stderr: str) -> list[int]:
    """The ranks torchrun's failure summary reports as killed (SIGKILL, exit -9, or 137 as a killed process reports)."""
    dead = set()
    for block in _BLOCK.split("\n" + torchrun_stderr):
        rank, code = _RANK.search(block), _CODE.search(block)
        if rank and code and int(code.group(1)) in _KILLED:
            dead.add(int(rank.group(1)))
    return sorted(dead)


def launch_script(script: Path, script_args: Sequence[str], *, nproc: int, run_dir: Path, checkpoint_dir: Path,
                  max_failures: int = 2, adapt: bool = False, timeout_s: float | None = None,
                  log: Callable[[str], None] = print) -> int:
    """Run ``script`` on ``nproc`` local ranks until it succeeds, restarting it after failures.

    Args:
        script: the user's training script.
        script_args: its arguments.
        nproc: ranks of the first segment.
        run_dir: the job's folder (segments in ``seg<k>``).
        checkpoint_dir: the checkpoint folder every segment is told about.
        max_failures: restarts after failures (with ``adapt``: failures that killed no rank).
        adapt: drop a dead rank's device and re-plan for the devices left (see the module docstring).
        timeout_s: seconds each segment may take (None: no limit).
        log: progress lines.

    Returns:
        The number of segments it took.

    Raises:
        HpmlError: the script is missing, or ``nproc`` is below 1.
        SupervisorError: every rank is gone, or too many failures (the last checkpoint is named).
    """
    if not script.is_file():
        raise HpmlError(f"launch: {script} does not exist; pass the training script to run on every rank")
    if nproc < 1:
        raise HpmlError(f"launch: --nproc {nproc}: expected 1 or more ranks")
    failures, segment, ranks = 0, 0, nproc
    run_dir.mkdir(parents=True, exist_ok=True)
    run = RunFolder(run_dir)

    def event(kind: str, **fields: object) -> None:  # one line per record, appended
        run.append_event({"event": kind, "time": time.time(), **fields})

    while True:
        seg = run_dir / f"seg{segment}"
        seg.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, ENV_CLUSTER: f"local-cpu-{ranks}", ENV_CHECKPOINT_DIR: str(checkpoint_dir),
               ENV_RUN_DIR: str(seg), ENV_SEGMENT: str(segment)}
        mark_launcher(env)  # each rank exits when this process or torchrun's agent is gone (.script_entry)
        log(f"launch: segment {segment}: {script.name} on {ranks} rank(s) ({env[ENV_CLUSTER]}); checkpoints in "
            f"{checkpoint_dir}")
        event("segment", segment=segment, ranks=ranks, cluster=env[ENV_CLUSTER], adapt=adapt)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(SCRIPT_ENTRY), str(script), *script_args]
        proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=timeout_s)
        (seg / "torchrun.stderr").write_text(proc.stderr)
        if proc.returncode == 0:
            event("done", segment=segment)
            log(f"launch: done in {segment + 1} segment(s)")
            return segment + 1
        dead = died_ranks(proc.stderr)
        tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
        if dead and adapt:
            ranks -= len(dead)
            event("failure", segment=segment, ranks=dead, cause="died", dropped=True, ranks_left=ranks)
            log(f"launch: segment {segment}: rank(s) {dead} died; re-planning for the {ranks} left "
                f"(local-cpu-{ranks}) and restarting from the last checkpoint")
            if ranks < 1:
                raise SupervisorError(f"launch: every rank is gone; the last checkpoint is in {checkpoint_dir}")
        else:
            failures += 1
            cause = f"rank(s) {dead} died" if dead else f"exit {proc.returncode}"
            event("failure", segment=segment, ranks=dead, cause="died" if dead else "failed", dropped=False,
                  ranks_left=ranks)
            log(f"launch: segment {segment} failed ({cause}): {tail}; restarting on {ranks} rank(s)")
            if failures > max_failures:
                raise SupervisorError(f"launch: {failures} failures (more than --max-failures {max_failures}); "
                                      f"the last checkpoint is in {checkpoint_dir}; see {seg / 'torchrun.stderr'}")
        segment += 1


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while torchrun starts the ranks (its agent passes its own on)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ScriptWork(HostWork):
    """``launch --adapt`` across hosts: each segment runs the script on the devices left (see the module docstring).

    Args:
        script: the user's training script (on this host: each host passes its own path).
        script_args: its arguments.
        run_dir: the job's folder, the same on every host.
        checkpoint_dir: the checkpoint folder every segment is told about (shared too).
        nproc: ranks per host at the start (each host's RAM is shared by its ranks' devices).
        max_failures: restarts after failures that killed no rank.
        log: progress lines.
    """

    def __init__(self, script: Path, script_args: Sequence[str], run_dir: Path, checkpoint_dir: Path, *,
                 nproc: int, max_failures: int, log: Callable[[str], None]) -> None:
        super().__init__(run_dir, log)
        self.script, self.script_args, self.checkpoint_dir = script, list(script_args), checkpoint_dir
        self.nproc, self.max_failures, self.failures = nproc, max_failures, 0
        self.devices: list[str] = []

    def first_devices(self, nnodes: int, nproc: int) -> list[str]:
        self.devices = [f"cpu{i}" for i in range(nnodes * nproc)]
        return list(self.devices)

    def begin(self, seg: int, held: dict[int, list[str]]) -> tuple[list[str], dict[str, Any]]:
        seg_dir = self.run.segment(seg).path
        seg_dir.mkdir(parents=True, exist_ok=True)
        host_of = {d: h for h, ds in held.items() for d in ds}
        gib = round(usable_memory_gib() / self.nproc, 3)  # as local-cpu-N: a host's ranks share its RAM
        cluster = Cluster(tuple(Device(d, "cpu", gib, host=f"host{host_of[d]}") for d in self.devices),
                          name=f"launch-cpu-{len(self.devices)}")
        path = write_json_atomic(cluster.to_dict(), seg_dir / "cluster.json")
        hosts = sorted({host_of[d] for d in self.devices})
        self.job.event("segment", segment=seg, reason=self.reason, devices=self.devices, cluster=str(path),
                       ranks=len(self.devices), adapt=True)
        self.job.log(f"launch: segment {seg} ({self.reason}): {self.script.name} on {len(self.devices)} rank(s) of "
                     f"{len(hosts)} host(s) ({', '.join(self.devices)}); checkpoints in {self.checkpoint_dir}")
        return list(self.devices), {"cluster": str(path)}

    def part(self, go: dict[str, Any], seg: int, node: int, nnodes: int) -> None:
        seg_dir = self.run.segment(seg).path
        env = {ENV_CLUSTER: go["cluster"], ENV_CHECKPOINT_DIR: str(self.checkpoint_dir), ENV_RUN_DIR: str(seg_dir),
               ENV_SEGMENT: str(seg)}
        with _environ(env):
            launch(LaunchSpec(self.script, seg_dir, go["nproc"][node], nnodes=nnodes, node_rank=node,
                              rdzv_endpoint=go["endpoint"], program=(str(self.script), *self.script_args)))

    def _drop(self, gone: list[str]) -> None:
        self.devices = [d for d in self.devices if d not in gone]
        if not self.devices:
            raise SupervisorError(f"launch: every device is gone; the last checkpoint is in {self.checkpoint_dir}")

    def hosts_lost(self, seg: int, lost: list[int], held: dict[int, list[str]], lost_after_s: float) -> None:
        for h in lost:
            self.job.event("failure", segment=seg, host=h, devices=held[h], device=", ".join(held[h]),
                           cause="host lost", message=f"host {h} stopped beating for {lost_after_s:g} s",
                           detected_at=time.time(), dropped=True)
            self.job.log(f"launch: segment {seg}: host {h} lost (its devices {', '.join(held[h])}); dropping them")
        self._drop([d for h in lost for d in held[h]])
        self.reason = f"host(s) {', '.join(map(str, lost))} lost"

    def failed(self, seg: int, failures: dict[int, tuple[int, str]]) -> None:
        dead = sorted(r for r, (code, _) in failures.items() if died(code))
        if dead:
            gone = [self.devices[r] for r in dead]
            self.job.event("failure", segment=seg, ranks=dead, devices=gone, cause="died", dropped=True,
                           ranks_left=len(self.devices) - len(gone))
            self.job.log(f"launch: segment {seg}: rank(s) {dead} died; dropping {', '.join(gone)}")
            self._drop(gone)
            self.reason = f"{', '.join(gone)} lost"
            return
        self.failures += 1
        self.job.event("failure", segment=seg, ranks=sorted(failures), cause="failed", dropped=False,
                       ranks_left=len(self.devices))
        if self.failures > self.max_failures:
            raise SupervisorError(f"launch: {self.failures} failures (more than --max-failures {self.max_failures});"
                                  f" the last checkpoint is in {self.checkpoint_dir}; see the ranks' output above")
        self.reason = "restart after a failure"

    def finished(self, seg: int) -> bool:
        self.job.event("done", segment=seg)
        self.job.log(f"launch: done in {seg + 1} segment(s)")
        return True

    def resume(self, segments: list[dict[str, Any]]) -> None:
        self.devices = list(segments[-1]["devices"])


def launch_hosts(script: Path, script_args: Sequence[str], *, nproc: int, run_dir: Path, checkpoint_dir: Path,
                 host: int, nnodes: int, endpoint: str, max_failures: int = 2, lost_after_s: float = LOST_AFTER_S,
                 log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """``launch --adapt`` on host ``host`` of ``nnodes``: the script on ``nproc`` ranks here, the job across all.

    Args:
        script: the user's training script.
        script_args: its arguments.
        nproc: ranks per host at the start.
        run_dir: the job's folder, the same on every host (a shared file system).
        checkpoint_dir: the checkpoint folder, shared too.
        host: this host's rank 0..nnodes-1 (host 0 holds the job's store at ``endpoint`` and decides).
        nnodes: the hosts.
        endpoint: ``HOST:PORT`` of host 0.
        max_failures: restarts after failures that killed no rank.
        lost_after_s: silence after which a host is lost.
        log: progress lines.

    Returns:
        The job's events on the host that decided last; [] on the others.

    Raises:
        HpmlError: the script is missing, or ``nproc`` is below 1.
        SupervisorError: the run folder is not shared, every device is gone, or too many failures.
    """
    if not script.is_file():
        raise HpmlError(f"launch: {script} does not exist; pass the training script to run on every rank")
    if nproc < 1:
        raise HpmlError(f"launch: --nproc {nproc}: expected 1 or more ranks")
    work = ScriptWork(script, script_args, run_dir, checkpoint_dir, nproc=nproc, max_failures=max_failures, log=log)
    return host_job(work, host=host, nnodes=nnodes, nproc=nproc, endpoint=endpoint, lost_after_s=lost_after_s,
                    log=log)
