"""``hpml-compile demo``: compile the built-in GPT for two local CPU ranks, show the plan, train, compare.

On a fresh machine, with nothing to download, in about a minute on 2 cores:

1. compile ``gpt-mini`` (6 layers, d_model 256) onto ``local-cpu-2``: trace,
   profile every node at the thread count each rank will have, solve, generate
   the build (``OUT/build``);
2. print the plan summary and write its pictures (``OUT/pictures``: the placed
   graph, the simulated timeline, memory per device);
3. train it for a few dozen steps on 2 real ranks started by torchrun, loss and
   throughput printed as it goes (``OUT/run``: JSON lines, TensorBoard events);
4. print the measured-against-predicted table, name the bottleneck, and write
   the measured profile (``OUT/run/profile.json``) that ``replan`` takes.

Example:
    >>> import argparse
    >>> a = argparse.Namespace(output="out/demo", model="gpt-mini")
    >>> options(a)["steps"], options(a)["cluster"]
    (30, 'local-cpu-2')
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["run_demo", "options", "DEMO_STEPS", "DEMO_CLUSTER"]

DEMO_STEPS = 30
DEMO_CLUSTER = "local-cpu-2"


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The demo's settings: what the CLI gave, defaults for the rest."""
    return {"output": Path(getattr(args, "output", "out/demo")), "model": getattr(args, "model", "gpt-mini"),
            "steps": int(getattr(args, "steps", None) or DEMO_STEPS),
            "cluster": getattr(args, "cluster", None) or DEMO_CLUSTER}


def _pictures(plan: Any, profile: Any, out: Path) -> None:
    """Print the plan summary and write its pictures (skipped, with a note, where a piece is missing)."""
    try:
        import graphviz

        from ..explain import plan_costgraph, summary
        from ..simulate import simulate
        from ..viz import write_pictures
    except ImportError as e:
        print(f"  (plan pictures skipped: {e})")
        return
    graph = plan_costgraph(plan, profile)
    result = simulate(plan, graph, profile.dtype)
    print("\n".join("  " + line for line in summary(plan, graph, result).splitlines()))
    try:
        written = write_pictures(plan, graph, result, out)
    except graphviz.ExecutableNotFound:
        written = write_pictures(plan, graph, result, out, graph_formats=())
        print("  (graphviz's `dot` is not installed: the plan graph is written as DOT source only)")
    print(f"  pictures: {', '.join(str(p) for p in written)}")


def run_demo(args: argparse.Namespace) -> int:
    """Handle ``hpml-compile demo`` (see the module docstring).

    Args:
        args: ``output`` (folder), ``model`` (a zoo name); ``steps`` and ``cluster`` if the parser has them.

    Returns:
        0 on success.

    Raises:
        HpmlError: if a step fails (a rank that cannot start, a port in use, ...), with what to do.
    """
    from .. import models
    from ..cluster import load_cluster
    from ..profile import load_profile
    from .. import driver
    from ..runtime.launcher import LaunchSpec, launch, prepare_run_dir
    from ..recipe import ModelRecipe
    from ..runtime.summary import analyse, export_profile, format_summary

    opt = options(args)
    out: Path = opt["output"]
    t0 = time.perf_counter()
    cluster = load_cluster(opt["cluster"])
    loaded = models.load(opt["model"])
    threads = driver.local_threads(cluster)
    print(f"[1/4] compiling {loaded.name} (batch {loaded.batch_size}, seq {loaded.seq_len}) onto {cluster.name} "
          f"({len(cluster.devices)} CPU processes, {threads or torch.get_num_threads()} thread(s) each)", flush=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        build, _ = driver.compile(loaded.module, loaded.example_inputs, out / "build", cluster=cluster,
                                  name=loaded.name, opts=driver.Options(time_limit_s=20.0),
                                  recipe=ModelRecipe(loaded.name, loaded.batch_size, loaded.seq_len, 0, (), "auto",
                                                     threads),
                                  prof_opts=driver.ProfileOptions(batch_size=loaded.batch_size, seq_len=loaded.seq_len),
                                  say=lambda line: print("  " + line, flush=True) if line.startswith("[") else None)
    finally:
        torch.set_num_threads(before)
    plan = build.plan
    print(f"[2/4] the plan ({time.perf_counter() - t0:.0f} s so far):", flush=True)
    _pictures(plan, load_profile(build.out_dir / "profile.json"), out / "pictures")
    ranks = sum(len(st.devices) for st in plan.stages)
    print(f"[3/4] training on {ranks} ranks started by torchrun (build {build.out_dir})", flush=True)
    run_dir = prepare_run_dir(build.out_dir, out / "run", {"steps": opt["steps"], "nproc": ranks, "demo": True})
    sys.stdout.flush()
    launch(LaunchSpec(build.out_dir, run_dir, ranks, worker_args=("--steps", str(opt["steps"]), "--lr", "3e-3",
                                                                   "--log-every", "3")))
    print(f"[4/4] measured against predicted ({time.perf_counter() - t0:.0f} s so far):", flush=True)
    s = analyse(run_dir)
    print(format_summary(s))
    prof = export_profile(run_dir, s)
    print(f"wrote {build.out_dir}, {out / 'pictures'}, {run_dir}" + (f", {prof}" if prof else ""))
    print(f"next: hpml-compile report {run_dir}  |  tensorboard --logdir {run_dir / 'tb'}  |  "
          f"hpml-compile run {build.out_dir} --steps 100")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return 0
