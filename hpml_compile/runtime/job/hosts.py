"""What the hosts of a multi-host ``run --adapt`` job tell each other: one TCPStore at the rendezvous endpoint.

Each host runs ``hpml-compile run BUILD --adapt --nnodes N --node-rank R
--rdzv-endpoint HOST:PORT --run-dir SHARED``. Host 0 (the endpoint's host)
opens a :class:`torch.distributed.TCPStore` at ``HOST:PORT`` for the whole
job, the same store torchrun's c10d rendezvous uses, and every host's
supervisor joins it as a client. Segments (one torchrun launch each, a
static rendezvous of the hosts taking part) use ports the lead host picks
and publishes there. Through the store:

- every host beats (a counter it adds to every ``beat_s``); a host whose
  counter has not moved for ``lost_after_s`` on the reader's own clock is
  lost (no clocks are compared across hosts). Its agent and its ranks are
  gone, or cut off, either way its devices are. Host 0 is the store's own
  process: it is lost when the store stops answering, never for a silence
  while it answers (a host 0 descheduled on a busy machine is still there);
- each host posts how its part of a segment ended (:meth:`JobBoard.post_end`);
- the lead (host 0, the store's host) decides once what the next segment is
  and publishes it (:meth:`JobBoard.publish_go`); every host follows.

Why our own few keys and not torchrun's elastic membership: torchrun's
elastic agent restarts its ranks with the world that re-forms, but the ranks
of a build must run the plan made for that world, which is re-planned
(solve and codegen) once, before any rank starts; the keys carry that
decision. Membership is still torchrun's: each segment is an ordinary
torchrun rendezvous of the hosts the decision names.

Host 0 holds the store, as torchrun's c10d rendezvous host holds its own: the
job goes on without any other host. When host 0 itself is lost, the store
goes with it; each other host has published where it would open a new one
(:meth:`JobBoard.publish_standby`), and the lowest one left does
(:mod:`.multihost`), raising :class:`~hpml_compile.errors.LeadLost` only where
nobody can (the checkpoints in the shared run folder are intact; run the
hosts left again with the same ``--run-dir`` to resume).

Example:
    >>> from hpml_compile.runtime.job.launcher import free_port
    >>> board = JobBoard(f"localhost:{free_port()}", host=0, nnodes=1, beat_s=0.05)
    >>> board.publish_go(0, {"hosts": [0]}); board.read_go(0)
    {'hosts': [0]}
    >>> board.close()
"""

from __future__ import annotations

import datetime
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable

from ...errors import LeadLost, SupervisorError
from ..observe.runfolder import RunFolder
from .launcher import parse_endpoint

__all__ = ["JobBoard", "Liveness", "LOST_AFTER_S", "BEAT_S", "check_shared"]

BEAT_S = 0.25  # how often a host beats
LOST_AFTER_S = 3.0  # a host silent this long is lost: twelve beats missed (a busy host still beats within 1 s)


