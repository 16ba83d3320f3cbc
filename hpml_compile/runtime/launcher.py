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
match the build's plan, and :func:`check_port` a rendezvous port that is in
use on this host. After a failure, :func:`explain_failure` reads the
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
import json
import logging
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NoReturn

from ..errors import LaunchError, RankFailure
from ..plan import Plan
from .lifeline import mark_launcher
from .worker import error_path, threads_per_rank

__all__ = ["LaunchError", "RankFailure", "LaunchSpec", "torchrun_args", "check_world", "check_port", "free_port", "launch",
           "explain_failure", "prepare_run_dir", "preflight", "RUN_FILE"]

RUN_FILE = "run.json"
RANK_ENTRY = Path(__file__).with_name("rank_entry.py")  # a script: see its docstring


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
        worker_args: extra arguments for :mod:`.worker`.
    """

    build_dir: Path
    run_dir: Path
    nproc: int
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "hpml-compile"
    max_restarts: int = 0
    worker_args: tuple[str, ...] = ()

    @property
    def standalone(self) -> bool:
        return self.nnodes == 1 and self.rdzv_endpoint is None


def prepare_run_dir(build_dir: Path, run_dir: Path, info: dict[str, Any]) -> Path:
    """Make the run folder self-contained: ``run.json``, the plan, and the profile the plan was made for.

    Measurements of an earlier run in the same folder are removed (a report must not mix two runs).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics", "errors", "tb"):
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    shutil.copyfile(build_dir / "plan.json", run_dir / "plan.json")
    if (build_dir / "profile.json").is_file():
        shutil.copyfile(build_dir / "profile.json", run_dir / "plan_profile.json")
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat()
    (run_dir / RUN_FILE).write_text(json.dumps({"build": str(build_dir.resolve()), "started": stamp, **info},
                                               indent=2) + "\n")
    return run_dir


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
    args += [f"--max-restarts={spec.max_restarts}", "--monitor-interval=0.2", str(RANK_ENTRY),
             str(spec.build_dir), str(spec.run_dir), *spec.worker_args]
    return args


def check_world(plan: Plan, nproc: int, nnodes: int) -> None:
    """Refuse a world size that is not the plan's device count.

    Raises:
        LaunchError: saying how many processes the build needs and how to get them.
    """
    want = sum(len(st.devices) for st in plan.stages)
    have = nproc * nnodes
    if have != want:
        devices = ", ".join(d for st in plan.stages for d in st.devices)
        fix = f"--nproc {want}" if nnodes == 1 else f"--nnodes and --nproc with nnodes x nproc = {want}"
        raise LaunchError(f"the build's plan runs on {want} devices ({devices}), one rank each, but "
                          f"{nnodes} node(s) x {nproc} process(es) = {have} ranks: use {fix}, or recompile for "
                          f"{have} devices (hpml-compile compile MODEL --cluster local-cpu-{have} -o BUILD)")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port(endpoint: str) -> None:
    """Refuse a rendezvous endpoint on this host whose port is already in use.

    Raises:
        LaunchError: naming the port and a free one to use instead.
    """
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise LaunchError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT, e.g. localhost:29400")
    try:
        with socket.socket() as s:
            s.bind((socket.gethostbyname(host or "localhost"), int(port)))
    except OSError as e:
        raise LaunchError(f"rendezvous port {port} on {host or 'localhost'} is already in use ({e.strerror}): "
                          f"another job, or a previous run still shutting down; pick a free port, e.g. "
                          f"--rdzv-endpoint {host or 'localhost'}:{free_port()}") from e


def _is_local(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname()):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


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
        path = error_path(run_dir, rank)
        if path.is_file():
            info = json.loads(path.read_text())
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


def preflight(spec: LaunchSpec) -> None:
    """The checks that need no process: the command line, and the port node 0's store will listen on.

    Raises:
        LaunchError: a bad endpoint, or a port already in use on this host.
    """
    torchrun_args(spec)
    if spec.rdzv_endpoint and spec.node_rank == 0 and _is_local(spec.rdzv_endpoint.rpartition(":")[0]):
        check_port(spec.rdzv_endpoint)  # node 0 hosts the store: fail now, with a port that is free


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

    def handler(signum: int, _frame: object) -> None:
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
                              f"{spec.nnodes} hosts run `hpml-compile run` with the same --nnodes and "
                              "--rdzv-endpoint, that node 0 can be reached on that port, and that each "
                              "--node-rank is used once") from None
        raise
