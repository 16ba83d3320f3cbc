"""One rank of ``hpml-compile run``: what torchrun starts in each process (``python -m hpml_compile.runtime.worker``).

Each rank reads the build's ``model.json`` (:mod:`.recipe`), builds the
model from the same seed as every other rank, loads the build (hashes
checked, model re-traced, stage code regenerated from plan.json), joins the job through
torchrun's environment (:class:`~.pipeline.Pipeline`), and trains ``--steps``
steps on the model's example batch (synthetic data: a fixed batch, so the
loss visibly falls; train on your own data with the Python API). Rank 0
prints the loss and throughput as it goes. Every rank writes its
measurements into the run folder; at the end rank 0 also writes the rows of
ranks on other hosts, so one run folder holds them all.

A rank that fails writes ``errors/rank<r>.txt`` (the message and the time)
so that the launcher can say which rank failed first and why.

Example:
    >>> a = parse_args(["build", "out/run", "--steps", "3"])
    >>> a.steps, a.optimizer is OptimizerName.ADAMW
    (3, True)
"""

from __future__ import annotations

import argparse
import enum
import functools
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..codegen.build import sha256
from ..errors import HpmlError
from ..schema import write_json_atomic
from .adapt import NEXT_FILE, AdaptOptions, Adapter, take_rows
from .checkpoint import CheckpointError, latest, load_checkpoint, resume_from, save_checkpoint, seed_rngs
from .comm import CommFault, CommOp
from .lifeline import watch_launcher
from .live import AlertWatch, RowTail, serve_metrics
from .monitor import metrics_path
from .pipeline import Pipeline
from .trainer import Trainer
from ..recipe import read_recipe
from .session import CommFailure, RetryPolicy, env_rank

PROGRESS_FILE = "started.json"
_STARTED = time.perf_counter()  # the process's start, near enough: the cost of a restart is measured from it

__all__ = ["OptimizerName", "ResumeMode", "parse_args", "main", "error_path", "threads_per_rank", "PROGRESS_FILE",
           "parse_fault", "parse_step_rank", "parse_slow"]


class OptimizerName(str, enum.Enum):
    """Optimizers ``run`` can train with."""

    ADAMW = "adamw"
    SGD = "sgd"


class ResumeMode(str, enum.Enum):
    """Whether a rank starts from a checkpoint: never, always (an error without one), or when there is one."""

    NO = "no"
    REQUIRED = "required"
    IF_ANY = "if-any"


def error_path(run_dir: str | Path, rank: int) -> Path:
    """Where a failing rank writes its message."""
    return Path(run_dir) / "errors" / f"rank{rank}.txt"


