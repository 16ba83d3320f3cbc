"""One self-contained HTML page of a run: what was planned beside what happened.

:func:`write_page` reads a run folder (every rank's per-step rows, the
recorded events, the plan, decisions of the closed loop) and writes one HTML
file with the charts drawn by plotly (its JavaScript inlined once, so the
page opens without a network), in sections:

- ``summary``: the measured-against-predicted table, the bottleneck and the
  advice (:func:`~.summary.analyse`, the same as ``hpml-compile report``);
- ``plan``: the plan picture (:func:`hpml_compile.viz.plan_graph`, as SVG)
  where the caller passes the plan's cost graph and simulation and graphviz
  is installed;
- ``gantt``: the simulator's timeline of a step and the measured one of the
  last recorded step, one row per device/rank, on the same time axis;
- ``steps``: step time (slowest rank) and loss over the run, the predicted
  step as a line, re-plans, retried steps and restarts marked;
- ``utilization``: each rank's CPU use (its process's CPU time over the
  step: 1.0 is one core busy), a GPU rank's device utilization (NVML, with
  its power and memory in use on hover), and the host's steal and other
  processes' load;
- ``bandwidth``: achieved bandwidth of each link (messages: bytes over the
  receive's duration, the median and the best; collectives: the ring's bus
  bandwidth) against the link's figure in the cluster;
- ``memory``: each rank's peak memory per step (RSS on CPU ranks, the CUDA
  allocator on GPUs) against the simulator's peak for its device, and any
  other per-kind byte counts the rows carry; then each device at its peak
  split into parameters, gradients, optimizer state and activations, with
  what the process holds beyond its tensors (resident set on a CPU, reserved
  but unallocated bytes on a GPU), beside the memory model's split.

Why plotly: interactive charts (zoom, hover) in a page a person opens
anywhere, from Python figures, with no JavaScript of ours.
"""

from __future__ import annotations

import html
import json
import os
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from ...cluster import link_between
from ...errors import HpmlError, OutputError
from ...plan import Plan, load_plan
from .events import StepEvents, read_events
from .monitor import StepMetrics, read_metrics
from .runfolder import RunFolder
from .summary import RunSummary, analyse, format_summary

__all__ = ["write_page", "page_html", "SECTIONS", "GENERATOR_META"]

SECTIONS = ("summary", "plan", "gantt", "steps", "utilization", "bandwidth", "memory")
GENERATOR_META = '<meta name="generator" content="hpml-compile report --html">'
_COLOURS = {"F": "#4c78a8", "fwd": "#4c78a8", "B": "#f58518", "bwd": "#f58518", "recompute": "#e45756",
            "SEND": "#54a24b", "send": "#54a24b", "RECV": "#b3b3b3", "WAIT": "#d9d9d9", "swap": "#9d755d",
            "SYNC": "#b279a2", "sync": "#b279a2", "ALLREDUCE": "#b279a2", "REDUCESCATTER": "#b279a2",
            "ALLGATHER": "#ff9da6", "OPT": "#72b7b2", "optim": "#72b7b2", "LOSS": "#eeca3b"}
_MEASURED_KINDS = ("F", "B", "RECV", "SEND", "WAIT", "ALLREDUCE", "REDUCESCATTER", "ALLGATHER", "OPT")
_LAYER = {"RECV": 1, "SEND": 2, "WAIT": 1, "ALLREDUCE": 1, "REDUCESCATTER": 1, "ALLGATHER": 1}
_OWN_BYTES = {"peak_memory_bytes", "bytes_sent", "bytes_received", "reserved_bytes", "held_params_bytes",
              "held_grads_bytes", "held_optimizer_bytes", "gpu_memory_bytes"}  # drawn elsewhere


def _div(fig: go.Figure) -> str:
    fig.update_layout(margin={"l": 60, "r": 20, "t": 40, "b": 40}, template="plotly_white")
    return pio.to_html(fig, full_html=False, include_plotlyjs=False, config={"displaylogo": False})


