"""``hpml-compile report RUN_DIR``: the measured-against-predicted table of a run folder (and its page, traces).

The parser is declared with ``run``'s (:mod:`hpml_compile.cli.run`); this module reads the folder: one table
for a plain run, one per segment and what happened between them for a run of ``run --adapt``.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

from ..errors import HpmlError
from ..plan import load_plan

__all__ = ["add_report_parser", "run_report", "report_run_dir", "columns_help", "print_timings"]


def add_report_parser(subparsers: Any) -> None:
    """Declare ``report`` under ``subparsers``."""
    r = subparsers.add_parser(
        "report", help="per-stage table of a run against its plan, the bottleneck, what to do",
        description="Summarise a run folder: per stage the forward, backward, communication and idle time, "
                    "bubble and peak memory, measured against the plan's prediction (medians over the steps, "
                    "averaged over a stage's replicas); name the bottleneck and suggest what to change. Writes "
                    "RUN_DIR/profile.json (the measured profile, for replan).",
        epilog=columns_help())
    r.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="the --run-dir of `hpml-compile run` (of `run --adapt`: every segment's table, then what "
                        "happened between them)")
    r.add_argument("--skip", type=int, default=None,
                   help="warm-up steps to leave out (default 2, fewer for runs of under 5 steps)")
    r.add_argument("--no-export", dest="export", action="store_false", help="do not write RUN_DIR/profile.json")
    r.add_argument("--trace", type=Path, default=None, metavar="FILE.json",
                   help="also write the recorded steps as a Chrome trace (one track per rank, an arrow per message; "
                        "open in ui.perfetto.dev or chrome://tracing)")
    r.add_argument("--trace-dir", type=Path, default=None, metavar="DIR",
                   help="also write one trace per rank (DIR/rank<R>.json, with distributedInfo), the layout "
                        "HolisticTraceAnalysis reads: TraceAnalysis(trace_dir=DIR)")
    r.add_argument("--html", type=Path, default=None, metavar="FILE.html",
                   help="also write one self-contained page (no network needed) with the plan, the predicted and "
                        "measured step side by side, step time and loss, utilization, bandwidth, memory and advice")
    r.set_defaults(run=run_report)


def columns_help() -> str:
    """The report table's columns, one a line, for ``report --help``."""
    from ..runtime.observe.summary import COLUMNS

    width = max(len(name) for name, _ in COLUMNS)
    lines = [textwrap.fill(what, 79, initial_indent=f"  {name:{width}s}  ", subsequent_indent=" " * (width + 4),
                           break_on_hyphens=False)
             for name, what in COLUMNS]
    return "columns of the table:\n" + "\n".join(lines) + "\n"



def report_run_dir(run_dir: Path, skip: int | None, *, export: bool) -> None:
    """Print the table of one run folder (and write its measured profile when ``export``)."""
    from ..runtime.observe.summary import analyse, export_profile, format_summary

    s = analyse(run_dir, skip=skip)
    print(format_summary(s))
    _print_validation(run_dir)
    if export:
        path = export_profile(run_dir, s)
        if path is not None:
            print(f"wrote {path} (the plan's profile scaled to the measured stage times; "
                  f"`hpml-compile replan {run_dir / 'plan.json'} --profile {path}` uses it)")
    tb = run_dir / "tb"
    if tb.is_dir():
        print(f"TensorBoard: tensorboard --logdir {tb}")


def _print_validation(run_dir: Path) -> None:
    """The validation losses a TrainSpec run measured (``--val-every``), from rank 0's rows."""
    from ..runtime.observe.monitor import read_metrics

    rows = read_metrics(run_dir).get(0, [])
    vals = [(m.step + 1, m.val_loss, m.loss) for m in rows if m.val_loss is not None]
    if vals:
        print("validation loss (eval mode, after the step; training loss of that step):")
        print("  " + ", ".join(f"step {s}: {v:.4f} ({t:.4f})" for s, v, t in vals))


