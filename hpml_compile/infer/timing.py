"""This host's CPU priced from one decoder block timed on it, rather than from the catalog's rates.

The catalog's CPU entry (``cost_models.get_device("cpu")``) holds a large
matmul's FLOP/s, a copy's bandwidth and a one-element add's dispatch, measured
with whatever torch threads the measuring process had. A cached decode step of
a small decoder is none of these: it is two dozen small ops per block, each
paying eager PyTorch's dispatch, at the thread count the serving rank runs
with. So, as training prices its stages from a profile of the model on the
host, an inference plan with a CPU stage times the model's own cached forward
here (:func:`time_block`): one block's prefill of ``rows x prompt_len`` tokens,
one block's decode step over a half-generated cache, and the output head, in
this process with the ranks' thread count, and what a stage's step costs beyond
its blocks (embedding, mask, head, the tokens handed on: fixed per step, where
the blocks' cost grows with their count).

A stage of a pipeline reads its weights from memory, not from the CPU's
caches: between two of its steps the other stages run theirs (on this host,
through the same last-level cache) and push its weights out. Timed back to
back, a small model's blocks stay in the cache and look several times faster
than they run in a pipeline (gpt-mini's first stage at batch 1: 0.40 ms a step
back to back, 0.9-1.0 ms with 32-64 MiB written between two steps, as in its
2-rank pipeline). So the decode step and the step's work outside the blocks
are timed both ways: back to back (what a plan of one stage runs) and cold,
each step after a write of :data:`_EVICT_BYTES` (what a stage of a pipeline
runs). And what handing a step's hidden states to the next rank costs here is
timed through the generator's pipes, between two threads taking turns as two
ranks do (:func:`hpml_compile.infer.handoff.measure_handoff`), at the decode step's and
the prefill's message sizes, fitted to a latency and a bandwidth; and the
latency again with the receiver idle before each message for
:data:`_IDLE_MS` (a rank that waits while the other stages compute, as at
batch 1, takes longer to wake than one that waited microseconds).

Such a rank also computes slower once woken: its core sat idle (on a virtual
machine, given back to the hypervisor) while the other stages streamed their
weights through the shared cache, and the step it then runs pays for it
(gpt-mini's 2 ranks at batch 1 computed 37-58% over what the block timed back
to back predicts, on a quiet 2-core VM). So
the decode step and the step's work outside the blocks are timed a third way:
each right after an idle gap (:data:`_IDLE_GAPS_MS`) that the timing thread
spends blocked on a pipe, as a rank waits for its input, while a second thread
stands for the other stages, running decode steps of another copy of the
blocks, one block at a time, for the gap's length (so reading weights at the
pace the other stages do) and then writing to the pipe (:class:`_Idler`).
The wake-up itself is not in this time (the hand-off's idle latency prices
it). This is timed per model rather than once per host: what a woken step
loses depends on how much of the stage's weights it reads again, and the
gaps a plan's ranks idle are its model's compute.

:func:`timed_spec` turns the times
into the CPU's entry for pricing: the FLOP/s that make the block's prefill take
what it took, the per-op cost that makes its decode step take what it took (the
catalog's bandwidth kept), so other rows and lengths follow the roofline from
measured points. The plan records the times (``cpu_timing``); a plan without
them says that its CPU is priced from the catalog.

Example:
    >>> from hpml_compile.models.gpt import PRESETS
    >>> t = BlockTiming(prefill_ms=4.0, decode_ms=0.3, step_ms=0.5, rows=8, prompt_len=32, new_tokens=32,
    ...                 threads=1)
    >>> BlockTiming.from_dict(t.to_dict()) == t
    True
"""

from __future__ import annotations

import itertools
import os
import select
import statistics
import struct
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from ..errors import HandoffError
from .handoff import busy_wait, measure_handoff

import cost_models
from cost_models.roofline import OpKind, roofline_ms

from .cost import CPU_OPS_PER_BLOCK, DecoderShape, TimedCpuSpec, Workload, block_flops_bytes, head_ms

__all__ = ["BlockTiming", "time_block", "timed_spec", "timed_specs"]

