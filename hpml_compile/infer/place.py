"""Speed-aware placement of a decoder's blocks on GPUs and CPUs for inference.

The idea that a serving planner should place layers by each device's speed,
not by its free memory, and leave out a device that would slow the pipeline,
is Helix's (Mei et al., "Helix: Serving Large Language Models over
Heterogeneous GPUs and Network via Max-Flow", arXiv 2406.01566), which solves
a max-flow MILP over many request paths. This module solves the single-path
case exactly and in milliseconds with a dynamic program of its own.

**What is optimised.** Devices are ordered fastest first (a block's decode
time). A plan is a sequence of stages, each a contiguous range of blocks on
one device, taken from that order with devices skipped (left idle). With
``M`` microbatch lanes of the ``B`` sequences, stage ``s`` taking ``p_s`` per
microbatch to prefill and ``d_s`` per decode step (its input's transfer
included), the batch takes

    prefill  P = sum_s p_s + (M - 1) max_s p_s               (the pipeline fills once)
    step     T = max(M max_s d_s, sum_s d_s' + return')      (lanes keep the stages busy, but a lane's
                                                               next token needs its last one back)
    total    P + (new_tokens - 1) T,  tokens/s = B new_tokens / total

where a primed time prices the hand-off into its stage with the receiver woken
from a wait (``(T - M d_s) / M`` on average, ``T`` first priced with no wait):
a rank of a pipeline whose lanes do not keep it busy (one lane at batch 1)
waits in the kernel while the others compute and takes longer to wake than
one that waited microseconds (:func:`hpml_compile.infer.cost.wake_us`), and
its ``d_s'`` is also the step it computes once woken, which on a CPU costs
more than one run back to back (:func:`hpml_compile.infer.cost.woken_extra_ms`).

Objective ``throughput`` maximises tokens/s, subject to ``T <= bound`` when a
per-token latency bound is given; ``latency`` minimises ``P + (n - 1) T`` at
batch 1 (one lane: the sum of the stages).

**How.** For a cap ``tau`` on every stage's work ``w_s = p_s / (n - 1) + d_s``,
:func:`_min_sum` finds the placement of least ``sum_s w_s`` whose stages all
fit their device's memory (:func:`hpml_compile.infer.cost.stage_bytes`) and
stay under the cap: a DP over (device, last block) in which each step places
one range on the next device used, vectorised over the range's ends. The
time ``max(M tau, sum)`` trades the two, so the caps are swept over the
distinct stage works and every lane count ``M`` in :data:`LANES`; each
candidate is scored exactly (:func:`score`) and the best kept. A stage may
instead stream its blocks' weights from host memory ahead of use (priced on
the host link, :func:`hpml_compile.infer.cost.stream_ms`) when they do not fit
resident; a CPU is an ordinary stage that computes its blocks.

A device the best plan leaves out is explained: the best plan that must use
it, with the same lane count, is found the same way and the plan says how
many tokens/s it would give, or that it cannot hold a stage.

Example:
    >>> from hpml_compile.cluster import load_cluster
    >>> from hpml_compile.models.gpt import PRESETS
    >>> p = place(DecoderShape.from_config(PRESETS["llama-7b"]), load_cluster("hetero-4"),
    ...           Workload(batch=16, prompt_len=512, new_tokens=128, dtype="bfloat16"))
    >>> [s.device for s in p.stages][0], p.predicted.tokens_per_s > 0
    ('gpu0', True)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

import numpy as np

import cost_models
from cost_models.comm import p2p_ms

from ..cluster import link_spec
from ..errors import InfeasibleError, OptionError
from ..ir import Cluster
from .cost import (DTYPE_BYTES, DecoderShape, Objective, Workload, block_ms, cold_head_ms, device_spec, handoff_ms,
                   head_ms, stage_bytes, step_extra_ms, stream_ms, woken_extra_ms)
from .plan import InferencePlan, InferenceStage, Prediction

__all__ = ["LANES", "MEMORY_FRACTION", "place", "score", "stages_for", "device_order", "predict_run",
           "replan_without", "decode_floor_ms", "decode_compute_ms"]

LANES: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)  # microbatch counts tried
MEMORY_FRACTION = 0.9  # of a device's memory a plan may use (allocator reserve, the runtime's own buffers)
_CAPS = 24  # stage-work caps tried per lane count


@dataclass(frozen=True, slots=True)
class _Costs:
    """Per device (in pipeline order), the time and memory of every block range ``[a, i)``."""

    names: tuple[str, ...]
    work: np.ndarray  # [D, L+1, L+1] per-token work of the stage (inf where it does not fit), input send included
    stream: np.ndarray  # [D, L+1, L+1] bool: the cheaper feasible variant streams its weights


def device_order(cluster: Cluster, shape: DecoderShape, work: Workload,
                 specs: Mapping[str, cost_models.DeviceSpec] | None = None) -> list[str]:
    """Devices fastest first by one block's decode time (then by name)."""
    t = {d.name: block_ms(device_spec(d, specs), shape, work, 1, decode=True) for d in cluster.devices}
    return sorted(t, key=lambda n: (t[n], n))


