"""``hpml-compile plan``: profile.json + a cluster -> plan.json, or a table comparing every solver.

The main CLI registers the sub-command with :func:`add_parsers`; the handler
raises HpmlError for bad input (printed without a traceback, exit 2).

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(prog="hpml-compile")
    >>> add_parsers(p.add_subparsers(dest="command"))
    >>> a = p.parse_args(["plan", "profile.json", "--cluster", "hetero-4", "-o", "plan.json"])
    >>> a.run is run_plan, a.solver, a.schedule, a.microbatches
    (True, 'portfolio', '1f1b', None)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from .. import driver
from ..assumptions import format_assumptions
from ..cluster import load_cluster
from ..errors import HpmlError, InfeasibleError
from ..ir import Cluster, Precision, Profile
from ..memory import GiB
from ..plan import Plan, Schedule, save_plan
from ..schema import read_json
from ..simulate import simulate
from ..solve import SolverName

__all__ = ["add_parsers", "run_plan", "compare", "format_table", "certificate_text"]


def add_parsers(subparsers: Any) -> None:
    """Register ``plan`` on an argparse sub-parser set.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    p = subparsers.add_parser("plan", help="place a profiled model on a cluster (writes plan.json)",
                              description="Place a profiled model on a cluster and write plan.json.")
    p.add_argument("profile", help="profile.json written by `hpml-compile profile`")
    p.add_argument("--cluster", required=True, help="a built-in cluster name or a cluster.json path")
    p.add_argument("--solver", default=SolverName.PORTFOLIO.value,
                   choices=[*(s.value for s in SolverName), "ilp"])
    p.add_argument("--microbatches", type=int, default=None, help="default: searched")
    p.add_argument("--schedule", default=Schedule.ONE_F_ONE_B.value, choices=[*(s.value for s in Schedule), "auto"],
                   help="the pipeline schedule (zb-h1: zero bubble, its backward split in two; auto: 1f1b, or "
                        "zb-h1 or interleaved-1f1b where it simulates faster on the solver's placement, or on one "
                        "solved again with memory left for interleaving, and fits)")
    p.add_argument("--time-limit", type=float, default=30.0, dest="time_limit", help="ILP time limit, seconds")
    p.add_argument("--compare", action="store_true", help="run every solver and print one table")
    p.add_argument("--precision", default=None, choices=[x.value for x in Precision],
                   help="the precision to train in; must be the profile's (default: the profile's)")
    p.add_argument("--compile-stages", choices=["auto", "on", "off"], default="auto", dest="compile_stages",
                   help="how the stages will run, recorded in the plan: auto (the default: compiled on CUDA devices, "
                        "not on CPUs), on (CPU stages priced at the blocks' compiled times of a `profile --compiled`) "
                        "or off")
    p.add_argument("-o", "--output", default=None, help="plan.json to write (with --compare: the ilp plan)")
    p.add_argument("--max-tp", type=int, default=8, choices=[1, 2, 4, 8], dest="max_tp",
                   help="the largest tensor-parallel degree a stage may take (default 8; 1: none); compile plans "
                        "with 1, its generated stages running without tensor parallelism")
    add_comm_options(p)
    from .infer import add_inference_options

    add_inference_options(p)
    p.set_defaults(run=run_plan)


