"""A rank dies with the process that launched it, however that process ends.

torchrun's agent starts every worker in a session of its own, so a launcher
killed with SIGKILL (``timeout -s KILL``, the OOM killer, a closed terminal
under ``nohup``) leaves its ranks running with parent PID 1: they go on
training and writing checkpoints that race any later ``--resume``. torchrun
stops its workers on SIGTERM and SIGINT, but nothing can run in a process
that receives SIGKILL, so the ranks must notice by themselves.

Why a watcher thread and not ``prctl(PR_SET_PDEATHSIG)``: the death signal
fires when the *thread* that forked the child exits, not the process, and
torchrun's agent is free to start workers from any thread; a poll of the
parent PID is portable, costs one system call every ``interval_s``, and
cannot fire while the launcher lives. The launcher writes its PID into the
environment (:func:`mark_launcher`); each rank calls :func:`watch_launcher`
at start (a build's worker itself; a user's script under ``hpml-compile
launch`` through :mod:`.script_entry`, which starts the watch and then runs it), which exits the rank (``os._exit``, no cleanup that could block on
a dead peer) as soon as its parent is no longer the process it started under
or the launcher's PID is gone. Checkpoints are published atomically, so a
rank that dies mid-write leaves the previous one whole.
(:mod:`.rank_entry` makes a rank that torchrun stops with SIGINT or SIGTERM
end without a traceback.)

Example:
    >>> import os
    >>> env = {}
    >>> mark_launcher(env)
    >>> int(env[LAUNCHER_PID_ENV]) == os.getpid()
    True
    >>> launcher_alive(os.getpid(), os.getppid())
    True
"""

from __future__ import annotations

import os
import sys
import threading
from typing import MutableMapping

__all__ = ["LAUNCHER_PID_ENV", "LAUNCHER_GONE_EXIT", "mark_launcher", "launcher_alive", "watch_launcher"]

LAUNCHER_PID_ENV = "HPML_LAUNCHER_PID"
LAUNCHER_GONE_EXIT = 75  # EX_TEMPFAIL: the job was stopped from outside, not by the rank


def mark_launcher(env: MutableMapping[str, str] = os.environ) -> None:
    """Record this process as the launcher of the ranks it starts (children inherit ``env``)."""
    env[LAUNCHER_PID_ENV] = str(os.getpid())


def _exists(pid: int) -> bool:
    """Whether ``pid`` is a live process: a killed launcher its parent has not yet reaped (a zombie) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:  # Linux: the state follows the command's closing parenthesis
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc (macOS): a signal's answer is all there is
        return True


def launcher_alive(launcher: int, parent: int) -> bool:
    """True while this process still has the parent it started with and the launcher's PID exists.

    Args:
        launcher: the launcher's PID (from the environment).
        parent: this process's parent PID when it started.
    """
    return os.getppid() == parent and _exists(launcher)


def watch_launcher(interval_s: float = 0.25, *, rank: int | None = None) -> threading.Thread | None:
    """Exit this process soon after its launcher is gone; a no-op outside a launch.

    Args:
        interval_s: how often to look.
        rank: named in the one line printed on exit.

    Returns:
        The daemon thread watching, or None when no launcher is recorded in the environment.
    """
    want = os.environ.get(LAUNCHER_PID_ENV, "")
    if not want.isdigit():
        return None
    launcher, parent = int(want), os.getppid()
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval_s):
            if not launcher_alive(launcher, parent):
                who = f"rank {rank}" if rank is not None else f"process {os.getpid()}"
                try:
                    print(f"hpml-compile: the launcher (pid {launcher}) is gone; {who} stops", file=sys.stderr,
                          flush=True)
                except (OSError, ValueError):  # stderr was a pipe to the dead launcher (or is closed): exit all the same
                    pass
                os._exit(LAUNCHER_GONE_EXIT)

    t = threading.Thread(target=watch, name="hpml-launcher-watch", daemon=True)
    t.start()
    return t


