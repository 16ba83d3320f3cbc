"""Pass 3, costgraph: a Profile as a weighted networkx DiGraph, coarsened into blocks.

A :class:`CostGraph` wraps an ``nx.DiGraph`` whose nodes carry per-device-kind
costs and sizes and whose edges carry the bytes that would cross a stage
boundary cut there. :meth:`CostGraph.coarsen` merges nodes into blocks (a
transformer layer, a ResNet bottleneck) by grouping *contiguous runs of a
topological order* that share a block key; because every edge goes forward
in that order, the quotient graph is acyclic by construction, and sums of
times, FLOPs and bytes are preserved exactly.

Scopes are the structure a person gave the model, so they are kept where they
exist. Where they give none (nodes outside every module, as in a model of
top-level parameters applied with ``F.linear``; or one block holding nearly
the whole model), that run is cut by cost instead: into contiguous runs of at most
``share`` of the model's time on every device kind, so that the solver can
still cut it. Without that, such a model is one block and gets one stage on
any cluster.

Example:
    >>> from hpml_compile.ir import Profile, ProfileNode, NodeOp, NodeCost
    >>> c = lambda ms: {"cpu": NodeCost(ms, 2 * ms, True)}
    >>> p = Profile(model="toy", batch_size=1, dtype="float32", nodes=(
    ...     ProfileNode("x", NodeOp.PLACEHOLDER, "x", cost=c(0.0)),
    ...     ProfileNode("l0_fc", NodeOp.CALL_MODULE, "l.0.fc", ("x",), scope="l.0.fc", output_bytes=8, cost=c(1.0)),
    ...     ProfileNode("l0_act", NodeOp.CALL_MODULE, "l.0.act", ("l0_fc",), scope="l.0.act", output_bytes=8, cost=c(0.5)),
    ...     ProfileNode("l1_fc", NodeOp.CALL_MODULE, "l.1.fc", ("l0_act",), scope="l.1.fc", output_bytes=8, cost=c(1.0)),
    ...     ProfileNode("output", NodeOp.OUTPUT, "output", ("l1_fc",), cost=c(0.0))))
    >>> cg = build(p).coarsen()
    >>> cg.order  # the input placeholder joins the first block
    ('l.0', 'l.1', 'output')
    >>> cg.node("l.0").cost["cpu"], cg.node("l.0").members, cg.graph.edges["l.0", "l.1"]["bytes"]
    ((1.5, 3.0), ('x', 'l0_fc', 'l0_act'), 8)
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from .backsplit import node_split_costs
from .ir import CostGraphNode, NodeOp, Profile, base_kind
from .memory import process_bytes
from .tp import TP_DEGREES, ShardPart, TensorParallel, analyze as analyze_tp

if TYPE_CHECKING:  # networkx is imported where a graph is made: a rank that only reads its plan never makes one
    import networkx as nx

__all__ = ["CostGraph", "build", "block_key"]

_SIZE_ATTRS = ("flops", "bwd_flops", "param_bytes", "activation_bytes", "output_bytes", "mem_bytes")
_NUMERIC = re.compile(r"^\d+$")
# Where scopes give no structure, runs of at most this share of the model's time (about 32 blocks or more):
# fine enough that the solver's best cut is rarely a block away from the optimum, coarse enough for the ILP.
RUN_SHARE = 1 / 32
# A block holding more than this share of the model's time gives no structure either (a model wrapped in one
# module whose own code is functional calls): it is cut by cost too, so that no model is a single block.
_WHOLE = 0.9


def block_key(scope: str) -> str:
    """The block a module path belongs to: the path up to its first numeric component.

    ``layers.3.attn.q_proj`` -> ``layers.3``; ``layer2.1.conv1`` -> ``layer2.1``;
    ``lm_head`` -> ``lm_head``; ``""`` (top level) -> ``""``.
    """
    parts = scope.split(".") if scope else []
    for i, part in enumerate(parts):
        if _NUMERIC.match(part):
            return ".".join(parts[: i + 1])
    return parts[0] if parts else ""


@dataclass(frozen=True, slots=True)
class CostGraph:
    """A DAG of (possibly merged) nodes with costs per device kind.

    Read a node with :meth:`node` (a typed :class:`~hpml_compile.ir.CostGraphNode`); only this
    module reads the networkx attributes behind it. Node attributes: ``members`` (fx node names,
    topological order), ``cost``
    (``{kind: (fwd_ms, bwd_ms)}`` for the full batch), ``fixed`` (``{kind:
    (fwd_ms, bwd_ms)}``, the part of ``cost`` that a slice of the batch
    still costs in full; absent means 0), ``params`` (parameter names used), the
    sizes ``flops``, ``bwd_flops``, ``param_bytes``, ``activation_bytes``,
    ``output_bytes``, ``mem_bytes`` (sums over members), and ``op`` (the fx
    op of a single member, ``"block"`` for merged nodes).
    Edge attributes: ``producers`` (``{fx node: output bytes}`` of the values
    crossing the edge), ``bytes`` (their sum) and ``tensors`` (False when a non-tensor value, e.g. an int from
    ``x.shape``, crosses it: a pipeline stage may not be cut there).

    Attributes:
        graph: the networkx DiGraph (do not mutate it; build a new CostGraph).
        order: a topological order of ``graph`` (the profile's order).
        kinds: device kinds every node has a cost for.
        model: model name, from the profile.
        batch_size: batch size the costs were measured at.
        optimizer_ms: one optimizer step over every parameter, per kind (empty: not modelled).
        param_sizes: bytes per parameter name (for tied parameters shared by stages; may be empty).
        streams: per measured CPU kind, ``(one thread's, the whole host's)`` memory bandwidth in GB/s
            (:func:`hpml_compile.profile.timing.time_streams`; empty: not measured).
        cores: per measured CPU kind, the logical CPUs of the host it was profiled on
            (:func:`hpml_compile.profile.timing.host_facts`; empty: not recorded): the simulator takes each
            host of a cluster to have as many, so that ranks beyond them share cores.
        coruns: per measured CPU kind, ``(forward, backward, ranks)``: how much slower its blocks ran while
            ``ranks`` processes ran them at once on the host (:func:`hpml_compile.profile.corun.time_corun`;
            empty: not measured): the simulator stretches CPU ranks' compute by it while they overlap.
        flat_steps: per measured kind, its optimizer step over the parameters' bytes as one flat tensor (a ZeRO
            shard's) over its step over the parameters one by one (``optimizer_ms``); 1 where not measured.
        processes: per measured CPU kind, the bytes a rank's process holds before its model (the profile's
            ``devices[kind]["process"]``, :mod:`hpml_compile.profile.process`; empty: not measured).
        bookkeeping: per measured CPU kind, the milliseconds a rank's ``Pipeline.step`` spends beyond the parts
            priced elsewhere: beyond the executor's span (the batch check, host sampling, memory counting; the
            profile's ``devices[kind]["process"]["step_ms"]``) and inside it between the parts it times (its
            set-up, its loop, the events around each token; ``["executor_ms"]``), measured with the baseline; the
            simulator adds it to the step (empty: not measured). Its fixed part: :attr:`bookkeeping_per_ms` adds
            a part per millisecond of the rank's compute (the host's sampling, about every 50 ms of steps).
        agreements: per measured CPU kind, ``(ms, per ms of compute)``: how long two of its ranks on one host take
            to agree on a step's loss as the runtime does it, a fixed part and a part per millisecond of the
            compute before it (the profile's ``devices[kind]["process"]["agree_ms"]``, ``["agree_per_ms"]``;
            empty: not measured, and the loss agreement is priced on the link).
        meetings: per measured CPU kind, ``(ms, per ms of compute)``: what two of its ranks on one host both pay
            to meet before the gradient sync (``["meet_ms"]``, ``["meet_per_ms"]``; empty: not measured, and the
            meeting is priced on the link).
        fitted: per measured CPU kind, the longest compute its probe ran (``["fit_compute_ms"]``): the agreement,
            the meeting and the skew are taken at it for longer compute (a line fitted on 1 and 20 ms of compute
            is not extrapolated to a step of 150; empty: extrapolated, as profiles without it were).
        skews: per measured CPU kind, ``(ms, per ms of compute)``: how far apart two of its ranks that did the same
            work reach the gradient sync, a fixed part and a part per millisecond of their compute
            (``devices[kind]["process"]["skew_ms"]``, ``["skew_per_ms"]``; empty: not measured): a replicated stage
            waits that long for its later replica each step.
        tensor_parallel: the units a tensor-parallel stage shards (:func:`hpml_compile.tp.analyze`); each
            node's ``shard`` attribute sums what of its members a degree divides.
        compiled: the kinds whose costs are of stages that run compiled (the profile's blocks timed compiled,
            :mod:`hpml_compile.profile.compiled`); empty: every cost is of eager stages.
        optimizer_coruns: per measured CPU kind, ``(slow-down, ranks)``: how much slower its optimizer step ran
            while ``ranks`` processes stepped theirs at once on the host
            (:func:`hpml_compile.profile.optcorun.time_optimizer_corun`; empty: not measured, and the step stretches
            by the host's memory bandwidth as any streaming does).
        early_receives: per measured CPU kind, the ms of CPU a pipeline message that arrived before its receive
            was posted takes from its receiving rank (``devices[kind]["process"]["recv_cpu_ms"]``,
            :func:`hpml_compile.profile.messages.probe_early_receive`; empty: not measured, and not charged).
    """

    graph: nx.DiGraph
    order: tuple[str, ...]
    kinds: tuple[str, ...]
    model: str
    batch_size: int
    optimizer_ms: Mapping[str, float] = field(default_factory=dict)
    param_sizes: Mapping[str, int] = field(default_factory=dict)
    streams: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    cores: Mapping[str, int] = field(default_factory=dict)
    coruns: Mapping[str, tuple[float, float, int]] = field(default_factory=dict)
    flat_steps: Mapping[str, float] = field(default_factory=dict)
    tensor_parallel: TensorParallel = field(default_factory=TensorParallel)
    processes: Mapping[str, int] = field(default_factory=dict)
    bookkeeping: Mapping[str, float] = field(default_factory=dict)
    stage_only: frozenset[str] = frozenset()
    agreements: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    skews: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    meetings: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    fitted: Mapping[str, float] = field(default_factory=dict)
    compiled: frozenset[str] = frozenset()
    optimizer_coruns: Mapping[str, tuple[float, int]] = field(default_factory=dict)
    early_receives: Mapping[str, float] = field(default_factory=dict)
    bookkeeping_per_ms: Mapping[str, float] = field(default_factory=dict)
    _records: dict[str, CostGraphNode] = field(default_factory=dict, init=False, repr=False, compare=False)

    def node(self, name: str) -> CostGraphNode:
        """The typed record of graph node ``name`` (read it rather than the networkx attributes).

        Args:
            name: a node of ``graph``.

        Returns:
            Its members, costs, parameters and sizes (made once per node, then reused).

        Raises:
            KeyError: if ``name`` is not a node of the graph.
        """
        rec = self._records.get(name)
        if rec is None:
            a = self.graph.nodes[name]
            rec = CostGraphNode(a["members"], a["cost"], a["params"], a["scope"], a["op"],
                                *(a[f] for f in _SIZE_ATTRS), fixed=a.get("fixed", {}), shard=a.get("shard", {}),
                                split=a.get("split", {}))
            self._records[name] = rec
        return rec

    def limit_tp(self, max_tp: int) -> "CostGraph":
        """This graph with no node sharding at a tensor-parallel degree above ``max_tp`` (1: none at all), so that
        a planner on it never gives a stage a larger ``tp``.

        Args:
            max_tp: the largest degree kept.

        Returns:
            A new CostGraph (this one where nothing changes).
        """
        if all(t <= max_tp for t in self.tp_degrees()):
            return self
        import networkx as nx

        q = nx.DiGraph()
        for n, attrs in self.graph.nodes(data=True):
            kept = {t: p for t, p in attrs.get("shard", {}).items() if t <= max_tp}
            q.add_node(n, **{k: v for k, v in attrs.items() if k != "shard"}, **({"shard": kept} if kept else {}))
        q.add_edges_from(self.graph.edges(data=True))
        return replace(self, graph=q)  # every other field kept, the node records made afresh

    def tp_degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees above 1 at which some node of the graph shards (empty: none)."""
        return tuple(t for t in TP_DEGREES if any(t in self.node(n).shard for n in self.order))

    def stream_gbps(self, kind: str) -> tuple[float, float] | None:
        """``(one thread's, the host's)`` measured memory bandwidth for ``kind`` (its base kind for a variant)."""
        return self.streams.get(kind, self.streams.get(base_kind(kind)))

    def corun(self, kind: str) -> tuple[float, float, int] | None:
        """``(forward, backward, ranks)`` slow-down of ``kind``'s compute with ``ranks`` processes computing on its
        host (its base kind for a variant); None: not measured."""
        return self.coruns.get(kind, self.coruns.get(base_kind(kind)))

    def optimizer_corun(self, kind: str) -> tuple[float, int] | None:
        """``(slow-down, ranks)`` of ``kind``'s optimizer step with ``ranks`` processes stepping on its host (its base
        kind for a variant); None: not measured."""
        return self.optimizer_coruns.get(kind, self.optimizer_coruns.get(base_kind(kind)))

    def early_receive_ms(self, kind: str) -> float:
        """CPU ms a message that waited for its receive takes from a receiving rank of ``kind`` (its base kind for a
        variant); 0: not measured."""
        return self.early_receives.get(kind, self.early_receives.get(base_kind(kind), 0.0))

    def process_bytes(self, kind: str, stage_param_bytes: Any, replicas: int = 1, zero: int = 0) -> Any:
        """Bytes a rank of ``kind`` holds besides its stage's tensors (:func:`hpml_compile.memory.process_bytes`: the
        measured baseline, the model as built, a replicated stage's shared memory, the optimizer's temporaries, the
        heap's slack, ZeRO-3's re-gathered unit), of
        the form of ``stage_param_bytes`` (an int, or an array of candidates'); 0 where no baseline was measured."""
        base = self.processes.get(kind, self.processes.get(base_kind(kind)))
        if base is None:
            return stage_param_bytes * 0
        whole = stage_param_bytes if kind in self.stage_only or base_kind(kind) in self.stage_only \
            else int(self.total("param_bytes"))  # a rank of saved weights builds its stage only
        return process_bytes(base, whole, stage_param_bytes, replicas=replicas,
                             zero=int(zero), largest_param=max(self.param_sizes.values(), default=None))

    def bookkeeping_ms(self, kind: str, compute_ms: float = 0.0) -> float:
        """Milliseconds of the runtime's per-step bookkeeping on a rank of ``kind`` that computes ``compute_ms`` a
        step (0.0: not measured): the fixed part and the part per ms (not held at the probe's longest compute:
        the host's sampling costs each step its share of a sample however long the step is)."""
        per_ms = self.bookkeeping_per_ms.get(kind, self.bookkeeping_per_ms.get(base_kind(kind), 0.0))
        return self.bookkeeping.get(kind, self.bookkeeping.get(base_kind(kind), 0.0)) + per_ms * max(0.0, compute_ms)

    def agreement_ms(self, kind: str, compute_ms: float = 0.0) -> float | None:
        """The measured loss agreement of two ranks of ``kind`` on one host after ``compute_ms`` of compute, ms
        (None: not measured)."""
        got = self.agreements.get(kind, self.agreements.get(base_kind(kind)))
        return None if got is None else got[0] + got[1] * self._within_fit(kind, compute_ms)

    def meeting_ms(self, kind: str, compute_ms: float) -> float | None:
        """What two ranks of ``kind`` on one host both pay to meet before the gradient sync after ``compute_ms`` of
        compute, ms (None: not measured)."""
        got = self.meetings.get(kind, self.meetings.get(base_kind(kind)))
        return None if got is None else got[0] + got[1] * self._within_fit(kind, compute_ms)

    def _within_fit(self, kind: str, compute_ms: float) -> float:
        """``compute_ms``, at most the longest compute ``kind``'s probe fitted its figures on."""
        return min(compute_ms, self.fitted.get(kind, self.fitted.get(base_kind(kind), float("inf"))))

    def skew_ms(self, kind: str, compute_ms: float) -> float:
        """How far apart two ranks of ``kind`` that each computed ``compute_ms`` reach the gradient sync, ms (0.0:
        not measured)."""
        fixed, per_ms = self.skews.get(kind, self.skews.get(base_kind(kind), (0.0, 0.0)))
        return fixed + per_ms * self._within_fit(kind, compute_ms)

    def host_cores(self, kind: str) -> int | None:
        """Logical CPUs of the host ``kind`` was profiled on (its base kind for a variant); None: not recorded."""
        return self.cores.get(kind, self.cores.get(base_kind(kind)))

    def cost_at(self, node: str, kind: str, fraction: float) -> tuple[float, float]:
        """``(fwd_ms, bwd_ms)`` of ``node`` on ``kind`` for a slice holding ``fraction`` of the batch rows:
        ``fixed + (full - fixed) * fraction``."""
        rec = self.node(node)
        fwd, bwd = rec.cost[kind]
        ff, bf = rec.fixed_at(kind)
        return ff + (fwd - ff) * fraction, bf + (bwd - bf) * fraction

    def split_at(self, nodes: Sequence[str], kinds: Sequence[str], fraction: float
                 ) -> tuple[float, float, float] | None:
        """ZB-H1's measured split of the backward of ``nodes`` (a stage's) for a slice holding ``fraction`` of the
        rows, on the first of ``kinds`` the profile measured it for (:mod:`hpml_compile.profile.split`).

        Args:
            nodes: graph nodes.
            kinds: the stage's device kinds.
            fraction: the slice's share of the batch rows.

        Returns:
            ``(weight share of the backward's compute, extra ms, the extra's weight-gradient ms)`` per microbatch;
            None where no kind was measured for every node.
        """
        kind = next((k for k in kinds if nodes and all(k in self.node(n).split for n in nodes)), None)
        if kind is None:
            return None
        weight = total = extra = extra_weight = 0.0
        for n in nodes:
            rec = self.node(n)
            full, (w, x, xw) = rec.cost[kind][1], rec.split[kind]
            _, b = self.cost_at(n, kind, fraction)
            weight += w / full * b if full > 0 else 0.0
            total, extra, extra_weight = total + b, extra + x, extra_weight + xw
        return (weight / total if total > 0 else 0.0), extra, extra_weight

    def optimizer_ms_per_byte(self, kind: str, flat: bool = False) -> float:
        """Optimizer-step ms per parameter byte on ``kind`` (its base kind for a variant), 0 when not modelled;
        ``flat``: of one flat tensor (a ZeRO-1/2/3 shard, ``runtime.sync.zero``), the parameters-one-by-one rate times
        the kind's measured ``flat_steps`` ratio (its base kind's for a variant, so a slowed variant keeps it)."""
        total = self.total("param_bytes")
        ms = self.optimizer_ms.get(kind, self.optimizer_ms.get(base_kind(kind), 0.0))
        if flat:
            ms *= self.flat_steps.get(kind, self.flat_steps.get(base_kind(kind), 1.0))
        return ms / total if total > 0 else 0.0

    def total(self, attr: str, kind: str | None = None) -> float:
        """Sum of a size attribute, or with ``kind``, of fwd+bwd time on that kind."""
        g = self.graph
        if kind is not None:
            return sum(sum(self.node(n).cost[kind]) for n in g)
        return sum(getattr(self.node(n), attr) for n in g)

    def coarsen(self, key: Callable[[str], str] | None = None, *, share: float = RUN_SHARE) -> "CostGraph":
        """Merge contiguous runs (in ``order``) of nodes with the same block key.

        Args:
            key: maps a node name to its block key; by default the
                :func:`block_key` of the first member's module scope. Nodes of
                cost zero with no scope (placeholders, shape reads) join the
                block of the node after them so they do not fragment the chain.
            share: where keys give no structure (a run with the empty key, or one
                block holding nearly the whole model), that run is cut into runs of
                at most this fraction of the model's time on every kind
                (:func:`_split_by_cost`).

        Returns:
            A new CostGraph, acyclic, with the same totals.

        Raises:
            ValueError: if ``share`` is not in ``(0, 1]``.
        """
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}: it is a fraction of the model's time")
        g = self.graph
        keyf = key or (lambda n: block_key(g.nodes[n]["scope"]))
        keys = [keyf(n) for n in self.order]
        # Free top-level nodes take the key of what follows (the output node takes what precedes).
        for i in range(len(keys) - 2, -1, -1):
            n = self.order[i]
            if keys[i] == "" and _is_free(g.nodes[n]) and g.nodes[n]["op"] != NodeOp.OUTPUT.value:
                keys[i] = keys[i + 1]
        groups: list[tuple[str, list[str]]] = []
        for n, k in zip(self.order, keys):
            if groups and groups[-1][0] == k:
                groups[-1][1].append(n)
            else:
                groups.append((k, [n]))
        groups = _split_by_cost(self, groups, share)
        return self.merge([members for _, members in groups], [k for k, _ in groups])

    def merge(self, groups: list[list[str]], keys: list[str] | None = None) -> "CostGraph":
        """Quotient graph over ``groups``, which must be contiguous runs of ``order`` covering it."""
        flat = [n for grp in groups for n in grp]
        if flat != list(self.order):
            raise ValueError("groups must be contiguous runs of the topological order that cover every node once")
        g = self.graph
        names: list[str] = []
        used: dict[str, int] = {}
        for i, grp in enumerate(groups):
            base = (keys[i] if keys else "") or (grp[0] if len(grp) == 1 else f"top{i}")
            used[base] = used.get(base, 0) + 1
            names.append(base if used[base] == 1 else f"{base}#{used[base]}")
        import networkx as nx

        owner = {n: names[i] for i, grp in enumerate(groups) for n in grp}
        q = nx.DiGraph()
        for name, grp in zip(names, groups):
            attrs = _merge_attrs([g.nodes[n] for n in grp], self.kinds)
            q.add_node(name, **attrs)
        for u, v, data in g.edges(data=True):
            a, b = owner[u], owner[v]
            if a == b:
                continue
            if not q.has_edge(a, b):
                q.add_edge(a, b, producers={}, tensors=True)
            e = q.edges[a, b]
            e["producers"].update(data["producers"])
            e["tensors"] = e["tensors"] and data["tensors"]
        for _, _, e in q.edges(data=True):
            e["bytes"] = sum(e["producers"].values())
        return replace(self, graph=q, order=tuple(names))

    def cut_bytes(self, before: Iterable[str]) -> int:
        """Bytes crossing from the node set ``before`` to the rest; a tensor read by
        several nodes beyond the cut is counted once."""
        s = set(before)
        crossing: dict[str, int] = {}
        for u, v, data in self.graph.edges(data=True):
            if u in s and v not in s:
                crossing.update(data["producers"])
        return sum(crossing.values())