def _plan_svg(plan: Plan, predicted: tuple[Any, Any] | None) -> str:
    if predicted is None:
        return "<p>No plan picture: the plan's profile was not found beside the run.</p>"
    from ...viz import plan_graph  # graphviz: only when a picture is asked for

    try:
        svg = plan_graph(plan, predicted[0], predicted[1]).pipe(format="svg").decode()
    except Exception as e:  # noqa: BLE001 -- graphviz's `dot` missing: the page goes on without the picture
        return f"<p>No plan picture: graphviz could not draw it ({html.escape(type(e).__name__)}); install graphviz.</p>"
    return svg[svg.find("<svg"):]


def _gantt(plan: Plan, predicted: tuple[Any, Any] | None, events: Mapping[int, Mapping[int, StepEvents]]) -> str:
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("predicted (simulator), one step", "measured"))
    seen: set[str] = set()

    def bar(row: int, y: str, kind: str, start: float, end: float, text: str) -> None:
        fig.add_trace(go.Bar(x=[max(end - start, 1e-3)], base=[start], y=[y], orientation="h", name=kind,
                             legendgroup=kind, showlegend=kind not in seen, hovertext=text,
                             marker_color=_COLOURS.get(kind, "#888888")), row=row, col=1)
        seen.add(kind)

    if predicted is not None:
        for iv in predicted[1].intervals:
            kind = iv.kind.value
            mb = f" mb{iv.microbatch}" if iv.microbatch >= 0 else ""
            bar(1, iv.device, kind, iv.start_ms, iv.end_ms, f"{kind}{mb} {iv.end_ms - iv.start_ms:.1f} ms")
    common = sorted(set.intersection(*(set(s) for s in events.values()))) if events else []
    devices = [d for st in plan.stages for d in st.devices]
    if common:
        step = common[-1]
        t0 = min(events[r][step].t0 for r in events)
        for rank in sorted(events):
            y = f"rank {rank} ({devices[rank]})" if rank < len(devices) else f"rank {rank}"
            # a forward or backward holds the receives it waited in: those are drawn over it
            for e in sorted(events[rank][step].spans(), key=lambda e: _LAYER.get(e["kind"], 0)):
                if e["kind"] in _MEASURED_KINDS:
                    a, b = (e["start"] - t0) * 1e3, (e["end"] - t0) * 1e3
                    bar(2, y, e["kind"], a, b, f"{e['kind']} mb{e['microbatch']} {b - a:.1f} ms")
        fig.layout.annotations[1].text = f"measured, step {step + 1} (ranks' clocks aligned at start-up)"
    fig.update_layout(barmode="overlay", height=260 + 40 * len(devices) * 2, xaxis2_title="ms from step start")
    fig.update_yaxes(autorange="reversed")
    return _div(fig)


def _marks(run_dir: Path, rows: Mapping[int, Sequence[StepMetrics]]) -> list[tuple[int, str]]:
    """(step from 1, what) of re-plans, retried steps and restarts."""
    out: list[tuple[int, str]] = []
    for folder in (run_dir, run_dir.parent):
        for path in (RunFolder(folder).replans, RunFolder(folder).events):
            if not path.is_file():
                continue
            for line in path.read_text().splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if isinstance(e, dict) and isinstance(e.get("step"), int):
                    what = e.get("event") or e.get("trigger") or "re-plan"
                    out.append((e["step"], f"{what}{' (switch)' if e.get('switch') else ''}"))
    retried = {m.step + 1 for rs in rows.values() for m in rs if m.retries}
    out += [(s, "step retried") for s in sorted(retried)]
    return out


def _steps(s: RunSummary, rows: Mapping[int, Sequence[StepMetrics]], marks: list[tuple[int, str]]) -> str:
    steps = sorted({m.step for rs in rows.values() for m in rs})
    by = {(m.rank, m.step): m for rs in rows.values() for m in rs}
    step_ms = [max(by[(r, st)].step_ms for r in rows if (r, st) in by) for st in steps]
    loss = [next((by[(r, st)].loss for r in rows if (r, st) in by and by[(r, st)].loss is not None), None)
            for st in steps]
    x = [st + 1 for st in steps]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=x, y=step_ms, name="step ms (slowest rank)", mode="lines+markers"))
    if s.predicted_step_ms > 0:
        fig.add_trace(go.Scatter(x=[x[0], x[-1]], y=[s.predicted_step_ms] * 2, name="predicted step ms",
                                 mode="lines", line={"dash": "dash"}))
    fig.add_trace(go.Scatter(x=x, y=loss, name="loss", mode="lines"), secondary_y=True)
    for step, what in marks:
        fig.add_vline(x=step, line_dash="dot", line_color="#e45756", annotation_text=what)
    fig.update_layout(height=360, xaxis_title="step")
    fig.update_yaxes(title_text="ms", secondary_y=False)
    fig.update_yaxes(title_text="loss", secondary_y=True)
    return _div(fig)


