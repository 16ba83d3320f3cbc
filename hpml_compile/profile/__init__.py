"""Pass 2, profile: per-node costs of a traced model on every device kind asked for.

``profile()`` = static facts on meta tensors (:mod:`.static`: op kind, FLOPs,
bytes) + times measured on the devices that are present (:mod:`.timing`: the
CPU always, a CUDA GPU when there is one) + predictions from ``cost_models``
for device kinds that are not present, calibrated on the measured ones and
marked ``"measured": false``. The result is a :class:`~hpml_compile.ir.Profile`,
saved as profile.json; re-planning needs only that file, not the model.

Example:
    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())
    >>> p = profile(m, (torch.randn(8, 32),), device_kinds=("cpu", "A100-80GB"), repeats=3, progress=False)
    >>> p.node("_0").cost["cpu"].measured, p.node("_0").cost["A100-80GB"].measured
    (True, False)
"""

from __future__ import annotations

from dataclasses import replace
import math
import os
import statistics
from pathlib import Path
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

import cost_models
from cost_models.calibrate import Calibration, OpSample, fit, predict_ms

from ..errors import HpmlError, OptionError, UnknownDeviceError
from ..hostmem import keep_freed_memory
from ..ir import BackwardTiming, FrontEnd, NodeCost, NodeOp, Precision, Profile, ProfileNode
from ..precision import autocast
from ..schema import read_json, write_json_atomic
from ..trace import node_info, trace
from .compiled import compiled_costs
from .optcorun import time_optimizer_corun
from .split import split_facts
from .static import NodeFacts, Segment, analyze, segments
from .corun import time_corun
from .timing import (host_facts, measure, slice_rows, time_optimizer, time_segments, time_streams,
                     time_whole)

__all__ = ["profile", "predict_kinds", "check_known_kinds", "local_kinds", "save_profile", "load_profile"]

# A backward pass reads the saved inputs and the output gradient and writes the
# input and weight gradients: about twice the forward's traffic.
_BWD_MEM_FACTOR = 2.0


def check_known_kinds(kinds: Sequence[str], known: Sequence[str] = (), where: str = "the profile") -> None:
    """Check that every requested device kind is known: in ``known`` or in the cost_models catalog.

    Args:
        kinds: the device kinds asked for.
        known: kinds known besides the catalog's (this machine's devices, a profile's kinds).
        where: where ``known`` comes from, for the message.

    Raises:
        UnknownDeviceError: naming the first unknown kind, ``known`` and the catalog's kinds.
    """
    catalog = set(cost_models.known_kinds())
    for kind in kinds:
        if kind not in catalog and kind not in known:
            raise UnknownDeviceError(
                f"unknown device kind {kind!r}: it is neither in {where} ({', '.join(known) or 'none'}) "
                f"nor in the cost_models catalog ({', '.join(sorted(catalog))}); use one of those names "
                "or profile on that device")


def local_kinds() -> dict[str, torch.device]:
    """Device kinds present on this machine and where to measure them: the CPU, and each CUDA GPU kind."""
    kinds = {"cpu": torch.device("cpu")}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            kind = cost_models.kind_from_cuda_name(props.name, props.total_memory) or props.name
            kinds.setdefault(kind, torch.device("cuda", i))
    return kinds


def _is_meta(model: torch.nn.Module, inputs: Sequence[Any]) -> bool:
    tensors = [*model.parameters(), *model.buffers(), *(x for x in inputs if isinstance(x, torch.Tensor))]
    return any(t.is_meta for t in tensors)


def _infer_sizes(inputs: Sequence[Any]) -> tuple[int, int | None]:
    first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    if first is None:
        return 1, None
    seq = int(first.shape[1]) if first.dim() >= 2 and not first.is_floating_point() else None
    return int(first.shape[0]), seq


def _dtype(model: torch.nn.Module) -> str:
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return str(p.dtype).removeprefix("torch.") if p is not None else "float32"


def _measure_on(gm: fx.GraphModule, inputs: Sequence[Any], device: torch.device, repeats: int, warmup: int,
                progress: bool, loss: tuple[Callable[[Any, Any], torch.Tensor], Any] | None = None
                ) -> tuple[dict[str, NodeCost], NodeCost, dict[str, Any]]:
    """Per-node costs scaled to what the segments measured in sequence: ``(costs, whole model, facts)``."""
    if device.type != "cpu":
        import copy  # a GPU gets its own copy so the user's model stays where it is

        gm = copy.deepcopy(gm).to(device)
    costs, _ = measure(gm, inputs, device=device, repeats=repeats, warmup=warmup, progress=progress, loss=loss,
                       whole=False)
    skip = next((n.name for n in gm.graph.nodes if n.op == "output"), None) if loss else None
    try:
        return _scale_to_segments(gm, inputs, device, costs, segments(gm), skip, repeats, warmup)
    except Exception as e:  # noqa: BLE001 -- e.g. a segment whose first op writes into its (leaf) input
        warnings.warn(f"timing the model's blocks in sequence failed on {device} ({type(e).__name__}: {e}); node "
                      "costs are scaled to the whole-model pass instead", stacklevel=4)
    whole = time_whole(gm, inputs, device, repeats, warmup)
    scaled, (rf, rb) = _scale_to_whole(costs, whole, skip)
    return scaled, whole, {"scaled_to_whole": {"fwd": round(rf, 4), "bwd": round(rb, 4)}}


