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
8. :func:`~.build.write_files`: the files and ``manifest.json`` with their hashes
   and the action lists;

then :func:`load_build` imports what was written, as any later run will.

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
    >>> "ops.send(" in build.source(0), "ops.recv(" in build.source(1)
    (True, True)
    >>> load_build(build.out_dir, model).stages[1].INPUTS
    ()
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.fx as fx

from ..errors import HpmlError
from ..ir import FrontEnd, Profile
from ..plan import Plan, validate_plan
from ..schedule import lower as lower_schedule
from ..schedule import rank_layout
from .actions import GradSync, StageActions, SyncKind, Transfer
from .build import (Build, InputSpec, Manifest, file_hashes, input_specs, leaf_modules, load_build, sha256,
                    write_files)
from .emit import class_name, stage_source
from .lower import lower_stage
from .partition import (batch_dims, canonical_text, microbatch_values, place, plan_actions, specs_of,
                        trace_rows)

__all__ = ["generate", "load_build", "Build", "Manifest", "InputSpec", "StageActions", "Transfer", "GradSync",
           "SyncKind"]


def generate(graph_module: fx.GraphModule, plan: Plan, out_dir: str | Path, *, profile: Profile | None = None,
             debug: bool = False) -> Build:
    """Lower ``graph_module`` to one Python module per stage of ``plan`` and write the build folder.

    Args:
        graph_module: the model traced by :func:`hpml_compile.trace`. For the
            fx front end any batch works (shapes are re-derived at microbatch
            size); a torch.export graph has fixed shapes and must be traced
            with one microbatch as its example input.
        plan: the plan to carry out.
        out_dir: the build folder (created if missing; codegen writes nowhere else).
        profile: the profile the plan was made for; validated against and copied into the build.
        debug: also write ``lowering.json``, every lowering step's output.

    Returns:
        The build, loaded from the files just written and bound to
        ``graph_module``'s weights (the model's own for the fx front end).

    Raises:
        BuildMismatchError: if the plan does not fit this graph (made for another model).
        HpmlError: if a boundary would carry a non-tensor value that cannot be
            recomputed, or the batch does not divide into the microbatches.
        PlanError: if ``profile`` is given and the plan breaks one of its rules.
    """
    out = Path(out_dir)
    gm = graph_module
    if profile is not None:
        validate_plan(plan, profile)
    text = canonical_text(gm)                                      # 1. the model graph
    graph_sha = sha256(text)
    owner = place(gm, plan)                                        # 2. node -> stage, as the plan says
    rows, values = _stage_values(gm, plan)                          # 3. shapes on each stage replica
    actions = plan_actions(gm, plan, owner, values[0])             # 4. explicit transfers, regions, collectives
    dims = _boundary_dims(plan, actions, values)
    last = len(plan.stages) - 1
    graphs = [lower_stage(gm, a, values[a.index], last=a.index == last, send_dims=dims[a.index],
                          recv_dims=dims[a.index - 1] if a.index else None)
              for a in actions]                                    # 5. one graph per stage
    files: dict[str, str | bytes] = {
        f"stage_{a.index}.py": stage_source(plan.model, plan, a, g, values[a.index], graph_sha)
        for a, g in zip(actions, graphs)}                          # 6. readable source
    files["plan.json"] = json.dumps(plan.to_dict(), indent=2) + "\n"
    files["graph.txt"] = text
    if profile is not None:
        files["profile.json"] = json.dumps(profile.to_dict(), indent=2) + "\n"
    if debug:
        files["lowering.json"] = json.dumps(_debug(owner, values, actions), indent=2) + "\n"
    collectives = list(dict.fromkeys(str(g) for a in actions for g in (*a.grad_sync, *a.after_step)))
    collectives.sort(key=lambda t: (GradSync.parse(t).stages, t))
    ranks = lower_schedule(plan.schedule, plan.microbatches, [len(st.devices) for st in plan.stages],
                           sends=[a.send is not None for a in actions],
                           grad_sync=[[str(g) for g in a.grad_sync] for a in actions],
                           after_step=[[str(g) for g in a.after_step] for a in actions])  # 7. per-rank actions
    manifest = Manifest(
        model=plan.model, graph_sha256=graph_sha,
        front_end=FrontEnd.EXPORT if gm.meta.get("hpml_front_end") is FrontEnd.EXPORT else FrontEnd.FX,
        leaf_modules=leaf_modules(gm), trace_inputs=input_specs(gm), inputs=input_specs(gm, rows=rows),
        microbatches=plan.microbatches,
        stages=tuple({"index": a.index, "file": f"stage_{a.index}.py", "class": class_name(a.index),
                      "actions": a.tokens()} for a in actions),
        collectives=tuple(collectives), files=file_hashes(files, sorted(files)),
        ranks=tuple({"stage": k, "replica": r, "actions": [str(x) for x in acts]}
                    for (k, r), acts in zip(rank_layout(plan), ranks)))
    write_files(out, files, manifest)                              # 8. files, then the manifest
    return load_build(out, gm, graph_module=gm)


def _stage_values(gm: fx.GraphModule, plan: Plan) -> tuple[int, list[dict[str, Any]]]:
    """Rows of one microbatch, and node values on one replica's slice of it, per stage.

    Replica ``r`` of a stage with ``d`` replicas runs rows ``r*b/d .. (r+1)*b/d``
    of each microbatch of ``b`` rows.
    """
    reps = [len(st.devices) for st in plan.stages]
    traced = trace_rows(gm)
    static = gm.meta.get("hpml_front_end") is FrontEnd.EXPORT
    rows = traced * reps[0] if static else traced // plan.microbatches  # export: traced at one replica's rows
    if not static and traced % plan.microbatches:
        raise HpmlError(f"a batch of {traced} rows does not split into {plan.microbatches} microbatches")
    for k, d in enumerate(reps):
        if rows % d:
            raise HpmlError(f"stage {k} has {d} replicas, but a microbatch has {rows} rows: use a batch "
                            f"divisible by microbatches x replicas ({plan.microbatches} x {d})")
    by_d = {d: microbatch_values(gm, rows // d) for d in sorted(set(reps))}
    return rows, [by_d[d] for d in reps]


def _boundary_dims(plan: Plan, actions: list[StageActions],
                   values: list[dict[str, Any]]) -> list[dict[str, tuple[int, ...]] | None]:
    """Per boundary ``k -> k+1``: batch dims of what it carries, where the replica counts differ."""
    out: list[dict[str, tuple[int, ...]] | None] = []
    for a in actions:
        k = a.index
        if a.send is None or len(plan.stages[k].devices) == len(plan.stages[k + 1].devices):
            out.append(None)
            continue
        out.append({v: batch_dims(values[k][v], values[k + 1][v], v) for v in a.send.values})
    return out


def _debug(owner: dict[str, int], values: list[dict[str, Any]], actions: list[StageActions]) -> dict[str, object]:
    return {
        "placement": owner,
        "send_specs": {a.index: [[list(s), str(d)] for v in (a.send.values if a.send else ())
                                 for s, d, _ in specs_of(values[a.index][v])] for a in actions},
        "actions": [{"index": a.index, "tokens": a.tokens(), "inputs": list(a.inputs), "remat": list(a.remat),
                     "recv": list(a.recv.values) if a.recv else [], "send": list(a.send.values) if a.send else [],
                     "swap": [list(r) for r in a.swap], "grad_sync": [[str(g), list(g.params)] for g in a.grad_sync]}
                    for a in actions],
    }