def _utilization(rows: Mapping[int, Sequence[StepMetrics]], devices: Sequence[str]) -> str:
    fig = go.Figure()
    for rank, rs in sorted(rows.items()):
        name = devices[rank] if rank < len(devices) else f"rank {rank}"
        fig.add_trace(go.Scatter(x=[m.step + 1 for m in rs], y=[m.cpu_util for m in rs], mode="lines+markers",
                                 name=f"rank {rank} ({name}) CPU, cores"))
        gpu = [m for m in rs if m.gpu_util is not None]
        if gpu:  # a GPU rank: its device's NVML utilization, power and memory on hover
            fig.add_trace(go.Scatter(
                x=[m.step + 1 for m in gpu], y=[m.gpu_util for m in gpu], mode="lines+markers",
                name=f"rank {rank} ({name}) GPU utilization",
                hovertext=[f"{m.gpu_power_w or 0:.0f} W, {(m.gpu_memory_bytes or 0) / 2**30:.2f} GiB in use"
                           for m in gpu]))
    hosts: dict[str, dict[int, tuple[float, float]]] = {}
    for rs in rows.values():
        for m in rs:
            old = hosts.setdefault(m.host, {}).get(m.step, (0.0, 0.0))
            hosts[m.host][m.step] = (max(old[0], m.steal), max(old[1], m.others_load))
    for host, per in sorted(hosts.items()):
        xs = sorted(per)
        fig.add_trace(go.Scatter(x=[s + 1 for s in xs], y=[per[s][0] for s in xs], line={"dash": "dot"},
                                 name=f"{host or 'host'}: steal (share of the host)"))
        fig.add_trace(go.Scatter(x=[s + 1 for s in xs], y=[per[s][1] for s in xs], line={"dash": "dash"},
                                 name=f"{host or 'host'}: other processes (share of the host)"))
    fig.update_layout(height=340, xaxis_title="step", yaxis_title="cores / share")
    return _div(fig)


def _bandwidth(plan: Plan, events: Mapping[int, Mapping[int, StepEvents]]) -> str:
    devices = [d for st in plan.stages for d in st.devices]
    per: dict[str, list[float]] = {}
    figure: dict[str, float] = {}
    for rank, steps in events.items():
        for s in steps.values():
            for e in s.spans():
                dur = e["end"] - e["start"]
                if dur <= 0 or e["bytes"] <= 0:
                    continue
                if e["kind"] == "RECV" and 0 <= e["peer"] < len(devices) and rank < len(devices):
                    key = f"{devices[e['peer']]} -> {devices[rank]}"
                    per.setdefault(key, []).append(e["bytes"] / dur / 1e9)
                    figure[key] = link_between(plan.cluster, devices[e["peer"]], devices[rank])[0]
                elif e["kind"] in ("ALLREDUCE", "REDUCESCATTER", "ALLGATHER") and e["peer"] > 1:
                    n = e["peer"]
                    bus = (2 if e["kind"] == "ALLREDUCE" else 1) * (n - 1) / n * e["bytes"] / dur / 1e9
                    key = f"{e['kind'].lower()} over {n} ranks (rank {rank})"
                    per.setdefault(key, []).append(bus)
    if not per:
        return "<p>No messages or collectives were recorded.</p>"
    keys = sorted(per)
    fig = go.Figure()
    fig.add_trace(go.Bar(x=keys, y=[statistics.median(per[k]) for k in keys], name="achieved, median"))
    fig.add_trace(go.Bar(x=keys, y=[max(per[k]) for k in keys], name="achieved, best"))
    fig.add_trace(go.Bar(x=keys, y=[figure.get(k, 0.0) for k in keys], name="the link's figure (cluster)"))
    fig.update_layout(barmode="group", height=360, yaxis_title="GB/s", yaxis_type="log")
    return (_div(fig) + "<p>A message's bandwidth is its bytes over its receive's duration, which includes "
            "waiting for the sender: the best one is closest to the link's speed.</p>")


