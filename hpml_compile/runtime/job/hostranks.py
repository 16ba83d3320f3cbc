"""Start one host's ranks without torchrun's agent, so that a lost replica does not stop the others.

``hpml-compile run BUILD --adapt`` on one host starts each segment's ranks
here (:func:`launch_here`); every other launch, ``--adapt`` across hosts
included, goes through torchrun (:mod:`.launcher`), whose elastic agent and
c10d rendezvous store join the hosts.

Why not torchrun on one host: its agent watches its workers as one group
and, when one exits with an error, stops all of them (the process context's
poll closes every process on the first failure) before it restarts or gives
up. The survivors of a lost data-parallel replica can go on in their own
processes (a live session: :mod:`hpml_compile.runtime.execute.members`), but
only if nothing kills them. On one host torchrun's agent does two things
for a job: it starts the processes and it hosts the store they rendezvous on.
This module does the same two, and no more:

- the store is a ``TCPStore`` in this process (as torchrun's agent hosts
  its own: ``TORCHELASTIC_USE_AGENT_STORE``), so it outlives any rank;
- each rank is ``python rank_entry.py BUILD RUN_DIR`` with torchrun's
  environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``...), so the worker cannot tell the difference; its options
  say ``live`` (:class:`~.options.RunOptions`), so it opens a live session.

While they run, a rank that *dies* (a signal, or the drills' exit 137) is
recorded as lost and the others are left alone: they agree who is left, take
its rows and run the failed step again (:meth:`~hpml_compile.runtime.execute.pipeline.Pipeline.step`).
When they cannot (the lost rank was its stage's only replica, or held state
the others lack), they fail with a message that says so, and that failure is
handled as torchrun's would be: every rank still running is stopped
(SIGTERM, recorded as exit ``-15`` as torchrun records it) and
:class:`~hpml_compile.errors.RankFailure` names them all, the dead ones
first, for the supervisor's restart path. A rank that fails any other way
(an error, a time-out) stops the job at once, as under torchrun.

The launch stops every rank on SIGINT and SIGTERM, and each rank exits by
itself when this process is gone (:mod:`.lifeline`): no process is left.

Example:
    >>> rank_env(2, 3, "127.0.0.1", 29500)["RANK"], rank_env(2, 3, "127.0.0.1", 29500)["LOCAL_WORLD_SIZE"]
    ('2', '3')
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Callable, Iterator

from ...errors import RankFailure
from ..observe.monitor import metrics_path
from .launcher import RANK_ENTRY, explain_failure, stopped
from .lifeline import mark_launcher
from .loop import KILLED_EXIT
from .worker import threads_per_rank

__all__ = ["LostRank", "launch_here", "rank_env", "died"]

_SIGTERM_CODE = -15  # what torchrun records for the ranks it stopped after a failure
POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class LostRank:
    """A rank that died while the others went on without it, in the same processes.

    Attributes:
        rank: its rank in the launch (the plan's numbering when it started).
        code: its exit code (negative: the signal that ended it).
        died_at: when this process saw it gone (epoch seconds).
        steps_done: the steps it had completed (its step ``steps_done + 1`` failed and runs again on the others).
        pids: the process of each rank of the launch (the survivors kept theirs).
        resumed_at: when a survivor had completed that step (epoch seconds), or None when none did.
    """

    rank: int
    code: int
    died_at: float
    steps_done: int
    pids: tuple[int, ...] = ()
    resumed_at: float | None = None


def died(code: int) -> bool:
    """Whether exit code ``code`` is a death (a signal other than the SIGTERM a launcher stops ranks with, or the
    drills' 137): the rank's device is lost, and its peers may go on without it."""
    return code == KILLED_EXIT or (code < 0 and code != _SIGTERM_CODE)


def rank_env(rank: int, world: int, addr: str, port: int) -> dict[str, str]:
    """The environment torchrun gives a rank on one host, for rank ``rank`` of ``world`` and the store at
    ``addr:port`` (hosted by the launcher: the ranks are its clients)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": addr, "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_RUN_ID": "hpml-compile", "TORCHELASTIC_MAX_RESTARTS": "0"}


def _lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for line in f if line.endswith(b"\n"))
    except FileNotFoundError:
        return 0


@contextlib.contextmanager
def _stop_on_sigterm(seen: list[int]) -> Iterator[None]:
    """SIGTERM to this process stops the ranks as Ctrl-C does (``seen`` gets it; default handling would leave the
    ranks to their lifeline)."""
    def handler(signum: int, _frame: FrameType | None) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class _Ranks:
    """The processes of one launch and what became of them."""

    def __init__(self, build: Path, run_dir: Path, nproc: int, port: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_rank(nproc)))}
        mark_launcher(env)
        self.run_dir = run_dir
        self.procs = [subprocess.Popen([sys.executable, str(RANK_ENTRY), str(build), str(run_dir)],
                                       env={**env, **rank_env(r, nproc, "127.0.0.1", port)}, stdin=subprocess.DEVNULL)
                      for r in range(nproc)]
        self.lost: dict[int, LostRank] = {}
        self.stopped: set[int] = set()

    def codes(self) -> dict[int, int | None]:
        return {r: p.poll() for r, p in enumerate(self.procs)}

    def lose(self, rank: int, code: int) -> None:
        steps = _lines(metrics_path(self.run_dir, rank))
        self.lost[rank] = LostRank(rank, code, time.time(), steps, tuple(p.pid for p in self.procs))

    def note_resumed(self) -> None:
        """Mark each lost rank resumed once a survivor has a row for the step it failed in."""
        for r, lost in self.lost.items():
            if lost.resumed_at is None and any(_lines(metrics_path(self.run_dir, s)) > lost.steps_done
                                               for s in range(len(self.procs)) if s not in self.lost):
                self.lost[r] = dataclasses.replace(lost, resumed_at=time.time())

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM to every rank still running, then SIGKILL after ``grace_s``; every process reaped."""
        for r, p in enumerate(self.procs):
            if p.poll() is None:
                self.stopped.add(r)
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def failures(self) -> dict[int, tuple[int, str]]:
        out: dict[int, tuple[int, str]] = {}
        for r, p in enumerate(self.procs):
            code = p.returncode
            if r in self.stopped:
                out[r] = (_SIGTERM_CODE, "stopped after another rank failed")
            elif code:
                out[r] = (code, f"exit code {code}" if code > 0 else f"killed by signal {-code}")
        return out


def launch_here(build: Path, run_dir: Path, nproc: int, *, live: bool = True,
                on_loss: Callable[[LostRank], None] | None = None) -> list[LostRank]:
    """Run ``nproc`` ranks of ``build`` on this host (see the module docstring); return when all have finished.

    Args:
        build: the build folder.
        run_dir: the run folder (its ``run.json`` holds the ranks' options, ``live`` among them).
        nproc: ranks to start.
        live: a rank that dies leaves the others running (they go on without it, or fail saying why); False: the
            first failure of any kind stops every rank, as torchrun does.
        on_loss: called when a rank is found dead and the others are left to go on.

    Returns:
        The ranks lost while the others went on and finished (empty when none died).

    Raises:
        RankFailure: a rank failed (naming the first, and every rank that failed or was stopped), lost ranks included.
        KeyboardInterrupt, SystemExit: stopped by SIGINT or SIGTERM (every rank stopped first).
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, nproc, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    ranks: _Ranks | None = None
    seen: list[int] = []
    try:
        with _stop_on_sigterm(seen):
            ranks = _Ranks(build, run_dir, nproc, store.port)
            return _watch(ranks, live, on_loss)
    except KeyboardInterrupt:
        if ranks is not None:
            ranks.stop_all()
        stopped(seen[0] if seen else signal.SIGINT, run_dir)
    finally:
        if ranks is not None:
            ranks.stop_all()  # nothing is left running, whatever ended the watch
        del store


def _watch(ranks: _Ranks, live: bool, on_loss: Callable[[LostRank], None] | None) -> list[LostRank]:
    """Wait for the ranks; the lost ones, or RankFailure."""
    while True:
        codes = ranks.codes()
        for r, code in codes.items():
            if not code or r in ranks.lost:
                continue
            alive = [s for s, c in codes.items() if c is None]
            if live and died(code) and alive:
                ranks.lose(r, code)
                if on_loss is not None:
                    on_loss(ranks.lost[r])
                continue
            ranks.stop_all()
            failures = ranks.failures()
            raise RankFailure(explain_failure(ranks.run_dir, failures), failures)
        if ranks.lost:
            ranks.note_resumed()
        if all(c is not None for c in codes.values()):
            return sorted(ranks.lost.values(), key=lambda x: x.died_at)
        time.sleep(POLL_S)
