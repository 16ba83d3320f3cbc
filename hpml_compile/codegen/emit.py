"""Write a stage's graphs as a readable Python file: ``class Stage<k>(StageModule)`` and its regions.

The forward methods are torch.fx's own code generation of the stage graphs
(``Graph.python_code``), indented into classes, with the globals fx refers to
turned into imports and the inserted operations spelled ``ops.recv``,
``ops.send``, ``ops.checkpoint``, ``ops.swap``, each under a comment naming
what it carries. Collectives become the ``COLLECTIVES`` table (token ->
parameters), which the executor hands to the sync each token names. The
file imports only torch and ``hpml_compile.codegen``.

Example:
    >>> import torch.fx as fx
    >>> g = fx.Graph(); x = g.placeholder("x"); _ = g.output(g.call_function(torch.relu, (x,)))
    >>> print(class_source("Tiny", "RegionModule", "A region.", {"TARGETS": ()}, [g.python_code("self").src]))
    class Tiny(RegionModule):
        \"\"\"A region.\"\"\"
    <BLANKLINE>
        TARGETS = ()
    <BLANKLINE>
        def forward(self, x):
            relu = torch.relu(x);  x = None
            return relu
    <BLANKLINE>
"""

from __future__ import annotations

import importlib
import re
import textwrap
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.fx.node import _get_qualified_name

from ..errors import HpmlError
from ..ir import Precision
from ..precision import wire_dtype
from ..plan import Plan
from . import ops
from .actions import StageActions
from .lower import RECOMPUTE_ATTR, SWAP_ATTR, StageGraphs, targets_of

__all__ = ["class_source", "stage_source", "class_name"]

_BUILTINS = {
    "torch": "import torch",
    "device": "from torch import device",
    "inf": "from math import inf",
    "nan": "from math import nan",
    "NoneType": "NoneType = type(None)",
    "fx_pytree": "import torch.fx._pytree as fx_pytree",
    "pytree": "import torch.utils._pytree as pytree",
}

def class_name(stage: int, region: str | None = None) -> str:
    """``Stage3``, ``Stage3Recompute``, ``Stage3Swap0``."""
    if region is None:
        return f"Stage{stage}"
    if region == RECOMPUTE_ATTR:
        return f"Stage{stage}Recompute"
    return f"Stage{stage}Swap{region.rsplit('_', 1)[1]}"


def _literal(value: Any, indent: int = 4) -> str:
    """A tuple or dict literal, one item per line when long."""
    text = repr(value)
    if len(text) <= 80:
        return text
    pad = " " * (indent + 4)
    if isinstance(value, dict):
        items = [f"{pad}{k!r}: {v}," for k, v in value.items()]
        return "{\n" + "\n".join(items) + "\n" + " " * indent + "}"
    return "(\n" + "\n".join(f"{pad}{v!r}," for v in value) + "\n" + " " * indent + ")"


def class_source(name: str, base: str, doc: str, attrs: dict[str, Any], methods: Sequence[str]) -> str:
    """A class with a docstring, class attributes (as literals) and methods (source text at column 0)."""
    lines = [f"class {name}({base}):", textwrap.indent(f'"""{doc}"""', "    "), ""]
    for key, value in attrs.items():
        lines.append(f"    {key} = {value if isinstance(value, str) and key == 'REGIONS' else _literal(value)}")
    for m in methods:
        lines.append("")
        lines.append(textwrap.indent(m.strip("\n").rstrip(), "    "))
    return "\n".join(lines) + "\n"


def _resolve(name: str, obj: Any) -> tuple[str, str]:
    """(import line, binding line) for a global of fx's code that is not a builtin of its codegen."""
    qual = _get_qualified_name(obj)
    parts = qual.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            found: Any = importlib.import_module(module)
        except ImportError:
            continue
        for attr in parts[i:]:
            found = getattr(found, attr, None)
        if found is obj:
            return f"import {module}", f"{name} = {qual}"
    raise HpmlError(f"generated code calls {qual} ({obj!r}), which cannot be imported by that name; "
                    "make it a module-level function of an importable module")


