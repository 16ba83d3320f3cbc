"""Hand-offs between the generator's ranks through pipes: each rank reads from the one before it, writes to the next.

Every decode step hands each lane's hidden states from a stage to the next
and the greedy tokens from the last stage back to the first: a few kilobytes,
a few hundred times a second. Over gloo's TCP transport a message is written
and read by a background thread of each process, which must be scheduled on a
core the rank's own thread keeps busy computing. On the 2-core development VM,
two ranks handing 8 KiB messages to each other with two lanes in flight took
21.8 ms a step for 4 ms of work each when the work kept the core busy (4.4 ms
when it slept instead), and in gpt-mini's decode loop at batch 16 a
non-blocking ``isend`` waited ~2 ms per call, more than the stage's blocks
took. One hand-off through a pipe takes ~4 us there at 1-8 KiB, against
~90 us for gloo's send/recv between two idle ranks. The generator's ranks
always share a host (it starts them itself), so they hand off through pipes: the
rank's own thread writes the bytes, the kernel wakes the reader blocked in
``poll``, and a rank that exits closes its ends, which its neighbours see at
once (end of file, or a broken pipe) rather than after a time-out. Why not
the runtime's shared-memory collectives (:mod:`hpml_compile.runtime.sync.shm`):
they meet at a gloo barrier per exchange, the very cost to remove; and shared
memory with a spinning reader burns the core a busy host's other processes
need and still needs a way to learn that a peer died; a pipe gives both for
one system call per message.

Writes never block: what a full pipe does not take now is queued and written
while the rank next waits to read (:meth:`PipeLink.recv`) or flushes
(:meth:`PipeLink.flush`). So, as with ``isend``, a stage hands a lane on and
runs the next one, and two ranks writing to each other can never both wait on
a full pipe.

Example:
    >>> import os, torch
    >>> r, w = os.pipe()
    >>> link = PipeLink(r, w, "itself", timeout_s=5)
    >>> link.send(torch.arange(4.0))
    >>> out = torch.empty(4)
    >>> link.recv(out); link.close()
    >>> out.tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import fcntl
import os
import select
import statistics
import time
from collections import deque
from typing import Callable

import torch
from torch import Tensor

from ..errors import HandoffError

__all__ = ["PipeLink", "HandoffError", "pipe_ring", "measure_handoff", "ping_pong", "busy_wait", "PIPE_BYTES"]

PIPE_BYTES = 1 << 20  # a pipe's buffer asked for (capped by /proc/sys/fs/pipe-max-size): a prefill in few writes
_POLL_MS = 1000  # how often a wait looks at its time-out


def pipe_ring(world: int) -> list[tuple[int, int]]:
    """``world`` pipes, the ``i``-th carrying rank ``i``'s output to rank ``(i + 1) % world``: ``(read, write)``
    descriptors, made large (:data:`PIPE_BYTES`) where the system allows."""
    pipes = [os.pipe() for _ in range(world)]
    for _, w in pipes:
        try:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (OSError, AttributeError):  # above the system's cap, or no such call: the default buffer
            pass
    return pipes


class PipeLink:
    """One rank's two ends of the ring: ``read_fd`` from the previous rank, ``write_fd`` to the next.

    Args:
        read_fd: the pipe the previous rank writes.
        write_fd: the pipe the next rank reads.
        peer: how errors name the neighbours (e.g. ``"rank 0 / rank 2"``).
        timeout_s: how long :meth:`recv` and :meth:`flush` may wait without any progress.
    """

    def __init__(self, read_fd: int, write_fd: int, peer: str, timeout_s: float) -> None:
        self.read_fd, self.write_fd, self.peer, self.timeout_s = read_fd, write_fd, peer, timeout_s
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._out: deque[memoryview] = deque()  # bytes queued for the next rank, in order
        self._held: deque[Tensor] = deque()  # the tensors those bytes live in, alive until written

    def send(self, t: Tensor) -> None:
        """Queue ``t``'s bytes (a contiguous CPU tensor, not changed afterwards) for the next rank; write what the
        pipe takes now.

        Raises:
            HandoffError: if the next rank has exited.
        """
        self._out.append(t.numpy().data.cast("B"))
        self._held.append(t)
        self._write()

    def recv(self, out: Tensor) -> None:
        """Fill ``out`` (contiguous, on the CPU) with the previous rank's next message of its size, writing queued
        output while waiting.

        Raises:
            HandoffError: if the previous rank has exited, or nothing came for ``timeout_s``.
        """
        view = out.numpy().data.cast("B")
        got, last = 0, time.monotonic()
        while got < len(view):
            try:
                n = os.readv(self.read_fd, [view[got:]])
            except BlockingIOError:
                n = -1
            if n == 0:
                raise HandoffError(f"{self.peer.split(' / ')[0]} closed its end of the pipeline (it exited)")
            if n > 0:
                got, last = got + n, time.monotonic()
                continue
            if self._wait(want_read=True):
                last = time.monotonic()
            elif time.monotonic() - last > self.timeout_s:
                raise HandoffError(f"nothing from {self.peer.split(' / ')[0]} for {self.timeout_s:.0f} s")

    def flush(self) -> None:
        """Wait until every queued byte is written.

        Raises:
            HandoffError: if the next rank has exited or read nothing for ``timeout_s``.
        """
        last = time.monotonic()
        while self._out:
            if self._wait(want_read=False):
                last = time.monotonic()
            elif time.monotonic() - last > self.timeout_s:
                raise HandoffError(f"{self.peer.split(' / ')[-1]} read nothing for {self.timeout_s:.0f} s")

    def close(self) -> None:
        """Close both ends (the neighbours see end of file or a broken pipe)."""
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self._out.clear()
        self._held.clear()

    def _write(self) -> bool:
        """Write what the pipe takes of the queue; whether anything was written."""
        wrote = False
        while self._out:
            head = self._out[0]
            try:
                n = os.write(self.write_fd, head)
            except BlockingIOError:
                return wrote
            except BrokenPipeError:
                raise HandoffError(f"{self.peer.split(' / ')[-1]} closed its end of the pipeline (it exited)") \
                    from None
            wrote = True
            if n < len(head):
                self._out[0] = head[n:]
                return wrote
            self._out.popleft()
            self._held.popleft()
        return wrote

    def _wait(self, *, want_read: bool) -> bool:
        """Block until the pipe in can be read (``want_read``) or the pipe out takes more of the queue, for at most
        :data:`_POLL_MS`; write what it takes. Returns whether anything happened."""
        poll = select.poll()
        if want_read:
            poll.register(self.read_fd, select.POLLIN)
        if self._out:
            poll.register(self.write_fd, select.POLLOUT)
        ready = False
        for fd, _ in poll.poll(_POLL_MS):
            if fd == self.write_fd:
                ready = self._write() or ready  # a closed reader raises here (broken pipe)
            else:
                ready = True
        return ready


_WARMUP = 3


def busy_wait(us: float) -> None:
    """Keep this thread on its core for ``us`` microseconds, as a rank that computes (no system call)."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def _echo(r: int, w: int, rounds: list[tuple[int, float]], count: int) -> None:
    """The far end of :func:`measure_handoff`: for each ``(bytes, busy us)`` round, reads ``count`` messages whole
    and writes each back after that long busy (blocking descriptors, plain bytes: the system calls release the
    GIL, and the two sides never compute at once, so neither waits for it)."""
    try:
        for n, busy_us in rounds:
            view = memoryview(bytearray(n))
            for _ in range(count):
                got = 0
                while got < n:
                    k = os.readv(r, [view[got:]])
                    if k == 0:
                        return
                    got += k
                busy_wait(busy_us)
                out = 0
                while out < n:
                    out += os.write(w, view[out:])
    except OSError:
        return  # the measuring side closed its ends
    finally:
        os.close(r)
        os.close(w)


