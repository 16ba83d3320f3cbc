"""What every solver shares: the chain view of a cost graph and the candidate stages.

A pipeline stage is a contiguous range ``[a, b)`` of a topological order of
the cost graph (so no edge runs from a later stage to an earlier one, on a
DAG as on a chain), cut only where tensors alone cross. A *candidate* is such
a range run by ``d`` devices of one kind with one memory configuration (ZeRO
stage, recompute, optimizer offload, activation swap), with its
per-microbatch time, its gradient-sync tail and the latest position in the
pipeline at which it still fits in memory.

Example:
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> ch = Chain.of(chain_graph([(1.0, 2.0), (1.0, 2.0), (1.0, 2.0)]))
    >>> ch.n, ch.time(0, 2, "cpu")
    (3, 6.0)
"""

from __future__ import annotations

from ..compression import Compression

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

import cost_models

from .. import stagecost
from ..cluster import Hierarchy, hierarchy, link_spec
from ..costgraph import CostGraph
from ..ir import Cluster, Precision
from ..memory import MemoryBreakdown, ZeroStage
from ..plan import AllReduce, Plan, Schedule, SolverInfo, Stage
from ..simulate import stage_costs, tied_syncs
from ..stagecost import Value
from ..tp import TP_DEGREES

__all__ = ["Chain", "StageConfig", "Candidate", "Setting", "CONFIGS", "zero_bubble_runs", "enumerate_candidates", "kind_counts",
           "assign_devices", "assign_tp_devices", "host_groups", "ShardSums", "in_flight", "interleaved_in_flight", "classes", "range_candidates", "to_plan", "degrees", "group_link",
           "group_links", "boundary_link", "faster_allreduce", "allreduce_choice"]


@dataclass(frozen=True, slots=True)
class Chain:
    """Prefix sums over a topological order, so that any range's totals cost O(1).

    Attributes:
        graph: the cost graph.
        n: number of graph nodes.
        fwd: per kind, prefix sums of forward ms (full batch).
        bwd: per kind, prefix sums of backward ms.
        fwd_fixed, bwd_fixed: per kind, prefix sums of the fixed parts of those (what a microbatch still
            pays in full; the simulator's ``fixed + (full - fixed) / (M d)``).
        params: prefix sums of parameter bytes.
        acts: prefix sums of activation bytes.
        cut: ``cut[k]``: bytes crossing between ``order[:k]`` and ``order[k:]``.
        cuttable: ``cuttable[k]``: only tensors cross position ``k`` (0 and n always).
        shard: per tensor-parallel degree at which some node shards, prefix sums of what it divides
            (:class:`ShardSums`).
        in_unit: ``in_unit[k]``: position ``k`` falls inside a tensor-parallel unit (a cut there would send its
            sharded intermediate across stages, which :func:`hpml_compile.plan.validate_plan` refuses for a stage
            with ``tp > 1``); empty: no unit.
    """

    graph: CostGraph
    n: int
    fwd: dict[str, tuple[float, ...]]
    bwd: dict[str, tuple[float, ...]]
    fwd_fixed: dict[str, tuple[float, ...]]
    bwd_fixed: dict[str, tuple[float, ...]]
    params: tuple[int, ...]
    acts: tuple[int, ...]
    cut: tuple[int, ...]
    cuttable: tuple[bool, ...]
    shard: dict[int, "ShardSums"] = field(default_factory=dict)
    in_unit: tuple[bool, ...] = ()

    @classmethod
    def of(cls, graph: CostGraph) -> "Chain":
        """Precompute the prefix sums and cut sizes of ``graph.order``."""
        g, order = graph.graph, graph.order
        n = len(order)
        pos = {v: i for i, v in enumerate(order)}
        recs = [graph.node(v) for v in order]
        fwd = {k: tuple(itertools.accumulate((r.cost[k][0] for r in recs), initial=0.0)) for k in graph.kinds}
        bwd = {k: tuple(itertools.accumulate((r.cost[k][1] for r in recs), initial=0.0)) for k in graph.kinds}
        ffix = {k: tuple(itertools.accumulate((r.fixed_at(k)[0] for r in recs), initial=0.0)) for k in graph.kinds}
        bfix = {k: tuple(itertools.accumulate((r.fixed_at(k)[1] for r in recs), initial=0.0)) for k in graph.kinds}
        params = tuple(itertools.accumulate((r.param_bytes for r in recs), initial=0))
        acts = tuple(itertools.accumulate((r.activation_bytes for r in recs), initial=0))
        # A producer's bytes cross every cut between its node and its last consumer (counted once).
        last: dict[str, tuple[int, int, int]] = {}
        blocked = [0] * (n + 2)
        for u, v, e in g.edges(data=True):
            for p, nbytes in e["producers"].items():
                lo, hi, _ = last.get(p, (pos[u], pos[v], nbytes))
                last[p] = (lo, max(hi, pos[v]), nbytes)
            if not e["tensors"]:
                blocked[pos[u] + 1] += 1
                blocked[pos[v] + 1] -= 1
        diff = [0] * (n + 2)
        for lo, hi, nbytes in last.values():
            diff[lo + 1] += nbytes
            diff[hi + 1] -= nbytes
        cut = tuple(itertools.accumulate(diff[: n + 1]))
        nb = tuple(itertools.accumulate(blocked[: n + 1]))
        cuttable = tuple(k in (0, n) or nb[k] == 0 for k in range(n + 1))
        shard = {t: ShardSums.of(recs, t, graph.kinds) for t in graph.tp_degrees()}
        in_unit = _in_unit(graph, n) if shard else ()
        return cls(graph, n, fwd, bwd, ffix, bfix, params, acts, cut, cuttable, shard, in_unit)

    def time(self, a: int, b: int, kind: str) -> float:
        """Forward + backward ms of ``order[a:b]`` on ``kind`` for the full batch."""
        return self.fwd[kind][b] - self.fwd[kind][a] + self.bwd[kind][b] - self.bwd[kind][a]

    def nodes(self, a: int, b: int) -> tuple[str, ...]:
        """The fx node names (members) of ``order[a:b]``."""
        return tuple(m for v in self.graph.order[a:b] for m in self.graph.node(v).members)


