"""Links measured, not assumed: this machine's send/recv and all-reduce timed between two ranks, fitted to alpha-beta.

The planner prices every transfer with cost_models' alpha-beta model
(``alpha + bytes * beta``) over the link a cluster names between two devices;
without one it takes the catalog's default for the two kinds (for two CPU
processes, ``gloo-loopback``, fitted once on another machine).
:func:`measure_cluster` replaces those defaults by this machine's own
figures, recorded as ``links`` of the cluster it returns (what
``hpml-compile devices --measure`` writes):

- **CPU ranks (gloo)**: two processes on this host (:func:`~hpml_compile.runtime.job.spawn.spawn_ranks`),
  one torch thread each as the runtime's ranks, time a ping-pong send/recv
  (half the round trip) and an all-reduce at a few sizes, median of a few
  repeats. One fit (:func:`fit_link`) gives the latency and bandwidth that
  best predict both (relative least squares), and whether the link is
  ``shared`` (both ranks' copies on one pool of cores and memory, so an
  all-reduce costs the traffic of both ranks: cost_models' loopback model),
  whichever of the two predicts the all-reduce better. The all-reduce is
  timed once more through shared memory (:mod:`.shm`), and so are the
  reduce-scatter and the all-gather, which is how the runtime runs them
  between CPU ranks of one host, each as a step's gradient sync runs it:
  after compute, its mean over ``TAIL_REPEATS`` (a tail the step pays, which
  a median leaves out); those rows (``SHM_ROWS``) give each its own
  fit, which prices it; gloo's all-reduce rows stay in the link's fit beside
  send/recv. ZeRO-3's parameter all-gather, which the runtime runs through
  the communicator (shared memory between the CPU ranks of one host) just
  after a rank computed, is timed that way too (``PARAM_GATHER``: each after
  a burst of compute on both ranks, from the later rank's start), and so are
  gloo's own all-gather after compute and all-reduce in a chain of compute
  (``TP_GATHER``, ``TP_REDUCE``), which price a tensor-parallel layer's
  (:func:`hpml_compile.stagecost.tp_link`); the first prices ZeRO-3's gathers
  (:func:`hpml_compile.stagecost.param_gather_link`). The chain is timed at two
  lengths of compute between the all-reduces, so that a layer's all-reduce is
  priced as a fixed cost plus a part of the compute it follows
  (:func:`tp_reduce_rows`, ``Link.tp_reduce_per_ms``).
- **GPU pairs (NCCL)**: the same two ranks, each on its own GPU, in a
  two-rank NCCL group, time the same operations (CUDA synchronised around
  each). Where there are fewer than two GPUs there is nothing to time.
- **CPU <-> GPU**: a pinned host tensor copied to the GPU and back (what the
  runtime does for a GPU rank talking to a CPU rank over gloo): the slower
  direction's fit becomes the link between each CPU device and each GPU.

The pairs of one kind share the figures of the pair measured (the first
two GPUs for all GPU pairs of the host; the two CPU ranks for all CPU pairs).
Why our own probe rather than ``torch.distributed``'s benchmarks or
nccl-tests: those print tables for people; this needs the figures in the
cluster file, fitted the way the cost model reads them, and gloo on CPU ranks
has no stock benchmark.

Example:
    >>> rows = [("p2p", 1000, 0.06), ("p2p", 10**6, 1.05), ("allreduce", 1000, 0.12), ("allreduce", 10**6, 2.1)]
    >>> link = fit_link(rows)
    >>> round(link.gbps, 2), round(link.latency_us), link.shared
    (1.01, 59, True)
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from cost_models import COLLECTIVE_OPS

from ..errors import HpmlError
from ..ir import Cluster, Device, Link, collectives_dict
from ..runtime.sync.shm import HostReduce
from ..runtime.job.spawn import spawn_ranks

__all__ = ["SIZES", "SHM_ALLREDUCE", "SHM_ROWS", "SHM_HOW", "TAIL_REPEATS", "tail_mean", "PARAM_GATHER", "TP_GATHER", "TP_REDUCE", "TP_REDUCE_SHORT",
           "TP_BURST", "TP_BURST_SHORT", "TP_REDUCE_HOW", "QUICK_SIZES", "Fit", "fit_link", "tp_reduce_rows",
           "measure_cluster", "measure_local_link", "probe_ranks", "probe_copies"]

SIZES = (4 << 10, 256 << 10, 4 << 20, 32 << 20)  # bytes: latency-bound to bandwidth-bound
REPEATS = 5
QUICK_SIZES = (64 << 10, 4 << 20, 32 << 20)  # what `profile` times: latency-bound to the size of a gradient
QUICK_REPEATS = 5

Row = tuple[str, int, float]  # (operation: "p2p" | "allreduce" | "copy" | a COLLECTIVE_OPS one, bytes, median ms)
SHM_ALLREDUCE = "allreduce_shm"  # a row of the all-reduce through shared memory (.shm), as the runtime runs it
# ... and of each collective so timed: what prices it where the probe could map the memory
SHM_ROWS = {"all_reduce": SHM_ALLREDUCE, "reduce_scatter": "reduce_scatter_shm", "all_gather": "all_gather_shm"}
# ZeRO-3's parameter all-gather as the runtime runs it between CPU ranks (runtime.sync.zero3): gloo's, started just
# after the ranks computed (a microbatch's forward or backward follows it). Timed so, not in a loop of gathers: on a
# 2-core VM a 1.7 MiB gather took 0.4-0.5 ms in a loop and 2-4 ms in the step or after a burst of compute.
PARAM_GATHER = "param_gather"
TP_GATHER = "tp_gather"  # gloo's own all-gather after compute, as a tensor-parallel layer calls it
# ... and its all-reduce (a sharded layer's forward output, its input's gradient backward): a layer's is a small
# tensor between two bursts of compute, which the link's all-reduces in a loop (which fit the link) do not see;
# timed in a chain of compute as a layer runs it (_in_chain), so that what it costs the compute around it is in it
TP_REDUCE = "tp_reduce"
# ... timed at two lengths of the compute between the all-reduces, the long bursts' rows TP_REDUCE, the short ones'
# TP_REDUCE_SHORT, with one burst's compute in each chain (TP_BURST, TP_BURST_SHORT, at the all-reduce's bytes):
# fitted as a fixed cost plus a part per ms of the compute each follows (Fit.tp_reduce_per_ms, tp_reduce_rows)
TP_REDUCE_SHORT = "tp_reduce_short"
TP_BURST = "tp_burst"
TP_BURST_SHORT = "tp_burst_short"
_CHAIN_ROWS = (TP_REDUCE_SHORT, TP_BURST, TP_BURST_SHORT)  # rows that only tp_reduce_rows reads
TP_REDUCE_HOW = "tp-reduce in chains of compute at two lengths"  # in a link's source where TP_REDUCE was timed so
CHAIN = 6  # all-reduces in one chain of the TP_REDUCE probe (a transformer layer runs 2 forward, 2 backward)
BURST_MATMULS = 8  # 256 x 256 matrix products: about 5 ms on one thread (34 MFLOP each)
SHORT_BURST_MATMULS = 2  # ... and a short layer's: about 1.3 ms
# the chains' repeats per repeat of the other timings: the part per ms of compute is the difference of two chains
# over a few ms of compute, which the noise of each chain moves twice; a chain costs 15-60 ms on a quiet host
CHAIN_REPEATS = 2
# The collectives through shared memory (SHM_ROWS) price a replicated stage's gradient sync, which runs once a step
# right after the backward: each is timed so (_after_compute, after a short burst of compute on both ranks) this many
# times, and its mean is kept, not its median. Its tail is part of what a step pays: on the 2-core development VM the
# demo's 1.7 MiB all-reduce took 0.8-1.1 ms in the median step and 1.5-2.1 ms in the mean one, where the median of a
# loop of them priced 0.85; the step the report measures is near the sum of its parts' means.
TAIL_REPEATS = 20
SHM_HOW = "the collectives through shared memory timed after compute (means)"  # in a link's source where so timed


@dataclass(frozen=True)
class Fit:
    """An alpha-beta link fitted to measurements.

    Attributes:
        gbps: bandwidth, GB/s (1e9 bytes/s).
        latency_us: per-message latency (alpha), microseconds.
        shared: an all-reduce costs the traffic of both ranks (one pool of bandwidth, as over loopback).
        rows: the measurements ``(operation, bytes, median ms)``.
        worst: the largest relative error of the fit over the send/recv and all-reduce rows.
        collectives: ``(op, gbps, latency_us)``: the reduce-scatter's, the all-gather's and the all-reduce's
            own fits, where they were timed at two sizes or more (``LinkSpec.collectives``).
        tp_reduce_per_ms: what each ms of compute before a tensor-parallel layer's all-reduce adds to it, beyond
            its ``tp_reduce`` fit (:func:`tp_reduce_rows`; 0 where it was timed at one length of compute).
    """

    gbps: float
    latency_us: float
    shared: bool
    rows: tuple[Row, ...]
    worst: float
    collectives: tuple[tuple[str, float, float], ...] = ()
    tp_reduce_per_ms: float = 0.0


def _solve(a: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Non-negative ``(alpha, beta)`` minimising the relative error of ``a @ (alpha, beta) ~ y``."""
    w = a / y[:, None]
    coef, *_ = np.linalg.lstsq(w, np.ones_like(y), rcond=None)
    alpha, beta = float(coef[0]), float(coef[1])
    if alpha < 0 or beta <= 0:  # latency below resolution: a line through the origin
        alpha = 0.0
        beta = float(np.linalg.lstsq(w[:, 1:], np.ones_like(y), rcond=None)[0][0])
    return alpha, max(beta, 1e-15)