def add_comm_options(p: argparse.ArgumentParser, *, solver: bool = True) -> None:
    """``--compress``, ``--allow-compress`` (``solver``), ``--sync-every``, ``--sync-warmup``."""
    g = p.add_argument_group("communication (less of it across slow links)")
    g.add_argument("--compress", default=None, metavar="powersgd:RANK|topk:RATIO",
                   help="compress the gradients of every replicated stage: PowerSGD of RANK or Top-K of RATIO, "
                        "with error feedback (default: none)")
    if solver:
        g.add_argument("--allow-compress", default=None, dest="allow_compress", metavar="powersgd:RANK|topk:RATIO",
                       help="let the solver compress a replicated stage's gradients so where it makes the step faster")
    g.add_argument("--sync-every", type=int, default=None, dest="sync_every", metavar="H",
                   help="local SGD: replicas step on their own gradients and average parameters every H steps "
                        "(default 1: every step, plain data parallelism)")
    g.add_argument("--sync-warmup", type=int, default=None, dest="sync_warmup", metavar="K",
                   help="steps of per-step gradient sync before local SGD starts (default 0)")
    if solver:
        g.add_argument("--reduce-dtype", default=None, dest="reduce_dtype", choices=[x.value for x in Precision],
                       help="the dtype of the gradient all-reduce / reduce-scatter between replicas: fp32 (default), "
                            "bf16 (half the bytes, fp32's range), or fp16 under --precision fp16 (loss-scaled)")
        g.add_argument("--no-hierarchical", action="store_false", dest="hierarchical",
                       help="keep every all-reduce flat (default: a stage whose replicas span hosts, each holding the "
                            "same number, all-reduces hierarchically where the cost model says it is faster)")
        p.add_argument("--no-uneven", action="store_false", dest="uneven",
                       help="do not try stages that mix device kinds with uneven rows per replica (default: tried on "
                            "clusters of several kinds, kept only when faster than the solver's plan)")
        p.add_argument("--every-device", action="store_true", dest="every_device",
                       help="give every device work (default, with the ilp and dp solvers: where a host has more CPU "
                            "devices than cores, only as many as it has cores get ranks, the rest idle, unless "
                            "nothing fits on them: ranks beyond the cores wait for each other's turns)")


