"""A run's recorded events as a Chrome trace: one track per rank, an arrow from each send to its receive.

:func:`chrome_trace` turns what the ranks recorded (:mod:`.events`) into the
Trace Event Format that chrome://tracing, Perfetto (ui.perfetto.dev and its
trace processor) and the PyTorch profiler's traces share: a JSON object
whose ``traceEvents`` hold

- per rank a process (``pid`` = rank) named ``rank R: stage K on DEVICE``
  with one thread (its track);
- per recorded step and rank a ``step N`` slice, and inside it a complete
  (``"ph": "X"``) slice per event: ``F3`` (forward of microbatch 3),
  ``B3``, ``SEND->1 mb3``, ``RECV<-0 mb3``, ``WAIT sends``, ``SYNC``,
  ``COLL_WAIT``, ``ALLREDUCE``, ``LOSS``, ``OPT``; ``args`` carry the
  stage, microbatch, peer, bytes and message tag;
- per message a flow (``"ph": "s"`` inside the send, ``"ph": "f"`` with
  ``"bp": "e"`` inside the matching receive: the same step, sender, receiver
  and tag), drawn as an arrow between the two tracks.

Times are microseconds from the first recorded step's start on rank 0's
clock (the ranks' clocks were aligned at start-up). Only the steps the ranks
kept are there (:class:`~.events.EventStore`: the first ones, a sample, the
last ones).

Example:
    >>> from hpml_compile.runtime.events import StepEvents
    >>> ev = {0: {5: StepEvents(5, 0, 10.0, (("F", 0, 900, 0, 0, -1, 0, -1), ("SEND", 800, 50, 0, 0, 1, 64, 7)))},
    ...       1: {5: StepEvents(5, 1, 10.0, (("RECV", 100, 900, 1, 0, 0, 64, 7), ("F", 1000, 500, 1, 0, -1, 0, -1)))}}
    >>> t = chrome_trace(ev)
    >>> sorted({e["ph"] for e in t["traceEvents"]})
    ['M', 'X', 'f', 's']
    >>> [e["name"] for e in t["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    ['step 5', 'RECV<-0 mb0', 'F0']
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from ..errors import OutputError
from .events import StepEvents, read_events
from ..plan import load_plan
from .monitor import read_metrics

__all__ = ["chrome_trace", "write_trace", "write_rank_traces", "event_name", "rank_labels", "GENERATOR"]

GENERATOR = "hpml-compile"


def event_name(e: Mapping[str, Any]) -> str:
    """A short label: ``F3``, ``B3``, ``SEND->1 mb3``, ``RECV<-0 mb3``, ``WAIT sends``, or the kind."""
    kind, mb, peer = e["kind"], e["microbatch"], e["peer"]
    if kind in ("F", "B"):
        return f"{kind}{mb}"
    if kind == "SEND":
        return f"SEND->{peer} mb{mb}"
    if kind == "RECV":
        return f"RECV<-{peer} mb{mb}"
    if kind == "WAIT":
        return "WAIT sends"
    return kind


def rank_labels(run_dir: str | Path) -> dict[int, str]:
    """``rank R: stage K on DEVICE`` per rank, from the run's plan (device names) or its rows (torch devices)."""
    run = Path(run_dir)
    if (run / "plan.json").is_file():
        plan = load_plan(run / "plan.json")
        pairs = [(st.index, d) for st in plan.stages for d in st.devices]
        return {r: f"rank {r}: stage {k} on {d}" for r, (k, d) in enumerate(pairs)}
    return {r: f"rank {r}: stage {rs[0].stage} on {rs[0].device}" for r, rs in read_metrics(run).items() if rs}


