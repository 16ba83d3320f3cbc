"""Per-rank events of every step on one clock: what ran when, kept compactly in the run folder.

Each rank's :class:`EventLog` collects, during a step, one record per thing
that took time: each microbatch's forward (``F``) and backward (``B``), each
send posted (``SEND``) and receive waited for (``RECV``), the wait for this
step's sends (``WAIT``), each gradient collective with the wait for its
slowest member before it (``COLL_WAIT``, then ``ALLREDUCE`` /
``REDUCESCATTER`` / ``ALLGATHER``), the stage's whole gradient sync
(``SYNC``), the loss agreement (``LOSS``) and the optimizer (``OPT``). A
record is a tuple appended to a list (a few hundred nanoseconds; the runtime
overhead benchmark measures the whole cost).

**One clock.** Times are ``time.perf_counter()`` plus an offset to rank 0's
counter, measured once at start-up over the default group
(:func:`align_clock`): rank ``r`` sends its time, rank 0 answers with its
own, and the round with the shortest round trip gives ``offset = t0 -
(t_send + t_back) / 2`` (Cristian's algorithm, 1989; the error is at most half
that round trip). Ranks on one host share the monotonic clock, so their
offsets come out near zero; across hosts the offset carries the difference.

**Kept compactly.** :class:`EventStore` (the monitor's, which writes each
step's row) appends a step's events to ``metrics/events_rank<r>.jsonl`` when
the step is one of a sample (the first ``keep_first`` steps, then every
``sample_every``-th), and keeps the last ``keep_last`` steps in memory,
written to ``metrics/events_rank<r>.tail.json`` every ``keep_last`` steps
and at the end (rewriting it every step cost ~2 ms a step on a busy 2-core
machine; this way a crash loses at most the unsampled steps since the last
write); :func:`read_events` merges the two. A
step's record holds its start on the common clock (seconds) and each event as
``[kind, start_us, duration_us, stage, microbatch, peer, bytes, tag]`` with
times in microseconds from the step's start.

Why our own and not ``torch.profiler``: the profiler records every operator
(megabytes per step, and a slowdown we could not leave on for a whole run);
what a person needs to see a pipeline is the few dozen events above, on the
schedule's own terms (microbatch, peer, message tag), every step.

Example:
    >>> log = EventLog(rank=0, offset=0.0)
    >>> log.begin()
    >>> t = log.now()
    >>> log.add("F", t, t + 0.002, stage=0, microbatch=1)
    >>> step = log.finish(step=4)
    >>> step["step"], step["events"][0][0], step["events"][0][2]
    (4, 'F', 2000)
    >>> estimate_offset([(1.0, 5.5, 2.0), (1.0, 5.2, 1.2)])
    4.1
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from ...publish import read_json_lines

__all__ = ["EventLog", "EventStore", "StepEvents", "align_clock", "estimate_offset", "read_events", "events_path",
           "tail_path", "FIELDS", "KINDS"]

FIELDS = ("kind", "start_us", "dur_us", "stage", "microbatch", "peer", "bytes", "tag")
KINDS = ("F", "B", "SEND", "RECV", "WAIT", "SYNC", "COLL_WAIT", "ALLREDUCE", "REDUCESCATTER", "ALLGATHER", "LOSS",
         "OPT", "GATHER")


class EventLog:
    """One process's events of the step under way (see the module docstring).

    Args:
        rank: this process's rank.
        offset: seconds to add to ``time.perf_counter()`` to get rank 0's clock (:func:`align_clock`).
    """

    __slots__ = ("rank", "offset", "_t0", "_events")

    def __init__(self, rank: int, offset: float = 0.0) -> None:
        self.rank, self.offset = rank, offset
        self._t0 = 0.0
        self._events: list[tuple[str, float, float, int, int, int, int, int]] = []

    now = staticmethod(time.perf_counter)

    def begin(self) -> None:
        """Start a step (drops what an earlier, failed attempt recorded)."""
        self._events.clear()
        self._t0 = time.perf_counter()

    def add(self, kind: str, start: float, end: float, stage: int = -1, microbatch: int = -1, peer: int = -1,
            nbytes: int = 0, tag: int = -1) -> None:
        """Record one event (``start``/``end`` from ``time.perf_counter()``)."""
        self._events.append((kind, start, end, stage, microbatch, peer, nbytes, tag))

    def finish(self, step: int) -> dict[str, Any]:
        """The step's record: its start on the common clock and its events relative to it (see the docstring)."""
        t0 = self._t0
        # start and end rounded alike, so an event inside another stays inside it
        events = [[k, round((s - t0) * 1e6), round((e - t0) * 1e6) - round((s - t0) * 1e6), st, mb, p, b, tag]
                  for k, s, e, st, mb, p, b, tag in self._events]
        self._events = []
        return {"step": step, "rank": self.rank, "t0": t0 + self.offset, "events": events}