def fit_link(rows: Sequence[Row]) -> Fit:
    """The alpha-beta link (and whether it is shared) that best predicts ``rows`` between two ranks.

    A point-to-point message costs ``alpha + b beta``; a two-rank ring all-reduce ``2 alpha + b beta``,
    or ``2 alpha + 2 b beta`` on a shared link; a copy ``alpha + b beta``.

    Args:
        rows: ``(operation, bytes, median ms)``, operation ``p2p``, ``allreduce`` or ``copy``.

    Returns:
        The fit.

    Raises:
        HpmlError: fewer than two sizes, or a time that is not positive.
    """
    if any(not ms > 0 for _, _, ms in rows):
        raise HpmlError(f"a link fit needs positive times at two sizes at least, got {list(rows)}")
    main = [r for r in rows if r[0] not in COLLECTIVE_OPS and r[0] not in SHM_ROWS.values()
            and r[0] not in _CHAIN_ROWS]
    if len({b for _, b, _ in main}) < 2:
        raise HpmlError(f"a link fit needs positive times at two sizes at least, got {list(rows)}")
    y = np.array([ms for _, _, ms in main])
    best: Fit | None = None
    for shared in (False, True):
        a = np.array([[2.0, (2.0 if shared else 1.0) * b] if op == "allreduce" else [1.0, float(b)]
                      for op, b, _ in main])
        alpha, beta = _solve(a, y)
        worst = float(np.max(np.abs(a @ np.array([alpha, beta]) / y - 1)))
        fit = Fit(gbps=1e-6 / beta, latency_us=alpha * 1e3, shared=shared, rows=tuple(rows), worst=worst)
        if best is None or worst < best.worst:
            best = fit
        if not any(op == "allreduce" for op, _, _ in main):
            break  # shared or not says nothing about a copy or a send
    assert best is not None
    chain, per_ms = tp_reduce_rows(rows)
    rows_of = [r for r in rows if r[0] != TP_REDUCE] + chain
    own = []
    for op in COLLECTIVE_OPS:
        # two ranks: a reduce-scatter or all-gather is one step of the ring, the whole buffer (shared) or half of
        # it moved; an all-reduce two steps, both buffers (shared) or one (the probe's rows say "allreduce")
        # the runtime's: through shared memory where the probe could map it (.shm), else gloo's
        mine = ([(b, ms) for o, b, ms in rows_of if o == SHM_ROWS.get(op)]
                or [(b, ms) for o, b, ms in rows_of if o == ("allreduce" if op == "all_reduce" else op)])
        steps = 2.0 if op in ("all_reduce", TP_REDUCE) else 1.0
        if len({b for b, _ in mine}) >= 2:
            alpha, beta = _solve(np.array([[steps, steps * (b if best.shared else b / 2)] for b, _ in mine]),
                                 np.array([ms for _, ms in mine]))
            own.append((op, round(1e-6 / beta, 4), round(alpha * 1e3, 2)))
    return replace(best, collectives=tuple(own), tp_reduce_per_ms=round(per_ms, 4))