def _hand_ms(cluster: Cluster, a: str, b: str, nbytes: float,
             specs: Mapping[str, cost_models.DeviceSpec] | None, idle_ms: float = 0.0) -> float:
    """One message of ``nbytes`` from device ``a`` to ``b``: between two CPUs of one host, the hand-off measured
    there where the specs carry it, its receiver idle for ``idle_ms`` before it
    (:func:`hpml_compile.infer.cost.handoff_ms`); else over the cluster's link."""
    da, db = cluster.device(a), cluster.device(b)
    if da.is_cpu and db.is_cpu and da.host == db.host:
        here = handoff_ms(device_spec(da, specs), nbytes, idle_ms)
        if here is not None:
            return here
    return p2p_ms(nbytes, link_spec(cluster, a, b))


def _send_ms(cluster: Cluster, a: str | None, b: str, shape: DecoderShape, work: Workload, decode: bool,
             specs: Mapping[str, cost_models.DeviceSpec] | None = None, idle_ms: float = 0.0) -> float:
    if a is None or a == b:
        return 0.0
    tokens = work.rows * (1 if decode else work.prompt_len)
    return _hand_ms(cluster, a, b, tokens * shape.d_model * DTYPE_BYTES[work.dtype], specs, idle_ms)


def _stage(cluster: Cluster, shape: DecoderShape, work: Workload, device: str, first: int, end: int,
           stream: bool, specs: Mapping[str, cost_models.DeviceSpec] | None, cold: bool = False) -> InferenceStage:
    """A priced stage; ``cold``: one of several, whose decode steps find a CPU's caches emptied by the others.

    Of a cold stage's ``M`` lanes per step, the first finds its weights out of the caches (the other stages ran
    since its last step) and the others right after it find them in: its decode time per lane is the warm
    one plus ``1 / M`` of what a cold step costs more (:func:`hpml_compile.infer.cost.block_ms`).
    """
    spec = device_spec(cluster.device(device), specs)
    n, embed, head = end - first, first == 0, end == shape.n_layer
    pre, dec = block_ms(spec, shape, work, n, decode=False), block_ms(spec, shape, work, n, decode=True)
    if cold:
        dec += (block_ms(spec, shape, work, n, decode=True, cold=True) - dec
                + (cold_head_ms(spec, shape, work) if head else 0.0)) / work.microbatches
    if head:
        pre, dec = pre + head_ms(spec, shape, work), dec + head_ms(spec, shape, work)
    pre, dec = pre + step_extra_ms(spec), dec + step_extra_ms(spec)
    if stream:
        copy = stream_ms(spec, shape, work, n)
        pre, dec = max(pre, copy), max(dec, copy)
    return InferenceStage(device, first, end, embed, head, stream, pre, dec,
                          stage_bytes(shape, work, n, embed=embed, head=head, stream=stream))


def score(cluster: Cluster, shape: DecoderShape, work: Workload, stages: Sequence[InferenceStage], *,
          sequential: bool = False, specs: Mapping[str, cost_models.DeviceSpec] | None = None) -> Prediction:
    """The predicted times of ``stages`` on ``work`` (formulas in the module docstring).

    Args:
        cluster: where the devices are (for the links between stages).
        shape: the model.
        work: the workload the stages were priced for.
        stages: the pipeline, priced (``prefill_ms``/``decode_ms`` per microbatch).
        sequential: one stage works at a time on the whole batch (no lanes), as a memory-proportional
            placement runs it.
        specs: the device specs the stages were priced with (a hand-off between CPUs of one host measured
            there prices their sends, :func:`hpml_compile.infer.cost.handoff_ms`).

    Returns:
        The prediction.
    """
    names = [s.device for s in stages]
    prev: list[str | None] = [None, *names[:-1]]
    lanes = 1 if sequential else work.microbatches
    p: list[float] = []
    for s, a in zip(stages, prev):  # each stage waited for the ones before it to prefill the first lane
        p.append(s.prefill_ms + _send_ms(cluster, a, s.device, shape, work, False, specs, idle_ms=sum(p)))
    prefill = sum(p) + (lanes - 1) * max(p)
    step, _ = _decode_step(cluster, shape, work, stages, lanes, specs)
    total = prefill + (work.new_tokens - 1) * step
    return Prediction(work.batch * work.new_tokens / (total / 1e3), prefill, step, total)


