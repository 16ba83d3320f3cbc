"""``hpml-compile show``: pictures of a plan and a text summary that explains it.

``show PLAN -o DIR [--profile profile.json]`` re-simulates the plan on its
profile's cost graph and writes, into ``DIR``: ``plan_graph.svg`` /
``.png`` / ``.dot`` (the placed graph), ``timeline.png`` (Gantt chart) and
``memory.png`` (memory per device against capacity); see :mod:`hpml_compile.viz`.
It prints a summary: the stages, the bottleneck stage and why, each device's
memory slack, and what one more device of the bottleneck's kind would give
(the plan re-solved with it, same solver, schedule and microbatches); the
text comes from :mod:`hpml_compile.explain`.

plan.json stores fx node names, not costs, so ``show`` needs the profile the
plan was made for: ``--profile``, or ``profile.json`` next to the plan.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(prog="hpml-compile")
    >>> add_parsers(p.add_subparsers(dest="command"))
    >>> a = p.parse_args(["show", "build/plan.json", "-o", "out/show"])
    >>> a.run is run_show, a.profile, a.what_if
    (True, None, True)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import graphviz

from ..errors import HpmlError
from .. import driver
from ..explain import base_solver, one_more_device, plan_costgraph, summary
from ..plan import load_plan
from ..profile import load_profile, predict_kinds
from ..simulate import simulate
from ..viz import write_pictures

__all__ = ["add_parsers", "run_show", "find_profile"]


def add_parsers(subparsers: Any) -> None:
    """Register ``show`` on an argparse sub-parser set.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.
    """
    p = subparsers.add_parser(
        "show", help="draw a plan (graph, timeline, memory) and explain it",
        description="Write pictures of a plan (the placed cost graph as SVG/PNG, the simulated timeline and the "
                    "memory of each device as PNG) and print a summary: the bottleneck stage, each device's "
                    "memory slack, and what one more device would change.")
    p.add_argument("plan", help="plan.json written by `hpml-compile plan`")
    p.add_argument("-o", "--output", required=True, help="folder to write the pictures into")
    p.add_argument("--profile", default=None,
                   help="the profile.json the plan was made for (default: profile.json next to the plan)")
    p.add_argument("--no-what-if", dest="what_if", action="store_false",
                   help="skip re-solving with one more device (faster)")
    p.add_argument("--time-limit", type=float, default=10.0, dest="time_limit",
                   help="ILP time limit for the one-more-device re-solve, seconds (default 10)")
    p.set_defaults(run=run_show)


def find_profile(plan_path: Path, given: str | None) -> Path:
    """The profile to draw the plan with: ``given``, else ``profile.json`` next to the plan.

    Raises:
        HpmlError: if neither exists, saying where it looked and what to pass.
    """
    if given:
        p = Path(given)
        if not p.is_file():
            raise HpmlError(f"show: --profile {given}: no such file")
        return p
    p = plan_path.parent / "profile.json"
    if p.is_file():
        return p
    raise HpmlError(f"show: {plan_path} stores fx node names, not costs, so drawing it needs the profile it was "
                    f"made for; no profile.json next to it ({p}). Pass --profile PATH/profile.json")


def run_show(args: argparse.Namespace) -> int:
    """Handle ``hpml-compile show``.

    Args:
        args: parsed arguments (see :func:`add_parsers`).

    Returns:
        0 on success.

    Raises:
        HpmlError: for a missing or bad plan or profile, or a profile that does not match the plan.
    """
    plan_path = Path(args.plan)
    if not plan_path.is_file():
        raise HpmlError(f"show: {plan_path}: no such file; pass the plan.json written by `hpml-compile plan`")
    plan = load_plan(plan_path)
    profile = load_profile(find_profile(plan_path, args.profile))
    if profile.precision is not plan.precision:
        raise HpmlError(f"show: {plan_path} trains in {plan.precision.value} but the profile was timed in "
                        f"{profile.precision.value}; pass the profile the plan was made from (--profile)")
    missing = sorted({d.kind for d in plan.cluster.devices} - set(profile.device_kinds))
    if missing:
        profile = predict_kinds(profile, missing)
    graph = plan_costgraph(plan, profile)
    result = simulate(plan, graph, profile.dtype)
    out = Path(args.output)
    try:
        written = write_pictures(plan, graph, result, out)
    except graphviz.ExecutableNotFound:
        written = write_pictures(plan, graph, result, out, graph_formats=())
        print("show: graphviz's `dot` is not installed, so the plan graph is written as DOT source only "
              "(install it, e.g. `apt-get install graphviz`, for SVG and PNG)", file=sys.stderr)
    what_if = None
    if args.what_if:
        print(f"show: re-solving with one more device (time limit {args.time_limit:g} s) ...", file=sys.stderr,
              flush=True)
        opts = driver.Options(solver=base_solver(plan), microbatches=plan.microbatches, schedule=plan.schedule,
                              time_limit_s=args.time_limit, precision=plan.precision,
                              allow_compress=plan.allow_compress or None, sync_every=plan.sync_every,
                              sync_warmup=plan.sync_warmup, reduce_dtype=plan.reduce_dtype)
        what_if = one_more_device(plan, result, lambda bigger: driver.plan(profile, bigger, opts))
    print(summary(plan, graph, result, what_if))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