def estimate_offset(rounds: Sequence[tuple[float, float, float]]) -> float:
    """Cristian's estimate from ``(sent, peer's time, back)`` rounds: the one with the shortest round trip."""
    sent, peer, back = min(rounds, key=lambda r: r[2] - r[0])
    return peer - (sent + back) / 2


def align_clock(rank: int, world_size: int, rounds: int = 8) -> float:
    """Seconds to add to this rank's ``perf_counter`` to read rank 0's (every rank calls it, in the default group).

    Args:
        rank: this rank.
        world_size: ranks in the default group (a gloo group: the messages are CPU tensors).
        rounds: ping-pongs per rank; the shortest round trip is kept.

    Returns:
        The offset (0.0 on rank 0 and without a process group).
    """
    if world_size < 2 or not dist.is_available() or not dist.is_initialized():
        return 0.0
    buf = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        for peer in range(1, world_size):
            for _ in range(rounds):
                dist.recv(buf, src=peer)
                buf.fill_(time.perf_counter())
                dist.send(buf, dst=peer)
        return 0.0
    samples = []
    for _ in range(rounds):
        sent = time.perf_counter()
        buf.fill_(sent)
        dist.send(buf, dst=0)
        dist.recv(buf, src=0)
        samples.append((sent, float(buf.item()), time.perf_counter()))
    return estimate_offset(samples)


def events_path(run_dir: str | Path, rank: int) -> Path:
    """The sampled steps' events of rank ``rank`` (JSON lines)."""
    return Path(run_dir) / "metrics" / f"events_rank{rank}.jsonl"


def tail_path(run_dir: str | Path, rank: int) -> Path:
    """The last steps' events of rank ``rank`` (one JSON list, rewritten every step)."""
    return Path(run_dir) / "metrics" / f"events_rank{rank}.tail.json"


class EventStore:
    """Writes each step's events: sampled steps appended, the last ``keep_last`` rewritten (see the docstring).

    Args:
        run_dir: the run folder.
        rank: this rank.
        keep_last: steps kept whole at the end of the run.
        keep_first: leading steps always kept (start-up and warm-up).
        sample_every: of the others, every this many-th step is kept.
    """

    def __init__(self, run_dir: str | Path, rank: int, *, keep_last: int = 8, keep_first: int = 3,
                 sample_every: int = 10) -> None:
        self._sampled = events_path(run_dir, rank)
        self._tail = tail_path(run_dir, rank)
        self._sampled.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._sampled.open("w")
        self._last: deque[str] = deque(maxlen=keep_last)
        self._unwritten = 0
        self.keep_first, self.sample_every = keep_first, sample_every

    def sampled(self, step: int) -> bool:
        """Whether ``step`` (from 0) is kept for good."""
        return step < self.keep_first or step % self.sample_every == 0

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"))
        if self.sampled(int(record["step"])):
            self._file.write(line + "\n")
            self._file.flush()
        self._last.append(line)
        self._unwritten += 1
        if self._unwritten >= (self._last.maxlen or 1):
            self._write_tail()

    def _write_tail(self) -> None:
        tmp = self._tail.with_name(self._tail.name + ".tmp")
        tmp.write_text("[" + ",".join(self._last) + "]\n")
        os.replace(tmp, self._tail)  # a reader sees the old tail or the new one, never half of one
        self._unwritten = 0

    def close(self) -> None:
        if self._unwritten:
            self._write_tail()
        self._file.close()


@dataclass(frozen=True, slots=True)
class StepEvents:
    """One rank's events of one step, on the common clock (seconds)."""

    step: int
    rank: int
    t0: float
    events: tuple[tuple[Any, ...], ...]

    def spans(self) -> Iterable[dict[str, Any]]:
        """Each event as a dict with absolute ``start``/``end`` seconds and the fields of :data:`FIELDS`."""
        for e in self.events:
            d = dict(zip(FIELDS, e))
            d["start"] = self.t0 + d["start_us"] / 1e6
            d["end"] = d["start"] + d["dur_us"] / 1e6
            yield d


def _record(d: dict[str, Any]) -> StepEvents:
    return StepEvents(int(d["step"]), int(d["rank"]), float(d["t0"]), tuple(tuple(e) for e in d["events"]))


def read_events(run_dir: str | Path) -> dict[int, dict[int, StepEvents]]:
    """Every rank's recorded steps (sampled and last), by rank then step; empty when none were recorded."""
    out: dict[int, dict[int, StepEvents]] = {}
    metrics = Path(run_dir) / "metrics"
    for path in sorted(metrics.glob("events_rank*.jsonl")):
        for d in read_json_lines(path):  # a line cut short by a stopped rank is left out
            r = _record(d)
            out.setdefault(r.rank, {})[r.step] = r
    for path in sorted(metrics.glob("events_rank*.tail.json")):
        for d in json.loads(path.read_text() or "[]"):
            r = _record(d)
            out.setdefault(r.rank, {})[r.step] = r
    return out