def decode_compute_ms(cluster: Cluster, shape: DecoderShape, work: Workload, stages: Sequence[InferenceStage], *,
                      specs: Mapping[str, cost_models.DeviceSpec] | None = None) -> list[float]:
    """Per stage, one lane's decode compute as :func:`score` prices the step: the stage's ``decode_ms``, or more
    where its rank idles between its lanes long enough that a step woken from the wait costs more
    (:func:`hpml_compile.infer.cost.woken_extra_ms`). Arguments as :func:`score`'s."""
    return _decode_step(cluster, shape, work, stages, work.microbatches, specs)[1]


def _decode_step(cluster: Cluster, shape: DecoderShape, work: Workload, stages: Sequence[InferenceStage], lanes: int,
                 specs: Mapping[str, cost_models.DeviceSpec] | None) -> tuple[float, list[float]]:
    """``(one decode step, per stage one lane's compute in it)`` (module docstring: ``T`` with primed times)."""
    names = [s.device for s in stages]
    prev: list[str | None] = [None, *names[:-1]]
    d = [s.decode_ms + _send_ms(cluster, a, s.device, shape, work, True, specs) for s, a in zip(stages, prev)]
    if len(names) == 1:
        return lanes * d[0], [stages[0].decode_ms]
    back = _hand_ms(cluster, names[-1], names[0], 8 * work.rows, specs)
    step = max(lanes * max(d), sum(d) + back)
    # a lane's way round wakes each rank from a wait (on average the step less its own work, over its lanes): its
    # hand-off in takes longer, and so does the step it then computes
    idle = [max(0.0, step - lanes * x) / lanes for x in d]
    compute = [_woken_ms(cluster, shape, work, s, specs, i) for s, i in zip(stages, idle)]
    woken = [c + _send_ms(cluster, a, s.device, shape, work, True, specs, idle_ms=i)
             for c, s, a, i in zip(compute, stages, prev, idle)]
    back = _hand_ms(cluster, names[-1], names[0], 8 * work.rows, specs, idle_ms=idle[0])
    hot = [c + x - s.decode_ms for c, x, s in zip(compute, d, stages)]
    return max(lanes * max(hot), sum(woken) + back), compute


def _woken_ms(cluster: Cluster, shape: DecoderShape, work: Workload, stage: InferenceStage,
              specs: Mapping[str, cost_models.DeviceSpec] | None, idle_ms: float) -> float:
    """A lane's decode compute on ``stage`` when its rank was idle ``idle_ms`` before it: the warm step and what
    waking costs more (where timed), unless the stage's own price (its weights out of the caches) is more."""
    extra = woken_extra_ms(device_spec(cluster.device(stage.device), specs), shape, work, stage.end - stage.first,
                           idle_ms)
    if extra <= 0:
        return stage.decode_ms
    warm = _stage(cluster, shape, work, stage.device, stage.first, stage.end, stage.stream, specs).decode_ms
    return max(stage.decode_ms, warm + extra)


def _memory(shape: DecoderShape, work: Workload, count: np.ndarray, embed: np.ndarray, head: np.ndarray, *,
            stream: bool) -> np.ndarray:
    """:func:`stage_bytes` over arrays of block counts (it is linear in them but for the streamed buffers)."""
    act = stage_bytes(shape, work, 0, embed=False, head=False)
    extra = {(e, h): stage_bytes(shape, work, 0, embed=e, head=h) - act for e in (False, True) for h in (False, True)}
    resident = np.minimum(count, 2) if stream else count
    ends = np.where(embed & head, extra[True, True], np.where(embed, extra[True, False], 0)
                    + np.where(head, extra[False, True], 0))
    per_block = shape.block_params() * DTYPE_BYTES[work.dtype]
    return act + shape.kv_bytes(work, 1) * count + per_block * resident + ends