def threads_per_rank(local_world_size: int, cores: int | None = None) -> int:
    """Torch threads for each of ``local_world_size`` ranks sharing this host's cores."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, local_world_size))


def parse_fault(text: str) -> CommFault:
    """Parse ``--inject-fault STEP:RANK:OP`` (STEP from 1, as the progress lines count).

    Raises:
        argparse.ArgumentTypeError: not three fields, a field that is not a whole number or an operation,
            a step below 1 or a negative rank.
    """
    ops = "|".join(o.value for o in CommOp)
    try:
        step, rank, op = text.split(":")
        fault = CommFault(int(step) - 1, int(rank), CommOp(op))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected STEP:RANK:{ops} (e.g. 3:1:{CommOp.COLLECTIVE.value}), "
                                         f"got {text!r}") from e
    _at_least(text, "STEP", fault.step + 1, 1)
    _at_least(text, "RANK", fault.rank, 0)
    return fault


def _at_least(text: str, name: str, value: int, low: int) -> None:
    if value < low:
        raise argparse.ArgumentTypeError(f"{name} must be {low} or more (steps count from 1, ranks from 0), "
                                         f"got {value} in {text!r}")


KILLED_EXIT = 137  # what a SIGKILLed process reports: the injected death looks like a real one


def parse_step_rank(text: str) -> tuple[int, int]:
    """Parse ``--kill-at``/``--hang-at STEP:RANK`` (STEP from 1).

    Returns:
        ``(step, rank)``.

    Raises:
        argparse.ArgumentTypeError: not two whole numbers, a step below 1 or a negative rank.
    """
    try:
        step, rank = (int(x) for x in text.split(":"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected STEP:RANK (e.g. 5:1; step from 1), got {text!r}") from e
    _at_least(text, "STEP", step, 1)
    _at_least(text, "RANK", rank, 0)
    return step, rank


def _die(run_dir: Path, rank: int, step: int) -> None:
    """Injected failure: leave the reason where the launcher looks, then vanish like a killed process."""
    path = error_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "time": time.time(), "user_error": False, "kind": "killed",
                                "message": f"killed at step {step} by --kill-at (fault injection)"}))
    sys.stdout.flush()
    os._exit(KILLED_EXIT)


def parse_slow(text: str) -> tuple[int, float, int]:
    """Parse ``--slow RANK:FACTOR:FROM_STEP`` (FROM_STEP from 1).

    Returns:
        ``(rank, factor, from_step)``.

    Raises:
        argparse.ArgumentTypeError: not three fields, a field of the wrong type, a factor below 1 or not
            finite, a step below 1 or a negative rank.
    """
    try:
        rank, factor, step = text.split(":")
        out = int(rank), float(factor), int(step)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected RANK:FACTOR:FROM_STEP, e.g. 1:3:10, got {text!r}") from e
    if not (math.isfinite(out[1]) and out[1] >= 1):
        raise argparse.ArgumentTypeError(f"FACTOR must be a number >= 1 (how many times slower), got {factor!r} "
                                         f"in {text!r}")
    _at_least(text, "RANK", out[0], 0)
    _at_least(text, "FROM_STEP", out[2], 1)
    return out


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps, got {text!r}") from e
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (only at the end and before a switch) or more, got {value}")
    return value


def _slow_down(module: torch.nn.Module, factor: float) -> None:
    """Make a stage ``factor`` times slower, as a slower device would be.

    Each forward call sleeps ``(factor - 1)`` times its own duration three times
    over (forward plus a backward of about twice the forward), so the stage's
    compute per microbatch grows by about ``factor`` and the monitor sees it
    where a slow device would show it: in the stage's compute time.
    """
    started: list[float] = [0.0]

    def before(_m: torch.nn.Module, _args: object) -> None:
        started[0] = time.perf_counter()

    def after(_m: torch.nn.Module, _args: object, _out: object) -> None:
        time.sleep((factor - 1.0) * 3.0 * (time.perf_counter() - started[0]))

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The worker's arguments (the launcher writes them; see ``hpml-compile run --help``)."""
    p = argparse.ArgumentParser(prog="python -m hpml_compile.runtime.worker")
    p.add_argument("build", type=Path)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--optimizer", type=OptimizerName, default=OptimizerName.ADAMW,
                   choices=list(OptimizerName))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=1, dest="log_every")
    p.add_argument("--retries", type=int, default=3, help="attempts per step on transient communication errors")
    p.add_argument("--inject-fault", type=parse_fault, action="append", default=[], dest="faults",
                   metavar="STEP:RANK:OP",
                   help="fail one communication operation once (to exercise the retry); repeatable")
    p.add_argument("--kill-at", type=parse_step_rank, action="append", default=[], dest="kills", metavar="STEP:RANK",
                   help="rank RANK dies (no clean-up, exit 137) when it reaches step STEP; repeatable")
    p.add_argument("--hang-at", type=parse_step_rank, action="append", default=[], dest="hangs", metavar="STEP:RANK",
                   help="rank RANK stops responding (sleeps for ever) when it reaches step STEP; repeatable")
    p.add_argument("--slow", type=parse_slow, action="append", default=[], dest="slows",
                   metavar="RANK:FACTOR:FROM_STEP",
                   help="rank RANK computes FACTOR times slower from step FROM_STEP on; repeatable")
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_false")
    p.add_argument("--checkpoint-dir", type=Path, default=None, dest="checkpoint_dir",
                   help="where checkpoints go (none written without it)")
    p.add_argument("--checkpoint-every", type=_non_negative, default=0, dest="checkpoint_every",
                   help="checkpoint every K steps (0: only at the end and before a switch)")
    p.add_argument("--keep-checkpoints", type=int, default=3, dest="keep", help="complete checkpoints kept")
    p.add_argument("--resume", action="store_const", const=ResumeMode.REQUIRED, default=ResumeMode.NO,
                   help="start from the latest intact checkpoint in --checkpoint-dir (an error when there is none)")
    p.add_argument("--resume-if-any", action="store_const", const=ResumeMode.IF_ANY, dest="resume",
                   help="as --resume, but start at step 0 when there is no checkpoint yet (the supervisor's "
                        "segments: a failure may come before the first checkpoint)")
    p.add_argument("--adapt", action="store_true", help="re-plan on a sustained gap to the plan (see adapt.py)")
    p.add_argument("--adapt-threshold", type=float, default=AdaptOptions().threshold, dest="adapt_threshold")
    p.add_argument("--adapt-patience", type=int, default=AdaptOptions().patience, dest="adapt_patience")
    p.add_argument("--adapt-cooldown", type=int, default=AdaptOptions().cooldown, dest="adapt_cooldown")
    p.add_argument("--rows-from", type=Path, default=None, dest="rows_from", metavar="PLAN",
                   help="train with this plan's rows per replica (the build's plan with rows moved in place: the "
                        "supervisor's restart after a failure)")
    p.add_argument("--launched-at", type=float, default=None, dest="launched_at",
                   help="when the launch began (epoch seconds): rank 0 records the time to the first step")
    p.add_argument("--val-every", type=int, default=0, dest="val_every",
                   help="a TrainSpec's validation loss every K steps and at the end (0: never)")
    p.add_argument("--log-samples", action="store_true", dest="log_samples",
                   help="first-stage ranks write each step's dataset indices to RUN_DIR/samples/rank<r>.jsonl")
    p.add_argument("--timeout", type=float, default=RetryPolicy().timeout_s,
                   help="seconds a collective or receive may block before the rank fails (a hung peer)")
    p.add_argument("--metrics-port", type=int, default=None, dest="metrics_port",
                   help="rank 0 serves every rank's latest figures here (Prometheus text format)")
    p.add_argument("--compress", default=None, help="override the plan's gradient compression (powersgd:R, topk:X)")
    p.add_argument("--sync-every", type=int, default=None, dest="sync_every", help="override the plan's local SGD period")
    p.add_argument("--sync-warmup", type=int, default=None, dest="sync_warmup", help="and its warm-up steps")
    return p.parse_args(argv)