_REPEATS = 7  # timings per phase; the median is kept (a busy host's outliers dropped)
_SPAN_BYTES = 64 * 2**20  # weights of the blocks timed together: more than a CPU's last-level cache
_MAX_BLOCKS = 16
_PREFILL_FLOPS = 2e10  # at most this much work per timed prefill (fewer rows for a large model: seconds, not minutes)
_EVICT_BYTES = 64 * 2**20  # written between two cold steps: more than a CPU's last-level cache (per core complex)
_RUN = 8  # decode steps per warm timing: a run as long as a stage's step, preempted as often on a busy host
_COLD = 3  # cold decode steps per repeat, each timed alone after a flush
_HANDOFF_BIG = 1 << 20  # a third message size for the hand-off's bandwidth
# How long the receiver of a hand-off is idle before it, per point timed (ms): from within a kernel's or a
# hypervisor's polling window (~0.1-0.2 ms) to a few scheduler ticks past it; a longer wait is priced at the last
# point. Each point costs its repeats twice its idle time (~0.6 s in all).
_IDLE_MS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# Idle gaps before a timed step (ms): a short stage's compute, gpt-mini's half at batch 1, a large model's stage;
# a longer gap is priced at the last point. Each costs its repeats twice its length and a step (~0.5 s in all).
_IDLE_GAPS_MS = (0.2, 1.0, 5.0)


