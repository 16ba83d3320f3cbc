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
to back predicts, on a quiet 2-core VM). What it pays depends on how long it
idled and on what ran meanwhile, so rather than stand in for either, the
blocks timed are split in two stages (the first half with the embedding, the
rest with the head) that take turns with one lane as a 2-stage plan's ranks
do: each computes its step, hands it on through the generator's pipes and
waits in ``poll`` while the other computes
(:func:`hpml_compile.infer.handoff.ping_pong`). Both steps are timed (the
hand-offs and the wake-ups left out: the hand-off's idle latency prices
those), with each side idle for the other's step, and again with each side
busy a little and a good deal longer before it hands on
(:data:`_TURN_SPIN_MS`), for stages longer than the model's halves.

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

import os
import statistics
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

import cost_models
from cost_models.roofline import OpKind, roofline_ms

from .cost import (CPU_OPS_PER_BLOCK, DecoderShape, TimedCpuSpec, Workload, block_flops_bytes, block_ms,
                   head_ms)
from .handoff import measure_handoff, ping_pong

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
# How long each side of the two timed taking turns stays busy after its step, per point (ms): as the model's own
# halves, then as stages a little and a good deal longer; a longer idle is priced at the last point. Each point
# costs its rounds the two halves' steps and twice its spin (~0.5 s in all for gpt-mini).
_TURN_SPIN_MS = (0.0, 1.0, 4.0)


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
    # (idle ms, ring ms) per point: the timed blocks split in two stages taking turns with one lane, how long each
    # side idled between its steps (the other side's step and spin, the wake-ups left out) and both steps together
    decode_turns: tuple[tuple[float, float], ...] = ()
    turn_blocks: int = 0  # the blocks of those two stages together

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BlockTiming":
        return cls(float(d["prefill_ms"]), float(d["decode_ms"]), float(d["step_ms"]), int(d["rows"]),
                   int(d["prompt_len"]), int(d["new_tokens"]), int(d["threads"]), float(d.get("decode_cold_ms", 0.0)),
                   float(d.get("step_cold_ms", 0.0)), float(d.get("handoff_us", 0.0)),
                   float(d.get("handoff_gbps", 0.0)), int(d.get("llc_bytes", 0)),
                   tuple((float(ms), float(us)) for ms, us in d.get("handoff_idle", ())),
                   tuple((float(g), float(r)) for g, r in d.get("decode_turns", ())), int(d.get("turn_blocks", 0)))


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
        first, second, halves = _halves(model, n, pads, work.context, at)
        turns: list[tuple[list[float], list[float]]] = [([], []) for _ in _TURN_SPIN_MS]
        for _ in range(_REPEATS):  # interleaved, so that a busy spell of the host weighs on each alike
            runs[0].append(_median_ms(lambda: [blocks.step(0, h1, at) for _ in range(_RUN)], 1) / _RUN / n)
            runs[1].append(_median_ms(lambda: [ends.step(0, ids, at).float().argmax(-1).tolist()
                                               for _ in range(_RUN)], 1) / _RUN)
            for _ in range(_COLD):
                runs[2].append(_cold_ms(lambda: blocks.step(0, h1, at), flush) / n)
                runs[3].append(_cold_ms(lambda: ends.step(0, ids, at).float().argmax(-1).tolist(), flush))
            for spin, (idle, ring) in zip(_TURN_SPIN_MS, turns):  # the halves taking turns, one lane
                a, b, _ = ping_pong(first, second, ids, _COLD, spin_ms=spin)
                # a side idles for the other's step and spin, on average; the wake-ups are left out, as the plan
                # leaves them out of a rank's idle (they are the hand-off's price)
                idle.append((a + b) / 2 + spin)
                ring.append(a + b)
        for stage in (blocks, ends, *halves):
            stage.close()
        decode, step, decode_cold, step_cold = (statistics.median(r) for r in runs)
        # a cold step is never faster than a warm one: where a busy host's preemptions made it so (a run of warm
        # steps is preempted more often than one step on a fresh time slice), warm it is
        decode_cold, step_cold = max(decode_cold, decode), max(step_cold, step)
    finally:
        torch.set_num_threads(before)
    width = torch.finfo(dtype).bits // 8
    latency_us, gbps, handoff_idle = _handoff(rows * config.d_model * width, rows * P * config.d_model * width)
    points: list[tuple[float, float]] = []
    for idle, ring in turns:  # a longer spin, a longer idle: where a busy host's medians cross, just longer
        least = points[-1][0] + 1e-3 if points else 0.0
        points.append((max(statistics.median(idle), least), statistics.median(ring)))
    return BlockTiming(prefill, decode, step, rows, P, work.new_tokens, threads, decode_cold, step_cold, latency_us,
                       gbps, last_level_cache_bytes(), handoff_idle, tuple(points), n)


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


def _halves(model: Any, n: int, pads: Tensor, context: int, at: int
            ) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor], tuple[Any, ...]]:
    """The ``n`` blocks of ``model`` as two stages of a plan, the first half with the embedding and the rest with
    the head: ``(first's decode step: token ids in, hidden states out; second's: hidden states in, greedy token
    ids out; the two stages, to close)``, each step at cache slot ``at`` of its one lane."""
    from .kv import Stage

    first, second = Stage(model, 0, n // 2), Stage(model, n // 2, n)
    second.is_first = False  # hidden states in, even with no blocks before it
    dtype = first.dtype
    for s in (first, second):
        s.open(0, pads, context)
    return (lambda x: first.step(0, x, at).float(),
            lambda h: second.step(0, h.to(dtype), at).float().argmax(-1, keepdim=True),
            (first, second))


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
    carried over. What the two stages timed taking turns took beyond their price back to back, per point timed,
    is spread over their blocks as a per-op cost of a step woken after that long idle
    (:func:`hpml_compile.infer.cost.woken_extra_ms`).

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
    spec = TimedCpuSpec(**{f.name: getattr(fitted, f.name) for f in fields(cost_models.DeviceSpec)}, step_ms=extra,
                        cold_op_ms=cold_op, cold_head_ms=cold_head, handoff_us=timing.handoff_us,
                        handoff_gbps=timing.handoff_gbps, llc_bytes=timing.llc_bytes,
                        handoff_idle=timing.handoff_idle)
    return replace(spec, idle_compute=_woken(spec, shape, work, timing))


def _woken(spec: TimedCpuSpec, shape: DecoderShape, work: Workload, timing: BlockTiming
           ) -> tuple[tuple[float, float], ...]:
    """``spec.idle_compute`` from the two stages timed taking turns: per point, what their steps took beyond
    what ``spec`` prices them at back to back (their blocks, the head and each stage's step beyond them), spread
    over their blocks as a per-op cost (:func:`hpml_compile.infer.cost.woken_extra_ms`)."""
    n = timing.turn_blocks
    if n <= 0:
        return ()
    warm = block_ms(spec, shape, work, n, decode=True) + head_ms(spec, shape, work) + 2 * spec.step_ms
    op = spec.launch_overhead_ms
    return tuple((idle, op + max(0.0, ring - warm) / (n * CPU_OPS_PER_BLOCK)) for idle, ring in timing.decode_turns)


def timed_specs(shape: DecoderShape, timing: BlockTiming | None, dtype: str = "float32"
                ) -> dict[str, cost_models.DeviceSpec] | None:
    """``{"cpu": timed_spec(...)}`` for a plan with a timing, else None (the catalog prices it)."""
    if timing is None:
        return None
    return {"cpu": timed_spec(cost_models.get_device("cpu"), shape, timing, dtype)}
