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

from .errors import HpmlError
from .plan import load_plan
from .runtime.comm import OpKind

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
                   help=f"fail the first {'|'.join(o.value for o in OpKind)} of rank RANK in step STEP (from 1) once, "
                        "to see the retry work; repeatable")
    p.add_argument("--kill-at", action="append", default=[], dest="kill_at", metavar="STEP:RANK",
                   help="fault injection: rank RANK dies abruptly when it reaches step STEP (from 1); repeatable")
    p.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR:FROM_STEP",
                   help="fault injection: rank RANK computes FACTOR times slower from step FROM_STEP (from 1) on")
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_false")
    p.add_argument("--no-report", dest="report", action="store_false", help="skip the table at the end")
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
    from .runtime.launcher import LaunchSpec, check_world, launch, preflight, prepare_run_dir
    from .runtime.recipe import read_recipe

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
    worker = ["--steps", str(args.steps), "--optimizer", args.optimizer, "--lr", str(args.lr),
              "--log-every", str(args.log_every), "--retries", str(args.retries)]
    worker += [x for fault in args.inject_fault for x in ("--inject-fault", fault)]
    worker += [x for kill in args.kill_at for x in ("--kill-at", kill)]
    worker += [x for slow in args.slow for x in ("--slow", slow)]
    worker += [] if args.tensorboard else ["--no-tensorboard"]
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


def _report(run_dir: Path, skip: int | None, *, export: bool) -> None:
    from .runtime.summary import analyse, export_profile, format_summary

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
    _report(args.run_dir, args.skip, export=args.export)
    return 0