def _memory(rows: Mapping[int, Sequence[StepMetrics]], devices: Sequence[str], predicted: tuple[Any, Any] | None,
            predicted_parts: Mapping[str, Any]) -> str:
    fig = go.Figure()
    extra = sorted({k for rs in rows.values() for m in rs[:1] for k, v in m.to_dict().items()
                    if k.endswith("_bytes") and k not in _OWN_BYTES and isinstance(v, (int, float))})
    for rank, rs in sorted(rows.items()):
        name = devices[rank] if rank < len(devices) else f"rank {rank}"
        kind = rs[0].memory_kind if rs else "rss"
        x = [m.step + 1 for m in rs]
        fig.add_trace(go.Scatter(x=x, y=[m.peak_memory_bytes / 2**20 for m in rs], mode="lines+markers",
                                 name=f"rank {rank} ({name}) peak {'RSS' if kind == 'rss' else kind}"))
        for k in extra:
            fig.add_trace(go.Scatter(x=x, y=[m.to_dict()[k] / 2**20 for m in rs], mode="lines",
                                     name=f"rank {rank} {k.removesuffix('_bytes')}"))
        if predicted is not None and name in predicted[1].peak:
            fig.add_trace(go.Scatter(x=[x[0], x[-1]], y=[predicted[1].peak[name] / 2**20] * 2, mode="lines",
                                     line={"dash": "dash"}, name=f"{name} predicted peak (tensors)"))
    fig.update_layout(height=360, xaxis_title="step", yaxis_title="MiB")
    note = ("<p>CPU ranks: the process's peak resident set (the interpreter, libraries and allocator caches "
            "beyond the tensors the simulator counts); GPU ranks: the CUDA allocator's peak.</p>")
    return _div(fig) + note + _memory_parts(rows, devices, predicted_parts)


_PARTS = (("parameters", "held_params_bytes", "params"), ("gradients", "held_grads_bytes", "grads"),
          ("optimizer state", "held_optimizer_bytes", "optimizer"),
          ("activations", "held_activation_bytes", "activations"))


def _memory_parts(rows: Mapping[int, Sequence[StepMetrics]], devices: Sequence[str],
                  predicted: Mapping[str, Any]) -> str:
    """Each device at its peak step, split by what holds the bytes, measured beside predicted.

    Measured: the step whose tensors held the most (runtime.observe.held, counted by storage), and above the tensors
    the process's resident set (CPU) or the allocator's reserved bytes (CUDA: fragmentation and cache).
    Predicted: the memory model's parts for the device (:func:`hpml_compile.plan.stage_breakdown`).
    """
    ranks = [(r, rs) for r, rs in sorted(rows.items()) if rs and any(m.held_params_bytes for m in rs)]
    if not ranks:
        return "<p>No split by part: the run was recorded before the rows carried it.</p>"
    x: list[str] = []
    parts: dict[str, list[float]] = {name: [] for name, _, _ in _PARTS}
    beyond: list[float] = []
    for rank, rs in ranks:
        name = devices[rank] if rank < len(devices) else f"rank {rank}"
        m = max(rs, key=lambda m: m.held_bytes)
        tensors = m.held_bytes
        over = (m.reserved_bytes if m.memory_kind == "cuda" else m.peak_memory_bytes) - tensors
        x.append(f"{name} measured")
        for label, field_name, _ in _PARTS:
            parts[label].append(getattr(m, field_name) / 2**20)
        beyond.append(max(0, over) / 2**20)
        if name in predicted:
            x.append(f"{name} predicted")
            for label, _, attr in _PARTS:
                parts[label].append(getattr(predicted[name], attr) / 2**20)
            beyond.append(0.0)
    fig = go.Figure()
    for label, _, _ in _PARTS:
        fig.add_trace(go.Bar(x=x, y=parts[label], name=label))
    fig.add_trace(go.Bar(x=x, y=beyond, name="beyond the tensors (CPU: resident set; GPU: reserved, unallocated)",
                         marker_color="#cccccc"))
    fig.update_layout(barmode="stack", height=380, yaxis_title="MiB")
    return ("<h3>At the peak, by part</h3>" + _div(fig) +
            "<p>Measured: the step whose tensors held the most, counted by storage (each storage once). Beyond the "
            "tensors: on a CPU rank the process's peak resident set above them (interpreter, libraries, allocator "
            "caches); on a GPU rank the CUDA allocator's reserved bytes above them (fragmentation and cache). "
            "Predicted: the memory model's parts for the device.</p>")


