"""Start gloo ranks on this machine for tests and benchmarks, with a deadline so that a deadlock fails.

Why not ``torch.multiprocessing.spawn(join=True)`` alone: it waits forever,
so one gloo deadlock hangs a CI job; :func:`spawn_ranks` joins with a
deadline, terminates the children and names the ranks still alive. Jobs of
users start with torchrun (:mod:`.launcher`), not this.

Why a fork server rather than ``spawn``: a spawned rank imports torch,
torch.distributed (with DTensor and sympy) and this package afresh, about 3 s
of CPU on a 2-core VM, which made start-up most of a small distributed test.
The fork server (one per process, started by the first call) imports them once;
each rank is forked from it and unpickles only its function, so a rank's CPU
before its first line fell from about 4.7 s to 0.2-1.5 s (by what its test
module imports). A rank is still a fresh process of its own (no state shared
with the caller); it gets the caller's environment, working directory and
``sys.path`` as of this call, as with spawn.

Example:
    >>> import tempfile
    >>> spawn_ranks(_hello, 2, tempfile.mkdtemp(), timeout_s=120)
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import time
from pathlib import Path
from typing import Any, Callable, Collection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ...errors import RanksTimeout
from ...hostmem import keep_freed_memory

__all__ = ["spawn_ranks", "RanksTimeout", "DEFAULT_TIMEOUT_S"]

# What the fork server imports once, so that each rank forked from it does not (about 5 s of CPU per rank on a
# 2-core VM): torch, this package, and what a rank's start no longer imports but a test's rank usually does:
# torch._dynamo (FakeTensorMode imports it, so every rank that traces or loads a build: ~2 s), DCP (checkpoints)
# and the driver with its solvers (ranks that compile).
_PRELOAD = ["torch", "torch.distributed", "hpml_compile", "hpml_compile.runtime", "torch._dynamo",
            "torch.distributed.checkpoint", "hpml_compile.driver"]
DEFAULT_TIMEOUT_S = 900.0  # generous: the longest dist test runs about a minute on two shared cores


def _entry(rank: int, fn: Callable[..., None], world_size: int, init: str, threads: int, args: tuple[Any, ...],
           environ: dict[str, str] | None = None) -> None:
    if environ is not None:  # the caller's environment now, not the fork server's (as of its start)
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(threads)  # ranks share the machine's cores
    keep_freed_memory()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():  # ``fn`` may have destroyed it (a test that re-forms its own groups)
            dist.destroy_process_group()


def _hello(rank: int, world_size: int) -> None:
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size, t


def _drop_killed(ctx: Any, may_die: Collection[int]) -> None:
    """Forget the ranks of ``may_die`` that a signal ended, so that joining the others does not count them failed."""
    for sentinel, index in list(ctx.sentinels.items()):
        p = ctx.processes[index]
        if index in may_die and p.exitcode is not None and p.exitcode < 0:
            ctx.sentinels.pop(sentinel)
            p.join()


def _join(ctx: Any, timeout: float, may_die: Collection[int]) -> bool:
    """``ctx.join(timeout)``, but a rank of ``may_die`` killed by a signal is not a failure."""
    if not may_die:
        return bool(ctx.join(timeout=timeout))
    multiprocessing.connection.wait(list(ctx.sentinels), timeout=timeout)
    _drop_killed(ctx, may_die)
    return bool(ctx.join(timeout=0))


def spawn_ranks(fn: Callable[..., None], world_size: int, workdir: str | Path, *args: Any, threads: int = 1,
                timeout_s: float = DEFAULT_TIMEOUT_S, start_method: str = "forkserver",
                may_die: Collection[int] = ()) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes on this machine.

    Args:
        fn: a module-level function (it is pickled to the children).
        world_size: number of ranks.
        workdir: a folder for the ``file://`` rendezvous (a fresh file in it; no port is opened).
        args: passed to ``fn`` after the rank and world size.
        threads: torch threads per rank.
        timeout_s: seconds all ranks together may take; then every child is terminated.
        start_method: ``forkserver`` (the default: children of a server that imported torch and this package
            once, so a rank starts in a fraction of a second and safe whatever the parent did), ``spawn`` (fresh
            interpreters, seconds each), or ``fork`` (children of
            this process: no second import of torch, a fraction of a second instead of seconds; for short
            probes on Linux, whose ranks run one torch thread, so no OpenMP pool is used after the fork).
        may_die: ranks that may end by a signal (a test that kills one) without failing the others: the rest
            go on and are joined as usual.

    Raises:
        torch.multiprocessing.ProcessRaisedException: if a rank fails (with its traceback).
        RanksTimeout: if ranks are still alive at the deadline (naming them).
    """
    path = Path(workdir).resolve() / f"rendezvous-{os.getpid()}-{id(fn)}"
    path.unlink(missing_ok=True)
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(_PRELOAD)  # read once, when the first call starts the server
    ctx = mp.start_processes(_entry, args=(fn, world_size, f"file://{path}", threads, args, dict(os.environ)),
                             nprocs=world_size, join=False, start_method=start_method)
    assert ctx is not None
    deadline = time.monotonic() + timeout_s
    while not _join(ctx, max(0.0, min(1.0, deadline - time.monotonic())), may_die):
        if time.monotonic() >= deadline:
            alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(timeout=10)
            raise RanksTimeout(f"ranks {alive} of {world_size} were still running {fn.__name__} after {timeout_s:g} s "
                               "(a deadlock between ranks?): they were terminated. Run the ranks' "
                               "action lists through hpml_compile.schedule_check.validate, or raise timeout_s")
