"""The ``grid`` baseline: what a practitioner configures by hand in Megatron-LM or torchtitan, searched.

Those engines build one N-D device mesh: every pipeline stage gets the same
tensor-parallel degree ``tp``, the same data-parallel degree ``d`` and an
equal share of the layers, and the user picks ``tp``, the pipeline depth
``S``, the microbatch count ``M``, the ZeRO stage (Megatron's distributed
optimizer is ZeRO-1; torchtitan's FSDP is ZeRO-3) and activation
recomputation, one setting for the whole job. This baseline tries every such
setting (``tp`` in 1, 2, 4, 8 where the model shards and a host holds that
many devices of a kind; ``S`` dividing the devices over ``tp``, with
``d = devices / (tp S)``; each power-of-two ``M`` splitting the batch
evenly over the replicas; ZeRO 0, 1 or 3; recompute off or on), lays the mesh
out over the devices in cluster order (stage ``i`` on the ``tp d`` devices
after stage ``i - 1``'s, each tensor-parallel group consecutive: what a
launcher's rank order gives), cuts the chain into ``S`` stages of equal node
counts (:func:`~.baselines.uniform_cuts`), and keeps the fastest plan whose
every device holds its stage's peak, all scored on the one simulator.

It is a peer for :mod:`hpml_compile.solve`'s ``ilp``, which may give every
stage its own ``tp``, degree, kind, depth of layers and memory options.

Example:
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> g = chain_graph([(1.0, 2.0)] * 4, param_bytes=1000, batch_size=8)
    >>> p = grid_plan(g, uniform_cluster(4))
    >>> p.solver.name, sum(len(s.devices) for s in p.stages)
    ('grid', 4)
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from ..costgraph import CostGraph
from ..errors import InfeasibleError
from ..ir import Cluster, Precision
from ..memory import ZeroStage
from ..plan import Plan, Schedule, SolverInfo, SolverStatus, Stage, tp_problem
from ..simulate import stage_costs, step_ms
from .baselines import uniform_cuts
from .candidates import Chain, Setting

__all__ = ["grid_plan", "GRID_ZERO"]

#: The ZeRO stages a practitioner sets (DDP, Megatron's distributed optimizer, FSDP).
GRID_ZERO = (ZeroStage.NONE, ZeroStage.OS, ZeroStage.OS_G_P)


def _meshes(devices: int, tps: list[int], blocks: int) -> list[tuple[int, int, int]]:
    """Every ``(tp, stages, replicas)`` using all ``devices`` with at most ``blocks`` stages."""
    return [(tp, s, devices // (tp * s)) for tp in tps for s in range(1, min(blocks, devices // tp) + 1)
            if devices % (tp * s) == 0]


def grid_plan(graph: CostGraph, cluster: Cluster, *, microbatches: int | None = None,
              schedule: Schedule | str = Schedule.ONE_F_ONE_B, dtype: str = "float32",
              time_limit_s: float = 30.0, max_tp: int = 8, compute_bytes: int = 0, hierarchical: bool = True) -> Plan:
    """The fastest hand-configured mesh (module docstring).

    Args:
        graph: the cost graph.
        cluster: the devices, in the order a launcher gives ranks.
        microbatches: ``M``; None tries the powers of two up to 64 splitting the batch evenly over the replicas.
        schedule: the pipeline schedule.
        dtype: parameter dtype.
        time_limit_s: stop trying settings after this long (the best so far is returned; the meshes are tried
            from the fewest stages up).
        max_tp: the largest tensor-parallel degree tried.
        hierarchical: let a ZeRO-0 stage spanning hosts all-reduce hierarchically where faster (NCCL does
            as much inside a collective); False keeps every all-reduce flat.
        compute_bytes: bytes per element of the autocast compute dtype (0: fp32): each microbatch in flight
            holds its weight copies (:func:`hpml_compile.memory.autocast_copy_bytes`), as the plan will.

    Returns:
        The plan, simulated, status ``heuristic``.

    Raises:
        InfeasibleError: no setting fits every device's memory.
    """
    from . import diagnose, microbatch_choices  # the package's own (it imports this module)

    t0 = time.perf_counter()
    sched = Schedule(schedule)
    chain = Chain.of(graph)
    # the plan's precision prices the autocast copies its memory holds (fp16 and bf16 hold the same bytes)
    precision = {0: Precision.FP32, 2: Precision.BF16}.get(compute_bytes, Precision.FP32)
    devs = [d.name for d in cluster.devices]
    tps = [1, *(t for t in sorted(chain.shard) if t <= max_tp)]
    best: tuple[float, Plan] | None = None
    tried = fits = 0
    for tp, s, d in _meshes(len(devs), tps, len(graph.order)):
        if time.perf_counter() - t0 > time_limit_s and best is not None:
            break
        cuts = uniform_cuts(chain, s)
        if len(cuts) - 1 != s:
            continue
        groups = [tuple(devs[i * tp * d:(i + 1) * tp * d]) for i in range(s)]
        ms = [microbatches] if microbatches else microbatch_choices(graph.batch_size)
        for m in ms:
            if graph.batch_size % (m * d):
                continue
            for zero in (z for z in GRID_ZERO if sched is not Schedule.ZB_H1 or z != ZeroStage.OS_G_P) if d > 1 \
                    else (ZeroStage.NONE,):  # ZB-H1 does not run ZeRO-3
                for rec in (False, True):
                    stages = tuple(Stage(i, groups[i], chain.nodes(cuts[i], cuts[i + 1]), zero, rec, tp=tp)
                                   for i in range(s))
                    plan = Plan(graph.model, cluster, sched, m, stages, solver=SolverInfo("grid"),
                                precision=precision)
                    if any(tp_problem(cluster, st) for st in stages):
                        break
                    tried += 1
                    costs = stage_costs(plan, graph, dtype)
                    if any(b.total > cluster.device(x).memory_bytes
                           for c, st in zip(costs, stages) for b, x in zip(c.device_memory, st.devices)):
                        continue  # recompute next, or the next ZeRO stage
                    fits += 1
                    t = step_ms(plan, graph, dtype)
                    if best is None or t < best[0]:
                        best = (t, plan)
                    break  # recompute only where it is needed to fit
    if best is None:
        most = max([microbatches] if microbatches else microbatch_choices(graph.batch_size))
        raise InfeasibleError(f"grid: none of the {tried} hand-configured meshes (tp x stages x replicas, "
                              "microbatches, ZeRO, recompute) fits every device's memory; "
                              + diagnose(chain, cluster, Setting(most, sched, graph.batch_size, dtype)))
    from ..simulate import annotate
    from .candidates import faster_allreduce

    plan = annotate(faster_allreduce(best[1], graph, dtype) if hierarchical else best[1], graph, dtype)[0]
    return replace(plan, solver=SolverInfo("grid", SolverStatus.HEURISTIC, 0.0, time.perf_counter() - t0))
