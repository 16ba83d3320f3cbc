"""How much slower a CPU rank's blocks run while the host's other ranks run theirs, timed as the ranks run.

CPU ranks of one host compute at the same time, each on its own core with its own copy of the weights, and
share the last-level cache, the memory bandwidth and the scheduler. A profile that times the blocks alone does
not see that: on the 2-core development VM mlp's forward and backward ran 1.10-1.14x slower beside a second
process running the same model, gpt-mini's 1.02x, while the stream rates
(:func:`hpml_compile.profile.timing.time_streams`) predicted less. :func:`time_corun` measures it.

The neighbours run as the real ranks do: forked processes, one torch thread each as this one, the same graph
on their own copies of the parameters, and before every pass a gloo all-reduce of the gradients' size over
all of them and this process (the gradient sync of a data-parallel step), so that every process starts its
forward at the same moment, as the ranks do after each sync, and gloo's threads run where they run in a step.
A rank's forward and backward in a run are wall-clock times; on CPU time alone, the demo's blocks beside a
second process read x1.04 on the 2-core development VM, where its two ranks ran them at x1.08 (a time slice
lost to a thread of the job is wall-clock time, not CPU time). So both clocks are read, and the wall clock's ratio is
kept where other programs kept less than :data:`QUIET_OTHERS` of a core busy while timing; on a busy host
the wall clock's ratio is the other programs' share more than the neighbours' (the demo's gpt-mini-sized
byte LM at 2 rows on the 2-core VM, other programs keeping 1.4-1.9 of its cores busy: wall-clock ratios of
0.3-16 in seven profiles, CPU-time ratios of 0.97-1.14 in fifteen), and the CPU time's is kept.

Each round's ratio is the *mean* pass with the neighbours over the median pass alone (alone: the neighbours
stopped by ``SIGSTOP`` where they wait in the all-reduce, as the profile's own per-block costs are medians of
passes alone), so that what contention adds to the tail of the passes is in the figure: the step the
report measures is near the sum of its parts' means. The rounds' median is returned.

Why fork and not a library: the neighbours must run this very graph, which may not pickle, on copies of its
parameters (separate memory, as separate ranks have; a forked copy reading the parent's pages would share
their cache lines). Each neighbour copies them, dies with this process (``PR_SET_PDEATHSIG``) and gives up
after ``start_timeout_s`` plus ten minutes whatever happens; all are killed and reaped before
:func:`time_corun` returns. The all-reduce group is gloo's own
(``torch.distributed.ProcessGroupGloo`` over a ``FileStore`` in a temporary folder), not the default process
group, which this process may hold for a job of its own.

Example:
    >>> import torch
    >>> from hpml_compile.trace import trace
    >>> gm = trace(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()), (torch.randn(4, 32),))
    >>> time_corun(gm, (torch.randn(4, 32),), [["_0"], ["_1"]], neighbours=0)
    {'skipped': 'no other core'}
"""

from __future__ import annotations

import contextlib
import datetime
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .timing import Timer, time_segments

__all__ = ["time_corun", "fork_neighbours", "QUIET_OTHERS"]

QUIET_OTHERS = 0.25  # cores other programs kept busy while timing, below which the wall clock's ratio is kept
_NEIGHBOUR_PASSES = 50  # passes a neighbour runs per call of its work (it runs until it is killed)

Totals = list[tuple[float, float]]  # per timed pass: (forward, backward) ms over every block


