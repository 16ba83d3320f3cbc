"""The compiler driver: the flat, commented list of pass calls, and the only module that imports every pass.

Every way into the compiler goes through here: the CLIs (``compile``,
``plan``, ``replan``, ``demo``), the Python API (:func:`hpml_compile.compile`)
and the closed loop (an imbalance re-plan in :mod:`.runtime.job.adapt`, a failure
re-plan in :mod:`.runtime.job.supervisor`). None of them calls a pass by itself,
so a change to the chain is made once, here::

    compile:  model -> trace -> profile -> costgraph -> coarsen -> solve -> codegen -> Build
    plan:              profile -> costgraph -> coarsen -> solve -> uneven rows -> cores -> validate
                       -> certificate, assumptions -> Plan
    replan:   (old plan, measured profile, devices lost) -> costgraph -> coarsen -> solve
              -> the faster of old and new, scored on the same costs -> Plan (+ rebuild -> Build)

Between passes the driver checks the intermediate result (the graph lints,
the profile covers the cluster's device kinds, the coarsened graph keeps the
profile's total time, the plan passes :func:`~hpml_compile.plan.validate_plan`)
so that a broken pass is named where it broke, not three passes later. With
``dump_dir`` (or the environment variable ``HPML_DUMP``), each pass's output
is written there: ``1-graph.txt``, ``2-profile.json``, ``3-costgraph.json``,
``4-plan.json``; the build folder is the fifth.

Example:
    >>> import torch
    >>> from hpml_compile.cluster import load_cluster
    >>> from hpml_compile.profile import profile
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> cluster = load_cluster("local-cpu-2")  # CPU ranks of this host: profile at each rank's thread count
    >>> prof = profile(m, (torch.randn(4, 8),), repeats=1, progress=False, threads=local_threads(cluster))
    >>> p = plan(prof, cluster, Options(solver="dp", microbatches=1))
    >>> sorted(n for st in p.stages for n in st.nodes) == sorted(n.name for n in prof.nodes)
    True
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from .assumptions import assumptions
from .certify import certify
from .cluster import check_devices_costed, load_cluster
from .codegen import Build, check_build_dir, generate
from .codegen.tensor_parallel import tp_degree
from .costgraph import CostGraph
from .costgraph import build as build_costgraph
from .errors import BuildMismatchError, HpmlError, OptionError, PlanError
from .ir import Cluster, FrontEnd, Link, Precision, Profile, base_kind
from .compression import check_sync, parse_compress
from .memory import compute_bytes
from .plan import COMPILE_STAGES, Plan, Schedule, ZeroStage, check_wire, fit_deferral, save_plan, validate_plan, with_comm
from .profile import predict_kinds, profile, save_profile
from .profile.process import with_process
from .recipe import ModelRecipe, read_recipe
from .replan import ReplanResult, carried_comm, move_rows as move_plan_rows, replan_graph, without_devices
from .schema import write_json_atomic
from .simulate import annotate, crowded_devices
from .solve import SolverName, solve
from .solve.interleave import BUDGET_S, choose as choose_chunks
from .solve.uneven import improve as improve_uneven
from .trace import fixed_shapes, trace
from .tp import MAX_TP, TP_DEGREES

__all__ = ["Options", "ProfileOptions", "compile", "plan", "replan", "move_rows", "with_link", "profile_links",
           "rebuild", "cost_graph", "local_threads",
           "check_microbatches", "check_threads", "check_precision", "faster_schedule", "AUTO_SCHEDULE",
           "INTERLEAVE_IN_AUTO", "roomy_placement"]

Say = Callable[[str], None]

#: The most seconds the uneven-rows search (:func:`hpml_compile.solve.uneven.improve`) adds after the solver
#: (less when the solver's own time limit is shorter); it says how far it got within them.
UNEVEN_BUDGET_S = 10.0

#: ``--schedule auto``: 1F1B, or ZB-H1 on the solver's placement where it is faster (:func:`faster_schedule`).
AUTO_SCHEDULE = "auto"

#: Whether ``--schedule auto`` also weighs interleaved 1F1B on the solver's device groups
#: (:func:`hpml_compile.solve.interleave.choose`), kept where it simulates faster and fits; ``--schedule
#: interleaved-1f1b`` asks for it, and :attr:`Options.interleave` turns it on or off for one plan.
INTERLEAVE_IN_AUTO = True
#: The seconds ``auto`` spends trying chunk counts (a forced ``interleaved-1f1b`` spends up to
#: :data:`hpml_compile.solve.interleave.BUDGET_S`), so that the plan command stays within its printed budget.
AUTO_BUDGET_S = 10.0
#: The most seconds the solve of a placement with room for interleaving's microbatches takes
#: (:func:`roomy_placement`; the solver's own time limit where shorter).
ROOM_LIMIT_S = 10.0


@dataclass(frozen=True, slots=True)
class Options:
    """How to solve: what every entry point passes to :func:`plan`, :func:`compile` and :func:`replan`.

    Attributes:
        solver: which solver (``ilp``, ``dp``, or a baseline).
        microbatches: ``M``; None searches the solver's choices (a re-plan keeps the old plan's).
        schedule: GPipe, 1F1B, ZB-H1 or interleaved 1F1B (a re-plan keeps the old plan's unless given); ``"auto"``:
            1F1B, or ZB-H1 on the same placement where it simulates faster and fits (:func:`faster_schedule`), or
            interleaved 1F1B on its device groups where :attr:`interleave` says so and it is faster still.
            Interleaved 1F1B solves a 1F1B pipeline first, then chooses the chunks
            (:func:`hpml_compile.solve.interleave.choose`).
        time_limit_s: the ILP's time limit.
        dump_dir: write each pass's output here (default: ``$HPML_DUMP``, else nothing).
        uneven: after solving, also try plans whose stages mix device kinds with uneven rows per replica
            (:mod:`hpml_compile.solve.uneven`) and keep the fastest (never slower than the solver's own), within
            a budget of :data:`UNEVEN_BUDGET_S` seconds (or the time limit, if shorter) that it reports against.
        hierarchical: let a stage whose replicas span hosts all-reduce hierarchically where faster (exact).
        precision: ``fp32``, ``bf16`` or ``fp16`` (:class:`~hpml_compile.ir.Precision`): what :func:`compile`
            profiles and trains in; for :func:`plan` and :func:`replan`, what the profile (the running plan)
            must be in. None: fp32 for :func:`compile`, the profile's (the old plan's) otherwise.
        compress: gradient compression on every replicated ZeRO-0 stage (``powersgd:RANK`` / ``topk:RATIO``,
            :mod:`hpml_compile.compression`), whatever it costs; None: none unless allowed.
        allow_compress: a compression the solver may choose per stage where it makes the step faster.
        sync_every: local SGD: average the replicas' parameters every H steps (1: plain data parallelism).
        sync_warmup: steps of per-step gradient sync before local SGD starts.
        reduce_dtype: the dtype the gradient all-reduce / reduce-scatter of replicated stages runs in (``bf16``,
            ``fp16`` under an fp16 plan; :func:`hpml_compile.plan.check_reduce_dtype`), priced by the simulator;
            None: fp32 (a re-plan keeps the old plan's).
        every_device: give every device of the cluster work. By default (``ilp`` and ``dp``), where a host has
            more CPU devices than the profile's cores, the plan uses only as many of them as there are cores, the
            rest idle (:func:`within_cores`), unless nothing fits on those.
        max_tp: the largest tensor-parallel degree a stage may take (1, 2, 4 or 8; :mod:`hpml_compile.tp`).
            :func:`compile` plans again with 1 where the solver combines tp with swap or offload, or gives
            stages that share a tied parameter different degrees, which the runtime does not run
            (:func:`hpml_compile.codegen.tensor_parallel.tp_degree`); :func:`replan` plans with 1.
        compiled: the stages will run compiled by ``torch.compile``: the kinds whose blocks the profile timed
            compiled (:mod:`hpml_compile.profile.compiled`) are priced at those times
            (:func:`hpml_compile.costgraph.build`), and the plan's assumptions say so. Implies
            ``compile_stages="on"``.
        compile_stages: how the stages are to run, recorded in the plan (:attr:`hpml_compile.plan.Plan.compile_stages`,
            which ``hpml-compile run`` follows): ``auto`` (compiled on CUDA devices, not on CPUs), ``on`` or
            ``off``. Under ``on`` the schedule chooser keeps 1F1B (a compiled stage runs no ZB-H1).
        interleave: whether ``"auto"`` weighs interleaved 1F1B too (None: :data:`INTERLEAVE_IN_AUTO`).
    """

    solver: SolverName | str = SolverName.ILP
    microbatches: int | None = None
    schedule: Schedule | str | None = None
    time_limit_s: float = 30.0
    dump_dir: str | Path | None = None
    precision: Precision | str | None = None
    uneven: bool = True
    hierarchical: bool = True
    compress: str | None = None
    allow_compress: str | None = None
    sync_every: int = 1
    sync_warmup: int = 0
    reduce_dtype: Precision | str | None = None
    every_device: bool = False
    max_tp: int = MAX_TP
    choose_schedule: bool = False  # set from ``schedule="auto"``
    compiled: bool = False
    compile_stages: str = "auto"
    interleave: bool | None = None

    def __post_init__(self) -> None:
        if self.compile_stages not in COMPILE_STAGES:
            raise OptionError(f"--compile-stages {self.compile_stages}: give one of {', '.join(COMPILE_STAGES)}")
        if self.compiled and self.compile_stages == "off":
            raise OptionError("compiled=True prices stages that run compiled, but compile_stages is off; give "
                              "compile_stages on (or leave compiled out)")
        if self.compiled:
            object.__setattr__(self, "compile_stages", "on")
        if self.schedule == AUTO_SCHEDULE:
            object.__setattr__(self, "schedule", None)
            object.__setattr__(self, "choose_schedule", True)
        if self.max_tp not in (1, *TP_DEGREES):
            raise OptionError(f"--max-tp {self.max_tp}: give 1 (no tensor parallelism) or one of "
                              f"{', '.join(map(str, TP_DEGREES))}")
        object.__setattr__(self, "solver", SolverName(self.solver))
        parse_compress(self.compress, "--compress")  # OptionError naming the forms, before any work
        parse_compress(self.allow_compress, "--allow-compress")
        check_sync(self.sync_every, self.sync_warmup)
        if self.compress and self.allow_compress:
            raise OptionError(f"--compress {self.compress} and --allow-compress {self.allow_compress}: give one "
                              "(--compress puts it on every replicated stage; --allow-compress lets the solver choose)")
        if self.sync_every > 1 and (self.compress or self.allow_compress):
            raise OptionError(f"--sync-every {self.sync_every} with compression: local SGD sends no gradients "
                              "between its averages, so there is nothing to compress; choose one")
        if self.precision is not None:
            object.__setattr__(self, "precision", Precision.parse(self.precision, "precision"))
        if self.reduce_dtype is not None:
            wire = Precision.parse(self.reduce_dtype, "--reduce-dtype")
            object.__setattr__(self, "reduce_dtype", wire)
            if wire is not Precision.FP32 and (self.compress or self.allow_compress or self.sync_every > 1):
                raise OptionError(f"--reduce-dtype {wire.value} with compression or local SGD: those send payloads "
                                  "of their own (compressed gradients, averaged parameters), not the dense gradient "
                                  "sum a reduce dtype applies to; choose one")
        if self.schedule is not None:
            object.__setattr__(self, "schedule", Schedule(self.schedule))
        if self.schedule is Schedule.ZB_H1 and self.compile_stages == "on":
            raise OptionError("--compile-stages on with --schedule zb-h1: zero bubble splits each backward into its "
                              "input- and weight-gradient parts at autograd's nodes, which a compiled stage hides in "
                              "one node; give --schedule 1f1b (or auto), or --compile-stages auto/off")
        if self.microbatches is not None and self.microbatches < 1:
            raise HpmlError(f"microbatches must be >= 1, got {self.microbatches}")
        if not (self.time_limit_s > 0 and math.isfinite(self.time_limit_s)):
            raise HpmlError(f"the solver's time limit must be a positive number of seconds, got {self.time_limit_s}")

    @property
    def dump(self) -> Path | None:
        """Where pass outputs are dumped, or None."""
        where = self.dump_dir if self.dump_dir is not None else os.environ.get("HPML_DUMP") or None
        return Path(where) if where else None


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    """How to trace and measure a model (what :func:`compile` passes to trace and profile).

    Attributes:
        repeats: timed runs per node.
        warmup: untimed runs per node first.
        batch_size: recorded in the profile (default: the inputs' first dimension).
        seq_len: recorded in the profile.
        leaf_modules: modules kept as one opaque node.
        front_end: fx, torch.export or auto.
        input_names: the names the inputs go to the model under, by keyword (``()``: positional).
        link: the link between two CPU processes of this host, measured by the caller
            (:func:`hpml_compile.profile.links.measure_local_link`; the driver never starts processes), recorded
            in the profile (:func:`with_link`); None: not measured.
        process: what a CPU rank of this host holds before its model, measured by the caller
            (:func:`hpml_compile.profile.process.this_host`), recorded in the profile for the memory model
            (:func:`hpml_compile.profile.process.with_process`); None: not measured (not counted).
        corun: also time the blocks while other processes run them on the other cores
            (:func:`hpml_compile.profile.corun.time_corun`: CPU ranks of one host share its caches and memory
            bandwidth); None: where the cluster puts two or more CPU ranks on this host.
        compiled: also time the blocks compiled by ``torch.compile`` on the CPU
            (:mod:`hpml_compile.profile.compiled`), for stages that will run compiled.
    """

    repeats: int = 3
    warmup: int = 1
    batch_size: int | None = None
    seq_len: int | None = None
    leaf_modules: Sequence[type | str] = field(default_factory=tuple)
    front_end: FrontEnd | str = FrontEnd.AUTO
    input_names: Sequence[str] = ()
    link: Mapping[str, Any] | None = None
    corun: bool | None = None
    process: Mapping[str, Any] | None = None
    compiled: bool = False


def with_link(prof: Profile, link: Mapping[str, Any]) -> Profile:
    """``prof`` with ``link`` recorded as the link between two CPU processes of the host it was measured on
    (``devices["cpu"]["link"]``), which :func:`profile_links` gives the plans made from it."""
    devices = {k: dict(v) for k, v in prof.devices.items()}
    devices.setdefault("cpu", {})["link"] = dict(link)
    return replace(prof, devices=devices)


def profile_links(cluster: Cluster, prof: Profile) -> Cluster:
    """``cluster`` with the profile's measured CPU link (:func:`with_link`) between every two CPU devices of one
    host that it names no link between; the cluster itself when the profile has none.

    A link the cluster names (a cluster.json of ``devices --measure``, or written by hand) is kept: it was
    measured or chosen for those very devices.
    """
    link = (prof.devices.get("cpu") or {}).get("link")
    if not link:
        return cluster
    named = {frozenset((x.a, x.b)) for x in cluster.links}
    cpus = [d for d in cluster.devices if d.is_cpu]
    extra = tuple(Link.from_dict({"a": a.name, "b": b.name, "source": "measured by profile", **link})
                  for i, a in enumerate(cpus) for b in cpus[i + 1:]
                  if a.host == b.host and frozenset((a.name, b.name)) not in named)
    return replace(cluster, links=(*cluster.links, *extra)) if extra else cluster


def local_threads(cluster: Cluster, cores: int | None = None) -> int | None:
    """Torch threads per rank when every device of ``cluster`` is a CPU process on this host, else None.

    The ranks share this host's cores, so the plan must be profiled at the
    thread count each rank will have (``cores // ranks``), not at all of them.
    """
    if all(d.is_cpu and d.host in ("localhost", "127.0.0.1") for d in cluster.devices):
        return max(1, (cores or os.cpu_count() or 1) // len(cluster.devices))
    return None


def _corun(prof_opts: ProfileOptions, cluster: Cluster) -> bool:
    """Whether the profile times the co-run slow-down: asked, or two or more CPU ranks share this host."""
    if prof_opts.corun is not None:
        return prof_opts.corun
    local = [d for d in cluster.devices if d.is_cpu and d.host in ("localhost", "127.0.0.1")]
    return len(local) >= 2 and (os.cpu_count() or 1) >= 2


def check_microbatches(prof: Profile, microbatches: int | None) -> None:
    """Refuse a microbatch count that does not split the profile's batch into whole rows.

    A microbatch holds ``batch / M`` rows and a stage replicated ``d`` ways gives each replica ``1 / d`` of
    them (the solver replicates only where that divides), so ``M`` must divide the batch: 16 microbatches
    of a batch of 8 would be half rows.

    Args:
        prof: the profile (its ``batch_size``).
        microbatches: ``M``, or None (searched: only counts that divide are tried).

    Raises:
        OptionError: naming ``M``, the batch, and the largest count that works.
    """
    if microbatches is None:
        return
    batch = prof.batch_size
    if microbatches >= 1 and batch % microbatches == 0:
        return
    valid = [m for m in range(1, batch + 1) if batch % m == 0]
    best = max(m for m in valid if m <= max(1, microbatches))
    shown = ", ".join(map(str, valid)) if len(valid) <= 12 else f"{', '.join(map(str, valid[:11]))}, ..."
    bigger = max(1, microbatches) * -(-batch // max(1, microbatches))  # the next batch that M splits
    raise OptionError(f"microbatches (--microbatches) {microbatches}: expected a count that splits the profile's "
                      f"batch of {batch} rows into whole rows, a divisor of {batch} ({shown}): each microbatch holds "
                      f"{batch}/M rows and a stage's replicas split those again. The largest valid count "
                      f"{'is' if microbatches > batch else 'below it is'} {best}: pass --microbatches {best}, or "
                      f"profile a batch of {bigger} rows")


def check_threads(prof: Profile, cluster: Cluster, cores: int | None = None) -> None:
    """Refuse a CPU profile measured with another torch thread count than the cluster's local CPU ranks use.

    CPU times depend on the threads: a profile made with all cores' threads, planned for ranks of one
    thread each, predicted 296 ms for a step that ran in 4 ms. There is no honest way to rescale
    it (how an op speeds up with threads depends on the op and the size), so it is refused.

    Args:
        prof: the profile (its ``threads`` and whether the CPU was measured).
        cluster: the devices; only a cluster of CPU processes on this host is checked.
        cores: this host's cores (default: ``os.cpu_count()``).

    Raises:
        HpmlError: the counts differ (both named, and how to profile at the right one).

    Warns:
        UserWarning: a measured CPU profile that does not record its threads (written before the field).
    """
    want = local_threads(cluster, cores)
    if want is None or not prof.devices.get("cpu", {}).get("measured"):
        return  # not local CPU ranks, or CPU costs predicted from the catalog: no thread count in them
    if prof.threads is None:
        warnings.warn(f"the profile of {prof.model} does not say how many torch threads its CPU times were measured "
                      f"with (written before profiles recorded it); {cluster.name} runs each rank with {want}: "
                      "if it was measured with more, its times are too low. Profile again to be sure", stacklevel=3)
        return
    if prof.threads != want:
        raise HpmlError(f"the profile of {prof.model} was measured with {prof.threads} torch thread(s), but "
                        f"{cluster.name} runs {len(cluster.devices)} CPU ranks on this host's "
                        f"{cores or os.cpu_count()} cores with {want} thread(s) each, and CPU times change with the "
                        f"thread count: profile again with `hpml-compile profile MODEL --threads {want} ...` (or "
                        f"OMP_NUM_THREADS={want}), or compile the model with `hpml-compile compile`, which profiles "
                        "at the ranks' thread count")


def check_precision(prof: Profile, wanted: Precision | str | None, what: str = "the plan") -> None:
    """Refuse a profile timed in another precision than ``wanted`` (None: any).

    Raises:
        OptionError: naming both precisions and the two ways out.
    """
    if wanted is not None and Precision(wanted) is not prof.precision:
        w = Precision(wanted).value
        raise OptionError(f"--precision {w}: the profile of {prof.model} was timed in {prof.precision.value}, and "
                          f"{what} must train in the precision its profile measured (times and activation sizes "
                          f"differ): profile again with --precision {w}, or use --precision {prof.precision.value}")


def _dump(opts: Options, name: str, write: Callable[[Path], Any]) -> None:
    where = opts.dump
    if where is not None:
        where.mkdir(parents=True, exist_ok=True)
        write(where / name)


def _graph_json(cg: CostGraph) -> dict[str, Any]:
    """A cost graph as plain JSON for the dump: its order, each block's members and per-kind costs, its edges."""
    g = cg.graph
    return {"model": cg.model, "batch_size": cg.batch_size, "kinds": list(cg.kinds), "order": list(cg.order),
            "edges": [[a, b, int(g.edges[a, b].get("bytes", 0))] for a, b in g.edges],
            "totals_ms": {k: cg.total("", k) for k in cg.kinds}}


def cost_graph(prof: Profile, cluster: Cluster, opts: Options = Options()) -> tuple[Profile, CostGraph]:
    """Passes 3-4 for ``cluster``: predict the kinds the profile lacks, build the cost graph, coarsen it.

    Args:
        prof: a measured (or meta) profile.
        cluster: the devices the plan is for.
        opts: where to dump.

    Returns:
        The profile with every kind of ``cluster`` and the coarsened cost graph.

    Raises:
        UnknownDeviceError: a device kind that is neither in the profile nor in the catalog.
        HpmlError: coarsening lost time (a bug in the pass, named).
    """
    prof, _, graph = _graphs(prof, cluster, opts)
    return prof, graph


def _graphs(prof: Profile, cluster: Cluster, opts: Options) -> tuple[Profile, CostGraph, CostGraph]:
    """:func:`cost_graph`, also returning the graph of the profile's own nodes (before coarsening)."""
    check_devices_costed(cluster, prof.device_kinds)                                # kinds are known
    prof = predict_kinds(prof, sorted({d.kind for d in cluster.devices}))           # 2b. the kinds not measured
    fine = build_costgraph(prof, compiled=opts.compiled).limit_tp(opts.max_tp)     # 3. costgraph
    graph = fine.coarsen()                                                          # 4. blocks
    for kind in graph.kinds:  # coarsening merges nodes: it may not lose or invent time
        before, after = fine.total("", kind), graph.total("", kind)
        if not math.isclose(before, after, rel_tol=1e-6, abs_tol=1e-9):
            raise HpmlError(f"coarsening {prof.model} changed its total {kind} time from {before:.6g} ms to "
                            f"{after:.6g} ms; this is a bug in hpml_compile.costgraph.CostGraph.coarsen")
    _dump(opts, "3-costgraph.json", lambda p: write_json_atomic(_graph_json(graph), p))
    return prof, fine, graph


def plan(prof: Profile, cluster: Cluster, opts: Options = Options(), *, progress: Say | None = None) -> Plan:
    """Passes 3-5: place a profiled model on ``cluster``.

    Args:
        prof: the profile (a file's, or measured by a run).
        cluster: the devices.
        opts: solver, microbatches, schedule, time limit, dump.
        progress: the solver's progress lines.

    Returns:
        The plan, with the simulator's predictions, checked against the profile, its certificate (the step
        against a lower bound on every plan's, :func:`hpml_compile.certify.certify`) and the costs it assumes
        (:func:`hpml_compile.assumptions.assumptions`).

    Raises:
        OptionError: ``opts.microbatches`` does not split the profile's batch, or ``opts.precision`` is not the
            profile's (before solving); ``opts.reduce_dtype`` other than fp32 and a plan with no replicated stage.
        PlanError: an fp16 ``opts.reduce_dtype`` on a profile not timed in fp16 (no loss scaling; before solving).
        HpmlError: a CPU profile measured with other threads than the cluster's local ranks run.
        UnknownDeviceError, InfeasibleError, HpmlError: as :func:`hpml_compile.solve.solve`.
    """
    check_microbatches(prof, opts.microbatches)                                     # before any solving
    check_precision(prof, opts.precision)                                           # trains as it was timed
    if opts.reduce_dtype is not None:                                               # fp16 only loss-scaled
        check_wire(Precision(opts.reduce_dtype), prof.precision)
    check_threads(prof, cluster)                                                    # CPU times at the ranks' threads
    cluster = profile_links(cluster, prof)                                          # this host's measured link
    prof, fine, graph = _graphs(prof, cluster, opts)
    if progress:
        progress(f"{prof.model}: {len(graph.order)} blocks after coarsening ({len(prof.nodes)} nodes)")

    def solve_on(devices: Cluster) -> Plan:
        one = opts.schedule if opts.schedule not in (None, Schedule.INTERLEAVED) else Schedule.ONE_F_ONE_B
        placed = solve(graph, devices, solver=opts.solver, microbatches=opts.microbatches,          # 5. solve
                       schedule=one, time_limit_s=opts.time_limit_s,
                       dtype=prof.dtype, compute_bytes=compute_bytes(prof.precision.value), progress=progress,
                       compress=opts.allow_compress, hierarchical=opts.hierarchical,
                       reduce_dtype=opts.reduce_dtype or Precision.FP32)
        if opts.uneven:                                                             # 5b. mixed kinds, uneven rows
            better = improve_uneven(graph, devices, placed, dtype=prof.dtype, microbatches=opts.microbatches,
                                    time_limit_s=min(UNEVEN_BUDGET_S, opts.time_limit_s),
                                    progress=progress).plan
            placed = better if better is placed else _fits(better, placed, prof, progress)
        elif progress:
            progress("uneven rows: not searched (turned off: Options(uneven=False), --no-uneven)")
        return placed

    result = solve_on(cluster)
    if not opts.every_device and opts.solver in (SolverName.ILP, SolverName.DP):   # 5c. no more ranks than cores
        result = within_cores(result, graph, cluster, solve_on, dtype=prof.dtype, progress=progress)
    if opts.choose_schedule and opts.compile_stages != "on":                        # 5d. zero bubble where faster
        result = faster_schedule(result, graph, prof, progress)                     # (not compiled: one backward)
    auto_chunks = opts.interleave if opts.interleave is not None else INTERLEAVE_IN_AUTO
    if opts.schedule is Schedule.INTERLEAVED or (opts.choose_schedule and auto_chunks):  # 5e. chunks per group
        forced = opts.schedule is Schedule.INTERLEAVED
        roomy = roomy_placement(result, graph, prof, cluster, opts, progress)      # memory for its chunks
        result = choose_chunks(replace(result, compile_stages=opts.compile_stages), graph, prof, forced=forced,
                               say=progress, budget_s=BUDGET_S if forced else AUTO_BUDGET_S, roomy=roomy)
    result = replace(result, precision=prof.precision,                              # trains as it was timed
                     compile_stages=opts.compile_stages,                            # runs as it was priced
                     allow_compress=opts.allow_compress or "")                      # a re-plan offers it again
    wire = opts.reduce_dtype not in (None, Precision.FP32)
    if opts.compress or opts.sync_every > 1:                                        # the user's comm options
        result = _unsharded(result, graph, prof.dtype, opts)
    if opts.compress or opts.sync_every > 1 or wire:
        result = with_comm(result, compress=opts.compress, sync_every=opts.sync_every,
                           sync_warmup=opts.sync_warmup, reduce_dtype=opts.reduce_dtype)
        result = annotate(result, graph, prof.dtype)[0]                             # re-simulated with them
    validate_plan(result, prof)                                                     # every node placed once
    result = replace(result, certificate=certify(result, fine),                     # 6. how far from the best
                     assumptions=assumptions(result, prof, compiled=opts.compiled))  # what was not measured here
    _dump(opts, "4-plan.json", lambda p: save_plan(result, p))
    return result


def roomy_placement(placed: Plan, graph: CostGraph, prof: Profile, cluster: Cluster, opts: Options,
                    progress: Say | None = None) -> Plan | None:
    """The placement solved again knowing interleaving follows: every stage leaves memory for the microbatches
    interleaved 1F1B holds with ``v`` chunks over ``placed``'s ``S`` device groups (``v = blocks // S``, at least 2:
    a block a piece; :func:`hpml_compile.solve.candidates.interleaved_in_flight`), priced as 1F1B.

    ``placed`` fills its devices for 1F1B, whose later stages hold few microbatches; interleaved, they hold about
    ``S``, so its chunks must recompute to fit. Solved with that room, the stages take more devices, a higher
    tensor-parallel degree or ZeRO where that is cheaper. :func:`hpml_compile.solve.interleave.choose` weighs both.

    Args:
        placed: the solver's plan.
        graph: the cost graph.
        prof: the profile.
        cluster: the devices it was solved on.
        opts: the solver's options (its time limit capped at :data:`ROOM_LIMIT_S`).
        progress: where one line about it goes.

    Returns:
        The plan (1F1B), or None: one stage, CPU ranks (which interleaving on its own does not overflow), a
        solver other than ``ilp``/``dp``, or nothing fits with that room.
    """
    s = len(placed.stages)
    kinds = {base_kind(d.kind) for d in cluster.devices}
    if s < 2 or kinds <= {"cpu"} or SolverName(opts.solver) not in (SolverName.ILP, SolverName.DP):
        return None
    v, t0 = max(2, len(graph.order) // s), time.perf_counter()
    try:
        roomy = solve(graph, cluster, solver=opts.solver, microbatches=opts.microbatches, time_limit_s=min(
            ROOM_LIMIT_S, opts.time_limit_s), dtype=prof.dtype, compute_bytes=compute_bytes(prof.precision.value),
            compress=opts.allow_compress, hierarchical=opts.hierarchical,
            reduce_dtype=opts.reduce_dtype or Precision.FP32, room=(v, s))
    except HpmlError as e:
        if progress:
            progress(f"schedule: no placement with room for {v} chunks over {s} device groups ({e})")
        return None
    if progress:
        progress(f"schedule: placed again with room for {v} chunks over {s} device groups: {len(roomy.stages)} "
                 f"stages, M={roomy.microbatches}, {roomy.predicted.step_ms:.4g} ms a step under 1f1b "
                 f"({time.perf_counter() - t0:.1f} s)")
    return roomy


def faster_schedule(placed: Plan, graph: CostGraph, prof: Profile, progress: Say | None = None) -> Plan:
    """``placed`` under ZB-H1 where that simulates faster and still fits its devices, else ``placed``; one line
    says which and why.

    ZB-H1 holds ``min(M, S)`` microbatches on every stage; where a stage's devices cannot, the stage holds back
    fewer weight-gradient parts, the most that fit (memory-capped ZB-H1, :func:`hpml_compile.plan.fit_deferral`),
    and the capped plan is what is weighed against ``placed``.

    Args:
        placed: the solver's plan (1F1B).
        graph: the cost graph it was solved on.
        prof: the profile (for the memory check).
        progress: where the line goes.

    Returns:
        The faster plan.
    """
    say = progress or (lambda _: None)
    try:
        zb = fit_deferral(replace(placed, schedule=Schedule.ZB_H1, precision=prof.precision), prof)
        zb = annotate(zb, graph, prof.dtype)[0]  # its memory as it trains: autocast's copies per microbatch held
        validate_plan(zb, prof)
    except PlanError as e:
        say(f"schedule: {placed.schedule.value} (zb-h1 is not an option for this placement: {e})")
        return placed
    capped = [st.index for st in zb.stages if st.max_deferred is not None]
    name = f"zb-h1 capped on {len(capped)} of {len(zb.stages)} stages" if capped else "zb-h1"
    if zb.predicted.step_ms < placed.predicted.step_ms:
        say(f"schedule: {name}, {zb.predicted.step_ms:.4g} ms a step against {placed.predicted.step_ms:.4g} ms "
            f"under {placed.schedule.value} (bubble {zb.predicted.bubble:.1%} against {placed.predicted.bubble:.1%})")
        return zb
    say(f"schedule: {placed.schedule.value}, {name} is not faster here ({zb.predicted.step_ms:.4g} ms a step)")
    return placed


def _fits(better: Plan, placed: Plan, prof: Profile, progress: Say | None) -> Plan:
    """``better`` (the uneven-rows search's plan) where it fits its devices in the profile's precision, else the
    solver's ``placed``: the search prices memory without autocast's weight copies per microbatch in flight."""
    try:
        validate_plan(replace(better, precision=prof.precision), prof)
    except PlanError as e:
        if progress:
            progress(f"uneven rows: its plan does not fit in {prof.precision.value} ({e}); the solver's plan is kept")
        return placed
    return better


def within_cores(result: Plan, graph: CostGraph, cluster: Cluster, solve_on: Callable[[Cluster], Plan], *,
                 dtype: str = "float32", progress: Say | None = None) -> Plan:
    """``result``, or the plan on no more CPU devices per host than it has cores (the rest idle).

    The solvers give every device of the cluster work. CPU ranks beyond a host's cores share them, and what
    that costs is far more than the simulator's stretch of their work (``max(1, ranks / cores)``) says: a rank
    that waits for a peer's message or collective waits for the peer to be scheduled too. On this 2-core VM
    (``run --steps 60``): gpt-tiny on 4 ranks (2 stages x 2) 42.2 ms a step against 16.0 ms for one stage on 2,
    predicted 5.82 and 5.17 ms; on 3 ranks (``cpu0 | cpu1, cpu2``) 28.0-30.4 ms against 14.1-14.4 ms for 2
    stages on 2, although the 3-rank plan simulated 4% faster; gpt-mini data parallel on 4 ranks 476 ms against
    350 ms on 2 (``benchmarks/prediction``). So the solver runs again on the cluster less those
    devices (:func:`crowded_devices`) and that plan is kept, on the whole cluster (its idle devices get no rank),
    whatever the two simulate; both predictions are said.

    Args:
        result: the solver's plan on ``cluster``.
        graph: the cost graph (its ``cores``).
        cluster: the cluster ``result`` was solved on.
        solve_on: the same solve on another cluster.
        dtype: parameter dtype, for the simulator.
        progress: where to say what was done.

    Returns:
        The plan within the cores; ``result`` when no host has more CPU devices than cores, when ``result``
        leaves them idle already, or when no plan fits the fewer devices (said).
    """
    extra = crowded_devices(cluster, graph)
    used = {d for st in result.stages for d in st.devices}
    if not extra or not used & set(extra):
        return result
    fewer = without_devices(cluster, extra)
    try:
        alt = solve_on(fewer)
    except HpmlError as e:  # e.g. the model does not fit on fewer devices
        if progress:
            progress(f"cores: no plan fits on {len(fewer.devices)} of the {len(cluster.devices)} devices ({e}); "
                     f"every device kept, {', '.join(extra)} beyond their host's cores")
        return result
    alt = annotate(replace(alt, cluster=cluster), graph, dtype)[0]
    if progress:
        progress(f"cores: {', '.join(extra)} left idle: their host has fewer cores than CPU devices, and ranks "
                 "beyond its cores wait for each other's turns far more than the simulator prices; the plan "
                 f"without them is predicted {alt.predicted.step_ms:.4g} ms, with them {result.predicted.step_ms:.4g} "
                 "ms (--every-device gives every device work)")
    return alt


def _unsharded(plan: Plan, graph: CostGraph, dtype: str, opts: Options) -> Plan:
    """``plan`` with every replicated stage at ZeRO-0, what ``--compress`` and ``--sync-every`` act on.

    The solver may shard a replicated stage's optimizer (ZeRO-1/3) where that is faster or needed for
    memory; a compressed all-reduce and local SGD (whose replicas step on their own) need each replica to
    hold its whole optimizer, so the user's option wins: the stages are unsharded and re-simulated.

    Raises:
        OptionError: an unsharded stage would not fit its devices' memory (naming it and what would).
    """
    sharded = [st.index for st in plan.stages if len(st.devices) > 1 and st.zero != ZeroStage.NONE]
    if not sharded:
        return plan
    plan = annotate(replace(plan, stages=tuple(replace(st, zero=ZeroStage.NONE) if st.index in sharded else st
                                               for st in plan.stages)), graph, dtype)[0]
    what = f"--compress {opts.compress}" if opts.compress else f"--sync-every {opts.sync_every}"
    for st in plan.stages:
        cap = min(plan.cluster.device(d).memory_bytes for d in st.devices)
        if st.index in sharded and st.predicted.memory_bytes > cap:
            raise OptionError(f"{what} needs every replica of stage {st.index} to hold its whole optimizer state "
                              f"(ZeRO-0), which would take {st.predicted.memory_bytes / 2**30:.2f} GiB on a device "
                              f"of {cap / 2**30:.2f} GiB: use devices with more memory, or leave {what.split()[0]} "
                              "out and let the solver shard the optimizer")
    return plan


def compile(module: nn.Module, example_inputs: Sequence[Any], out_dir: str | Path, *,  # noqa: A001
            cluster: Cluster | str, opts: Options = Options(), prof_opts: ProfileOptions = ProfileOptions(),
            name: str | None = None, measured: Profile | None = None, recipe: ModelRecipe | None = None,
            say: Say | None = None) -> tuple[Build, fx.GraphModule]:
    """The whole chain: trace, profile, plan and generate a build of ``module`` for ``cluster``.

    Args:
        module: the model.
        example_inputs: positional inputs of one training batch.
        out_dir: the build folder to write: new, empty or an earlier build (checked before any work).
        cluster: the devices (a Cluster, a built-in name or a cluster.json path).
        opts: how to solve.
        prof_opts: how to trace and measure.
        name: the model's name in the files (default: its class name).
        measured: a profile of this very model to plan from instead of measuring it again.
        recipe: how ``hpml-compile run`` rebuilds the model (``model.json``, hashed in the manifest).
        say: progress lines.

    Returns:
        The build (bound to ``module``) and the graph it was generated from.

    Raises:
        OutputError: ``out_dir`` holds files no build wrote, or cannot be written (before any work).
        HpmlError: a model that cannot be traced, fits nowhere, or cannot be split as planned.
    """
    check_build_dir(out_dir)                                                        # 0. never a user's folder
    tell = say or (lambda line: None)
    c = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    inputs = tuple(example_inputs)
    label = name or type(module).__name__
    kinds = ["cpu", *sorted({d.kind for d in c.devices} - {"cpu"})]
    tell(f"[1/4] tracing {label}")
    gm = trace(module, inputs, leaf_modules=prof_opts.leaf_modules, front_end=prof_opts.front_end,  # 1. trace
               input_names=prof_opts.input_names or None)
    gm.graph.lint()
    _dump(opts, "1-graph.txt", lambda p: p.write_text(str(gm.graph)))
    if measured is None:
        prec = Precision(opts.precision or Precision.FP32)
        tell(f"[2/4] profiling {len(gm.graph.nodes)} nodes on the CPU ({local_threads(c) or torch.get_num_threads()} "
             f"thread(s){', under ' + prec.value + ' autocast' if prec.is_mixed else ''}); "
             f"predicting {', '.join(kinds[1:]) or 'nothing else'}")
        measured = profile(gm, inputs, name=label, device_kinds=kinds, batch_size=prof_opts.batch_size,  # 2. profile
                           seq_len=prof_opts.seq_len, repeats=prof_opts.repeats, warmup=prof_opts.warmup,
                           progress=False, threads=local_threads(c),  # local CPU ranks: at their thread count
                           precision=prec, corun=_corun(prof_opts, c),
                           compiled=prof_opts.compiled, say=say)  # 2a. blocks compiled, for compiled stages
        if prof_opts.link:                                                          # 2b. measured by the caller
            measured = with_link(measured, prof_opts.link)
        if prof_opts.process:
            measured = with_process(measured, prof_opts.process)
    else:
        tell(f"[2/4] planning from the given profile of {measured.model} (batch {measured.batch_size}, "
             f"{measured.precision.value})")
        _check_profile_matches(measured, gm, label)
        check_precision(measured, opts.precision)
    _dump(opts, "2-profile.json", lambda p: save_profile(measured, p))
    tell(f"[3/4] planning on {c.name} ({len(c.devices)} devices) with {SolverName(opts.solver).value}")
    placed = plan(measured, c, opts, progress=say)                                  # 3-5. costgraph, solve
    unrunnable = _unrunnable_tp(placed, measured)
    if unrunnable:                                                                  # 5b. tp the runtime runs
        tell(f"      {unrunnable}; planning again without tensor parallelism (--max-tp 1)")
        placed = plan(measured, c, replace(opts, max_tp=1), progress=say)
    tell(f"[4/4] generating {len(placed.stages)} stage(s) into {out_dir}")
    return _generate(module, inputs, gm, placed, predict_kinds(measured, kinds), out_dir, label,  # 6. codegen
                     recipe)


def _unrunnable_tp(placed: Plan, prof: Profile) -> str | None:
    """Why the runtime cannot run ``placed``'s tensor-parallel stages (None: it can, or there are none): swap or
    offload with ``tp > 1``, or a parameter tied between stages of different ``tp``
    (:func:`hpml_compile.codegen.tensor_parallel.check_shared`)."""
    try:
        tp_degree(placed)
    except PlanError as e:
        return str(e).split(";")[0]
    where = {n: st.index for st in placed.stages for n in st.nodes}
    users: dict[str, set[int]] = {}
    for node in prof.nodes:
        for name in node.params:
            if node.name in where:
                users.setdefault(name, set()).add(where[node.name])
    for name, stages in users.items():
        if len({placed.stages[k].tp for k in stages}) > 1:
            return (f"{name} is shared by stages {sorted(stages)} of tensor-parallel degrees "
                    f"{[placed.stages[k].tp for k in sorted(stages)]}")
    return None


def _check_profile_matches(prof: Profile, gm: fx.GraphModule, label: str) -> None:
    names = {n.name for n in gm.graph.nodes}
    missing = sorted({n.name for n in prof.nodes} - names)
    if missing:
        raise BuildMismatchError(f"the profile of {prof.model} has nodes that {label}'s graph lacks "
                                 f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): "
                                 "it profiles another model; profile this one again")


def _first_rows(inputs: tuple[Any, ...], rows: int) -> tuple[Any, ...]:
    return tuple(x[:rows] if isinstance(x, torch.Tensor) and x.dim() else x for x in inputs)


def _generate(module: nn.Module, inputs: tuple[Any, ...], gm: fx.GraphModule, placed: Plan, prof: Profile,
              out_dir: str | Path, label: str, recipe: ModelRecipe | None = None) -> tuple[Build, fx.GraphModule]:
    """Pass 6, codegen: the build of ``placed`` (checked against ``prof``) from the traced ``gm``.

    torch.export fixes every shape, so an exported model is traced again at the
    size one replica of one stage runs (a slice of a microbatch).

    Raises:
        HpmlError: the plan breaks a rule of the profile, or an exported model cannot execute at that size.
        PlanError: ``tp > 1`` with swap or offload (:func:`hpml_compile.codegen.tensor_parallel.tp_degree`).
    """
    validate_plan(placed, prof)
    tp_degree(placed)  # PlanError where the runtime cannot run the plan's tensor-parallel stages
    graph = gm
    replicas = {len(st.devices) // st.tp for st in placed.stages}
    if fixed_shapes(gm) and any(st.rows for st in placed.stages):
        raise HpmlError(f"{label} traces with torch.export, whose shapes are fixed, but the plan gives the replicas "
                        "of a stage different rows per microbatch; plan with uneven rows off "
                        "(Options(uneven=False)) or trace with fx")
    if fixed_shapes(gm) and (placed.microbatches > 1 or replicas != {1}):
        if len(replicas) > 1:
            raise HpmlError(f"{label} traces with torch.export, whose shapes are fixed, but the plan gives its "
                            f"stages different replica counts {sorted(replicas)}; use a cluster or solver that "
                            "gives every stage the same number of devices")
        rows = prof.batch_size // (placed.microbatches * replicas.pop())
        graph = trace(module, _first_rows(inputs, rows), front_end=FrontEnd.EXPORT,
                      input_names=gm.meta.get("hpml_keywords") or None)
        if [n.name for n in graph.graph.nodes] != [n.name for n in gm.graph.nodes]:
            raise BuildMismatchError(
                f"{label}: torch.export gives a different graph at batch {rows} (one microbatch of one replica) "
                f"than at batch {prof.batch_size}: it specialises sizes 0 and 1. Use a batch giving at least 2 "
                "rows per microbatch and replica, or one microbatch")
    return generate(graph, placed, out_dir, profile=prof, recipe=recipe), graph


def replan(old: Plan, measured: Profile, *, cluster: Cluster | None = None, lost: Iterable[str] = (),
           opts: Options = Options(), progress: Say | None = None) -> ReplanResult:
    """Re-solve a running plan on measured costs, for the devices it has now.

    The one re-plan of the tool: ``hpml-compile replan``, an imbalance seen by
    the closed loop, and a device lost to a failure all come here. The new
    plan keeps the old one's microbatches and schedule unless ``opts`` names
    them; the old plan is scored on the same costs and kept unless the new one
    is predicted faster (when it can no longer run, any plan that fits wins).
    It keeps the user's communication options the old plan records
    (:func:`hpml_compile.replan.carried_comm`: the compression the solver may
    choose, a compression on every replicated stage, local SGD) unless
    ``opts`` names others (``compress``, ``allow_compress``, ``sync_every`` > 1).

    Args:
        old: the plan running now.
        measured: the measured profile (kinds the cluster has and it lacks are predicted).
        cluster: the devices as they are now (default: the old plan's; a slowed device may have a kind of
            its own, see :func:`hpml_compile.runtime.observe.summary.measured_setup`).
        lost: devices to plan without (dead or failing).
        opts: solver, time limit, dump; microbatches and schedule default to the old plan's.
        progress: the solver's progress lines.

    Returns:
        The plan to run, its diff against the old one, and whether it switched.

    Raises:
        HpmlError: ``measured`` profiles another model, or ``lost`` names an unknown device or all of them.
        InfeasibleError: nothing fits on what is left.
    """
    if measured.model != old.model:
        raise HpmlError(f"the measured profile is of {measured.model!r} but the plan places {old.model!r}")
    if opts.precision is not None and Precision(opts.precision) is not old.precision:
        raise OptionError(f"--precision {Precision(opts.precision).value}: the running plan trains in "
                          f"{old.precision.value}; a re-plan keeps its precision (compile again to change it)")
    check_precision(measured, old.precision, "the running plan")
    check_microbatches(measured, opts.microbatches)
    target = cluster or old.cluster
    gone = list(lost)
    if gone:
        target = without_devices(target, gone)
    prof, fine, graph = _graphs(measured, target, replace(opts, max_tp=1))  # re-plans without tp (a checkpoint
    # of a tensor-parallel plan loads under one without)
    # Blocks cut by cost follow the measured costs, so the old plan may split one of them: both plans are
    # scored on the profile's own nodes, which any plan's stages respect.
    allowed, forced = carried_comm(old)                                             # the user's comm options
    if opts.compress or opts.allow_compress:
        allowed = opts.allow_compress
        forced = {k: v for k, v in forced.items() if k != "compress"} | (
            {"compress": opts.compress} if opts.compress else {})
    if opts.sync_every > 1:
        forced.update(sync_every=opts.sync_every, sync_warmup=opts.sync_warmup)
    if opts.reduce_dtype is not None:
        forced["reduce_dtype"] = Precision(opts.reduce_dtype).value
    schedule = opts.schedule or old.schedule  # an interleaved plan re-solves as 1F1B (its chunks are a later pass)
    result = replan_graph(old, graph, cluster=target, solver=opts.solver,
                          microbatches=opts.microbatches or old.microbatches,
                          schedule=Schedule.ONE_F_ONE_B if schedule is Schedule.INTERLEAVED else schedule,
                          time_limit_s=opts.time_limit_s,
                          dtype=prof.dtype, progress=progress, score_graph=fine, allow_compress=allowed,
                          comm=forced, hierarchical=opts.hierarchical)
    validate_plan(result.plan, prof)
    result = replace(result, plan=replace(result.plan, certificate=certify(result.plan, fine),  # as plan() does
                                          assumptions=assumptions(result.plan, prof),
                                          compile_stages=old.compile_stages))  # runs as the old one did
    _dump(opts, "4-plan.json", lambda p: save_plan(result.plan, p))
    return result


def move_rows(old: Plan, measured: Profile, *, cluster: Cluster | None = None,
              stages: Iterable[int] | None = None) -> ReplanResult:
    """The running plan with its replicated stages' rows moved on measured costs (no solve; see
    :func:`hpml_compile.replan.move_rows`): the closed loop's cheap candidate beside :func:`replan`.

    Args:
        old: the plan running now.
        measured: the measured profile.
        cluster: the devices as they are now (a slowed device may have a kind of its own).
        stages: the stages whose rows may change (default: every replicated stage).

    Returns:
        The plan with new rows (``switched``: predicted faster) or the old one rescored.

    Raises:
        HpmlError: ``measured`` profiles another model, or its batch does not split into rows per replica.
        PlanError: the new rows put a device over its memory.
    """
    if measured.model != old.model:
        raise HpmlError(f"the measured profile is of {measured.model!r} but the plan places {old.model!r}")
    target = cluster or old.cluster
    prof, fine, _ = _graphs(measured, target, Options())
    result = move_plan_rows(old, fine, cluster=target, stages=stages, dtype=prof.dtype)
    validate_plan(result.plan, prof)
    return result


def rebuild(recipe_dir: str | Path, placed: Plan, prof: Profile, out_dir: str | Path) -> Build:
    """Passes 1 and 6 again: the build of ``placed`` for the model that ``recipe_dir/model.json`` describes.

    What ``replan`` and the closed loop use after :func:`replan`: the model is
    built again from its recipe (same seed, batch, sequence length), traced the
    same way, and the new build, its recipe included, is published to ``out_dir``.

    Args:
        recipe_dir: the build whose ``model.json`` names the model (it may be ``out_dir`` itself).
        placed: the plan to build.
        prof: the profile it was made for.
        out_dir: the new build folder: new, empty or an earlier build (replaced whole); never a folder with
            anything else in it.

    Returns:
        The new build.

    Raises:
        BuildMismatchError: ``recipe_dir`` has no model.json, or one that does not match its manifest.
        OutputError: ``out_dir`` holds files no build wrote (named; nothing is deleted), or cannot be written.
        HpmlError: the plan breaks a rule of the profile.
    """
    from . import models  # the zoo: only a rebuild from a recipe needs it

    recipe = read_recipe(recipe_dir)
    check_build_dir(out_dir)                                        # before the model is built: refuse early
    loaded = models.load(recipe.model, batch_size=recipe.batch_size, seq_len=recipe.seq_len, seed=recipe.seed)
    gm = trace(loaded.module, loaded.example_inputs, leaf_modules=recipe.leaf_modules, front_end=recipe.front_end,
               input_names=loaded.input_names or None)
    build, _ = _generate(loaded.module, loaded.example_inputs, gm, placed, prof, out_dir, loaded.name, recipe)
    return build