def _in_unit(graph: CostGraph, n: int) -> tuple[bool, ...]:
    """Per chain position ``0..n``, whether a tensor-parallel unit's computing nodes (its columns, inside nodes and
    row: not its parameter nodes, which the stage reading them holds) lie on both sides of it."""
    at = {m: i for i, v in enumerate(graph.order) for m in graph.node(v).members}
    inside = [False] * (n + 1)
    for unit in graph.tensor_parallel.units:
        held = [at[x] for x in (*unit.columns, *unit.inside, *((unit.row,) if unit.row else ())) if x in at]
        for k in range(min(held, default=0) + 1, max(held, default=0) + 1):
            inside[k] = True
    return tuple(inside)


@dataclass(frozen=True, slots=True)
class ShardSums:
    """Prefix sums over a chain of what tensor parallelism of one degree divides (:class:`hpml_compile.tp.ShardPart`):
    per kind the sharded nodes' forward and backward ms and their fixed parts, and their parameter and activation
    bytes; the collectives' bytes and counts. Arrays of ``n + 1`` entries."""

    fwd: dict[str, np.ndarray]
    bwd: dict[str, np.ndarray]
    fwd_fixed: dict[str, np.ndarray]
    bwd_fixed: dict[str, np.ndarray]
    params: np.ndarray
    acts: np.ndarray
    fwd_allreduce: np.ndarray
    fwd_gather: np.ndarray
    bwd_allreduce: np.ndarray
    fwd_count: np.ndarray
    bwd_count: np.ndarray

    @classmethod
    def of(cls, recs: list, tp: int, kinds: tuple[str, ...]) -> "ShardSums":
        """The sums over ``recs`` (cost-graph nodes in chain order) at degree ``tp``."""
        parts = [r.shard.get(tp) for r in recs]

        def acc(get: Callable[[object], float]) -> np.ndarray:
            return np.concatenate([[0.0], np.cumsum([get(p) if p is not None else 0.0 for p in parts])])

        def by_kind(attr: str, i: int) -> dict[str, np.ndarray]:
            return {k: acc(lambda p, k=k: getattr(p, attr).get(k, (0.0, 0.0))[i]) for k in kinds}

        ints = {f: acc(lambda p, f=f: getattr(p, f)).astype(np.int64) for f in
                ("param_bytes", "activation_bytes", "fwd_allreduce", "fwd_gather", "bwd_allreduce", "fwd_count",
                 "bwd_count")}
        return cls(by_kind("cost", 0), by_kind("cost", 1), by_kind("fixed", 0), by_kind("fixed", 1),
                   ints["param_bytes"], ints["activation_bytes"], ints["fwd_allreduce"], ints["fwd_gather"],
                   ints["bwd_allreduce"], ints["fwd_count"], ints["bwd_count"])