def _scale_to_whole(costs: dict[str, NodeCost], whole: NodeCost, skip: str | None
                    ) -> tuple[dict[str, NodeCost], tuple[float, float]]:
    """Node costs scaled so that they add up to the whole-model pass (``skip``, the loss, is not in it).

    The fallback when the blocks cannot be timed in sequence (:func:`_scale_to_segments`). A ratio outside
    the expected range is applied all the same, and said.
    """
    fwd = sum(c.fwd_ms for n, c in costs.items() if n != skip)
    bwd = sum(c.bwd_ms for n, c in costs.items() if n != skip)
    rf = whole.fwd_ms / fwd if fwd > 0 and whole.fwd_ms > 0 else 1.0
    rb = whole.bwd_ms / bwd if bwd > 0 and whole.bwd_ms > 0 else 1.0
    lo, hi = _SCALE_RANGE
    if not (lo <= rf <= hi and lo <= rb <= hi):
        warnings.warn(f"the whole-model pass took {rf:.2f}x (forward) and {rb:.2f}x (backward) the sum of the "
                      f"per-node times, outside the {lo}-{hi}x seen on the development machine; node costs are "
                      "scaled by it all the same (the pass is what a step runs)", stacklevel=5)
    out = {n: c if n == skip else _scaled(c, rf, rb) for n, c in costs.items()}
    return out, (rf, rb)


def _scaled(c: NodeCost, f: float, b: float) -> NodeCost:
    return NodeCost(c.fwd_ms * f, c.bwd_ms * b, c.measured, c.fwd_spread_ms * f, c.bwd_spread_ms * b)


# Whole-pass / per-node-sum ratios seen on the development machine (1.0-1.25 there). Outside it the segments are timed again; a ratio that persists is
# believed (another CPU model runs a pass differently from its nodes alone) and said.
_SCALE_RANGE = (0.5, 2.0)
# A block whose own median is this far from its identical siblings' is timed again.
_OUTLIER = 0.25


