"""``hpml-compile run`` (train a build on torchrun ranks) and ``hpml-compile report`` (read a run folder).

``run BUILD`` checks that the world fits the build's plan, prepares the run
folder (``run.json``, the plan, the plan's profile), starts the ranks with
torchrun (:mod:`hpml_compile.runtime.job.launcher`), and when they finish prints
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
import math
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

from ..errors import HpmlError, OptionError
from ..plan import Plan, load_plan, with_comm
from ..schedule import rank_layout
from ..runtime.job.adapt import AdaptOptions
from ..runtime.job.options import (Faults, OptimizerName, ResumeMode, RunOptions, parse_fault, parse_slow,
                                   parse_step_rank)
from ..runtime.sync.comm import CommOp
from .plan import add_comm_options
from .report import add_report_parser, print_timings, report_run_dir, run_report

DEFAULT_STEPS = 20

__all__ = ["add_parsers", "run_run", "run_report", "default_run_dir", "check_options", "check_faults", "run_options"]


def add_parsers(subparsers: Any) -> None:
    """Register ``run`` and ``report`` on an argparse sub-parser set.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    p = subparsers.add_parser(
        "run", help="train a build on torchrun ranks, measuring every stage (writes a run folder)",
        description="Start one rank per device of the build's plan with torchrun (standalone on one host; "
                    "torchrun's rendezvous across hosts), each loading its stage from BUILD, and train: a build of a "
                    "TrainSpec (`compile path/to/train.py:NAME`) on the TrainSpec's dataset, each rank loading only "
                    "its own rows of every batch; a build of a zoo model or a factory on the model's example batch. "
                    "Every step of every rank is measured (JSON lines and TensorBoard "
                    "events in the run folder); at the end the measured-vs-predicted table is printed and the "
                    "measured profile written for `replan`.")
    p.add_argument("build", type=Path, metavar="BUILD", help="the build folder written by `hpml-compile compile`")
    p.add_argument("--steps", type=int, default=None, help=f"training steps (default {DEFAULT_STEPS}, or --epochs)")
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
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                   help="the optimizer every rank steps its parameters with (default adamw; a TrainSpec's own "
                        "optimizer wins)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of --optimizer (default 1e-3)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                   help="the build's precision (a build runs as it was compiled; given, it must match)")
    p.add_argument("--log-every", type=int, default=1, dest="log_every", metavar="N",
                   help="print the loss every N steps (default 1)")
    p.add_argument("--retries", type=int, default=3,
                   help="attempts per step when communication fails transiently; 0 or 1: one attempt (default 3)")
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_false",
                   help="write no TensorBoard event files (RUN_DIR/tb); the per-step JSON lines are written anyway")
    p.add_argument("--compile-stages", choices=["auto", "on", "off"], default=None, dest="compile_stages",
                   help="run each stage's forward and backward compiled by torch.compile (inductor): auto on CUDA "
                        "devices, not on CPUs, where a compile takes tens of seconds a stage; on; off (default: as "
                        "the build was compiled, `compile --compile-stages`; a build planned otherwise runs, and "
                        "one line says its predicted figures were priced for the other mode)")
    p.add_argument("--metrics-port", type=int, default=None, dest="metrics_port", metavar="P",
                   help="rank 0 serves every rank's latest figures at http://HOST:P/metrics in the Prometheus text "
                        "format while the job runs (ranks of other hosts only with a shared run folder)")
    p.add_argument("--no-report", dest="report", action="store_false", help="skip the table at the end")
    add_comm_options(p, solver=False)
    d = p.add_argument_group("data (a build of a TrainSpec: `compile path/to/train.py:NAME`)")
    d.add_argument("--epochs", type=int, default=None, metavar="E",
                   help="train E passes over the TrainSpec's dataset (instead of --steps)")
    d.add_argument("--val-every", type=int, default=0, dest="val_every", metavar="K",
                   help="the validation loss (eval mode, the whole val_dataset) every K steps and at the end; "
                        "0: never (default)")
    d.add_argument("--log-samples", action="store_true", dest="log_samples",
                   help="first-stage ranks write the dataset indices of every step's rows to RUN_DIR/samples/")
    c = p.add_argument_group("checkpoints")
    c.add_argument("--checkpoint-dir", type=Path, default=None, dest="checkpoint_dir",
                   help="where checkpoints go (default: none; RUN_DIR/checkpoints with --adapt)")
    c.add_argument("--checkpoint-every", type=int, default=None, dest="checkpoint_every", metavar="K",
                   help="checkpoint every K steps, and at the end; 0: only at the end (and, with --adapt, before "
                        "a switch) (default 5 with --adapt, else 0)")
    c.add_argument("--keep-checkpoints", type=int, default=3, dest="keep", metavar="N",
                   help="complete checkpoints kept; 0: every one (default 3)")
    c.add_argument("--resume", action="store_true",
                   help="start from the latest checkpoint in --checkpoint-dir (any plan's: regrouped by name)")
    a = p.add_argument_group("closed loop (--adapt)")
    a.add_argument("--adapt", action="store_true",
                   help="re-plan while training: on a sustained gap to the plan (switching when the predicted gain "
                        "pays for a restart) and on a failed rank (resume from the last checkpoint; a dead "
                        "rank's device is dropped; on one host a dead replica of a replicated stage is dropped "
                        "without a restart: the others run the failed step again and go on); across hosts "
                        "(--nnodes N --node-rank R --rdzv-endpoint, the same --run-dir on a shared file system) a "
                        "lost host's devices are dropped. Segments go to RUN_DIR/seg<k>, decisions to "
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
    a.add_argument("--host-timeout", type=float, default=None, dest="host_timeout", metavar="S",
                   help="across hosts: a host silent for S seconds is lost, its devices dropped (default 3)")
    a.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds a rank may block in communication before it fails (a hung peer; default 600)")
    f = p.add_argument_group("drills (inject a fault on purpose, to see retries and the closed loop at work)")
    f.add_argument("--inject-fault", action="append", default=[], dest="inject_fault", metavar="STEP:RANK:OP",
                   help=f"fail the first {'|'.join(o.value for o in CommOp)} of rank RANK in step STEP (from 1) once, "
                        "to see the retry work; repeatable")
    f.add_argument("--kill-at", action="append", default=[], dest="kill_at", metavar="STEP:RANK",
                   help="rank RANK dies abruptly when it reaches step STEP (from 1); repeatable")
    f.add_argument("--hang-at", action="append", default=[], dest="hang_at", metavar="STEP:RANK",
                   help="rank RANK stops responding at step STEP (its peers fail after --timeout); "
                        "with --adapt, every time its device gets there")
    f.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR:FROM_STEP",
                   help="rank RANK computes FACTOR times slower from step FROM_STEP (from 1) on")
    p.set_defaults(run=run_run)
    add_report_parser(subparsers)


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
    from ..runtime.job.launcher import LaunchSpec, check_world, launch, owns_run_dir, preflight, prepare_run_dir
    from ..recipe import read_recipe

    check_options(args)  # every range and format first: nothing is read, nothing starts, on a typo
    if not (args.build / "plan.json").is_file():
        raise HpmlError(f"run: {args.build} is not a build folder (no plan.json): run `hpml-compile compile MODEL "
                        f"--cluster C -o {args.build}` first")
    recipe = read_recipe(args.build)  # fail here, not in every rank, when the ranks cannot rebuild the model
    plan = load_plan(args.build / "plan.json")
    if args.precision is not None and args.precision != plan.precision.value:
        raise OptionError(f"--precision {args.precision}: {args.build} was compiled for {plan.precision.value} (its "
                          f"profile was timed so, its stages send {plan.precision.value} tensors); drop --precision, "
                          f"or compile again with --precision {args.precision}")
    _data_options(args, recipe, plan)  # --epochs becomes --steps; a TrainSpec's batch must split as planned
    _compile_mode(args, plan)  # the build's, or the one asked for (one line where it was not priced so)
    with_comm(plan, compress=args.compress, sync_every=args.sync_every, sync_warmup=args.sync_warmup)  # checked
    devices = len(rank_layout(plan))  # one rank per device
    nproc = args.nproc if args.nproc is not None else max(1, devices // args.nnodes)
    check_world(plan, nproc, args.nnodes)
    check_faults(args, devices)  # ranks and steps that exist in this build and this run
    options = run_options(args)
    if args.adapt:
        return _run_adaptive(args, options, nproc)
    if args.resume:
        _check_resume(args.checkpoint_dir)
    spec = LaunchSpec(args.build, args.run_dir or default_run_dir(args.build), nproc, args.nnodes, args.node_rank,
                      args.rdzv_endpoint, args.rdzv_id, args.max_restarts)
    preflight(spec)  # before the run folder exists: a refused launch leaves nothing behind
    run_dir = prepare_run_dir(args.build, spec.run_dir,
                              {"steps": args.steps, "nproc": nproc, "nnodes": args.nnodes, "node_rank": args.node_rank,
                               "optimizer": args.optimizer, "lr": args.lr, "argv": sys.argv[1:]}, options,
                              log=lambda line: print(line, flush=True), keep_earlier=owns_run_dir(spec))
    print(f"run: {devices} ranks ({args.nnodes} node(s) x {nproc}) for {args.build} -> {run_dir}", flush=True)
    launch(spec)
    if args.report and args.node_rank in (None, 0):
        report_run_dir(run_dir, None, export=True)
    return 0


def _compile_mode(args: argparse.Namespace, plan: Plan) -> None:
    """Set ``args.compile_stages``: as given, else as the build was planned (:attr:`Plan.compile_stages`); print
    one line where the one given runs the CPU stages otherwise than the plan's figures were priced."""
    from ..runtime.execute.compiled import CompileStages, mode_mismatch

    if args.compile_stages is None:
        args.compile_stages = plan.compile_stages
        return
    line = mode_mismatch(plan, CompileStages.parse(args.compile_stages), str(args.build))
    if line is not None:
        print(f"run: {line}", flush=True)


def run_options(args: argparse.Namespace) -> RunOptions:
    """The ranks' options from the parsed ``run`` arguments (checked by :func:`check_options`, ``--steps`` set).

    With ``--adapt``, checkpoints go to the job's folder (the supervisor sets it per segment) every 5 steps
    unless ``--checkpoint-every`` says otherwise, and the closed loop's options come from ``--adapt-*``.

    Args:
        args: the parsed arguments.

    Returns:
        What every rank reads from ``run.json``.
    """
    faults = Faults(comm=tuple(parse_fault(t) for t in args.inject_fault),
                    kills=tuple(parse_step_rank(t) for t in args.kill_at),
                    hangs=tuple(parse_step_rank(t) for t in args.hang_at), slows=tuple(parse_slow(t) for t in args.slow))
    common = dict(steps=args.steps, optimizer=OptimizerName(args.optimizer), lr=args.lr, log_every=args.log_every,
                  retries=args.retries, timeout_s=args.timeout if args.timeout is not None else RunOptions().timeout_s,
                  tensorboard=args.tensorboard, metrics_port=args.metrics_port, val_every=args.val_every or 0,
                  log_samples=args.log_samples, compress=args.compress, sync_every=args.sync_every,
                  sync_warmup=args.sync_warmup, keep=args.keep, faults=faults,
                  compile_stages=args.compile_stages or "auto")
    if args.adapt:
        adapt = AdaptOptions.from_env(threshold=args.adapt_threshold, patience=args.adapt_patience,
                                      cooldown=args.adapt_cooldown) if args.on_imbalance else None
        every = 5 if args.checkpoint_every is None else args.checkpoint_every  # 0 stays 0: the end and switches
        return RunOptions(**common, checkpoint_every=every, adapt=adapt)
    return RunOptions(**common, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every or 0,
                      resume=ResumeMode.REQUIRED if args.resume else ResumeMode.NO)


_DEST = {"--keep-checkpoints": "keep"}  # options whose attribute is not their name


def _refuse(option: str, value: object, expected: str, fix: str) -> NoReturn:
    raise OptionError(f"{option} {value}: expected {expected}; {fix}")


def _whole(args: argparse.Namespace, option: str, low: int, meaning: str) -> None:
    """Refuse ``option`` (an int attribute of ``args``, named as on the command line) below ``low``."""
    value = getattr(args, _DEST.get(option, option.lstrip("-").replace("-", "_")))
    if value is not None and value < low:
        _refuse(option, value, f"{meaning}: a whole number, {low} or more", f"pass e.g. {option} {max(low, 1)}")


def _positive(args: argparse.Namespace, option: str, meaning: str, example: str, *, above: float = 0.0) -> None:
    """Refuse ``option`` (a float attribute of ``args``) that is not a finite number above ``above``."""
    value = getattr(args, _DEST.get(option, option.lstrip("-").replace("-", "_")))
    if value is not None and not (math.isfinite(value) and value > above):
        _refuse(option, value, f"{meaning}: a finite number above {above:g}", f"pass e.g. {option} {example}")


def check_options(args: argparse.Namespace) -> None:
    """Check every option of ``run`` that needs no build: ranges, formats and combinations.

    Args:
        args: the parsed ``run`` arguments.

    Raises:
        OptionError: the first option out of range or badly formed (its name, value, what is expected, the fix).
        LaunchError: a ``--rdzv-endpoint`` that is not ``HOST:PORT``.
    """
    from ..runtime.job.launcher import parse_endpoint

    _whole(args, "--steps", 1, "the number of training steps")
    _whole(args, "--nproc", 1, "ranks on this host")
    _whole(args, "--nnodes", 1, "hosts taking part")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        _refuse("--node-rank", args.node_rank, f"this host's rank among --nnodes {args.nnodes}, 0..{args.nnodes - 1}",
                "give each host its own rank, node 0 the one at --rdzv-endpoint")
    _whole(args, "--max-restarts", 0, "restarts after a failure")
    _whole(args, "--log-every", 1, "steps between progress lines")
    _whole(args, "--retries", 0, "attempts per step")
    _whole(args, "--checkpoint-every", 0, "steps between checkpoints (0: only at the end)")
    _whole(args, "--keep-checkpoints", 0, "checkpoints kept (0: every one)")
    _whole(args, "--adapt-patience", 1, "slow steps in a row")
    _whole(args, "--adapt-cooldown", 0, "quiet steps after a decision")
    _whole(args, "--max-failures", 1, "failures of one device before it is dropped")
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65535:
        _refuse("--metrics-port", args.metrics_port, "a TCP port, 1..65535", "pass e.g. --metrics-port 9464")
    _positive(args, "--lr", "a learning rate", "1e-3")
    _positive(args, "--timeout", "seconds a rank may block", "600")
    _positive(args, "--host-timeout", "seconds a host may stay silent", "3")
    if getattr(args, "host_timeout", None) is not None and (not args.adapt or args.nnodes == 1):
        _refuse("--host-timeout", args.host_timeout, "a multi-host --adapt job (--adapt --nnodes 2 or more)",
                "drop --host-timeout")
    _positive(args, "--adapt-threshold", "a ratio of measured to predicted step time", "1.25", above=1.0)
    if args.rdzv_endpoint is not None:
        parse_endpoint(args.rdzv_endpoint)
    if not args.adapt and args.checkpoint_dir is None:
        if args.checkpoint_every is not None:
            _refuse("--checkpoint-every", args.checkpoint_every, "a --checkpoint-dir to write to",
                    "add --checkpoint-dir DIR, or drop --checkpoint-every")
        if args.resume:
            raise OptionError("--resume needs --checkpoint-dir DIR (the folder the checkpoints were written to)")
    parsers: tuple[tuple[str, list[str], Callable[[str], object]], ...] = (
        ("--inject-fault", args.inject_fault, parse_fault), ("--kill-at", args.kill_at, parse_step_rank),
        ("--hang-at", args.hang_at, parse_step_rank), ("--slow", args.slow, parse_slow))
    for option, values, parse in parsers:
        for text in values:
            try:
                parse(text)
            except argparse.ArgumentTypeError as e:
                raise OptionError(f"{option} {text}: {e}") from None


def check_faults(args: argparse.Namespace, ranks: int) -> None:
    """Refuse fault injections that name a rank the build lacks or a step the run never reaches.

    Args:
        args: the parsed ``run`` arguments (formats already checked by :func:`check_options`).
        ranks: the build's rank count (its plan's devices).

    Raises:
        OptionError: naming the option, the rank or step, and the ones that exist.
    """
    named: list[tuple[str, str, int, int]] = []  # (option, text, rank, step)
    named += [("--inject-fault", t, f.rank, f.step + 1) for t in args.inject_fault for f in [parse_fault(t)]]
    named += [(o, t, r, st) for o, texts in (("--kill-at", args.kill_at), ("--hang-at", args.hang_at))
              for t in texts for st, r in [parse_step_rank(t)]]
    named += [("--slow", t, r, st) for t in args.slow for r, _, st in [parse_slow(t)]]
    for option, text, rank, step in named:
        if rank >= ranks:
            _refuse(option, text, f"a rank of the build, 0..{ranks - 1} (its plan has {ranks} devices, one rank "
                    f"each), got rank {rank}", "name one of those ranks")
        if step > args.steps:
            _refuse(option, text, f"a step the run reaches, 1..{args.steps} (--steps {args.steps}), got step {step}",
                    f"use a step up to {args.steps}, or raise --steps")


def _data_options(args: argparse.Namespace, recipe: Any, plan: Any) -> None:
    """``--epochs``/``--val-every``/``--log-samples`` against the build's model, and ``--steps``' default.

    A build of a TrainSpec (``compile path/to/train.py:NAME``) trains on its dataset: its batch must split
    into the plan's microbatches and replicas (checked here, before any rank starts), and ``--epochs E``
    becomes ``--steps`` (full batches per epoch x E). Without either, 20 steps.

    Raises:
        OptionError: a data option for a build without a TrainSpec, ``--epochs`` with ``--steps`` or over a
            stream without a length, ``--val-every`` without a val_dataset.
        ModelError: the TrainSpec's batch does not split into the plan's microbatches and replicas.
    """
    epochs, val_every, samples = (getattr(args, "epochs", None), getattr(args, "val_every", 0),
                                  getattr(args, "log_samples", False))
    _whole(args, "--epochs", 1, "passes over the dataset")
    _whole(args, "--val-every", 0, "steps between validations (0: never)")
    if epochs is not None and args.steps is not None:
        _refuse("--epochs", epochs, "either --epochs or --steps", "drop one of them")
    spec = None
    if ".py:" in recipe.model:  # a user's file: it may be a TrainSpec (built here once, to check it)
        from .. import models

        spec = models.load(recipe.model, batch_size=recipe.batch_size, seq_len=recipe.seq_len, seed=recipe.seed).train
    if spec is None:
        for option, value in (("--epochs", epochs), ("--val-every", val_every or None),
                              ("--log-samples", samples or None)):
            if value is not None:
                _refuse(option, value, "a build of a TrainSpec (compile path/to/train.py:NAME)",
                        f"{recipe.model} trains on its example batch; use --steps")
    else:
        from ..trainspec import batches_per_epoch, check_batch_split, split_of

        check_batch_split(spec.batch_size, plan.microbatches, [split_of(len(st.devices), st.rows)
                                                               for st in plan.stages])
        if val_every and spec.val_dataset is None:
            _refuse("--val-every", val_every, "a TrainSpec with a val_dataset",
                    "give the TrainSpec a val_dataset, or drop --val-every")
        if epochs is not None:
            per = batches_per_epoch(spec)
            if per is None:
                _refuse("--epochs", epochs, "a dataset with a length", "the IterableDataset has no len(): use --steps")
            args.steps = epochs * per
            print(f"run: {epochs} epoch(s) of {per} batches of {spec.batch_size} = {args.steps} steps", flush=True)
    if args.steps is None:
        args.steps = DEFAULT_STEPS


def _check_resume(checkpoint_dir: Path) -> None:
    """``--resume``: refuse a folder with nothing intact to resume from before any rank starts.

    Raises:
        CheckpointError: the folder is missing, empty, holds no checkpoint or only damaged ones (which, said by
            :func:`~hpml_compile.runtime.execute.checkpoint.resume_from`).
    """
    from ..runtime.execute.checkpoint import resume_from

    resume_from(checkpoint_dir, log=lambda _line: None)  # rank 0 says which damaged ones it skips


def _run_adaptive(args: argparse.Namespace, options: RunOptions, nproc: int) -> int:
    from ..runtime.job.launcher import keep_earlier_run
    from ..runtime.job.supervisor import supervise

    if args.checkpoint_dir is not None or args.resume:
        raise HpmlError("run --adapt keeps its checkpoints in RUN_DIR/checkpoints and always resumes from them; "
                        "drop --checkpoint-dir/--resume (or pass the same --run-dir to go on with a job)")
    if args.nnodes > 1:
        return _run_adaptive_hosts(args, options, nproc)
    run_dir = args.run_dir or default_run_dir(args.build)
    keep_earlier_run(run_dir, log=lambda line: print(line, flush=True))  # a plain run's files: `report` reads segments
    every = options.checkpoint_every
    when = f"every {every} steps" if every else "only at the end and before a switch"
    print(f"run --adapt: {nproc} ranks for {args.build} -> {run_dir} (checkpoints {when} in "
          f"{run_dir / 'checkpoints'})", flush=True)
    events = supervise(args.build, run_dir, options=options, max_failures=args.max_failures,
                       run_info={"optimizer": args.optimizer, "lr": args.lr, "argv": sys.argv[1:]},
                       log=lambda line: print(line, flush=True))
    _adaptive_done(args, events, run_dir)
    return 0


def _run_adaptive_hosts(args: argparse.Namespace, options: RunOptions, nproc: int) -> int:
    """``run --adapt`` on one of several hosts: :func:`~hpml_compile.runtime.job.hostbuild.supervise_hosts`."""
    from ..runtime.job.hosts import LOST_AFTER_S
    from ..runtime.job.launcher import keep_earlier_run
    from ..runtime.job.hostbuild import supervise_hosts

    if args.node_rank is None or args.rdzv_endpoint is None or args.run_dir is None:
        raise OptionError(f"run --adapt --nnodes {args.nnodes} needs --node-rank R (0 on the host at the endpoint, "
                          "which decides), --rdzv-endpoint HOST:PORT and --run-dir DIR, the same DIR on every host "
                          "(a shared file system: the hosts left resume from the checkpoints there)")
    if args.node_rank == 0:
        keep_earlier_run(args.run_dir, log=lambda line: print(line, flush=True))
    print(f"run --adapt: host {args.node_rank} of {args.nnodes}, {nproc} rank(s) here, for {args.build} -> "
          f"{args.run_dir} (the job's store at {args.rdzv_endpoint})", flush=True)
    events = supervise_hosts(args.build, args.run_dir, options, host=args.node_rank, nnodes=args.nnodes,
                             nproc=nproc, endpoint=args.rdzv_endpoint, max_failures=args.max_failures,
                             lost_after_s=args.host_timeout if args.host_timeout is not None else LOST_AFTER_S,
                             run_info={"optimizer": args.optimizer, "lr": args.lr, "argv": sys.argv[1:]},
                             log=lambda line: print(line, flush=True))
    if args.node_rank == 0 or events:  # events: this host took the decisions over from a lost host 0
        _adaptive_done(args, events, args.run_dir)
    else:
        print(f"done: host {args.node_rank}'s part finished; the job's report is on host 0 ({args.run_dir})")
    return 0


def _adaptive_done(args: argparse.Namespace, events: list[dict[str, Any]], run_dir: Path) -> None:
    """The end of an ``--adapt`` job: its segments, its recoveries' timings, the last segment's table."""
    segments = [e for e in events if e["event"] == "segment"]
    print(f"done: step {args.steps} reached in {len(segments)} segment(s); decisions in {run_dir / 'events.jsonl'}")
    print_timings(run_dir)
    if args.report:
        report_run_dir(run_dir / f"seg{segments[-1]['segment']}", None, export=True)