def _is_free(attrs: dict[str, Any]) -> bool:
    return all(f == 0 and b == 0 for f, b in attrs["cost"].values()) and attrs["param_bytes"] == 0


def _split_by_cost(cg: CostGraph, groups: list[tuple[str, list[str]]], share: float
                   ) -> list[tuple[str, list[str]]]:
    """Cut the groups whose keys give no structure into runs of at most ``share`` of the model's time.

    A group gives no structure when its key is empty (its nodes are outside every
    module) and it costs more than ``share`` of the model on some kind, or when it
    alone is (nearly) the whole model: over 90% of its time on every kind. Other groups are kept
    as they are, so models with scopes coarsen exactly as before. Runs are filled
    greedily in order and never end where a non-tensor value crosses.

    Args:
        cg: the fine-grained graph the groups cover.
        groups: ``(key, members)`` runs of ``cg.order``.
        share: the largest fraction of a kind's total time a run may hold (a node
            above it is a run alone).

    Returns:
        The groups, the unstructured ones replaced by their runs (same key).
    """
    g = cg.graph
    totals = {k: t for k in cg.kinds if (t := cg.total("", kind=k)) > 0}
    if not totals:
        return groups

    def frac(members: list[str]) -> dict[str, float]:
        return {k: sum(sum(g.nodes[n]["cost"][k]) for n in members) / t for k, t in totals.items()}

    over = share * (1 + 1e-9)  # sums in another order may differ in the last bits: share=1 must mean "whole"
    blocked: list[bool] = []
    pos = {n: i for i, n in enumerate(cg.order)}
    out: list[tuple[str, list[str]]] = []
    for key, members in groups:
        f = frac(members)
        if not ((key == "" and max(f.values()) > over) or min(f.values()) > _WHOLE):
            out.append((key, members))
            continue
        blocked = blocked or _non_tensor_positions(cg)
        run: list[str] = []
        held = dict.fromkeys(totals, 0.0)
        for atom in _atoms(g, members):
            more = frac(atom)
            if run and not blocked[pos[atom[0]]] and any(held[k] + more[k] > over for k in totals):
                out.append((key, run))
                run, held = [], dict.fromkeys(totals, 0.0)
            run.extend(atom)
            held = {k: held[k] + more[k] for k in totals}
        out.append((key, run))
    return out


