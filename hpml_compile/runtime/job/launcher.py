"""Start the ranks of a run with torchrun, and turn what goes wrong into a message that says what to do.

Launch and rendezvous are torchrun's own (``torch.distributed.run``, called
in this process with the arguments a user would type): ``--standalone`` on
one host (a private rendezvous on a free port); across hosts, each host runs
``hpml-compile run`` with the same ``--nnodes`` and ``--rdzv-endpoint``:

- with ``--node-rank R``: torchrun's *static* rendezvous (node ``R`` gets
  global ranks ``R x nproc ..``, so the plan's first stages go to node 0,
  whose agent hosts the store at the endpoint);
- without: torchrun's *c10d* rendezvous (ranks in the order torchrun
  assigns; right for clusters of identical hosts).

Before anything starts, :func:`check_world` refuses a world that does not
match the build's plan, and :func:`preflight` a rendezvous port that is in
use on a host that is to listen there (:func:`check_port`), or an endpoint
that does not answer a host that is to join (:func:`wait_for_endpoint`,
bounded). A run folder used before keeps the earlier run in
``earlier/<n>/`` (:func:`prepare_run_dir`). After a failure, :func:`explain_failure` reads the
``errors/rank<r>.txt`` the workers wrote and names the rank that failed first.

Example:
    >>> spec = LaunchSpec(Path("build"), Path("out/run"), nproc=2)
    >>> torchrun_args(spec)[:3]
    ['--standalone', '--nnodes=1', '--nproc-per-node=2']
    >>> torchrun_args(LaunchSpec(Path("b"), Path("r"), 1, nnodes=2, node_rank=1,
    ...                          rdzv_endpoint="host0:29400"))[:4]
    ['--nnodes=2', '--node-rank=1', '--rdzv-backend=static', '--rdzv-endpoint=host0:29400']
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator, NoReturn

from ...errors import LaunchError, RankFailure
from ...plan import Plan
from ...schedule import rank_layout
from ..observe.runfolder import RUN_FILE, RUN_FILES, RunFolder
from .lifeline import mark_launcher
from .options import RunOptions, write_options
from .worker import threads_per_rank

__all__ = ["LaunchError", "RankFailure", "LaunchSpec", "torchrun_args", "check_world", "check_port", "free_port", "launch",
           "explain_failure", "prepare_run_dir", "preflight", "RUN_FILE", "parse_endpoint", "wait_for_endpoint",
           "RUN_FILES", "EARLIER", "keep_earlier_run", "owns_run_dir", "SCRIPT_ENTRY"]

RANK_ENTRY = Path(__file__).with_name("rank_entry.py")  # a script: see its docstring
SCRIPT_ENTRY = Path(__file__).with_name("script_entry.py")  # a user's script, its launcher watched: see its docstring


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """How to start a run.

    Attributes:
        build_dir: the build folder.
        run_dir: the run folder (measurements, errors).
        nproc: ranks on this host.
        nnodes: hosts.
        node_rank: this host's rank (static rendezvous), or None (c10d rendezvous, or one host).
        rdzv_endpoint: ``HOST:PORT`` of the rendezvous (None on one host: a free port).
        rdzv_id: job id shared by the hosts (c10d rendezvous).
        max_restarts: how often torchrun restarts the ranks after a failure.
        program: a script and its arguments to run on every rank instead of a build's worker (``launch``:
            the user's own training script, started through :data:`SCRIPT_ENTRY` so that each rank exits
            when this process is gone; ``build_dir`` is then unused).

    What a build's ranks do is the run folder's ``run.json`` (:func:`prepare_run_dir`), not a command line.
    """

    build_dir: Path
    run_dir: Path
    nproc: int
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "hpml-compile"
    max_restarts: int = 0
    program: tuple[str, ...] = ()

    @property
    def standalone(self) -> bool:
        return self.nnodes == 1 and self.rdzv_endpoint is None


# What a run writes into its folder (RUN_FILES, and the closed loop's next build) moves to earlier/<n>/ before
# another run in the same folder; anything else there (a checkpoint folder, the --adapt job's segments) stays.
_MOVED = (*RUN_FILES, "next_build")
EARLIER = "earlier"


def keep_earlier_run(run_dir: Path, log: Callable[[str], None] | None = None) -> Path | None:
    """Move the files an earlier run left in ``run_dir`` to ``run_dir/earlier/<n>/`` (n = 1, 2, ...), and say so.

    Only the files a run writes (:data:`RUN_FILES`) move; an ``--adapt`` job's segments, events and
    checkpoints, and anything of the user's, stay where they are.

    Args:
        run_dir: the run folder.
        log: where to say where they went (default: standard error).

    Returns:
        The folder they went to, or None when there was nothing to move.
    """
    found = [run_dir / name for name in _MOVED if (run_dir / name).exists()]
    if not found:
        return None
    taken = [int(p.name) for p in (run_dir / EARLIER).glob("*") if p.name.isdigit()]
    dest = run_dir / EARLIER / str(max(taken, default=0) + 1)
    dest.mkdir(parents=True)  # a new number: never into a folder that holds something
    for path in found:
        path.rename(dest / path.name)  # the same file system: a rename, nothing copied or lost
    (log or _stderr)(f"run: {run_dir} held an earlier run; its files are now in {dest}")
    return dest


def prepare_run_dir(build_dir: Path, run_dir: Path, info: dict[str, Any], options: RunOptions | None = None, *,
                    log: Callable[[str], None] | None = None, keep_earlier: bool = True) -> Path:
    """Make the run folder self-contained: ``run.json`` (with the ranks' options), the plan, and its profile.

    An earlier run's files in the same folder are moved, never deleted or overwritten, to
    ``RUN_DIR/earlier/<n>/`` (``n`` counts up), so that a report reads this run alone and the earlier one
    can still be reported on (``hpml-compile report RUN_DIR/earlier/<n>``).

    Args:
        build_dir: the build folder.
        run_dir: the run folder (created if needed).
        info: facts for ``run.json``.
        options: what every rank reads back (:func:`~.options.read_options`); default :class:`~.options.RunOptions`.
        log: where to say that an earlier run was moved (default: standard error).
        keep_earlier: move an earlier run away; False on the hosts of a multi-host job other than the
            rendezvous host (:func:`owns_run_dir`), which would otherwise move the files of their own job
            when the hosts share the folder.

    Returns:
        ``run_dir``.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    if keep_earlier:
        keep_earlier_run(run_dir, log)
    shutil.copyfile(build_dir / "plan.json", run_dir / "plan.json")
    if (build_dir / "profile.json").is_file():
        shutil.copyfile(build_dir / "profile.json", run_dir / "plan_profile.json")
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat()
    write_options(RunFolder(run_dir), options or RunOptions(), {"build": str(build_dir.resolve()), "started": stamp,
                                                                **info})
    return run_dir


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def torchrun_args(spec: LaunchSpec) -> list[str]:
    """The torchrun command line (without the program name) that runs the worker."""
    if spec.standalone:
        args = ["--standalone", "--nnodes=1", f"--nproc-per-node={spec.nproc}"]
    else:
        if not spec.rdzv_endpoint:
            raise LaunchError(f"--nnodes {spec.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every host)")
        args = [f"--nnodes={spec.nnodes}"]
        if spec.node_rank is not None:
            args += [f"--node-rank={spec.node_rank}", "--rdzv-backend=static"]
        else:
            args += ["--rdzv-backend=c10d", f"--rdzv-id={spec.rdzv_id}"]
        args += [f"--rdzv-endpoint={spec.rdzv_endpoint}", f"--nproc-per-node={spec.nproc}"]
    args += [f"--max-restarts={spec.max_restarts}", "--monitor-interval=0.2",
             *((str(SCRIPT_ENTRY), *spec.program) if spec.program
               else (str(RANK_ENTRY), str(spec.build_dir), str(spec.run_dir)))]
    return args


def check_world(plan: Plan, nproc: int, nnodes: int) -> None:
    """Refuse a world size that is not the plan's device count.

    Raises:
        LaunchError: saying how many processes the build needs and how to get them.
    """
    want = len(rank_layout(plan))  # one rank per device (an interleaved plan's stages share their group's)
    have = nproc * nnodes
    if have != want:
        devices = ", ".join(dict.fromkeys(d for st in plan.stages for d in st.devices))
        fix = f"--nproc {want}" if nnodes == 1 else f"--nnodes and --nproc with nnodes x nproc = {want}"
        raise LaunchError(f"the build's plan runs on {want} devices ({devices}), one rank each, but "
                          f"{nnodes} node(s) x {nproc} process(es) = {have} ranks: use {fix}, or recompile for "
                          f"{have} devices (hpml-compile compile MODEL --cluster local-cpu-{have} -o BUILD)")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``--rdzv-endpoint HOST:PORT``.

    Returns:
        ``(host, port)``; an IPv6 host loses its brackets.

    Raises:
        LaunchError: no host, or a port that is not a number in 1..65535.
    """
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise LaunchError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT with a port in 1..65535, e.g. "
                          f"localhost:29400 (the same on every host)")
    return host.strip("[]"), int(port)


def check_port(endpoint: str, *, peers_here: bool = False) -> None:
    """Refuse a rendezvous endpoint whose port is already in use on this host (which is to listen there).

    The store listens on every address of the host, so the port is tried on all of them, as the store
    would take it (``SO_REUSEADDR``: a port left in TIME_WAIT by a finished run is free).

    Args:
        endpoint: ``HOST:PORT``.
        peers_here: c10d rendezvous, where an agent on this host that finds the port taken joins whatever
            holds it: the message then says how to run several nodes on one host.

    Raises:
        LaunchError: naming the port and a free one to use instead.
    """
    host, port = parse_endpoint(endpoint)
    for family, anywhere in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((anywhere, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                continue  # no IPv6 on this host: nothing to collide with there
            also = (" (several nodes on one host: give each --node-rank, node 0 listens)") if peers_here else ""
            raise LaunchError(f"rendezvous port {port} on {host} is already in use ({e.strerror}): another job, "
                              f"or a previous run still shutting down{also}; pick a free port, e.g. "
                              f"--rdzv-endpoint {host}:{free_port()}") from e


RDZV_WAIT_S = 60.0  # how long a host that joins waits for the rendezvous host before it gives up


def wait_for_endpoint(endpoint: str, wait_s: float = RDZV_WAIT_S, log: Callable[[str], None] | None = None) -> None:
    """Wait, at most ``wait_s`` seconds, until something accepts connections at ``endpoint``.

    A host that joins a rendezvous would otherwise wait in torchrun for up to 10 minutes without a word
    when the endpoint is mistyped, the rendezvous host is not started, or a firewall is in the way.
    Opening and closing a connection is all it does (the store takes that as a client that left).

    Args:
        endpoint: ``HOST:PORT``.
        wait_s: the longest wait.
        log: where to say that it is waiting (once; default: standard error).

    Raises:
        LaunchError: the host name does not resolve, or nothing answered in time.
    """
    host, port = parse_endpoint(endpoint)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise LaunchError(f"--rdzv-endpoint {endpoint}: the host {host!r} cannot be found ({e.strerror}); check "
                          "its name (the rendezvous host's name or address, the same on every host)") from None
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError as e:
            why = e.strerror or type(e).__name__
        left = deadline - time.monotonic()
        if left <= 0:
            raise LaunchError(f"nothing answers at --rdzv-endpoint {endpoint} after {wait_s:g} s ({why}): start the "
                              "rendezvous host first (node 0 with --node-rank; the endpoint's host without), and "
                              "check the host name, the port and any firewall between the hosts")
        if not told:
            (log or _stderr)(f"run: waiting up to {wait_s:g} s for the rendezvous at {endpoint} ({why})")
            told = True
        time.sleep(min(0.5, left))


def _is_local(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname()):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def _hosts_store(spec: LaunchSpec, host: str) -> bool:
    """Whether this host's agent will listen at the endpoint: node 0 of a static rendezvous always; in a
    c10d rendezvous the agent whose host the endpoint names (torch's own test, so the two cannot disagree)."""
    if spec.node_rank is not None:
        return spec.node_rank == 0
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    except ImportError:  # pragma: no cover -- a torch that moved it: the same test by name and address
        return _is_local(host)
    return bool(_matches_machine_hostname(host))


@contextlib.contextmanager
def _quiet_elastic() -> Iterator[None]:
    # torchrun's agent logs every worker failure with a traceback banner; explain_failure says it better.
    # Its loggers set their own levels, so each is quietened by name (the agent's says "Received 2 death
    # signal" on Ctrl-C, which the launcher's own line says better).
    logs = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.distributed.elastic.agent.server.api")]
    old = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, old):
            log.setLevel(level)


def explain_failure(run_dir: Path, failures: dict[int, tuple[int, str]]) -> str:
    """A message naming the rank that failed first and why, then the others.

    Args:
        run_dir: the run folder (workers write ``errors/rank<r>.txt`` there).
        failures: rank -> (exit code, torchrun's message) for every failed rank.
    """
    reports = []
    for rank, (code, message) in failures.items():
        info = RunFolder(run_dir).read_error(rank)
        if info is not None:
            reports.append((info["time"], rank, info["message"], bool(info.get("user_error"))))
        else:  # died before it could report: no Python exception (a signal, an import error)
            why = message if message and "To enable traceback" not in message else f"exit code {code}"
            reports.append((float("inf"), rank, f"exited before it could report ({why}); it probably could not "
                            "start: see its output above", False))
    reports.sort()
    first_time, first, why, _ = reports[0]
    lines = [f"rank {first} failed{' first' if len(reports) > 1 else ''}: {why}"]
    for _, rank, msg, _ in reports[1:]:
        lines.append(f"  then rank {rank}: {msg.splitlines()[0][:160]}")
    lines.append(f"(measurements so far are in {run_dir})")
    return "\n".join(lines)


def owns_run_dir(spec: LaunchSpec) -> bool:
    """Whether this host sets up the run folder (moves an earlier run away): one host, or the rendezvous host.

    The others join only once that host listens (:func:`preflight` waits for it), which is after it has
    prepared the folder, so a folder the hosts share is never cleared under a running job.
    """
    if spec.standalone or not spec.rdzv_endpoint:
        return True
    return _hosts_store(spec, parse_endpoint(spec.rdzv_endpoint)[0])


def preflight(spec: LaunchSpec, *, wait_s: float = RDZV_WAIT_S, log: Callable[[str], None] | None = None) -> None:
    """The checks before any process starts: the command line, and the rendezvous endpoint.

    On one host torchrun picks a free port itself. Across hosts, a host that will listen at the endpoint
    (node 0 of a static rendezvous; the endpoint's own host in a c10d one) needs its port free; any other
    host needs the endpoint to answer, within ``wait_s`` seconds.

    Args:
        spec: the launch.
        wait_s: how long a joining host waits for the rendezvous host.
        log: where to say that it is waiting.

    Raises:
        LaunchError: a bad endpoint, a port already in use on this host, or an endpoint that does not answer.
    """
    torchrun_args(spec)
    if spec.standalone or not spec.rdzv_endpoint:
        return
    host, _ = parse_endpoint(spec.rdzv_endpoint)
    if _hosts_store(spec, host):
        check_port(spec.rdzv_endpoint, peers_here=spec.node_rank is None)  # fail now, with a port that is free
    else:
        wait_for_endpoint(spec.rdzv_endpoint, wait_s, log)


@contextlib.contextmanager
def _ranks_stop_with_sigterm(seen: list[int]) -> Iterator[None]:
    """While torchrun runs, whatever signal stops it is passed on to the ranks as SIGTERM (``seen`` gets the real one).

    torchrun's agent sends every rank the signal it received. A rank whose
    Python is still starting (before :mod:`.rank_entry` runs its first line)
    turns SIGINT into a "Fatal Python error ... KeyboardInterrupt" traceback,
    while SIGTERM ends it silently. The agent installs its handler from a
    module attribute at start-up (``_terminate_process_handler``), so the
    replacement is swapped in there for the launch and restored after; if a
    later torch renames it, nothing is patched and only the message differs.
    """
    try:
        from torch.distributed.elastic.multiprocessing import api as mp_api
    except ImportError:  # pragma: no cover -- torch without elastic
        yield
        return
    original = getattr(mp_api, "_terminate_process_handler", None)
    if original is None or not hasattr(mp_api, "SignalException"):
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001 -- the replaced handler's shape
        seen.append(signum)
        raise mp_api.SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.SIGTERM)

    mp_api._terminate_process_handler = handler
    try:
        yield
    finally:
        mp_api._terminate_process_handler = original


