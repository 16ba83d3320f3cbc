"""``hpml-compile run`` (train a build on torchrun ranks) and ``hpml-compile report`` (read a run folder).

``run BUILD`` checks that the world fits the build's plan, prepares the run
folder (``run.json``, the plan, the plan's profile), starts the ranks with
torchrun (:mod:`hpml_compile.runtime.launcher`), and when they finish prints
the measured-against-predicted table and writes the measured profile
(``RUN_DIR/profile.json``, for ``replan``). ``report RUN_DIR`` prints the
same table for any run folder.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(prog="hpml-compile")
    >>> add_parsers(p.add_subparsers(dest="command"))
    >>> a = p.parse_args(["run", "build", "--steps", "5", "--nproc", "2"])
    >>> a.run is run_run, a.steps, a.nproc, a.nnodes, a.node_rank
    (True, 5, 2, 1, None)
    >>> p.parse_args(["report", "out/run"]).run is run_report
    True
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

from ..errors import HpmlError
from ..plan import load_plan
from ..runtime.adapt import AdaptOptions
from ..runtime.comm import CommOp

__all__ = ["add_parsers", "run_run", "run_report", "default_run_dir"]


def add_parsers(subparsers: Any) -> None:
    """Register ``run`` and ``report`` on an argparse sub-parser set.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    p = subparsers.add_parser(
        "run", help="train a build on torchrun ranks, measuring every stage (writes a run folder)",
        description="Start one rank per device of the build's plan with torchrun (standalone on one host; "
                    "torchrun's rendezvous across hosts), each loading its stage from BUILD, and train on the "
                    "model's example batch. Every step of every rank is measured (JSON lines and TensorBoard "
                    "events in the run folder); at the end the measured-vs-predicted table is printed and the "
                    "measured profile written for `replan`.")
    p.add_argument("build", type=Path, help="the build folder written by `hpml-compile compile`")
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--nproc", type=int, default=None, help="ranks on this host (default: the plan's devices / nnodes)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts taking part (default 1)")
    p.add_argument("--node-rank", type=int, default=None, dest="node_rank",
                   help="this host's rank 0..nnodes-1 (static rendezvous: node 0 runs the first stages)")
    p.add_argument("--rdzv-endpoint", default=None, dest="rdzv_endpoint", metavar="HOST:PORT",
                   help="rendezvous endpoint shared by the hosts (node 0 listens there)")
    p.add_argument("--rdzv-id", default="hpml-compile", dest="rdzv_id", help="job id across hosts (c10d rendezvous)")
    p.add_argument("--run-dir", type=Path, default=None, dest="run_dir",
                   help="where measurements go (default out/runs/<build>-<time>)")
    p.add_argument("--max-restarts", type=int, default=0, dest="max_restarts",
                   help="let torchrun restart the ranks this often after a failure (default 0)")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--log-every", type=int, default=1, dest="log_every", help="print every N steps (default 1)")
    p.add_argument("--retries", type=int, default=3,
                   help="attempts per step when communication fails transiently (default 3)")
    p.add_argument("--inject-fault", action="append", default=[], dest="inject_fault", metavar="STEP:RANK:OP",
                   help=f"fail the first {'|'.join(o.value for o in CommOp)} of rank RANK in step STEP (from 1) once, "
                        "to see the retry work; repeatable")
    p.add_argument("--kill-at", action="append", default=[], dest="kill_at", metavar="STEP:RANK",
                   help="fault injection: rank RANK dies abruptly when it reaches step STEP (from 1); repeatable")
    p.add_argument("--hang-at", action="append", default=[], dest="hang_at", metavar="STEP:RANK",
                   help="fault injection: rank RANK stops responding at step STEP (its peers fail after --timeout); "
                        "with --adapt, every time its device gets there")
    p.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR:FROM_STEP",
                   help="fault injection: rank RANK computes FACTOR times slower from step FROM_STEP (from 1) on")
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_false")
    p.add_argument("--no-report", dest="report", action="store_false", help="skip the table at the end")
    c = p.add_argument_group("checkpoints")
    c.add_argument("--checkpoint-dir", type=Path, default=None, dest="checkpoint_dir",
                   help="where checkpoints go (default: none; RUN_DIR/checkpoints with --adapt)")
    c.add_argument("--checkpoint-every", type=int, default=None, dest="checkpoint_every", metavar="K",
                   help="checkpoint every K steps, and at the end (default 5 with --adapt, else only at the end)")
    c.add_argument("--keep-checkpoints", type=int, default=3, dest="keep", metavar="N",
                   help="complete checkpoints kept (default 3)")
    c.add_argument("--resume", action="store_true",
                   help="start from the latest checkpoint in --checkpoint-dir (any plan's: regrouped by name)")
    a = p.add_argument_group("closed loop (--adapt)")
    a.add_argument("--adapt", action="store_true",
                   help="re-plan while training: on a sustained gap to the plan (switching when the predicted gain "
                        "pays for a restart) and on a failed rank (resume from the last checkpoint; a dead "
                        "rank's device is dropped); one host. Segments go to RUN_DIR/seg<k>, decisions to "
                        "RUN_DIR/events.jsonl")
    a.add_argument("--adapt-threshold", type=float, default=AdaptOptions().threshold, dest="adapt_threshold",
                   metavar="X", help="a step is slow above X times the plan's prediction (default %(default)s)")
    a.add_argument("--adapt-patience", type=int, default=AdaptOptions().patience, dest="adapt_patience",
                   metavar="K", help="slow steps in a row before re-planning (default %(default)s)")
    a.add_argument("--adapt-cooldown", type=int, default=AdaptOptions().cooldown, dest="adapt_cooldown",
                   metavar="K", help="steps without re-planning after a decision to stay (default %(default)s)")
    a.add_argument("--no-replan-on-imbalance", dest="on_imbalance", action="store_false",
                   help="with --adapt: re-plan on failures only")
    a.add_argument("--max-failures", type=int, default=2, dest="max_failures", metavar="N",
                   help="a device whose rank fails N times (other than dying) is dropped (default 2)")
    a.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds a rank may block in communication before it fails (a hung peer; default 600)")
    p.set_defaults(run=run_run)

    r = subparsers.add_parser(
        "report", help="per-stage table of a run against its plan, the bottleneck, what to do",
        description="Summarise a run folder: per stage the forward, backward, communication and idle time, "
                    "bubble and peak memory, measured against the plan's prediction; name the bottleneck and "
                    "suggest what to change. Writes RUN_DIR/profile.json (the measured profile, for replan).")
    r.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    r.add_argument("--skip", type=int, default=None, help="warm-up steps to leave out (default 2)")
    r.add_argument("--no-export", dest="export", action="store_false", help="do not write RUN_DIR/profile.json")
    r.set_defaults(run=run_report)