def _python(graph: fx.Graph, imports: dict[str, None], bindings: dict[str, str]) -> str:
    """fx's code for ``graph`` with its globals resolved (ops as ``ops.<name>``)."""
    code = graph.python_code(root_module="self")
    src = code.src
    # `ops.recv(...)` reads best, unless a node of the graph is itself named `ops`
    spell_ops = not any(n.name == "ops" for n in graph.nodes)
    for gname, obj in code.globals.items():
        if not re.search(rf"\b{re.escape(gname)}\b", src):
            continue
        if callable(obj) and getattr(ops, getattr(obj, "__name__", ""), None) is obj:
            if spell_ops:
                src = re.sub(rf"\b{re.escape(gname)}\b", f"ops.{obj.__name__}", src)
            else:
                bindings[gname] = f"{gname} = ops.{obj.__name__}"
        elif gname in _BUILTINS:
            imports[_BUILTINS[gname]] = None
        else:
            imp, bind = _resolve(gname, obj)
            if bindings.get(gname, bind) != bind:
                raise HpmlError(f"generated code: the name {gname} stands for two objects; rename a node")
            imports[imp] = None
            bindings[gname] = bind
    return src


def _comment(src: str, acts: StageActions) -> str:
    """A comment above each inserted operation saying what it does."""
    notes = {}
    if acts.recv:
        notes["ops.recv("] = (f"received from stage {acts.recv.src} by the RECV token before this forward (shapes: "
                              f"RECV): {', '.join(acts.recv.values)}")
    if acts.send:
        notes["ops.send("] = f"sent to stage {acts.send.dst} by the SEND token after it: {', '.join(acts.send.values)}"
    notes["ops.checkpoint("] = "recompute: keep only the inputs, run again in backward" + (
        " (inputs swapped to host memory)" if acts.swap else "")
    notes["ops.swap("] = "swap: saved activations go to host memory, back before their backward use"
    out: list[Any] = []
    for line in src.splitlines():
        for key, note in notes.items():
            if key in line:
                pad = line[: len(line) - len(line.lstrip())]
                out.extend(pad + "# " + w for w in textwrap.wrap(note, 96 - len(pad)))
        out.append(line)
    return "\n".join(out)


def _collectives(acts: StageActions) -> str | None:
    """The stage's ``COLLECTIVES`` table: each collective token of its lists -> the parameters it moves."""
    syncs = tuple({str(g): g for g in (*acts.grad_sync, *acts.after_step)}.values())  # a token before and after OPT
    if not syncs:
        return None
    local = dict(acts.local_params)
    lines = ["# Each collective token of this stage's action lists -> the parameters it sums (before OPT) or gathers",
             "# (after it), in the order flattened on every rank; the token's suffix names the implementation.",
             "COLLECTIVES = {"]
    for g in syncs:
        names = [repr(local[p]) for p in g.params]
        why = "tied: shared with stages " + ", ".join(map(str, g.stages)) if len(g.stages) > 1 else \
            f"replicas of stage {g.stages[0]}"
        lines.append(f"    # {why}")
        entry = f"    {str(g)!r}: ({', '.join(names)}{',' if len(names) == 1 else ''}),"
        if len(entry) <= 110:
            lines.append(entry)
            continue
        lines.append(f"    {str(g)!r}: (")  # one parameter list, wrapped, never inside a name
        lines.extend(textwrap.wrap(", ".join(names) + ",", 100, initial_indent=" " * 8, subsequent_indent=" " * 8,
                                   break_on_hyphens=False, break_long_words=False))
        lines.append("    ),")
    return "\n".join([*lines, "}"])


def _describe(value: Any, precision: Precision = Precision.FP32) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(wire_dtype(value.dtype, precision)).removeprefix('torch.')}"
    return f"tuple of {len(value)} tensors"


