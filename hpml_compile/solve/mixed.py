"""Mixed-kind stages: the rows each replica of a stage gets, and plans built from groups of devices of any kinds.

The building block of :mod:`.uneven`'s candidate plans. A stage whose replicas are devices of different kinds
(or speeds, or memories) gives each its own rows per microbatch. Rows come from
:func:`hpml_compile.stagecost.choose_rows`: each replica's time for ``r`` rows is its kind's fixed part plus
``r`` times its per-row part (:meth:`hpml_compile.ir.NodeCost.at`), and each is capped at the most rows its
memory holds (the plan validator's own memory model, so a plan made here passes
:func:`hpml_compile.plan.validate_plan`). :func:`build_plan` makes a whole plan from devices per stage,
stage boundaries and a microbatch count, each stage taking the first memory configuration of
:data:`CONFIGS` (ZeRO 0, 1, 2, then recompute, then each of those with the Adam state offloaded to host
memory, on a group without a CPU) under which every replica fits at least one row and the group all the rows;
swap and ZeRO-3 are not tried.

Example:
    >>> from hpml_compile.plan import Schedule
    >>> from hpml_compile.testing import chain_graph, cluster_of
    >>> g = chain_graph([{"fast": (1.0, 2.0), "slow": (3.0, 6.0)}] * 4)
    >>> c = cluster_of(["fast", "slow"])
    >>> stage_rows(g, c, g.order, ["d0", "d1"], microbatches=2, schedule=Schedule.ONE_F_ONE_B, index=0, stages=1)
    (384, 128)
    >>> p = build_plan(g, c, [["d0", "d1"]], [0, 4], 2, Schedule.ONE_F_ONE_B, "float32", "example")
    >>> p.stages[0].rows, microbatch_counts(g, 2, None)[:4]
    ((384, 128), [1, 2, 4, 8])
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from ..costgraph import CostGraph
from ..errors import HpmlError
from ..ir import Cluster, Device
from ..memory import ZeroStage, dtype_bytes, tied_elsewhere, tied_shared, tied_shm_bytes
from ..plan import Plan, Schedule, SolverInfo, Stage
from ..stagecost import choose_rows, device_memory, in_flight

__all__ = ["CONFIGS", "Config", "Score", "allowed", "stage_rows", "build_plan", "microbatch_counts", "stage_blocks", "fastest"]

#: A stage's memory configuration here: ``(ZeRO stage, recompute, Adam state offloaded to host memory)``.
Config = tuple[ZeroStage, bool, bool]

#: Memory configurations tried per stage, cheapest first. The offloaded ones come last (every step copies the
#: state's parameters both ways over the host link) and are skipped for a group with a CPU, whose host memory is
#: its own (:func:`hpml_compile.plan.validate_plan` refuses them there). Without them a group with a small GPU
#: (a T4 beside an A100, for gpt2-xl) fits under no configuration and the search never mixes it in.
CONFIGS: tuple[Config, ...] = tuple(
    (z, rec, off) for off in (False, True) for rec in (False, True)
    for z in (ZeroStage.NONE, ZeroStage.OS, ZeroStage.OS_G))


def _members(graph: CostGraph, blocks: Sequence[str]) -> tuple[str, ...]:
    return tuple(m for b in blocks for m in graph.node(b).members)


def _sizes(graph: CostGraph, blocks: Sequence[str]) -> tuple[int, int, int, int]:
    """``(parameter bytes with tied copies, activation bytes, input bytes, tied gradient buffer)`` of a stage
    made of ``blocks``, as :func:`hpml_compile.simulate.stage_costs` counts them."""
    inside = set(blocks)
    users = [(n, graph.node(n).params) for n in graph.order]
    params = sum(graph.node(b).param_bytes for b in blocks) + tied_elsewhere(users, graph.param_sizes, inside)
    acts = sum(graph.node(b).activation_bytes for b in blocks)
    inputs: dict[str, int] = {}
    for u, v, e in graph.graph.edges(data=True):
        if v in inside and u not in inside:
            inputs.update(e["producers"])
    return params, acts, sum(inputs.values()), tied_shared(users, graph.param_sizes, inside)


def _cap(dev: Device, sizes: tuple[int, int, int, int], *, rows: int, batch: int, replicas: int, zero: ZeroStage,
         recompute: bool, microbatches: int, flight: int, dtype: str, offload: bool = False,
         process: int = 0) -> int:
    """The most rows of a microbatch (up to ``rows``) whose activations fit ``dev`` beside the stage's
    parameters, gradients and optimizer state (0: not even one)."""
    params, acts, inputs, shared = sizes

    def need(r: int) -> int:
        return device_memory(param_bytes=params, activation_bytes=acts, input_bytes=inputs,
                             dtype_bytes=dtype_bytes(dtype), replicas=replicas, zero=zero,
                             microbatches=microbatches, in_flight=flight, recompute=recompute,
                             offload_optimizer=offload, host_is_device=dev.is_cpu, share=(r, batch),
                             process_bytes=process).total + shared + (tied_shm_bytes(shared, replicas + 1)
                                                                      if process else 0)

    if need(1) > dev.memory_bytes:
        return 0
    lo, hi = 1, rows  # need grows with r: the largest r that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= dev.memory_bytes else (lo, mid - 1)
    return lo


def stage_rows(graph: CostGraph, cluster: Cluster, blocks: Sequence[str], devices: Sequence[str], *,
               microbatches: int, schedule: Schedule, index: int, stages: int, zero: ZeroStage | int = 0,
               recompute: bool = False, dtype: str = "float32", offload: bool = False,
               sizes: tuple[int, int, int, int] | None = None) -> tuple[int, ...] | None:
    """Rows per microbatch for each of ``devices`` running the graph blocks ``blocks`` as stage ``index`` of
    ``stages``: the replicas finish together (:func:`~hpml_compile.stagecost.choose_rows`) and each fits.

    Args:
        graph: the cost graph (its ``batch_size`` is the step's rows).
        cluster: the devices.
        blocks: graph nodes of the stage.
        devices: the stage's devices, of any kinds.
        microbatches: ``M`` (must divide the batch).
        schedule: the pipeline schedule (how many microbatches a stage holds at its peak).
        index: the stage's position.
        stages: how many stages the plan has.
        zero: the stage's ZeRO stage.
        recompute: activation checkpointing of the stage.
        dtype: parameter dtype.
        offload: the Adam state in host memory (not counted on the devices).
        sizes: the stage's byte sizes (:func:`_sizes`), when the caller has them already.

    Returns:
        Rows per device, or None when they cannot fit (a device holds not even one row, or all of them hold
        fewer than a microbatch).

    Raises:
        HpmlError: ``microbatches`` does not split the batch into whole rows.
    """
    batch = graph.batch_size
    if batch % microbatches:
        raise HpmlError(f"uneven rows: {microbatches} microbatches do not split the batch of {batch} into whole rows")
    total = batch // microbatches
    if total < len(devices):
        return None
    sizes = sizes or _sizes(graph, blocks)
    flight = int(in_flight(Schedule(schedule), microbatches, stages - index - 1, stages))
    rec = 1.0 if recompute else 0.0
    alike: dict[tuple[str, int, bool], tuple[float, float, int]] = {}  # devices that differ in nothing rows see
    fixed, per_row, caps = [], [], []
    for name in devices:
        dev = cluster.device(name)
        key = (dev.kind, dev.memory_bytes, dev.is_cpu)
        if key not in alike:
            f = b = ff = bf = 0.0
            for blk in blocks:
                full, fix = graph.node(blk).cost[dev.kind], graph.node(blk).fixed_at(dev.kind)
                f, b, ff, bf = f + full[0], b + full[1], ff + fix[0], bf + fix[1]
            alike[key] = (ff * (1 + rec) + bf, ((f - ff) * (1 + rec) + (b - bf)) / batch,
                          _cap(dev, sizes, rows=total, batch=batch, replicas=len(devices), zero=ZeroStage(zero),
                               recompute=recompute, microbatches=microbatches, flight=flight, dtype=dtype,
                               offload=offload,
                               process=graph.process_bytes(dev.kind, sizes[0], len(devices), zero)
                               if dev.is_cpu else 0))
        one_fixed, one_row, cap = alike[key]
        fixed.append(one_fixed)
        per_row.append(one_row)
        caps.append(cap)
        if cap == 0:
            return None  # a replica holds not even one row
    try:
        return choose_rows(fixed, per_row, total, caps)
    except ValueError:
        return None


def build_plan(graph: CostGraph, cluster: Cluster, groups: Sequence[Sequence[str]], cuts: Sequence[int],
               microbatches: int, schedule: Schedule, dtype: str, name: str,
               configs: Sequence[Config] = CONFIGS) -> Plan | None:
    """A plan of stage ``i`` = blocks ``order[cuts[i]:cuts[i+1]]`` on ``groups[i]``, each with the first
    configuration of ``configs`` whose rows fit (:func:`stage_rows`).

    Args:
        graph: the cost graph.
        cluster: the devices.
        groups: the devices of each stage, of any kinds.
        cuts: stage boundaries, positions in ``graph.order`` from 0 to its length.
        microbatches: ``M`` (must divide the batch).
        schedule: the pipeline schedule.
        dtype: parameter dtype.
        name: the plan's solver name (the family that made it).
        configs: memory configurations to try per stage, in order (offloaded ones skipped on a group with a CPU).

    Returns:
        The plan (not yet simulated), or None if one stage fits under none of ``configs``.
    """
    order = graph.order
    stages = []
    for i, devs in enumerate(groups):
        blocks = order[cuts[i]:cuts[i + 1]]
        sizes = _sizes(graph, blocks)  # once per stage, whatever the configuration
        for zero, rec, off in configs:
            if (zero and len(devs) == 1) or not allowed(cluster, devs, off, schedule):
                continue
            rows = stage_rows(graph, cluster, blocks, devs, microbatches=microbatches, schedule=schedule, index=i,
                              stages=len(groups), zero=zero, recompute=rec, dtype=dtype, offload=off,
                              sizes=sizes)
            if rows is not None:
                even = len(set(rows)) == 1 and len({cluster.device(d).kind for d in devs}) == 1
                stages.append(Stage(i, tuple(devs), _members(graph, blocks), zero, rec, offload_optimizer=off,
                                    rows=() if even else rows))
                break
        else:
            return None
    return Plan(graph.model, cluster, schedule, microbatches, tuple(stages), solver=SolverInfo(name))


def allowed(cluster: Cluster, devices: Sequence[str], offload: bool, schedule: Schedule | None = None) -> bool:
    """Whether a group may take a configuration: optimizer offload only where no device is a CPU, and not under
    ZB-H1 (which does not run it: :class:`hpml_compile.plan.Plan`)."""
    return not offload or not (schedule is Schedule.ZB_H1 or any(cluster.device(d).is_cpu for d in devices))


def microbatch_counts(graph: CostGraph, fewest_rows: int, microbatches: int | None) -> list[int]:
    """Microbatch counts to try: the given one, else the divisors of the batch up to 64 that leave at least
    ``fewest_rows`` rows per microbatch."""
    if microbatches:
        return [microbatches]
    b = graph.batch_size
    return [m for m in range(1, min(b, 64) + 1) if b % m == 0 and b // m >= fewest_rows]


#: A plan's score: its simulated step in milliseconds (lower is better).
Score = Callable[[Plan], float]


def fastest(plans: Iterable[Plan | None], score: Score) -> Plan | None:
    """The plan of ``plans`` with the shortest score (None entries, plans that did not fit, skipped)."""
    best: tuple[float, Plan] | None = None
    for p in plans:
        if p is not None:
            t = score(p)
            if best is None or t < best[0]:
                best = (t, p)
    return best[1] if best else None


def stage_blocks(graph: CostGraph, plan: Plan) -> list[list[str]]:
    """The graph blocks of each stage of ``plan``, in order.

    Raises:
        HpmlError: a block's members lie in several stages (``graph`` is not the one the plan was solved on).
    """
    where = {n: st.index for st in plan.stages for n in st.nodes}
    out: list[list[str]] = [[] for _ in plan.stages]
    for b in graph.order:
        owners = {where[m] for m in graph.node(b).members}
        if len(owners) != 1:
            raise HpmlError(f"uneven rows: graph block {b!r} spans stages {sorted(owners)}; use the graph the plan "
                            "was solved on")
        out[owners.pop()].append(b)
    return out
