"""What a CPU rank's process holds before the model: its baseline resident set, measured once per host.

A CPU device's memory is its process's: a rank holds the interpreter, torch,
the runtime's imports (the tracer, TensorBoard's writer, gloo's buffers) and
only then the model's tensors. On the 2-core development VM a rank of the
demo held 408-456 MiB for 15 MiB of tensors. :func:`runtime_baseline` starts a
fresh interpreter that imports what a rank imports, joins a one-rank gloo
group and runs one all-reduce, and reads its peak resident set (``VmHWM``);
the memory model adds it to every CPU device's bytes
(:func:`hpml_compile.memory.process_bytes`).

Starting an interpreter that imports torch costs seconds, so the figure is
kept in a small JSON cache per host (``$XDG_CACHE_HOME/hpml-compile/host.json``,
else ``~/.cache/...``; ``HPML_HOST_CACHE`` names another file, ``none`` turns
it off), keyed by the CPU model, the Python and torch versions and this
package's version: the profile says where its figure came from. Figures
measured while the host is busy (a load average above its CPU count) price the
plan at hand but are not cached. Why a file of
our own and not a library's cache: nothing else records these facts.

Example:
    >>> key = host_key({"cpu_model": "AMD EPYC"})
    >>> key.startswith("AMD EPYC | python ")
    True
"""

from __future__ import annotations

import datetime
import json
from importlib import metadata
import os
import subprocess
import sys
from pathlib import Path
from dataclasses import replace
from typing import Any, Callable, Mapping

import torch

from ..errors import HpmlError
from ..ir import Profile
from ..schema import write_json_atomic

__all__ = ["runtime_baseline", "this_host", "with_process", "host_key", "cache_path", "cached", "remember",
           "BASELINE_CODE"]

# What a rank imports before it builds its model (runtime.job.worker, the tracer, TensorBoard's writer), then one
# gloo group of one rank and an all-reduce: the runtime up, no model.
BASELINE_CODE = """
import os, statistics, sys, tempfile
import torch
torch.set_num_threads(1)
import torch._dynamo
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
from hpml_compile.hostmem import keep_freed_memory
keep_freed_memory()
from hpml_compile.cluster import load_cluster
from hpml_compile.codegen import generate
from hpml_compile.plan import Plan, Schedule, Stage
from hpml_compile.runtime import Pipeline
from hpml_compile.trace import trace
from hpml_compile.runtime.job import worker
tmp = tempfile.mkdtemp(prefix="hpml-baseline-")
dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "rendezvous"), rank=0, world_size=1)
model, x, y = torch.nn.Linear(4, 2), torch.randn(2, 4), torch.randn(2, 2)
gm = trace(model, (x,))
body = tuple(n.name for n in gm.graph.nodes)
plan = Plan("baseline", load_cluster("local-cpu-1"), Schedule.GPIPE, 1, (Stage(0, ("cpu0",), body),))
generate(gm, plan, os.path.join(tmp, "build"))
pipe = Pipeline.from_build(os.path.join(tmp, "build"), model, run_dir=os.path.join(tmp, "run"),
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
for _ in range(STEPS):
    pipe.step((x,), y, torch.nn.functional.mse_loss)
rows = pipe.metrics[3:]
extra = statistics.median(m.wall_ms - m.step_ms for m in rows)
pipe.close()
dist.destroy_process_group()
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print(int(line.split()[1]) * 1024, round(extra, 4))
""".replace("STEPS", "40")



def host_key(facts: Mapping[str, Any]) -> str:
    """The cache key of this host's measured facts: CPU model, Python, torch and this package's versions."""
    try:
        version = metadata.version("hpml-compile")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    return (f"{facts.get('cpu_model', '?')} | python {sys.version.split()[0]} | torch {torch.__version__} | "
            f"hpml-compile {version}")


def cache_path() -> Path | None:
    """The host cache file (None: turned off with ``HPML_HOST_CACHE=none``)."""
    named = os.environ.get("HPML_HOST_CACHE")
    if named:
        return None if named.lower() == "none" else Path(named)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "hpml-compile" / "host.json"


def cached(key: str, what: str) -> dict[str, Any] | None:
    """The cached entry ``what`` for host ``key`` (None: none, or the cache is off or unreadable)."""
    path = cache_path()
    if path is None or not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text()).get(key, {}).get(what)
    except (OSError, ValueError, AttributeError):
        return None
    return entry if isinstance(entry, dict) else None


def remember(key: str, what: str, entry: Mapping[str, Any]) -> Path | None:
    """Store ``entry`` as ``what`` for host ``key`` (atomically); the file written, or None (cache off or not
    writable: the figure is then measured again next time)."""
    path = cache_path()
    if path is None:
        return None
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(data, dict):
            data = {}
        data.setdefault(key, {})[what] = dict(entry)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(data, path)
    except (OSError, ValueError):
        return None
    return path


