"""The Python API: ``hpml_compile.compile(model, example_inputs, ...)`` -> a :class:`~.pipeline.Pipeline`.

:func:`compile_build` is the flat list of passes (trace, profile, costgraph,
solve, codegen) that ``hpml-compile compile`` runs too. :func:`compile` runs
it on rank 0 of the job and ships the build to the other ranks through the
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
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from ..cluster import check_devices_costed, load_cluster
from ..codegen import Build, generate, load_build
from ..codegen.build import sha256
from ..costgraph import build as build_costgraph
from ..errors import BuildMismatchError, HpmlError
from ..ir import Cluster, FrontEnd, Profile
from ..plan import Plan, Schedule, validate_plan
from ..profile import profile
from ..solve import SolverName, solve
from ..trace import trace
from .pipeline import OptimizerArg, Pipeline
from .session import RetryPolicy, Session

__all__ = ["compile", "compile_build", "local_threads", "rebuild"]


def local_threads(cluster: Cluster, cores: int | None = None) -> int | None:
    """Torch threads per rank when every device of ``cluster`` is a CPU process on this host, else None.

    The ranks share this host's cores, so the plan must be profiled at the
    thread count each rank will have (``cores // ranks``), not at all of them.
    """
    if all(d.is_cpu and d.host in ("localhost", "127.0.0.1") for d in cluster.devices):
        return max(1, (cores or os.cpu_count() or 1) // len(cluster.devices))
    return None


def _first_rows(inputs: tuple[Any, ...], rows: int) -> tuple[Any, ...]:
    return tuple(x[:rows] if isinstance(x, torch.Tensor) and x.dim() else x for x in inputs)


def compile_build(module: nn.Module, example_inputs: Sequence[Any], out_dir: str | Path, *, cluster: Cluster,
                  name: str | None = None, solver: SolverName | str = SolverName.ILP,
                  microbatches: int | None = None, schedule: Schedule | str = Schedule.ONE_F_ONE_B,
                  time_limit_s: float = 30.0, batch_size: int | None = None, seq_len: int | None = None,
                  repeats: int = 3, warmup: int = 1, leaf_modules: Sequence[type | str] = (),
                  front_end: FrontEnd | str = FrontEnd.AUTO,
                  say: Callable[[str], None] | None = None) -> tuple[Build, fx.GraphModule]:
    """Trace, profile, plan and generate: the passes in order, each checked.

    Args:
        module: the model.
        example_inputs: positional inputs of one training batch.
        out_dir: the build folder to write.
        cluster: the devices.
        name: the model's name in the files (default: its class name).
        solver, microbatches, schedule, time_limit_s: for :func:`hpml_compile.solve.solve`.
        batch_size, seq_len: recorded in the profile.
        repeats, warmup: profiling runs per node.
        leaf_modules, front_end: for :func:`hpml_compile.trace`.
        say: progress lines.

    Returns:
        The build (bound to ``module``) and the graph it was generated from.

    Raises:
        HpmlError: a model that cannot be traced, fits nowhere, or cannot be split as planned.
    """
    tell = say or (lambda line: None)
    inputs = tuple(example_inputs)
    label = name or type(module).__name__
    kinds = ["cpu", *sorted({d.kind for d in cluster.devices} - {"cpu"})]
    tell(f"[1/4] tracing {label}")
    gm = trace(module, inputs, leaf_modules=leaf_modules, front_end=front_end)                 # 1. graph
    tell(f"[2/4] profiling {len(gm.graph.nodes)} nodes on the CPU ({torch.get_num_threads()} thread(s)); "
         f"predicting {', '.join(kinds[1:]) or 'nothing else'}")
    prof = profile(gm, inputs, name=label, device_kinds=kinds, batch_size=batch_size, seq_len=seq_len,
                   repeats=repeats, warmup=warmup, progress=False)                              # 2. costs
    check_devices_costed(cluster, prof.device_kinds)
    tell(f"[3/4] planning on {cluster.name} ({len(cluster.devices)} devices) with {SolverName(solver).value}")
    plan = solve(build_costgraph(prof).coarsen(), cluster, solver=solver, microbatches=microbatches,
                 schedule=Schedule(schedule), time_limit_s=time_limit_s, dtype=prof.dtype, progress=say)  # 3. plan
    tell(f"[4/4] generating {len(plan.stages)} stage(s) into {out_dir}")
    return generate_for_plan(module, inputs, gm, plan, prof, out_dir, label)                   # 4. code


def generate_for_plan(module: nn.Module, inputs: tuple[Any, ...], gm: fx.GraphModule, plan: Plan, prof: Profile,
                      out_dir: str | Path, label: str) -> tuple[Build, fx.GraphModule]:
    """Generate the build of ``plan`` (checked against ``prof``) from the traced ``gm``.

    torch.export fixes every shape, so an exported model is traced again at the
    size one replica of one stage runs (a slice of a microbatch).

    Raises:
        HpmlError: the plan breaks a rule of the profile, or an exported model cannot run at that size.
    """
    validate_plan(plan, prof)
    graph = gm
    replicas = {len(st.devices) for st in plan.stages}
    if gm.meta.get("hpml_front_end") is FrontEnd.EXPORT and (plan.microbatches > 1 or replicas != {1}):
        if len(replicas) > 1:
            raise HpmlError(f"{label} traces with torch.export, whose shapes are fixed, but the plan gives its "
                            f"stages different replica counts {sorted(replicas)}; use a cluster or solver that "
                            "gives every stage the same number of devices")
        rows = prof.batch_size // (plan.microbatches * replicas.pop())
        graph = trace(module, _first_rows(inputs, rows), front_end=FrontEnd.EXPORT)
        if [n.name for n in graph.graph.nodes] != [n.name for n in gm.graph.nodes]:
            raise BuildMismatchError(
                f"{label}: torch.export gives a different graph at batch {rows} (one microbatch of one replica) "
                f"than at batch {prof.batch_size}: it specialises sizes 0 and 1. Use a batch giving at least 2 "
                "rows per microbatch and replica, or one microbatch")
    return generate(graph, plan, out_dir, profile=prof), graph


def rebuild(recipe_dir: str | Path, plan: Plan, prof: Profile, out_dir: str | Path) -> Build:
    """Generate the build of ``plan`` for the model that ``recipe_dir/model.json`` describes.

    What ``replan`` and the closed loop use: the model is built again from its
    recipe (same seed, batch, sequence length), traced the same way, and the
    new stage files go to ``out_dir`` with the recipe beside them.

    Raises:
        BuildMismatchError: ``recipe_dir`` has no (valid) model.json.
        HpmlError: the plan breaks a rule of the profile.
    """
    import shutil

    from .. import models
    from .recipe import read_recipe, write_recipe

    recipe = read_recipe(recipe_dir)
    loaded = models.load(recipe.model, batch_size=recipe.batch_size, seq_len=recipe.seq_len, seed=recipe.seed)
    gm = trace(loaded.module, loaded.example_inputs, leaf_modules=recipe.leaf_modules, front_end=recipe.front_end)
    out = Path(out_dir)
    if out.exists() and out.resolve() != Path(recipe_dir).resolve():
        shutil.rmtree(out)
    build, _ = generate_for_plan(loaded.module, loaded.example_inputs, gm, plan, prof, out, loaded.name)
    write_recipe(out, recipe)
    return build


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


def compile(model: nn.Module, example_inputs: Sequence[Any] | torch.Tensor, *,  # noqa: A001 -- the API's name
            cluster: str | Cluster | None = None, optimizer: OptimizerArg = None,
            schedule: Schedule | str = Schedule.ONE_F_ONE_B, microbatches: int | None = None,
            solver: SolverName | str = SolverName.ILP, out_dir: str | Path | None = None,
            run_dir: str | Path | None = None, time_limit_s: float = 30.0, profile_repeats: int = 3,
            name: str | None = None, retry: RetryPolicy = RetryPolicy(),
            log: Callable[[str], None] | None = None) -> Pipeline:
    """Compile ``model`` for ``cluster`` and return the pipeline that trains it; call on every rank.

    Args:
        model: the model, built identically (same seed) on every rank.
        example_inputs: positional inputs of one training batch (fixes the batch and microbatch sizes).
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

    Returns:
        The pipeline: ``step``, ``eval_forward``, ``state_dict``.

    Raises:
        HpmlError: a model that cannot be compiled for ``cluster``, or a world that does not fit its plan.
    """
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    distributed = dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1
    session = Session("env://", policy=retry, log=log) if distributed else None
    world = session.world_size if session else 1
    c = cluster if isinstance(cluster, Cluster) else load_cluster(cluster or f"local-cpu-{max(world, 1)}")
    rank = session.rank if session else 0
    built: Path | None = None
    gm = None
    if rank == 0:
        folder = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="hpml-build-"))
        try:
            build, gm = compile_build(model, inputs, folder, cluster=c, name=name, solver=solver,
                                      microbatches=microbatches, schedule=schedule, time_limit_s=time_limit_s,
                                      repeats=profile_repeats, say=log)
        except BaseException:
            if session is not None:  # the others wait in the broadcast below: let them fail too
                session.close()
            raise
        built = build.out_dir
    where = _ship(built, rank) if session is not None else built
    assert where is not None
    build = load_build(where, model, graph_module=gm)
    if session is None and sum(len(st.devices) for st in build.plan.stages) > 1 and log:
        log(f"no torchrun environment: all {len(build.plan.stages)} stages run in this process")
    return Pipeline(build, model, optimizer=optimizer, session=session, run_dir=run_dir, log=log)