# The blocks-in-sequence passes decide every block's cost, so they get more runs than a node does: gpt-mini's
# data-parallel step, predicted by four profiles in fresh processes on a quiet 2-core VM, spread 333-406 ms with
# 5 passes after 2 warm-up ones, and 316-333 ms (measured: 316-322 ms) with 9 after 3, for about 2 s more.
_SEGMENT_PASSES = 9
_SEGMENT_WARMUP = 3


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _scale_to_segments(gm: fx.GraphModule, inputs: Sequence[Any], device: torch.device,
                       costs: dict[str, NodeCost], segs: list[Segment], skip: str | None, repeats: int,
                       warmup: int) -> tuple[dict[str, NodeCost], NodeCost, dict[str, Any]]:
    """Scale per-node costs so that each segment's nodes add up to the segment timed in sequence.

    Segments (:func:`.static.segments`) are timed one after the other, forward then backward, as a
    pipeline runs them (:func:`.timing.time_segments`). Identical blocks (equal signatures) are timed in
    the same passes and get one cost: the median over all their samples; a block whose own median is more
    than 25% off its siblings' makes the passes run again (its samples are kept with the new ones). Their
    nodes get the median of each node's cost over the identical blocks, scaled to that cost, so that the
    solver sees identical blocks as identical. Per-node times then only split a segment's cost among its
    nodes. When the segments add up to outside 0.5-2.0x the per-node sum, they are timed again; a ratio
    that persists is believed, warned about and recorded (``scale_note``).

    Returns:
        ``(scaled costs, whole model = the segments' sum, facts for profile.devices)``.
    """
    names = [list(s.nodes) for s in segs]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, s in enumerate(segs):
        groups.setdefault(s.signature, []).append(i)
    shared = [g for g in groups.values() if len(g) > 1]
    samples = time_segments(gm, inputs, names, device=device, passes=max(repeats, _SEGMENT_PASSES),
                            warmup=max(warmup, _SEGMENT_WARMUP))
    remeasured = 0

    def outliers() -> list[int]:
        out = []
        for g in shared:
            own = [_med(samples[i][0]) + _med(samples[i][1]) for i in g]
            mid = statistics.median(own)
            out += [i for i, t in zip(g, own) if mid > 0 and abs(t - mid) > _OUTLIER * mid]
        return out

    if outliers():
        more = time_segments(gm, inputs, names, device=device, passes=repeats, warmup=1)
        samples = [(f + f2, b + b2) for (f, b), (f2, b2) in zip(samples, more)]
        remeasured += 1

    def seg_costs() -> list[tuple[float, float]]:
        out = [(_med(f), _med(b)) for f, b in samples]
        for g in shared:
            pooled = (_med([x for i in g for x in samples[i][0]]), _med([x for i in g for x in samples[i][1]]))
            for i in g:
                out[i] = pooled
        return out

    per_node = _shared_nodes(costs, segs, shared)
    node_f = sum(per_node[n].fwd_ms for s in segs for n in s.nodes)
    node_b = sum(per_node[n].bwd_ms for s in segs for n in s.nodes)
    seg = seg_costs()
    lo, hi = _SCALE_RANGE
    rf, rb = (sum(c[0] for c in seg) / node_f if node_f > 0 else 1.0), (sum(c[1] for c in seg) / node_b
                                                                         if node_b > 0 else 1.0)
    note = None
    if not (lo <= rf <= hi and lo <= rb <= hi):
        first = (rf, rb)
        samples = time_segments(gm, inputs, names, device=device, passes=repeats, warmup=1)
        remeasured += 1
        seg = seg_costs()
        rf, rb = sum(c[0] for c in seg) / node_f if node_f > 0 else 1.0, sum(c[1] for c in seg) / node_b \
            if node_b > 0 else 1.0
        if not (lo <= rf <= hi and lo <= rb <= hi):
            note = (f"at {_infer_sizes(tuple(inputs))[0]} rows, the model's blocks timed in sequence took {rf:.2f}x "
                    f"(forward) and {rb:.2f}x (backward) the sum "
                    f"of their nodes timed alone ({first[0]:.2f}x and {first[1]:.2f}x the first time), outside the "
                    f"{lo}-{hi}x seen on the development machine; believed: node costs are scaled to the blocks")
            warnings.warn(note, stacklevel=5)
    out = dict(costs)
    for s, (f, b) in zip(segs, seg):
        sf = sum(per_node[n].fwd_ms for n in s.nodes)
        sb = sum(per_node[n].bwd_ms for n in s.nodes)
        for n in s.nodes:
            out[n] = _scaled(per_node[n], f / sf if sf > 0 else 1.0, b / sb if sb > 0 else 1.0)
    spread = [(_iqr(fs), _iqr(bs)) for fs, bs in samples]
    whole = NodeCost(sum(c[0] for c in seg), sum(c[1] for c in seg), True, sum(x for x, _ in spread),
                     sum(y for _, y in spread))
    info: dict[str, Any] = {"scaled_to_whole": {"fwd": round(rf, 4), "bwd": round(rb, 4)}, "segments": len(segs),
                            "identical_blocks": sum(len(g) for g in shared), "remeasured": remeasured}
    if note:
        info["scale_note"] = note
    return out, whole, info


