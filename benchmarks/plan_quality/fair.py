"""The peers' partitioners as a user runs them: each given the data parallelism, microbatches and ZeRO stage a
user would set, all searched, scored on the one simulator.

DeepSpeed's ``PipelineModule`` and torchgpipe split the model into ``S``
pipeline stages; a user of either also picks the data-parallel degree ``d``
(DeepSpeed's ``dp`` = world size / ``S``; torchgpipe under DDP), the
microbatch count and, with DeepSpeed, the ZeRO stage (1 with pipelines; 2
without), and turns on activation checkpointing where a stage does not fit.
Scoring a peer one stage per device with no data parallelism measures data
parallelism against none, not the partitioner. So here each peer is credited
with the best of:

- ``S`` stages (its own split of the chain, :func:`main.peer_cuts`) times ``d``
  replicas, ``S * d`` at most the devices, stage ``i`` on the ``d`` devices
  after stage ``i - 1``'s in cluster order (what a launcher's rank order gives);
- every microbatch count of :func:`hpml_compile.solve.microbatch_choices` that
  gives each replica whole, equal rows (neither peer splits rows unevenly);
- ZeRO 0, 1 or 2 on every replicated stage (one setting for the whole job, as a
  config file sets it), with activation checkpointing where that alone fits;

each plan simulated by :func:`hpml_compile.simulate.annotate` and kept only if
every device holds its stage's peak.

Example:
    >>> from hpml_compile.testing import chain_graph, cluster_of
    >>> g = chain_graph([{"a": (1.0, 2.0)}] * 4, param_bytes=1000, batch_size=8)
    >>> even = lambda weights, parts: [round(i * len(weights) / parts) for i in range(parts + 1)]
    >>> best = fair_peer_plan(g, cluster_of(["a"] * 4), "torchgpipe", even)
    >>> [len(st.devices) for st in best.stages], best.solver.name
    ([4], 'torchgpipe')
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator

from hpml_compile.costgraph import CostGraph
from hpml_compile.errors import HpmlError, InfeasibleError
from hpml_compile.ir import Cluster
from hpml_compile.memory import ZeroStage
from hpml_compile.plan import Plan, Schedule
from hpml_compile.simulate import annotate
from hpml_compile.solve import microbatch_choices
from hpml_compile.solve.mixed import build_plan

__all__ = ["fair_peer_plan", "shapes"]

Partitioner = Callable[[list[float], int], list[int]]
ZEROS = (ZeroStage.NONE, ZeroStage.OS, ZeroStage.OS_G)


def shapes(devices: int, batch: int) -> Iterator[tuple[int, int, int]]:
    """Every ``(stages, replicas, microbatches)`` a user could set: ``S * d <= devices`` and the microbatch
    count leaving each replica whole, equal rows (``batch % (M * d) == 0``)."""
    for s in range(1, devices + 1):
        for d in range(1, devices // s + 1):
            for m in microbatch_choices(batch):
                if batch % (m * d) == 0:
                    yield s, d, m


def fair_peer_plan(graph: CostGraph, cluster: Cluster, which: str, fn: Partitioner, *,
                   cuts_of: Callable[[CostGraph, Cluster, str, Partitioner, int], list[int]] | None = None,
                   schedule: Schedule = Schedule.ONE_F_ONE_B, dtype: str = "float32") -> Plan:
    """The fastest plan the peer's split gives under the settings a user chooses (module docstring).

    Args:
        graph: the cost graph.
        cluster: the devices, in the order a launcher gives ranks.
        which: the peer's name (``deepspeed`` or ``torchgpipe``), for :func:`main.peer_cuts` and the plan.
        fn: the peer's partitioner, ``(weights, parts) -> cut positions``.
        cuts_of: the split into ``S`` stages (default :func:`main.peer_cuts`).
        schedule: the pipeline schedule.
        dtype: parameter dtype.

    Returns:
        The plan with the shortest simulated step, named ``which``.

    Raises:
        InfeasibleError: no setting fits.
    """
    if cuts_of is None:
        from main import peer_cuts  # the benchmark's split: the peer's partitioner on its own weights
        cuts_of = peer_cuts
    best: tuple[float, Plan] | None = None
    names = [d.name for d in cluster.devices]
    split: dict[int, list[int]] = {}
    for s, d, m in shapes(len(names), graph.batch_size):
        if s not in split:
            split[s] = cuts_of(graph, cluster, which, fn, s)
        cuts = split[s]
        if len(cuts) - 1 != s:
            continue  # the chain has fewer places to cut than stages
        groups = [names[i * d:(i + 1) * d] for i in range(s)]
        for zero in ZEROS if d > 1 else ZEROS[:1]:
            plan = _even(graph, cluster, groups, cuts, m, zero, schedule, dtype, which)
            if plan is not None and (best is None or plan.predicted.step_ms < best[0]):
                best = (plan.predicted.step_ms, plan)
    if best is None:
        raise InfeasibleError(f"{which}: no split, data-parallel degree, microbatch count and ZeRO stage fits "
                              f"{cluster.name}")
    return best[1]


def _even(graph: CostGraph, cluster: Cluster, groups: list[list[str]], cuts: list[int], m: int, zero: ZeroStage,
          schedule: Schedule, dtype: str, name: str) -> Plan | None:
    """The plan with equal rows per replica under ``zero`` (recompute where needed), simulated; None when a
    device cannot hold its stage."""
    built = build_plan(graph, cluster, groups, cuts, m, schedule, dtype, name,
                       configs=((zero, False, False), (zero, True, False)))
    if built is None:
        return None
    even = replace(built, stages=tuple(replace(st, rows=()) for st in built.stages))  # no uneven rows
    try:
        plan = annotate(even, graph, dtype)[0]
    except HpmlError:
        return None
    for st in plan.stages:
        if st.predicted.memory_bytes > min(cluster.device(x).memory_bytes for x in st.devices):
            return None
    return plan