def tp_reduce_rows(rows: Sequence[Row]) -> tuple[list[Row], float]:
    """A tensor-parallel layer's all-reduce as a fixed cost plus a part per ms of the compute it follows.

    The probe times gloo's all-reduce in chains of compute at two lengths of the bursts between the all-reduces
    (``TP_REDUCE`` after the long bursts, ``TP_REDUCE_SHORT`` after the short ones, each chain's burst in the
    ``TP_BURST`` and ``TP_BURST_SHORT`` rows). At each size, the difference between the two over the difference
    between their bursts is what each ms of compute adds (the group's wait for its later rank grows with the
    compute each rank did alone); its median over the sizes is the part per ms, and each size's time less that
    part of its burst (the mean of the two lengths' figures) is the fixed cost, fitted to alpha-beta as the other
    collectives are. So a layer's all-reduce is priced at the compute it follows, short or long, from measurement,
    where one timed after 5 ms of compute alone prices a layer of 1 ms as dear as one of 5. A part per ms below
    zero (noise) counts as zero; a fixed cost is kept at a tenth of the shorter chain's figure at least, so that
    noise cannot make it free.

    Args:
        rows: the probe's rows; without ``TP_REDUCE_SHORT`` rows and both bursts at a size (a probe at one length)
            the ``TP_REDUCE`` rows are the fixed cost as they are.

    Returns:
        ``(TP_REDUCE rows of the fixed cost, ms added per ms of compute)``.

    Example:
        >>> mib = 1 << 20
        >>> rows = [(TP_REDUCE, mib, 1.6), (TP_BURST, mib, 5.0),  # after 5 ms of compute, and after 1.25 ms
        ...         (TP_REDUCE_SHORT, mib, 0.85), (TP_BURST_SHORT, mib, 1.25)]
        >>> fixed, per_ms = tp_reduce_rows(rows)
        >>> [(op, b, round(ms, 3)) for op, b, ms in fixed], round(per_ms, 3)
        ([('tp_reduce', 1048576, 0.6)], 0.2)
    """
    of = {op: {b: ms for o, b, ms in rows if o == op} for op in (TP_REDUCE, *_CHAIN_ROWS)}
    long_, short, hi, lo = of[TP_REDUCE], of[TP_REDUCE_SHORT], of[TP_BURST], of[TP_BURST_SHORT]
    sizes = sorted(b for b in long_ if b in short and b in hi and b in lo and hi[b] > lo[b])
    if not sizes:
        return [(TP_REDUCE, b, ms) for b, ms in long_.items()], 0.0
    per_ms = max(0.0, statistics.median((long_[b] - short[b]) / (hi[b] - lo[b]) for b in sizes))
    return [(TP_REDUCE, b, max((long_[b] - per_ms * hi[b] + short[b] - per_ms * lo[b]) / 2,
                               0.1 * min(long_[b], short[b]))) for b in sizes], per_ms