def measure_handoff(sizes: tuple[int, ...], repeats: int = 30, timeout_s: float = 60.0,
                    idle_ms: tuple[float, ...] = ()) -> tuple[list[tuple[int, float]], list[tuple[float, float]]]:
    """One hand-off's time through :class:`PipeLink` on this host: per message size with the receiver waiting for
    it, and per time the receiver was idle before it came.

    A thread echoes each message back through a second pipe; a hand-off takes half the round trip of
    ``repeats`` (after a few untimed): the median per size, the mean per idle time (a wake-up after a wait
    varies more, and a run pays the sum of its wake-ups). This side is the generator's: :meth:`PipeLink.send`, then
    :meth:`PipeLink.recv` waiting in ``poll``; each message wakes a thread blocked on the other pipe, as it
    wakes the next rank. For the sizes, the echo answers at once: its receiver went to wait microseconds
    before (a pipeline whose lanes keep every stage busy). For each of ``idle_ms``, a message of the first
    size: each side computes (a busy wait) that long before it sends, so that each message finds its receiver
    idle for that long, as a rank that waits while the other stages compute (one lane at batch 1); the
    computing is left out of the time. They differ: a reader blocked for long may have given its core away (to
    another process, or on a virtual machine back to the hypervisor) and waits to get it back. A thread rather
    than a second process: nothing to start, and the two sides take turns, each blocked in the kernel (the GIL
    free) while the other computes, so the time is the pipe's and the wake-up's, as between two processes.

    Args:
        sizes: message sizes in bytes (each at least 1).
        repeats: round trips timed per size and per idle time.
        timeout_s: how long the echo may take to answer.
        idle_ms: how long the receiver is idle before each message, per point measured (milliseconds).

    Returns:
        ``([(bytes, milliseconds)] per size, [(idle milliseconds, milliseconds)] per idle time)``.

    Raises:
        HandoffError: if the echo does not answer.
    """
    import threading

    rounds = [(n, 0.0) for n in sizes] + [(sizes[0], ms * 1e3) for ms in idle_ms]
    there, back = pipe_ring(2)
    echo = threading.Thread(target=_echo, args=(there[0], back[1], rounds, repeats + _WARMUP), daemon=True)
    echo.start()
    link = PipeLink(back[0], there[1], "the echo / the echo", timeout_s)
    times: list[float] = []
    try:
        for n, busy_us in rounds:
            msg, got = torch.zeros(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
            one = []
            for k in range(repeats + _WARMUP):
                busy_wait(busy_us)  # the echo is idle meanwhile
                t0 = time.perf_counter()
                link.send(msg)
                link.recv(got)
                if k >= _WARMUP:
                    one.append(((time.perf_counter() - t0) * 1e3 - busy_us / 1e3) / 2)
            # a run's time is the sum of its wake-ups, whose spread after an idle wait is the point: their mean
            times.append(max(statistics.fmean(one) if busy_us else statistics.median(one), 0.0))
    finally:
        link.close()  # the echo sees end of file (or has finished) and closes its ends
        echo.join(timeout=5)
    return list(zip(sizes, times)), list(zip(idle_ms, times[len(sizes):]))


def _second_side(link: PipeLink, second: Callable[[Tensor], Tensor], like: Tensor, rounds: int, spin_us: float,
                 times: list[float], failed: list[BaseException]) -> None:
    """The far end of :func:`ping_pong`: ``rounds`` times, wait for a message, run ``second`` on it (timed), stay
    busy ``spin_us``, hand the result back. A failure is kept for the caller; the ends are closed either way (the
    caller's wait then ends at once)."""
    got = torch.empty_like(like)
    try:
        for _ in range(rounds):
            link.recv(got)
            t0 = time.perf_counter()
            out = second(got)
            times.append((time.perf_counter() - t0) * 1e3)
            busy_wait(spin_us)
            link.send(out.contiguous())
        link.flush()
    except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
        failed.append(e)
    finally:
        link.close()


def ping_pong(first: Callable[[Tensor], Tensor], second: Callable[[Tensor], Tensor], x: Tensor, rounds: int, *,
              spin_ms: float = 0.0, timeout_s: float = 60.0) -> tuple[float, float, float]:
    """Two parties taking turns through :class:`PipeLink` pipes, as a 2-stage pipeline's ranks with one lane: each
    computes, hands on, and waits in ``poll`` while the other computes.

    ``first`` runs in this thread on ``x``; what it returns goes to ``second`` in a second thread, and what that
    returns (``x``'s shape and dtype) comes back as the next round's input. With ``spin_ms``, each side stays
    busy that long after its compute before it hands on (a longer stage that reads nothing more), so the other
    idles that much longer. A thread rather than a second process, as :func:`measure_handoff`: the two take
    turns, each blocked in the kernel with the GIL free while the other computes.

    Args:
        first: one side's step (a contiguous CPU tensor in and out).
        second: the other side's step.
        x: the first round's input of ``first``.
        rounds: rounds timed (after a few untimed).
        spin_ms: how long each side stays busy after its compute.
        timeout_s: how long a side may wait for the other.

    Returns:
        ``(first's compute, second's compute, one round)``, medians in milliseconds; a round is both sides'
        compute, their spins and two hand-offs, each to a side woken from its wait.

    Raises:
        HandoffError: if ``second``'s output does not fit ``first``'s input, or a side fails or does not answer.
    """
    import threading

    y = first(x)  # untimed: the sizes of the message each way, and first calls' allocations
    back_like = second(y)
    if back_like.shape != x.shape or back_like.dtype != x.dtype:
        raise HandoffError(f"the second side returns {tuple(back_like.shape)} {back_like.dtype}, but the first "
                           f"side takes {tuple(x.shape)} {x.dtype}")
    there, back = pipe_ring(2)
    total = rounds + _WARMUP
    theirs: list[float] = []
    failed: list[BaseException] = []
    other = PipeLink(there[0], back[1], "the first side / the first side", timeout_s)
    thread = threading.Thread(target=_second_side, args=(other, second, y, total, spin_ms * 1e3, theirs, failed),
                              daemon=True)
    link = PipeLink(back[0], there[1], "the second side / the second side", timeout_s)
    thread.start()
    x = x.clone()
    ours, whole = [], []
    try:
        for _ in range(total):
            t0 = time.perf_counter()
            y = first(x)
            ours.append((time.perf_counter() - t0) * 1e3)
            busy_wait(spin_ms * 1e3)
            link.send(y.contiguous())
            link.recv(x)
            whole.append((time.perf_counter() - t0) * 1e3)
    except HandoffError as e:
        raise HandoffError(f"timing two sides taking turns: {failed[0]!r}" if failed else str(e)) from e
    finally:
        link.close()  # the other side sees end of file (or has finished) and closes its ends
        thread.join(timeout=timeout_s)
    if failed:
        raise HandoffError(f"timing two sides taking turns: {failed[0]!r}")
    return (statistics.median(ours[_WARMUP:]), statistics.median(theirs[_WARMUP:]),
            statistics.median(whole[_WARMUP:]))
