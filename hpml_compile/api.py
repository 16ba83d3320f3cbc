"""The Python API: ``hpml_compile.compile(model, example_inputs, ...)`` -> a :class:`~.pipeline.Pipeline`.

:func:`hpml_compile.driver.compile` is the flat list of passes (trace,
profile, costgraph, solve, codegen) that ``hpml-compile compile`` runs too.
:func:`compile` runs it on rank 0 of the job and ships the build to the other ranks through the
process group (text files; every rank checks the hashes on load), so all
ranks run the very same plan whatever their clocks measured. Without
torchrun (no ``WORLD_SIZE``) everything runs in this process.

In a script started with ``torchrun --nproc-per-node 2 train.py``::

    model = MyModel()                       # the same model, from the same seed, on every rank
    pipe = hpml_compile.compile(model, (x,), cluster="local-cpu-2",
                                optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    for x, y in batches:                    # the same batches on every rank
        loss = pipe.step((x,), y, loss_fn)  # microbatched, 1F1B or GPipe as planned
    state = pipe.state_dict()               # the full model, original names

Example:
    >>> import torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    >>> x, y = torch.randn(8, 8), torch.randn(8, 1)
    >>> pipe = compile(model, (x,), cluster="local-cpu-2", microbatches=2, solver="dp", profile_repeats=1,
    ...                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05))
    >>> first = pipe.step((x,), y, torch.nn.functional.mse_loss).item()
    >>> pipe.step((x,), y, torch.nn.functional.mse_loss).item() < first
    True
"""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import driver
from .cluster import load_cluster
from .codegen import load_build
from .codegen.build import sha256
from .ir import Cluster, Precision
from .driver import SolverName
from .errors import ModelError
from .plan import Schedule
from .profile.process import this_host
from .schedule import stage_ranks
from .trainspec import TrainSpec, batch_input_names, first_batch
from .runtime.execute.weights import load_stage_weights
from .runtime.execute.compiled import CompileStages, priced_compiled
from .runtime.execute.pipeline import OptimizerArg, Pipeline
from .runtime.execute.session import RetryPolicy, Session

__all__ = ["compile"]


def _ship(src: Path | None, rank: int) -> Path:
    """Rank 0's build folder on every rank: the same path when this host sees it, else a private copy."""
    files: list[Any] = [None]
    if rank == 0:
        assert src is not None
        files[0] = {p.name: p.read_bytes() for p in sorted(src.iterdir()) if p.is_file()}
        files[0]["\0path"] = str(src.resolve()).encode()
    dist.broadcast_object_list(files, src=0)  # text files in memory; load_build re-checks every hash
    shipped: dict[str, bytes] = files[0]
    path = Path(shipped.pop("\0path").decode())
    manifest = path / "manifest.json"
    if rank == 0 or (manifest.is_file() and sha256(manifest.read_bytes()) == sha256(shipped["manifest.json"])):
        return path
    mine = Path(tempfile.mkdtemp(prefix=f"hpml-build-rank{rank}-"))
    for name, data in shipped.items():
        (mine / name).write_bytes(data)
    return mine


def _unpack(model: nn.Module | TrainSpec, example_inputs: Sequence[Any] | torch.Tensor | None,
            optimizer: OptimizerArg) -> tuple[nn.Module, tuple[Any, ...], OptimizerArg]:
    """The module, its example inputs and optimizer: a TrainSpec's own where it gives them and the caller did not.

    Raises:
        ModelError: a plain module without example inputs.
    """
    if isinstance(model, TrainSpec):
        spec = model
        model = spec.module
        if example_inputs is None:
            example_inputs = first_batch(spec)[0]
        if optimizer is None:
            optimizer = spec.optimizer
    if example_inputs is None:
        raise ModelError("compile(model) needs example_inputs (one training batch's positional inputs), or pass "
                         "an hpml_compile.TrainSpec, whose dataset's first batch is used")
    return model, ((example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)), optimizer


