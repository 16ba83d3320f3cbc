"""``hpml-compile replan``: a running build's plan + a measured profile -> a new build, and what changed.

Example:
    $ hpml-compile run build/ --steps 50 --run-dir runs/a       # measures every stage
    $ hpml-compile report runs/a                                # writes runs/a/profile.json
    $ hpml-compile replan build/plan.json --profile runs/a/profile.json -o build2/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .. import driver
from ..cluster import load_cluster
from ..errors import HpmlError
from ..plan import load_plan, save_plan
from ..profile import load_profile
from ..schema import read_json
from ..solve import SolverName

__all__ = ["add_parsers", "run_replan"]


def add_parsers(subparsers: Any) -> None:
    """Register ``replan`` on an argparse sub-parser set."""
    p = subparsers.add_parser(
        "replan", help="re-solve a build's plan from measured costs; print the diff; write the new build",
        description="Re-solve PLAN with the costs in a measured profile (from `hpml-compile report`), on the "
                    "same cluster or what is left of it, print what changed, and generate the new build. The "
                    "old plan is scored on the same measured costs; it is kept when no plan is predicted faster.")
    p.add_argument("plan", type=Path, help="plan.json of the running build (build/plan.json)")
    p.add_argument("--profile", type=Path, required=True, help="measured profile.json (from `hpml-compile report`)")
    p.add_argument("--cluster", help="plan for this cluster instead (built-in name or cluster.json)")
    p.add_argument("--drop-device", action="append", default=[], metavar="NAME",
                   help="plan without this device (lost or failing); repeatable")
    p.add_argument("--solver", default=SolverName.PORTFOLIO.value,
                   choices=[*(s.value for s in SolverName), "ilp"])
    p.add_argument("--time-limit", type=float, default=30.0, dest="time_limit", help="ILP time limit, seconds")
    p.add_argument("-o", "--output", type=Path, required=True, help="the new build folder")
    p.set_defaults(run=run_replan)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_replan(args: argparse.Namespace) -> int:
    """Handle ``hpml-compile replan`` (raises HpmlError for bad input; InfeasibleError when nothing fits)."""
    from ..codegen.build import check_build_dir

    check_build_dir(args.output)  # before solving: -o must be new, empty or an earlier build, never a user's folder
    old = load_plan(args.plan)
    measured = load_profile(args.profile)
    if measured.model != old.model:
        raise HpmlError(f"{args.profile} profiles {measured.model!r} but {args.plan} places {old.model!r}")
    cluster = load_cluster(args.cluster) if args.cluster else old.cluster
    left = len(cluster.devices) - len(set(args.drop_device))
    _say(f"replan: {old.model} on {cluster.name} ({left} devices) from {args.profile}")
    result = driver.replan(old, measured, cluster=cluster, lost=args.drop_device, progress=_say,
                           opts=driver.Options(solver=args.solver, time_limit_s=args.time_limit))
    scopes = {n.name: n.scope for n in measured.nodes}
    print(result.diff.summary(scope_of=lambda n: scopes.get(n, "")))
    print("switch: yes, the new plan is predicted faster" if result.switched
          else "switch: no, the old plan is still predicted fastest (written again with the new predictions)")
    build_dir = args.plan.parent
    from ..runtime.observe.runfolder import RunFolder

    run_json = RunFolder(build_dir).run_json  # a run folder (from `hpml-compile run`) names its build
    if not (build_dir / "model.json").is_file() and run_json.is_file():
        build_dir = Path(read_json(run_json).get("build", build_dir))
    if not (build_dir / "model.json").is_file():
        save_plan(result.plan, args.output / "plan.json")
        print(f"wrote {args.output / 'plan.json'} only: {build_dir} has no model.json to rebuild the model from "
              "(generate the stage files with hpml_compile.generate(graph_module, plan, out_dir))")
        return 0
    build = driver.rebuild(build_dir, result.plan, measured, args.output)
    print(f"wrote {len(result.plan.stages)} stage(s), predicted step {result.plan.predicted.step_ms:.4g} ms, to "
          f"{build.out_dir}")
    return 0
