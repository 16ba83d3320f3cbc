"""What a CPU rank's process holds before the model and pays each step besides it, measured once per host.

A CPU device's memory is its process's: a rank holds the interpreter, torch,
the runtime's imports (the tracer, TensorBoard's writer, gloo's buffers) and
only then the model's tensors. On the 2-core development VM a rank of the
demo held 408-456 MiB for 15 MiB of tensors. :func:`runtime_baseline` starts two
fresh interpreters that import what a rank imports, join one gloo group as
the two ranks of a data-parallel stage of a tiny model, and train it a few
dozen steps through the runtime; it reads their peak resident set
(``VmHWM``), which the memory model adds to every CPU device's bytes
(:func:`hpml_compile.memory.process_bytes`), and, from the runtime's own
measurements of those steps, what a step pays on this host beyond its
compute and transfers (:func:`replicated_step_figures`): ``Pipeline.step``'s
bookkeeping around the executor, the loss agreement, what two ranks both pay to
meet before the gradient sync, and how far apart two ranks that did the same work
reach it, each as a fixed part and a part per millisecond of the compute before
it. The simulator adds those to the step (:func:`hpml_compile.simulate.simulate`).

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
           "older_link", "BASELINE_CODE", "FIGURES"]

# The replicated step's figures the probe measures (replicated_step_figures), each a fixed part and a part per ms of
# the compute before it.
FIGURES = ("agree_ms", "agree_per_ms", "meet_ms", "meet_per_ms", "skew_ms", "skew_per_ms", "fit_compute_ms",
           "step_per_ms")

# What a rank imports before it builds its model (runtime.job.worker, the tracer, TensorBoard's writer), then a gloo
# group and steps of a tiny model through the runtime: the runtime up, no model to speak of. Alone (no
# HPML_PROBE_WORLD), one rank; with HPML_PROBE_WORLD=2 and HPML_PROBE_RANK, one of two ranks of a data-parallel stage
# (rendezvous in HPML_PROBE_DIR), whose steps also time what a replicated step pays beyond its compute. Each forward
# runs matrix products on a buffer (no parameters: the memory figure stays the runtime's), about 1 ms of them and
# then about 20 ms (a small model's step), so that the ranks meet at the gradient sync as ranks that computed do. The last line: peak RSS,
# the median of Pipeline.step's wall clock beyond the executor's span and the median of the executor's span beyond
# its timed parts (ms); the line before it: per step, the loss agreement, the wait at the sync's meeting, the
# compute and Pipeline.step's wall clock beyond the executor's span (ms).
BASELINE_CODE = """
import json, os, statistics, sys, tempfile
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
world = int(os.environ.get("HPML_PROBE_WORLD", "1"))
rank = int(os.environ.get("HPML_PROBE_RANK", "0"))
tmp = os.environ.get("HPML_PROBE_DIR") or tempfile.mkdtemp(prefix="hpml-baseline-")
dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "rendezvous"), rank=rank, world_size=world)

class Probe(torch.nn.Module):
    def __init__(self, products):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.products = products
        self.register_buffer("burst", torch.eye(256) * 0.5, persistent=False)
        self.register_buffer("seq", torch.arange(32.0).view(1, 2, 4, 4), persistent=False)
        self.register_buffer("ids", torch.tensor([[0, 3]]), persistent=False)
        self.register_buffer("labels", torch.tensor([1, 2]), persistent=False)

    def forward(self, x):
        a = self.burst * (1.0 + 0.0 * x.sum())  # depends on the input: traced, not folded to a constant
        for _ in range(self.products):
            a = a @ self.burst
        h = self.lin(x)
        return h + a[0, :2] * 0.0 + self.kernels(h) * 0.0

    def kernels(self, h):
        # a transformer's and an MLP's kernels on a few elements, forward and backward (on the gradient's path):
        # their code is part of what a rank holds (the development VM: 8 MiB more file-backed pages than linear
        # layers alone)
        t = h.sum() * 0.0 + self.seq
        n = torch.nn.functional.layer_norm(t, (4,))
        att = torch.nn.functional.scaled_dot_product_attention(n, n, n, is_causal=True)
        g = torch.nn.functional.gelu(att) + torch.nn.functional.silu(att) + torch.tanh(att)
        e = torch.nn.functional.embedding(self.ids, g.view(8, 4))
        logits = torch.softmax(e.view(2, 4), -1).log() + e.view(2, 4)
        return (torch.nn.functional.cross_entropy(logits, self.labels)
                + torch.nn.functional.dropout(g, 0.1).sum())