def _iqr(xs: Sequence[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs) if xs else 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def _shared_nodes(costs: dict[str, NodeCost], segs: list[Segment], shared: list[list[int]]) -> dict[str, NodeCost]:
    """Per-node costs where the nodes of identical blocks get the median of their counterparts' costs."""
    out = dict(costs)
    for g in shared:
        for k in range(len(segs[g[0]].nodes)):
            peers = [costs[segs[i].nodes[k]] for i in g]
            mid = NodeCost(_med([c.fwd_ms for c in peers]), _med([c.bwd_ms for c in peers]), True,
                           _med([c.fwd_spread_ms for c in peers]), _med([c.bwd_spread_ms for c in peers]))
            for i in g:
                out[segs[i].nodes[k]] = mid
    return out


def _split_fixed(big: NodeCost, small: NodeCost, batch: int, rows: int) -> NodeCost:
    """``big`` (at ``batch`` rows) with the fixed part of ``a + b * rows`` fitted through it and ``small``.

    A slope below zero (the small batch timed slower, noise) means no per-row part: all of it is fixed.
    """
    def fixed(t_big: float, t_small: float) -> float:
        per_row = max(0.0, (t_big - t_small) / (batch - rows))
        return min(t_big, max(0.0, t_big - per_row * batch))

    return NodeCost(big.fwd_ms, big.bwd_ms, big.measured, big.fwd_spread_ms, big.bwd_spread_ms,
                    fixed(big.fwd_ms, small.fwd_ms), fixed(big.bwd_ms, small.bwd_ms))


def _profile_kind(gm: fx.GraphModule, inputs: tuple[Any, ...], device: torch.device, batch: int,
                  micro: int | None, loss: tuple[Callable[[Any, Any], torch.Tensor], Any] | None, repeats: int,
                  warmup: int, progress: bool, corun: bool = False
                  ) -> tuple[dict[str, NodeCost], NodeCost, dict[str, Any], bool]:
    """Costs on one present device: at the batch, scaled to its blocks timed in sequence, with fixed parts from
    ``micro`` rows.

    Returns ``(costs, whole-model cost, facts for profile.devices, whether micro rows were measured)``.
    """
    info: dict[str, Any] = {}
    if device.type == "cpu":
        keep_freed_memory()  # what the runtime's CPU ranks run with (hpml_compile.hostmem)
        info.update(host_facts())
        info.update({k: round(v, 3) for k, v in time_streams().items()})
    costs, whole, facts = _measure_on(gm, inputs, device, repeats, warmup, progress, loss)
    info.update(facts)
    if not micro or micro >= batch:
        if corun:
            info["corun"] = _corun(gm, inputs, device)
        info["split"] = split_facts(gm, inputs, device, batch)
        return costs, whole, info, False
    small_inputs = tuple(slice_rows(x, batch, micro) for x in inputs)
    small_loss = (loss[0], slice_rows(loss[1], batch, micro)) if loss else None
    try:
        small, small_whole, small_facts = _measure_on(gm, small_inputs, device, repeats, warmup, progress,
                                                      small_loss)
    except Exception as e:  # e.g. a graph whose shapes were specialised to the batch by torch.export
        warnings.warn(f"profiling at {micro} rows failed ({type(e).__name__}: {e}); node costs on {device} are "
                      "taken as proportional to the rows", stacklevel=4)
        return costs, whole, info, False
    if corun:
        info["corun"] = _corun(gm, small_inputs, device)
    info["split"] = split_facts(gm, small_inputs, device, micro)
    info["scaled_to_whole_micro"] = small_facts["scaled_to_whole"]
    info["remeasured"] = info.get("remeasured", 0) + small_facts.get("remeasured", 0)
    if "scale_note" in small_facts:
        info["scale_note_micro"] = small_facts["scale_note"]
    fitted = {n: _split_fixed(c, small[n], batch, micro) if n in small else c for n, c in costs.items()}
    whole = _split_fixed(whole, small_whole, batch, micro)
    return fitted, whole, info, True


def _make_optimizer(optimizer: str | Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None
                    ) -> tuple[str | None, Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None]:
    if optimizer is None:
        return None, None
    if callable(optimizer):
        return getattr(optimizer, "__name__", "custom"), optimizer
    makers = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3), "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)}
    if optimizer.lower() not in makers:
        raise HpmlError(f"unknown optimizer {optimizer!r}: use one of {', '.join(makers)} or a callable "
                        "(parameters -> torch.optim.Optimizer)")
    return optimizer.lower(), makers[optimizer.lower()]


