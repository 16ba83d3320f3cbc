"""Pass 6, codegen: a traced graph and a plan -> one readable Python module per stage.

Codegen decides nothing; it carries out the plan exactly, in small lowering
steps, each a function whose output the next one reads (see :func:`generate`):

1. :func:`~.partition.canonical_text`: the model graph as text, hashed into the manifest;
2. :func:`~.partition.place`: every fx node in the stage the plan names (a plan
   for another model is refused);
3. :func:`~.partition.microbatch_values`: every node's shape at microbatch size;
4. :func:`~.partition.plan_actions`: the explicit actions -- boundary
   transfers (relayed past stages for skip connections), non-tensor values
   recomputed in their consumer, recompute and swap regions, gradient
   collectives for replicas and tied parameters (:mod:`.actions`);
5. :func:`~.lower.lower_stage`: one fx graph per stage with ``ops.recv``,
   ``ops.send``, ``ops.checkpoint``, ``ops.swap`` as real nodes (:mod:`.ops`);
6. :func:`~.emit.stage_source`: each stage as Python source (``stage_<k>.py``);
7. :func:`hpml_compile.schedule.lower`: each rank's action list (forwards and
   backwards in schedule order, messages, collectives, loss, optimizer step);
8. :func:`~.build.publish_build`: the files and ``manifest.json`` with their
   hashes and the action lists, written aside and renamed into place (only a
   new folder or an earlier build is replaced);

then the stage source just rendered is compiled and bound to the model's
weights, as :func:`load_build` does with the source it regenerates from
``plan.json`` and the model at load time (steps 1-7 are
:func:`~.render.render`; the stage files are for reading, never imported).

Example:
    >>> import tempfile, torch
    >>> from hpml_compile.trace import trace
    >>> from hpml_compile.plan import Plan, Stage
    >>> from hpml_compile.cluster import load_cluster
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> gm = trace(model, (torch.randn(4, 8),))
    >>> stages = (Stage(0, ("cpu0",), ("input_1", "_0", "_1")), Stage(1, ("cpu1",), ("_2", "output")))
    >>> plan = Plan("seq", load_cluster("local-cpu-2"), "gpipe", 2, stages)
    >>> build = generate(gm, plan, tempfile.mkdtemp())
    >>> sorted(p.name for p in build.out_dir.iterdir())
    ['graph.txt', 'manifest.json', 'plan.json', 'stage_0.py', 'stage_1.py']
    >>> build.source(1) == (build.out_dir / "stage_1.py").read_text()
    True
    >>> "ops.send(" in build.source(0), "ops.recv(" in build.source(1)
    (True, True)
    >>> load_build(build.out_dir, model).stages[1].INPUTS
    ()
"""

from __future__ import annotations

from pathlib import Path

import torch.fx as fx

from ..ir import Profile
from ..plan import Plan, validate_plan
from ..recipe import ModelRecipe
from .actions import GradSync, StageActions, SyncKind, Transfer
from .build import Build, InputSpec, Manifest, bind_build, build_files, check_build_dir, load_build, publish_build
from .render import render

__all__ = ["generate", "load_build", "check_build_dir", "build_files", "Build", "Manifest", "InputSpec",
           "StageActions", "Transfer", "GradSync", "SyncKind"]


def generate(graph_module: fx.GraphModule, plan: Plan, out_dir: str | Path, *, profile: Profile | None = None,
             recipe: ModelRecipe | None = None, debug: bool = False) -> Build:
    """Lower ``graph_module`` to one Python module per stage of ``plan`` and publish the build folder.

    Args:
        graph_module: the model traced by :func:`hpml_compile.trace`. For the
            fx front end any batch works (shapes are re-derived at microbatch
            size); a torch.export graph has fixed shapes and must be traced
            with one microbatch as its example input.
        plan: the plan to carry out.
        out_dir: the build folder: new, empty, or holding an earlier build, which is replaced whole (codegen
            writes nowhere else; a folder with anything else in it is refused and left as it is).
        profile: the profile the plan was made for; validated against and copied into the build.
        recipe: how ``hpml-compile run`` rebuilds the model, written as ``model.json`` and hashed in the
            manifest (:mod:`hpml_compile.recipe`); None for a build of the caller's own model.
        debug: also write ``lowering.json``, every lowering step's output.

    Returns:
        The build, bound to ``graph_module``'s weights (the model's own for the fx front end).

    Raises:
        BuildMismatchError: if the plan does not fit this graph (made for another model).
        OutputError: if ``out_dir`` holds files that no build wrote, or cannot be written.
        HpmlError: if a boundary would carry a non-tensor value that cannot be
            recomputed, or the batch does not divide into the microbatches.
        PlanError: if ``profile`` is given and the plan breaks one of its rules.
    """
    check_build_dir(out_dir)                                       # before any work: never a user's folder
    if profile is not None:
        validate_plan(plan, profile)
    files, manifest = render(graph_module, plan, profile=profile, recipe=recipe, debug=debug)  # 1.-7.
    out = publish_build(out_dir, files, manifest)                  # 8. files, then the manifest; renamed in
    return bind_build(out, plan, manifest, files, graph_module, graph_module.meta.get("hpml_out_spec"))