def compile(model: nn.Module | TrainSpec, example_inputs: Sequence[Any] | torch.Tensor | None = None, *,  # noqa: A001
            cluster: str | Cluster | None = None, optimizer: OptimizerArg = None,
            schedule: Schedule | str = Schedule.ONE_F_ONE_B, microbatches: int | None = None,
            solver: SolverName | str = SolverName.ILP, out_dir: str | Path | None = None,
            run_dir: str | Path | None = None, time_limit_s: float = 30.0, profile_repeats: int = 3,
            name: str | None = None, retry: RetryPolicy = RetryPolicy(),
            log: Callable[[str], None] | None = None, precision: Precision | str = Precision.FP32,
            compress: str | None = None, allow_compress: str | None = None, sync_every: int = 1,
            sync_warmup: int = 0, compile_stages: str | bool | None = None,
            reduce_dtype: Precision | str = Precision.FP32, corun: bool | None = None) -> Pipeline:
    """Compile ``model`` for ``cluster`` and return the pipeline that trains it; call on every rank.

    Args:
        model: the model, built identically (same seed) on every rank; or a :class:`~hpml_compile.TrainSpec`,
            whose dataset's first batch is the example batch and whose optimizer is the default one (the
            pipeline's ``trainer`` then trains on its dataset: ``pipe.trainer.step()``).
        example_inputs: positional inputs of one training batch (fixes the batch and microbatch sizes); taken
            from a TrainSpec's first batch when None.
        cluster: a built-in name, a cluster.json path or a Cluster (default ``local-cpu-<world size>``).
        optimizer: an optimizer over ``model.parameters()``, or a factory called with each rank's parameters.
        schedule: ``1f1b`` or ``gpipe``.
        microbatches: fixed microbatch count (default: searched by the solver).
        solver: which solver (``ilp``, ``dp``, baselines).
        out_dir: where rank 0 writes the build (default: a temporary folder).
        run_dir: where every rank writes its per-step measurements (default: none written).
        time_limit_s: solver time limit.
        profile_repeats: timed runs per node while profiling.
        name: the model's name in the files.
        retry: how transient communication errors are retried.
        log: progress lines (default: none).
        precision: ``fp32``, ``bf16`` or ``fp16``: profiled, planned and trained under autocast to that dtype
            with fp32 master weights (:mod:`hpml_compile.precision`); fp16 adds loss scaling.
        compress: gradient compression on every replicated stage, ``powersgd:RANK`` or ``topk:RATIO``
            (:mod:`hpml_compile.compression`).
        allow_compress: a compression the solver may choose, stage by stage, where it makes the step faster.
        sync_every: local SGD: the replicas step on their own gradients and average parameters every H steps
            (1: plain data parallelism).
        sync_warmup: steps of per-step gradient sync before local SGD starts.
        compile_stages: ``auto`` (default: compiled on CUDA devices, not on CPUs), ``on`` or ``off``: each stage's
            forward and backward compiled by ``torch.compile`` (:mod:`hpml_compile.runtime.execute.compiled`).
            Where CPU stages will run compiled, the profile also times the model's blocks compiled and the plan
            is priced at those times (:mod:`hpml_compile.profile.compiled`).
        reduce_dtype: ``fp32`` (default), ``bf16``, or ``fp16`` under an fp16 plan: the dtype of the replicated
            stages' gradient all-reduce / reduce-scatter (half the bytes; :func:`hpml_compile.plan.check_reduce_dtype`).
        corun: time the blocks beside forked neighbours, as ranks sharing a host run (None: where CPU ranks share
            one, as ``compile``); False skips it, and the plan's times assume no slow-down from neighbours.

    Returns:
        The pipeline: ``step``, ``eval_forward``, ``state_dict``.

    Raises:
        OptionError: ``precision`` is not one of fp32, bf16, fp16, or ``compile_stages`` not one of auto, on,
            off, or on with ``schedule`` zb-h1 (before anything runs).
        HpmlError: a model that cannot be compiled for ``cluster``, or a world that does not fit its plan.
        ModelError: no example inputs for a plain module, or a TrainSpec whose batch does not split as planned.
    """
    prec = Precision.parse(precision, "precision")
    compiled = CompileStages.parse(compile_stages)
    opts = driver.Options(solver=solver, microbatches=microbatches, schedule=schedule, time_limit_s=time_limit_s,
                          precision=prec, compress=compress, allow_compress=allow_compress, sync_every=sync_every,
                          sync_warmup=sync_warmup, reduce_dtype=reduce_dtype,  # checked before anything runs
                          max_tp=1)  # this process group runs stages without tensor parallelism (run does)
    spec = model if isinstance(model, TrainSpec) else None
    names: tuple[str, ...] = batch_input_names(spec) if spec is not None else ()
    model, inputs, optimizer = _unpack(model, example_inputs, optimizer)
    distributed = dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1
    session = Session("env://", policy=retry, log=log) if distributed else None
    world = session.world_size if session else 1
    c = cluster if isinstance(cluster, Cluster) else load_cluster(cluster or f"local-cpu-{max(world, 1)}")
    rank = session.rank if session else 0
    # CPU stages that will run compiled are planned at their blocks' compiled times, which the profile measures
    timed = priced_compiled(compiled, c)
    opts = replace(opts, compiled=timed, compile_stages=compiled.value)  # recorded in the plan
    built: Path | None = None
    gm = None
    if rank == 0:
        folder = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="hpml-build-"))
        try:  # this host's link and a rank's baseline memory where compile/profile/demo measured them (cached):
            host = this_host(log=log or (lambda _line: None), measure=False)  # no processes started in a job
            if "process" in host and spec is not None and spec.weights is not None:
                host["process"] = {**host["process"], "stage_only": True}  # each rank builds only its stage
            build, gm = driver.compile(model, inputs, folder, cluster=c, name=name, say=log,
                                       opts=opts,
                                       prof_opts=driver.ProfileOptions(repeats=profile_repeats,
                                                                       input_names=names, link=host.get("link"),
                                                                       process=host.get("process"),
                                                                       compiled=timed, corun=corun))
        except BaseException:
            if session is not None:  # the others wait in the broadcast below: let them fail too
                session.close()
            raise
        built = build.out_dir
    where = _ship(built, rank) if session is not None else built
    assert where is not None
    build = load_build(where, model, graph_module=gm)
    if spec is not None and spec.weights is not None:  # each rank reads only its own stages' tensors
        ranks = stage_ranks(build.plan)
        load_stage_weights(model, [st for k, st in enumerate(build.stages) if session is None or rank in ranks[k]],
                           spec.weights)
    if session is None and sum(len(st.devices) for st in build.plan.stages) > 1 and log:
        log(f"no torchrun environment: all {len(build.plan.stages)} stages run in this process")
    if optimizer is None:  # what `run` would have trained with AdamW: say it, once, rather than train nothing
        warnings.warn("hpml_compile.compile: no optimizer given, so each step computes the loss and gradients and "
                      "leaves the weights as they are; pass optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3) "
                      "(or TrainSpec(optimizer=...)) to train", UserWarning, stacklevel=2)
    pipe = Pipeline(build, model, optimizer=optimizer, session=session, run_dir=run_dir, log=log,
                    compile_stages=compiled)
    if spec is not None:
        from .runtime.execute.trainer import Trainer

        pipe.trainer = Trainer(pipe, spec)
    return pipe
