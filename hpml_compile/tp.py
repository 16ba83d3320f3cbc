"""Tensor parallelism inside a stage: which fx nodes are sharded how, found in the graph.

A stage with ``tp > 1`` (:class:`hpml_compile.plan.Stage`) runs each replica
on ``tp`` devices of one host that share its layers the way Megatron-LM
(Shoeybi et al., 2019) splits a transformer, found here from the profile's
graph rather than from class names:

- a *unit* is a group of linear layers reading one input ``X`` (the column
  layers: attention's query/key/value, the MLP's up and gate projections),
  whose outputs flow only through parameter-free element-wise, view,
  activation and attention nodes (the *inside* nodes) into one linear layer
  (the row layer: attention's output projection, the MLP's down projection).
  The column layers' weights are split by output features, the row layer's
  by input features, the inside nodes run on their shard (attention heads
  divided by ``tp``: the head-count reshapes it finds are listed in
  :attr:`Unit.reshapes`). Forward: one all-reduce of the row layer's
  output; backward: one all-reduce of the gradient of ``X`` (none where ``X``
  depends on no parameter: the model's input has no gradient). A unit allows
  the degrees dividing every head count (attention) or every column's
  output features (MLP), up to :data:`MAX_TP`.
- an embedding table indexed by the model's input (the token ids) is split
  by rows (vocabulary): each rank looks up the tokens of its rows and the
  output is all-reduced forward. A table indexed by positions computed in
  the graph is small and kept whole.
- the LM head (a linear layer outside any unit, wider than its input, whose
  output reaches the graph's output through views alone) is split by output features
  (vocabulary): its output all-gathered forward, the gradient of its input
  all-reduced backward.

Everything else (norms, residual additions, dropout between units) is
replicated: every rank of the group computes it whole. A linear layer that
fits none of these keeps ``tp = 1`` and :attr:`TensorParallel.unmatched`
says which and why (:mod:`hpml_compile.explain` prints it).

The cost model (:mod:`hpml_compile.stagecost`, through
:meth:`TensorParallel.part`) divides a sharded node's per-row compute, its
parameters and its activations by ``tp`` (its fixed per-op part is paid by
every rank whole) and adds the collectives above on the group's link.

Example:
    >>> from hpml_compile.ir import NodeOp, Profile, ProfileNode
    >>> def n(name, kind, inputs=(), params=(), shape=(2, 4, 8), op=NodeOp.CALL_MODULE):
    ...     return ProfileNode(name, op, name, inputs, name, kind, param_bytes=4 * 64 if params else 0,
    ...                        params=params, output_bytes=256, output_shape=shape)
    >>> nodes = (n("x", "view", op=NodeOp.PLACEHOLDER), n("up", "matmul", ("x",), ("up.w",), (2, 4, 32)),
    ...          n("act", "activation", ("up",), shape=(2, 4, 32)), n("down", "matmul", ("act",), ("down.w",)),
    ...          n("output", "view", ("down",), op=NodeOp.OUTPUT))
    >>> tp = analyze(Profile("toy", 2, "float32", nodes))
    >>> [(u.kind, u.columns, u.row, u.max_tp) for u in tp.units]
    [('mlp', ('up',), 'down', 8)]
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

from .ir import NodeOp, Profile, ProfileNode
from .memory import dtype_bytes

__all__ = ["MAX_TP", "TP_DEGREES", "Role", "Collective", "Unit", "TensorParallel", "ShardPart", "analyze"]

#: The largest tensor-parallel degree planned (a host's GPUs; NVLink domains are 8 wide on DGX hosts).
MAX_TP = 8
#: The degrees above 1 the planner considers.
TP_DEGREES = (2, 4, 8)
# Parameter-free nodes a unit's inside may hold: they act on each rank's shard independently.
_INSIDE_KINDS = frozenset({"view", "elementwise", "activation", "attention", "dropout"})


class Role(str, enum.Enum):
    """How a node runs in a tensor-parallel group."""

    COLUMN = "column"  # weight split by output features
    ROW = "row"  # weight split by input features; output all-reduced forward
    INSIDE = "inside"  # between the columns and the row: runs on its shard
    VOCAB_EMBEDDING = "vocab_embedding"  # table split by rows; output all-reduced forward
    VOCAB_HEAD = "vocab_head"  # weight split by vocabulary; output gathered forward, input gradient all-reduced


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective over a tensor-parallel group, per pass of the whole batch.

    Attributes:
        node: the node whose output (forward) or input gradient (backward) it acts on.
        phase: ``forward`` or ``backward``.
        op: ``all_reduce`` or ``all_gather``.
        nbytes: bytes of the whole batch's tensor (each rank's buffer; a microbatch on one replica moves its
            ``1 / (M d)``).
    """

    node: str
    phase: str
    op: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Unit:
    """A group of nodes sharded together.

    Attributes:
        kind: ``attention``, ``mlp``, ``embedding`` or ``head``.
        scope: the module path of its first node (for messages).
        columns: the column-split linear nodes (the embedding or head node for those kinds).
        row: the row-split linear node ("" for an embedding or head).
        inside: the nodes between columns and row, run on each rank's shard.
        reshapes: ``(node, heads)``: reshapes splitting features into ``heads`` heads, whose head count a
            rank of a ``tp`` group divides by ``tp``.
        max_tp: the largest degree (a power of two, at most :data:`MAX_TP`) dividing every split size.
        collectives: what the group runs for it per pass.
        weights: ``(parameter node, the layer reading it)`` where the graph reads a weight through a node of its
            own (torch.export's lifted parameters): split as the layer's weight is.
    """

    kind: str
    scope: str
    columns: tuple[str, ...]
    row: str
    inside: tuple[str, ...]
    reshapes: tuple[tuple[str, int], ...]
    max_tp: int
    collectives: tuple[Collective, ...]
    weights: tuple[tuple[str, str], ...] = ()

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node the unit shards (parameter nodes included)."""
        return (*(w for w, _ in self.weights), *self.columns, *self.inside, *((self.row,) if self.row else ()))

    def role(self, node: str) -> Role:
        """The role of one of :attr:`nodes` (a parameter node: its layer's)."""
        node = dict(self.weights).get(node, node)
        if self.kind == "embedding":
            return Role.VOCAB_EMBEDDING
        if self.kind == "head":
            return Role.VOCAB_HEAD
        return Role.ROW if node == self.row else Role.COLUMN if node in self.columns else Role.INSIDE


class ShardPart(NamedTuple):
    """What of a node (or a block of them) a degree ``tp`` divides, and the collectives it adds.

    Attributes:
        cost: ``{kind: (fwd_ms, bwd_ms)}`` of the sharded nodes, whole batch.
        fixed: ``{kind: (fwd_ms, bwd_ms)}``: their fixed parts (not divided: every rank pays them).
        param_bytes: parameter bytes of the sharded nodes.
        activation_bytes: activation bytes of the sharded nodes.
        fwd_allreduce: bytes all-reduced in the forward (whole batch), in ``fwd_count`` collectives.
        fwd_gather: bytes all-gathered in the forward (whole batch; one collective each, counted in ``fwd_count``).
        bwd_allreduce: bytes all-reduced in the backward, in ``bwd_count`` collectives.
        fwd_count, bwd_count: collectives per pass.
    """

    cost: Mapping[str, tuple[float, float]]
    fixed: Mapping[str, tuple[float, float]]
    param_bytes: int
    activation_bytes: int
    fwd_allreduce: int
    fwd_gather: int
    bwd_allreduce: int
    fwd_count: int
    bwd_count: int

    @staticmethod
    def add(parts: list["ShardPart"], kinds: tuple[str, ...]) -> "ShardPart":
        """The sum of ``parts`` over ``kinds``."""
        def tot(attr: str, k: str, i: int) -> float:
            return sum(getattr(p, attr).get(k, (0.0, 0.0))[i] for p in parts)
        return ShardPart({k: (tot("cost", k, 0), tot("cost", k, 1)) for k in kinds},
                         {k: (tot("fixed", k, 0), tot("fixed", k, 1)) for k in kinds},
                         *(sum(getattr(p, f) for p in parts) for f in ShardPart._fields[2:]))


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """The units of a graph and the linear layers left replicated.

    Attributes:
        units: the sharded units, in graph order.
        unmatched: ``(scope, why)`` for each linear layer (or group) that keeps ``tp = 1``.
    """

    units: tuple[Unit, ...] = ()
    unmatched: tuple[tuple[str, str], ...] = ()
    _of: dict[str, Unit] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for u in self.units:
            for n in u.nodes:
                self._of[n] = u

    def unit_of(self, node: str) -> Unit | None:
        """The unit sharding ``node``, or None."""
        return self._of.get(node)

    def role(self, node: str, tp: int) -> Role | None:
        """How ``node`` runs at degree ``tp`` (None: replicated, or ``tp`` is 1 or more than its unit allows)."""
        u = self._of.get(node)
        return u.role(node) if u is not None and 1 < tp <= u.max_tp else None

    def max_tp(self) -> int:
        """The largest degree any unit allows (1: nothing shards)."""
        return max((u.max_tp for u in self.units), default=1)

    def part(self, node: ProfileNode, tp: int, kinds: tuple[str, ...]) -> ShardPart | None:
        """What degree ``tp`` divides of ``node`` and the collectives it adds after it (None: nothing)."""
        u = self._of.get(node.name)
        if u is None or not 1 < tp <= u.max_tp:
            return None
        coll = [c for c in u.collectives if c.node == node.name]
        return ShardPart({k: (node.cost[k].fwd_ms, node.cost[k].bwd_ms) for k in kinds if k in node.cost},
                         {k: (node.cost[k].fwd_fixed_ms, node.cost[k].bwd_fixed_ms) for k in kinds if k in node.cost},
                         node.param_bytes, node.activation_bytes,
                         sum(c.nbytes for c in coll if c.phase == "forward" and c.op == "all_reduce"),
                         sum(c.nbytes for c in coll if c.phase == "forward" and c.op == "all_gather"),
                         sum(c.nbytes for c in coll if c.phase == "backward"),
                         sum(1 for c in coll if c.phase == "forward"), sum(1 for c in coll if c.phase == "backward"))

    def to_dict(self) -> dict[str, object]:
        """A JSON-able summary (for dumps and ``explain``)."""
        return {"units": [{"kind": u.kind, "scope": u.scope, "columns": list(u.columns), "row": u.row,
                           "max_tp": u.max_tp} for u in self.units],
                "unmatched": [{"scope": s, "why": w} for s, w in self.unmatched]}


def _pow2_dividing(*sizes: int) -> int:
    """The largest power of two at most :data:`MAX_TP` dividing every size (1 when one is odd or 0)."""
    t = MAX_TP
    while t > 1 and any(s <= 0 or s % t for s in sizes):
        t //= 2
    return t


def _last(n: ProfileNode) -> int:
    return int(n.output_shape[-1]) if n.output_shape else 0


class _Graph:
    """Consumers and data dependence of a profile's nodes."""

    def __init__(self, profile: Profile) -> None:
        self.nodes = {n.name: n for n in profile.nodes}
        self.order = {n.name: i for i, n in enumerate(profile.nodes)}
        self.users: dict[str, list[str]] = {n.name: [] for n in profile.nodes}
        # whether a node's output depends on a parameter, so that backward computes its gradient
        self.learns: dict[str, bool] = {}
        for n in profile.nodes:
            for i in n.inputs:
                self.users[i].append(n.name)
            self.learns[n.name] = bool(n.params) or any(self.learns.get(i, False) for i in n.inputs)

    def weights(self, name: str) -> list[str]:
        """The parameter nodes ``name`` reads (torch.export lifts parameters into nodes of their own)."""
        return [i for i in self.nodes[name].inputs
                if self.nodes[i].op is NodeOp.GET_ATTR and self.nodes[i].params]

    def is_linear(self, name: str) -> bool:
        n = self.nodes[name]
        return n.op_kind == "matmul" and bool(n.params or self.weights(name)) and n.output_shape is not None

    def activation_input(self, name: str) -> str | None:
        """The input of a linear node that is not a parameter read (None: not exactly one)."""
        ins = [i for i in self.nodes[name].inputs if self.nodes[i].op is not NodeOp.GET_ATTR]
        return ins[0] if len(ins) == 1 else None

    def reads_input(self, name: str) -> bool:
        """Whether ``name``'s non-parameter inputs are the graph's inputs, possibly through views."""
        todo = [i for i in self.nodes[name].inputs if self.nodes[i].op is not NodeOp.GET_ATTR]
        while todo:
            node = self.nodes[todo.pop()]
            if node.op is NodeOp.PLACEHOLDER:
                continue
            if node.op_kind != "view" or not node.inputs:
                return False
            todo.extend(node.inputs)
        return True

    def depends_on(self, name: str, root: str) -> bool:
        """Whether ``name`` reads ``root``'s output, directly or not (walks back no earlier than ``root``)."""
        stop, seen, todo = self.order[root], set(), [name]
        while todo:
            x = todo.pop()
            if x == root:
                return True
            if x in seen or self.order[x] < stop:
                continue
            seen.add(x)
            todo.extend(self.nodes[x].inputs)
        return False


def _unit(g: _Graph, x: str, columns: list[str]) -> Unit | str:
    """The unit of ``columns`` (linear nodes reading ``x``), or why they form none."""
    inside: set[str] = set()
    rows: set[str] = set()
    todo = list(columns)
    while todo:
        cur = todo.pop()
        for u in g.users[cur]:
            if u in inside or u in rows or u in columns:
                continue
            node = g.nodes[u]
            if g.is_linear(u):
                rows.add(u)
            elif node.op_kind in _INSIDE_KINDS and not node.params and node.op is not NodeOp.OUTPUT:
                inside.add(u)
                todo.append(u)
            else:
                return f"{u} ({node.op_kind}) reads the split features before any linear layer merges them"
    if len(rows) != 1:
        return (f"their outputs reach {len(rows)} linear layers ({', '.join(sorted(rows)) or 'none'}), not one "
                "that merges them")
    row = rows.pop()
    own = inside | set(columns)
    if g.activation_input(row) not in own:
        return f"{row} also reads a tensor from outside them"
    for n in inside:
        for i in g.nodes[n].inputs:
            if i not in own and g.depends_on(i, x):
                return f"{n} mixes in {i}, which depends on the unsplit input {x}"
    heads = []
    for n in inside:
        node, prev = g.nodes[n], [g.nodes[i] for i in g.nodes[n].inputs if i in own]
        shape = node.output_shape
        if shape and prev and prev[0].output_shape and len(shape) == len(prev[0].output_shape) + 1 \
                and shape[-2] * shape[-1] == prev[0].output_shape[-1] and shape[-2] > 1:
            heads.append((n, int(shape[-2])))
    kind = "attention" if any(g.nodes[n].op_kind == "attention" for n in inside) else "mlp"
    sizes = [h for _, h in heads] if heads else [_last(g.nodes[c]) for c in columns]
    max_tp = _pow2_dividing(*sizes, *(_last(g.nodes[c]) for c in columns))
    if max_tp == 1:
        return f"no degree above 1 divides their split sizes {sizes}"
    order = sorted(own | {row}, key=g.order.__getitem__)
    # backward all-reduces the gradient of X, which autograd computes only where X depends on a parameter (not
    # where it is the model's input, as an MLP's first layer reads it)
    coll = (Collective(row, "forward", "all_reduce", g.nodes[row].output_bytes),
            *((Collective(min(columns, key=g.order.__getitem__), "backward", "all_reduce", g.nodes[x].output_bytes),)
              if g.learns[x] else ()))
    return Unit(kind, g.nodes[order[0]].scope, tuple(sorted(columns, key=g.order.__getitem__)), row,
                tuple(sorted(inside, key=g.order.__getitem__)), tuple(sorted(heads, key=lambda h: g.order[h[0]])),
                max_tp, coll, tuple((w, n) for n in (*columns, row) for w in g.weights(n)))


def _reaches_output(g: _Graph, name: str) -> bool:
    """Whether ``name``'s output reaches the graph's output through view nodes alone."""
    todo, seen = [name], set()
    while todo:
        cur = todo.pop()
        for u in g.users[cur]:
            node = g.nodes[u]
            if node.op is NodeOp.OUTPUT:
                return True
            if node.op_kind == "view" and u not in seen:
                seen.add(u)
                todo.append(u)
    return False


def analyze(profile: Profile) -> TensorParallel:
    """Find the units a tensor-parallel stage shards (the module docstring's rules).

    Args:
        profile: the profile (its graph: inputs, op kinds, parameters, output shapes).

    Returns:
        The units, and the linear layers that keep ``tp = 1`` with the reason.
    """
    g = _Graph(profile)
    units: list[Unit] = []
    unmatched: list[tuple[str, str]] = []
    taken: set[str] = set()
    by_input: dict[str, list[str]] = {}
    for n in profile.nodes:
        if g.is_linear(n.name):
            x = g.activation_input(n.name)
            if x is None:
                unmatched.append((n.scope or n.name, f"{n.name} reads {len(n.inputs)} tensors, not one input"))
                taken.add(n.name)
            else:
                by_input.setdefault(x, []).append(n.name)
    for x, cols in by_input.items():
        cols = [c for c in cols if c not in taken]
        if not cols:
            continue
        got = _unit(g, x, cols)
        if isinstance(got, Unit):
            units.append(got)
            taken.update(got.nodes)
    bpe = dtype_bytes(profile.dtype)
    for n in profile.nodes:
        table = g.weights(n.name)
        if n.op_kind != "embedding" or n.name in taken or not _last(n) or len(n.params) + len(table) != 1:
            continue
        if not g.reads_input(n.name):
            unmatched.append((n.scope or n.name, "its indices are computed in the graph (positions), not the "
                                                 "model's input tokens: a small table, kept whole"))
            continue
        shape = g.nodes[table[0]].output_shape if table else None
        rows = int(shape[0]) if shape else n.param_bytes // (_last(n) * bpe)
        t = _pow2_dividing(rows)
        if t > 1:
            units.append(Unit("embedding", n.scope or n.name, (n.name,), "", (), (), t,
                              (Collective(n.name, "forward", "all_reduce", n.output_bytes),),
                              tuple((w, n.name) for w in table)))
            taken.update((n.name, *table))
        else:
            unmatched.append((n.scope or n.name, f"no degree above 1 divides its {rows} rows"))
    for n in profile.nodes:
        if not g.is_linear(n.name) or n.name in taken:
            continue
        x = g.activation_input(n.name)
        if _reaches_output(g, n.name) and x is not None and _last(n) > _last(g.nodes[x]):
            t = _pow2_dividing(_last(n))
            if t > 1:
                units.append(Unit("head", n.scope or n.name, (n.name,), "", (), (), t,
                                  (Collective(n.name, "forward", "all_gather", n.output_bytes),
                                   Collective(n.name, "backward", "all_reduce", g.nodes[x].output_bytes)),
                                  tuple((w, n.name) for w in g.weights(n.name))))
                taken.add(n.name)
                continue
            unmatched.append((n.scope or n.name, f"no degree above 1 divides its {_last(n)} output features "
                                                 "(the vocabulary)"))
            continue
        got = _unit(g, x, [n.name]) if x is not None else "it reads no single input"
        unmatched.append((n.scope or n.name, got if isinstance(got, str) else "a unit of one layer overlaps another"))
    units.sort(key=lambda u: min(g.order[c] for c in u.nodes))
    return TensorParallel(tuple(units), tuple(unmatched))


def degrees_for(limit: int) -> tuple[int, ...]:
    """The degrees above 1 planned with at most ``limit`` devices in a group.

    >>> degrees_for(4), degrees_for(1)
    ((2, 4), ())
    """
    return tuple(t for t in TP_DEGREES if t <= limit)


def log2_degree(tp: int) -> int:
    """``log2(tp)`` for a planned degree (for tables indexed by degree).

    >>> log2_degree(8)
    3
    """
    return int(math.log2(tp))