class Liveness:
    """Which hosts still beat, on this reader's own clock.

    Args:
        read: host -> its beat counter now (None when it never beat).
        lost_after_s: silence that makes a host lost.
        clock: the reader's monotonic clock.
    """

    def __init__(self, read: Callable[[int], int | None], lost_after_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read, self._after, self._clock = read, lost_after_s, clock
        self._seen: dict[int, tuple[int | None, float]] = {}

    def lost(self, host: int) -> bool:
        """Whether ``host``'s counter has not moved for ``lost_after_s`` (since this reader first asked).

        Example:
            >>> t, beats = [0.0], {1: 3}
            >>> live = Liveness(beats.get, 2.0, clock=lambda: t[0])
            >>> live.lost(1), (t.__setitem__(0, 1.5), live.lost(1))[1], (t.__setitem__(0, 2.5), live.lost(1))[1]
            (False, False, True)
            >>> beats[1] = 4; live.lost(1)
            False
        """
        now, value = self._clock(), self._read(host)
        last = self._seen.get(host)
        if last is None or last[0] != value:
            self._seen[host] = (value, now)
            return False
        return now - last[1] > self._after

    def silent_since(self, host: int) -> float | None:
        """The reader's clock when ``host``'s counter last moved (None before it was asked)."""
        last = self._seen.get(host)
        return None if last is None else last[1]


class JobBoard:
    """This host's view of the job's store (see the module docstring).

    Args:
        endpoint: ``HOST:PORT``: host 0 listens there, the others connect.
        host: this host's rank (``--node-rank``).
        nnodes: the hosts of the job.
        beat_s: how often this host beats.
        lost_after_s: the silence after which a host is lost.
        connect_s: how long a host waits for host 0's store.

    Raises:
        SupervisorError: host 0's store cannot be opened or reached.
    """

    def __init__(self, endpoint: str, host: int, nnodes: int, *, beat_s: float = BEAT_S,
                 lost_after_s: float = LOST_AFTER_S, connect_s: float = 60.0) -> None:
        self.endpoint, self.host, self.nnodes = endpoint, host, nnodes
        self.lost_after_s = lost_after_s
        self._addr = parse_endpoint(endpoint)
        self._timeout = datetime.timedelta(seconds=connect_s)
        try:
            self._store = self._client(master=host == 0)
        except Exception as e:  # noqa: BLE001 -- DistNetworkError, DistStoreError, RuntimeError by torch version
            what = "open" if host == 0 else "reach"
            raise SupervisorError(f"host {host} could not {what} the job's store at {endpoint} "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): start host 0 "
                                  "first, with the same --rdzv-endpoint, and check that its port is free and "
                                  "reachable from every host") from None
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._beating, args=(beat_s,), name="hpml-host-beat", daemon=True)
        self._beat.start()
        self.live = Liveness(self.beats, lost_after_s)

    def _client(self, *, master: bool = False) -> Any:
        import torch.distributed as dist

        host, port = self._addr
        return dist.TCPStore(host, port, is_master=master, wait_for_workers=False, timeout=self._timeout)

    def _beating(self, every_s: float) -> None:
        store = self._client()  # its own connection: one client per thread
        key = f"beat/{self.host}"
        while not self._stop.wait(every_s):
            try:
                store.add(key, 1)
            except Exception:  # noqa: BLE001 -- the store's host is gone: the main thread finds out and says so
                return

    def watcher(self) -> Liveness:
        """A :class:`Liveness` on a connection of its own, for another thread to watch the hosts with."""
        store = self._client()

        def read(host: int) -> int | None:
            key = f"beat/{host}"
            return int(store.add(key, 0)) if store.check([key]) else None

        return Liveness(read, self.lost_after_s)

    def close(self) -> None:
        """Stop beating (the store closes with host 0's process)."""
        self._stop.set()

    # --- reading and writing keys -----------------------------------------------------------------------------------
    def beats(self, host: int) -> int | None:
        """``host``'s beat counter, or None when it has not beaten yet."""
        key = f"beat/{host}"
        return int(self._store.add(key, 0)) if self._store.check([key]) else None

    def _put(self, key: str, value: dict[str, Any]) -> None:
        self._store.set(key, json.dumps(value))

    def end_reader(self) -> Callable[[int, int], dict[str, Any] | None]:
        """:meth:`read_end` on a connection of its own, for another thread (the store's client is one a thread)."""
        store = self._client()

        def read(seg: int, host: int) -> dict[str, Any] | None:
            key = f"end/{seg}/{host}"
            return json.loads(store.get(key)) if store.check([key]) else None

        return read

    def _get(self, key: str) -> dict[str, Any] | None:
        return json.loads(self._store.get(key)) if self._store.check([key]) else None

    def publish_go(self, seg: int, decision: dict[str, Any]) -> None:
        """The lead: what segment ``seg`` is (``hosts``, ``nproc``, ``build``, ``endpoint``...) or ``done``/``stop``."""
        self._put(f"go/{seg}", decision)

    def read_go(self, seg: int) -> dict[str, Any] | None:
        """The decision for segment ``seg``, or None while there is none."""
        return self._get(f"go/{seg}")

    def post_end(self, seg: int, end: dict[str, Any]) -> None:
        """This host: how its part of segment ``seg`` ended (``ok``, or the failures of its ranks)."""
        self._put(f"end/{seg}/{self.host}", end)

    def read_end(self, seg: int, host: int) -> dict[str, Any] | None:
        """How ``host``'s part of segment ``seg`` ended, or None while it has not said."""
        return self._get(f"end/{seg}/{host}")

    def set_fact(self, name: str, value: dict[str, Any]) -> None:
        """A fact of the job (the first segment, the shared folder's token)."""
        self._put(f"fact/{name}", value)

    def fact(self, name: str, wait_s: float) -> dict[str, Any]:
        """A fact host 0 publishes, waited for at most ``wait_s`` seconds while host 0 beats.

        Raises:
            SupervisorError: host 0 was lost, or said nothing in time.
        """
        return self.wait(lambda: self._get(f"fact/{name}"), [0], wait_s, what=f"host 0's {name}")

    def publish_standby(self, endpoint: str) -> None:
        """This host (not host 0): where it would open the job's store, should host 0 be lost."""
        self.set_fact(f"standby/{self.host}", {"endpoint": endpoint})

    def standbys(self) -> dict[int, str]:
        """Host -> the endpoint where it would open the job's store (the hosts other than 0 that published one)."""
        out = {}
        for h in range(1, self.nnodes):
            got = self._get(f"fact/standby/{h}")
            if got is not None:
                out[h] = str(got["endpoint"])
        return out

    # --- waiting ---------------------------------------------------------------------------------------------------
    def wait(self, poll: Callable[[], dict[str, Any] | None], watch: Iterable[int], wait_s: float | None, *,
             what: str, every_s: float = 0.1) -> dict[str, Any]:
        """Poll until ``poll`` returns something, while the ``watch`` hosts beat (host 0: while the store answers).

        Raises:
            SupervisorError: a watched host was lost, the store is gone, or ``wait_s`` passed.
        """
        deadline = None if wait_s is None else time.monotonic() + wait_s
        watch = list(watch)
        while True:
            try:
                got = poll()
                gone = [h for h in watch if h != 0 and self.live.lost(h)]  # host 0 is there while its store answers
            except Exception as e:  # noqa: BLE001 -- the store's host is gone
                raise self.store_lost(e) from None
            if got is not None:
                return got
            if gone:
                raise SupervisorError(f"host {gone[0]} was lost while this host waited for {what}")
            if deadline is not None and time.monotonic() > deadline:
                raise SupervisorError(f"host {self.host} waited {wait_s:g} s for {what} in vain")
            time.sleep(every_s)

    def store_lost(self, e: BaseException) -> LeadLost:
        """The error for a store that stopped answering: host 0 is gone."""
        return LeadLost(f"the job's store at {self.endpoint} stopped answering ({type(e).__name__}): host 0 "
                               "was lost, and with it the job's store; its checkpoints in the shared run folder are "
                               "intact: run the hosts left again with the same --run-dir (one of them as host 0) "
                               "to resume from the last one")


def check_shared(board: JobBoard, run_dir: Path, wait_s: float = 60.0) -> None:
    """Make sure every host reads the same run folder: host 0 writes a token there and publishes it.

    Checkpoints, plans and builds of the job live in the run folder, and after a host is lost the others
    resume from checkpoints it wrote: the folder must be one that every host mounts (NFS, a cluster file
    system, or one machine's disk for agents on one machine).

    Raises:
        SupervisorError: this host reads another token, or none: the folder is not shared.
    """
    path = RunFolder(run_dir).shared_token
    if board.host == 0:
        token = uuid.uuid4().hex
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(token)
        tmp.replace(path)
        board.set_fact("shared", {"token": token, "path": str(run_dir.resolve())})
        return
    want = board.fact("shared", wait_s)
    got = path.read_text().strip() if path.is_file() else None
    if got != want["token"]:
        raise SupervisorError(f"--run-dir {run_dir} on host {board.host} is not the folder host 0 writes "
                              f"({want['path']} there): a multi-host --adapt job keeps its checkpoints and builds "
                              "in the run folder and resumes on the hosts left from them, so every host must "
                              "pass --run-dir on a file system they all mount (NFS or a cluster file system)")