@dataclass(frozen=True, slots=True)
class StageConfig:
    """Memory options of one stage (``hierarchical``: a ZeRO-1 stage spread evenly over hosts, its optimizer
    sharded over each host's devices behind the hierarchical sync, HSDP-like: :class:`~hpml_compile.plan.AllReduce`)."""

    zero: ZeroStage = ZeroStage.NONE
    recompute: bool = False
    offload: bool = False
    swap: bool = False
    hierarchical: bool = False
    tp: int = 1


# Cheapest first within each family; enumerate_candidates keeps those that buy memory.
# Not ZeRO-2: the runtime accumulates a step's gradients whole before its one reduce-scatter, so ZeRO-2
# holds the same at the peak as ZeRO-1 (stagecost.memory_parts). ZeRO-3 is performed (runtime/sync/zero3.py)
# and offered, but gathers the whole stage for its compute, so at the peak it holds more than ZeRO-1 and
# the table keeps it only where it would buy memory (never, with one gather unit per stage). It is not
# combined with optimizer offload, which the runtime does not do.
OFFERED_ZERO: tuple[ZeroStage, ...] = (ZeroStage.NONE, ZeroStage.OS, ZeroStage.OS_G_P)
# The hierarchical ZeRO-1 configurations come last (existing indices unchanged); the table offers them only
# for a group whose devices span hosts evenly, where the setting allows hierarchical syncs.
CONFIGS: tuple[StageConfig, ...] = tuple(
    StageConfig(z, r, o, s)
    for s in (False, True) for r in (False, True) for o in (False, True) for z in OFFERED_ZERO
    if not (o and z == ZeroStage.OS_G_P)) + tuple(
    StageConfig(ZeroStage.OS, r, o, s, hierarchical=True) for s in (False, True) for r in (False, True)
    for o in (False, True)) + tuple(
    # Tensor parallelism (hpml_compile.tp) last: it divides the memory itself, so neither offload nor swap
    # is combined with it; its data-parallel groups (every tp-th device) may sync hierarchically.
    StageConfig(z, r, tp=t) for t in TP_DEGREES for r in (False, True) for z in OFFERED_ZERO) + tuple(
    StageConfig(ZeroStage.OS, r, hierarchical=True, tp=t) for t in TP_DEGREES for r in (False, True))


def zero_bubble_runs(config: StageConfig) -> bool:
    """Whether ZB-H1 runs a stage of ``config``: not with swap, an offloaded optimizer or ZeRO-3
    (:func:`hpml_compile.plan.Plan` refuses them under it); tensor parallelism it runs."""
    return not config.swap and not config.offload and config.zero != ZeroStage.OS_G_P


@dataclass(frozen=True, slots=True)
class Setting:
    """The global choices a candidate set is built for (``compress``: the gradient compression the user allowed,
    which a replicated ZeRO-0 stage takes where it syncs faster than without)."""

    microbatches: int
    schedule: Schedule
    batch_size: int
    dtype: str = "float32"
    compress: Compression | None = None
    compress_fraction: float | None = None  # PowerSGD's share of elements on the wire, over the model's parameters
    hierarchical: bool = True  # a ZeRO-0/1 stage spread over hosts may sync hierarchically where faster
    compute_bytes: int = 0  # the autocast compute dtype's (0: fp32), for the weight copies per microbatch
    max_tp: int = 8  # the largest tensor-parallel degree a stage may take (1: none; hpml_compile.tp)
    reduce_dtype: Precision = Precision.FP32  # the dtype of the gradient collectives (Plan.reduce_dtype)
    # interleaved 1F1B's memory, where the placement is for interleaving that follows (hpml_compile.solve.interleave):
    # every stage leaves room for the microbatches ``room_chunks`` chunks over ``room_groups`` device groups hold
    # (:func:`in_flight`), and takes no configuration a device group holding chunks does not run (activation swap,
    # optimizer offload); 1: the schedule's own count. Times stay the schedule's: the chunks are a later pass.
    room_chunks: int = 1
    room_groups: int = 0


