"""Measured per-node forward and backward times on a present device (CPU, CUDA).

Method: the graph is run once with real inputs to capture every node's real
input values. Then each node is timed *alone*, on those values:

* forward: the node's call, grad enabled (training builds the autograd graph
  too), ``warmup`` untimed calls then ``repeats`` timed ones;
* backward: the node's inputs become leaves that require grad, the node runs
  once, and ``torch.autograd.grad`` from its outputs to its inputs and
  parameters is timed ``repeats`` times (``retain_graph=True``).

Each cost is the median of the repeats, with the inter-quartile range as its
spread (CPU timings of small ops vary by tens of per cent). CPU
times use ``time.perf_counter``; CUDA times use CUDA events around each call
so that asynchronous kernels are counted where they run.

Profiling must not change the user's model: BatchNorm running statistics and
other buffers are restored afterwards.

Example:
    >>> import torch
    >>> from hpml_compile.trace import trace
    >>> gm = trace(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()), (torch.randn(16, 64),))
    >>> costs, total = measure(gm, (torch.randn(16, 64),), repeats=3, warmup=1, progress=False)
    >>> costs["_0"].measured and costs["_0"].fwd_ms > 0 and total.bwd_ms > 0
    True
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate, map_arg
from torch.utils._pytree import tree_leaves

from ..ir import NodeCost
from ..trace import buffers_restored
from .static import is_inplace

__all__ = ["measure", "Timer", "time_loss", "time_optimizer", "slice_rows", "time_streams", "time_segments",
           "time_whole", "host_facts"]


class Timer:
    """Times a callable on one device: perf_counter on CPU, CUDA events on a GPU.

    Every timed call of the profiler (a node, a segment, the loss, the optimizer) goes through
    :meth:`once`, inside ``context()``: the one place to wrap what is timed (e.g. in autocast).
    """

    def __init__(self, device: torch.device,
                 context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                 cpu_time: bool = False) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.context = context
        # on a CPU: this process's CPU time instead of the wall clock (time another process held the core is
        # left out, time stalled on the cache or memory is not)
        self.clock = time.process_time if cpu_time and not self.cuda else time.perf_counter

    def once(self, fn: Callable[[], Any]) -> float:
        """Milliseconds of one call of ``fn``."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with self.context():
                fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        t0 = self.clock()
        with self.context():
            fn()
        return (self.clock() - t0) * 1e3

    def stats(self, fn: Callable[[], Any], repeats: int, warmup: int,
              before: Callable[[], Any] | None = None) -> tuple[float, float]:
        """(median ms, inter-quartile range ms) of ``repeats`` calls after ``warmup`` calls.

        ``before`` runs untimed ahead of each call (e.g. to clone inputs of an in-place op).
        """
        samples = []
        for i in range(warmup + repeats):
            if before is not None:
                before()
            ms = self.once(fn)
            if i >= warmup:
                samples.append(ms)
        return _median_iqr(samples)


def _median_iqr(samples: Sequence[float]) -> tuple[float, float]:
    if len(samples) < 4:
        return statistics.median(samples), (max(samples) - min(samples)) if samples else 0.0
    q = statistics.quantiles(samples, n=4)
    return statistics.median(samples), q[2] - q[0]