def _costs(cluster: Cluster, shape: DecoderShape, work: Workload, order: Sequence[str],
           specs: Mapping[str, cost_models.DeviceSpec] | None) -> _Costs:
    L, per = shape.n_layer, max(work.new_tokens - 1, 1)
    n = np.arange(L + 1)
    a_idx, i_idx = np.meshgrid(n, n, indexing="ij")  # [a, i]: the range [a, i)
    count = i_idx - a_idx
    valid = count > 0
    works, streams = [], []
    for name in order:
        dev = cluster.device(name)
        spec = device_spec(dev, specs)
        warm = block_ms(spec, shape, work, 1, decode=True)
        cold = block_ms(spec, shape, work, 1, decode=True, cold=True) if len(order) > 1 else warm
        blk = block_ms(spec, shape, work, 1, decode=False) / per + warm + (cold - warm) / work.microbatches
        hd = head_ms(spec, shape, work) * (1 / per + 1)
        copy = stream_ms(spec, shape, work, 1) * (1 / per + 1)
        embed, head = a_idx == 0, i_idx == L
        resident_t = count * blk + head * hd
        cap = dev.memory_bytes * MEMORY_FRACTION
        fits = _memory(shape, work, count, embed, head, stream=False) <= cap
        w = np.where(valid & fits, resident_t, np.inf)
        s = np.zeros_like(valid)
        if copy > 0:  # a GPU may stream what does not fit resident
            fits_s = _memory(shape, work, count, embed, head, stream=True) <= cap
            ws = np.where(valid & fits_s, np.maximum(resident_t, count * copy), np.inf)
            s = ws < w
            w = np.minimum(w, ws)
        works.append(w)
        streams.append(s)
    return _Costs(tuple(order), np.stack(works), np.stack(streams))


def _min_sum(costs: _Costs, send: np.ndarray, tau: float, required: frozenset[int]) -> list[tuple[int, int, int]] | None:
    """Least total work with every stage's work at most ``tau``; ``required`` devices must be used.

    Returns:
        ``[(device index, first, end), ...]`` in pipeline order, or None if nothing fits.
    """
    D, L = costs.work.shape[0], costs.work.shape[1] - 1
    lo = min(required, default=D)  # no device before the first required one may be skipped past it
    hi = max(required, default=-1)
    f = np.full((D, L + 1), np.inf)
    parent: dict[tuple[int, int], tuple[int, int]] = {}
    for j in range(D):
        w = np.where(costs.work[j] <= tau, costs.work[j], np.inf)  # [a, i]
        if j <= lo:  # a first stage: starts at block 0
            f[j] = w[0]
        for jp in range(j):
            if any(jp < r < j for r in required):
                continue
            cand = f[jp][:, None] + send[jp, j] + w  # [a, i]: previous stage ends at a
            cand[0, :] = np.inf
            cand = np.where(w + send[jp, j] <= tau, cand, np.inf)
            best_a = np.argmin(cand, axis=0)
            best = cand[best_a, np.arange(L + 1)]
            better = best < f[j]
            for i in np.nonzero(better)[0]:
                parent[(j, int(i))] = (jp, int(best_a[i]))
            f[j] = np.where(better, best, f[j])
    ends = [j for j in range(D) if j >= hi and math.isfinite(f[j][L])]
    if not ends:
        return None
    j, i = min(ends, key=lambda x: f[x][L]), L
    out = []
    while True:
        pj = parent.get((j, i))
        first = pj[1] if pj else 0
        out.append((j, first, i))
        if pj is None:
            break
        j, i = pj
    return out[::-1]


def stages_for(cluster: Cluster, shape: DecoderShape, work: Workload, ranges: Iterable[tuple[str, int, int, bool]],
               specs: Mapping[str, cost_models.DeviceSpec] | None = None) -> tuple[InferenceStage, ...]:
    """Price given ``(device, first, end, stream)`` ranges as stages (for baselines and tests)."""
    ranges = list(ranges)
    return tuple(_stage(cluster, shape, work, d, a, b, s, specs, cold=len(ranges) > 1) for d, a, b, s in ranges)


