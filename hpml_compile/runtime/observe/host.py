"""How busy the host was during a step: CPU stolen by the hypervisor, and CPU used by processes not of this job.

A shared virtual machine loses CPU time to other tenants (``steal`` in
``/proc/stat``), and a host runs other programs; either makes every step
slower without anything being wrong with the plan. Each rank samples, at the
start and end of its steps (closely following short steps share one window) (:class:`HostSampler`, through psutil, which
reads ``/proc/stat`` and ``/proc/<pid>/stat`` on Linux):

- ``steal``: the share of the host's CPU time (all cores) stolen during the step;
- ``others``: the share used by processes other than this job's ranks on this
  host (busy time of the host less the CPU time of the job's processes);
- ``cpu_util``: this rank's own CPU time over the step's wall time (1.0 = one core busy throughout);
- ``contention_s``: the time this rank lost to the others during the step: its
  main thread (where the model computes) waiting on a run queue while ready to
  run (``/proc/self/schedstat``, Linux), plus the steal's share of the time it
  ran. This, not the host-wide shares, is what a slowdown is discounted by
  (:func:`~.policy.contention_discount`): a host can be busy while a job that
  mostly waits for messages loses nothing to it.

:func:`~.policy.lost_share` turns the first two into the share of the
host's CPU the job could not have had, which names a busy host.

Example:
    >>> a = HostSample(wall=0.0, total=100.0, idle=60.0, steal=10.0, job=20.0, own=10.0, runq=1.0)
    >>> b = HostSample(wall=1.0, total=300.0, idle=100.0, steal=40.0, job=100.0, own=10.5, runq=1.25)
    >>> busy = a.delta(b)
    >>> round(busy.steal, 2), round(busy.others, 2), round(busy.cpu_util, 2), round(busy.contention_s, 3)
    (0.15, 0.25, 0.5, 0.325)
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Sequence

import psutil

__all__ = ["HostSample", "HostBusy", "HostSampler", "hostname", "REUSE_S", "WINDOW_S"]

REUSE_S = 0.005  # a step starting this soon after the last one's end continues its sample window
WINDOW_S = 0.05  # closely following steps are sampled about this often (HostSampler): a sample takes 0.1-0.3 ms;
# a longer window would lag the contention a slow-down is discounted by (policy.contention_discount)
_SCHEDSTAT = "/proc/self/schedstat"  # run time, run-queue wait (ns), time slices of the main thread


def hostname() -> str:
    """This host's name, as the per-step rows record it."""
    return socket.gethostname()


@dataclass(frozen=True, slots=True)
class HostBusy:
    """Shares of the host's CPU during one step (see the module docstring)."""

    steal: float
    others: float
    cpu_util: float
    contention_s: float = 0.0


@dataclass(frozen=True, slots=True)
class HostSample:
    """Cumulative CPU seconds at one moment: the host's (all cores), the job's processes' and this one's."""

    wall: float
    total: float
    idle: float
    steal: float
    job: float
    own: float
    runq: float = 0.0

    def delta(self, later: "HostSample") -> HostBusy:
        """What happened between this sample and ``later``."""
        total = later.total - self.total
        wall = later.wall - self.wall
        own = later.own - self.own
        if total <= 0:  # the host's counters did not move (ticks): nothing to say of the others
            return HostBusy(0.0, 0.0, own / wall if wall > 0 else 0.0)
        busy = total - (later.idle - self.idle) - (later.steal - self.steal)
        others = max(0.0, busy - (later.job - self.job)) / total
        steal = max(0.0, (later.steal - self.steal) / total)
        waited = max(0.0, later.runq - self.runq) + steal * min(own, wall)
        return HostBusy(steal, min(1.0, others), own / wall if wall > 0 else 0.0, waited)


def _run_queue_wait() -> float:
    """Seconds this process's main thread has waited on a run queue while ready (0.0 where Linux does not say)."""
    try:
        with open(_SCHEDSTAT) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class HostSampler:
    """Samples the host and this job's processes (see the module docstring).

    A sample reads three or more ``/proc`` files (about 0.1 ms), a few percent of a small model's step. Steps
    that follow each other closely (the next begins within :data:`REUSE_S` of the last one's end) share one
    sample window of at least :data:`WINDOW_S`: a step that ends before its window is that long is not sampled
    and reports the shares of the last window that was (``contention_s`` scaled to its own wall time), so a run
    of millisecond steps samples about every :data:`WINDOW_S` rather than at every step, and the shares of so
    short a span, which would be noise of the kernel's ticks, are not reported. A step after a gap starts a
    fresh window: the gap's load is not counted.

    Args:
        job_pids: the process ids of this job's ranks on this host (this process included).
    """

    def __init__(self, job_pids: Sequence[int] = ()) -> None:
        self._job = [psutil.Process(p) for p in dict.fromkeys([*job_pids, os.getpid()]) if psutil.pid_exists(p)]
        self._start: HostSample | None = None  # the open window's first sample
        self._step_t0 = 0.0  # monotonic start of the current step
        self._step_end = -1e9  # monotonic end of the last step
        self._last: tuple[HostBusy, float] | None = None  # the last sampled window's shares and its wall time

    def sample(self) -> HostSample:
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        steal = getattr(t, "steal", 0.0)
        total = sum(t)  # user, nice, system, idle, iowait, irq, softirq, steal, guest (guest is in user)
        total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
        job = 0.0
        for p in list(self._job):
            try:
                c = p.cpu_times()
            except psutil.Error:  # a rank that ended
                self._job.remove(p)
                continue
            job += c.user + c.system
        # this process's own CPU time from the kernel's exact account (CLOCK_PROCESS_CPUTIME_ID), not psutil's
        # tick-sampled one: a 24 ms step could read 0 ticks of its own CPU (cpu_util 0.0, seen in CI)
        return HostSample(time.monotonic(), total, idle, steal, job, time.process_time(), _run_queue_wait())

    def begin(self) -> None:
        """Mark the start of a step: within :data:`REUSE_S` of the last step's end it continues that window."""
        now = time.monotonic()
        self._step_t0 = now
        if self._start is None or now - self._step_end >= REUSE_S:
            self._start = self.sample()
            self._step_t0 = self._start.wall

    def end(self) -> HostBusy:
        """The shares of this step's window (see the class docstring)."""
        if self._start is None:
            return HostBusy(0.0, 0.0, 0.0)
        now = self._step_end = time.monotonic()
        step_s = now - self._step_t0
        if self._last is None or now - self._start.wall >= WINDOW_S:
            later = self.sample()
            self._last = (self._start.delta(later), later.wall - self._start.wall)
            self._start = later
        busy, window_s = self._last
        share = min(1.0, step_s / window_s) if window_s > 0 else 1.0
        return HostBusy(busy.steal, busy.others, busy.cpu_util, busy.contention_s * share)
