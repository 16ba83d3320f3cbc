"""Who is left after a rank died: heartbeats in the job's store, one agreed set of survivors, the plan without them.

A gloo operation with a dead peer fails at once (its socket closes), so the
survivors notice a lost rank within the step; what they must then settle is
*who* is gone, and they must all settle on the same answer. torchrun answers
that by killing every worker and restarting them (its agent's elastic
restart); torchft by a quorum server. Here the job's own store does it, the
one the process group was opened on (a ``file://`` store or the launcher's
TCPStore), so nothing new runs:

- every rank beats: a daemon thread adds 1 to ``hpml/beat/<rank>`` every
  ``interval_s`` (:class:`Heartbeat`), and the rank's host and PID are in
  ``hpml/proc/<rank>``;
- after a failure, each rank that is still there marks itself arrived in the
  round of the next generation (:func:`agree_survivors`) and watches the
  others: a rank is alive once it arrives, dead once its beat has not moved
  for ``stale_s`` or, on this host, as soon as its process has exited (a
  zombie or gone: no need to wait for its beat to go stale); the first rank
  to see every rank either way proposes its
  answer with ``compare_set`` on one key, and every rank reads back the one
  answer that won (so all act on the same set, even where their views
  differed at the edge);
- :func:`without_ranks` is the running plan without the lost ranks' devices,
  their rows split over the replicas left of each stage (the rows stay a
  microbatch's, so the gradient stays the batch mean and nothing is skipped).

A rank that arrives after it was judged dead (stopped, not killed) finds
itself left out and stops with an error: it must not train beside the others.

Example:
    >>> from hpml_compile.plan import Plan, Schedule, Stage
    >>> from hpml_compile.cluster import builtin_cluster
    >>> one = (Stage(0, ("cpu0", "cpu1", "cpu2"), ("x",)),)
    >>> p = Plan("mlp", builtin_cluster("local-cpu-3"), Schedule.GPIPE, 1, one)
    >>> [(st.devices, st.rows) for st in without_ranks(p, [1], 24).stages]
    [(('cpu0', 'cpu2'), (12, 12))]
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import replace
from typing import Any, Sequence

from ...errors import CommFailure
from ...plan import Plan
from ...schedule import rank_layout

__all__ = ["Heartbeat", "agree_survivors", "without_ranks", "in_place_refusal", "BEAT_INTERVAL_S", "STALE_S",
           "JOIN_TICKETS"]

BEAT_INTERVAL_S = 0.1
STALE_S = 1.0  # a beat that has not moved this long: the rank is gone (ten beats missed, on a busy host too)
JOIN_TICKETS = "hpml/join/tickets"  # processes that asked to join (:mod:`.join`), read with every beat


def _beat_key(rank: int) -> str:
    return f"hpml/beat/{rank}"


def _proc_key(rank: int) -> str:
    return f"hpml/proc/{rank}"


def _exited(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:  # no /proc here: only the beat tells
        return False


def _exited_here(store: Any, rank: int) -> bool:
    """Whether ``rank`` runs on this host and its process has exited (False where it cannot be told)."""
    if not store.check([_proc_key(rank)]):
        return False
    host, _, pid = store.get(_proc_key(rank)).decode().rpartition(" ")
    return host == socket.gethostname() and pid.isdigit() and _exited(int(pid))


class Heartbeat:
    """A daemon thread that adds 1 to this rank's beat in ``store`` every ``interval_s`` until :meth:`stop`.

    With each beat it reads how many processes asked to join (:attr:`joiners`, :mod:`.join`), so that a step
    boundary need not.

    Args:
        store: the job's store (shared by every rank).
        rank: this rank's number in the job as it started (the key never changes when the group shrinks).
        interval_s: seconds between beats.
    """

    def __init__(self, store: Any, rank: int, interval_s: float = BEAT_INTERVAL_S) -> None:
        self._store, self._key, self._interval = store, _beat_key(rank), interval_s
        self._stop = threading.Event()
        self.joiners = 0
        self._store.set(_proc_key(rank), f"{socket.gethostname()} {os.getpid()}")
        self._store.add(self._key, 1)  # present before anyone can ask
        self._thread = threading.Thread(target=self._run, name="hpml-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._store.add(self._key, 1)
                self.joiners = int(self._store.add(JOIN_TICKETS, 0))
            except Exception:  # noqa: BLE001 -- the store is gone with the job: nothing left to tell
                return

    def stop(self) -> None:
        """Stop beating (the others will judge this rank gone after ``STALE_S``)."""
        self._stop.set()
        self._thread.join(timeout=5 * self._interval + 1)


def agree_survivors(store: Any, round_id: int, me: int, ranks: Sequence[int], *, stale_s: float = STALE_S,
                    timeout_s: float = 120.0) -> list[int]:
    """The ranks still in the job, the same list on every rank that is; call it on each after a failure.

    Args:
        store: the job's store, where every rank of ``ranks`` beats (:class:`Heartbeat`).
        round_id: a number no earlier round of this job used (the next generation of the group).
        me: this rank's job rank (as it started).
        ranks: the job ranks in the group that failed.
        stale_s: a rank whose beat has not moved this long and that has not arrived is gone.
        timeout_s: how long to wait for every rank to be seen arrived or gone.

    Returns:
        The surviving job ranks, sorted (``ranks`` itself when nobody died: a transient failure).

    Raises:
        CommFailure: this rank was judged gone by the others, or the round did not settle in ``timeout_s``.
    """
    prefix = f"hpml/members{round_id}/"
    store.set(f"{prefix}arrived/{me}", b"1")
    decided = f"{prefix}survivors"
    first = {r: int(store.add(_beat_key(r), 0)) for r in ranks}
    moved = {r: time.monotonic() for r in ranks}
    t0 = time.monotonic()
    while True:
        now = time.monotonic()
        alive, gone = set(), set()
        for r in ranks:
            if r == me or store.check([f"{prefix}arrived/{r}"]):
                alive.add(r)
                continue
            beat = int(store.add(_beat_key(r), 0))
            if beat != first[r]:
                first[r], moved[r] = beat, now
            if now - moved[r] >= stale_s or _exited_here(store, r):
                gone.add(r)
        if store.check([decided]) or len(alive) + len(gone) == len(ranks):
            break
        if now - t0 > timeout_s:
            raise CommFailure(f"after a communication error, ranks {sorted(set(ranks) - alive - gone)} neither "
                              f"rejoined nor stopped beating within {timeout_s:g} s: restart the job from the last "
                              "checkpoint")
        time.sleep(0.02)
    mine = ",".join(map(str, sorted(alive)))
    won = store.compare_set(decided, "", mine)
    won = won.decode() if isinstance(won, bytes) else str(won)
    out = [int(x) for x in won.split(",") if x]
    if me not in out:
        raise CommFailure(f"rank {me} was judged gone by the other ranks (its beat stopped for {stale_s:g} s) and "
                          f"they went on without it (ranks {out}): it stops here")
    return out


def without_ranks(plan: Plan, lost: Sequence[int], microbatch_rows: int) -> Plan:
    """``plan`` without the devices of the ranks ``lost``, each stage's rows split over the replicas left.

    The rows of each microbatch are spread evenly over a stage's remaining replicas (the first ones take one more
    where they do not divide), so every row is still trained on and the gradient is still the batch mean; the
    stage's rows are given explicitly, one replica left included.

    Args:
        plan: the running plan.
        lost: ranks of that plan (its numbering: :func:`~hpml_compile.schedule.rank_layout`).
        microbatch_rows: the rows of one microbatch.

    Returns:
        The plan the survivors run.

    Raises:
        CommFailure: a stage would have no replica left (its parameters are gone: only the restart from the last
            checkpoint can go on), or a stage runs tensor parallelism (its replicas are groups of ranks).
    """
    layout = rank_layout(plan)
    gone: dict[int, set[int]] = {}
    for r in lost:
        k, i = layout[r]
        gone.setdefault(k, set()).add(i)
    stages = list(plan.stages)
    for k, idx in gone.items():
        st = stages[k]
        if st.tp > 1:
            raise CommFailure(f"stage {k} runs tensor parallelism over {st.tp} devices a replica; a lost rank of it "
                              "needs the restart from the last checkpoint")
        keep = [d for i, d in enumerate(st.devices) if i not in idx]
        if not keep:
            raise CommFailure(f"stage {k} lost its only replica{'s' if len(st.devices) > 1 else ''} "
                              f"({', '.join(st.devices)}): its parameters are gone, so the job must restart from "
                              "the last checkpoint")
        n = len(keep)
        # explicit even when one replica is left: the stage code was generated at the old rows per replica, and
        # explicit rows are what scale its boundary tensors (:meth:`~hpml_compile.codegen.comm.Comm.shaped`)
        rows = tuple(microbatch_rows // n + (j < microbatch_rows % n) for j in range(n))
        if rows and min(rows) < 1:
            raise CommFailure(f"stage {k}: a microbatch of {microbatch_rows} rows cannot be split over {n} replicas")
        stages[k] = replace(st, devices=tuple(keep), rows=rows)
    return replace(plan, stages=tuple(stages))


def in_place_refusal(plan: Plan, lost: Sequence[int]) -> str | None:
    """Why the survivors cannot go on without ``lost`` in place (None: they can); the same answer on every rank.

    The stage that lost a replica must keep its whole state on each replica left: plain data parallelism
    (ZeRO-0, gradients sent whole, synchronised every step). A ZeRO-1/2/3 shard, a compressor's error feedback
    or local SGD's drifted parameters of the lost replica went with it.

    Args:
        plan: the running plan.
        lost: ranks of that plan.
    """
    layout = rank_layout(plan)
    for k in sorted({layout[r][0] for r in lost}):
        st = plan.stages[k]
        if int(st.zero):
            return (f"stage {k} shards its optimizer state over its replicas (ZeRO-{int(st.zero)}): the lost shard "
                    "is gone")
        if st.compress:
            return f"stage {k} compresses its gradients ({st.compress}): the lost replica's error feedback is gone"
        if plan.sync_every > 1:
            return (f"the replicas synchronise every {plan.sync_every} steps (local SGD): the lost replica's drift "
                    "is gone")
    return None