def default_run_dir(build: Path) -> Path:
    """``out/runs/<build folder name>-<UTC time>``."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path("out") / "runs" / f"{build.resolve().name}-{stamp}"


def run_run(args: argparse.Namespace) -> int:
    """Handle ``hpml-compile run``.

    Returns:
        0 when every rank finished.

    Raises:
        HpmlError: a missing or mismatched build, a world that does not fit
            the plan, a port in use, or a rank that failed (named, with why).
    """
    from ..runtime.launcher import LaunchSpec, check_world, launch, preflight, prepare_run_dir
    from ..recipe import read_recipe

    if not (args.build / "plan.json").is_file():
        raise HpmlError(f"run: {args.build} is not a build folder (no plan.json): run `hpml-compile compile MODEL "
                        f"--cluster C -o {args.build}` first")
    read_recipe(args.build)  # fail here, not in every rank, when the ranks cannot rebuild the model
    plan = load_plan(args.build / "plan.json")
    if args.nnodes < 1 or args.steps < 1:
        raise HpmlError(f"run: --nnodes and --steps must be >= 1, got {args.nnodes} and {args.steps}")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        raise HpmlError(f"run: --node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    devices = sum(len(st.devices) for st in plan.stages)
    nproc = args.nproc if args.nproc is not None else max(1, devices // args.nnodes)
    check_world(plan, nproc, args.nnodes)
    worker = ["--optimizer", args.optimizer, "--lr", str(args.lr), "--log-every", str(args.log_every),
              "--retries", str(args.retries)]
    worker += [] if args.tensorboard else ["--no-tensorboard"]
    worker += [] if args.timeout is None else ["--timeout", str(args.timeout)]
    faults = [x for fault in args.inject_fault for x in ("--inject-fault", fault)]
    if args.adapt:
        return _run_adaptive(args, worker, faults, nproc)
    worker += ["--steps", str(args.steps), *faults]
    worker += [x for kill in args.kill_at for x in ("--kill-at", kill)]
    worker += [x for hang in args.hang_at for x in ("--hang-at", hang)]
    worker += [x for slow in args.slow for x in ("--slow", slow)]
    if args.checkpoint_dir:
        worker += ["--checkpoint-dir", str(args.checkpoint_dir), "--checkpoint-every", str(args.checkpoint_every or 0),
                   "--keep-checkpoints", str(args.keep)] + (["--resume"] if args.resume else [])
    elif args.resume:
        raise HpmlError("run: --resume needs --checkpoint-dir DIR (the folder the checkpoints were written to)")
    spec = LaunchSpec(args.build, args.run_dir or default_run_dir(args.build), nproc, args.nnodes, args.node_rank,
                      args.rdzv_endpoint, args.rdzv_id, args.max_restarts, tuple(worker))
    preflight(spec)  # before the run folder exists: a refused launch leaves nothing behind
    run_dir = prepare_run_dir(args.build, spec.run_dir,
                              {"steps": args.steps, "nproc": nproc, "nnodes": args.nnodes, "node_rank": args.node_rank,
                               "optimizer": args.optimizer, "lr": args.lr, "argv": sys.argv[1:]})
    print(f"run: {devices} ranks ({args.nnodes} node(s) x {nproc}) for {args.build} -> {run_dir}", flush=True)
    launch(spec)
    if args.report and args.node_rank in (None, 0):
        _report(run_dir, None, export=True)
    return 0


def _parse_faults(args: argparse.Namespace) -> tuple[list[tuple[int, float, int]], list[tuple[int, int]],
                                                     list[tuple[int, int]]]:
    from ..runtime.worker import _kill, _slow

    try:
        return [_slow(x) for x in args.slow], [_kill(x) for x in args.kill_at], [_kill(x) for x in args.hang_at]
    except argparse.ArgumentTypeError as e:
        raise HpmlError(f"run: {e}") from None


def _run_adaptive(args: argparse.Namespace, worker: list[str], faults: list[str], nproc: int) -> int:
    from ..runtime.adapt import AdaptOptions
    from ..runtime.supervisor import supervise

    if args.nnodes != 1:
        raise HpmlError("run --adapt runs on one host (it restarts every rank itself); across hosts use "
                        "--max-restarts and `hpml-compile replan` between runs")
    if args.checkpoint_dir is not None or args.resume:
        raise HpmlError("run --adapt keeps its checkpoints in RUN_DIR/checkpoints and always resumes from them; "
                        "drop --checkpoint-dir/--resume (or pass the same --run-dir to go on with a job)")
    run_dir = args.run_dir or default_run_dir(args.build)
    slows, kills, hangs = _parse_faults(args)
    adapt = AdaptOptions(threshold=args.adapt_threshold, patience=args.adapt_patience,
                         cooldown=args.adapt_cooldown) if args.on_imbalance else None
    print(f"run --adapt: {nproc} ranks for {args.build} -> {run_dir} (checkpoints every "
          f"{args.checkpoint_every or 5} steps in {run_dir / 'checkpoints'})", flush=True)
    events = supervise(args.build, run_dir, steps=args.steps, worker_args=worker, slows=slows, kills=kills, hangs=hangs,
                       first_only=faults, checkpoint_every=args.checkpoint_every or 5, keep=args.keep, adapt=adapt,
                       max_failures=args.max_failures, run_info={"optimizer": args.optimizer, "lr": args.lr,
                                                                  "argv": sys.argv[1:]},
                       log=lambda line: print(line, flush=True))
    segments = [e for e in events if e["event"] == "segment"]
    print(f"done: step {args.steps} reached in {len(segments)} segment(s); decisions in {run_dir / 'events.jsonl'}")
    _print_timings(run_dir)
    if args.report:
        _report(run_dir / f"seg{segments[-1]['segment']}", None, export=True)
    return 0


def _report(run_dir: Path, skip: int | None, *, export: bool) -> None:
    from ..runtime.summary import analyse, export_profile, format_summary

    s = analyse(run_dir, skip=skip)
    print(format_summary(s))
    if export:
        path = export_profile(run_dir, s)
        if path is not None:
            print(f"wrote {path} (the plan's profile scaled to the measured stage times; "
                  f"`hpml-compile replan {run_dir / 'plan.json'} --profile {path}` uses it)")
    tb = run_dir / "tb"
    if tb.is_dir():
        print(f"TensorBoard: tensorboard --logdir {tb}")


def run_report(args: argparse.Namespace) -> int:
    """Handle ``hpml-compile report``.

    Raises:
        HpmlError: a folder without measurements or plan.
    """
    if not args.run_dir.is_dir():
        raise HpmlError(f"report: {args.run_dir}: no such folder; pass the --run-dir of `hpml-compile run`")
    segments = sorted(args.run_dir.glob("seg*/plan.json"), key=lambda p: int(p.parent.name[3:]))
    if (args.run_dir / "metrics").is_dir() or not segments:
        _report(args.run_dir, args.skip, export=args.export)
        return 0
    _report_segments(args.run_dir, [p.parent for p in segments], args.skip, export=args.export)
    return 0


def _report_segments(run_dir: Path, segments: list[Path], skip: int | None, *, export: bool) -> None:
    """A run of `run --adapt`: each segment's table, then what happened between them."""
    import json

    from ..runtime.supervisor import EVENTS_FILE

    events = {e["segment"]: e for e in (json.loads(x) for x in (run_dir / EVENTS_FILE).read_text().splitlines()
                                        if x.strip()) if e["event"] == "segment"} \
        if (run_dir / EVENTS_FILE).is_file() else {}
    for seg in segments:
        k = int(seg.name[3:])
        why = events.get(k, {}).get("reason", "?")
        print(f"== segment {k} ({why}): {seg}")
        if not (seg / "metrics").is_dir():
            print("  no step finished")
            continue
        _report(seg, skip, export=export)
    if (run_dir / EVENTS_FILE).is_file():
        _print_timings(run_dir)


def _print_timings(run_dir: Path) -> None:
    from ..runtime.supervisor import timings

    for t in timings(run_dir):
        resume = f"{t['resume_s']:.1f} s" if t.get("resume_s") is not None else "-"
        print(f"  {t['kind']}: re-plan {t['replan_s']:.2f} s, back to training after {resume}")