def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

devices = tuple(f"cpu{i}" for i in range(world))
steps, extras, inside, rss = [], [], [], None
for products in (SHORT, LONG):  # two lengths of compute, so that what the sync waits can be told per ms of it
    torch.manual_seed(0)  # the same batch on every rank
    model, x, y = Probe(products), torch.randn(2 * world, 4), torch.randn(2 * world, 2)
    gm = trace(model, (x,))
    plan = Plan("baseline", load_cluster(f"local-cpu-{world}"), Schedule.GPIPE, 1,
                (Stage(0, devices, tuple(n.name for n in gm.graph.nodes)),))
    build = os.path.join(tmp, f"build{rank}-{products}")
    generate(gm, plan, build)
    pipe = Pipeline.from_build(build, model, run_dir=os.path.join(tmp, f"run{rank}-{products}"),
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    pipe.ride_agreement = False  # the loss agreement timed on its own, as a pipeline runs it (a stage's meeting apart)
    for _ in range(STEPS):
        pipe.step((x,), y, torch.nn.functional.mse_loss)
    rows = pipe.metrics[5:]
    extras += [m.wall_ms - m.step_ms for m in rows]
    # the executor's own work: its span less the compute, the sync, the optimizer and the LOSS token (the set-up,
    # the loop, the events around each token)
    inside += [m.step_ms - m.fwd_ms - m.bwd_ms - m.allreduce_ms - m.sync_wait_ms - m.optimizer_ms - m.loss_ms
               for m in rows]
    # the loss agreement (the executor's span less the compute, the gradient sync with its meeting and the
    # optimizer), the wait at the sync's meeting, the compute
    steps += [[m.step_ms - m.pipeline_ms - m.allreduce_ms - m.sync_wait_ms - m.optimizer_ms, m.sync_wait_ms,
               m.fwd_ms + m.bwd_ms, m.wall_ms - m.step_ms] for m in rows]
    pipe.close()
    rss = rss or peak_rss()  # a rank of one job: the second model's groups come on top of the first's
dist.destroy_process_group()
print("steps", json.dumps(steps))
print(rss, round(statistics.median(extras), 4), round(statistics.median(inside), 4))
""".replace("STEPS", "40").replace("SHORT", "4").replace("LONG", "64")



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
    """Measure what a CPU rank of this host holds and pays besides its model (the module docstring), in two fresh
    interpreters that run the two ranks of a data-parallel stage of a tiny model through the runtime.

    Args:
        timeout_s: how long the fresh interpreters may take.

    Returns:
        The profile's ``devices["cpu"]["process"]``: ``bytes`` (the larger rank's peak RSS), ``step_ms`` (the
        larger rank's median of ``Pipeline.step``'s wall clock beyond the executor's span), ``executor_ms`` (the
        larger rank's median of the executor's span beyond the compute, the sync, the optimizer and the ``LOSS``
        token: its set-up, its loop and the events it records around each token), the fixed and per-ms
        parts of the loss agreement, the meeting and the skew (:func:`replicated_step_figures`), ``source``.

    Raises:
        HpmlError: an interpreter failed or printed no figure (not Linux: no ``/proc/self/status``).
    """
    import tempfile
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "HPML_PROBE_WORLD": "2"}
    with tempfile.TemporaryDirectory(prefix="hpml-baseline-") as tmp:
        logs = [(Path(tmp, f"out{r}"), Path(tmp, f"err{r}")) for r in (0, 1)]
        procs = []
        for r, (out, err) in enumerate(logs):
            with out.open("w") as o, err.open("w") as e:  # files, not pipes: nothing blocks on a full pipe
                procs.append(subprocess.Popen([sys.executable, "-c", BASELINE_CODE], stdout=o, stderr=e, text=True,
                                              env={**env, "HPML_PROBE_RANK": str(r), "HPML_PROBE_DIR": tmp}))
        deadline = time.monotonic() + timeout_s
        try:  # until both end, one fails (its peer would wait for it until the time-out) or time runs out
            while any(x.poll() is None for x in procs) and not any(x.poll() for x in procs):
                if time.monotonic() > deadline:
                    raise HpmlError(f"measuring a CPU rank's baseline took over {timeout_s:.0f} s: the memory model "
                                    "and the step leave it out")
                time.sleep(0.05)
        finally:
            for proc in procs:  # never left behind
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        outs = [(x.returncode, out.read_text(), err.read_text()) for x, (out, err) in zip(procs, logs)]
    # a rank that failed first: its error, not its killed peer's, names the cause
    ranks = [_parse_baseline(code, out, err) for code, out, err in sorted(outs, key=lambda o: o[0] <= 0)]
    figures = replicated_step_figures([steps for *_, steps in ranks])
    day = datetime.date.today().isoformat()
    return {"bytes": max(b for b, *_ in ranks), "step_ms": max(x for _, x, _, _ in ranks),  # a fit's, where it has one
            "executor_ms": max(x for _, _, x, _ in ranks), **figures,
            "source": f"measured {day}: two fresh interpreters with torch and the runtime up, the ranks of a "
                      "data-parallel stage of a tiny model (about 1 ms, then 20 ms of compute a step): peak RSS, "
                      "Pipeline.step's wall clock beyond the executor's span, the executor's own work between its "
                      "timed parts, the loss agreement, the meeting at the sync and the ranks' skew there (means)"}


def _parse_baseline(code: int, out: str, err: str) -> tuple[int, float, float, list[list[float]]]:
    """``(peak RSS, bookkeeping ms, executor's own ms, per-step rows)`` one probe rank printed
    (:data:`BASELINE_CODE`).

    Raises:
        HpmlError: the rank failed or printed no figure.
    """
    lines = out.strip().splitlines()
    last = lines[-1].split() if lines else []
    rows = next((json.loads(line[len("steps "):]) for line in lines if line.startswith("steps ")), None)
    if code != 0 or len(last) != 3 or not last[0].isdigit() or rows is None:
        tail = (err.strip().splitlines() or ["no output"])[-1][:200]
        raise HpmlError(f"measuring a CPU rank's baseline failed ({tail}): the memory model and the step leave it out")
    return int(last[0]), float(last[1]), float(last[2]), rows


def replicated_step_figures(ranks: list[list[list[float]]]) -> dict[str, float]:
    """What a replicated step pays beyond compute and transfers, from two probe ranks' steps.

    Each rank's row of a step is ``[loss agreement ms, wait at the sync's meeting ms, compute ms]``, and may end
    with ``Pipeline.step``'s wall clock beyond the executor's span (ms); the rows of both ranks are step by step, the shorter compute's steps first (:data:`BASELINE_CODE` runs about 1 ms of
    compute a step, then about 20).

    - ``agree_ms`` and ``agree_per_ms``: the loss agreement as the runtime runs it where it has an all-reduce of
      its own (a gloo all-reduce of four float64s, handed to gloo's thread after the step's work: a pipeline's;
      the probe's ranks run it so, though a one-stage plan's rides its sync's meeting), per step the two ranks'
      mean. The alpha-beta
      link, fitted at 64 KiB and up, says less: on the 2-core development VM it priced 0.48 ms where the demo's
      steps took about 1.
    - ``meet_ms`` and ``meet_per_ms``: the meeting before the gradient sync (a one-element all-reduce over the
      stage, :meth:`hpml_compile.runtime.sync.comm.DistComm._collective`) as both ranks pay it: per step the
      smaller of the two ranks' waits there (the later rank's, which waited for nobody). The link prices it at
      its latency; on the 2-core development VM the demo's ranks paid 0.4-1.2 ms (median per run) after their
      compute, 0.2-0.4 ms after the optimizer's short step.
    - ``skew_ms`` and ``skew_per_ms``: the ranks leave their compute at different times (a time slice taken by
      another thread or process, a wake-up), and the step waits for the later: per step, half the difference of
      the two ranks' waits at the sync's meeting (the later rank came that much later; the step pays the maximum
      of the two ranks' compute, which is their mean plus half the difference).
    - ``step_ms`` and ``step_per_ms`` (where the rows carry it): ``Pipeline.step``'s bookkeeping around the
      executor, per step the two ranks' mean. Most of it is fixed (the batch check, memory counting), but the
      host's sampler reads ``/proc`` about every :data:`hpml_compile.runtime.observe.host.WINDOW_S` of steps
      (0.27-0.30 ms a sample on the 2-core development VM), so a step pays a share of a sample that grows with
      its length: the part per ms. Its median said nothing of the sampling while fewer than half the steps
      sampled (a 23 ms step samples at about two steps in five).

    Each is fitted as a fixed part plus a part per millisecond of the compute before it (:func:`_fit`): a tiny
    collective's gloo threads and a rank's time slices are likelier to be taken the longer the ranks computed,
    and the two lengths of compute tell. ``fit_compute_ms`` is the longer one: beyond it the figures stay at
    their value there (a line through 1 and 20 ms says nothing of a step of 150). Each half's figure is a mean, not a median: these parts are
    heavy-tailed (most steps pay a fraction of a millisecond, a few pay several), and a step is their sum, so
    the step's typical time is near the sum of their means; the sum of their medians fell 4-5 ms short of the
    demo's measured step of about 26 ms on the development VM.

    Args:
        ranks: two lists of rows, one per rank, step by step.

    Returns:
        ``{"agree_ms", "agree_per_ms", "meet_ms", "meet_per_ms", "skew_ms", "skew_per_ms", "fit_compute_ms"}``,
        with ``"step_ms", "step_per_ms"`` where the rows carry the bookkeeping.

    Raises:
        HpmlError: fewer than two ranks or no step.

    Example:
        >>> a = [[1.0, 0.2, 1.0], [1.2, 0.6, 1.0], [0.8, 0.2, 11.0], [1.0, 1.2, 11.0]]
        >>> b = [[1.0, 0.4, 1.0], [1.0, 0.4, 1.0], [1.0, 0.6, 11.0], [1.0, 0.2, 11.0]]
        >>> replicated_step_figures([a, b])
        {'agree_ms': 1.0, 'agree_per_ms': 0.0, 'meet_ms': 0.25, 'meet_per_ms': 0.0, 'skew_ms': 0.075, 'skew_per_ms': 0.025, 'fit_compute_ms': 11.0}
    """
    import statistics

    if len(ranks) < 2 or not ranks[0] or not ranks[1]:
        raise HpmlError("the step figures need the rows of two probe ranks, each with one step at least")
    pairs = list(zip(ranks[0], ranks[1]))
    compute = [(a[2] + b[2]) / 2 for a, b in pairs]
    parts = {"agree": [(a[0] + b[0]) / 2 for a, b in pairs], "meet": [min(a[1], b[1]) for a, b in pairs],
             "skew": [abs(a[1] - b[1]) / 2 for a, b in pairs]}
    if all(len(a) > 3 and len(b) > 3 for a, b in pairs):  # the bookkeeping around the executor: the ranks' mean
        parts["step"] = [(a[3] + b[3]) / 2 for a, b in pairs]
    out: dict[str, float] = {}
    for name, values in parts.items():
        fixed, per_ms = _fit(list(zip(values, compute)))
        out[f"{name}_ms"], out[f"{name}_per_ms"] = fixed, per_ms
    half = max(1, len(compute) // 2)
    out["fit_compute_ms"] = round(statistics.median(compute[half:] or compute), 4)
    return out


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(fixed ms, ms per ms of compute)`` of ``(value, compute)`` points: the line through the two halves' means
    (the short compute's steps, then the long one's), neither part below 0; where the longer compute paid no more,
    no slope and the two means' mean.

    A half's mean leaves out its largest twentieth (one value of 35: a stall of tens of milliseconds, which a
    probe of seconds can meet once and a run's mean would not show).

    >>> _fit([(1.0, 1.0), (2.0, 1.0), (3.0, 11.0), (3.0, 11.0)])
    (1.35, 0.15)
    """
    import statistics

    half = max(1, len(points) // 2)

    def mean(part: list[tuple[float, float]]) -> tuple[float, float]:
        values = sorted(v for v, _ in part)
        kept = values[:len(values) - len(values) // 20]
        return statistics.fmean(kept), statistics.median(c for _, c in part)

    (v0, c0), (v1, c1) = mean(points[:half]), mean(points[half:] or points[:half])
    if c1 <= c0 or v1 <= v0:  # no more for more compute: one figure for both
        return round(max(0.0, (v0 + v1) / 2), 4), 0.0
    slope = (v1 - v0) / (c1 - c0)
    return round(max(0.0, v0 - slope * c0), 4), round(slope, 4)


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
    old = link is not None and older_link(link)
    if link is not None and isinstance(link.get("gbps"), (int, float)) and not (old and measure):
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
        # an entry of an older probe (its bookkeeping, without the meeting's or the executor's figures) is measured again
        # where allowed; an entry written by hand (no bookkeeping either) is taken as it is
        stale = hit is not None and "step_ms" in hit and not {"fit_compute_ms", "executor_ms", "step_per_ms"} <= set(hit)
        if hit is not None and isinstance(hit.get("bytes"), int) and not (stale and measure):
            out["process"] = {**hit, "source": f"{hit.get('source', 'measured')}; cached in {where}"}
        elif measure:
            out["process"] = runtime_baseline()
            if keep:
                remember(key, "runtime_baseline", out["process"])
    except HpmlError as e:
        log(f"  {e}")
    if "process" in out and "step_ms" in out["process"] and "recv_cpu_ms" not in out["process"]:  # a probe's entry
        out["process"] = {**out["process"], **_early_receive(key, measure, keep, refresh, log)}
    if "process" in out:
        extra = out["process"].get("step_ms")
        inner = out["process"].get("executor_ms")
        agree, skew = out["process"].get("agree_ms"), out["process"].get("skew_ms")
        log(f"  a CPU rank holds {out['process']['bytes'] / 2**20:.0f} MiB before its model"
            + (f" and spends {_line(out['process'], 'step').replace('their', 'its')} a step on the runtime's "
               "bookkeeping" if extra is not None else "")
            + (f" around the executor and {inner:.2f} ms inside it between the parts it times" if inner is not None
               else "")
            + (f"; two ranks agree on the loss in {_line(out['process'], 'agree')}, meet before the gradient sync in "
               f"{_line(out['process'], 'meet')} and reach it {_line(out['process'], 'skew')} apart"
               if agree is not None and skew is not None else "")
            + f" ({out['process']['source']})")
    return out


def _early_receive(key: str, measure: bool, store: bool, refresh: bool, log: Callable[[str], None]
                   ) -> dict[str, float]:
    """``{"recv_cpu_ms": ...}``: the CPU a pipeline message that arrived before its receive takes from its CPU
    rank (:func:`hpml_compile.profile.messages.probe_early_receive`), cached per host (probed only where
    ``measure``, stored only where ``store``); empty where not known (the simulator then charges nothing)."""
    from .messages import probe_early_receive

    hit = None if refresh else cached(key, "early_receive")
    if hit is not None and isinstance(hit.get("recv_cpu_ms"), (int, float)):
        return {"recv_cpu_ms": float(hit["recv_cpu_ms"])}
    if not measure:
        return {}
    try:
        found = probe_early_receive(nbytes=256 * 2**10)
    except Exception as e:  # noqa: BLE001 -- a probe that cannot run here: the plan goes without its figure
        log(f"  the early-receive probe failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
        return {}
    log(f"  a pipeline message that waits {found['wait_ms']:g} ms for its receive takes {found['recv_cpu_ms']:.2f} "
        "ms of its CPU rank's time (gloo's threads)")
    if store:
        remember(key, "early_receive", found)
    return {"recv_cpu_ms": found["recv_cpu_ms"]}


def older_link(link: Mapping[str, Any]) -> bool:
    """Whether a cached link was timed by an older probe, to be timed again where allowed: one with fits of its
    collectives but none of a tensor-parallel layer's all-reduce (``TP_REDUCE``), one timed another way than a
    layer runs it (its source does not say ``TP_REDUCE_HOW``), or one whose collectives through shared memory were
    timed in a loop (medians) rather than after compute (means: its source does not say ``SHM_HOW``). A link
    written by hand (no collectives) is kept.

    >>> older_link({"gbps": 3.0, "latency_us": 60.0, "source": "by hand"})
    False
    """
    from .links import SHM_HOW, TP_REDUCE, TP_REDUCE_HOW

    own, source = link.get("collectives"), str(link.get("source", ""))
    shm_in_loop = "through shared memory" in source and SHM_HOW not in source
    return own is not None and (TP_REDUCE not in own or TP_REDUCE_HOW not in source or shm_in_loop)


def _line(process: Mapping[str, Any], name: str) -> str:
    """``"0.60 ms + 2.0% of their compute"``: a probe figure's fixed part and its part per ms of compute."""
    return f"{float(process.get(name + '_ms', 0.0)):.2f} ms + {float(process.get(name + '_per_ms', 0.0)):.1%} of their compute"


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
        **{k: float(process[k]) for k in dict.fromkeys(("step_ms", "executor_ms", "recv_cpu_ms", *FIGURES))
           if isinstance(process.get(k), (int, float))},
        **({"stage_only": True} if process.get("stage_only") else {})}
    return replace(prof, devices=devices)