@dataclass(frozen=True, slots=True)
class BlockTiming:
    """One decoder block's measured times on this host's CPU, with the sizes and threads they were taken at."""

    prefill_ms: float  # one block, ``rows x prompt_len`` tokens
    decode_ms: float  # one block, one token per row over a cache of ``prompt_len + new_tokens / 2``
    step_ms: float  # a decode step's work outside the blocks: embedding, positions and mask, head, tokens out
    rows: int
    prompt_len: int
    new_tokens: int
    threads: int
    decode_cold_ms: float = 0.0  # decode_ms with the caches flushed before each step (as a pipeline's stage)
    step_cold_ms: float = 0.0  # step_ms likewise
    handoff_us: float = 0.0  # one hand-off between two ranks of this host: latency ...
    handoff_gbps: float = 0.0  # ... and bandwidth (0: not measured; the cluster's link prices it)
    llc_bytes: int = 0  # the CPU's last-level cache as the host reports it (0: unknown)
    handoff_idle: tuple[tuple[float, float], ...] = ()  # (receiver idle ms, hand-off latency us) per point timed
    # (idle gap ms, decode_ms, step_ms) with the step timed right after the thread was idle that long, per gap
    decode_idle: tuple[tuple[float, float, float], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BlockTiming":
        return cls(float(d["prefill_ms"]), float(d["decode_ms"]), float(d["step_ms"]), int(d["rows"]),
                   int(d["prompt_len"]), int(d["new_tokens"]), int(d["threads"]), float(d.get("decode_cold_ms", 0.0)),
                   float(d.get("step_cold_ms", 0.0)), float(d.get("handoff_us", 0.0)),
                   float(d.get("handoff_gbps", 0.0)), int(d.get("llc_bytes", 0)),
                   tuple((float(ms), float(us)) for ms, us in d.get("handoff_idle", ())),
                   tuple((float(g), float(b), float(e)) for g, b, e in d.get("decode_idle", ())))


def _median_ms(fn: Callable[[], object], repeats: int = _REPEATS) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_block(config: Any, work: Workload, threads: int) -> BlockTiming:
    """Time one block of a zoo GPT of ``config`` in this process on the CPU, with ``threads`` torch threads.

    A model of the same sizes with a few blocks is built (random weights: the time does not depend on their
    values), so a large model is never loaded to time it. Its blocks run in turn and their time is divided
    by their count: enough of them that their weights overflow the CPU's caches (:data:`_SPAN_BYTES`), as a
    stage's blocks do, since one block run again and again reads its weights from cache and looks several
    times faster than it is in a stage. A prefill over :data:`_PREFILL_FLOPS` is timed at fewer rows (the
    rows used are recorded).

    Args:
        config: the model's :class:`hpml_compile.models.gpt.GPTConfig`.
        work: sizes: ``work.rows`` sequences, ``work.prompt_len`` prompt, ``work.new_tokens`` output, dtype.
        threads: torch threads while timing (the serving ranks' count); restored afterwards.

    Returns:
        The block's times.
    """
    from ..models.gpt import GPT
    from .engine import DTYPES
    from .kv import Stage

    dtype = DTYPES[work.dtype]
    params = DecoderShape.from_config(config).block_params()
    n = max(1, min(config.n_layer, _MAX_BLOCKS, -(-_SPAN_BYTES // (params * torch.finfo(dtype).bits // 8))))
    P = work.prompt_len
    rows = max(1, min(work.rows, int(_PREFILL_FLOPS // (2 * P * params * n))))
    at = P + work.new_tokens // 2 - 1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = GPT(replace(config, n_layer=n)).eval().to(dtype)
        pads = torch.zeros(rows, dtype=torch.long)
        blocks = Stage(model, 0, n)
        blocks.is_first = blocks.is_last = False  # hidden states in and out, as a middle stage
        h = torch.randn(rows, P, config.d_model, dtype=dtype)

        def prefill_once() -> Tensor:
            blocks.open(0, pads, work.context)
            return blocks.step(0, h, 0)

        prefill = _median_ms(prefill_once) / n
        ends = Stage(model, 0, 0)  # a stage's step without its blocks: token ids in, embedding, mask, head, tokens out
        ends.is_last = True
        ids = torch.randint(0, config.vocab_size, (rows, 1))
        ends.open(0, pads, work.context)
        blocks.open(0, pads, work.context)
        blocks.step(0, h, 0)
        h1 = torch.randn(rows, 1, config.d_model, dtype=dtype)
        flush = torch.zeros(_EVICT_BYTES // 4)
        runs: tuple[list[float], ...] = ([], [], [], [])
        idle: list[tuple[list[float], list[float]]] = [([], []) for _ in _IDLE_GAPS_MS]
        with _Idler(_other_stages(config, n, dtype, pads, work.context, h1, at)) as idler:
            for _ in range(_REPEATS):  # interleaved, so that a busy spell of the host weighs on each alike
                runs[0].append(_median_ms(lambda: [blocks.step(0, h1, at) for _ in range(_RUN)], 1) / _RUN / n)
                runs[1].append(_median_ms(lambda: [ends.step(0, ids, at).float().argmax(-1).tolist()
                                                   for _ in range(_RUN)], 1) / _RUN)
                for _ in range(_COLD):
                    runs[2].append(_cold_ms(lambda: blocks.step(0, h1, at), flush) / n)
                    runs[3].append(_cold_ms(lambda: ends.step(0, ids, at).float().argmax(-1).tolist(), flush))
                    for gap, (blk, out) in zip(_IDLE_GAPS_MS, idle):
                        blk.append(idler.after(gap, lambda: blocks.step(0, h1, at)) / n)
                        out.append(idler.after(gap, lambda: ends.step(0, ids, at).float().argmax(-1).tolist()))
        decode, step, decode_cold, step_cold = (statistics.median(r) for r in runs)
        # a cold or woken step is never faster than a warm one: where a busy host's preemptions made it so (a run
        # of warm steps is preempted more often than one step on a fresh time slice), warm it is
        decode_cold, step_cold = max(decode_cold, decode), max(step_cold, step)
        woken = tuple((gap, max(statistics.median(blk), decode), max(statistics.median(out), step))
                      for gap, (blk, out) in zip(_IDLE_GAPS_MS, idle))
        blocks.close()
        ends.close()
    finally:
        torch.set_num_threads(before)
    width = torch.finfo(dtype).bits // 8
    latency_us, gbps, handoff_idle = _handoff(rows * config.d_model * width, rows * P * config.d_model * width)
    return BlockTiming(prefill, decode, step, rows, P, work.new_tokens, threads, decode_cold, step_cold, latency_us,
                       gbps, last_level_cache_bytes(), handoff_idle, woken)


def last_level_cache_bytes() -> int:
    """The largest CPU cache this host reports (Linux sysfs, cpu0's ``cache/index*/size``), in bytes; 0 where it
    does not say."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=0)


def _cold_ms(fn: Callable[[], object], flush: Tensor) -> float:
    """``fn``'s time right after ``flush`` is written through (the caches hold it, not what ``fn`` reads)."""
    flush.add_(1.0)
    os.sched_yield()  # on a busy host, a fresh time slice rather than the end of the one the flush spent
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _other_stages(config: Any, n: int, dtype: torch.dtype, pads: Tensor, context: int, h1: Tensor, at: int
                  ) -> Callable[[], object]:
    """One block's decode step of another copy of ``n`` blocks (other weights, as the other stages have), the next
    block at each call: what :class:`_Idler` runs while the timed thread waits."""
    from ..models.gpt import GPT
    from .kv import Stage

    other = GPT(replace(config, n_layer=n)).eval().to(dtype)
    blocks = [Stage(other, i, i + 1) for i in range(n)]
    for b in blocks:
        b.is_first = b.is_last = False
        b.open(0, pads, context)
    turn = itertools.cycle(blocks)
    return lambda: next(turn).step(0, h1, at)


class _Idler:
    """A thread that stands for a pipeline's other stages while the timing thread waits for its input, as a rank
    waits in ``poll`` on the pipe from the stage before it: asked for a gap, it runs ``work`` (a short piece of the
    other stages' compute: one block's decode step) again and again for that long, busy-waiting what is left
    once another piece would overrun it, then writes a byte to the pipe the timing thread is blocked on.

    A thread, not a process: nothing to start, and the two take turns (the timing thread blocked in the kernel,
    the GIL free), as two ranks do at batch 1. Written here rather than taken from a library: what is timed is
    this host's cost of waking a rank's compute, which needs the rank's own way of waiting.
    """

    def __init__(self, work: Callable[[], object]) -> None:
        self._work = work
        self._ask_r, self._ask_w = os.pipe()
        self._done_r, self._done_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def __enter__(self) -> "_Idler":
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._ask_w)  # the thread reads end of file and returns
        self._thread.join(timeout=10)
        for fd in (self._ask_r, self._done_r, self._done_w):
            os.close(fd)

    def _serve(self) -> None:
        piece = 0.0  # how long one piece of work took last
        while len(ask := os.read(self._ask_r, 8)) == 8:
            end = time.perf_counter() + struct.unpack("d", ask)[0] / 1e3
            while (now := time.perf_counter()) + piece < end:
                self._work()
                piece = time.perf_counter() - now
            busy_wait(max(0.0, end - time.perf_counter()) * 1e6)
            os.write(self._done_w, b"\0")

    def after(self, gap_ms: float, fn: Callable[[], object]) -> float:
        """``fn``'s time (ms) right after this thread waited ``gap_ms`` in ``poll`` for the stand-in's byte (the
        wait and the wake-up left out).

        Raises:
            HandoffError: if the stand-in does not answer within a minute.
        """
        os.write(self._ask_w, struct.pack("d", gap_ms))
        poll = select.poll()
        poll.register(self._done_r, select.POLLIN)
        if not poll.poll(60_000):
            raise HandoffError("timing a block after an idle gap: the thread standing for the other stages did not "
                               "answer within 60 s")
        os.read(self._done_r, 1)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def _handoff(decode_bytes: int, prefill_bytes: int) -> tuple[float, float, tuple[tuple[float, float], ...]]:
    """``(latency us, GB/s, ((idle ms, latency us), ...))`` of a hand-off through pipes here: fitted to
    the decode step's message, the prefill's and a larger one, and the decode step's latency with the receiver
    idle for each of :data:`_IDLE_MS` (:func:`hpml_compile.infer.handoff.measure_handoff`)."""
    rows, idle = measure_handoff(tuple(sorted({max(1, decode_bytes), max(1, prefill_bytes), _HANDOFF_BIG})),
                                 idle_ms=_IDLE_MS)
    (b0, t0), (b1, t1) = rows[0], rows[-1]
    per_byte = max((t1 - t0) / (b1 - b0), 1e-12)  # ms per byte
    return (max(0.0, t0 - b0 * per_byte) * 1e3, 1e-6 / per_byte,
            tuple((ms, max(0.0, t - b0 * per_byte) * 1e3) for ms, t in idle))


def timed_spec(base: cost_models.DeviceSpec, shape: DecoderShape, timing: BlockTiming,
               dtype: str = "float32") -> TimedCpuSpec:
    """``base`` (the catalog's CPU) with the FLOP/s and per-op cost that reproduce ``timing``.

    :func:`hpml_compile.infer.cost.block_ms` prices a CPU block at ``roofline + CPU_OPS_PER_BLOCK * op``:
    the per-op cost ``op`` is fitted to the decode step, the FLOP/s to the prefill, a few rounds since each
    term holds a little of the other; the bandwidth stays the catalog's. What a stage step costs beyond its
    blocks and head (:attr:`BlockTiming.step_ms` less the head as priced) is charged to each stage step. The
    cold decode step (a stage of a pipeline) gets a per-op cost of its own the same way; what the cold step
    outside the blocks took more than the warm one is the head's (its table read from memory: the embedding
    reads a row per sequence); the hand-off's latency (hot and after each idle time timed) and bandwidth are
    carried over. The steps timed after each idle gap get a per-op cost of their own, and what the step outside
    the blocks took more than warm after it (:func:`hpml_compile.infer.cost.woken_extra_ms`).

    Returns:
        The fitted spec, with the step's cost beyond its blocks and head (``step_ms``) and the cold and
        hand-off figures.
    """
    work = Workload(timing.rows, timing.prompt_len, timing.new_tokens, 1, dtype)
    fp, bp = block_flops_bytes(shape, work, decode=False)
    fd, bd = block_flops_bytes(shape, work, decode=True)
    flops, op = float(base.peak_flops.get(dtype, base.peak_flops["float32"])), base.launch_overhead_ms
    for _ in range(4):
        spec = replace(base, peak_flops={**base.peak_flops, dtype: flops}, launch_overhead_ms=op)
        op = max(1e-6, (timing.decode_ms - roofline_ms(OpKind.MATMUL, fd, bd, spec, dtype)) / CPU_OPS_PER_BLOCK)
        compute_ms = max(timing.prefill_ms - CPU_OPS_PER_BLOCK * op, 0.25 * timing.prefill_ms)
        flops = fp / (compute_ms / 1e3)
    fitted = replace(base, peak_flops={**base.peak_flops, dtype: flops}, launch_overhead_ms=op, measured=True,
                     source=f"timed on this host: one block at {timing.rows} rows, prompt {timing.prompt_len}, "
                            f"torch threads {timing.threads}")
    extra = max(0.0, timing.step_ms - head_ms(fitted, shape, work))  # the head is priced on its own
    cold_op = cold_head = 0.0
    if timing.decode_cold_ms > 0:
        cold_op = max(1e-6, (timing.decode_cold_ms - roofline_ms(OpKind.MATMUL, fd, bd, fitted, dtype))
                      / CPU_OPS_PER_BLOCK)
        cold_head = max(0.0, timing.step_cold_ms - timing.step_ms)  # the table read from memory: the head's
    floor = roofline_ms(OpKind.MATMUL, fd, bd, fitted, dtype)  # what no per-op cost explains
    woken = tuple((gap, max(op, (blk - floor) / CPU_OPS_PER_BLOCK), max(0.0, out - timing.step_ms))
                  for gap, blk, out in timing.decode_idle)
    return TimedCpuSpec(**{f.name: getattr(fitted, f.name) for f in fields(cost_models.DeviceSpec)}, step_ms=extra,
                        cold_op_ms=cold_op, cold_head_ms=cold_head, handoff_us=timing.handoff_us,
                        handoff_gbps=timing.handoff_gbps, llc_bytes=timing.llc_bytes,
                        handoff_idle=timing.handoff_idle, idle_compute=woken)


def timed_specs(shape: DecoderShape, timing: BlockTiming | None, dtype: str = "float32"
                ) -> dict[str, cost_models.DeviceSpec] | None:
    """``{"cpu": timed_spec(...)}`` for a plan with a timing, else None (the catalog prices it)."""
    if timing is None:
        return None
    return {"cpu": timed_spec(cost_models.get_device("cpu"), shape, timing, dtype)}