@dataclass(frozen=True, slots=True)
class Candidate:
    """One stage the solvers may select.

    Attributes:
        a: first chain position.
        b: one past the last position.
        kind: device kind.
        d: data-parallel degree.
        config: memory options.
        t: per-microbatch busy ms (forward, recompute, backward, swap traffic).
        tail: gradient-sync ms after the last backward, then the optimizer step.
        comm: ms to receive the stage's input and send its gradient back, per microbatch.
        jmax: most stages that may follow it and still fit (see :func:`classes`).
        memory: bytes per device at the peak, at ``jmax``.
    """

    a: int
    b: int
    kind: str
    d: int
    config: StageConfig
    t: float
    tail: float
    comm: float
    jmax: int
    memory: MemoryBreakdown


def kind_counts(cluster: Cluster) -> dict[str, int]:
    """Devices per kind, in the order kinds first appear in the cluster."""
    out: dict[str, int] = {}
    for d in cluster.devices:
        out[d.kind] = out.get(d.kind, 0) + 1
    return out


def classes(setting: Setting, devices: int) -> int:
    """``J``: position classes that matter for memory. Class ``j < J``: exactly ``j`` stages follow;
    class ``J``: at least ``J`` follow. GPipe keeps all ``M`` microbatches in flight anywhere: ``J = 0``; so
    does ZB-H1 here (``min(M, S)`` on every stage, ``S`` not known while the table is built: ``M`` bounds it)."""
    if setting.schedule in (Schedule.GPIPE, Schedule.ZB_H1):
        return 0
    return max(0, min(setting.microbatches, devices) - 1)


def in_flight(setting: Setting, j: int) -> int:
    """Microbatches in flight for a stage with ``j`` stages after it (:func:`hpml_compile.stagecost.in_flight`);
    with :attr:`Setting.room_chunks` above 1, interleaving's (:func:`interleaved_in_flight`)."""
    if setting.room_chunks > 1:
        return int(interleaved_in_flight(setting.microbatches, j, setting.room_groups, setting.room_chunks))
    return int(stagecost.in_flight(setting.schedule, setting.microbatches, j))