def _atoms(g: nx.DiGraph, members: list[str]) -> list[list[str]]:
    """``members`` cut after each node that takes time: nodes of no time (a ``get_attr`` of a
    weight, a placeholder) stay with the node after them, which reads them, so that a
    weight is counted in the block that uses it. Trailing ones join the last atom."""
    atoms: list[list[str]] = [[]]
    for n in members:
        atoms[-1].append(n)
        if any(f or b for f, b in g.nodes[n]["cost"].values()):
            atoms.append([])
    if not atoms[-1]:
        atoms.pop()
    elif len(atoms) > 1:
        atoms[-2].extend(atoms.pop())
    return atoms


def _non_tensor_positions(cg: CostGraph) -> list[bool]:
    """Per position ``p`` of ``cg.order``: a non-tensor value crosses from ``order[:p]`` to
    ``order[p:]``, so a block boundary there could never be a stage boundary and none is made."""
    pos = {n: i for i, n in enumerate(cg.order)}
    diff = [0] * (len(cg.order) + 2)
    for u, v, data in cg.graph.edges(data=True):
        if not data["tensors"]:
            diff[pos[u] + 1] += 1
            diff[pos[v] + 1] -= 1
    return [c > 0 for c in itertools.accumulate(diff)]


def _merge_attrs(nodes: list[dict[str, Any]], kinds: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {a: sum(n[a] for n in nodes) for a in _SIZE_ATTRS}
    out["cost"] = {k: (sum(n["cost"][k][0] for n in nodes), sum(n["cost"][k][1] for n in nodes)) for k in kinds}
    fixed = [n.get("fixed", {}).get(k, (0.0, 0.0)) for n in nodes for k in kinds]
    if any(f != (0.0, 0.0) for f in fixed):
        out["fixed"] = {k: (sum(n.get("fixed", {}).get(k, (0.0, 0.0))[0] for n in nodes),
                            sum(n.get("fixed", {}).get(k, (0.0, 0.0))[1] for n in nodes)) for k in kinds}
    split = [k for k in kinds if all(k in n.get("split", {}) for n in nodes)]
    if split:  # each of the three parts adds up
        out["split"] = {k: tuple(sum(n["split"][k][i] for n in nodes) for i in range(3)) for k in split}
    degrees = sorted({t for n in nodes for t in n.get("shard", {})})
    if degrees:
        out["shard"] = {t: ShardPart.add([n["shard"][t] for n in nodes if t in n.get("shard", {})], kinds)
                        for t in degrees}
    out["members"] = tuple(m for n in nodes for m in n["members"])
    out["params"] = tuple(dict.fromkeys(p for n in nodes for p in n["params"]))
    out["scope"] = nodes[0]["scope"]
    out["op"] = nodes[0]["op"] if len(nodes) == 1 else "block"
    return out


def _fitted_pair(probes: dict[str, Any], name: str) -> dict[str, tuple[float, float]]:
    """Per kind, a host probe's ``<name>_ms`` and its slope ``<name>_per_ms`` (0 where not fitted)."""
    return {k: (float(x[f"{name}_ms"]), float(x.get(f"{name}_per_ms", 0.0))) for k, x in probes.items()
            if isinstance(x.get(f"{name}_ms"), (int, float))}


def _figure(probes: dict[str, Any], key: str) -> dict[str, float]:
    """Per kind, a host probe's figure ``key``, where it has one."""
    return {k: float(x[key]) for k, x in probes.items() if isinstance(x.get(key), (int, float))}


def build(profile: Profile, compiled: bool = False) -> CostGraph:
    """The fine-grained cost graph of a profile: one graph node per fx node.

    Edge ``u -> v`` exists when ``v`` reads ``u``'s output; its ``bytes`` is
    ``u``'s output size.

    Args:
        profile: the profile.
        compiled: price stages that run compiled: on the kinds whose blocks the profile timed compiled, each
            node at its ``compiled`` cost where it has one (its eager cost where not: a block that fell back,
            the loss), recorded in the graph's ``compiled``.

    Returns:
        The cost graph.
    """
    import networkx as nx

    kinds = profile.device_kinds
    fast = frozenset(k for k in kinds if compiled and any(k in n.compiled for n in profile.nodes))

    def price(n: Any, k: str) -> Any:
        return n.compiled[k] if k in fast and k in n.compiled else n.cost[k]

    g = nx.DiGraph()
    tensor_out: dict[str, bool] = {}
    tp = analyze_tp(profile)
    split = node_split_costs(profile)
    for n in profile.nodes:
        parts = {t: part for t in TP_DEGREES if (part := tp.part(n, t, kinds)) is not None}
        g.add_node(
            n.name,
            members=(n.name,),
            cost={k: (price(n, k).fwd_ms, price(n, k).bwd_ms) for k in kinds},
            fixed={k: (price(n, k).fwd_fixed_ms, price(n, k).bwd_fixed_ms) for k in kinds},
            params=n.params,
            scope=n.scope,
            op=n.op.value,
            **{a: getattr(n, a) for a in _SIZE_ATTRS},
            **({"shard": parts} if parts else {}),
            **({"split": split[n.name]} if n.name in split else {}),
        )
        for inp in n.inputs:  # inputs precede n (Profile checks it), so they are nodes already
            size = g.nodes[inp]["output_bytes"]
            g.add_edge(inp, n.name, bytes=size, producers={inp: size}, tensors=tensor_out[inp])
        tensor_out[n.name] = n.tensor_output
    streams = {k: (float(d["stream_gbps"]), float(d["host_stream_gbps"])) for k, d in profile.devices.items()
               if d.get("stream_gbps") and d.get("host_stream_gbps")}
    cores = {k: int(d["cpus"]) for k, d in profile.devices.items() if isinstance(d.get("cpus"), int) and d["cpus"] > 0}
    coruns = {k: (float(c["fwd"]), float(c["bwd"]), int(c["ranks"])) for k, d in profile.devices.items()
              if isinstance(c := d.get("corun"), dict) and {"fwd", "bwd", "ranks"} <= set(c) and int(c["ranks"]) > 1}
    optimizer_coruns = {k: (float(c["ratio"]), int(c["ranks"])) for k, d in profile.devices.items()
                        if isinstance(c := d.get("optimizer_corun"), dict) and {"ratio", "ranks"} <= set(c)
                        and int(c["ranks"]) > 1}
    flat_steps = {k: float(d["optimizer_flat_ms"]) / profile.optimizer_ms[k] for k, d in profile.devices.items()
                  if d.get("optimizer_flat_ms") and profile.optimizer_ms.get(k)}
    processes = {k: int(d["process"]["bytes"]) for k, d in profile.devices.items()
                 if isinstance(d.get("process"), dict) and isinstance(d["process"].get("bytes"), int)}
    bookkeeping = {k: float(d["process"]["step_ms"]) + float(d["process"].get("executor_ms", 0.0))
                   for k, d in profile.devices.items()
                   if isinstance(d.get("process"), dict) and isinstance(d["process"].get("step_ms"), (int, float))}
    probes = {k: d["process"] for k, d in profile.devices.items() if isinstance(d.get("process"), dict)}
    bookkeeping_per_ms = _figure(probes, "step_per_ms")
    agreements, meetings, skews = (_fitted_pair(probes, name) for name in ("agree", "meet", "skew"))
    fitted, early_receives = (_figure(probes, key) for key in ("fit_compute_ms", "recv_cpu_ms"))
    stage_only = frozenset(k for k, d in profile.devices.items()
                           if isinstance(d.get("process"), dict) and d["process"].get("stage_only"))
    return CostGraph(g, tuple(n.name for n in profile.nodes), kinds, profile.model, profile.batch_size,
                     dict(profile.optimizer_ms), dict(profile.parameters), streams, cores, coruns, flat_steps, tp,
                     processes, bookkeeping, stage_only, agreements, skews, meetings, fitted, fast,
                     optimizer_coruns, early_receives, bookkeeping_per_ms)
