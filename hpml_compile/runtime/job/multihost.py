"""The closed loop across hosts: one supervisor per host, decisions taken once by host 0, a lost host planned out.

``hpml-compile run BUILD --adapt --nnodes N --node-rank R --rdzv-endpoint
HOST:PORT --run-dir SHARED`` on each of ``N`` hosts runs the job of
:func:`~.supervisor.supervise` across them (:mod:`.hostbuild`);
``hpml-compile launch --adapt`` with the same options runs a user's own
script so (:mod:`.scriptlaunch`). Both are a :class:`HostWork` (what a
segment runs, and how the next one follows from its end) on the machinery
here (:func:`host_job`). Each segment is one torchrun
launch per host taking part, joined by torchrun's static rendezvous (host
``i`` of the segment gets the next global ranks, so each host runs the
plan's devices it holds); the ranks' own closed loop (:mod:`.adapt`:
slowdowns, row moves in place, switches) runs over all of them as on one
host. Between segments the hosts meet in the job's store
(:mod:`.hosts`): each says how its part ended, and host 0, the lead,
decides what the next segment is, once, and publishes it:

- every host's ranks finished: done, or (``run``) a switch the ranks chose
  (the new build in the shared run folder);
- a host stopped beating (its agent and ranks died, or it is cut off): its
  devices are dropped, the job is re-planned for the devices of the hosts
  left (``run``: :func:`~.supervisor.replan_without`; ``launch``: the
  script's own ``compile`` re-plans for the cluster it is told) and resumes on them from the
  last checkpoint. A host that sees another one lost while its ranks run
  stops them at once (they would otherwise wait for their dead peers up to
  ``--timeout``), so the job is training again within seconds;
- a rank failed or died on a host that is still there: as on one host
  (``run``: :func:`~.supervisor.after_failure`, blamed from every host's exit codes
  and the ranks' reports in the shared folder; a dead rank's device dropped,
  another failure restarted on the same devices).

Checkpoints, builds and plans live in the run folder, which every host must
mount (:func:`~.hosts.check_shared` refuses one that is not): the hosts left
resume from checkpoints the lost host helped write.

Host 0 itself lost: with it go the job's store and the decisions. Neither is
torchrun's (each segment's rendezvous is a fresh torchrun launch whose node 0
is the lead's host), so they can move: at the start every other host says
where it would open the store (:func:`standby_endpoint`, a port free then),
and host 0 waits for every host's word before its first decision. When host
0 stops answering, the lowest other host opens a new store there and takes
the decisions over (:func:`_take_over`): everything the lead knew is in the
shared run folder (``events.jsonl``: what each segment ran and on which devices, which
host ran which), so it records host 0's loss in the segment that was
running, drops host 0's devices and resumes from the last
checkpoint, as host 0 would have for any other host. The other hosts join
it, renumbered in order. One takeover: if the new lead is lost too, the job
stops with its checkpoints intact. The takeover takes a silent host 0 for a
dead one, as the lead does any silent host; a host 0 that is only cut off
from the others would go on too, so the lead names itself in the shared
folder (``RUN_DIR/.lead``, :func:`claim_lead`) and checks before each
decision that it still is the one named: an old lead that finds the new
one there stops (a segment it already started runs to its end or failure).
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

from ...errors import HpmlError, LaunchError, LeadLost, RankFailure, SupervisorError
from ..observe.runfolder import RunFolder
from .hosts import LOST_AFTER_S, JobBoard, Liveness, check_shared
from .launcher import free_port, parse_endpoint
from .supervisor import Job

__all__ = ["host_job", "HostWork", "place", "standby_endpoint", "claim_lead"]

JOIN_S = 120.0  # how long host 0 waits for every host's first beat


def place(devices: list[str], held: dict[int, list[str]]) -> tuple[list[int], list[int], dict[int, list[str]]]:
    """The hosts a plan's ranks run on, and how many on each, in rank order.

    Each host runs as many ranks as it holds devices the plan uses; host ``i`` of the segment gets the next
    global ranks (torchrun's static rendezvous), so the devices a host runs are the next ones of the plan's
    rank order (on hosts of identical devices the names are the plan's own; each is held by whichever host
    runs it from then on).

    Args:
        devices: the plan's device of each rank, in rank order.
        held: host -> the devices it ran in the last segment.

    Returns:
        ``(hosts, nproc, held)``: the hosts taking part (ascending), ranks on each, and the devices each runs.

    Example:
        >>> place(["cpu0"], {0: ["cpu0"], 1: ["cpu1"]})
        ([0], [1], {0: ['cpu0'], 1: []})
        >>> place(["cpu2", "cpu0", "cpu1"], {0: ["cpu0", "cpu1"], 1: ["cpu2", "cpu3"]})
        ([0, 1], [2, 1], {0: ['cpu2', 'cpu0'], 1: ['cpu1']})
    """
    used = set(devices)
    counts = {h: len(used & set(ds)) for h, ds in sorted(held.items())}
    hosts = [h for h, n in counts.items() if n]
    out: dict[int, list[str]] = {h: [] for h in held}
    at = 0
    for h in hosts:
        out[h] = devices[at:at + counts[h]]
        at += counts[h]
    return hosts, [counts[h] for h in hosts], out


class HostWork(ABC):
    """What the hosts of a job run, segment by segment, and what the lead makes of each segment's end.

    The hosts' machinery (the store, the beats, one decider, a lost host 0 taken over) is the same for every
    job; this says what a segment runs (a build's ranks for ``run --adapt``, :class:`~.hostbuild.BuildWork`; the user's
    script for ``launch --adapt``, :class:`~.scriptlaunch.ScriptWork`) and how the next one follows from how
    it ended. Every host holds one; only the lead's is asked to decide, and it keeps the job's state between
    segments (a host taking over rebuilds it from the shared run folder's events: :meth:`resume`).

    Args:
        run_dir: the job's folder, the same on every host.
        log: progress lines.
    """

    def __init__(self, run_dir: Path, log: Callable[[str], None]) -> None:
        self.run = RunFolder(run_dir)
        self.job = Job(self.run, log)
        self.reason = "start"

    @abstractmethod
    def first_devices(self, nnodes: int, nproc: int) -> list[str]:
        """The first segment's device of each rank, in rank order (host ``h`` runs ranks ``h x nproc ..``)."""

    @abstractmethod
    def begin(self, seg: int, held: dict[int, list[str]]) -> tuple[list[str], dict[str, Any]]:
        """Prepare segment ``seg`` (its folder, its ``segment`` event) on the devices the hosts hold.

        Returns:
            ``(devices, fields)``: its device of each rank in rank order, and what every host needs to run its
            part (added to the lead's decision, with ``reason``).
        """

    @abstractmethod
    def part(self, go: dict[str, Any], seg: int, node: int, nnodes: int) -> None:
        """Run this host's ranks of segment ``seg`` (node ``node`` of ``nnodes`` in its rendezvous, the lead's
        decision ``go``); return when they have all finished.

        Raises:
            RankFailure: a rank failed (every rank of this host stopped).
            LaunchError: the rendezvous did not form.
        """

    @abstractmethod
    def hosts_lost(self, seg: int, lost: list[int], held: dict[int, list[str]], lost_after_s: float) -> None:
        """Drop the devices of the ``lost`` hosts after segment ``seg`` and prepare the next segment on the rest.

        Raises:
            SupervisorError: nothing can run on what is left.
        """

    @abstractmethod
    def failed(self, seg: int, failures: dict[int, tuple[int, str]]) -> None:
        """Segment ``seg``'s ranks failed on hosts that are still there (global rank -> exit code, message):
        prepare the next segment (a dead rank's device dropped, or a restart on the same devices).

        Raises:
            SupervisorError: too many failures, or nothing can run on what is left.
        """

    @abstractmethod
    def finished(self, seg: int) -> bool:
        """Segment ``seg``'s ranks all finished: True when the job is done (its ``done`` event written), False
        when another segment follows (prepared)."""

    @abstractmethod
    def resume(self, segments: list[dict[str, Any]]) -> None:
        """A host taking the decisions over: the job's state at the start of the last of ``segments`` (the
        shared folder's ``segment`` events)."""


def _stop_local_ranks() -> None:
    """SIGTERM every process this one started (torchrun's ranks; each ends quietly on it)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass


def _run_part(board: JobBoard, seg: int, go: dict[str, Any], work: HostWork,
              log: Callable[[str], None]) -> tuple[dict[str, Any], set[int], Liveness]:
    """This host's ranks of segment ``seg``, watched for lost peers; post how they ended.

    Returns:
        ``(end, lost, live)``: what this host posted, the hosts its watcher found lost while the ranks ran, and
        the watcher's view of the hosts' beats since the segment started (to go on watching with).
    """
    hosts: list[int] = go["hosts"]
    lost: set[int] = set()
    done = threading.Event()
    live = board.watcher()
    read_end = board.end_reader()

    def watch() -> None:
        while not done.wait(0.2):
            try:
                gone = {h for h in hosts if h not in (board.host, 0) and live.lost(h)}  # host 0: the store
            except Exception:  # noqa: BLE001 -- the store's host is gone: host 0 is lost
                gone = {0}
            if gone:
                lost.update(gone)
                log(f"host {board.host}: host(s) {', '.join(map(str, sorted(gone)))} lost during segment {seg}; "
                    "stopping this host's ranks")
                _stop_local_ranks()
                return
            try:
                failed = [h for h in hosts if h != board.host and "failures" in (read_end(seg, h) or {})]
            except Exception:  # noqa: BLE001 -- the store's host is gone: the next look finds host 0 lost
                continue
            if failed:  # a rank here may wait on them for ever (a hung one): the segment has failed, end it here
                log(f"host {board.host}: ranks failed on host(s) {', '.join(map(str, failed))} during segment "
                    f"{seg}; stopping this host's ranks")
                _stop_local_ranks()
                return

    watcher = threading.Thread(target=watch, name="hpml-host-watch", daemon=True)
    watcher.start()
    try:
        work.part(go, seg, hosts.index(board.host), len(hosts))
        end: dict[str, Any] = {"ok": True}
    except RankFailure as e:
        end = {"failures": {str(r): [code, msg] for r, (code, msg) in e.failures.items()}}
    except LaunchError as e:  # the rendezvous did not form: a host that should have joined did not
        end = {"launch_error": str(e)}
    finally:
        done.set()
        watcher.join()
    end["lost"] = sorted(lost)
    end["time"] = time.time()
    try:
        board.post_end(seg, end)
    except Exception as e:  # noqa: BLE001 -- the store's host is gone
        raise board.store_lost(e) from None
    return end, lost, live


def host_job(work: HostWork, *, host: int, nnodes: int, nproc: int, endpoint: str,
             lost_after_s: float = LOST_AFTER_S, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run ``work`` on ``nnodes`` hosts, this one being ``host`` (see the module docstring).

    Args:
        work: what the job runs, and how each segment follows from the last.
        host: this host's rank, 0..nnodes-1 (host 0 holds the job's store at ``endpoint`` and decides).
        nnodes: the hosts.
        nproc: ranks per host in the first segment.
        endpoint: ``HOST:PORT`` of host 0.
        lost_after_s: silence after which a host is lost.
        log: progress lines.

    Returns:
        The job's events on the host that decided last (as written to ``RUN_DIR/events.jsonl``); [] on the others.

    Raises:
        SupervisorError: the run folder is not shared, host 0 was lost before every host joined, or nothing can
            run on what is left.
    """
    board = JobBoard(endpoint, host, nnodes, lost_after_s=lost_after_s)
    standbys: dict[int, str] = {}
    try:
        check_shared(board, work.run.path)
        if host == 0:
            return _lead(board, work, nproc)
        board.publish_standby(standby_endpoint(endpoint))
        try:
            _follow(board, work, log, standbys)
            return []
        except LeadLost:
            if not standbys:  # lost before every host was known: nobody can take over
                raise
            log(f"host {host}: host 0 is lost, and with it the job's store and decisions")
    finally:
        board.close()
    return _succeed(host, standbys, work, lost_after_s, log)


def standby_endpoint(endpoint: str) -> str:
    """Where this host would open the job's store if host 0 were lost: a port free now, on this host's name (or on
    the rendezvous endpoint's own host name when that is this machine's loopback: agents on one machine)."""
    host, _ = parse_endpoint(endpoint)
    addr = host if host in ("localhost", "127.0.0.1", "::1") else socket.getfqdn()
    return f"{addr}:{free_port('')}"


def _succeed(host: int, standbys: dict[int, str], work: HostWork, lost_after_s: float,
             log: Callable[[str], None]) -> list[dict[str, Any]]:
    """After host 0 is lost: the lowest host left opens the job's store at its standby endpoint and decides from
    the shared run folder's events (:func:`_take_over`); the others join it, renumbered in order.

    Raises:
        SupervisorError: the successor could not be reached (lost too), or nothing can run on what is left.
    """
    order = sorted(standbys)
    ids = {h: i for i, h in enumerate(order)}
    lead = order[0]
    if host != lead:
        log(f"host {host}: joining host {lead}, which takes over, at {standbys[lead]} (now host {ids[host]})")
        board = JobBoard(standbys[lead], ids[host], len(order), lost_after_s=lost_after_s, connect_s=JOIN_S)
        try:
            _follow(board, work, log, {})
            return []
        finally:
            board.close()
    log(f"host {host}: taking over the job's decisions, its store at {standbys[host]}")
    board = JobBoard(standbys[host], 0, len(order), lost_after_s=lost_after_s)
    try:
        _await_hosts(board, standbys=False)
        return _take_over(board, ids, work)
    finally:
        board.close()


def _take_over(board: JobBoard, ids: dict[int, int], work: HostWork) -> list[dict[str, Any]]:
    """The new lead: record host 0's loss in the segment it ran, drop its devices, and go on deciding.

    Everything the lead knew is in the shared run folder: the segments (``segment``: what ran, on which devices)
    and which host ran which devices (``hosts``); the checkpoints are there too.

    Args:
        board: the job's new store, this host its host 0.
        ids: old host number -> new one, for the hosts left.
    """
    job = work.job
    events = job.run.read_events()
    if events and events[-1]["event"] == "done":
        return events
    lead = min(ids, key=ids.__getitem__)
    job.event("lead_moved", host=lead, endpoint=board.endpoint, renumbered={str(old): new for old, new in ids.items()})
    segments = [e for e in events if e["event"] == "segment"]
    if not segments:
        raise SupervisorError("host 0 was lost before the job's first segment started: run the hosts left again")
    seg = int(segments[-1]["segment"])
    placed = [e for e in events if e["event"] == "hosts" and e["segment"] == seg]
    held = {int(h): list(ds) for h, ds in (placed[-1]["devices"] if placed else {}).items()}
    held.setdefault(0, [])
    work.resume(segments)
    work.hosts_lost(seg, [0], held, board.lost_after_s)
    return _decide(board, work, seg + 1, {new: held.get(old, []) for old, new in ids.items()})


def _follow(board: JobBoard, work: HostWork, log: Callable[[str], None], standbys: dict[int, str]) -> None:
    """A host other than 0: run each segment the lead names this host in, until it says done or stop.

    ``standbys`` gets where each host would take over, once the lead has seen them all (before its first decision).

    Raises:
        LeadLost: host 0 (the store's host) was lost.
    """
    seg = int(board.fact("first", JOIN_S)["segment"])
    if board.host > 0 and not standbys:
        standbys.update(board.standbys())
    while True:
        go = board.wait(lambda: board.read_go(seg), [0], None, what=f"host 0's decision for segment {seg}")
        if go.get("done"):
            log(f"host {board.host}: done")
            return
        if "stop" in go:
            raise SupervisorError(f"host 0 stopped the job: {go['stop']}")
        if board.host in go["hosts"]:
            log(f"host {board.host}: segment {seg} ({go['reason']}): {go['nproc'][go['hosts'].index(board.host)]} "
                f"rank(s) of {sum(go['nproc'])} on {len(go['hosts'])} host(s)")
            _, lost, _ = _run_part(board, seg, go, work, log)
            if 0 in lost:
                raise board.store_lost(ConnectionError("host 0 stopped answering while this host's ranks ran"))
        else:
            log(f"host {board.host}: segment {seg} runs without this host's devices")
        seg += 1


def _lead(board: JobBoard, work: HostWork, nproc: int) -> list[dict[str, Any]]:
    """Host 0: wait for every host, then run segments and decide between them (see the module docstring)."""
    first = work.first_devices(board.nnodes, nproc)
    held = {h: first[h * nproc:(h + 1) * nproc] for h in range(board.nnodes)}
    _await_hosts(board, standbys=True)
    seg = max(work.run.segments(), default=-1) + 1
    return _decide(board, work, seg, held)


def _await_hosts(board: JobBoard, *, standbys: bool) -> None:
    """The lead: wait until every host of ``board`` beats (and, with ``standbys``, has said where it would open
    the job's store should host 0 be lost)."""
    want = range(1, board.nnodes) if standbys else ()
    board.wait(lambda: {} if all(board.beats(h) is not None for h in range(board.nnodes))
               and set(want) <= set(board.standbys()) else None, [], JOIN_S,
               what=f"all {board.nnodes} hosts to join the job's store at {board.endpoint}")


def claim_lead(run: RunFolder, endpoint: str) -> None:
    """Name the host whose store is at ``endpoint`` the job's lead in the shared run folder (atomically)."""
    tmp = run.lead_file.with_suffix(".tmp")
    tmp.write_text(endpoint)
    tmp.replace(run.lead_file)


def _still_lead(run: RunFolder, endpoint: str) -> None:
    """Raise unless the shared run folder still names this lead (see the module docstring).

    Raises:
        SupervisorError: another host took the job's decisions over.
    """
    named = run.lead_file.read_text().strip() if run.lead_file.is_file() else endpoint
    if named != endpoint:
        raise SupervisorError(f"another host took this job's decisions over (its store at {named}) after this host "
                              "lost touch with the others: this host stops, and the job goes on there")


def _decide(board: JobBoard, work: HostWork, seg: int, held: dict[int, list[str]]) -> list[dict[str, Any]]:
    """The lead's loop from segment ``seg`` (what ``work`` has prepared, on the hosts' devices ``held``)."""
    job = work.job
    board.set_fact("first", {"segment": seg})
    where = parse_endpoint(board.endpoint)[0]
    claim_lead(job.run, board.endpoint)
    try:
        while True:
            _still_lead(job.run, board.endpoint)
            devices, fields = work.begin(seg, held)
            hosts, counts, held = place(devices, held)
            go = {"hosts": hosts, "nproc": counts, "reason": work.reason, "endpoint": f"{where}:{free_port('')}",
                  **fields}
            job.event("hosts", segment=seg, hosts=hosts, nproc=counts, devices={str(h): held[h] for h in hosts})
            board.publish_go(seg, go)
            if board.host in hosts:
                _, seen_lost, live = _run_part(board, seg, go, work, job.log)
            else:  # this host's devices were dropped: it only decides, watching the hosts that run the segment
                job.log(f"segment {seg} runs without this host's devices")
                seen_lost, live = set(), board.watcher()
            ends = _collect(board, seg, hosts, seen_lost, live)
            _still_lead(job.run, board.endpoint)  # before anything is written for the next segment
            lost = [h for h in hosts if ends[h] is None]
            if lost:
                work.hosts_lost(seg, lost, held, board.lost_after_s)
                held = {h: ds for h, ds in held.items() if h not in lost}
            elif any("failures" in e or "launch_error" in e for e in ends.values() if e):
                failures = {int(r): (int(code), msg) for e in ends.values() if e
                            for r, (code, msg) in e.get("failures", {}).items()}
                if not failures:
                    raise SupervisorError("; ".join(e["launch_error"] for e in ends.values() if e and
                                                    "launch_error" in e))
                work.failed(seg, failures)
            elif work.finished(seg):
                board.publish_go(seg + 1, {"done": True})
                return job.events
            seg += 1
    except HpmlError as e:  # the other hosts stop with it, saying why
        board.publish_go(seg if board.read_go(seg) is None else seg + 1, {"stop": str(e)})
        raise


def _collect(board: JobBoard, seg: int, hosts: list[int], seen_lost: set[int],
             live: Liveness) -> dict[int, dict[str, Any] | None]:
    """Each host's end of segment ``seg``, or None for a host that was lost (silent for ``lost_after_s``).

    ``live`` has watched the beats since the segment started, so a host that died while the ranks ran is lost
    ``lost_after_s`` after its last beat, not after the ranks here stopped.
    """
    ends: dict[int, dict[str, Any] | None] = {}
    while len(ends) < len(hosts):
        for h in hosts:
            if h in ends:
                continue
            end = board.read_end(seg, h)
            if end is not None:
                ends[h] = end
            elif h in seen_lost or live.lost(h):
                ends[h] = None
        time.sleep(0.1)
    return ends
