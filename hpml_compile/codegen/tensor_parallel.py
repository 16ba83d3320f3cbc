"""Lowering a stage with ``tp > 1``: one rank's shard of its graph, the plan each rank runs, and its peers.

A stage of ``replicas x tp`` devices (:class:`hpml_compile.plan.Stage`) runs
on one rank per device; every rank runs a plan without tensor parallelism
(:func:`replica_plan`): a rank at place ``i`` of its group sees each stage
on ``devices[i % tp::tp]`` (that stage's data-parallel group at place
``i % tp``), runs that plan's schedule, boundaries and gradient sync, and
meets the other places only inside the sharded layers. Each rank holds the
whole activation after a row layer's all-reduce, and the whole gradient of
a stage's input after the column layers' all-reduce, so a boundary between
stages of any two degrees moves whole tensors: the receiver at place ``j``
reads from the sender at place ``j % tp_sender`` (:class:`Places`). Between
stages of the same ``tp`` place ``i`` talks to place ``i``; a tp-2 stage
before a tp-1 stage sends forward from place 0 only and gets the gradient
back on both places (the tp-1 rank sends it twice); a tp-1 stage before a
tp-2 stage sends its output to both places, and place 0 alone sends the
gradient back. The gradient sync of a sharded parameter runs over its
data-parallel group at one place.

:func:`shard_graphs` rewrites each stage graph where :func:`hpml_compile.tp.analyze`
found Megatron units (Shoeybi et al., 2019):

- before a unit's column layers, ``tp_copy`` (gradient of ``X`` all-reduced);
- the head-count reshapes of the unit read ``heads / tp`` (a literal feature
  size of a reshape that merges the heads back, ``features / tp``);
- the row layer becomes ``tp_row`` (its output all-reduced, bias added once);
- a vocabulary embedding becomes ``tp_embedding``, the LM head ``tp_head``;

and lists the parameters each rank holds a slice of (``TP_SHARDS``:
qualified name, dimension), which the runtime slices at load
(:mod:`hpml_compile.runtime.execute.tensor_parallel`). The collectives are in
:mod:`.tpops`.

ZeRO-1/2 shard a tensor-parallel stage's optimizer state and gradients over
its data-parallel group (each copy's plan is a replicated stage whose
parameters are this rank's slices), ZeRO-3 its parameters as well; a stage
that recomputes holds its layers in a region graph, rewritten the same way
(the recomputed forward repeats the collectives, in the same order on every
rank of the group).

What is refused, by name: swap or offload on a stage with ``tp > 1``
(:func:`tp_degree`), and parameters tied between stages of different ``tp``
(:func:`check_shared`: one stage would hold slices, the other the whole
tensor).

Example:
    >>> from hpml_compile.cluster import load_cluster
    >>> from hpml_compile.plan import Plan, Stage
    >>> st = Stage(0, ("cpu0", "cpu1", "cpu2", "cpu3"), ("x",), tp=2)
    >>> p = Plan("m", load_cluster("local-cpu-4"), "gpipe", 1, (st,))
    >>> [s.devices for s in replica_plan(p, 1).stages], tp_degree(p)
    ([('cpu1', 'cpu3')], 2)
    >>> mixed = Plan("m", load_cluster("local-cpu-4"), "gpipe", 1, (Stage(0, ("cpu0", "cpu1"), ("x",), tp=2),
    ...                                                             Stage(1, ("cpu2",), ("y",))))
    >>> [s.devices for s in replica_plan(mixed, 1).stages], Places.of(mixed).table(1)
    ([('cpu1',), ('cpu2',)], [[1], [2]])
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
import torch.fx as fx

from ..errors import PlanError
from ..ir import NodeOp, Profile, ProfileNode
from ..plan import Plan
from ..tp import TensorParallel, Unit, analyze
from ..trace import node_info
from . import tpops
from .lower import TP_ATTR

__all__ = ["TP_ATTR", "Places", "tp_degree", "replica_plan", "check_shared", "graph_units", "shard_graphs"]

_VIEWS = frozenset({"view", "reshape", "unflatten", "_unsafe_view"})


def tp_degree(plan: Plan) -> int:
    """The largest tensor-parallel degree of ``plan``'s stages (1: none).

    Raises:
        PlanError: a stage with ``tp > 1`` also swaps or offloads its optimizer (what the runtime does not
            combine with tensor parallelism).
    """
    for st in plan.stages:
        what = [w for w, on in (("swap", bool(st.swap)), ("offload", st.offload_optimizer)) if on and st.tp > 1]
        if what:
            raise PlanError(f"stage {st.index} has tp={st.tp} and {', '.join(what)}, which the runtime does not "
                            f"combine with tensor parallelism: set that stage's {', '.join(what)} off, or its tp to 1")
    return max(st.tp for st in plan.stages)


def replica_plan(plan: Plan, index: int = 0) -> Plan:
    """The plan that a rank at place ``index`` of its tensor-parallel group runs: each stage on
    ``devices[index % tp::tp]`` with ``tp = 1`` (``plan`` itself where no stage has ``tp > 1``).

    Raises:
        PlanError: see :func:`tp_degree`.
        ValueError: ``index`` is no place of the plan's groups.
    """
    if tp_degree(plan) == 1:
        return plan
    if not 0 <= index < Places.of(plan).count:
        raise ValueError(f"index {index} is not a place in the plan's groups of {[st.tp for st in plan.stages]}")
    return replace(plan, stages=tuple(replace(st, devices=st.devices[index % st.tp::st.tp], tp=1)
                                      for st in plan.stages))


def check_shared(plan: Plan, stage_sets: list[tuple[int, ...]]) -> None:
    """Refuse a collective over stages of different ``tp`` (a parameter tied between them, an embedding shared
    with the LM head of another stage, say): each stage's ranks would hold it split differently.

    Raises:
        PlanError: naming the stages and their degrees.
    """
    for stages in stage_sets:
        tps = sorted({plan.stages[k].tp for k in stages})
        if len(tps) > 1:
            raise PlanError(f"stages {list(stages)} share parameters (tied weights), but run at tensor-parallel "
                            f"degrees {[plan.stages[k].tp for k in stages]}: a shared parameter is held the same "
                            "way on every stage that uses it; give those stages the same tp, or untie the weights")


@dataclass(frozen=True, slots=True)
class Places:
    """Which job rank runs each replica of each stage at each place of its tensor-parallel group, and the peers
    of a boundary between stages of different ``tp``.

    Job ranks follow the plan's device order: replica ``r`` of stage ``k`` holds devices ``r * tp .. r * tp +
    tp - 1`` of the stage, place ``j`` of its group the ``j``-th of them. A rank at place ``i`` sees every stage
    at place ``i % tp`` of that stage's groups (:meth:`table`): the ranks it sends to, receives from and syncs
    with. Along a boundary, the receiver at place ``j`` reads from the sender at place ``j % tp_sender``, so a
    sender at place ``i`` sends to every receiver place ``j`` with ``j % tp_sender == i``
    (:meth:`send_places`): a tp-2 stage's output (whole on both ranks after its row layer's all-reduce) goes
    forward from place 0 only, and the gradient coming back from a tp-1 stage goes to both places; a tp-1
    stage's output goes to both places of a tp-2 stage after it, whose place 0 alone sends the gradient back
    (the gradient of its input is whole on each rank: the column layers' all-reduce). Between stages of the
    same ``tp``, place ``i`` talks to place ``i``.

    An interleaved plan (``chunks`` ``v > 1``) has ``S * v`` stages on ``S`` device groups: stage ``k`` runs on
    the ranks of stage ``k % S``, so a rank holds ``v`` stages and :meth:`locate` names the first.

    Attributes:
        tps: each stage's degree.
        replicas: each stage's replicas (its devices over its ``tp``).
        chunks: stages per device group (the plan's ``chunks``; 1: one stage per rank).

    Example:
        >>> p = Places((2, 1), (1, 1))
        >>> p.table(1), p.send_places(0, 1, 1), p.send_places(1, 0, 0), p.recv_place(1, 0, 0)
        ([[1], [2]], [], [0, 1], 0)
        >>> [p.locate(r) for r in range(3)]
        [(0, 0, 0), (0, 0, 1), (1, 0, 0)]
        >>> v = Places((1, 1, 1, 1), (2, 1, 2, 1), chunks=2)  # stages 0 and 2 on ranks 0-1, 1 and 3 on rank 2
        >>> v.table(0), v.size, v.locate(2)
        ([[0, 1], [2], [0, 1], [2]], 3, (1, 0, 0))
    """

    tps: tuple[int, ...]
    replicas: tuple[int, ...]
    chunks: int = 1

    @classmethod
    def of(cls, plan: Plan) -> "Places":
        """The places of ``plan``'s stages."""
        return cls(tuple(st.tp for st in plan.stages), tuple(st.replicas for st in plan.stages), plan.chunks)

    @property
    def groups(self) -> int:
        """Device groups: stages of one per rank (``S``, the stages over the chunks)."""
        return len(self.tps) // self.chunks

    @property
    def count(self) -> int:
        """How many different tables the ranks see (the least common multiple of the degrees)."""
        return math.lcm(*self.tps)

    @property
    def size(self) -> int:
        """Ranks in the job."""
        return sum(t * r for t, r in zip(self.tps[:self.groups], self.replicas[:self.groups]))

    def rank(self, stage: int, replica: int, place: int) -> int:
        """The job rank of ``replica`` of ``stage`` at ``place`` of its group (taken modulo the stage's ``tp``)."""
        g = stage % self.groups
        base = sum(t * r for t, r in zip(self.tps[:g], self.replicas[:g]))
        return base + replica * self.tps[g] + place % self.tps[g]

    def table(self, place: int) -> list[list[int]]:
        """Each stage's ranks, one per replica, as a rank at ``place`` sees them."""
        return [[self.rank(k, r, place) for r in range(n)] for k, n in enumerate(self.replicas)]

    def locate(self, rank: int) -> tuple[int, int, int]:
        """``(stage, replica, place)`` of a job rank.

        Raises:
            ValueError: the job has no such rank.
        """
        base = 0
        for k, (t, n) in enumerate(zip(self.tps[:self.groups], self.replicas[:self.groups])):
            if rank < base + t * n:
                r, j = divmod(rank - base, t)
                return k, r, j
            base += t * n
        raise ValueError(f"rank {rank} is not one of the plan's {self.size} ranks")

    def send_places(self, me: int, peer: int, place: int) -> list[int]:
        """The places of stage ``peer``'s group that the rank of stage ``me`` at ``place`` sends a message to."""
        return [j for j in range(self.tps[peer]) if j % self.tps[me] == place % self.tps[me]]

    def recv_place(self, me: int, peer: int, place: int) -> int:
        """The place of stage ``peer``'s group that the rank of stage ``me`` at ``place`` receives a message from."""
        return place % self.tps[me] % self.tps[peer]


def graph_units(gm: fx.GraphModule) -> TensorParallel:
    """:func:`hpml_compile.tp.analyze` of a traced graph (its static facts; nothing is timed)."""
    from ..profile.static import analyze as facts_of  # noqa: PLC0415 -- only a tensor-parallel build needs it

    facts = facts_of(gm)
    nodes = []
    for n in gm.graph.nodes:
        info, f = node_info(n), facts[n.name]
        nodes.append(ProfileNode(n.name, NodeOp(n.op), str(n.target), tuple(i.name for i in n.all_input_nodes),
                                 info.scope, f.op_kind, param_bytes=f.param_bytes, params=f.params,
                                 output_bytes=info.output_bytes, output_shape=info.shape,
                                 tensor_output=info.tensor_output))
    dtype = next((str(p.dtype).removeprefix("torch.") for p in gm.parameters()), "float32")
    return analyze(Profile("graph", 1, dtype, tuple(nodes)))


def _weight_args(gm: fx.GraphModule, graph: fx.Graph, node: fx.Node) -> tuple[Any, Any, Any]:
    """``(input, weight, bias)`` of a linear or embedding node of ``graph`` (bias None where it has none).

    A call of a submodule reads its weight and bias through new ``get_attr`` nodes; ``aten.linear`` and
    ``aten.embedding`` carry them as arguments.
    """
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        with graph.inserting_before(node):
            w = graph.get_attr(f"{node.target}.weight")
            b = graph.get_attr(f"{node.target}.bias") if getattr(mod, "bias", None) is not None else None
        if isinstance(mod, torch.nn.Embedding):
            if mod.padding_idx is not None or mod.max_norm is not None:
                raise PlanError(f"{node.format_node()}: an embedding with padding_idx or max_norm is not split by "
                                "vocabulary; set this stage's tp to 1")
            return node.args[0], w, None
        return node.args[0], w, b
    if "embedding" in str(node.target):
        return node.args[1], node.args[0], None
    args = list(node.args) + [None] * 3
    return args[0], args[1], node.kwargs.get("bias", args[2])


def _param_names(gm: fx.GraphModule, node: fx.Node) -> list[tuple[str, int]]:
    """``(qualified name, ndim)`` of the parameters a linear or embedding node reads."""
    if node.op == "call_module":
        return [(f"{node.target}.{n}", p.dim()) for n, p in gm.get_submodule(str(node.target)).named_parameters()]
    out = []
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            t = gm.get_parameter(str(a.target)) if _is_param(gm, str(a.target)) else None
            if t is not None:
                out.append((str(a.target), t.dim()))
    return out


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def _divide_shape(node: fx.Node, unit: Unit, heads: int | None, features: int, tp: int) -> None:
    """Rewrite the literal sizes of a view-like node inside ``unit`` to one rank's shard."""
    target = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if target not in _VIEWS:
        return
    shape_pos = 2 if target == "unflatten" else 1
    args: list[Any] = list(node.args)
    if len(args) <= shape_pos:
        return
    packed = isinstance(args[shape_pos], (list, tuple))
    shape: list[Any] = list(args[shape_pos]) if packed else args[shape_pos:]
    pos = len(shape) - 2 if heads is not None else len(shape) - 1
    want = heads if heads is not None else features
    if pos < 0 or shape[pos] == -1 or (isinstance(shape[pos], int) and shape[pos] != want):
        return  # inferred, or not the split dimension
    if not isinstance(shape[pos], int):
        raise PlanError(f"{node.format_node()} in the {unit.kind} unit {unit.scope} reshapes its split dimension to "
                        "a size computed in the graph, which cannot be divided among the tensor-parallel ranks; "
                        "set this stage's tp to 1")
    shape[pos] = want // tp
    if packed:
        args[shape_pos] = type(args[shape_pos])(shape)
        node.args = tuple(args)
    else:
        node.args = tuple(args[:shape_pos] + shape)


def shard_graphs(gm: fx.GraphModule, graphs: Sequence[fx.Graph], units: TensorParallel,
                 tp: int) -> tuple[tuple[str, int], ...]:
    """Rewrite one stage's graphs (in place) to run one rank's shard of its units at degree ``tp``.

    Args:
        gm: the traced model (its submodules say which linear layers have a bias).
        graphs: the stage's lowered graphs (node names as in ``gm``): its forward and its regions (a recompute
            region holds the stage's layers; its forward reads the group from its own ``hpml_tp``, and the
            recomputation in backward repeats the collectives in the same order on every rank).
        units: :func:`graph_units` of ``gm``.
        tp: the degree.

    Returns:
        ``(parameter name, dimension)`` of each parameter this stage holds a slice of.

    Raises:
        PlanError: a reshape inside a unit has computed sizes, or an embedding has ``padding_idx``.
    """
    shards: dict[str, int] = {}
    for graph in graphs:
        _shard_one(gm, graph, units, tp, shards)
    return _once(gm, shards)


def _shard_one(gm: fx.GraphModule, graph: fx.Graph, units: TensorParallel, tp: int, shards: dict[str, int]) -> None:
    # a region's outputs come back to the stage's graph as getitem nodes named after them: not the layers
    by_name = {n.name: n for n in graph.nodes if not (n.op == "call_function" and n.target is operator.getitem)}
    anchor = next((n for n in graph.nodes if n.op not in ("placeholder", "get_attr")), None)
    if anchor is None:
        return
    with graph.inserting_before(anchor):
        group = graph.get_attr(TP_ATTR)
    for unit in units.units:
        if not 1 < tp <= unit.max_tp or not any(c in by_name for c in unit.columns):
            continue
        if unit.kind in ("attention", "mlp"):
            _shard_unit(gm, graph, by_name, unit, group, tp, shards)
        else:
            node = by_name[unit.columns[0]]
            shards.update({p: 0 for p, _ in _param_names(gm, node)})
            x, w, b = _weight_args(gm, graph, node)
            fn = tpops.tp_embedding if unit.kind == "embedding" else tpops.tp_head
            with graph.inserting_before(node):
                new = graph.call_function(fn, (group, x, w) if fn is tpops.tp_embedding else (group, x, w, b))
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            new.name = node.name
    if not group.users:
        graph.erase_node(group)
    graph.lint()


def _once(gm: fx.GraphModule, shards: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """``shards`` with a parameter read under two names (a tied embedding and LM head) listed once."""
    seen: dict[int, tuple[str, int]] = {}
    for name, dim in shards.items():
        p = gm.get_parameter(name)
        if id(p) in seen and seen[id(p)][1] != dim:
            raise PlanError(f"{name} is also {seen[id(p)][0]}, split along another dimension there; a parameter "
                            "shared by two layers is split one way: set this stage's tp to 1")
        seen.setdefault(id(p), (name, dim))
    return tuple(seen.values())


def _shard_unit(gm: fx.GraphModule, graph: fx.Graph, by_name: dict[str, fx.Node], unit: Unit, group: fx.Node,
                tp: int, shards: dict[str, int]) -> None:
    missing = [n for n in (*unit.columns, unit.row) if n not in by_name]
    if missing:
        raise PlanError(f"the {unit.kind} unit {unit.scope} is cut between stages ({', '.join(missing)} elsewhere); "
                        "a stage with tp > 1 holds each sharded unit whole: move the cut, or set tp to 1")
    cols = [by_name[c] for c in unit.columns]
    x = cols[0].args[0]
    with graph.inserting_before(cols[0]):
        copied = graph.call_function(tpops.tp_copy, (group, x))
    for c in cols:
        c.args = (copied, *c.args[1:])
        shards.update({p: 0 for p, _ in _param_names(gm, c)})
    heads = dict(unit.reshapes)
    row = by_name[unit.row]
    merged = node_info(row.args[0]).shape if isinstance(row.args[0], fx.Node) else None
    features = merged[-1] if merged else -1  # the row layer's input features, whole
    for name in unit.inside:
        if name in by_name:
            _divide_shape(by_name[name], unit, heads.get(name), features, tp)
    shards.update({p: 1 for p, nd in _param_names(gm, row) if nd == 2})
    xin, w, b = _weight_args(gm, graph, row)
    with graph.inserting_before(row):
        new = graph.call_function(tpops.tp_row, (group, xin, w, b))
    row.replace_all_uses_with(new)
    graph.erase_node(row)
    new.name = row.name