def _search(cluster: Cluster, shape: DecoderShape, work: Workload, order: Sequence[str], objective: Objective,
            bound: float | None, required: frozenset[int], specs: Mapping[str, cost_models.DeviceSpec] | None,
            lanes: tuple[int, ...] | None = None) -> tuple[tuple[InferenceStage, ...], Workload, Prediction] | None:
    best: tuple[tuple[InferenceStage, ...], Workload, Prediction] | None = None
    if lanes is None:
        lanes = (1,) if objective is Objective.LATENCY else tuple(m for m in LANES if m <= work.batch)
    for m in lanes:
        w = replace(work, microbatches=m)
        costs = _costs(cluster, shape, w, order, specs)
        D = len(order)
        send = np.array([[_send_ms(cluster, order[a], order[b], shape, w, True, specs) for b in range(D)]
                         for a in range(D)])
        finite = np.unique(costs.work[np.isfinite(costs.work)])
        if finite.size == 0:
            continue
        caps = [math.inf] if objective is Objective.LATENCY else sorted(
            {*np.quantile(finite, np.linspace(0, 1, _CAPS)).tolist(), math.inf})
        for tau in caps:
            found = _min_sum(costs, send, tau, required)
            if found is None:
                continue
            stages = tuple(_stage(cluster, shape, w, order[j], a, b, bool(costs.stream[j, a, b]), specs,
                                  cold=len(found) > 1) for j, a, b in found)
            pred = score(cluster, shape, w, stages, specs=specs)
            if bound is not None and pred.token_ms > bound:
                continue
            if best is None or pred.total_ms * best[1].batch < best[2].total_ms * w.batch:
                best = (stages, w, pred)
    return best


def place(shape: DecoderShape, cluster: Cluster, work: Workload, *, objective: Objective | str = Objective.THROUGHPUT,
          latency_bound_ms: float | None = None, model: str = "custom",
          specs: Mapping[str, cost_models.DeviceSpec] | None = None, explain_idle: bool = True) -> InferencePlan:
    """The fastest pipeline for ``work`` on ``cluster`` (see the module docstring).

    Args:
        shape: the model's sizes.
        cluster: the devices that may be used.
        work: the workload; its ``microbatches`` is searched (:data:`LANES`); with the ``latency`` objective
            it is served at batch 1.
        objective: ``throughput`` or ``latency``.
        latency_bound_ms: with ``throughput``, the most one decode step (per-token latency) may take.
        model: the model's name, recorded in the plan.
        specs: device specs by kind, overriding the catalog (a simulated CPU, say).
        explain_idle: find, for each device left out, the best plan that uses it (the reason given).

    Returns:
        The plan.

    Raises:
        OptionError: on a bad bound or a device kind the catalog lacks.
        InfeasibleError: if no placement fits memory (or the bound), naming what would.
    """
    t0 = time.perf_counter()
    objective = Objective(objective)
    if latency_bound_ms is not None and not latency_bound_ms > 0:
        raise OptionError(f"inference plan: the per-token latency bound must be > 0 ms, got {latency_bound_ms}")
    if objective is Objective.LATENCY:
        work = replace(work, batch=1, microbatches=1)
    order = device_order(cluster, shape, work, specs)
    best = _search(cluster, shape, work, order, objective, latency_bound_ms, frozenset(), specs)
    if best is None:
        need = stage_bytes(shape, replace(work, microbatches=work.batch), shape.n_layer, embed=True, head=True)
        have = sum(d.memory_bytes for d in cluster.devices) * MEMORY_FRACTION
        why = (f"no plan meets the per-token bound of {latency_bound_ms:g} ms; raise it or add a faster device"
               if latency_bound_ms is not None and _search(cluster, shape, work, order, objective, None,
                                                           frozenset(), specs) is not None
               else f"the model with its KV cache needs about {need / 2**30:.3g} GiB (batch {work.batch}, "
                    f"context {work.context}, {work.dtype}) and cluster {cluster.name} offers "
                    f"{have / 2**30:.3g} GiB; lower the batch or the context, serve in a 2-byte dtype, or add "
                    "a device")
        raise InfeasibleError(f"inference plan: {why}")
    stages, work, pred = best
    idle: list[tuple[str, str]] = []
    used = {s.device for s in stages}
    for j, name in enumerate(order):
        if name in used:
            continue
        why = "not needed: the plan was not asked why"
        if explain_idle:
            forced = _search(cluster, shape, work, order, objective, latency_bound_ms, frozenset({j}), specs,
                             lanes=(work.microbatches,))
            why = ("it cannot hold a stage next to the others (memory)" if forced is None else
                   f"the best plan using it ({work.microbatches} lanes) predicts {forced[2].tokens_per_s:.4g} "
                   f"tokens/s, no more than {pred.tokens_per_s:.4g} without it")
        idle.append((name, why))
    return InferencePlan(objective, model, shape, work, cluster, stages, pred, tuple(idle), latency_bound_ms,
                         (time.perf_counter() - t0) * 1e3)