class _Clocks(Timer):
    """A CPU timer whose calls return the wall clock and keep this process's CPU time too (``cpu``, in order)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.cpu: list[float] = []

    def once(self, fn: Callable[[], Any]) -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        with self.context():
            fn()
        t1, c1 = time.perf_counter(), time.process_time()
        self.cpu.append((c1 - c0) * 1e3)
        return (t1 - t0) * 1e3


def _pass_totals(samples: list[tuple[list[float], list[float]]], cpu: Sequence[float], passes: int,
                 warmup: int) -> tuple[Totals, Totals]:
    """``(wall, cpu)`` totals per timed pass from :func:`time_segments`'s ``samples`` and the CPU times of its
    calls in order (each pass times every block's forward, then the backwards that run, the same ones each
    pass)."""
    wall = [(sum(f[k] for f, _ in samples), sum(b[k] for _, b in samples)) for k in range(passes)]
    calls = len(cpu) // (warmup + passes) if warmup + passes else 0
    n = len(samples)
    own = [cpu[k * calls:(k + 1) * calls] for k in range(warmup, warmup + passes)]
    return wall, [(sum(row[:n]), sum(row[n:])) for row in own]


def _ratio(together: Totals, before: Totals, after: Totals) -> list[float]:
    """``[forward, backward]``: the mean pass with the neighbours over the median pass alone (before and after)."""
    out = []
    for i in (0, 1):
        alone = (statistics.median(t[i] for t in before) + statistics.median(t[i] for t in after)) / 2
        out.append(statistics.fmean(t[i] for t in together) / alone if alone > 0 else 1.0)
    return out


def time_corun(gm: fx.GraphModule, example_inputs: Sequence[Any], groups: Sequence[Sequence[str]], *,
               neighbours: int, passes: int = 7, warmup: int = 1, rounds: int = 5,
               start_timeout_s: float = 60.0) -> dict[str, Any]:
    """How much slower the blocks run in sequence on a CPU while ``neighbours`` other processes run them too, each
    pass after an all-reduce over all of them (see the module docstring).

    The neighbours are started once; the blocks are timed (:func:`~hpml_compile.profile.timing.time_segments`)
    alone, then with them, alternately, ``rounds`` times.

    Args:
        gm: the traced model, on the CPU.
        example_inputs: its inputs.
        groups: the segments' node names, as for :func:`~hpml_compile.profile.timing.time_segments`.
        neighbours: processes running beside this one (1 on a 2-core host).
        passes: timed passes per measurement.
        warmup: untimed passes before each.
        rounds: measurements with the neighbours, each between two alone.
        start_timeout_s: how long to wait for the neighbours to be running (and for each all-reduce).

    Returns:
        ``{"fwd": ratio, "bwd": ratio, "ranks": neighbours + 1, "rounds": [[fwd, bwd], ...], "clock": "wall" or
        "cpu", "wall": [fwd, bwd], "cpu": [fwd, bwd], "others": share}`` (``rounds``, ``fwd`` and ``bwd`` on the
        clock kept; ``others``: the mean number of the host's cores other programs kept busy while timing), or
        ``{"skipped": why}`` (no neighbours asked, no ``fork`` on this platform, a neighbour did not start).

    Raises:
        RuntimeError: from gloo, where a neighbour stopped answering the all-reduce (the profile records the
            measurement as skipped).
    """
    import signal

    if neighbours < 1:
        return {"skipped": "no other core"}
    if not hasattr(os, "fork"):
        return {"skipped": "no fork on this platform"}
    clocks = _Clocks()
    grads = sum(p.numel() for p in gm.parameters() if p.requires_grad)

    def pause(pids: list[int], stop: bool) -> None:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)
        for pid in pids if stop else ():
            os.waitpid(pid, os.WUNTRACED)  # back once it is stopped

    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="hpml-corun-") as tmp:
        store = os.path.join(tmp, "store")
        pids = _start_neighbours(gm, example_inputs, groups, neighbours, start_timeout_s, store, grads)
        if pids is None:
            return {"skipped": f"a neighbour process did not start within {start_timeout_s:g} s"}
        walls: list[list[float]] = []
        cpus: list[list[float]] = []
        try:
            torch.set_num_threads(1)  # one core each, as the neighbours (and a process's CPU time has no idle spins)
            group = _group(store, 0, neighbours + 1, start_timeout_s)
            buf = torch.zeros(max(1, grads))

            def measure(together: bool) -> tuple[Totals, Totals]:
                clocks.cpu.clear()
                s = time_segments(gm, example_inputs, groups, passes=passes, warmup=warmup, timer=clocks,
                                  between=(lambda: group.allreduce([buf]).wait()) if together else None)
                return _pass_totals(s, clocks.cpu, passes, warmup)

            busy0 = _host_busy_s(pids)
            pause(pids, True)
            alone = [measure(False)]
            for _ in range(rounds):
                pause(pids, False)
                together = measure(True)
                pause(pids, True)
                alone.append(measure(False))
                walls.append(_ratio(together[0], alone[-2][0], alone[-1][0]))
                cpus.append(_ratio(together[1], alone[-2][1], alone[-1][1]))
            busy1 = _host_busy_s(pids)
        finally:
            torch.set_num_threads(threads)
            _stop(pids)
    others = None
    if busy0 is not None and busy1 is not None and busy1[1] > busy0[1]:
        others = round(max(0.0, (busy1[0] - busy0[0]) / (busy1[1] - busy0[1])), 3)
    clock = "wall" if others is not None and others < QUIET_OTHERS else "cpu"
    kept = walls if clock == "wall" else cpus
    med = {name: [round(statistics.median(r[i] for r in rs), 4) for i in (0, 1)]
           for name, rs in (("wall", walls), ("cpu", cpus))}
    out: dict[str, Any] = {"fwd": med[clock][0], "bwd": med[clock][1], "ranks": neighbours + 1,
                           "rounds": [[round(f, 4), round(b, 4)] for f, b in kept], "clock": clock, **med}
    if others is not None:
        out["others"] = others
    return out


def _group(store: str, rank: int, size: int, timeout_s: float) -> Any:
    """A gloo group of its own over a ``FileStore`` at ``store`` (not the default process group)."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.FileStore(store, size), rank, size,
                                 datetime.timedelta(seconds=max(1.0, timeout_s)))