def profile(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor,
    *,
    name: str | None = None,
    device_kinds: Sequence[str] = ("cpu",),
    batch_size: int | None = None,
    seq_len: int | None = None,
    repeats: int = 5,
    warmup: int = 2,
    leaf_modules: Sequence[type | str] = (),
    front_end: FrontEnd | str = FrontEnd.AUTO,
    progress: bool = True,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None,
    micro_batch: int | None = None,
    optimizer: str | Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = "adamw",
    threads: int | None = None,
    precision: Precision | str = Precision.FP32,
    corun: bool = False,
    gpu_op_us: float | None = None,
    compiled: bool = False,
    say: Callable[[str], None] | None = None,
) -> Profile:
    """Trace (unless given a traced GraphModule) and profile ``model``.

    Args:
        model: an nn.Module, possibly on the meta device (then nothing is
            measured and every cost is predicted), or the output of
            :func:`hpml_compile.trace`.
        example_inputs: positional inputs of one training batch.
        name: model name written to the profile (default: the class name).
        device_kinds: kinds to give costs for; kinds present here (``cpu``, a
            local GPU's kind) are measured, the others predicted.
        batch_size, seq_len: recorded in the file (default: read off the inputs).
        repeats, warmup: timed and untimed calls per node.
        leaf_modules, front_end: passed to :func:`hpml_compile.trace`.
        progress: progress bar while measuring.
        loss_fn, targets: the training loss ``loss_fn(output, targets)``; when
            given, it is timed and becomes the output node's cost.
        micro_batch: a second, smaller batch (rows) every node is also timed
            at, to split each cost into a fixed part and a per-row part (a
            microbatch of a few rows costs more than its share of the batch);
            None picks ``batch // 8``, 0 measures the batch only.
        optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd"``, a callable
            ``parameters -> torch.optim.Optimizer``, or None: one step of it
            over the parameters is timed (kinds not present: predicted from
            the measured kind's bytes per memory bandwidth).
        threads: torch threads to measure the CPU with (restored after);
            None: this process's current count. Use the count each rank
            will run with (:func:`hpml_compile.driver.local_threads`).
        precision: ``fp32``, or ``bf16``/``fp16``: every node (and the loss and
            the whole-model pass) is timed under ``torch.autocast`` to that
            dtype on its device, activation sizes are what autograd saves under
            autocast, and predicted kinds use their datasheet peak for that
            dtype (:mod:`hpml_compile.precision`). Recorded in the profile.
        corun: on a CPU of several cores, also time the blocks while forked
            processes run them on the other cores (``devices.cpu.corun``,
            :func:`.corun.time_corun`), and the optimizer step while they step
            theirs (``devices.cpu.optimizer_corun``,
            :func:`.optcorun.time_optimizer_corun`), which the simulator then
            prices CPU ranks computing (stepping) at once by. Off by default: on the 2-core
            development VM that slow-down swung from 1.0x to 1.7x between
            minutes, so two profiles of one model disagreed more with it, and
            the prediction benchmark moved by at most a point.
        gpu_op_us: the host's work per op, in microseconds, of the GPU kinds
            predicted rather than measured (None: the catalog's eager cost,
            ``cost_models.EAGER_GPU_OP_MS``); e.g. 5 for stages that run
            compiled, an assumption the plan then lists
            (:func:`predict_kinds`' ``op_ms``).
        compiled: also time the model's blocks compiled by ``torch.compile`` on the kinds measured here
            (:mod:`.compiled`: once per kind of block; a block that does not compile keeps its eager times,
            said in one line), recorded as each node's ``compiled`` cost, which the cost graph prices stages
            that run compiled with (:func:`hpml_compile.costgraph.build`).
        say: progress lines of the compiled timing, and its fallbacks (None: fallbacks as warnings).

    Measuring on the CPU also measures the host's memory bandwidth (one
    thread, all threads) and leaves this process keeping freed memory, as
    the runtime's CPU ranks do (:mod:`hpml_compile.hostmem`). The CPU is
    measured with this process's torch threads (``torch.set_num_threads``),
    recorded as the profile's ``threads``: a plan for CPU ranks that run
    with another count refuses the profile (:func:`hpml_compile.driver.plan`).

    Returns:
        The Profile, nodes in topological order.

    Raises:
        UnknownDeviceError: a kind is neither present nor in the catalog.
        TraceError: the model cannot be traced.
        HpmlError: ``threads`` below 1.
        OptionError: ``precision`` is not one of fp32, bf16, fp16; ``gpu_op_us`` is negative.
    """
    prec = Precision.parse(precision)
    if gpu_op_us is not None:  # the kinds present measured; the others predicted at that per-op cost
        if not (gpu_op_us >= 0 and math.isfinite(gpu_op_us)):
            raise OptionError(f"profile: gpu_op_us {gpu_op_us}: expected microseconds per op, 0 or more")
        here = [k for k in device_kinds if k in local_kinds()]
        measured = profile(model, example_inputs, name=name, device_kinds=here, batch_size=batch_size,
                           seq_len=seq_len, repeats=repeats, warmup=warmup, leaf_modules=leaf_modules,
                           front_end=front_end, progress=progress, loss_fn=loss_fn, targets=targets,
                           micro_batch=micro_batch, optimizer=optimizer, threads=threads, precision=prec, corun=corun,
                           compiled=compiled, say=say)
        return predict_kinds(measured, list(dict.fromkeys(device_kinds)), op_ms=gpu_op_us / 1e3)
    if threads is None:
        return _profile(model, example_inputs, name, device_kinds, batch_size, seq_len, repeats, warmup, leaf_modules,
                        front_end, progress, loss_fn, targets, micro_batch, optimizer, prec, corun, compiled, say)
    if threads < 1:
        raise HpmlError(f"profile: threads {threads}: expected a number of torch threads, 1 or more; pass the "
                        "count each rank will run with, or None for this process's")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _profile(model, example_inputs, name, device_kinds, batch_size, seq_len, repeats, warmup, leaf_modules,
                        front_end, progress, loss_fn, targets, micro_batch, optimizer, prec, corun, compiled, say)
    finally:
        torch.set_num_threads(before)


# At most this many processes time the blocks together (:func:`_corun`), and their copies of the parameters may
# take at most this share of the host's available memory.
_CORUN_RANKS = 4
_CORUN_MEMORY_SHARE = 0.25


def _corun(gm: fx.GraphModule, inputs: Sequence[Any], device: torch.device) -> dict[str, Any]:
    """The CPU blocks' slow-down while the host's other cores run them too (:func:`.corun.time_corun`), at the
    microbatch's rows when measured there (what a rank runs, and 1/8 of the cost), for the simulator's CPU ranks
    that compute at the same time (:mod:`hpml_compile.simulate`); ``{"skipped": why}`` where not measured."""
    if device.type != "cpu":
        return {"skipped": "not a CPU"}
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    neighbours = min(cpus, _CORUN_RANKS) - 1
    if neighbours < 1:
        return {"skipped": "one CPU"}
    try:
        import psutil

        need = sum(p.numel() * p.element_size() for p in gm.parameters()) * neighbours
        if need > _CORUN_MEMORY_SHARE * psutil.virtual_memory().available:
            return {"skipped": f"{neighbours} copies of the parameters ({need / 2**30:.1f} GiB) would take more "
                               f"than {_CORUN_MEMORY_SHARE:.0%} of the available memory"}
        return time_corun(gm, inputs, [list(sg.nodes) for sg in segments(gm)], neighbours=neighbours)
    except Exception as e:  # noqa: BLE001 -- a graph the segments cannot run: the plan stays without it
        return {"skipped": f"{type(e).__name__}: {e}"}



