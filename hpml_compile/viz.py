"""Pictures of a plan: the placed cost graph (graphviz), the simulated timeline and the memory per device.

Three pictures, each a plain function of a :class:`~hpml_compile.plan.Plan`,
its cost graph and the simulator's :class:`~hpml_compile.simulate.SimResult`:

- :func:`plan_graph`: the coarsened cost graph as a graphviz ``Digraph``, one
  colour and one box per stage (labelled with its devices, options, time per
  microbatch and peak memory), the bytes on every edge that crosses stages,
  swapped and recomputed blocks marked;
- :func:`timeline_figure`: a Gantt chart, one row per device: forward,
  backward, recompute, sends, swaps, gradient sync and idle time;
- :func:`memory_figure`: each device's memory over the step against its
  capacity, with the peak broken down (parameters, gradients, optimizer
  state, activations).

Beyond 16 devices the timeline and the memory chart draw one row (panel) per
stage instead of per device (:func:`chart_rows`): a stage's replicas do the
same work at the same times, and 64 identical rows are not readable.

:func:`write_pictures` writes them all into a folder. Figures are built with
``matplotlib.figure.Figure`` and saved by the Agg canvas directly, never
through ``pyplot``, so nothing global (backend, current figure) changes.
matplotlib is imported by the two functions that draw with it (about half a
second of CPU), not with this module, which every ``hpml-compile`` command
imports through ``show``.

Example:
    >>> import tempfile
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> from hpml_compile.plan import Plan, Stage, Schedule
    >>> from hpml_compile.simulate import simulate
    >>> g = chain_graph([(2.0, 4.0), (2.0, 4.0)], kind="cpu", output_bytes=2**20)
    >>> st = (Stage(0, ("d0",), ("n0",)), Stage(1, ("d1",), ("n1",), recompute=True))
    >>> plan = Plan("toy", uniform_cluster(2), Schedule.ONE_F_ONE_B, 2, st)
    >>> r = simulate(plan, g)
    >>> "1.0 MiB" in plan_graph(plan, g, r).source
    True
    >>> sorted(p.name for p in write_pictures(plan, g, r, tempfile.mkdtemp(), graph_formats=()))
    ['memory.png', 'plan_graph.dot', 'timeline.png']
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import graphviz

from .costgraph import CostGraph
from .memory import GiB, ZeroStage
from .plan import AllReduce, Plan, Stage
from .report import human_bytes
from .simulate import EventKind, SimResult, idle_intervals

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn (see the module docstring)
    from matplotlib.figure import Figure

__all__ = ["STAGE_COLOURS", "stage_of_nodes", "chunk_text", "plan_graph", "timeline_figure", "memory_figure", "write_pictures",
           "device_order", "chart_rows", "device_names", "rows_text"]

# Qualitative, colour-blind-friendly fills (Okabe-Ito, lightened); stage k takes colour k mod len.
STAGE_COLOURS: tuple[str, ...] = ("#9ecae1", "#fdae6b", "#a1d99b", "#fc9fb5", "#c6b3e0", "#f6e58d", "#bcbddc",
                                  "#fdd0a2", "#c7e9c0", "#d9d9d9")
_BORDER: tuple[str, ...] = ("#3182bd", "#e6550d", "#31a354", "#d6336c", "#756bb1", "#b8a200", "#54278f",
                            "#a63603", "#006d2c", "#525252")
# Timeline colours by event kind; idle is drawn as a light hatched background.
_EVENT_COLOURS: dict[EventKind, str] = {
    EventKind.FORWARD: "#4C72B0", EventKind.BACKWARD: "#55A868", EventKind.RECOMPUTE: "#8172B2",
    EventKind.SEND: "#DD8452", EventKind.SWAP: "#937860", EventKind.SYNC: "#C44E52",
    EventKind.OPTIMIZER: "#8C8C8C",
}
_EVENT_NAMES: dict[EventKind, str] = {
    EventKind.FORWARD: "forward", EventKind.BACKWARD: "backward", EventKind.RECOMPUTE: "recompute (extra forward)",
    EventKind.SEND: "communication: send activation / gradient", EventKind.SWAP: "communication: swap to/from host",
    EventKind.SYNC: "communication: gradient sync",
    EventKind.OPTIMIZER: "optimizer step",
}
_IDLE = "#e8e8e8"


def stage_of_nodes(plan: Plan, graph: CostGraph) -> dict[str, int]:
    """The stage of every node of ``graph``.

    Args:
        plan: the plan.
        graph: a cost graph each of whose nodes lies within one stage.

    Returns:
        ``{graph node: stage index}``.

    Raises:
        ValueError: if a graph node has members in several stages or in none.
    """
    fx_stage = {n: st.index for st in plan.stages for n in st.nodes}
    out: dict[str, int] = {}
    for v in graph.order:
        owners = {fx_stage.get(m, -1) for m in graph.node(v).members}
        if len(owners) != 1 or -1 in owners:
            raise ValueError(f"graph node {v!r} has members in stages {sorted(owners)}")
        out[v] = owners.pop()
    return out


def device_order(plan: Plan) -> list[str]:
    """Devices in pipeline order (stage by stage), then the devices the plan leaves unused."""
    used = list(dict.fromkeys(d for st in plan.stages for d in st.devices))  # interleaved: a device's chunks once
    return used + [d.name for d in plan.cluster.devices if d.name not in set(used)]


def device_names(names: Sequence[str]) -> str:
    """A short list of device names: all of up to three, else the first and last and the count."""
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} .. {names[-1]} ({len(names)})"


def chart_rows(plan: Plan, per_device: bool | None = None) -> list[tuple[str, str, int | None]]:
    """The rows of the timeline and the panels of the memory chart: ``(label, device drawn, stage)``.

    Args:
        plan: the plan.
        per_device: one row per device; by default only up to 16 devices. Otherwise one row per stage
            (its replicas do the same work at the same times; the row draws the first, which also sends)
            and one per kind of unused device.

    Returns:
        The rows, in pipeline order. A row of unused devices has stage None and names its first device
        (which gives the row's kind and capacity).
    """
    c = plan.cluster
    if per_device if per_device is not None else len(c.devices) <= 16:
        stage_of: dict[str, int] = {}
        for st in plan.stages:
            for d in st.devices:
                stage_of.setdefault(d, st.index)  # interleaved 1F1B: the device's first chunk
        rows = {d: r for st in plan.stages for d, r in zip(st.devices, st.rows)}
        return [(f"{d} ({c.device(d).kind})\n" + (_held(plan, stage_of[d]) if d in stage_of else "unused")
                 + (f", {rows[d]} rows" if d in rows else ""),
                 d, stage_of.get(d)) for d in device_order(plan)]
    rows: list[tuple[str, str, int | None]] = [
        (f"{device_names(st.devices)}\n{c.device(st.devices[0]).kind}, {_held(plan, st.index)}"
         + (f", rows {min(st.rows)}-{max(st.rows)}" if st.rows else ""), st.devices[0], st.index)
        for st in plan.stages[:len(plan.stages) // plan.chunks]]
    used = {d for st in plan.stages for d in st.devices}
    for kind in dict.fromkeys(d.kind for d in c.devices if d.name not in used):
        idle = [d.name for d in c.devices if d.name not in used and d.kind == kind]
        rows.append((f"{device_names(idle)}\n{kind}, unused", idle[0], None))
    return rows


def _held(plan: Plan, first: int) -> str:
    """``stage 3``, or under interleaved 1F1B the stages (chunks) a device group holds: ``stages 1, 5, 9``."""
    if plan.chunks == 1:
        return f"stage {first}"
    return "stages " + ", ".join(map(str, range(first, len(plan.stages), len(plan.stages) // plan.chunks)))


def chunk_text(plan: Plan, st: Stage) -> str:
    """``chunk 2 of 3 on device group 1``: where an interleaved plan's stage runs ("" for one chunk per group).

    Example:
        >>> from hpml_compile.cluster import load_cluster
        >>> from hpml_compile.plan import Schedule
        >>> sts = tuple(Stage(k, (f"cpu{k % 2}",), (f"n{k}",)) for k in range(4))
        >>> p = Plan("m", load_cluster("local-cpu-2"), Schedule.INTERLEAVED, 2, sts, chunks=2)
        >>> chunk_text(p, p.stages[3])
        'chunk 2 of 2 on device group 1'
    """
    if plan.chunks == 1:
        return ""
    groups = len(plan.stages) // plan.chunks
    return f"chunk {st.index // groups + 1} of {plan.chunks} on device group {st.index % groups}"


def rows_text(st: Stage) -> str:
    """The rows of each microbatch each replica of ``st`` trains on, e.g. ``rows per microbatch: gpu0 12,
    gpu2 4`` (uneven data parallelism), or ``equal rows`` for a stage without them.

    Example:
        >>> rows_text(Stage(0, ("gpu0", "gpu2"), ("x",), rows=(12, 4)))
        'rows per microbatch: gpu0 12, gpu2 4'
    """
    if not st.rows:
        return "equal rows"
    pairs = [f"{d} {r}" for d, r in zip(st.devices, st.rows)]
    if len(pairs) > 6:
        pairs = [*pairs[:2], "..", *pairs[-2:], f"({len(pairs)} replicas, {min(st.rows)}-{max(st.rows)})"]
    return "rows per microbatch: " + ", ".join(pairs)


def allreduce_label(plan: Plan, st: Stage) -> str:
    """``hierarchical all-reduce (2 hosts x 8)``: how a stage sums its gradients, for the pictures and the summary
    (a ZeRO-1 stage: ``hierarchical reduce-scatter + all-gather (2 hosts x 8, optimizer sharded per host)``)."""
    group = st.sync_group()
    hosts = len({plan.cluster.device(d).host for d in group})
    shape = f"{hosts} hosts x {len(group) // max(1, hosts)}"
    if st.zero != ZeroStage.NONE and st.allreduce is AllReduce.HIERARCHICAL:
        return f"hierarchical reduce-scatter + all-gather ({shape}, optimizer sharded per host)"
    return f"{st.allreduce.value} all-reduce ({shape})"


def _stage_label(plan: Plan, st: Stage, result: SimResult | None) -> str:
    kinds = [plan.cluster.device(d).kind for d in st.devices]
    kind_text = " + ".join(f"{kinds.count(k)} x {k}" for k in dict.fromkeys(kinds))
    opts = [f"tp {st.tp} x {st.replicas} replicas"] if st.tp > 1 else []
    opts += [f"ZeRO-{int(st.zero)}"] if st.zero else []
    opts += ["recompute"] if st.recompute else []
    opts += [f"swap {len(st.swap)} nodes"] if st.swap else []
    opts += ["optimizer offload"] if st.offload_optimizer else []
    opts += [f"grads {st.compress}"] if st.compress else []
    opts += [f"at most {st.max_deferred} of {st.index} W held back"] if st.max_deferred is not None else []
    opts += [f"local SGD every {plan.sync_every} (warm-up {plan.sync_warmup})"] \
        if plan.sync_every > 1 and len(st.devices) > 1 else []
    opts += [allreduce_label(plan, st)] if st.allreduce is AllReduce.HIERARCHICAL else []
    opts += [chunk_text(plan, st)] if plan.chunks > 1 else []
    head = f"stage {st.index}: {device_names(st.devices)} ({kind_text})" + (f" | {', '.join(opts)}" if opts else "")
    if st.rows:
        head += "\\n" + rows_text(st)
    if result is None:
        return head
    c = result.stages[st.index]
    cap = min(plan.cluster.device(d).memory_bytes for d in st.devices)
    bott = "  << bottleneck" if st.index == result.bottleneck_stage else ""
    return (f"{head}\\nper microbatch: fwd {c.fwd_ms:.3g} + bwd {c.bwd_ms + c.recompute_ms:.3g} ms{bott}\\n"
            f"peak {c.memory.total / GiB:.2f} of {cap / GiB:.1f} GiB per device")


def plan_graph(plan: Plan, graph: CostGraph, result: SimResult | None = None) -> graphviz.Digraph:
    """The placed cost graph: one coloured box per stage, cut edges labelled with their bytes.

    Args:
        plan: the plan.
        graph: its (coarsened) cost graph; every node within one stage.
        result: the simulation, for per-stage times and memory in the labels (optional).

    Returns:
        A graphviz Digraph (render it with ``.pipe(format="svg")``).
    """
    owner = stage_of_nodes(plan, graph)
    g, m = graph.graph, plan.microbatches
    ids = {v: f"n{i}" for i, v in enumerate(graph.order)}
    so = plan.solver
    title = (f"{plan.model} on {plan.cluster.name}: {len(plan.stages)} stages, {m} microbatches "
             f"({plan.schedule.value}), {so.name} {so.status.value}")
    if result is not None:
        title += f"\\npredicted step {result.step_ms:.4g} ms, bubble {result.bubble:.1%}"
    title += ("\\ncolour = stage; red edges cross stages (bytes per step, per microbatch); "
              "dashed = activations swapped to host; double border = recomputed in backward")
    dot = graphviz.Digraph(plan.model, graph_attr={
        "rankdir": "TB", "label": title, "labelloc": "t", "fontname": "Helvetica", "fontsize": "14",
        "nodesep": "0.25", "ranksep": "0.3", "compound": "true"},
        node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica", "fontsize": "10"},
        edge_attr={"fontname": "Helvetica", "fontsize": "9", "color": "#777777", "arrowsize": "0.6"})
    for st in plan.stages:
        fill, border = STAGE_COLOURS[st.index % len(STAGE_COLOURS)], _BORDER[st.index % len(_BORDER)]
        kinds = sorted({plan.cluster.device(d).kind for d in st.devices})
        swapped = set(st.swap)
        with dot.subgraph(name=f"cluster_{st.index}") as sub:
            sub.attr(label=_stage_label(plan, st, result), style="rounded", color=border, penwidth="2",
                     fontcolor=border, labeljust="l")
            for v in (v for v in graph.order if owner[v] == st.index):
                a = graph.node(v)
                ms = max(sum(a.cost[k]) for k in kinds) if all(k in a.cost for k in kinds) else 0.0
                lines = [v, f"fwd+bwd {ms:.3g} ms/step, params {human_bytes(a.param_bytes)}"]
                style, peripheries = "rounded,filled", "1"
                if swapped and swapped & set(a.members):
                    lines.append("[swapped to host]")
                    style = "rounded,filled,dashed"
                if st.recompute:
                    lines.append("[recomputed]")
                    peripheries = "2"
                sub.node(ids[v], "\\n".join(lines), fillcolor=fill, color=border, style=style,
                         peripheries=peripheries)
    # The topological order is the spine (stages stacked top to bottom); other edges do not move ranks, so
    # a hub such as a rotary-embedding table feeding every layer does not spread the picture sideways.
    nxt = dict(zip(graph.order, graph.order[1:]))
    for u, v in nxt.items():
        if not g.has_edge(u, v):
            dot.edge(ids[u], ids[v], style="invis", weight="100")
    # A stage receives each tensor once: cross-stage edges from one node into one stage are drawn as one,
    # into that stage's first consumer, labelled with the bytes that cross.
    crossing: dict[tuple[str, int], tuple[str, dict[str, int]]] = {}
    pos = {v: i for i, v in enumerate(graph.order)}
    for u in graph.order:
        for v in sorted(g.successors(u), key=pos.__getitem__):
            e = g.edges[u, v]
            if owner[u] == owner[v]:
                dot.edge(ids[u], ids[v], weight="100" if nxt.get(u) == v else "1",
                         constraint="true" if nxt.get(u) == v else "false")
                continue
            crossing.setdefault((u, owner[v]), (v, {}))[1].update(e["producers"])
    for (u, _), (v, prods) in crossing.items():
        nbytes = sum(prods.values())
        dot.edge(ids[u], ids[v], label=f"{human_bytes(nbytes)}\\n({human_bytes(nbytes / m)} / mb)",
                 color="#d62728", fontcolor="#d62728", penwidth="2.0", weight="100" if nxt.get(u) == v else "1",
                 constraint="true" if nxt.get(u) == v else "false")
    return dot


def _row_bars(result: SimResult, device: str) -> dict[EventKind, list[tuple[float, float]]]:
    out: dict[EventKind, list[tuple[float, float]]] = {}
    for b in result.intervals:
        if b.device == device and b.end_ms > b.start_ms:
            out.setdefault(b.kind, []).append((b.start_ms, b.end_ms - b.start_ms))
    return out


def timeline_figure(plan: Plan, result: SimResult) -> Figure:
    """A Gantt chart of the simulated step: one row per device (per stage beyond 16), communication below compute.

    Args:
        plan: the plan.
        result: its simulation.

    Returns:
        A matplotlib Figure (save it with ``fig.savefig(path)``).
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = chart_rows(plan)
    fig = Figure(figsize=(13, min(40.0, 1.6 + 0.55 * len(rows))), layout="constrained")
    ax = fig.add_subplot()
    end = max(result.step_ms, max((b.end_ms for b in result.intervals), default=0.0))
    m = plan.microbatches
    for row, (_, dev, st) in enumerate(rows):
        bars = _row_bars(result, dev) if st is not None else {}
        gaps = [(s, e - s) for s, e in idle_intervals(result, dev)] if st is not None else [(0.0, end)]
        ax.broken_barh(gaps, (row - 0.3, 0.6), facecolors=_IDLE, edgecolor="#bbbbbb", hatch="///", linewidth=0)
        for kind in (EventKind.FORWARD, EventKind.RECOMPUTE, EventKind.BACKWARD):
            if kind in bars:
                ax.broken_barh(bars[kind], (row - 0.3, 0.6), facecolors=_EVENT_COLOURS[kind],
                               edgecolor="white", linewidth=0.4)
        for kind, (y, h) in ((EventKind.SEND, (0.32, 0.12)), (EventKind.SWAP, (0.32, 0.12)),
                             (EventKind.SYNC, (-0.3, 0.6)), (EventKind.OPTIMIZER, (-0.3, 0.6))):
            if kind in bars:
                ax.broken_barh(bars[kind], (row + y, h), facecolors=_EVENT_COLOURS[kind], alpha=0.85,
                               linewidth=0)
        if m <= 16 and st is not None:
            _label_microbatches(ax, result, dev, row, end)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.7)
    ax.set_xlim(0, end * 1.01 if end > 0 else 1.0)
    ax.set_xlabel("time in the step (ms)")
    ax.axvline(result.step_ms, color="black", linewidth=0.8, linestyle="--")
    ax.set_title(f"{plan.model} on {plan.cluster.name}: {plan.schedule.value}, {m} microbatches; step "
                 f"{result.step_ms:.4g} ms, bubble {result.bubble:.1%}, bottleneck stage {result.bottleneck_stage}",
                 fontsize=10)
    present = {b.kind for b in result.intervals}
    handles = [Patch(facecolor=_EVENT_COLOURS[k], label=_EVENT_NAMES[k]) for k in EventKind
               if k in present or k in (EventKind.FORWARD, EventKind.BACKWARD, EventKind.SEND)]
    handles.append(Patch(facecolor=_IDLE, edgecolor="#bbbbbb", hatch="///", label="idle"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(4, len(handles)), fontsize=8, frameon=False)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    return fig


def _label_microbatches(ax: Any, result: SimResult, dev: str, row: int, end: float) -> None:
    for b in result.intervals:
        if b.device != dev or b.kind not in (EventKind.FORWARD, EventKind.BACKWARD):
            continue
        if b.end_ms - b.start_ms > 0.012 * end:  # only where the number fits inside the bar
            tag = f"{'F' if b.kind is EventKind.FORWARD else 'B'}{b.microbatch}"
            ax.text((b.start_ms + b.end_ms) / 2, row, tag, ha="center", va="center", fontsize=6, color="white")


def memory_figure(plan: Plan, result: SimResult) -> Figure:
    """Each device's memory over the step against its capacity, one panel per device (per stage beyond 16).

    Args:
        plan: the plan.
        result: its simulation.

    Returns:
        A matplotlib Figure.
    """
    from matplotlib.figure import Figure

    panels = chart_rows(plan)
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(3.4 * cols + 0.6, min(60.0, 2.9 * rows + 0.8)), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    end = result.step_ms or 1.0
    for i, (label, dev, st) in enumerate(panels):
        ax = axes[i // cols][i % cols]
        first = label.split("\n")[0]
        d = plan.cluster.device(dev)
        who = first if first.endswith(f"({d.kind})") else f"{first} ({d.kind})"  # per device: the label has it
        if st is not None:
            cap = min(plan.cluster.device(x).memory_bytes for x in plan.stages[st].devices) / GiB
            peak = result.peak.get(dev, 0) / GiB
            mem = result.stages[st].memory
            each = " each" if len(plan.stages[st].devices) > 1 else ""
            title = (f"{who}, stage {st}\n"
                     f"peak {peak:.2f} of {cap:.1f} GiB{each}, slack {1 - peak / cap:.0%}\n"
                     f"P {mem.params / GiB:.2f} + G {mem.grads / GiB:.2f} + O {mem.optimizer / GiB:.2f} + "
                     f"A {mem.activations / GiB:.2f} GiB")
            _memory_curve(ax, result, dev, st, end)
            if peak < 0.25 * cap:  # too small to see against the capacity: zoom in
                inset = ax.inset_axes((0.45, 0.3, 0.52, 0.45))
                _memory_curve(inset, result, dev, st, end)
                inset.set_ylim(0, peak * 1.15 or 1.0)
                inset.set_title("zoom", fontsize=6, pad=2)
                inset.tick_params(labelsize=5)
        else:
            cap = max(x.memory_gib for x in plan.cluster.devices if x.kind == d.kind)
            peak = 0.0
            title = f"{who}, unused\n0 of {cap:.1f} GiB\n"
        ax.axhline(cap, color="#d62728", linewidth=1.5, linestyle="--")
        ax.text(0.01, cap, f"capacity {cap:.1f} GiB", transform=ax.get_yaxis_transform(), color="#d62728",
                fontsize=7, va="bottom")
        ax.set_ylim(0, max(cap, peak) * 1.15)
        ax.set_xlim(0, end)
        ax.set_title(title, fontsize=7.5)
        ax.set_xlabel("ms", fontsize=7)
        ax.set_ylabel("GiB", fontsize=7)
        ax.tick_params(labelsize=7)
    for j in range(len(panels), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    fig.suptitle("memory per device over the step against its capacity (red); dotted: parameters (P), gradients "
                 "(G) and optimizer state (O); above it activations (A) of the microbatches in flight", fontsize=9)
    return fig


def _memory_curve(ax: Any, result: SimResult, dev: str, stage: int, end: float) -> None:
    curve = list(result.memory.get(dev, ((0.0, 0),)))
    ts = [t for t, _ in curve] + [end]
    gib = [b / GiB for _, b in curve] + [curve[-1][1] / GiB]
    ax.step(ts, gib, where="post", color=_BORDER[stage % len(_BORDER)], linewidth=1.2)
    ax.fill_between(ts, gib, step="post", color=STAGE_COLOURS[stage % len(STAGE_COLOURS)], alpha=0.8)
    ax.axhline(result.stages[stage].memory.static / GiB, color="#555555", linewidth=0.8, linestyle=":")
    ax.set_xlim(0, end)


def write_pictures(plan: Plan, graph: CostGraph, result: SimResult, out_dir: str | Path, *,
                   graph_formats: Sequence[str] = ("svg", "png"), dpi: int = 110) -> list[Path]:
    """Write the plan graph, the timeline and the memory chart into ``out_dir``.

    Args:
        plan: the plan.
        graph: its cost graph (every node within one stage).
        result: the simulation of ``plan`` on ``graph``.
        out_dir: folder to write into (created if missing).
        graph_formats: graphviz output formats for the plan graph (the DOT source is always written).
        dpi: resolution of the PNG charts.

    Returns:
        The paths written.

    Raises:
        graphviz.ExecutableNotFound: if a graph format is asked for and graphviz's ``dot`` is not installed.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dot = plan_graph(plan, graph, result)
    written = [out / "plan_graph.dot"]
    written[0].write_text(dot.source)
    for fmt in graph_formats:
        path = out / f"plan_graph.{fmt}"
        path.write_bytes(dot.pipe(format=fmt))
        written.append(path)
    for name, fig in (("timeline.png", timeline_figure(plan, result)), ("memory.png", memory_figure(plan, result))):
        fig.savefig(out / name, dpi=dpi)
        written.append(out / name)
    return written