def _live(args: argparse.Namespace, pipe: Pipeline) -> tuple[AlertWatch, RowTail]:
    """Rank 0: the metrics endpoint (with --metrics-port) and the alert watch, both over the run folder's rows."""
    plan = pipe.plan
    devices = [d for st in plan.stages for d in st.devices]
    if args.metrics_port:
        try:
            serve_metrics(args.run_dir, args.metrics_port, devices, plan.predicted.step_ms)
        except OSError as e:
            raise HpmlError(f"--metrics-port {args.metrics_port}: cannot serve there ({e}); pass a free port") from e
        _say(f"metrics: http://{socket.gethostname()}:{args.metrics_port}/metrics (Prometheus text format)")
    capacity = {r: plan.cluster.device(d).memory_bytes for r, d in enumerate(devices)}
    return AlertWatch(plan.predicted.step_ms, capacity), RowTail(args.run_dir)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _optimizer(name: OptimizerName, lr: float) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    if name is OptimizerName.SGD:
        return functools.partial(torch.optim.SGD, lr=lr)
    return functools.partial(torch.optim.AdamW, lr=lr)


def _collect_rows(pipe: Pipeline, run_dir: Path) -> None:
    """Rank 0 writes the rows of ranks whose files it cannot see (ranks on other hosts)."""
    mine = "\n".join(json.dumps(m.to_dict()) for m in pipe.metrics)
    every: list[str | None] = [None] * pipe.world_size
    dist.all_gather_object(every, mine)
    if pipe.rank != 0:
        return
    for r, text in enumerate(every):
        path = metrics_path(run_dir, r)
        if text and not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")


def _save(args: argparse.Namespace, pipe: Pipeline, step: int, loss: float | None,
          trainer: Trainer | None = None) -> float:
    """Checkpoint ``step`` on every rank; returns the seconds it took."""
    t0 = time.perf_counter()
    plan_hash = sha256((Path(args.build) / "plan.json").read_bytes())
    save_checkpoint(args.checkpoint_dir, step, pipe.local_module(), pipe.optimizer, keep=args.keep, scaler=pipe.scaler,
                    feedback=pipe.feedback(),
                    extra={"loss": loss, "build": str(Path(args.build).resolve()), "plan_sha256": plan_hash,
                           **(trainer.state_dict(step) if trainer is not None else {})})
    return time.perf_counter() - t0


