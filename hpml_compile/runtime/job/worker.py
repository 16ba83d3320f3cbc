"""One rank of ``hpml-compile run``: what torchrun starts in each process (``rank_entry.py BUILD RUN_DIR``).

Each rank reads the run's options from ``RUN_DIR/run.json``
(:func:`~.options.read_options`, written once by the launcher), reads the
build's ``model.json`` (:mod:`hpml_compile.recipe`), builds the model from the
same seed as every other rank, loads the build (hashes checked, model
re-traced, stage code regenerated from plan.json), joins the job through
torchrun's environment (:class:`~hpml_compile.runtime.execute.pipeline.Pipeline`),
and trains (:func:`~.loop.train`): on a TrainSpec's dataset, or on the model's
example batch (a fixed batch, so the loss visibly falls). Rank 0 prints the
loss and throughput as it goes. Every rank writes its measurements into the
run folder; at the end rank 0 also writes the rows of ranks on other hosts,
so one run folder holds them all.

A rank that fails writes ``errors/rank<r>.txt`` (the message and the time)
so that the launcher can say which rank failed first and why.

Example:
    >>> import tempfile
    >>> from .options import write_options
    >>> run = RunFolder(Path(tempfile.mkdtemp()))
    >>> write_options(run, RunOptions(steps=3, optimizer=OptimizerName.SGD), {"build": "b"})
    >>> read_options(run).steps, read_options(run).optimizer is OptimizerName.SGD
    (3, True)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ...codegen.build import sha256
from ...errors import HpmlError
from ...recipe import ModelRecipe, read_recipe
from ..execute.checkpoint import CheckpointError, latest, load_checkpoint, resume_from, save_checkpoint, seed_rngs
from ..execute.tensor_parallel import checkpoint_view
from ..execute.pipeline import Pipeline
from ..execute.session import CommFailure, RetryPolicy, env_rank
from ..execute.trainer import Trainer
from ..execute.unallocated import parameters_unallocated, reserve_parameters
from ..observe.monitor import metrics_path
from ..observe.runfolder import RunFolder
from .adapt import take_rows
from .lifeline import watch_launcher
from .loop import observers_for, say, train
from .options import OptimizerName, ResumeMode, RunOptions, read_options

if TYPE_CHECKING:
    from ...models import LoadedModel

_STARTED = time.perf_counter()  # the process's start, near enough: the cost of a restart is measured from it

__all__ = ["RankRun", "start_rank", "main", "threads_per_rank", "resume_point"]


def threads_per_rank(local_world_size: int, cores: int | None = None) -> int:
    """Torch threads for each of ``local_world_size`` ranks sharing this host's cores."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, local_world_size))


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


def resume_point(options: RunOptions, rank: int) -> Path | None:
    """The checkpoint to start from (None: step 0); rank 0 says which damaged ones it skipped.

    Raises:
        CheckpointError: resuming without a checkpoint folder, or with nothing intact to resume from.
    """
    if options.resume is ResumeMode.NO:
        return None
    if options.checkpoint_dir is None:
        raise CheckpointError("--resume needs --checkpoint-dir DIR (the folder the checkpoints were written to)")
    log = say if rank == 0 else (lambda _line: None)
    if options.resume is ResumeMode.IF_ANY:
        return latest(options.checkpoint_dir, log=log)
    return resume_from(options.checkpoint_dir, log=log)


class RankRun:
    """One rank's steps (:class:`~.loop.Steps`): the pipeline, the data, and the checkpoints of a run.

    Args:
        pipe: the rank's pipeline.
        loaded: the model as loaded from the build's recipe (its example batch and loss).
        trainer: a TrainSpec's trainer, or None (train on the example batch).
        options: the run's options.
        build: the build folder.
        start: the first step (a resumed checkpoint's).
    """

    def __init__(self, pipe: Pipeline, loaded: Any, trainer: Trainer | None, options: RunOptions, build: Path,
                 start: int) -> None:
        self.pipe, self.loaded, self.trainer, self.options, self.build = pipe, loaded, trainer, options, build
        self.start, self.steps = start, options.steps

    def step(self, step: int) -> float:
        """Run step ``step``; return its loss."""
        if self.trainer is not None:
            every = self.options.val_every
            return float(self.trainer.step(validate=bool(every) and ((step + 1) % every == 0
                                                                     or step + 1 == self.steps)).item())
        ld = self.loaded
        return float(self.pipe.step(ld.example_inputs, ld.example_targets, ld.loss_fn).item())

    def checkpoint_due(self, done: int) -> bool:
        """At the end, and every ``checkpoint_every`` steps."""
        every = self.options.checkpoint_every
        return done == self.steps or bool(every and done % every == 0)

    def checkpoint(self, done: int, loss: float) -> float | None:
        """Checkpoint ``done`` steps on every rank; the seconds it took (None: this run keeps none)."""
        if self.options.checkpoint_dir is None:
            return None
        t0 = time.perf_counter()
        pipe, trainer = self.pipe, self.trainer
        with checkpoint_view(pipe) as writes:  # tensor-parallel slices whole (stored once)
            if writes:
                save_checkpoint(self.options.checkpoint_dir, done, pipe.local_module(), pipe.optimizer,
                                keep=self.options.keep, scaler=pipe.scaler, feedback=pipe.feedback(),
                                extra={"loss": loss, "build": str(self.build.resolve()),
                                       "plan_sha256": sha256((self.build / "plan.json").read_bytes()),
                                       **(trainer.state_dict(done) if trainer is not None else {})})
        return time.perf_counter() - t0