def stopped(sig: int, run_dir: Path) -> NoReturn:
    """End the launch that ``sig`` stopped (torchrun stopped the ranks): one line, no traceback.

    Raises:
        KeyboardInterrupt: for SIGINT (the CLI prints ``interrupted`` and exits 130).
        SystemExit: ``128 + sig`` for any other signal.
    """
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
    print(f"hpml-compile: stopped by {name}; every rank was stopped; what was measured is in {run_dir}",
          file=sys.stderr, flush=True)
    if sig == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + int(sig))


def launch(spec: LaunchSpec) -> None:
    """Run the worker on ``spec.nproc`` ranks of this host under torchrun; return when all have finished.

    Raises:
        LaunchError: a bad endpoint or a port in use, a rank that failed
            (which one first, and why), or a rendezvous that did not form.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    preflight(spec)
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    # Ranks share this host's cores; torchrun would otherwise warn and pick 1.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(spec.nproc)))
    mark_launcher()  # every rank exits when this process is gone, SIGKILL included (see .lifeline)
    seen: list[int] = []
    try:
        with _quiet_elastic(), _ranks_stop_with_sigterm(seen):
            run(parse_args(torchrun_args(spec)))
    except ChildFailedError as e:
        failures = {rank: (f.exitcode, f.message) for rank, f in e.failures.items()}
        raise RankFailure(explain_failure(spec.run_dir, failures), failures) from None
    except SignalException as e:  # torchrun has already stopped the ranks
        stopped(seen[0] if seen else e.sigval, spec.run_dir)
    except Exception as e:  # noqa: BLE001 -- rendezvous and store errors come in several types
        text = str(e)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise LaunchError(f"the rendezvous port of {spec.rdzv_endpoint} is already in use: pick a free one, "
                              f"e.g. --rdzv-endpoint localhost:{free_port()}") from None
        if type(e).__name__ in ("RendezvousTimeoutError", "RendezvousClosedError", "DistNetworkError",
                                "DistStoreError", "RendezvousConnectionError", "TimeoutError"):
            raise LaunchError(f"the rendezvous at {spec.rdzv_endpoint or 'localhost'} did not form "
                              f"({type(e).__name__}: {text.splitlines()[0] if text else ''}): check that all "
                              f"{spec.nnodes} hosts run `hpml-compile run` (or `launch`) with the same --nnodes and "
                              "--rdzv-endpoint, that node 0 can be reached on that port, and that each "
                              "--node-rank is used once") from None
        raise
