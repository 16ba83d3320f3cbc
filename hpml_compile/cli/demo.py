"""``hpml-compile demo``: compile a byte-level GPT for two local CPU ranks, show the plan, train it on real text.

On a fresh machine, with nothing to download, in about a minute or two on 2 cores:

1. compile ``examples/stdlib_lm.py:spec`` (a TrainSpec: a 2-layer byte GPT on
   the source files of Python's own standard library, every tenth file held
   out for validation) onto ``local-cpu-2``: trace, profile every node at the
   thread count each rank will have, solve, generate the build (``OUT/build``);
2. print the plan summary and write its pictures (``OUT/pictures``);
3. measure the baseline, the entropy of the training bytes' frequencies (what
   a model that knows only how often each byte occurs scores), then train on
   2 real ranks started by torchrun, each loading only its own rows of every
   batch; the training loss and the validation loss (eval mode, held-out files)
   printed as it goes (``OUT/run``: JSON lines, TensorBoard events);
4. print the measured-against-predicted table and how far the validation loss
   fell below the baseline.

Example:
    >>> import argparse
    >>> a = argparse.Namespace(output="out/demo")
    >>> options(a)["steps"], options(a)["cluster"], options(a)["spec"].name
    (300, 'local-cpu-2', 'stdlib_lm.py')
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["run_demo", "options", "DEMO_STEPS", "DEMO_CLUSTER"]

DEMO_STEPS = 300
DEMO_CLUSTER = "local-cpu-2"
VAL_EVERY = 50
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stdlib_lm.py"  # in a clone (bash dev installs -e)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The demo's settings: what the CLI gave, defaults for the rest."""
    return {"output": Path(getattr(args, "output", "out/demo")), "spec": Path(getattr(args, "spec", None) or EXAMPLE),
            "steps": int(getattr(args, "steps", None) or DEMO_STEPS),
            "cluster": getattr(args, "cluster", None) or DEMO_CLUSTER,
            "measure_links": bool(getattr(args, "measure_links", True))}


def _baseline(spec_file: Path) -> float:
    """The example's byte-frequency entropy (nats per byte), measured on its training text."""
    import importlib.util

    mod_spec = importlib.util.spec_from_file_location("_hpml_demo_stdlib_lm", spec_file)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return float(module.byte_entropy())


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
        args: ``output`` (folder); ``spec``, ``steps`` and ``cluster`` if the parser has them.

    Returns:
        0 on success.

    Raises:
        HpmlError: the example file is missing (an install without the repository's examples/), or a step
            fails (a rank that cannot start, a port in use, ...), with what to do.
    """
    from .. import models
    from ..cluster import load_cluster
    from ..errors import HpmlError
    from ..profile import load_profile
    from .. import driver
    from ..runtime.job.launcher import LaunchSpec, launch, prepare_run_dir
    from ..runtime.job.options import RunOptions
    from ..recipe import ModelRecipe
    from ..runtime.observe.monitor import read_metrics
    from ..runtime.observe.summary import analyse, export_profile, format_summary

    opt = options(args)
    out: Path = opt["output"]
    if not opt["spec"].is_file():
        raise HpmlError(f"demo: {opt['spec']} not found: the demo trains the repository's examples/stdlib_lm.py; "
                        "run it from a clone (bash dev demo), or pass --spec path/to/stdlib_lm.py")
    t0 = time.perf_counter()
    cluster = load_cluster(opt["cluster"])
    model = f"{opt['spec'].resolve()}:spec"
    loaded = models.load(model)
    assert loaded.train is not None
    data = loaded.train
    threads = driver.local_threads(cluster)
    print(f"[1/4] compiling {opt['spec'].name}: a byte-level GPT ({sum(p.numel() for p in loaded.module.parameters()):,} "
          f"parameters), batch {loaded.batch_size} x {loaded.example_inputs[0].shape[1]} bytes, onto {cluster.name} "
          f"({len(cluster.devices)} CPU processes, {threads or torch.get_num_threads()} thread(s) each)", flush=True)
    link = process = None
    if opt["measure_links"]:  # this host's gloo link and a rank's baseline memory, cached per host (as compile)
        from ..profile.process import this_host

        host = this_host(log=lambda line: print("  " + line.strip(), flush=True))
        link, process = host.get("link"), host.get("process")
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        build, _ = driver.compile(loaded.module, loaded.example_inputs, out / "build", cluster=cluster,
                                  name=loaded.name, opts=driver.Options(time_limit_s=20.0),
                                  recipe=ModelRecipe(model, loaded.batch_size, None, 0, (), "auto", threads),
                                  prof_opts=driver.ProfileOptions(batch_size=loaded.batch_size, link=link,
                                                                  process=process),
                                  say=lambda line: print("  " + line, flush=True) if line.startswith("[") else None)
    finally:
        torch.set_num_threads(before)
    plan = build.plan
    print(f"[2/4] the plan ({time.perf_counter() - t0:.0f} s so far):", flush=True)
    _pictures(plan, load_profile(build.out_dir / "profile.json"), out / "pictures")
    ranks = sum(len(st.devices) for st in plan.stages)
    baseline = _baseline(opt["spec"])
    print(f"[3/4] training {opt['steps']} steps on {ranks} ranks started by torchrun: {len(data.dataset):,} windows "
          f"of standard-library source for training, {len(data.val_dataset):,} from held-out files for validation "
          f"(every {VAL_EVERY} steps)", flush=True)
    print(f"  baseline: the byte frequencies of the training text have an entropy of {baseline:.4f} nats/byte "
          "(the loss of a model that knows only how often each byte occurs)", flush=True)
    ranks_read = RunOptions(steps=opt["steps"], log_every=VAL_EVERY // 2, val_every=VAL_EVERY)
    run_dir = prepare_run_dir(build.out_dir, out / "run", {"steps": opt["steps"], "nproc": ranks, "demo": True},
                              ranks_read)
    sys.stdout.flush()
    launch(LaunchSpec(build.out_dir, run_dir, ranks))
    print(f"[4/4] measured against predicted ({time.perf_counter() - t0:.0f} s so far):", flush=True)
    s = analyse(run_dir)
    print(format_summary(s))
    rows = read_metrics(run_dir).get(0, [])
    vals = [m for m in rows if m.val_loss is not None]
    if vals:
        last = vals[-1]
        print(f"validation loss {last.val_loss:.4f} at step {last.step + 1} (training loss {last.loss:.4f}), "
              f"{baseline - last.val_loss:.4f} nats/byte ({1 - last.val_loss / baseline:.0%}) below the "
              f"byte-frequency entropy {baseline:.4f}")
    prof = export_profile(run_dir, s)
    print(f"wrote {build.out_dir}, {out / 'pictures'}, {run_dir}" + (f", {prof}" if prof else ""))
    print(f"next: hpml-compile report {run_dir}  |  tensorboard --logdir {run_dir / 'tb'}  |  "
          f"hpml-compile run {build.out_dir} --epochs 1 --val-every 200")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return 0