class _Capture(fx.Interpreter):
    """Runs the graph and keeps every node's output (no grad: values only)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)


def _to_device(x: Any, device: torch.device) -> Any:
    return map_aggregate(x, lambda v: v.to(device) if isinstance(v, torch.Tensor) else v)


def _leafify(x: Any, keep: frozenset[int] = frozenset()) -> Any:
    """Float tensors as leaves that require grad (as activations do in training), except those in ``keep``
    (ids of the graph's buffers: an exported graph passes BatchNorm's running statistics as arguments, and
    they never take a gradient)."""
    return map_aggregate(x, lambda v: v.detach().requires_grad_(True)
                         if isinstance(v, torch.Tensor) and v.is_floating_point() and id(v) not in keep else v)


def _callable(gm: fx.GraphModule, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any]:
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        return lambda: sub(*args, **kwargs)
    if node.op == "call_method":
        self_obj, *rest = args
        return lambda: getattr(self_obj, str(node.target))(*rest, **kwargs)
    return lambda: node.target(*args, **kwargs)  # type: ignore[operator]


def _grad_fn(out: Any, wrt: list[torch.Tensor]) -> Callable[[], Any] | None:
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = [t for t in wrt if t.requires_grad]
    if not outs or not wrt:
        return None
    grads = [torch.ones_like(t) for t in outs]
    return lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True, allow_unused=True)


def _time_node(gm: fx.GraphModule, node: fx.Node, env: dict[fx.Node, Any], timer: Timer,
               repeats: int, warmup: int) -> NodeCost:
    module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
    inplace = is_inplace(node, module)
    args, kwargs = map_arg((node.args, node.kwargs), lambda n: env[n])
    leaf_args, leaf_kwargs = _leafify((args, kwargs), frozenset(id(b) for b in gm.buffers()))
    live: list[tuple[Any, dict[str, Any]]] = [(leaf_args, leaf_kwargs)]

    # An in-place op timed again and again would apply itself again and again (an integer bucket index grown
    # past its table): every run, the one whose output later nodes read included, gets copies of the values
    # as they were, so the output is the op applied once.
    pristine = map_aggregate((leaf_args, leaf_kwargs),
                             lambda v: v.clone() if isinstance(v, torch.Tensor) else v) if inplace else None

    def fresh() -> None:
        live[0] = map_aggregate(pristine, lambda v: v.clone() if isinstance(v, torch.Tensor) else v)

    def fwd() -> Any:
        a, k = live[0]
        return _callable(gm, node, tuple(a), dict(k))()

    with torch.enable_grad():
        fwd_ms, fwd_spread = timer.stats(fwd, repeats, warmup, before=fresh if inplace else None)
        if inplace:
            fresh()
        out = fwd()
        params = [p for p in (module.parameters() if module is not None else ()) if p.requires_grad]
        leaves = [t for t in tree_leaves((leaf_args, leaf_kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        grad = _grad_fn(out, leaves + params)
        bwd_ms, bwd_spread = timer.stats(grad, repeats, warmup) if grad is not None else (0.0, 0.0)
    return NodeCost(fwd_ms=fwd_ms, bwd_ms=bwd_ms, measured=True, fwd_spread_ms=fwd_spread, bwd_spread_ms=bwd_spread)


def _time_whole(gm: fx.GraphModule, inputs: tuple[Any, ...], timer: Timer, repeats: int, warmup: int) -> NodeCost:
    """Whole-model forward and backward, the backward accumulating into the parameters' ``.grad`` as training
    does (the user's gradients are put back afterwards)."""
    params = [p for p in gm.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        with torch.enable_grad():
            fwd_ms, fwd_spread = timer.stats(lambda: gm(*inputs), repeats, warmup)
            leaves = _leafify(inputs)
            out = gm(*leaves)
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            wrt = params + [t for t in tree_leaves(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs and wrt:
                grads = [torch.ones_like(t) for t in outs]
                bwd_ms, bwd_spread = timer.stats(
                    lambda: torch.autograd.backward(outs, grads, retain_graph=True, inputs=wrt), repeats, warmup)
            else:
                bwd_ms, bwd_spread = 0.0, 0.0
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    return NodeCost(fwd_ms=fwd_ms, bwd_ms=bwd_ms, measured=True, fwd_spread_ms=fwd_spread, bwd_spread_ms=bwd_spread)


def time_whole(gm: fx.GraphModule, example_inputs: Sequence[Any], device: torch.device | str = "cpu",
               repeats: int = 5, warmup: int = 2) -> NodeCost:
    """Whole-model forward and backward ms (the backward accumulating into ``.grad``; the user's put back)."""
    dev = torch.device(device)
    with buffers_restored(gm):
        return _time_whole(gm, tuple(_to_device(x, dev) for x in example_inputs), Timer(dev), repeats, warmup)


def time_loss(output: Any, loss_fn: Callable[[Any, Any], torch.Tensor], targets: Any, device: torch.device | str,
              repeats: int = 5, warmup: int = 2) -> NodeCost:
    """Forward and backward ms of ``loss_fn(output, targets)`` on a model output (its values, detached).

    Args:
        output: what the model returned for one batch (tensors on ``device``).
        loss_fn: ``(output, targets) -> scalar``.
        targets: the batch's targets (moved to ``device`` here).
        device: where to measure.
        repeats, warmup: timed and untimed calls.
    """
    dev = torch.device(device)
    timer = Timer(dev)
    tgt = _to_device(targets, dev)
    leaves = _leafify(map_aggregate(output, lambda v: v.detach() if isinstance(v, torch.Tensor) else v))
    wrt = [t for t in tree_leaves(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    with torch.enable_grad():
        fwd_ms, fwd_spread = timer.stats(lambda: loss_fn(leaves, tgt), repeats, warmup)
        loss = loss_fn(leaves, tgt)
        if wrt and loss.requires_grad:
            bwd_ms, bwd_spread = timer.stats(
                lambda: torch.autograd.grad(loss, wrt, retain_graph=True, allow_unused=True), repeats, warmup)
        else:
            bwd_ms, bwd_spread = 0.0, 0.0
    return NodeCost(fwd_ms=fwd_ms, bwd_ms=bwd_ms, measured=True, fwd_spread_ms=fwd_spread, bwd_spread_ms=bwd_spread)


# Optimizer steps are timed on copies of at most this many parameter bytes, then scaled by bytes.
_OPTIMIZER_BYTES_CAP = 256 * 2**20


def time_optimizer(params: Sequence[torch.Tensor], device: torch.device | str,
                   make: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
                   repeats: int = 5, warmup: int = 2, *, flat: bool = False) -> float:
    """Milliseconds of one optimizer step over ``params`` (default: ``torch.optim.AdamW``), on ``device``.

    The step runs on copies with random gradients (the model is left alone); beyond 256 MiB of parameters
    it runs on the first 256 MiB and is scaled by bytes (an optimizer step streams its state: linear in bytes).
    On a CPU each step is timed after the caches are flushed (:func:`_cold_ms`), as it runs in a training step.
    With ``flat``, on one tensor of the same bytes instead, as a ZeRO shard is stepped (``runtime.sync.zero``):
    without the per-tensor work, which is most of a small model's step (gpt-tiny's 36 tensors: 1.05 ms one by
    one, 0.19 ms flat).
    """
    dev = torch.device(device)
    make = make or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    total = sum(p.numel() * p.element_size() for p in params)
    if flat and params:
        size = params[0].element_size()
        sources = [torch.randn(min(total, _OPTIMIZER_BYTES_CAP) // size, dtype=params[0].dtype)]
    else:
        sources = list(params)
    copies, nbytes = [], 0
    for p in sources:
        if copies and nbytes + p.numel() * p.element_size() > _OPTIMIZER_BYTES_CAP:
            break
        c = torch.nn.Parameter(p.detach().to(dev, copy=True))
        c.grad = torch.randn_like(c)
        copies.append(c)
        nbytes += c.numel() * c.element_size()
    if not copies or nbytes == 0:
        return 0.0
    opt = make(copies)
    if dev.type == "cpu":
        return _cold_ms(opt.step, repeats, warmup) * total / nbytes
    ms, _ = Timer(dev).stats(opt.step, repeats, warmup)
    return ms * total / nbytes


def _cold_ms(fn: Callable[[], Any], repeats: int, warmup: int) -> float:
    """Median milliseconds of ``fn`` on the CPU, each call after the caches were flushed by a write of twice
    their size, as a rank's optimizer step runs after the step's forward and backward: an AdamW step of
    gpt-mini's 0.9 MiB ZeRO shard took 0.22 ms in a loop and 0.5-0.65 ms so (and in the step), a 4 KiB one
    0.03 ms against 0.24 ms (its code and the optimizer's Python objects out of cache too)."""
    caches = _cache_bytes()
    flush = torch.empty(max(2 * max(caches.values(), default=0), 8 << 20) // 4)
    times = []
    for i in range(max(0, warmup) + max(1, repeats)):
        flush.fill_(float(i))
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_streams(threads: int | None = None, nbytes: int = 64 * 2**20, repeats: int = 5,
                 rounds: int = 3) -> dict[str, float]:
    """Host memory bandwidth: one thread streaming alone, and ``threads`` threads streaming at once.

    Each thread copies its own ``nbytes`` tensor (read + write counted, twice the last-level cache of a
    typical CPU) ``repeats`` times at one torch thread; the median copy gives the rate. One thread streams
    alone, then ``threads`` together, ``rounds`` times. CPU ranks on one host share this bandwidth: a phase
    that streams at the one-thread rate alone slows by ``threads * stream_gbps / host_stream_gbps`` when
    every rank streams at once (on the 2-core development VM: 1.1-2x, mostly ~1.5x). The simulator uses
    both figures (:mod:`hpml_compile.simulate`).

    Args:
        threads: concurrent streams for the host figure (default: the CPU count, at most 8).
        nbytes: bytes per stream.
        repeats: copies per stream (median kept).
        rounds: alone-then-together rounds; the medians of the one-thread rate and of the slow-down are kept.

    Returns:
        ``{"stream_gbps": one thread, "host_stream_gbps": all threads together, "stream_threads": threads}``
        in GB/s (1e9 bytes/s).
    """
    import threading

    k = max(1, min(8, threads or os.cpu_count() or 1))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def stream(out: list[float], i: int, start: threading.Barrier | None) -> None:
            src = torch.ones(nbytes // 4)
            dst = torch.empty_like(src)
            dst.copy_(src)
            if start is not None:
                start.wait()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - t0)
            out[i] = statistics.median(times)

        ones, slows = [], []
        for _ in range(rounds):  # alternate alone and together: a busy moment of the machine hits both
            alone = [0.0]
            stream(alone, 0, None)
            ones.append(2 * nbytes / alone[0] / 1e9)
            if k > 1:  # torch releases the GIL inside copy_: the threads stream at once
                took = [0.0] * k
                barrier = threading.Barrier(k)
                workers = [threading.Thread(target=stream, args=(took, i, barrier)) for i in range(k)]
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
                slows.append(max(1.0, max(took) / alone[0]))  # the slowest stream paces the host
    finally:
        torch.set_num_threads(before)
    one = statistics.median(ones)
    host = k * one / statistics.median(slows) if slows else one
    return {"stream_gbps": one, "host_stream_gbps": host, "stream_threads": k}


def _cache_bytes() -> dict[str, int]:
    """Cache sizes of CPU 0 (``L1d``, ``L1i``, ``L2``, ``L3``) from sysfs, in bytes; empty where sysfs lacks them."""
    out: dict[str, int] = {}
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for d in sorted(root.glob("index*")):
        try:
            level = (d / "level").read_text().strip()
            kind = (d / "type").read_text().strip()
            size = (d / "size").read_text().strip()
        except OSError:
            continue
        name = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:].upper(), 1)
        digits = size.rstrip("KMGkmg")
        if digits.isdigit():
            out[name] = int(digits) * scale
    return out


def host_facts() -> dict[str, Any]:
    """What a CPU time depends on besides the model: ``cpu_model`` (``/proc/cpuinfo``'s model name, else the
    platform's processor), ``cache_bytes`` (per level, CPU 0's caches) and ``cpus`` (logical CPUs).

    Example:
        >>> f = host_facts()
        >>> isinstance(f["cpu_model"], str) and f["cpus"] >= 1
        True
    """
    import platform

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu_model": model or platform.processor() or platform.machine() or "unknown",
            "cache_bytes": _cache_bytes(), "cpus": os.cpu_count() or 1}


def measure(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    device: torch.device | str = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    progress: bool = True,
    loss: tuple[Callable[[Any, Any], torch.Tensor], Any] | None = None,
    whole: bool = True,
) -> tuple[dict[str, NodeCost], NodeCost]:
    """Time every node of ``gm`` on ``device``, and the whole model for comparison.

    Args:
        gm: a traced GraphModule whose parameters live on ``device``.
        example_inputs: real inputs (moved to ``device`` here).
        device: where to measure.
        repeats: timed calls per node (the median is kept).
        warmup: untimed calls first.
        progress: show a progress bar (tqdm) on stderr.
        loss: ``(loss_fn, targets)``: the output node's cost is then the
            loss's on the model's output (:func:`time_loss`).

    Returns:
        ``({node name: NodeCost}, whole-model NodeCost)``; placeholders,
        get_attr and output nodes cost zero (the output node: unless ``loss``).
    """
    from tqdm.auto import tqdm

    dev = torch.device(device)
    timer = Timer(dev)
    inputs = tuple(_to_device(x, dev) for x in example_inputs)
    costs: dict[str, NodeCost] = {}
    with buffers_restored(gm):
        cap = _Capture(gm)
        with torch.no_grad():
            result = cap.run(*inputs)
        env = cap.env
        nodes = list(gm.graph.nodes)
        for node in tqdm(nodes, desc=f"profiling on {dev}", unit="node", disable=not progress, leave=False):
            if node.op == "output" and loss is not None:
                costs[node.name] = time_loss(result, loss[0], loss[1], dev, repeats, warmup)
                continue
            if node.op in ("placeholder", "get_attr", "output"):
                costs[node.name] = NodeCost(0.0, 0.0, True)
                continue
            costs[node.name] = _time_node(gm, node, env, timer, repeats, warmup)
        del env, cap, result
        if whole:
            return costs, _time_whole(gm, inputs, timer, repeats, warmup)
    live = [c for n, c in costs.items() if not (loss is not None and n == nodes[-1].name)]
    return costs, NodeCost(sum(c.fwd_ms for c in live), sum(c.bwd_ms for c in live), True)


def slice_rows(x: Any, batch: int, rows: int) -> Any:
    """The first ``rows`` of every tensor in ``x`` whose first dimension is ``batch`` (how the runtime splits a
    batch into microbatches); everything else is kept whole."""
    return map_aggregate(x, lambda v: v[:rows] if isinstance(v, torch.Tensor) and v.dim() > 0
                         and v.shape[0] == batch else v)


def _segment_module(gm: fx.GraphModule, nodes: Sequence[fx.Node], later: set[fx.Node]
                    ) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """A GraphModule running ``nodes`` alone, as a pipeline stage would: ``(module, input nodes, output nodes)``.

    Its inputs are the values it reads from outside (``get_attr`` nodes are copied in, not passed); its
    outputs the values that nodes outside it (``later``: every node after it, the output included) read.
    """
    inside = set(nodes)
    reads = [a for n in nodes for a in n.all_input_nodes if a not in inside]
    inputs = [a for a in dict.fromkeys(reads) if a.op != "get_attr"]
    attrs = [a for a in dict.fromkeys(reads) if a.op == "get_attr"]
    outputs = [n for n in nodes if any(u not in inside and u in later for u in n.users)]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = g.placeholder(a.name)
    for a in attrs:
        env[a] = g.node_copy(a)
    for n in nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, g), inputs, outputs


def time_segments(gm: fx.GraphModule, example_inputs: Sequence[Any], groups: Sequence[Sequence[str]], *,
                  device: torch.device | str = "cpu", passes: int = 5, warmup: int = 2,
                  timer: Timer | None = None, between: Callable[[], Any] | None = None
                  ) -> list[tuple[list[float], list[float]]]:
    """Forward and backward ms of each segment, timed in sequence, as a pipeline of one stage per segment runs.

    Each pass runs every segment's forward in graph order, each on the values the earlier ones made
    (floating tensors detached into leaves that require grad, as a stage receives its inputs), then every
    segment's backward in reverse order from the gradients the later ones produced, accumulating the
    parameters' ``.grad`` as training does (the user's gradients are put back afterwards). A segment is
    timed where it runs in a step, with the cache state the segments before it leave; a node timed alone
    and repeatedly is not (nodes timed alone on hot caches add up to less than a pass). No hook
    packs the saved tensors: the runtime counts saved activations on a few steps of each shape only
    (:meth:`hpml_compile.runtime.Pipeline._counts_memory`), and the steps it times run without one.

    Args:
        gm: a traced GraphModule whose parameters live on ``device``.
        example_inputs: the model's inputs (moved to ``device``).
        groups: each segment's node names, contiguous and in graph order (:func:`.static.segments`).
        device: where to measure.
        passes: timed passes (every segment gets one sample per pass).
        warmup: untimed passes first.
        timer: the timer to use (default: a plain one on ``device``).
        between: run untimed before every pass, warm-up ones included (a co-run's gradient all-reduce,
            :func:`hpml_compile.profile.corun.time_corun`).

    Returns:
        Per segment, ``(forward samples, backward samples)`` in ms, one of each per timed pass.
    """
    got = _passes(gm, example_inputs, groups, torch.device(device), [False] * (warmup + passes), warmup, timer,
                  between)
    return [(f, b) for f, b, _ in got]


def _passes(gm: fx.GraphModule, example_inputs: Sequence[Any], groups: Sequence[Sequence[str]], dev: torch.device,
            modes: Sequence[bool], warmup: int, timer: Timer | None, between: Callable[[], Any] | None = None
            ) -> list[tuple[list[float], list[float], list[float]]]:
    """:func:`time_segments`'s passes, one per entry of ``modes`` (True: the backward split,
    :func:`_segment_pass`), the first ``warmup`` untimed, ``between`` run before each: per segment, forward,
    backward (split: its input-gradient part) and weight-gradient part (else zeros) samples in ms."""
    timer = timer or Timer(dev)
    inputs = tuple(_to_device(x, dev) for x in example_inputs)
    by_name = {n.name: n for n in gm.graph.nodes}
    order = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    segs = []
    for names in groups:
        nodes = [by_name[n] for n in names]
        segs.append(_segment_module(gm, nodes, {n for n in order if index[n] > index[nodes[-1]]}))
    placeholders = [n for n in order if n.op == "placeholder"]
    model_out = next(n for n in order if n.op == "output")
    finals = set(model_out.all_input_nodes)
    samples: list[tuple[list[float], list[float], list[float]]] = [([], [], []) for _ in segs]
    params = [p for p in gm.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        with buffers_restored(gm), torch.enable_grad():
            for i, split in enumerate(modes):
                if between is not None:
                    between()
                got = _segment_pass(segs, placeholders, inputs, finals, timer, split)
                if i >= warmup:
                    for s, row in enumerate(zip(*got)):
                        for into, x in zip(samples[s], row):
                            into.append(x)
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    return samples


def _segment_pass(segs: list[tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]], placeholders: list[fx.Node],
                  inputs: tuple[Any, ...], finals: set[fx.Node], timer: Timer, split: bool = False
                  ) -> tuple[list[float], list[float], list[float]]:
    """One forward of every segment in order, then one backward of every segment in reverse order:
    ``(forward, backward, 0)`` ms per segment.

    ``split``: each backward runs as ZB-H1 runs it (:mod:`hpml_compile.backsplit`), its
    input-gradient part then its weight-gradient part, timed apart: ``(forward, input part, weight part)``."""
    env: dict[fx.Node, Any] = dict(zip(placeholders, inputs))
    leaves: list[list[Any]] = []
    outs: list[tuple[Any, ...]] = []
    fwd_ms: list[float] = []
    for module, ins, outputs in segs:
        args = [_leafify(env[a]) for a in ins]
        box: list[Any] = [None]
        fwd_ms.append(timer.once(lambda: box.__setitem__(0, module(*args))))
        leaves.append(args)
        outs.append(box[0])
        env.update(zip(outputs, box[0]))
    consumers: dict[fx.Node, list[Any]] = {}  # a value -> the leaf copies the later segments read it through
    for (_, ins, _), args in zip(segs, leaves):
        for a, leaf in zip(ins, args):
            consumers.setdefault(a, []).append(leaf)
    bwd_ms = [0.0] * len(segs)
    wgt_ms = [0.0] * len(segs)
    for s in range(len(segs) - 1, -1, -1):
        _, _, outputs = segs[s]
        tensors, grads = [], []
        for node, value in zip(outputs, outs[s]):
            got = [tree_leaves(leaf) for leaf in consumers.get(node, [])]
            for k, t in enumerate(tree_leaves(value)):
                if not isinstance(t, torch.Tensor) or not t.requires_grad:
                    continue
                parts = [g[k].grad for g in got if isinstance(g[k], torch.Tensor) and g[k].grad is not None]
                if node in finals:
                    parts.append(torch.ones_like(t))
                if parts:
                    tensors.append(t)
                    grads.append(parts[0] if len(parts) == 1 else torch.stack(parts).sum(0))
        if tensors and split:
            bwd_ms[s], wgt_ms[s] = _split_once(segs[s][0], tensors, grads, leaves[s], timer)
        elif tensors:
            bwd_ms[s] = timer.once(lambda: torch.autograd.backward(tensors, grads))
    return fwd_ms, bwd_ms, wgt_ms


def _split_once(module: fx.GraphModule, tensors: list[torch.Tensor], grads: list[torch.Tensor], args: list[Any],
                timer: Timer) -> tuple[float, float]:
    """``(input part, weight part)`` ms of one segment's backward, run as ZB-H1's stages run it."""
    from ..backsplit import backward_input, backward_weight

    params = [p for p in module.parameters() if p.requires_grad]
    inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
    box: list[Any] = [None]
    first = timer.once(lambda: box.__setitem__(0, backward_input(tensors, params, inputs, grads)))
    return first, timer.once(lambda: backward_weight(box[0]))
