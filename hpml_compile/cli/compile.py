"""``hpml-compile compile``: trace, profile, plan and generate a build folder in one command.

The main CLI registers the sub-command with :func:`add_parsers`; the handler
raises HpmlError for bad input (printed without a traceback, exit 2).

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(prog="hpml-compile")
    >>> add_parsers(p.add_subparsers(dest="command"))
    >>> a = p.parse_args(["compile", "gpt-tiny", "--cluster", "local-cpu-2", "-o", "build"])
    >>> a.run is run_compile, a.solver, a.schedule, a.microbatches, str(a.output)
    (True, 'portfolio', '1f1b', None, 'build')
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..assumptions import format_assumptions
from ..cluster import load_cluster
from ..errors import HpmlError
from ..ir import FrontEnd, Precision
from ..plan import COMPILE_STAGES, Schedule
from ..solve import SolverName
from .plan import add_comm_options, certificate_text, comm_options, precision_text

__all__ = ["add_parsers", "run_compile"]


def add_parsers(subparsers: Any) -> None:
    """Register ``compile`` on an argparse sub-parser set.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    p = subparsers.add_parser(
        "compile", help="trace, profile, plan and generate a pipelined build of a model (writes build/)",
        description="Trace MODEL, profile every node on this machine (predicting the cluster's other device "
                    "kinds), place it on CLUSTER with a solver, and write the build folder: one Python file "
                    "per stage, plan.json, profile.json and manifest.json.")
    p.add_argument("model", metavar="MODEL", help="a zoo name, hf:<model_type>[?k=v,...] or file.py:factory")
    p.add_argument("--cluster", required=True, help="a built-in cluster name or a cluster.json path")
    p.add_argument("--solver", default=SolverName.PORTFOLIO.value,
                   choices=[*(s.value for s in SolverName), "ilp"])
    p.add_argument("--microbatches", type=int, default=None, help="default: searched by the solver")
    p.add_argument("--schedule", default=Schedule.ONE_F_ONE_B.value, choices=[*(s.value for s in Schedule), "auto"],
                   help="the pipeline schedule (zb-h1: zero bubble, its backward split in two; auto: 1f1b, or "
                        "zb-h1 or interleaved-1f1b where it simulates faster and fits)")
    p.add_argument("--time-limit", type=float, default=30.0, dest="time_limit", help="ILP time limit, seconds")
    p.add_argument("--batch-size", type=int, dest="batch_size", help="batch size (default: the model's)")
    p.add_argument("--seq-len", type=int, dest="seq_len", help="sequence length (default: the model's)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per node while profiling (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per node first (default 1)")
    p.add_argument("--leaf", action="append", default=[], metavar="MODULE",
                   help="keep a module (class or qualified name) as one opaque node; repeatable")
    p.add_argument("--front-end", dest="front_end", choices=[f.value for f in FrontEnd], default="auto")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument("--precision", default=None, choices=[x.value for x in Precision],
                   help="fp32 (default), or bf16/fp16 mixed precision: profiled and trained under autocast, fp32 "
                        "master weights and optimizer state, stage boundaries in the compute dtype; fp16 adds "
                        "loss scaling")
    p.add_argument("--measure-links", dest="measure_links", action="store_true", default=True,
                   help="plan with this host's gloo link between two processes where the cluster names no link, and "
                        "count a CPU rank's baseline memory: measured once per host (a few seconds) and cached "
                        "(the default)")
    p.add_argument("--no-measure-links", dest="measure_links", action="store_false",
                   help="plan with the catalog's link, and count only the tensors of a CPU rank")
    p.add_argument("--corun", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the blocks while forked processes run them on this host's other cores (the "
                        "slow-down of CPU ranks that share its caches and memory bandwidth, which the plan's "
                        "predicted times include), dozens of forward and backward passes at the microbatch's "
                        "rows. Default: when the cluster puts two or more CPU ranks on this host; --no-corun "
                        "plans without it (a plan whose predicted times do not matter, or a model too large to "
                        "time so often)")
    p.add_argument("--compile-stages", choices=list(COMPILE_STAGES), default="auto", dest="compile_stages",
                   help="how the stages will run, recorded in the build (`run` follows it): compiled by "
                        "torch.compile (inductor) on CUDA devices, not on CPUs (auto, the default), always (on: "
                        "CPU stages are then profiled compiled too, a compile of each kind of block, and planned "
                        "at those times) or never (off)")
    p.add_argument("-o", "--output", type=Path, required=True, help="the build folder to write")
    p.add_argument("--max-tp", type=int, default=None, choices=[1, 2, 4, 8], dest="max_tp",
                   help="the largest tensor-parallel degree a stage may take (default 8; 1: none, for `run --adapt`, "
                        "which re-plans stages without tensor parallelism)")
    add_comm_options(p)
    from .infer import add_inference_options

    add_inference_options(p)
    p.set_defaults(run=run_compile)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_compile(args: argparse.Namespace) -> int:
    """Handle ``hpml-compile compile``.

    Args:
        args: parsed arguments (see :func:`add_parsers`).

    Returns:
        0 on success.

    Raises:
        HpmlError: for a bad model, cluster or option, a model that fits nowhere, or a plan codegen cannot carry out.
    """
    if args.inference:
        from .infer import run_inference_compile, refuse_compiled_inference

        refuse_compiled_inference(args)

        return run_inference_compile(args)
    from .. import models  # the zoo is only needed here
    from .. import driver
    from ..recipe import ModelRecipe, absolute_model_spec
    from ..runtime.execute.compiled import CompileStages, priced_compiled

    if args.microbatches is not None and args.microbatches < 1:
        raise HpmlError(f"compile: --microbatches must be >= 1, got {args.microbatches}")
    cluster = load_cluster(args.cluster)
    # CPU stages that will run compiled are planned at their blocks' compiled times, which the profile measures
    timed = priced_compiled(CompileStages.parse(args.compile_stages), cluster)
    opts = driver.Options(solver=args.solver, microbatches=args.microbatches, schedule=args.schedule,
                          time_limit_s=args.time_limit, precision=args.precision, compiled=timed,
                          compile_stages=args.compile_stages, **comm_options(args))  # checked before any work
    loaded = models.load(args.model, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    # Ranks of a local CPU cluster share this host's cores: profile at the thread count each rank will have.
    threads = driver.local_threads(cluster)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    # How `hpml-compile run` ranks rebuild this model: written with the build and hashed in its manifest (it
    # names the model file that run imports, so a changed one is refused).
    recipe = ModelRecipe(absolute_model_spec(args.model), loaded.batch_size, loaded.seq_len, args.seed,
                         tuple(map(str, args.leaf)), str(args.front_end), threads)
    link = process = None
    if args.measure_links:  # before the threads are set for profiling; the probe starts its own processes
        from ..profile.process import this_host

        host = this_host(log=_say)  # cached per host: measured once
        link, process = host.get("link"), host.get("process")
        if process is not None and loaded.train is not None and loaded.train.weights is not None:
            process = {**process, "stage_only": True}  # each rank builds only its stage (runtime.execute.unallocated)
    try:
        build, gm = driver.compile(
            loaded.module, loaded.example_inputs, args.output, cluster=cluster, name=loaded.name, say=_say,
            recipe=recipe, opts=opts,
            prof_opts=driver.ProfileOptions(repeats=args.repeats, warmup=args.warmup, batch_size=loaded.batch_size,
                                            seq_len=loaded.seq_len, leaf_modules=args.leaf,
                                            front_end=args.front_end, input_names=loaded.input_names,
                                            link=link, process=process, compiled=timed,
                                            corun=args.corun))
    finally:
        torch.set_num_threads(before)
    plan = build.plan
    pr = plan.predicted
    print(f"{len(plan.stages)} stages, {plan.microbatches} microbatches ({plan.schedule.value}, "
          f"{precision_text(plan)}), predicted step "
          f"{pr.step_ms:.4g} ms (bottleneck stage {pr.bottleneck_stage}, bubble {pr.bubble:.1%}); wrote "
          f"{', '.join(sorted(p.name for p in build.out_dir.iterdir()))} to {build.out_dir}")
    for k, st in enumerate(plan.stages):
        print(f"  stage {k} on {', '.join(st.devices)}: {len(st.nodes)} nodes; "
              f"{' '.join(build.manifest.stages[k]['actions']) or 'no communication'}")
    print(certificate_text(plan))
    print(format_assumptions(plan.assumptions))
    from ..profile import load_profile
    from .bf16hint import bf16_profile_of, plan_hint

    hint = plan_hint(load_profile(build.out_dir / "profile.json"), cluster, pr.step_ms,  # fp32 on bf16 GPUs
                     replace(opts, max_tp=1),  # as the driver planned it
                     bf16_prof=lambda: bf16_profile_of(gm, loaded.example_inputs, cluster, name=loaded.name,
                                                       batch_size=loaded.batch_size, seq_len=loaded.seq_len))
    if hint is not None:
        print(hint)
    return 0