def _host_busy_s(pids: Sequence[int]) -> tuple[float, float] | None:
    """``(CPU-seconds the host's other programs used so far, wall seconds)``: every core's busy time from
    ``/proc/stat`` less this process's and ``pids``' own (``/proc/<pid>/schedstat``); None where unreadable."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = os.sysconf("SC_CLK_TCK")
        # every state but idle, iowait and steal
        busy = sum(int(x) for i, x in enumerate(fields[:8]) if i not in (3, 4, 7)) / ticks
        own = sum(int(Path(f"/proc/{p}/schedstat").read_text().split()[0]) for p in ("self", *pids)) / 1e9
    except (OSError, ValueError, IndexError):
        return None
    return busy - own, time.monotonic()


def _start_neighbours(gm: fx.GraphModule, example_inputs: Sequence[Any], groups: Sequence[Sequence[str]],
                      n: int, timeout_s: float, store: str, grads: int) -> list[int] | None:
    """Fork ``n`` processes running the blocks in sequence on their own copies of the parameters, each pass after
    an all-reduce of ``grads`` floats in the gloo group at ``store`` (ranks 1 to ``n``; this process is rank 0
    and joins it once they run); their pids once each has run a pass, or None (every one killed) when they are
    not all running within ``timeout_s``."""
    def prepare(i: int) -> Callable[[], Any]:
        with torch.no_grad():
            for t in [*gm.parameters(), *gm.buffers()]:
                t.data = t.data.clone()
        buf = torch.zeros(max(1, grads))
        group: list[Any] = []

        def sync() -> None:
            if not group:  # joined after the first pass: this process joins once every neighbour is running
                group.append(_group(store, i + 1, n + 1, timeout_s + 600.0))
            group[0].allreduce([buf]).wait()

        first = [True]

        def work() -> Any:
            if first:  # the pass that says it runs, before any all-reduce
                first.clear()
                return time_segments(gm, example_inputs, groups, passes=1, warmup=0)
            return time_segments(gm, example_inputs, groups, passes=_NEIGHBOUR_PASSES, warmup=0, between=sync)

        return work

    return fork_neighbours(n, prepare, timeout_s)


def fork_neighbours(n: int, prepare: Callable[[int], Callable[[], Any]], timeout_s: float) -> list[int] | None:
    """Fork ``n`` processes, the ``i``-th running ``prepare(i)``'s work (one torch thread) over and over until
    killed, dying with this process; their pids once each has run it once, or None (every one killed) when they
    are not all running within ``timeout_s``.

    The neighbours a co-run measurement runs beside (blocks here, optimizer steps in
    :mod:`hpml_compile.profile.optcorun`); :func:`_stop` kills and reaps them.
    """
    import select

    parent = os.getpid()
    read, write = os.pipe()
    pids = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:  # the neighbour: never returns into the caller's code
            code = 1
            try:
                os.close(read)
                _die_with(parent)
                torch.set_num_threads(1)
                work = prepare(i)
                work()
                os.write(write, b"1")
                stop = time.monotonic() + timeout_s + 600.0
                while time.monotonic() < stop:
                    work()
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(write)
    got, deadline = 0, time.monotonic() + timeout_s
    try:
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read], [], [], left)[0]:
                break
            chunk = os.read(read, n)
            if not chunk:  # every neighbour closed its end: some died before running
                break
            got += len(chunk)
    finally:
        os.close(read)
    if got < n:
        _stop(pids)
        return None
    return pids


def _stop(pids: Sequence[int]) -> None:
    """Kill and reap the neighbours."""
    import signal

    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _die_with(parent: int) -> None:
    """Make this (forked) process die when ``parent`` does (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``)."""
    import signal

    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