def stage_source(model: str, plan: Plan, acts: StageActions, graphs: StageGraphs, values: dict[str, Any],
                 graph_sha256: str, extra: dict[str, Any] | None = None) -> str:
    """The text of ``stage_<k>.py``.

    Args:
        model: the model's name (for the docstring).
        plan: the plan.
        acts: the stage's actions.
        graphs: the stage's graphs.
        values: node values at microbatch size (for the docstring's shapes).
        graph_sha256: hash of the model graph the build is for.
        extra: more class attributes of the stage (a tensor-parallel stage's ``TP`` and ``TP_SHARDS``).

    Returns:
        Python source defining ``Stage<k>`` and its region classes.
    """
    k = acts.index
    st = plan.stages[k]
    imports: dict[str, None] = {"import torch": None}
    bindings: dict[str, str] = {}
    classes = []
    regions = {}
    for attr, g in graphs.regions.items():
        cls = class_name(k, attr)
        regions[attr] = cls
        count = sum(1 for n in g.nodes if n.op not in ("placeholder", "output", "get_attr"))
        doc = (f"Stage {k}'s {count} nodes under recompute: only the inputs are kept; backward runs them again."
               if attr == RECOMPUTE_ATTR else
               f"Stage {k}'s swap region {attr.rsplit('_', 1)[1]} ({count} nodes): saved activations go to host "
               "memory.")
        classes.append(class_source(cls, "RegionModule", doc, {"TARGETS": targets_of(g)},
                                    [_python(g, imports, bindings)]))
    methods = [_comment(_python(graphs.graph, imports, bindings), acts)]
    table = _collectives(acts)
    if table:
        methods.insert(0, table)
    attrs: dict[str, Any] = {"INDEX": k, "INPUTS": acts.inputs, "TARGETS": targets_of(graphs.graph)}
    if graphs.recv:
        attrs["RECV"] = graphs.recv
    if regions:
        attrs["REGIONS"] = "{" + ", ".join(f"{a!r}: {c}" for a, c in regions.items()) + "}"
    attrs.update(extra or {})
    doc = f"Stage {k} of {len(plan.stages)}: {len(acts.nodes)} node(s) on {', '.join(st.devices)}."
    classes.append(class_source(class_name(k), "StageModule", doc, attrs, methods))
    header = _header(model, plan, acts, values, graph_sha256)
    body = "\n".join(imports) + "\n\nfrom hpml_compile.codegen import ops\n" + \
        "from hpml_compile.codegen.stage import RegionModule, StageModule\n"
    if bindings:
        body += "\n" + "\n".join(bindings.values()) + "\n"
    return header + body + "\n\n" + "\n\n".join(classes)


def _header(model: str, plan: Plan, acts: StageActions, values: dict[str, Any], graph_sha256: str) -> str:
    st = plan.stages[acts.index]
    lines = [f"Stage {acts.index} of {len(plan.stages)} of {model}, generated by hpml-compile from plan.json.", "",
             "This file is for reading: load_build() regenerates this code from plan.json and the model,",
             "runs that, and refuses the build if this copy differs. Regenerate with `hpml-compile compile`.",
             "",
             f"Model graph sha256: {graph_sha256}",
             f"Devices: {', '.join(st.devices)} ({len(st.devices)} replica(s), ZeRO {int(st.zero)}); "
             f"{plan.microbatches} microbatch(es), {plan.schedule.value}.",
             *([f"Rows of each microbatch per replica: {', '.join(map(str, st.rows))} (uneven data parallelism: "
                f"this code is shaped for the first replica's {st.rows[0]} rows; each replica runs its own, its "
                "loss weighted by them)."] if st.rows else []),
             *([f"Precision: {plan.precision.value}: the forward runs under torch.autocast to "
                f"{plan.precision.dtype}; parameters, gradients and optimizer state stay float32; floating "
                f"tensors cross stages in {plan.precision.dtype}."] if plan.precision.is_mixed else []),
             f"Actions: {' '.join(acts.tokens()) or 'none'}."]
    for label, tr in (("Receives from", acts.recv), ("Sends to", acts.send)):
        if tr is not None:
            peer = tr.src if label.startswith("Receives") else tr.dst
            lines.append(f"{label} stage {peer} (per microbatch):")
            lines.extend(f"    {v}: {_describe(values[v], plan.precision)}" for v in tr.values)
    if acts.remat:
        lines.append(f"Recomputed here (non-tensor values never cross a stage): {', '.join(acts.remat)}.")
    if acts.recompute:
        lines.append("Recompute: the whole stage runs under torch.utils.checkpoint.")
        if acts.swap:
            lines.append("Swap: what the checkpoint keeps (the stage's inputs) goes to host memory until backward.")
    else:
        for i, run in enumerate(acts.swap):
            lines.append(f"Swap region {i}: {', '.join(run)}.")
    text = "\n".join(textwrap.fill(x, 100, subsequent_indent="    ") if len(x) > 100 and not x.startswith(" ")
                     else x for x in lines)
    return f'"""{text}\n"""\n\n'