def run_report(args: argparse.Namespace) -> int:
    """Handle ``hpml-compile report``.

    Raises:
        HpmlError: a folder without measurements or plan.
    """
    if not args.run_dir.is_dir():
        raise HpmlError(f"report: {args.run_dir}: no such folder; pass the --run-dir of `hpml-compile run`")
    segments = sorted(args.run_dir.glob("seg*/plan.json"), key=lambda p: int(p.parent.name[3:]))
    if (args.run_dir / "metrics").is_dir() or not segments:
        report_run_dir(args.run_dir, args.skip, export=args.export)
        last = args.run_dir
    else:
        _report_segments(args.run_dir, [p.parent for p in segments], args.skip, export=args.export)
        last = next((p.parent for p in reversed(segments) if (p.parent / "metrics").is_dir()), args.run_dir)
    if args.trace is not None:
        from ..runtime.observe.timeline import write_trace

        info = write_trace(last, args.trace)
        print(f"wrote {args.trace}: {info['ranks']} ranks, {info['messages']} messages of {last} "
              "(open in ui.perfetto.dev or chrome://tracing)")
    if args.trace_dir is not None:
        from ..runtime.observe.timeline import write_rank_traces

        files = write_rank_traces(last, args.trace_dir)
        print(f"wrote {len(files)} per-rank traces of {last} into {args.trace_dir} "
              f"(HolisticTraceAnalysis: TraceAnalysis(trace_dir='{args.trace_dir}'))")
    if args.html is not None:
        from ..runtime.observe.page import write_page

        write_page(last, args.html, predicted=_predicted(last), skip=args.skip)
        print(f"wrote {args.html} (the page of {last}; open it in a browser)")
    return 0


def _predicted(run_dir: Path) -> tuple[Any, Any] | None:
    """The run's plan's cost graph and simulation, from the profile copied beside it (None without one)."""
    from ..explain import plan_costgraph
    from ..profile import load_profile, predict_kinds
    from ..simulate import simulate

    if not (run_dir / "plan_profile.json").is_file():
        return None
    plan = load_plan(run_dir / "plan.json")
    profile = load_profile(run_dir / "plan_profile.json")
    missing = sorted({d.kind for d in plan.cluster.devices} - set(profile.device_kinds))
    if missing:
        profile = predict_kinds(profile, missing)
    graph = plan_costgraph(plan, profile)
    return graph, simulate(plan, graph, profile.dtype)


def _report_segments(run_dir: Path, segments: list[Path], skip: int | None, *, export: bool) -> None:
    """A run of `run --adapt`: each segment's table, then what happened between them."""
    from ..runtime.observe.runfolder import RunFolder

    run = RunFolder(run_dir)
    events = {e["segment"]: e for e in run.read_events() if e["event"] == "segment"}
    for seg in segments:
        k = int(seg.name[3:])
        why = events.get(k, {}).get("reason", "?")
        print(f"== segment {k} ({why}): {seg}")
        if not (seg / "metrics").is_dir():
            print("  no step finished")
            continue
        report_run_dir(seg, skip, export=export)
    if run.events.is_file():
        print_timings(run_dir)


def print_timings(run_dir: Path) -> None:
    from ..runtime.job.supervisor import timings

    for t in timings(run_dir):
        if t.get("in_place") and "switch_s" not in t:  # a replica lost, the others on in their processes
            again = f"{t['resume_s']:.2f} s" if t.get("resume_s") is not None else "-"
            print(f"  {t['kind']} at step {t['step']} (segment {t['segment']}): no step lost, the failed step "
                  f"done again after {again}")
            continue
        if t.get("in_place"):  # no restart: the measured switch is milliseconds
            rows = " | ".join(":".join(map(str, r)) or "even" for r in t.get("rows") or [])
            print(f"  {t['kind']} at step {t['step']} (segment {t['segment']}, rows {rows}): chosen in "
                  f"{t['replan_s']:.2f} s, switched in {t['switch_s'] * 1e3:.1f} ms (measured)")
            continue
        resume = f"{t['resume_s']:.1f} s" if t.get("resume_s") is not None else "-"
        print(f"  {t['kind']}: re-plan {t['replan_s']:.2f} s, back to training after {resume}")