def _load_model(recipe: ModelRecipe) -> LoadedModel:
    """The build's model, its parameters unallocated until this rank's stage loads them from saved weights.

    The model is built first without its parameters' memory (:mod:`..execute.unallocated`); when its
    ``TrainSpec`` names saved weights, each parameter gets unwritten storage, and only the stage this
    rank runs is written (``Pipeline.from_build`` loads it), so a model larger than one rank's memory
    runs. A model without saved weights (random initialisation) is built again, whole, as the compile
    built it: its initial values are the constructor's. So is a model whose constructor needs its
    parameters' values (reading a meta tensor raises).
    """
    from ... import models  # the zoo: only a worker of a `compile`d build needs it

    def load() -> LoadedModel:
        return models.load(recipe.model, batch_size=recipe.batch_size, seq_len=recipe.seq_len, seed=recipe.seed)

    try:
        with parameters_unallocated():
            loaded = load()
    except Exception:  # a constructor that computes with its parameters' values: built whole, as before
        return load()
    if loaded.train is None or loaded.train.weights is None:
        return load()
    reserve_parameters(loaded.module)
    return loaded


def start_rank(build: Path, run: RunFolder, options: RunOptions, rank: int, local_world: int
               ) -> tuple[RankRun, Path | None]:
    """Load the build, join the job, and resume: the rank's steps, and the checkpoint they start from.

    Args:
        build: the build folder.
        run: the run folder.
        options: the run's options.
        rank: this rank.
        local_world: ranks on this host (they share its cores).

    Returns:
        The rank's steps, and the checkpoint it resumed from (None: step 0).
    """
    recipe = read_recipe(build)
    threads = recipe.threads_per_rank or threads_per_rank(local_world)
    torch.set_num_threads(threads)
    loaded = _load_model(recipe)
    spec = loaded.train  # a TrainSpec: train on its dataset (else on the example batch)
    o = options
    optimizer = spec.optimizer if spec is not None and spec.optimizer is not None else _optimizer(o.optimizer, o.lr)
    retry = RetryPolicy(attempts=max(1, o.retries), timeout_s=o.timeout_s,
                        rejoin_timeout_s=min(RetryPolicy().rejoin_timeout_s, o.timeout_s))
    pipe = Pipeline.from_build(build, loaded.module, init_method="env://", retry=retry, optimizer=optimizer,
                               weights=spec.weights if spec is not None else None,
                               run_dir=run.path, tensorboard=o.tensorboard, faults=o.faults.comm, log=say,
                               comm_options=o.comm_options, compile_stages=o.compile_stages, live=o.live)
    trainer = Trainer(pipe, spec, run_dir=run.path, log_samples=o.log_samples) if spec is not None else None
    pipe.trainer = trainer  # rows moved in place (the closed loop) reach its data loader
    seed_rngs(recipe.seed, rank)  # dropout draws the same masks in two runs; a resume restores the states
    start, found = 0, resume_point(o, rank)
    if found is not None:
        with checkpoint_view(pipe):
            meta = load_checkpoint(found, pipe.local_module(), pipe.optimizer, scaler=pipe.scaler,
                                   feedback=pipe.feedback(), log=say)
        start = pipe.steps_done = int(meta["step"])
        if trainer is not None:
            trainer.load_state_dict(meta, found)
    if o.rows_from is not None:  # rows the closed loop moved in place before a failure: in force from the start
        took = take_rows(pipe, o.rows_from)
        if rank == 0:
            say(f"rows per replica from {o.rows_from}, on every rank: " + " | ".join(
                ",".join(st.devices) + (f" rows {':'.join(map(str, st.rows))}" if st.rows else "")
                for st in took.stages))
    if rank == 0:
        plan = pipe.plan
        ranks = pipe.world_size
        print(f"training {recipe.model} for {o.steps} steps on {ranks} ranks: {len(plan.stages)} stages, "
              f"{plan.microbatches} microbatches, {plan.schedule.value}, {plan.precision.value}, batch "
              f"{recipe.batch_size}, {threads} thread(s) per rank"
              + (f"; resumed from {found} (step {start})" if found else ""), flush=True)
    return RankRun(pipe, loaded, trainer, o, build, start), found


def _train(build: Path, run: RunFolder, rank: int, local_world: int) -> None:
    options = read_options(run)
    steps, found = start_rank(build, run, options, rank, local_world)
    observers = observers_for(steps.pipe, options, run, build=build, start=steps.start, resumed=found,
                              started=_STARTED)
    train(steps, observers)
    if steps.trainer is not None:
        steps.trainer.close()
    _collect_rows(steps.pipe, run.path)
    steps.pipe.close()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The rank's command line: the build and the run folder (the options are the folder's ``run.json``)."""
    p = argparse.ArgumentParser(prog="rank_entry.py", description="one rank of `hpml-compile run`")
    p.add_argument("build", type=Path)
    p.add_argument("run_dir", type=Path)
    return p.parse_args(argv)


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one rank (started by torchrun; see the module docstring)."""
    args = parse_args(argv)
    env = env_rank()
    if env is None:
        raise SystemExit("hpml_compile.runtime.job.worker runs under torchrun: use `hpml-compile run BUILD`")
    rank, _, local_world = env
    watch_launcher(rank=rank)  # no orphan rank when the launcher is killed
    run = RunFolder(args.run_dir)
    try:
        _train(args.build, run, rank, local_world)
    except Exception as e:
        prefix = "" if isinstance(e, HpmlError) else f"{type(e).__name__}: "
        kind = "comm" if isinstance(e, CommFailure) else "user" if isinstance(e, HpmlError) else "crash"
        run.write_error(rank, f"{prefix}{e}", kind=kind)
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
