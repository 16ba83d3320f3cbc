"""Compiled block times: what a block costs in a stage that runs compiled by ``torch.compile`` (inductor).

A stage that runs compiled (:mod:`hpml_compile.runtime.execute.compiled`) costs less than its eager nodes:
inductor fuses pointwise ops and drops the per-op Python dispatch. So where stages will run compiled, the
profile also times the model's blocks compiled (:func:`compiled_costs`), the units the solver cuts
between (:func:`.static.segments`: each repeated block, each region between blocks):

1. each block of a kind is compiled once: identical blocks (equal signatures: the same modules, ops,
   shapes and wiring, e.g. the layers of a transformer) share one compile and one measurement, on the
   first of them;
2. the block is timed alone, eager and compiled in alternation (forward, then backward from ones), on the
   inputs the model gives it; a compiled call pays the compiled wrapper once (its guards and the
   autograd function around the graph: the *call overhead*, measured on a trivial function, about 20-50
   us on a CPU), which a stage pays once per graph, not once per block, so the block's compiled time is
   taken without it;
3. the ratio compiled / eager of the block is applied to the node costs the profile measured for it in
   sequence (:func:`hpml_compile.profile._scale_to_segments`), so a compiled node keeps what the
   sequence measured (caches, the segments before it) and changes by what compiling changed;
4. where the profile measured a second, smaller batch (the microbatch rows, for the fixed part of a
   cost), the ratio is measured there too (a second compile: the runtime compiles with static shapes),
   and the fixed part of the compiled cost is fitted through both, as the eager one is.

A block that does not compile (dynamo or inductor raises) keeps its eager times, said in one line naming
the block and why. The call overhead is recorded (``devices[kind]["compiled"]``) but not priced: a stage
pays it once per microbatch's forward and backward, tens of microseconds. Inductor fusing across block
boundaries, and the graph breaks at a stage's sends and receives, are not timed.

Example:
    >>> import torch
    >>> from hpml_compile.trace import trace
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    >>> gm = trace(m, (torch.randn(4, 8),))
    >>> r, facts = block_ratios(gm, (torch.randn(4, 8),), torch.device("cpu"), repeats=3)  # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate
from torch.utils._pytree import tree_leaves

from ..ir import NodeCost
from ..trace import buffers_restored
from .static import Segment, segments
from .timing import Timer, _Capture, _leafify, _segment_module, _to_device, slice_rows

__all__ = ["block_ratios", "compiled_costs", "call_overhead_ms"]

# Timed calls per block and mode: the blocks are few (one per kind), so they get more than a node does.
_PASSES = 9
# A compiled block's time less the call overhead is kept at no less than this share of its compiled call: the
# overhead, measured on a trivial function, is itself a few microseconds off.
_FLOOR = 0.1

Ratios = dict[int, tuple[float, float]]  # segment index -> (forward, backward) compiled / eager


def _backend(fallbacks: list[str]) -> Callable[..., Any]:
    """Inductor, recording why where it fails (then the graph runs as traced, and the block counts as eager)."""
    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        try:
            out: Callable[..., Any] = compile_fx(gm, example_inputs)  # type: ignore[assignment]
            return out
        except Exception as e:  # noqa: BLE001 -- any compiler failure: the block is timed eager, and said
            fallbacks.append((str(e).strip().splitlines() or [type(e).__name__])[0][:200])
            return gm.forward

    return backend


def _time_pair(fn: Callable[[], Any], timer: Timer) -> tuple[float, float]:
    """``(forward ms, backward ms)`` of one call of ``fn`` and one backward from ones through what it returned."""
    box: list[Any] = [None]
    fwd = timer.once(lambda: box.__setitem__(0, fn()))
    outs = [t for t in tree_leaves(box[0]) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs:
        return fwd, 0.0
    grads = [torch.ones_like(t) for t in outs]
    return fwd, timer.once(lambda: torch.autograd.backward(outs, grads))


def call_overhead_ms(device: torch.device, repeats: int = 50) -> tuple[float, float]:
    """``(forward, backward)`` ms a compiled call adds to the same call eager: its guards and wrapper, measured
    on a trivial function (``2 * x`` of 8 numbers); ``(0.0, 0.0)`` where it does not compile (then neither will
    the blocks, each said)."""
    x = torch.randn(8, device=device, requires_grad=True)
    failed: list[str] = []
    compiled = torch.compile(lambda a: a * 2, backend=_backend(failed), dynamic=False)
    timer = Timer(device)
    try:
        _time_pair(lambda: compiled(x), timer)  # compiles
    except Exception:  # noqa: BLE001 -- dynamo itself fails here: the blocks will say why, one line each
        return 0.0, 0.0
    if failed:
        return 0.0, 0.0
    eager = [_time_pair(lambda: x * 2, timer) for _ in range(repeats)]
    comp = [_time_pair(lambda: compiled(x), timer) for _ in range(repeats)]
    med = statistics.median
    return (max(0.0, med(c[0] for c in comp) - med(e[0] for e in eager)),
            max(0.0, med(c[1] for c in comp) - med(e[1] for e in eager)))


def block_ratios(gm: fx.GraphModule, inputs: Sequence[Any], device: torch.device, *, repeats: int = _PASSES,
                 segs: list[Segment] | None = None, overhead: tuple[float, float] | None = None,
                 say: Callable[[str], None] = lambda _line: None) -> tuple[Ratios, dict[str, Any]]:
    """Per block, its compiled time over its eager time (module docstring, steps 1-3), at the rows of ``inputs``.

    Args:
        gm: the traced model (its parameters on ``device``).
        inputs: the model's inputs.
        device: where to time.
        repeats: timed calls per block and mode (at least 3).
        segs: the blocks (default :func:`.static.segments`).
        overhead: the call overhead (default: measured, :func:`call_overhead_ms`).
        say: progress lines, and the one line for each kind of block that falls back to eager.

    Returns:
        ``(ratios by segment index, facts)``; a block that fell back has no ratio, and its name is in
        ``facts["fallbacks"]`` with why.
    """
    segs = segments(gm) if segs is None else segs
    over = call_overhead_ms(device) if overhead is None else overhead
    args = tuple(_to_device(x, device) for x in inputs)
    with torch.no_grad(), buffers_restored(gm):
        cap = _Capture(gm)
        cap.run(*args)
        env = cap.env
    order = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    by_name = {n.name: n for n in order}
    kinds: dict[tuple[Any, ...], list[int]] = {}
    for i, s in enumerate(segs):
        kinds.setdefault(s.signature, []).append(i)
    ratios: Ratios = {}
    fallbacks: dict[str, str] = {}
    compile_s = 0.0
    timer = Timer(device)
    params = [p for p in gm.parameters() if p.requires_grad]
    saved = [p.grad for p in params]  # the backward passes accumulate into .grad: the user's are put back
    try:
        for n_kind, members in enumerate(kinds.values(), start=1):
            seg = segs[members[0]]
            nodes = [by_name[n] for n in seg.nodes]
            module, ins, _ = _segment_module(gm, nodes, {n for n in order if index[n] > index[nodes[-1]]})
            same = f" and {len(members) - 1} identical" if len(members) > 1 else ""
            t0 = time.perf_counter()
            why, got = _ratio(module, [_leafify(env[a]) for a in ins], timer, max(3, repeats), over)
            took = time.perf_counter() - t0
            compile_s += took
            if why is not None:
                say(f"      block {seg.name}{same}: priced eager (torch.compile failed on it: {why})")
                fallbacks.update((segs[i].name, why) for i in members)
                continue
            say(f"      block {seg.name}{same} ({n_kind}/{len(kinds)}): compiled {got[0]:.2f}x forward, "
                f"{got[1]:.2f}x backward of eager ({took:.1f} s)")
            ratios.update((i, got) for i in members)
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    facts = {"blocks": len(segs), "distinct": len(kinds), "compile_s": round(compile_s, 2),
             "call_fwd_ms": round(over[0], 5), "call_bwd_ms": round(over[1], 5), "fallbacks": fallbacks}
    return ratios, facts


def _ratio(module: fx.GraphModule, leaves: list[Any], timer: Timer, repeats: int, over: tuple[float, float]
           ) -> tuple[str | None, tuple[float, float]]:
    """``(why it fell back or None, (forward, backward) compiled / eager)`` of one block, timed in alternation."""
    failed: list[str] = []
    try:
        import torch._dynamo

        torch._dynamo.reset()  # a fresh cache: the blocks of a model are many, the limit per code object 8
        compiled = torch.compile(module, backend=_backend(failed), dynamic=False)
        with buffers_restored(module), torch.enable_grad():
            _time_pair(lambda: compiled(*leaves), timer)  # compiles forward and backward
            if failed:
                return failed[0], (1.0, 1.0)
            eager: list[tuple[float, float]] = []
            comp: list[tuple[float, float]] = []
            for _ in range(repeats + 1):  # the first pair warms both up
                eager.append(_time_pair(lambda: module(*leaves), timer))
                comp.append(_time_pair(lambda: compiled(*leaves), timer))
    except Exception as e:  # noqa: BLE001 -- dynamo cannot trace the block: it is timed eager, and said
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:200], (1.0, 1.0)
    out = []
    for part in (0, 1):
        ms = statistics.median(x[part] for x in eager[1:])
        c = statistics.median(x[part] for x in comp[1:])
        out.append(max(c - over[part], _FLOOR * c) / ms if ms > 0 else 1.0)
    return None, (out[0], out[1])


def _fit(eager: NodeCost, big: tuple[float, float], small: tuple[float, float] | None, fraction: float) -> NodeCost:
    """``eager`` at its compiled ratios ``big`` (the batch's); with ``small`` (the micro rows', a ``fraction`` of
    the batch) the fixed part is fitted through both, else scaled by ``big``."""
    fwd, bwd = eager.fwd_ms * big[0], eager.bwd_ms * big[1]
    if small is None or not 0 < fraction < 1:
        return NodeCost(fwd, bwd, eager.measured, eager.fwd_spread_ms * big[0], eager.bwd_spread_ms * big[1],
                        min(fwd, eager.fwd_fixed_ms * big[0]), min(bwd, eager.bwd_fixed_ms * big[1]))
    ef, eb = eager.at(fraction)

    def fixed(t_big: float, t_small: float) -> float:  # a + b * rows through both points, as the eager fit
        per = max(0.0, (t_big - t_small) / (1.0 - fraction))
        return min(t_big, max(0.0, t_big - per))

    return NodeCost(fwd, bwd, eager.measured, eager.fwd_spread_ms * big[0], eager.bwd_spread_ms * big[1],
                    fixed(fwd, ef * small[0]), fixed(bwd, eb * small[1]))


def compiled_costs(gm: fx.GraphModule, inputs: Sequence[Any], device: torch.device, costs: dict[str, NodeCost],
                   *, batch: int, micro: int | None, repeats: int = _PASSES,
                   say: Callable[[str], None] = lambda _line: None) -> tuple[dict[str, NodeCost], dict[str, Any]]:
    """The nodes' costs in stages that run compiled, from their eager ``costs`` (module docstring).

    Args:
        gm: the traced model.
        inputs: the model's inputs (``batch`` rows).
        device: where to time.
        costs: the eager costs the profile measured on ``device`` (fixed parts fitted at ``micro`` rows).
        batch: the rows of ``inputs``.
        micro: the second, smaller batch the eager costs were also timed at (None: not measured).
        repeats: timed calls per block and mode.
        say: progress lines and fallbacks.

    Returns:
        ``(compiled costs of the blocks' nodes, facts for profile.devices[kind]["compiled"])``; nodes in no block
        (the inputs, the output: the loss) are not in it and keep their eager cost.
    """
    segs = segments(gm)
    over = call_overhead_ms(device)
    said = f"call overhead {over[0] * 1e3:.0f} us forward, {over[1] * 1e3:.0f} us backward" if any(over) \
        else "call overhead not measured: a trivial function did not compile"
    say(f"      timing {len(segs)} blocks compiled by torch.compile (inductor), once per kind of block ({said})")
    big, facts = block_ratios(gm, inputs, device, repeats=repeats, segs=segs, overhead=over, say=say)
    small: Ratios | None = None
    if micro is not None and 0 < micro < batch:
        say(f"      and at {micro} rows (the microbatch's fixed part)")
        small_inputs = tuple(slice_rows(x, batch, micro) for x in inputs)
        try:
            small, small_facts = block_ratios(gm, small_inputs, device, repeats=repeats, segs=segs, overhead=over,
                                              say=lambda _line: None)
            facts["compile_s"] = round(facts["compile_s"] + small_facts["compile_s"], 2)
        except Exception as e:  # noqa: BLE001 -- e.g. shapes specialised to the batch: fixed parts scaled instead
            say(f"      compiled blocks at {micro} rows failed ({type(e).__name__}: {e}); their fixed parts are "
                "scaled by the batch's ratio")
    failed = {i for i in range(len(segs)) if i not in big}
    if small is not None and any(i not in small for i in big):  # compiled at the batch only: fixed parts scaled
        small = {i: small.get(i, big[i]) for i in big}
    facts["rows"] = [batch] + ([micro] if small is not None and micro is not None else [])
    facts["ratios"] = {s.name: [round(big[i][0], 4), round(big[i][1], 4)] for i, s in enumerate(segs)
                       if i not in failed}
    out: dict[str, NodeCost] = {}
    for i, s in enumerate(segs):
        if i in failed:
            continue
        for n in s.nodes:
            if n in costs:
                out[n] = _fit(costs[n], big[i], small[i] if small is not None else None,
                              (micro or 0) / batch)
    return out, facts