def _resume_point(args: argparse.Namespace, rank: int) -> Path | None:
    """The checkpoint to start from (None: step 0); rank 0 says which damaged ones it skipped.

    Raises:
        CheckpointError: ``--resume`` without ``--checkpoint-dir``, or with nothing intact to resume from.
    """
    if args.resume is ResumeMode.NO:
        return None
    if args.checkpoint_dir is None:
        raise CheckpointError("--resume needs --checkpoint-dir DIR (the folder the checkpoints were written to)")
    log = _say if rank == 0 else (lambda _line: None)
    if args.resume is ResumeMode.IF_ANY:
        return latest(args.checkpoint_dir, log=log)
    return resume_from(args.checkpoint_dir, log=log)


def _env_seconds(name: str) -> float | None:
    """A number of seconds from the environment variable ``name``, or None when it is not set."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise HpmlError(f"{name}={text!r}: expected a number of seconds, e.g. {name}=0.5") from None
    if value < 0:
        raise HpmlError(f"{name}={text!r}: a cost cannot be negative; give 0 or more seconds")
    return value


def _train(args: argparse.Namespace, rank: int, local_world: int) -> None:
    from .. import models  # the zoo: only a worker of a `compile`d build needs it

    recipe = read_recipe(args.build)
    threads = recipe.threads_per_rank or threads_per_rank(local_world)
    torch.set_num_threads(threads)
    loaded = models.load(recipe.model, batch_size=recipe.batch_size, seq_len=recipe.seq_len, seed=recipe.seed)
    spec = loaded.train  # a TrainSpec: train on its dataset (else on the example batch)
    optimizer = spec.optimizer if spec is not None and spec.optimizer is not None else _optimizer(args.optimizer,
                                                                                                   args.lr)
    pipe = Pipeline.from_build(args.build, loaded.module, init_method="env://",
                               weights=spec.weights if spec is not None else None,
                               retry=RetryPolicy(attempts=max(1, args.retries), timeout_s=args.timeout,
                                                 rejoin_timeout_s=min(RetryPolicy().rejoin_timeout_s, args.timeout)),
                               optimizer=optimizer, run_dir=args.run_dir,
                               tensorboard=args.tensorboard, faults=args.faults, log=_say,
                               comm_options={"compress": args.compress, "sync_every": args.sync_every,
                                             "sync_warmup": args.sync_warmup})
    trainer = Trainer(pipe, spec, run_dir=args.run_dir, log_samples=args.log_samples) if spec is not None else None
    pipe.trainer = trainer  # rows moved in place (the closed loop) reach its data loader
    seed_rngs(recipe.seed, rank)  # dropout draws the same masks in two runs; a resume restores the states
    start = 0
    found = _resume_point(args, rank)
    if found is not None:
        meta = load_checkpoint(found, pipe.local_module(), pipe.optimizer, scaler=pipe.scaler,
                               feedback=pipe.feedback(), log=_say)
        start = int(meta["step"])
        pipe.steps_done = start
        if trainer is not None:
            trainer.load_state_dict(meta, found)
    if args.rows_from is not None:  # rows the closed loop moved in place before a failure: in force from the start
        took = take_rows(pipe, args.rows_from)
        if rank == 0:
            _say("rows per replica from " + str(args.rows_from) + ", on every rank: " + " | ".join(
                ",".join(st.devices) + (f" rows {':'.join(map(str, st.rows))}" if st.rows else "")
                for st in took.stages))
    if rank == 0:
        plan = pipe.plan
        print(f"training {recipe.model} for {args.steps} steps on {pipe.world_size} ranks: "
              f"{len(plan.stages)} stages, {plan.microbatches} microbatches, {plan.schedule.value}, "
              f"{plan.precision.value}, "
              f"batch {recipe.batch_size}, {threads} thread(s) per rank"
              + (f"; resumed from {found} (step {start})" if found else ""), flush=True)
    t0 = time.perf_counter()
    kills = {step for step, r in args.kills if r == rank}
    hangs = {step for step, r in args.hangs if r == rank}
    adapter: Adapter | None = None
    live = _live(args, pipe) if rank == 0 else None
    loss_value: float | None = None
    switched = None
    for step in range(start, args.steps):
        if step + 1 in kills:
            _die(args.run_dir, rank, step + 1)
        if step + 1 in hangs:  # injected hang: the peers block on this rank until their time-out
            while True:
                time.sleep(3600)
        for r, factor, begin in args.slows:
            if r == rank and (begin == step + 1 or (step == start and begin <= start)):
                for module in pipe.stages.values():
                    _slow_down(module, factor)
        if trainer is not None:
            validate = bool(args.val_every) and ((step + 1) % args.val_every == 0 or step + 1 == args.steps)
            loss = trainer.step(validate=validate)
        else:
            loss = pipe.step(loaded.example_inputs, loaded.example_targets, loaded.loss_fn)
        loss_value = float(loss.item())
        if step == start and rank == 0:  # how long a (re)start took, for the supervisor's figures
            write_json_atomic({"launched_at": args.launched_at, "first_step_at": time.time(), "start_step": start,
                               "checkpoint": str(found) if found else None}, Path(args.run_dir) / PROGRESS_FILE)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            m = pipe.metrics[-1]
            print(f"step {step + 1:4d}/{args.steps}  loss {loss_value:9.4f}  {m.samples_per_s:8.1f} samples/s  "
                  f"{m.step_ms:8.1f} ms/step" + (f"  ({m.retries} retries)" if m.retries else ""), flush=True)
        if rank == 0 and pipe.metrics and pipe.metrics[-1].val_loss is not None:
            print(f"step {step + 1:4d}/{args.steps}  validation loss {pipe.metrics[-1].val_loss:9.4f}", flush=True)
        if live is not None:
            for alert in live[0].observe(live[1].read()):
                _say(f"ALERT {alert}")
        if args.adapt:
            if adapter is None:
                began = time.time() - args.launched_at if args.launched_at else time.perf_counter() - _STARTED
                adapter = Adapter(pipe, build_dir=args.build, run_dir=args.run_dir, total_steps=args.steps,
                                  startup_s=began, log=_say,
                                  options=AdaptOptions(threshold=args.adapt_threshold, patience=args.adapt_patience,
                                                       cooldown=args.adapt_cooldown,
                                                       # which candidates: a benchmark forces each (AdaptOptions)
                                                       candidates=os.environ.get("HPML_ADAPT_CANDIDATES", "both"),
                                                       switch_cost_s=_env_seconds("HPML_ADAPT_SWITCH_COST_S")))
            verdict = adapter.observe()
            if verdict is not None and verdict.restart:  # an in-place row move goes on here
                switched = verdict
        done = step + 1
        if args.checkpoint_dir and (switched or done == args.steps
                                    or (args.checkpoint_every and done % args.checkpoint_every == 0)):
            took = _save(args, pipe, done, loss_value, trainer)
            if adapter is not None:
                adapter.checkpoint_s = took
        if switched is not None:
            if rank == 0:
                write_json_atomic({"reason": "imbalance", "step": done, "build": switched.build,
                                   "event": switched.event}, Path(args.run_dir) / NEXT_FILE)
                print(f"step {done}: checkpointed; restarting on the new plan ({switched.build})", flush=True)
            break
    if trainer is not None:
        trainer.close()
    _collect_rows(pipe, args.run_dir)
    if rank == 0 and switched is None:
        print(f"done: {args.steps - start} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    pipe.close()


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one rank (started by torchrun; see the module docstring)."""
    args = parse_args(argv)
    env = env_rank()
    if env is None:
        raise SystemExit("hpml_compile.runtime.worker runs under torchrun: use `hpml-compile run BUILD`")
    rank, _, local_world = env
    watch_launcher(rank=rank)  # no orphan rank when the launcher is killed
    try:
        _train(args, rank, local_world)
    except Exception as e:
        path = error_path(args.run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        prefix = "" if isinstance(e, HpmlError) else f"{type(e).__name__}: "
        kind = "comm" if isinstance(e, CommFailure) else "user" if isinstance(e, HpmlError) else "crash"
        path.write_text(json.dumps({"rank": rank, "time": time.time(), "message": f"{prefix}{e}", "kind": kind,
                                    "user_error": kind == "user"}))
        if isinstance(e, HpmlError):  # the launcher prints the message, naming the rank that failed first
            # os._exit, not sys.exit: an orderly interpreter exit destroys the threads gloo still runs for the
            # failed group ("terminate called without an active exception"), and the rank then dies by SIGABRT,
            # which the launcher reads as a killed rank (its device dropped, a re-plan) instead of this failure;
            # what the rank wrote is on disk already (the per-step files are flushed as they are written)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