def interleaved_in_flight(microbatches: int, after: Value, groups: int, chunks: int) -> Value:
    """Whole-stage microbatches a device group holds at its peak under interleaved 1F1B with ``j`` groups after it.

    Group ``g = S - j - 1`` runs ``2 j + (v - 1) S`` warm-up forwards (:func:`hpml_compile.interleave.warmup`),
    so it holds ``min(2 j + (v - 1) S + 1, v M)`` chunk-microbatches at its peak, each about ``1 / v`` of the
    group's activations (chunks cut to equal time): ``ceil(min(2 j + (v - 1) S + 1, v M) / v)`` whole ones,
    against 1F1B's ``min(j + 1, M)``. The first group holds about ``S (1 + 1 / v)``, the last ``S (1 - 1 / v)``.

    Args:
        microbatches: ``M``.
        after: ``j`` (an int, or an array of them).
        groups: ``S``, the device groups assumed.
        chunks: ``v``.

    Returns:
        The count (at least 1), of the same form as ``after``.

    >>> [interleaved_in_flight(64, j, 4, 2) for j in range(4)], [interleaved_in_flight(3, j, 4, 2) for j in range(4)]
    ([3, 4, 5, 6], [3, 3, 3, 3])
    """
    held = np.maximum(1, -(-np.minimum(2 * np.asarray(after) + (chunks - 1) * groups + 1, chunks * microbatches)
                            // chunks))
    return held if isinstance(after, np.ndarray) else int(held)


def degrees(count: int, rows: int) -> list[int]:
    """Data-parallel degrees tried for ``count`` devices of a kind: 1, powers of two and ``count``.

    Only degrees that split a microbatch of ``rows`` rows evenly (each replica runs ``rows / d`` of them).

    >>> degrees(3, 8), degrees(4, 8), degrees(8, 2)
    ([1, 2], [1, 2, 4], [1, 2])
    """
    ds = {1, count} | {2**i for i in range(1, int(math.log2(max(count, 1))) + 1)}
    return sorted(d for d in ds if 1 <= d <= count and rows % d == 0)


def group_hierarchies(cluster: Cluster, kind: str, ds: list[int], tp: int = 1) -> dict[int, Hierarchy | None]:
    """The first ``d`` devices of ``kind`` by host (:func:`hpml_compile.cluster.hierarchy`), for each ``d``; with
    ``tp > 1``, the data-parallel group of a stage on them (every ``tp``-th)."""
    devs = [x.name for x in cluster.devices if x.kind == kind]
    return {d: (hierarchy(cluster, devs[:d:tp]) if d > tp else None) for d in ds}


def group_link(cluster: Cluster, kind: str, d: int) -> cost_models.LinkSpec | None:
    """The slowest link inside a group of the first ``d`` devices of ``kind`` (None for one device)."""
    return group_links(cluster, kind, [d])[d]


def group_links(cluster: Cluster, kind: str, ds: list[int]) -> dict[int, cost_models.LinkSpec | None]:
    """:func:`group_link` for several ``d`` at once: one link look-up per device of ``kind``, not per ``d``.

    (With 256 devices of a kind and nine degrees, one look-up per pair took ~1 s of a plan's search.)
    """
    devs = [x.name for x in cluster.devices if x.kind == kind][:max(ds, default=0)]
    out: dict[int, cost_models.LinkSpec | None] = {}
    slowest: cost_models.LinkSpec | None = None
    need = sorted(set(ds))
    for i, x in enumerate(devs[1:], start=2):  # i: the group's size once x joins it
        spec = link_spec(cluster, devs[0], x)
        if slowest is None or spec.gbps < slowest.gbps:
            slowest = spec
        if i in need:
            out[i] = slowest
    return {d: (None if d < 2 else out.get(d, slowest)) for d in ds}


def boundary_link(cluster: Cluster, kind: str) -> cost_models.LinkSpec | None:
    """The link a stage of ``kind`` most likely receives over: the slowest to a device on its host."""
    first = next(x for x in cluster.devices if x.kind == kind)
    near = [x.name for x in cluster.devices if x.name != first.name and x.host == first.host]
    others = near or [x.name for x in cluster.devices if x.name != first.name]
    if not others:
        return None
    return min((link_spec(cluster, first.name, x) for x in others), key=lambda s: s.gbps)


def enumerate_candidates(chain: Chain, cluster: Cluster, setting: Setting, *,
                         max_time: float = math.inf) -> list[Candidate]:
    """Every useful candidate stage: per range, kind and degree, the cheapest configurations that fit.

    For each ``(a, b, kind, d)`` the configurations are tried from cheapest
    (estimated ``M t + tail``) up; one is kept only if it fits at a later
    pipeline position than every cheaper one, and the search stops once one
    fits everywhere. Computed with numpy by :func:`~.table.build_table`; the
    solvers use that table directly and never build this list.

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        max_time: drop candidates whose ``M * t`` exceeds this (a known plan's objective bounds them).

    Returns:
        The candidates (possibly empty: nothing fits), by kind, degree, range, cheapest configuration first.

    Raises:
        UnknownDeviceError: if a device kind has no costs in the graph.
    """
    from .table import build_table  # table builds on this module's types

    return build_table(chain, cluster, setting, max_time=max_time).candidates()


def range_candidates(chain: Chain, cluster: Cluster, setting: Setting, a: int, b: int, kind: str,
                     d: int) -> list[Candidate]:
    """The candidates of one range, kind and degree (cheapest first, each fitting later than the last).

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        a: first position.
        b: one past the last position.
        kind: device kind.
        d: data-parallel degree.

    Returns:
        The candidates; empty if no configuration fits even as the last stage.
    """
    from .table import build_table

    return build_table(chain, cluster, setting, ranges=(np.asarray([a]), np.asarray([b])),
                       groups=[(kind, d)]).candidates()


def to_plan(chain: Chain, cluster: Cluster, setting: Setting, picked: list[Candidate], solver: SolverInfo) -> Plan:
    """A plan from selected candidates in pipeline order (predictions left to the simulator).

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        picked: candidates tiling ``[0, n)`` in order.
        solver: who made it.

    Returns:
        The plan.
    """
    devices, tps = assign_tp_devices(cluster, [(c.kind, c.d, c.config.tp) for c in picked])
    stages = []
    for i, (c, devs, tp) in enumerate(zip(picked, devices, tps)):
        nodes = chain.nodes(c.a, c.b)
        # a hierarchical ZeRO-1 candidate was priced on the kind's first devices; on the devices it gets, where
        # those do not span hosts evenly, or with fewer per host (larger shards: more memory than priced), it
        # stays flat (sharded over all of them: less memory than either, so it fits)
        how = AllReduce.FLAT
        if c.config.hierarchical:
            got = hierarchy(cluster, devs[::tp])
            priced = group_hierarchies(cluster, c.kind, [c.d], c.config.tp)[c.d]
            if got is not None and priced is not None and got.per_host >= priced.per_host:
                how = AllReduce.HIERARCHICAL
        stages.append(Stage(i, devs, nodes, c.config.zero, c.config.recompute, nodes if c.config.swap else (),
                            c.config.offload, allreduce=how, tp=tp))
    plan = Plan(chain.graph.model, cluster, setting.schedule, setting.microbatches, tuple(stages), solver=solver,
                reduce_dtype=setting.reduce_dtype)
    if setting.hierarchical:
        plan = faster_allreduce(plan, chain.graph, setting.dtype)
    if setting.hierarchical:  # the all-reduce of tied parameters too, where it spans hosts and is faster
        hier = replace(plan, tied_allreduce=AllReduce.HIERARCHICAL)
        if sum(ms for _, ms in tied_syncs(hier, chain.graph)) < sum(ms for _, ms in tied_syncs(plan, chain.graph)):
            plan = hier
    return plan


def faster_allreduce(plan: Plan, graph: CostGraph, dtype: str = "float32") -> Plan:
    """``plan`` with each ZeRO-0 stage whose replicas span hosts set to the faster of its flat and hierarchical
    all-reduce as the simulator prices them (:func:`hpml_compile.simulate.stage_costs`): both run in buckets
    overlapped with the last backward where the stage's devices overlap (GPU groups; a hierarchical bucket is
    a chain of three collectives, so it pays three latencies and exposes its last chain), both after it on CPU
    ranks, as the runtime runs each; comparing the two collectives alone (:func:`allreduce_choice`) ignores
    that. Ties stay flat (one collective, not three).

    Args:
        plan: a plan (its stages' ``allreduce`` is replaced where a stage spans hosts).
        graph: its cost graph.
        dtype: the parameters' dtype.

    Returns:
        The plan, each stage that spans hosts flat or hierarchical.
    """
    spans = {st.index for st in plan.stages if st.zero == ZeroStage.NONE and st.replicas > 1
             and not st.compress and hierarchy(plan.cluster, st.sync_group()) is not None}
    if not spans:
        return plan

    def every(how: AllReduce) -> Plan:
        return replace(plan, stages=tuple(replace(st, allreduce=how) if st.index in spans else st
                                          for st in plan.stages))

    flat = stage_costs(every(AllReduce.FLAT), graph, dtype)
    hier = stage_costs(every(AllReduce.HIERARCHICAL), graph, dtype)
    return replace(plan, stages=tuple(
        replace(st, allreduce=AllReduce.HIERARCHICAL if hier[st.index].synced_ms < flat[st.index].synced_ms
                else AllReduce.FLAT) if st.index in spans else st for st in plan.stages))


def allreduce_choice(cluster: Cluster, devices: tuple[str, ...], param_bytes: int) -> AllReduce:
    """The faster all-reduce for a ZeRO-0 stage on ``devices``: hierarchical where they span hosts (each
    holding the same number) and :func:`hpml_compile.stagecost.hierarchical_allreduce_ms` beats the flat ring
    over the slowest link; flat otherwise (ties included: the flat ring is one collective, not three). The two
    collectives alone, both after the backward; the solver decides with :func:`faster_allreduce`, which counts
    each one's overlap with the backward.

    >>> from hpml_compile.cluster import load_cluster
    >>> c = load_cluster("2node-a100-16")
    >>> allreduce_choice(c, ("gpu0", "gpu1", "gpu8", "gpu9"), 2**30).value, allreduce_choice(c, ("gpu0", "gpu1"), 2**30).value
    ('hierarchical', 'flat')
    """
    hier = hierarchy(cluster, devices)
    if hier is None or param_bytes <= 0:
        return AllReduce.FLAT
    slowest = min((link_spec(cluster, devices[0], x) for x in devices[1:]), key=lambda sp: sp.gbps)
    flat = stagecost.transfer_ms(cost_models.allreduce_ms, param_bytes, slowest, len(devices))
    return AllReduce.HIERARCHICAL if stagecost.hierarchical_allreduce_ms(param_bytes, hier) < flat else AllReduce.FLAT


def host_groups(cluster: Cluster, kind: str, tp: int) -> int:
    """How many groups of ``tp`` devices of ``kind`` on one host the cluster holds (tensor-parallel groups).

    >>> from hpml_compile.cluster import load_cluster
    >>> host_groups(load_cluster("2node-a100-16"), "A100-80GB", 8), host_groups(load_cluster("2node-a100-16"), "A100-80GB", 16)
    (2, 0)
    """
    per_host: dict[str, int] = {}
    for x in cluster.devices:
        if x.kind == kind:
            per_host[x.host] = per_host.get(x.host, 0) + 1
    return sum(c // tp for c in per_host.values())


def assign_tp_devices(cluster: Cluster, stages: list[tuple[str, int, int]]
                      ) -> tuple[list[tuple[str, ...]], list[int]]:
    """Devices for a pipeline of ``(kind, d, tp)`` stages, each tensor-parallel group on one host.

    The stages with ``tp > 1`` take their groups first, ``tp`` devices at a time from hosts (in cluster order)
    that still hold that many free devices of the kind; then :func:`assign_devices` gives the others the next
    free devices in cluster order. A stage whose groups no longer fit on hosts (the hosts hold fewer whole groups
    than the stages together ask for) runs with ``tp = 1`` on the devices it gets, and the plan's simulation and
    validation say what that costs.

    Args:
        cluster: the cluster.
        stages: ``(kind, d, tp)`` per stage, in pipeline order (``d``: all its devices).

    Returns:
        The device names of each stage (each group's ``tp`` devices consecutive), and the degree each got.

    Raises:
        ValueError: if a kind runs out of devices.
    """
    free = {x.name for x in cluster.devices}
    out: list[tuple[str, ...] | None] = [None] * len(stages)
    tps = [tp for _, _, tp in stages]
    for i, (kind, d, tp) in enumerate(stages):
        if tp <= 1:
            continue
        by_host: dict[str, list[str]] = {}
        for x in cluster.devices:
            if x.kind == kind and x.name in free:
                by_host.setdefault(x.host, []).append(x.name)
        got: list[str] = []
        for names in by_host.values():
            while len(names) >= tp and len(got) < d:
                got.extend(names[:tp])
                names = names[tp:]
        if len(got) == d:
            out[i] = tuple(got)
            free -= set(got)
        else:
            tps[i] = 1
    rest = [(k, d) for (k, d, _), o in zip(stages, out) if o is None]
    spare = Cluster(tuple(x for x in cluster.devices if x.name in free), (), cluster.name)
    it = iter(assign_devices(spare, rest))
    return [o if o is not None else next(it) for o in out], tps


def assign_devices(cluster: Cluster, stages: list[tuple[str, int]]) -> list[tuple[str, ...]]:
    """Concrete devices for a pipeline of ``(kind, d)`` stages: per kind, the next unused in cluster order.

    Identical devices of a kind are interchangeable in every solver's model
    (symmetry broken by kind); taking them in cluster order keeps neighbours
    on one host where the cluster lists hosts together.

    Args:
        cluster: the cluster.
        stages: ``(kind, d)`` per stage, in pipeline order.

    Returns:
        The device names of each stage.

    Raises:
        ValueError: if a kind runs out of devices.
    """
    pools = {k: [x.name for x in cluster.devices if x.kind == k] for k in kind_counts(cluster)}
    out = []
    for kind, d in stages:
        if len(pools.get(kind, [])) < d:
            raise ValueError(f"not enough {kind} devices for the stages {stages}")
        out.append(tuple(pools[kind][:d]))
        pools[kind] = pools[kind][d:]
    return out
