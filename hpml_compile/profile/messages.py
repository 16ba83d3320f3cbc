"""The CPU a pipeline message takes on its receiving CPU rank when it arrives before the receive is posted.

A stage boundary's values move by gloo ``isend`` / ``irecv`` (:mod:`hpml_compile.runtime.sync.comm`). Where the
receiver is already waiting at its receive, the message costs it little beyond the copy. Where it arrives
while the receiver still computes (the later chunk's gradients of interleaved 1F1B, a 1F1B stage's gradients
during its next forward), gloo's threads on the receiving rank keep a core busy until the receive is posted,
for a while: on the 2-core development VM, a busy one, 1.1 ms of their CPU for a 1 ms wait, 2.0-2.4 ms for
waits of 5-20 ms, whatever the size (4 KiB to 2 MiB), against 0.2-0.3 ms for one that found its receive
posted. On a host whose cores the ranks keep busy, that CPU is taken from a rank's compute: gpt-mini's
interleaved 1F1B, with twice 1F1B's messages, ran 30 ms a step of these threads' CPU and 10% slower than its
1F1B, which a model of transfers alone does not see.

So two processes time it (:func:`probe_early_receive`): the sender sends at once and the receiver computes
for ``wait_ms`` before posting its receive ("early"), then the receiver posts first and the sender computes
before it sends ("posted"); the receiver's CPU beyond its main thread's, per message, in each. The simulator
charges a receiving CPU rank ``min(wait, early - posted)`` for each message that waited for its receive,
where its host has no core to spare (:mod:`hpml_compile.simulate`).

Why our own probe: it is gloo's behaviour under this runtime's calls that is priced; no library reports it.

Example:
    >>> r = probe_early_receive(count=2, wait_ms=2.0)  # doctest: +SKIP
    >>> sorted(r)  # doctest: +SKIP
    ['early_ms', 'posted_ms', 'recv_cpu_ms', 'wait_ms']
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["probe_early_receive"]


def _compute(ms: float) -> None:
    """Busy one core for ``ms`` of this thread's CPU time (a rank computing)."""
    a = torch.ones(128, 128)
    t0 = time.thread_time()
    while (time.thread_time() - t0) * 1e3 < ms:
        a = torch.mm(a, a).div_(128.0)


def _rank(rank: int, world: int, count: int, wait_ms: float, nbytes: int, out: str) -> None:
    """One rank of :func:`probe_early_receive` (rank 0 sends, rank 1 receives and writes the result)."""
    t = torch.ones(max(1, nbytes // 4))
    buf = torch.empty_like(t)
    found: dict[str, float] = {}
    for mode in ("early", "posted"):
        extra = []
        for i in range(count + 1):  # the first: connections and allocations
            dist.barrier()
            p0, m0 = time.process_time(), time.thread_time()
            if rank == 0:
                if mode == "posted":
                    _compute(wait_ms)  # the receiver waits at its receive meanwhile
                work = dist.isend(t, 1, tag=i)
            else:
                if mode == "early":
                    _compute(wait_ms)  # the message arrives while this rank computes
                work = dist.irecv(buf, 0, tag=i)
            assert work is not None  # None only for a rank outside the group
            work.wait()
            p1, m1 = time.process_time(), time.thread_time()
            if i:
                extra.append(((p1 - p0) - (m1 - m0)) * 1e3)
        found[mode] = statistics.median(extra)
    if rank == 1:
        Path(out, "messages.json").write_text(json.dumps(found))


def probe_early_receive(count: int = 12, wait_ms: float = 20.0, nbytes: int = 64 * 2**10,
                        timeout_s: float = 60.0) -> dict[str, Any]:
    """The receiving rank's CPU beyond its main thread per message, arriving early and finding its receive posted.

    Two processes forked from this one (:func:`hpml_compile.runtime.job.spawn.spawn_ranks`, one torch thread
    each) on this host's gloo.

    Args:
        count: timed messages per case (the median kept).
        wait_ms: how long the early message waits for its receive (and the posted receive for its message).
        nbytes: message size (the cost measured here did not depend on it).
        timeout_s: the probe's limit.

    Returns:
        ``{"early_ms", "posted_ms", "recv_cpu_ms", "wait_ms"}``: ``recv_cpu_ms`` (``early - posted``, at least 0)
        is what a message that waited for its receive costs its receiver beyond one that did not.

    Raises:
        RanksTimeout: the probe ran past ``timeout_s``.
    """
    from ..runtime.job.spawn import spawn_ranks

    with tempfile.TemporaryDirectory(prefix="hpml-messages-") as tmp:
        spawn_ranks(_rank, 2, tmp, count, wait_ms, nbytes, tmp, timeout_s=timeout_s, start_method="fork")
        found = json.loads(Path(tmp, "messages.json").read_text())
    early, posted = float(found["early"]), float(found["posted"])
    return {"early_ms": round(early, 4), "posted_ms": round(posted, 4),
            "recv_cpu_ms": round(max(0.0, early - posted), 4), "wait_ms": wait_ms}