def _predicted_parts(run: Path, plan: Plan) -> dict[str, Any]:
    """Device -> the memory model's breakdown, from the profile the plan was made for (empty without it)."""
    src = run / "plan_profile.json"
    if not src.is_file():
        return {}
    from ...plan import stage_breakdown
    from ...profile import load_profile

    try:
        prof = load_profile(src)
        return {d: b for st in plan.stages for b in [stage_breakdown(plan, prof, st)] for d in st.devices}
    except HpmlError:
        return {}  # a profile that does not describe this plan: the chart shows the measured side only


def page_html(run_dir: str | Path, *, predicted: tuple[Any, Any] | None = None, skip: int | None = None) -> str:
    """The page of a run folder (see the module docstring).

    Args:
        run_dir: the run folder (or one segment of a ``run --adapt`` folder).
        predicted: ``(cost graph, simulation)`` of the run's plan (:func:`hpml_compile.explain.plan_costgraph`
            and :func:`hpml_compile.simulate.simulate`), for the plan picture, the predicted Gantt and memory.
        skip: warm-up steps the summary leaves out.

    Raises:
        HpmlError: the folder has no measurements or no plan.
    """
    run = Path(run_dir)
    s = analyse(run, skip=skip)
    plan = load_plan(run / "plan.json")
    rows = read_metrics(run)
    events = read_events(run)
    devices = [d for st in plan.stages for d in st.devices]
    advice = "".join(f"<li>{html.escape(a)}</li>" for a in s.advice)
    b = s.stages[s.bottleneck]
    body = {
        "summary": (f"<p><b>Bottleneck:</b> stage {b.stage} on {html.escape(', '.join(b.devices))}, "
                    f"{b.compute_ms:.1f} ms of compute per step.</p><ul class='advice'>{advice}</ul>"
                    f"<pre>{html.escape(format_summary(s))}</pre>"),
        "plan": _plan_svg(plan, predicted),
        "gantt": _gantt(plan, predicted, events) if events or predicted else "<p>No events were recorded.</p>",
        "steps": _steps(s, rows, _marks(run, rows)),
        "utilization": _utilization(rows, devices),
        "bandwidth": _bandwidth(plan, events),
        "memory": _memory(rows, devices, predicted, _predicted_parts(run, plan)),
    }
    titles = {"summary": "Bottleneck and advice", "plan": "The plan", "gantt": "Predicted and measured step",
              "steps": "Step time and loss over the run", "utilization": "CPU utilization per rank, host load",
              "bandwidth": "Bandwidth per link", "memory": "Memory per device"}
    sections = "\n".join(f'<section id="{k}"><h2>{titles[k]}</h2>\n{body[k]}\n</section>' for k in SECTIONS)
    title = f"{plan.model}: {len(plan.stages)} stages on {len(devices)} devices, {s.steps} steps"
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>{GENERATOR_META}"
            f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;margin:1.5em;max-width:1200px}}"
            "pre{background:#f6f6f6;padding:.8em;overflow-x:auto}section{margin-bottom:2em}"
            "svg{max-width:100%;height:auto}</style>"
            f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
            f"<h1>{html.escape(title)}</h1><p>Run folder: <code>{html.escape(str(run))}</code></p>\n"
            f"{sections}\n</body></html>\n")


def write_page(run_dir: str | Path, out: str | Path, *, predicted: tuple[Any, Any] | None = None,
               skip: int | None = None) -> Path:
    """Write the page of ``run_dir`` to ``out`` (atomically; an existing file only if this tool wrote it).

    Raises:
        OutputError: ``out`` exists and is not a page this tool wrote.
        HpmlError: the folder has no measurements or no plan.
    """
    out = Path(out)
    if out.exists():
        try:
            ours = GENERATOR_META in out.read_text(errors="replace")[:4096]
        except OSError:
            ours = False
        if not ours:
            raise OutputError(f"{out} exists and is not a page hpml-compile wrote; name another file for --html")
    text = page_html(run_dir, predicted=predicted, skip=skip)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    return out
