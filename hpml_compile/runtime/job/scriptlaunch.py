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

What this does not do (said here so that nobody counts on it): re-plan on a
measured imbalance, even with ``adapt`` (the script's step times are
measured by its Pipeline, but nothing here reads them; ``run --adapt`` does
re-plan on imbalance, for builds of a model file or TrainSpec), or run across
hosts. Writing the re-planning into the supervisor rather than into the
script is deliberate: the script stays an ordinary torchrun script.

Example:
    >>> died_ranks("[0]:\\n  rank      : 1 (local_rank: 1)\\n  exitcode  : -9 (pid: 12)\\n[1]:\\n  rank : 0\\n"
    ...            "  exitcode : 1")
    [1]
"""

from __future__ import annotations

import os
import re
import time
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

from ...errors import HpmlError, SupervisorError
from ..observe.runfolder import RunFolder

__all__ = ["launch_script", "died_ranks", "ENV_CLUSTER", "ENV_CHECKPOINT_DIR", "ENV_RUN_DIR", "ENV_SEGMENT"]

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
        log(f"launch: segment {segment}: {script.name} on {ranks} rank(s) ({env[ENV_CLUSTER]}); checkpoints in "
            f"{checkpoint_dir}")
        event("segment", segment=segment, ranks=ranks, cluster=env[ENV_CLUSTER], adapt=adapt)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(script), *script_args]
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