def decode_floor_ms(shape: DecoderShape, cluster: Cluster, work: Workload,
                    specs: Mapping[str, cost_models.DeviceSpec] | None = None) -> float:
    """A lower bound on one decode step of any pipeline :func:`place` can return on ``cluster``, any lanes.

    :func:`score` prices a step at ``max(M max_s d_s, sum_s d_s + return) >= sum_s d_s``, and a stage's
    ``d_s`` (one lane) is at least its blocks' decode time at one row (the time grows with the rows), made
    longer by the copy when its weights are streamed. Dropping everything else (sends, the head, the
    activations and cache in memory, one stage per device), the least ``sum_s d_s`` assigns the
    ``n_layer`` identical blocks to per-block slots: ``floor(memory / block bytes)`` resident slots per
    device at its block time and, on a GPU, unlimited streamed slots at the longer of the block time and
    the copy; filling the cheapest slots first is optimal. In a weight-bandwidth-bound decode this is the
    model's weights read once per step from the fastest memories that hold them, which is what filling the
    fastest GPU first already does: no pipeline, whatever its lanes, beats that by more than the prefill
    and the cache's share.

    Args:
        shape: the model.
        cluster: the devices.
        work: the workload (its batch and lanes do not matter: one row is priced).
        specs: device specs by name or kind, as :func:`place` takes them.

    Returns:
        Milliseconds.
    """
    one = replace(work, batch=1, microbatches=1)
    block_bytes = shape.block_params() * DTYPE_BYTES[work.dtype]
    slots: list[tuple[float, float]] = []  # (ms per block, how many blocks)
    for dev in cluster.devices:
        spec = device_spec(dev, specs)
        b1 = block_ms(spec, shape, one, 1, decode=True)
        slots.append((b1, math.floor(dev.memory_bytes * MEMORY_FRACTION / block_bytes)))
        copy = stream_ms(spec, shape, one, 1)
        if copy > 0:
            slots.append((max(b1, copy), math.inf))
    left, total = shape.n_layer, 0.0
    for ms, count in sorted(slots):
        take = min(left, count)
        total += take * ms
        left -= take
        if left == 0:
            return total
    return math.inf  # no plan holds the model: nothing to bound


def predict_run(plan: InferencePlan, batch: int, prompt_len: int, new_tokens: int, lanes: int) -> Prediction:
    """What ``plan``'s stages predict for one run of its generator (its own batch, lengths and lanes)."""
    work = Workload(batch, max(prompt_len, 1), max(new_tokens, 1), max(1, min(lanes, batch)), plan.workload.dtype)
    ranges = [(s.device, s.first, s.end, s.stream) for s in plan.stages]
    specs = plan.specs()
    return score(plan.cluster, plan.shape, work, stages_for(plan.cluster, plan.shape, work, ranges, specs),
                 specs=specs)


def replan_without(plan: InferencePlan, lost: Iterable[str],
                   specs: Mapping[str, cost_models.DeviceSpec] | None = None) -> InferencePlan:
    """``plan``'s model and workload placed again on its cluster without the ``lost`` devices (``specs``: as
    :func:`place` takes them, e.g. the speeds measured while serving).

    Raises:
        InfeasibleError: if the devices left cannot hold the model (naming the memory).
    """
    gone = set(lost)
    devices = tuple(d for d in plan.cluster.devices if d.name not in gone)
    if not devices:
        raise InfeasibleError(f"inference plan: no device is left of {plan.cluster.name}")
    left = Cluster(devices=devices, links=tuple(x for x in plan.cluster.links if x.a not in gone and x.b not in gone),
                   name=f"{plan.cluster.name} without {', '.join(sorted(gone))}",
                   hosts=tuple(h for h in plan.cluster.hosts if any(d.host == h.name for d in devices)))
    new = place(plan.shape, left, plan.workload, objective=plan.objective, latency_bound_ms=plan.latency_bound_ms,
                model=plan.model, specs=specs if specs is not None else plan.specs(), explain_idle=False)
    return replace(new.with_model(plan.model, plan.seed, plan.weights), cpu_timing=plan.cpu_timing)