def _optimizer_corun(params: list[torch.Tensor], make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                     ) -> dict[str, Any]:
    """The optimizer step's slow-down while the host's other cores step theirs too
    (:func:`.optcorun.time_optimizer_corun`), as many processes as :func:`_corun` uses; ``{"skipped": why}``
    where not measured."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    neighbours = min(cpus, _CORUN_RANKS) - 1
    if neighbours < 1:
        return {"skipped": "one CPU"}
    try:
        return time_optimizer_corun(params, make, neighbours=neighbours)
    except Exception as e:  # noqa: BLE001 -- an optimizer the copies cannot build: the plan stays without it
        return {"skipped": f"{type(e).__name__}: {e}"}


def _profile(model: torch.nn.Module, example_inputs: Sequence[Any] | torch.Tensor, name: str | None,
             device_kinds: Sequence[str], batch_size: int | None, seq_len: int | None, repeats: int, warmup: int,
             leaf_modules: Sequence[type | str], front_end: FrontEnd | str, progress: bool,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None, targets: Any, micro_batch: int | None,
             optimizer: str | Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None,
             precision: Precision = Precision.FP32, corun: bool = False, compiled: bool = False,
             say: Callable[[str], None] | None = None) -> Profile:
    """:func:`profile` at this process's thread count."""
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    kinds = list(dict.fromkeys(device_kinds))
    present = local_kinds()
    check_known_kinds(kinds, known=list(present), where="this machine's devices")
    gm = model if isinstance(model, fx.GraphModule) and "hpml_front_end" in model.meta else \
        trace(model, inputs, leaf_modules=leaf_modules, front_end=front_end)
    facts = analyze(gm, precision)
    meta = _is_meta(gm, inputs)
    b, s = _infer_sizes(inputs)
    micro = max(1, b // 8) if micro_batch is None else micro_batch
    micro = micro if 0 < micro < b else None
    loss = (loss_fn, targets) if loss_fn is not None else None
    opt_name, make_opt = _make_optimizer(optimizer)
    measured: dict[str, dict[str, NodeCost]] = {}
    compiled_costs_of: dict[str, dict[str, NodeCost]] = {}
    totals: dict[str, NodeCost] = {}
    devices: dict[str, dict[str, Any]] = {}
    optimizer_ms: dict[str, float] = {}
    micro_measured = False
    if not meta:
        for kind in kinds:
            if kind in present:
                with autocast(present[kind].type, precision, cache=False):  # each call pays its casts
                    measured[kind], totals[kind], info, got = _profile_kind(gm, inputs, present[kind], b, micro,
                                                                            loss, repeats, warmup, progress, corun)
                    if compiled:  # the blocks as a stage that runs compiled runs them
                        compiled_costs_of[kind], info["compiled"] = compiled_costs(
                            gm, inputs, present[kind], measured[kind], batch=b, micro=micro if got else None,
                            say=say or _warn_fallbacks)
                micro_measured = micro_measured or got
                devices[kind] = {"measured": True, "device": str(present[kind]), **info}
                if make_opt is not None:
                    optimizer_ms[kind] = time_optimizer(_unique_params(gm), present[kind], make_opt, repeats, warmup)
                    # a ZeRO shard is one flat tensor: its step without the per-tensor work (costgraph)
                    devices[kind]["optimizer_flat_ms"] = round(time_optimizer(
                        _unique_params(gm), present[kind], make_opt, repeats, warmup, flat=True), 4)
                    if corun and present[kind].type == "cpu":  # beside the host's other ranks' steps
                        devices[kind]["optimizer_corun"] = _optimizer_corun(_unique_params(gm), make_opt)
    nodes = _nodes(gm, facts, measured, precision, compiled_costs_of)
    prof = Profile(
        model=name or type(model).__name__, batch_size=batch_size or b, seq_len=seq_len if seq_len else s,
        dtype=_dtype(gm), nodes=nodes, front_end=gm.meta["hpml_front_end"],
        backward_timing=BackwardTiming.PER_NODE if measured else BackwardTiming.PREDICTED,
        repeats=repeats if measured else 0, warmup=warmup if measured else 0, devices=devices, totals=totals,
        micro_batch=micro if micro_measured else None,
        loss=(getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__) if loss and measured else None,
        optimizer=opt_name, optimizer_ms=optimizer_ms, parameters=_param_sizes(gm, nodes),
        threads=torch.get_num_threads() if "cpu" in measured else None,  # CPU times hold at this count only
        precision=precision,
    )
    return predict_kinds(prof, kinds)


def _warn_fallbacks(line: str) -> None:
    """Without a ``say``, the compiled timing's fallback lines as warnings (its progress lines dropped)."""
    if "priced eager" in line or "failed" in line:
        warnings.warn(line.strip(), stacklevel=2)


def _unique_params(gm: fx.GraphModule) -> list[torch.Tensor]:
    return [p for p in gm.parameters() if p.requires_grad]


def _param_sizes(gm: fx.GraphModule, nodes: Sequence[ProfileNode]) -> dict[str, int]:
    """Bytes of every parameter name the nodes use (a tied parameter under each of its names)."""
    used = {p for n in nodes for p in n.params}
    sizes = {name: p.numel() * p.element_size() for name, p in gm.named_parameters(remove_duplicate=False)}
    return {name: sizes[name] for name in sorted(used) if name in sizes}


def _wire_bytes(info: Any, precision: Precision) -> int:
    """Bytes of a node's output as a stage boundary sends it: a floating tensor in the compute dtype."""
    if precision.is_mixed and info.tensor_output and info.dtype in ("float32", "float64"):
        return info.output_bytes * precision.bytes // (8 if info.dtype == "float64" else 4)
    return info.output_bytes


def _nodes(gm: fx.GraphModule, facts: dict[str, NodeFacts], measured: dict[str, dict[str, NodeCost]],
           precision: Precision = Precision.FP32, compiled: dict[str, dict[str, NodeCost]] | None = None
           ) -> tuple[ProfileNode, ...]:
    out = []
    for node in gm.graph.nodes:
        info, f = node_info(node), facts[node.name]
        out.append(ProfileNode(
            name=node.name, op=NodeOp(node.op), target=_target_str(node),
            inputs=tuple(n.name for n in node.all_input_nodes), scope=info.scope, op_kind=f.op_kind,
            flops=f.flops, bwd_flops=f.bwd_flops, param_bytes=f.param_bytes, params=f.params,
            output_bytes=_wire_bytes(info, precision), activation_bytes=f.activation_bytes, mem_bytes=f.mem_bytes,
            output_shape=info.shape, output_dtype=info.dtype, tensor_output=info.tensor_output,
            cost={k: costs[node.name] for k, costs in measured.items()},
            compiled={k: costs[node.name] for k, costs in (compiled or {}).items() if node.name in costs},
        ))
    return tuple(out)


def _target_str(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    module = getattr(t, "__module__", None)
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None)
    return f"{module}.{name}" if module and name else str(t)


def _compute_dtype(p: Profile) -> str:
    """The dtype whose datasheet peak prices a node: the autocast dtype under mixed precision, else the model's."""
    return p.precision.dtype if p.precision.is_mixed else p.dtype


def _calibrations(p: Profile) -> dict[str, tuple[Calibration, Calibration]]:
    """(forward, backward) calibrations fitted on each measured kind of a profile."""
    out = {}
    for kind, info in p.devices.items():
        if not info.get("measured") or kind not in cost_models.known_kinds():
            continue  # a measured GPU the catalog lacks has no datasheet roofline to calibrate against
        spec = cost_models.get_device(kind)
        live = [n for n in p.nodes if n.op not in (NodeOp.PLACEHOLDER, NodeOp.OUTPUT, NodeOp.GET_ATTR)
                and kind in n.cost]
        fwd = [OpSample(n.op_kind, n.flops, n.mem_bytes, n.cost[kind].fwd_ms) for n in live if n.cost[kind].fwd_ms > 0]
        bwd = [OpSample(n.op_kind, n.bwd_flops, _BWD_MEM_FACTOR * n.mem_bytes, n.cost[kind].bwd_ms)
               for n in live if n.cost[kind].bwd_ms > 0]
        if fwd and bwd:
            out[kind] = (fit(fwd, spec, _compute_dtype(p)), fit(bwd, spec, _compute_dtype(p)))
    return out


def predict_kinds(p: Profile, kinds: Sequence[str], *, op_ms: float | None = None) -> Profile:
    """Add predicted costs for the ``kinds`` the profile lacks.

    Predictions use the roofline of each kind's datasheet with multipliers
    fitted on a measured kind of the same profile (the CPU first), so they
    need only the profile, not the model. A profile with nothing measured
    uses the bare roofline with the catalog's efficiency priors.

    ``op_ms``: the host's work per op on a GPU kind (None: the catalog's eager
    cost, ``cost_models.EAGER_GPU_OP_MS``); a smaller one prices stages that
    run compiled (fewer, fused launches), an assumption the caller states.

    Raises:
        UnknownDeviceError: a kind is in neither the profile nor the catalog.
    """
    missing = [k for k in dict.fromkeys(kinds) if k not in p.device_kinds]
    if not missing:
        return p
    check_known_kinds(missing, known=p.device_kinds)
    calibs = _calibrations(p)
    source = "cpu" if "cpu" in calibs else next(iter(calibs), None)
    fwd_cal, bwd_cal = calibs[source] if source else (None, None)
    devices = dict(p.devices)
    new_nodes = []
    specs = {k: cost_models.get_device(k) for k in missing}
    if op_ms is not None:
        specs = {k: replace(sp, launch_overhead_ms=op_ms) if sp.category is cost_models.DeviceCategory.GPU else sp
                 for k, sp in specs.items()}
    for n in p.nodes:
        cost = dict(n.cost)
        for k in missing:
            if n.op in (NodeOp.PLACEHOLDER, NodeOp.OUTPUT, NodeOp.GET_ATTR):
                cost[k] = NodeCost(0.0, 0.0, False)
                continue
            # a GPU node's backward issues about two kernels (the gradients of the input and of the weight)
            ops = cost_models.BACKWARD_OPS_PER_NODE if specs[k].category is cost_models.DeviceCategory.GPU else 1.0
            fwd = predict_ms(n.op_kind, n.flops, n.mem_bytes, specs[k], _compute_dtype(p), fwd_cal)
            bwd = predict_ms(n.op_kind, n.bwd_flops, _BWD_MEM_FACTOR * n.mem_bytes, specs[k], _compute_dtype(p),
                             bwd_cal, ops) \
                if n.bwd_flops or n.activation_bytes or n.param_bytes else 0.0
            # the per-op overhead does not shrink with the rows: a microbatch pays all of it (the fixed part)
            f_over = fwd_cal.overhead_for(specs[k]) if fwd_cal else specs[k].launch_overhead_ms
            b_over = ops * (bwd_cal.overhead_for(specs[k]) if bwd_cal else specs[k].launch_overhead_ms)
            cost[k] = NodeCost(fwd, bwd, False, fwd_fixed_ms=min(fwd, f_over), bwd_fixed_ms=min(bwd, b_over))
        new_nodes.append(ProfileNode(**{**{f: getattr(n, f) for f in ProfileNode.__slots__}, "cost": cost}))
    optimizer_ms = {**p.optimizer_ms, **_predict_optimizer(p, missing)}
    for k in missing:
        devices[k] = {"measured": False, "predicted_from": f"{source} calibration + datasheet" if source
                      else "datasheet roofline with prior efficiencies",
                      **({"op_ms": op_ms} if op_ms is not None and specs[k].category is cost_models.DeviceCategory.GPU
                         else {})}
    if source:
        devices[source] = {**devices[source], "calibration_fwd": fwd_cal.to_dict(),  # type: ignore[union-attr]
                           "calibration_bwd": bwd_cal.to_dict()}  # type: ignore[union-attr]
    return Profile(**{**{f: getattr(p, f) for f in Profile.__slots__}, "nodes": tuple(new_nodes),
                      "devices": devices, "optimizer_ms": optimizer_ms})


# Memory passes over the parameter bytes of one optimizer step when no kind was measured: a rough count of
# what AdamW reads and writes (parameters, gradients, two moments, over several kernels), not a measurement.
# A measured kind replaces it with its own passes (time x bandwidth / bytes).
OPTIMIZER_PASSES_PRIOR = {"adamw": 12.0, "adam": 12.0, "sgd": 5.0}


def _predict_optimizer(p: Profile, kinds: Sequence[str]) -> dict[str, float]:
    """Optimizer-step ms on ``kinds``: the memory passes over the parameter bytes that a measured kind took
    (its time x its bandwidth / bytes), else a prior, at each kind's memory bandwidth."""
    total = sum(p.parameters.values())
    if not p.optimizer or not total:
        return {}
    passes = OPTIMIZER_PASSES_PRIOR.get(p.optimizer, 12.0)
    for kind, ms in p.optimizer_ms.items():
        if kind in cost_models.known_kinds() and p.devices.get(kind, {}).get("measured") and ms > 0:
            passes = ms / 1e3 * cost_models.get_device(kind).mem_bw / total
            break
    return {k: passes * total / cost_models.get_device(k).mem_bw * 1e3 for k in kinds}


def save_profile(p: Profile, path: str | os.PathLike[str]) -> Path:
    """Write profile.json atomically (a crash mid-write leaves any previous file whole)."""
    return write_json_atomic(p.to_dict(), path)


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and schema-check a profile.json (raises SchemaError naming the bad field)."""
    try:
        return Profile.from_dict(read_json(path), source=str(path))
    except HpmlError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise HpmlError(f"{path}: not a valid profile: {e}") from e