def runtime_baseline(*, timeout_s: float = 120.0) -> dict[str, Any]:
    """Measure this host's baseline resident set of a CPU rank (see the module docstring) in a fresh interpreter.

    Args:
        timeout_s: how long the fresh interpreter may take.

    Returns:
        ``{"bytes": peak RSS, "source": how it was measured}`` (the profile's ``devices["cpu"]["process"]``).

    Raises:
        HpmlError: the interpreter failed or printed no figure (not Linux: no ``/proc/self/status``).
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        done = subprocess.run([sys.executable, "-c", BASELINE_CODE], capture_output=True, text=True, env=env,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise HpmlError(f"measuring a CPU rank's baseline memory took over {timeout_s:.0f} s: the memory model "
                        "leaves it out") from e
    lines = done.stdout.strip().splitlines()
    last = lines[-1].split() if lines else []
    if done.returncode != 0 or len(last) != 2 or not last[0].isdigit():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise HpmlError(f"measuring a CPU rank's baseline memory failed ({tail}): the memory model leaves it out")
    day = datetime.date.today().isoformat()
    return {"bytes": int(last[0]), "step_ms": float(last[1]),
            "source": f"measured {day}: peak RSS of a fresh interpreter with torch and the runtime up (one gloo "
                      "rank, a 10-parameter model), and its Pipeline.step's wall clock beyond the executor's span"}


def this_host(log: Callable[[str], None] = print, *, measure: bool = True, refresh: bool = False
              ) -> dict[str, Any]:
    """This host's measured gloo link between two CPU processes and a rank's baseline memory, cached per host.

    What ``compile``, ``profile`` and ``demo`` plan with: each is read from the host cache (see the module
    docstring) where it was measured before on this CPU model with these versions, else measured now
    (:func:`hpml_compile.profile.links.measure_local_link`, :func:`runtime_baseline`) and cached. One line per
    figure says which.

    Args:
        log: where the lines go.
        measure: measure what the cache lacks (False: only what is cached; the Python API, which runs inside a
            job's ranks, starts no processes).
        refresh: measure again even where cached (and cache the new figures).

    Returns:
        ``{"link": ..., "process": ...}``, each present where known (the profile's ``devices["cpu"]`` entries).
    """
    from .links import measure_local_link
    from .timing import host_facts

    key = host_key(host_facts())
    where = cache_path()
    out: dict[str, Any] = {}
    load, cpus = _load()
    keep = load <= cpus  # figures timed while other programs keep the cores busy price this plan, never later ones
    if not keep and measure:
        log(f"  this host is busy (load average {load:.1f} on {cpus} CPUs): what is measured now prices this plan "
            "only and is not cached")
    link = None if refresh else cached(key, "link")
    if link is not None and isinstance(link.get("gbps"), (int, float)):
        out["link"] = link
        log(f"  gloo link between 2 processes of this host: {link['gbps']:.3g} GB/s, {link['latency_us']:.1f} us, "
            f"cached in {where} for this CPU model (delete the file, or set HPML_HOST_CACHE=none, to time it again)")
    elif measure:
        link = measure_local_link(log=log)
        link = {**link, "source": f"{link['source']}; {datetime.date.today().isoformat()}"}
        if keep:
            remember(key, "link", link)
        out["link"] = link
    hit = None if refresh else cached(key, "runtime_baseline")
    try:
        if hit is not None and isinstance(hit.get("bytes"), int):
            out["process"] = {**hit, "source": f"{hit.get('source', 'measured')}; cached in {where}"}
        elif measure:
            out["process"] = runtime_baseline()
            if keep:
                remember(key, "runtime_baseline", out["process"])
    except HpmlError as e:
        log(f"  {e}")
    if "process" in out:
        extra = out["process"].get("step_ms")
        log(f"  a CPU rank holds {out['process']['bytes'] / 2**20:.0f} MiB before its model"
            + (f" and spends {extra:.2f} ms a step on the runtime's bookkeeping" if extra is not None else "")
            + f" ({out['process']['source']})")
    return out


def _load() -> tuple[float, int]:
    """``(one-minute load average, logical CPUs)`` of this host (load 0.0 where the platform has none)."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        load = 0.0
    return load, os.cpu_count() or 1


def with_process(prof: Profile, process: Mapping[str, Any]) -> Profile:
    """``prof`` with ``process`` (:func:`runtime_baseline`) recorded as what a CPU rank of its host holds before its
    model (``devices["cpu"]["process"]``), which the memory model adds to each CPU device
    (:meth:`hpml_compile.costgraph.CostGraph.process_bytes`)."""
    devices = {k: dict(v) for k, v in prof.devices.items()}
    devices.setdefault("cpu", {})["process"] = {
        "bytes": int(process["bytes"]), "source": str(process.get("source", "")),
        **({"step_ms": float(process["step_ms"])} if isinstance(process.get("step_ms"), (int, float)) else {}),
        **({"stage_only": True} if process.get("stage_only") else {})}
    return replace(prof, devices=devices)