def comm_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~hpml_compile.driver.Options` fields of :func:`add_comm_options`."""
    return {"compress": args.compress, "allow_compress": getattr(args, "allow_compress", None),
            "sync_every": 1 if args.sync_every is None else args.sync_every,
            "sync_warmup": 0 if args.sync_warmup is None else args.sync_warmup,
            **({"reduce_dtype": args.reduce_dtype} if getattr(args, "reduce_dtype", None) else {}),
            **({"hierarchical": args.hierarchical, "uneven": args.uneven, "every_device": args.every_device,
                **({"max_tp": args.max_tp} if getattr(args, "max_tp", None) is not None else {})} if hasattr(args, "uneven") else {})}


def precision_text(plan: Plan) -> str:
    """The plan's precision as the commands print it, with the reduce dtype where it is not fp32."""
    wire = plan.reduce_dtype
    return plan.precision.value + ("" if wire is Precision.FP32 else f", gradients reduced in {wire.value}")


def _inputs(args: argparse.Namespace) -> tuple[Profile, Cluster]:
    return Profile.from_dict(read_json(args.profile), source=str(args.profile)), load_cluster(args.cluster)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def compare(profile: Profile, cluster: Cluster, opts: driver.Options
            ) -> list[tuple[str, Plan | str, dict[str, int]]]:
    """Run every solver through the same driver steps as ``plan`` (:func:`hpml_compile.driver.plan`: the solve,
    uneven rows, the cores rule, the plan checked, its certificate), so that the ``ilp`` row is the very plan
    ``plan`` returns with the same options, and each row's figure is that of a plan a user would get.

    Args:
        profile: the profile.
        cluster: the cluster.
        opts: the options of ``plan`` (their ``solver`` is replaced by each solver in turn).

    Returns:
        ``(solver, plan or the reason it failed, peak bytes per device)`` per solver, ilp first.
    """
    out: list[tuple[str, Plan | str, dict[str, int]]] = []
    for s in SolverName:
        _progress(f"compare: {s.value} ...")
        try:
            plan = driver.plan(profile, cluster, replace(opts, solver=s), progress=None)
        except InfeasibleError as e:
            out.append((s.value, str(e).splitlines()[0], {}))
            continue
        graph = driver.cost_graph(profile, plan.cluster)[1]
        out.append((s.value, plan, simulate(plan, graph, profile.dtype).peak))
    return out


def certificate_text(plan: Plan) -> str:
    """The plan's certificate as a person reads it, or "no certificate" when the plan carries none."""
    return plan.certificate.text if plan.certificate is not None else "no certificate (the plan carries none)"


def format_table(rows: list[tuple[str, Plan | str, dict[str, int]]]) -> str:
    """One line per solver: step ms, bottleneck stage, bubble, ratio to ilp, the certificate's ``within``, peak
    GiB per device."""
    ref = next((p.predicted.step_ms for name, p, _ in rows if isinstance(p, Plan) and name == SolverName.PORTFOLIO.value), None)
    head = (f"{'solver':<8} {'step ms':>12} {'bottleneck':>10} {'bubble':>7} {'vs ilp':>7} {'within':>8}  "
            "peak GiB per device")
    lines = [head, "-" * len(head)]
    for name, plan, peak in rows:
        if not isinstance(plan, Plan):
            lines.append(f"{name:<8} {'infeasible':>12}  {plan}")
            continue
        ratio = f"{plan.predicted.step_ms / ref:.2f}x" if ref else "-"
        within = plan.certificate.within if plan.certificate is not None else None
        mem = " ".join(f"{d}:{b / GiB:.2f}" for d, b in list(peak.items())[:16]) + (" ..." if len(peak) > 16 else "")
        lines.append(f"{name:<8} {plan.predicted.step_ms:>12.4g} {plan.predicted.bottleneck_stage:>10} "
                     f"{plan.predicted.bubble:>7.3f} {ratio:>7} {'-' if within is None else f'{within:.1%}':>8}  "
                     f"{mem}")
    lines.append("within: the step's distance from a lower bound on every plan's step (the best plan under the "
                 "cost model is at least that close); -: no certificate")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    """Handle ``hpml-compile plan``.

    Args:
        args: parsed arguments (see :func:`add_parsers`).

    Returns:
        0 on success.

    Raises:
        HpmlError: for a bad profile, cluster or option, or a model that fits nowhere (InfeasibleError).
    """
    if getattr(args, "inference", False):
        from .infer import run_inference_plan, refuse_compiled_inference

        refuse_compiled_inference(args)

        return run_inference_plan(args)
    if not args.compare and not args.output:
        raise HpmlError("plan: -o/--output is required (where to write plan.json), unless --compare")
    if args.microbatches is not None and args.microbatches < 1:
        raise HpmlError(f"plan: --microbatches must be >= 1, got {args.microbatches}")
    profile, cluster = _inputs(args)
    schedule = args.schedule if args.schedule == "auto" else Schedule(args.schedule)
    driver.check_microbatches(profile, args.microbatches)  # before any solving: --compare solves five times
    driver.check_precision(profile, args.precision)
    from ..runtime.execute.compiled import CompileStages, priced_compiled

    mode = getattr(args, "compile_stages", "auto")
    opts = driver.Options(solver=args.solver, microbatches=args.microbatches, schedule=schedule,
                          time_limit_s=args.time_limit, precision=args.precision, compile_stages=mode,
                          compiled=priced_compiled(CompileStages.parse(mode), cluster), **comm_options(args))
    if args.compare:
        rows = compare(profile, cluster, opts)
        print(format_table(rows))
        plan = next((p for n, p, _ in rows if n == SolverName.ILP.value and isinstance(p, Plan)), None)
        if plan is not None:
            print(format_assumptions(plan.assumptions))
        if args.output and plan is not None:
            save_plan(plan, args.output)
            print(f"wrote {args.output}")
        return 0
    _progress(f"plan: {profile.model} on {cluster.name} ({len(cluster.devices)} devices), solver {args.solver}")
    plan = driver.plan(profile, cluster, opts, progress=_progress)
    save_plan(plan, args.output)
    pr, so = plan.predicted, plan.solver
    print(f"{len(plan.stages)} stages, {plan.microbatches} microbatches ({plan.schedule.value}, "
          f"{precision_text(plan)}): step "
          f"{pr.step_ms:.4g} ms, bottleneck stage {pr.bottleneck_stage}, bubble {pr.bubble:.1%}; "
          f"{so.name} {so.status.value} in {so.seconds:.2f} s; wrote {args.output}")
    print(certificate_text(plan))
    print(format_assumptions(plan.assumptions))
    from .bf16hint import plan_hint

    hint = plan_hint(profile, cluster, pr.step_ms, opts)  # fp32 on GPUs with bf16 units: one line
    if hint is not None:
        print(hint)
    return 0