def _timed(fn: Any, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _probe(rank: int, world: int, sizes: Sequence[int], repeats: int, gpus: Sequence[int], out: str,
           timeout_s: float = 600) -> None:
    """One rank of :func:`probe_ranks`: gloo between the CPU processes, then NCCL between two GPUs if given (its
    group with the probe's time-out, not torch's default of 10 minutes for NCCL)."""
    backends: list[tuple[str, torch.device, Any]] = [("gloo", torch.device("cpu"), None)]
    if len(gpus) >= 2:
        dev = torch.device("cuda", gpus[rank])
        torch.cuda.set_device(dev)
        backends.append(("nccl", dev, dist.new_group([0, 1], backend="nccl",
                                                       timeout=datetime.timedelta(seconds=timeout_s))))
    result: dict[str, list[Row]] = {}
    host = HostReduce.open(dist.group.WORLD, slot_bytes=max(sizes))  # None where no mapping can be made here
    for name, device, group in backends:
        cuda = device.type == "cuda"
        rows: list[Row] = []
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
            peer = 1 - rank

            def ping() -> None:
                if rank == 0:
                    dist.send(t, peer, group=group)
                    dist.recv(t, peer, group=group)
                else:
                    dist.recv(t, peer, group=group)
                    dist.send(t, peer, group=group)

            def reduce() -> None:
                dist.all_reduce(t, group=group)

            halves, half = list(t.chunk(2)), torch.empty_like(t.chunk(2)[0])

            def scatter() -> None:  # the ZeRO pair: each rank ends with the sum of its half ...
                dist.reduce_scatter(half, halves, group=group)

            def gather() -> None:  # ... and gathers the other's half back
                dist.all_gather(halves, half, group=group)

            whole = torch.empty_like(t)

            def reduce_shm() -> None:
                assert host is not None
                host.all_reduce(t)

            def scatter_shm() -> None:
                assert host is not None
                host.reduce_scatter(t, half)

            def gather_shm() -> None:
                assert host is not None
                host.all_gather(half, whole)

            ops = [("p2p", ping, 0.5), ("allreduce", reduce, 1.0), ("reduce_scatter", scatter, 1.0),
                   ("all_gather", gather, 1.0)]
            if not cuda:  # ZeRO-3's gather as the runtime's communicator runs it, each after the ranks computed
                shm = host is not None and t.numel() % 2 == 0
                rows.append((PARAM_GATHER, t.numel() * 4, _after_compute(gather_shm if shm else gather, repeats)))
                rows.append((TP_GATHER, t.numel() * 4, _after_compute(gather, repeats)))  # a tp layer's: gloo
                for op, each, matmuls in ((TP_REDUCE, TP_BURST, BURST_MATMULS),
                                          (TP_REDUCE_SHORT, TP_BURST_SHORT, SHORT_BURST_MATMULS)):
                    added, burst = _in_chain(reduce, CHAIN_REPEATS * repeats, matmuls=matmuls)
                    rows += [(op, t.numel() * 4, added), (each, t.numel() * 4, burst)]
            if host is not None and not cuda and t.numel() % 2 == 0:  # as a step's sync runs: after compute, means
                rows += [(op, t.numel() * 4, _after_compute(fn, max(repeats, TAIL_REPEATS), mean=True,
                                                            matmuls=SHORT_BURST_MATMULS))
                         for op, fn in ((SHM_ALLREDUCE, reduce_shm), (SHM_ROWS["reduce_scatter"], scatter_shm),
                                        (SHM_ROWS["all_gather"], gather_shm))]
            for op, fn, share in ops:
                fn()  # warm-up: connections, allocations
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    times.append(_timed(fn, cuda) * share)
                rows.append((op, t.numel() * 4, statistics.median(times)))
        result[name] = rows
    if rank == 0:
        Path(out, "links.json").write_text(json.dumps(result))


def _burst(matmuls: int = BURST_MATMULS) -> None:
    """A few milliseconds of single-thread compute: what a rank does before a collective inside a step."""
    a = torch.ones(256, 256)
    for _ in range(matmuls):
        a = a @ a * (1.0 / 256)


def _after_compute(fn: Any, repeats: int, meeting: bool = False, mean: bool = False,
                   matmuls: int = BURST_MATMULS) -> float:
    """Median milliseconds of ``fn`` (a collective over the two ranks) started right after each rank computed,
    from the later rank's start to the later rank's end (the ranks share this host's monotonic clock), so that one
    rank finishing its compute late is not counted (the plan counts that as compute).

    ``mean``: the mean instead of the median, less the largest twentieth of the times (:func:`tail_mean`): what a
    collective run once a step adds to the mean step, tail included. ``matmuls``: the burst's matrix products.

    ``meeting``: from the ranks' mean start instead, so that half the gap between the two ranks' arrivals is
    counted: what a tensor-parallel layer's collective costs its group, whose ranks compute the same work between
    two collectives and go on together after each (the step pays the later rank's compute, the mean's plus half
    the gap, where the plan prices the mean)."""
    fn()
    spans = []
    for _ in range(repeats):
        dist.barrier()
        _burst(matmuls)
        t0 = time.perf_counter()
        fn()
        spans.append(_span([(t0, time.perf_counter())], meeting)[0])
    return (tail_mean(spans) if mean else statistics.median(spans)) * 1e3


def tail_mean(values: Sequence[float]) -> float:
    """The mean of ``values`` less their largest twentieth: a heavy tail counted, one stall of tens of
    milliseconds that a probe of a second can meet and a run's mean would not show left out (as
    :func:`hpml_compile.profile.process.replicated_step_figures` does).

    >>> tail_mean([1.0] * 15 + [3.0] * 4 + [40.0])
    1.4210526315789473
    """
    kept = sorted(values)[:len(values) - len(values) // 20]
    return statistics.fmean(kept)


def _span(calls: Sequence[tuple[float, float]], meeting: bool) -> list[float]:
    """Seconds of each of this rank's ``calls`` (``(start, end)`` on this host's monotonic clock) as the two ranks
    spent them together: from the later rank's start (``meeting``: the ranks' mean start) to the later one's end."""
    mine = torch.tensor([v for call in calls for v in call], dtype=torch.float64)
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine)
    out = []
    for i in range(len(calls)):
        starts = [float(b[2 * i]) for b in both]
        out.append(max(float(b[2 * i + 1]) for b in both) - (sum(starts) / 2 if meeting else max(starts)))
    return out


def _in_chain(fn: Any, repeats: int, links: int = CHAIN, matmuls: int = BURST_MATMULS) -> tuple[float, float]:
    """Median milliseconds that ``fn`` (a collective over the two ranks) adds to a chain of bursts of compute run on
    both ranks at once (what one of a tensor-parallel layer's all-reduces costs its step), and the median
    milliseconds of one burst (``matmuls`` matrix products) on a rank, the mean of the two ranks' in the chain of
    bursts alone.

    A stage with ``tp > 1`` alternates compute and collectives, each rank computing again as soon as one returns.
    Timed as such a chain: ``links`` x (burst, ``fn``) against the ``links`` bursts alone, each from the ranks'
    mean start to the later rank's end, the difference over ``links`` taken (never less than the collective's own
    span in the chain, from the later rank's start). So the transfer is in it, the group's wait for its later rank
    at each meeting (a chain of bursts alone pays the ranks' skew once), and whatever the collective's threads take
    from the compute after it, where every core computes. A collective timed alone after compute
    (:func:`_after_compute`, the ranks then waiting on each other) is followed by no compute: its threads finish
    on an idle core. Measured on a 2-core VM, two 1-thread ranks under the kernel's fair scheduler: gpt-mini's
    1 MiB all-reduces at ``tp = 2`` cost its step 3.6-4.6 ms each (the ranks reaching them within 0.1-1.5 ms of
    each other), where a 1 MiB all-reduce after compute took 1.8 ms and one in a chain 3.0 ms (medians of 15,
    the same two processes); with the ranks' threads given a core whenever they woke (real-time priority) all
    three were 0.3-0.6 ms.
    """
    fn()
    added, bursts = [], []
    for _ in range(repeats):
        chains, calls = [], []
        for collect in (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(links):
                _burst(matmuls)
                if collect:
                    c0 = time.perf_counter()
                    fn()
                    calls.append((c0, time.perf_counter()))
            t1 = time.perf_counter()
            chains.append(_span([(t0, t1)], meeting=True)[0])
            if not collect:
                mine = torch.tensor([(t1 - t0) / links], dtype=torch.float64)
                dist.all_reduce(mine)
                bursts.append(float(mine) / 2)
        own = statistics.median(_span(calls, meeting=False))
        added.append(max((chains[1] - chains[0]) / links, own))
    return statistics.median(added) * 1e3, statistics.median(bursts) * 1e3


def probe_ranks(sizes: Sequence[int] = SIZES, repeats: int = REPEATS, gpus: Sequence[int] = (),
                start_method: str = "spawn", timeout_s: float = 600) -> dict[str, list[Row]]:
    """Time send/recv and all-reduce between two processes of this host (gloo; NCCL between ``gpus[:2]``).

    Args:
        sizes: message sizes in bytes.
        repeats: timed repeats per size (the median is kept).
        gpus: CUDA indices; with two or more, the first two are timed under NCCL too.
        start_method: how the two processes start (:func:`~hpml_compile.runtime.job.spawn.spawn_ranks`; ``fork`` for gloo only).
        timeout_s: how long the probe may take.

    Returns:
        ``{"gloo": rows, "nccl": rows}`` (``nccl`` only with two GPUs).
    """
    with tempfile.TemporaryDirectory(prefix="hpml-links-") as tmp:
        spawn_ranks(_probe, 2, tmp, list(sizes), repeats, list(gpus), tmp, timeout_s, timeout_s=timeout_s,
                    start_method=start_method)
        raw = json.loads(Path(tmp, "links.json").read_text())
    return {k: [(op, int(b), float(ms)) for op, b, ms in v] for k, v in raw.items()}


def probe_copies(gpu: int, sizes: Sequence[int] = SIZES, repeats: int = REPEATS) -> dict[str, list[Row]]:
    """Time pinned host -> GPU ``gpu`` and back, in this process: ``{"h2d": rows, "d2h": rows}``."""
    dev = torch.device("cuda", gpu)
    out: dict[str, list[Row]] = {"h2d": [], "d2h": []}
    for nbytes in sizes:
        host = torch.ones(max(1, nbytes // 4), dtype=torch.float32).pin_memory()
        on_gpu = host.to(dev)
        for name, fn in (("h2d", lambda: on_gpu.copy_(host, non_blocking=True)),
                         ("d2h", lambda: host.copy_(on_gpu, non_blocking=True))):
            fn()
            times = [_timed(fn, True) for _ in range(repeats)]
            out[name].append(("copy", host.numel() * 4, statistics.median(times)))
    return out


def measure_cluster(cluster: Cluster, sizes: Sequence[int] = SIZES, repeats: int = REPEATS,
                    log: Any = print) -> tuple[Cluster, dict[str, Fit]]:
    """``cluster`` (this machine's devices) with every pair's link measured here (see the module docstring).

    Args:
        cluster: this host's devices (CPU devices ``kind == "cpu"``, GPUs ``gpu<i>`` = CUDA index ``i``).
        sizes: message sizes, bytes.
        repeats: timed repeats per size.
        log: where progress lines go.

    Returns:
        The cluster with measured ``links`` (each ``source`` saying what was timed) and the fits by backend.
    """
    cpus = [d for d in cluster.devices if d.is_cpu]
    gpus = [d for d in cluster.devices if not d.is_cpu]
    cuda = torch.cuda.is_available()
    indices = [int(d.name[3:]) for d in gpus if d.name[3:].isdigit()] if cuda else []
    log(f"timing send/recv and all-reduce between 2 processes (gloo{', NCCL on 2 GPUs' if len(indices) >= 2 else ''}) "
        f"at {', '.join(_size(b) for b in sizes)} ...")
    rows = probe_ranks(sizes, repeats, indices[:2])
    fits = {name: fit_link(r) for name, r in rows.items()}
    if indices:
        copies = probe_copies(indices[0], sizes, repeats)
        fits.update({name: fit_link(r) for name, r in copies.items()})
    links: list[Link] = []

    def add(a: Device, b: Device, fit: Fit, what: str) -> None:
        links.append(Link(a.name, b.name, round(fit.gbps, 4), round(fit.latency_us, 2), shared=fit.shared,
                          source=f"measured: {what} ({_summary(fit)})", collectives=fit.collectives,
                          tp_reduce_per_ms=fit.tp_reduce_per_ms))

    for i, a in enumerate(cpus):
        for b in cpus[i + 1:]:
            add(a, b, fits["gloo"], "gloo send/recv and all-reduce between 2 CPU processes of this host")
    if "nccl" in fits:
        for i, a in enumerate(gpus):
            for b in gpus[i + 1:]:
                add(a, b, fits["nccl"], f"NCCL send/recv and all-reduce between {gpus[0].name} and {gpus[1].name}")
    if "h2d" in fits:
        slow = min((fits["h2d"], fits["d2h"]), key=lambda f: f.gbps)
        for c in cpus:
            for g in gpus:
                add(c, g, slow, f"pinned host <-> {gpus[0].name} copies, the slower direction")
    for name, fit in fits.items():
        log(f"  {name:5s} {_summary(fit)}")
    return Cluster(devices=cluster.devices, links=tuple(links), name=cluster.name), fits


def measure_local_link(sizes: Sequence[int] = QUICK_SIZES, repeats: int = QUICK_REPEATS,
                       log: Any = print) -> dict[str, Any]:
    """The gloo link between two CPU processes of this host, as ``profile`` records it in the profile.

    The probe of :func:`measure_cluster` at fewer sizes and repeats, fitted the same way. ``profile`` must
    stay cheap, and starting two fresh interpreters that import torch costs seconds (29-35 s measured on a
    busy 2-core host), so on Linux the two processes are forked from this one (0.4 s there): they time
    gloo between two processes all the same. Should a forked probe fail or hang (60 s), it is run again
    with fresh interpreters.

    Returns:
        ``{"gbps", "latency_us", "shared", "source"}``, with ``collectives`` and ``tp_reduce_per_ms`` where
        measured: the profile's ``devices["cpu"]["link"]``.
    """
    t0 = time.perf_counter()
    rows = None
    if sys.platform == "linux" and "fork" in mp.get_all_start_methods():
        try:
            rows = probe_ranks(sizes, repeats, start_method="fork", timeout_s=60)
        except Exception as e:  # noqa: BLE001 -- a forked probe that fails is run again in fresh interpreters
            log(f"  the forked link probe failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                "timing again in fresh processes")
    fit = fit_link((rows or probe_ranks(sizes, repeats))["gloo"])
    log(f"  gloo link between 2 processes of this host: {_summary(fit)} ({time.perf_counter() - t0:.1f} s)")
    return {"gbps": round(fit.gbps, 4), "latency_us": round(fit.latency_us, 2), "shared": fit.shared,
            "source": f"measured by profile: gloo send/recv and all-reduce between 2 CPU processes at "
                      f"{', '.join(_size(b) for b in sizes)} ({_summary(fit)})"
                      + (f"; {TP_REDUCE_HOW}" if any(op == TP_REDUCE for op, _, _ in fit.collectives) else ""),
            **({"collectives": collectives_dict(fit.collectives)} if fit.collectives else {}),
            **({"tp_reduce_per_ms": fit.tp_reduce_per_ms} if fit.tp_reduce_per_ms else {})}


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def _summary(fit: Fit) -> str:
    own = "".join(f"; {op.replace('_', '-')} {g:.3g} GB/s, {lat:.1f} us"
                  + (f" + {fit.tp_reduce_per_ms:.1%} of the compute before it" if op == TP_REDUCE else "")
                  for op, g, lat in fit.collectives)
    return (f"{fit.gbps:.3g} GB/s, {fit.latency_us:.1f} us{', shared' if fit.shared else ''}; worst error "
            f"{fit.worst:.0%} over {sum(op in ('p2p', 'allreduce', 'copy') for op, _, _ in fit.rows)} timings{own}"
            + (f"; {SHM_HOW}" if any(op in SHM_ROWS.values() for op, _, _ in fit.rows) else ""))
