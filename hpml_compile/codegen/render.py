"""Steps 1-7 of codegen, in one function: a traced graph and a plan -> the text of every build file.

:func:`render` is pure: it reads the graph and the plan and returns the
files' text and the manifest, writing nothing. Both ends of a build call it:
:func:`hpml_compile.codegen.generate` writes what it returns, and
:func:`hpml_compile.codegen.load_build` calls it again at load time, from the
build's ``plan.json`` and the user's model, and runs *that* code (the stage
files on disk are compared with it, never imported). So a build folder holds
no code that runs: only data and copies of code for people to read.

Example:
    >>> import torch
    >>> from hpml_compile.trace import trace
    >>> from hpml_compile.testing import split_plan
    >>> gm = trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),))
    >>> files, manifest = render(gm, split_plan(gm, "seq", 2))
    >>> sorted(files), manifest.stages[1]["class"]
    (['graph.txt', 'plan.json', 'stage_0.py', 'stage_1.py'], 'Stage1')
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from ..errors import HpmlError
from ..ir import FrontEnd, Profile
from ..plan import Plan
from ..recipe import RECIPE_FILE, ModelRecipe, recipe_text
from ..schedule import lower as lower_schedule
from ..schedule import deferral, rank_layout
from ..trace import fixed_shapes
from .actions import GradSync, StageActions
from .constants import CONSTANTS_FILE, constants_bytes
from .emit import class_name, stage_source
from .lower import lower_stage
from .manifest import Manifest, file_hashes, input_specs, leaf_modules, sha256
from .tensor_parallel import check_shared, graph_units, replica_plan, shard_graphs, tp_degree
from .partition import batch_dims, canonical_text, microbatch_values, place, plan_actions, specs_of, trace_rows

__all__ = ["render"]


def render(gm: fx.GraphModule, plan: Plan, *, profile: Profile | None = None, recipe: ModelRecipe | None = None,
           debug: bool = False) -> tuple[dict[str, str | bytes], Manifest]:
    """The build files of ``plan`` for the graph ``gm``, and their manifest (nothing is written).

    Args:
        gm: the model traced as the build is (see :func:`hpml_compile.codegen.generate`).
        plan: the plan to carry out.
        profile: copied into the build as ``profile.json`` when given.
        recipe: written as ``model.json`` (and hashed) when given.
        debug: also ``lowering.json``, every lowering step's output.

    Returns:
        File name -> text (``stage_<k>.py``, ``plan.json``, ``graph.txt`` and the optional files), and
        the manifest that lists them with their hashes.

    Raises:
        BuildMismatchError: the plan does not fit this graph (made for another model).
        HpmlError: a boundary would carry a non-tensor value that cannot be recomputed, or the batch does
            not divide into the microbatches.
    """
    text = canonical_text(gm)                                      # 1. the model graph
    graph_sha = sha256(text)
    full, plan = plan, replica_plan(plan)                          # tensor parallelism: one place of each group
    owner = place(gm, plan)                                        # 2. node -> stage, as the plan says
    rows, values = _stage_values(gm, plan)                          # 3. shapes on each stage replica
    actions = plan_actions(gm, plan, owner, values[0])             # 4. explicit transfers, regions, collectives
    dims = _boundary_dims(plan, actions, values, gm)
    last = len(plan.stages) - 1
    graphs = [lower_stage(gm, a, values[a.index], last=a.index == last, send_dims=dims[a.index],
                          recv_dims=dims[a.index - 1] if a.index else None, precision=plan.precision)
              for a in actions]                                    # 5. one graph per stage
    extra = _tensor_parallel(gm, full, graphs)                     # 5b. one rank's shard of tp stages
    files: dict[str, str | bytes] = {
        f"stage_{a.index}.py": stage_source(full.model, full, a, g, values[a.index], graph_sha, extra[a.index])
        for a, g in zip(actions, graphs)}                          # 6. readable source
    files["plan.json"] = json.dumps(full.to_dict(), indent=2) + "\n"
    files["graph.txt"] = text
    if gm.meta.get("hpml_constants"):                               # tensors the model does not hold: as data
        files[CONSTANTS_FILE] = constants_bytes(gm.meta["hpml_constants"])
    if profile is not None:
        files["profile.json"] = json.dumps(profile.to_dict(), indent=2) + "\n"
    if recipe is not None:
        files[RECIPE_FILE] = recipe_text(recipe)
    if debug:
        files["lowering.json"] = json.dumps(_debug(owner, values, actions), indent=2) + "\n"
    collectives = list(dict.fromkeys(str(g) for a in actions for g in (*a.grad_sync, *a.after_step)))
    check_shared(full, [GradSync.parse(t).stages for t in collectives])  # tied weights: one tp
    collectives.sort(key=lambda t: (GradSync.parse(t).stages, t))
    ranks = lower_schedule(plan.schedule, plan.microbatches, [len(st.devices) for st in plan.stages],
                           sends=[a.send is not None for a in actions],
                           grad_sync=[[str(g) for g in a.grad_sync] for a in actions],
                           after_step=[[str(g) for g in a.after_step] for a in actions],
                           defer=deferral(plan), chunks=plan.chunks)  # 7. per-rank actions
    manifest = Manifest(
        model=plan.model, graph_sha256=graph_sha,
        front_end=FrontEnd.EXPORT if gm.meta.get("hpml_front_end") is FrontEnd.EXPORT else FrontEnd.FX,
        leaf_modules=leaf_modules(gm), trace_inputs=input_specs(gm), inputs=input_specs(gm, rows=rows),
        keywords=tuple(gm.meta.get("hpml_keywords") or ()),
        microbatches=plan.microbatches, precision=plan.precision,
        stages=tuple({"index": a.index, "file": f"stage_{a.index}.py", "class": class_name(a.index),
                      "actions": a.tokens()} for a in actions),
        collectives=tuple(collectives), files=file_hashes(files, sorted(files)),
        ranks=tuple({"stage": k, "replica": r, "actions": [str(x) for x in acts]}
                    for (k, r), acts in zip(rank_layout(plan), ranks)))
    return files, manifest


def _tensor_parallel(gm: fx.GraphModule, plan: Plan, graphs: list[Any]) -> list[dict[str, Any]]:
    """Rewrite the graphs of stages with ``tp > 1`` to one rank's shard (:mod:`.tensor_parallel`); their class
    attributes ``TP`` and ``TP_SHARDS``."""
    if tp_degree(plan) == 1:
        return [{} for _ in graphs]
    units = graph_units(gm)
    out = []
    for g, st in zip(graphs, plan.stages):
        shards = shard_graphs(gm, [g.graph, *g.regions.values()], units, st.tp)
        out.append({"TP": st.tp, "TP_SHARDS": shards})
    return out


def _stage_values(gm: fx.GraphModule, plan: Plan) -> tuple[int, list[dict[str, Any]]]:
    """Rows of one microbatch, and node values on one replica's slice of it, per stage.

    Replica ``r`` of a stage with ``d`` replicas runs rows ``r*b/d .. (r+1)*b/d``
    of each microbatch of ``b`` rows; with plan rows (``Stage.rows``) it runs
    ``rows[r]`` rows, and the stage is generated at its first replica's rows
    (the runtime scales each boundary spec to the replica's own,
    :meth:`~hpml_compile.codegen.comm.Comm.shaped`).
    """
    reps = [len(st.devices) for st in plan.stages]
    traced = trace_rows(gm)
    static = fixed_shapes(gm)
    rows = traced * reps[0] if static else traced // plan.microbatches  # export: traced at one replica's rows
    if not static and traced % plan.microbatches:
        raise HpmlError(f"a batch of {traced} rows does not split into {plan.microbatches} microbatches")
    for k, st in enumerate(plan.stages):
        if st.rows and static:
            raise HpmlError(f"stage {k} gives its replicas uneven rows {list(st.rows)}, but this graph came from "
                            "torch.export, which fixes every shape: trace the model with torch.fx, or give the "
                            "stage an equal split")
        if st.rows and sum(st.rows) != rows:
            raise HpmlError(f"stage {k} gives its replicas rows {list(st.rows)} of each microbatch "
                            f"({sum(st.rows)} rows), but a microbatch of this build has {rows} rows (a batch of "
                            f"{traced} in {plan.microbatches}): trace with a batch of "
                            f"{sum(st.rows) * plan.microbatches} rows, or re-plan for this batch")
        if not st.rows and rows % reps[k]:
            raise HpmlError(f"stage {k} has {reps[k]} replicas, but a microbatch has {rows} rows: use a batch "
                            f"divisible by microbatches x replicas ({plan.microbatches} x {reps[k]})")
    per = [st.rows[0] if st.rows else rows // reps[k] for k, st in enumerate(plan.stages)]
    by_n = {n: microbatch_values(gm, n) for n in sorted(set(per))}
    return rows, [by_n[n] for n in per]


def _boundary_dims(plan: Plan, actions: list[StageActions], values: list[dict[str, Any]],
                   gm: fx.GraphModule | None = None) -> list[dict[str, tuple[int, ...]] | None]:
    """Per boundary ``k -> k+1``: batch dims of what it carries, where the two sides split rows differently.

    The dims come from the values at two different row counts: the two
    stages' own where they differ, else one more (shapes only) run of the graph.
    """
    out: list[dict[str, tuple[int, ...]] | None] = []
    extra: dict[str, Any] | None = None
    for a in actions:
        k = a.index
        if a.send is None:
            out.append(None)
            continue
        here, there = plan.stages[k], plan.stages[k + 1]
        if len(here.devices) == len(there.devices) and not here.rows and not there.rows:
            out.append(None)
            continue
        small, large = values[k], values[k + 1]
        static = gm is None or fixed_shapes(gm)
        if not static and all(_shapes(small[v]) == _shapes(large[v]) for v in a.send.values):
            if extra is None:
                assert gm is not None
                extra = microbatch_values(gm, trace_rows(gm) + 1)  # more rows than any replica runs
            large = extra
        out.append({v: batch_dims(small[v], large[v], v) for v in a.send.values})
    return out


def _shapes(value: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


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