def chrome_trace(events: Mapping[int, Mapping[int, StepEvents]],
                 labels: Mapping[int, str] | None = None) -> dict[str, Any]:
    """The Trace Event Format object of recorded steps (see the module docstring).

    Args:
        events: rank -> step -> its events (:func:`~.events.read_events`).
        labels: rank -> the name of its track (:func:`rank_labels`; default ``rank R``).

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.
    """
    labels = labels or {}
    starts = [s.t0 for steps in events.values() for s in steps.values()]
    origin = min(starts) if starts else 0.0
    out: list[dict[str, Any]] = []
    sends: dict[tuple[int, int, int, int], dict[str, Any]] = {}
    recvs: dict[tuple[int, int, int, int], dict[str, Any]] = {}
    for rank in sorted(events):
        name = labels.get(rank, f"rank {rank}")
        out += [{"ph": "M", "name": "process_name", "pid": rank, "tid": rank, "args": {"name": name}},
                {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": rank, "args": {"sort_index": rank}},
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": rank, "args": {"name": f"rank {rank}"}}]
        for step in sorted(events[rank]):
            s = events[rank][step]
            spans = list(s.spans())
            base = (s.t0 - origin) * 1e6
            end = max((e["start_us"] + e["dur_us"] for e in spans), default=0)
            out.append({"ph": "X", "name": f"step {step}", "cat": "step", "pid": rank, "tid": rank,
                        "ts": round(base, 3), "dur": end, "args": {"step": step}})
            for e in spans:
                x = {"ph": "X", "name": event_name(e), "cat": e["kind"], "pid": rank, "tid": rank,
                     "ts": round(base + e["start_us"], 3), "dur": e["dur_us"],
                     "args": {k: e[k] for k in ("stage", "microbatch", "peer", "bytes", "tag") if e[k] != -1}}
                out.append(x)
                if e["kind"] == "SEND":
                    sends[(step, rank, e["peer"], e["tag"])] = x
                elif e["kind"] == "RECV":
                    recvs[(step, e["peer"], rank, e["tag"])] = x
    flow = 0
    for key in sorted(sends.keys() & recvs.keys()):
        s, r = sends[key], recvs[key]
        flow += 1
        common = {"name": "message", "cat": "p2p", "id": flow}
        out.append({**common, "ph": "s", "pid": s["pid"], "tid": s["tid"], "ts": s["ts"] + s["dur"] / 2})
        out.append({**common, "ph": "f", "bp": "e", "pid": r["pid"], "tid": r["tid"], "ts": r["ts"] + r["dur"] / 2})
    unmatched = len(sends) + len(recvs) - 2 * flow
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"generator": GENERATOR, "ranks": len(events), "messages": flow, "unmatched": unmatched}}


def _ours(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("otherData", {}).get("generator") == GENERATOR
    except (OSError, ValueError, AttributeError):
        return False


def write_trace(run_dir: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the run's Chrome trace to ``out`` (atomically; an existing file is replaced only if this tool wrote it).

    Args:
        run_dir: a run folder (or a segment of one) whose ranks recorded events.
        out: the ``.json`` file to write.

    Returns:
        The trace's ``otherData`` (ranks, messages, unmatched).

    Raises:
        OutputError: ``out`` exists and is not a trace this tool wrote, or the run recorded no events.
    """
    out = Path(out)
    if out.exists() and not _ours(out):
        raise OutputError(f"{out} exists and is not a trace hpml-compile wrote; name another file for --trace")
    events = read_events(run_dir)
    if not events:
        raise OutputError(f"{run_dir}: no recorded events (metrics/events_rank*.jsonl); the run was made before "
                          "events were recorded, or with them off")
    trace = chrome_trace(events, rank_labels(run_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(trace, separators=(",", ":")))
    os.replace(tmp, out)
    return trace["otherData"]


def write_rank_traces(run_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """One trace per rank in ``out_dir``, the layout HolisticTraceAnalysis (HTA) reads: ``rank<R>.json``.

    Each file holds that rank's track of :func:`chrome_trace` (the same clock: the ranks' clocks were aligned at
    start-up), its step slices named ``ProfilerStep#N`` as the PyTorch profiler names them, and
    ``distributedInfo`` (rank, world size, backend), which is how HTA tells the ranks apart:
    ``hta.trace_analysis.TraceAnalysis(trace_dir=out_dir)``. HTA takes each ``ProfilerStep`` as an iteration
    and leaves out the last one it finds. Each file is written atomically.

    Args:
        run_dir: a run folder (or a segment of one) whose ranks recorded events.
        out_dir: the folder to write into: new, empty, or holding only traces this tool wrote.

    Returns:
        The files written, by rank.

    Raises:
        OutputError: ``out_dir`` holds files this tool did not write, or the run recorded no events.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} is a file; --trace-dir names a folder for one trace per rank")
    foreign = [p.name for p in out.iterdir() if not (p.suffix == ".json" and _ours(p))] if out.is_dir() else []
    if foreign:
        raise OutputError(f"{out} holds files hpml-compile did not write ({', '.join(sorted(foreign)[:3])}); "
                          "name a new or empty folder for --trace-dir")
    events = read_events(run_dir)
    if not events:
        raise OutputError(f"{run_dir}: no recorded events (metrics/events_rank*.jsonl); the run was made with them off")
    merged = chrome_trace(events, rank_labels(run_dir))["traceEvents"]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    on_gpu = any(m.device.startswith("cuda") for rows in read_metrics(run_dir).values() for m in rows[:1])
    backend = "nccl" if on_gpu else "gloo"
    for rank in sorted(events):
        mine = [dict(e, name=f"ProfilerStep#{e['args']['step']}") if e.get("cat") == "step" else e
                for e in merged if e.get("pid") == rank and e["ph"] in ("M", "X")]
        doc = {"distributedInfo": {"rank": rank, "world_size": len(events), "backend": backend},
               "schemaVersion": 1, "deviceProperties": [], "traceEvents": mine, "displayTimeUnit": "ms",
               "otherData": {"generator": GENERATOR}}
        path = out / f"rank{rank}.json"
        tmp = out / f".{path.name}.tmp"
        tmp.write_text(json.dumps(doc))  # HTA finds the rank as '"rank": N' (a space after the colon), first
        os.replace(tmp, path)
        written.append(path)
    return written
