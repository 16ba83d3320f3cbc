"""Build one fx graph per stage from its actions: recv, the stage's nodes, regions, send.

Each stage graph reads, in order: the model inputs it uses (placeholders),
the tuple received from the previous stage (one ``ops.recv`` node, which
takes what the stage's RECV token received, and a ``getitem`` per tensor,
named after the value it carries), the non-tensor
values recomputed here, the plan's nodes for this stage -- inside a
``ops.checkpoint`` region when the stage recomputes, inside ``ops.swap``
regions for runs of swapped nodes -- and one ``ops.send`` of the tuple the
next stage needs. The last stage returns the model's output; the others
return the send's token. Regions are separate graphs, called through a
submodule attribute (``hpml_recompute``, ``hpml_swap_<i>``).

Example:
    >>> import torch
    >>> from hpml_compile.trace import trace
    >>> from hpml_compile.plan import Plan, Stage
    >>> from hpml_compile.cluster import load_cluster
    >>> from hpml_compile.codegen.partition import microbatch_values, place, plan_actions
    >>> gm = trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),))
    >>> st = (Stage(0, ("cpu0",), ("input_1", "_0")), Stage(1, ("cpu1",), ("_1", "output"), recompute=True))
    >>> plan = Plan("seq", load_cluster("local-cpu-2"), "gpipe", 1, st)
    >>> vals = microbatch_values(gm, 2)
    >>> acts = plan_actions(gm, plan, place(gm, plan), vals)
    >>> sg = lower_stage(gm, acts[1], vals, last=True)
    >>> sg.recv  # what its RECV tokens receive: (shape, dtype, batch dimension) of each tensor
    (((2, 4), torch.float32, None),)
    >>> print(sg.graph.python_code("self").src.strip())  # doctest: +NORMALIZE_WHITESPACE
    def forward(self):
        hpml_comm = self.hpml_comm
        recv = hpml_compile_codegen_ops_recv(hpml_comm, 0, 1);  hpml_comm = None
        _0 = recv[0];  recv = None
        hpml_recompute = self.hpml_recompute
        checkpoint = hpml_compile_codegen_ops_checkpoint(hpml_recompute, _0);  hpml_recompute = _0 = None
        _1 = checkpoint[0];  checkpoint = None
        return _1
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from . import ops
from .actions import StageActions
from ..ir import Precision
from ..precision import wire_dtype
from .partition import specs_of

__all__ = ["COMM_ATTR", "SWAP_ATTR", "RECOMPUTE_ATTR", "StageGraphs", "lower_stage", "targets_of"]

COMM_ATTR = "hpml_comm"
SWAP_ATTR = "hpml_swap"
RECOMPUTE_ATTR = "hpml_recompute"
TP_ATTR = "hpml_tp"  # a tensor-parallel stage's group (.tensor_parallel)
_OWN_ATTRS = frozenset({COMM_ATTR, SWAP_ATTR, TP_ATTR})


@dataclass
class StageGraphs:
    """The graphs of one stage: its forward and its regions (attribute name -> graph), and ``recv``: the
    ``(shape, dtype, batch dim)`` of each tensor its ``ops.recv`` takes (the stage's ``RECV``, which its
    RECV tokens receive)."""

    index: int
    graph: fx.Graph
    regions: dict[str, fx.Graph] = field(default_factory=dict)
    recv: tuple[ops.TensorSpec, ...] = ()


class _Builder:
    """Copies nodes of the traced graph into a new graph, mapping their inputs through ``env``."""

    def __init__(self, env: dict[str, Any] | None = None) -> None:
        self.graph = fx.Graph()
        self.env: dict[str, Any] = dict(env or {})
        self._attrs: dict[str, fx.Node] = {}

    def attr(self, target: str) -> fx.Node:
        if target not in self._attrs:
            self._attrs[target] = self.graph.get_attr(target)
        return self._attrs[target]

    def arg(self, node: fx.Node) -> Any:
        if node.name in self.env:
            return self.env[node.name]
        if node.op == "get_attr":  # weights are read where they are used: duplicated, never sent
            return self.attr(str(node.target))
        raise KeyError(f"lowering: {node.format_node()} is used before it is available in this stage")

    def copy(self, node: fx.Node) -> fx.Node:
        new = self.graph.node_copy(node, self.arg)
        self.env[node.name] = new
        return new


def _unpack(b: _Builder, tuple_node: fx.Node, names: tuple[str, ...], values: dict[str, Any]) -> None:
    """``getitem`` nodes that give each carried value its own name (tuples of tensors rebuilt)."""
    i = 0
    for name in names:
        v = values[name]
        if isinstance(v, torch.Tensor):
            b.env[name] = b.graph.create_node("call_function", operator.getitem, (tuple_node, i), name=name)
            i += 1
        else:
            leaves = [b.graph.create_node("call_function", operator.getitem, (tuple_node, i + j),
                                          name=f"{name}_{j}") for j in range(len(v))]
            b.env[name] = tuple(leaves) if isinstance(v, tuple) else leaves
            i += len(v)


def _leaves(b: _Builder, names: tuple[str, ...], values: dict[str, Any]) -> list[fx.Node]:
    out: list[fx.Node] = []
    for name in names:
        local = b.env[name]
        if isinstance(local, (tuple, list)):
            out.extend(local)
        elif isinstance(values[name], torch.Tensor):
            out.append(local)
        else:  # a tuple made in this stage: send its elements
            out.extend(b.graph.call_function(operator.getitem, (local, j)) for j in range(len(values[name])))
    return out


def _flat(value: Any) -> list[fx.Node]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _region(outer: _Builder, nodes: list[fx.Node], call: Callable[[list[fx.Node]], fx.Node]) -> fx.Graph:
    """Copy ``nodes`` into a region graph and call it from ``outer``; returns the region graph."""
    inside = {n.name for n in nodes}
    sub = _Builder()
    inputs: list[fx.Node] = []
    for n in nodes:
        for u in n.all_input_nodes:
            if u.name in inside or u.name in sub.env or u.op == "get_attr":
                continue
            here = _flat(outer.arg(u))
            phs = [sub.graph.placeholder(x.name) for x in here]
            inputs.extend(here)
            local = outer.env[u.name]
            sub.env[u.name] = type(local)(phs) if isinstance(local, (tuple, list)) else phs[0]
    for n in nodes:
        sub.copy(n)
    # A value leaves the region if anything outside it reads it (later nodes, the send, the output).
    leaving = [n for n in nodes if any(u.name not in inside for u in n.users)]
    sub.graph.output(tuple(sub.env[n.name] for n in leaving))
    result = call(inputs)
    for i, n in enumerate(leaving):
        outer.env[n.name] = outer.graph.create_node("call_function", operator.getitem, (result, i), name=n.name)
    return sub.graph


def lower_stage(gm: fx.GraphModule, acts: StageActions, values: dict[str, Any], *, last: bool,
                recv_dims: dict[str, tuple[int, ...]] | None = None,
                send_dims: dict[str, tuple[int, ...]] | None = None,
                precision: Precision = Precision.FP32) -> StageGraphs:
    """The graphs of one stage.

    Args:
        gm: the traced graph.
        acts: the stage's actions (:func:`~hpml_compile.codegen.partition.plan_actions`).
        values: node values on one replica's slice of a microbatch of this stage.
        last: whether this is the last stage (it returns the model's output).
        recv_dims: batch dimension of each received value's tensors, where the
            previous stage has another replica count (the boundary is resharded).
        send_dims: the same for the values sent to the next stage.
        precision: the plan's; under bf16/fp16 a floating boundary tensor's spec carries the compute
            dtype, the dtype it crosses in (:func:`hpml_compile.precision.wire_dtype`).

    Returns:
        The stage's forward graph and its region graphs, linted.
    """
    orig = {n.name: n for n in gm.graph.nodes}
    b = _Builder()
    recv: tuple[ops.TensorSpec, ...] = ()
    for name in acts.inputs:
        ph = orig[name]
        b.env[name] = b.graph.placeholder(name, default_value=ph.args[0] if ph.args else inspect.Signature.empty)
    if acts.recv:
        recv = tuple((sh, wire_dtype(dt, precision), bd) for v in acts.recv.values
                     for sh, dt, bd in specs_of(values[v], (recv_dims or {}).get(v)))
        r = b.graph.call_function(ops.recv, (b.attr(COMM_ATTR), acts.recv.src, acts.recv.dst))
        _unpack(b, r, acts.recv.values, values)
    for name in acts.remat:  # cheap non-tensor values (sizes) recomputed from what crossed
        b.copy(orig[name])
    compute = [orig[n] for n in acts.nodes if orig[n].op != "output"]
    regions: dict[str, fx.Graph] = {}
    if acts.recompute and compute:
        def run_checkpoint(inputs: list[fx.Node]) -> fx.Node:
            kwargs = {"swap": b.attr(SWAP_ATTR)} if acts.swap else {}
            return b.graph.call_function(ops.checkpoint, (b.attr(RECOMPUTE_ATTR), *inputs), kwargs)
        regions[RECOMPUTE_ATTR] = _region(b, compute, run_checkpoint)
    else:
        runs = {run[0]: (i, run) for i, run in enumerate(acts.swap)}
        skip: set[str] = set()
        for n in compute:
            if n.name in skip:
                continue
            if n.name in runs:
                i, run = runs[n.name]
                attr = f"{SWAP_ATTR}_{i}"

                def run_swap(inputs: list[fx.Node], attr: str = attr) -> fx.Node:
                    return b.graph.call_function(ops.swap, (b.attr(SWAP_ATTR), b.attr(attr), *inputs))
                regions[attr] = _region(b, [orig[x] for x in run], run_swap)
                skip.update(run)
                continue
            b.copy(n)
    if acts.send:
        leaves = _leaves(b, acts.send.values, values)
        specs = tuple((sh, wire_dtype(dt, precision), bd) for v in acts.send.values
                      for sh, dt, bd in specs_of(values[v], (send_dims or {}).get(v)))
        token = b.graph.call_function(ops.send, (b.attr(COMM_ATTR), acts.send.src, acts.send.dst, specs,
                                                 tuple(leaves)))
        b.graph.output(token)
    elif last:
        out = orig[acts.nodes[-1]] if acts.nodes and orig[acts.nodes[-1]].op == "output" else \
            next(n for n in gm.graph.nodes if n.op == "output")
        b.graph.output(fx.node.map_arg(out.args[0], b.arg))
    else:
        b.graph.output(None)
    b.graph.lint()
    for g in regions.values():
        g.lint()
    return StageGraphs(acts.index, b.graph, regions, recv)


def targets_of(graph: fx.Graph) -> tuple[str, ...]:
    """Qualified names a graph reads from the model (submodules called, parameters and buffers read)."""
    out: dict[str, None] = {}
    for n in graph.nodes:
        if n.op in ("call_module", "get_attr"):
            t = str(n.target)
            if t not in _OWN_ATTRS and t != RECOMPUTE_ATTR and not t.startswith(f"{SWAP_ATTR}_"):
                out[t] = None
    return tuple(out)
