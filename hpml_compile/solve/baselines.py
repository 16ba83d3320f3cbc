"""The common partitioners, re-implemented on our chain so every plan is scored by one simulator.

Each puts one stage on each device, in cluster order (no data parallelism),
and splits the topological order into contiguous ranges:

- ``uniform``: equal numbers of graph nodes (blocks) per stage, like
  ``torch.distributed.pipelining``'s equal split;
- ``params``: balanced parameter bytes, like DeepSpeed's default
  ``partition_method="parameters"`` (``deepspeed.runtime.utils.partition_balanced``);
- ``time``: balanced compute time assuming every device is the first one's
  kind, like torchgpipe's ``balance_by_time`` (Kim et al. 2020).

``params`` and ``time`` use the exact min-max contiguous partition (what
``partition_balanced`` and torchgpipe's block partition approximate). Then
each stage takes the cheapest memory configuration that fits (ZeRO has no
effect on one device; recompute, offload and swap do), so that a baseline
fails only when nothing would fit.

Example:
    >>> from hpml_compile.solve.candidates import Chain
    >>> from hpml_compile.testing import chain_graph
    >>> ch = Chain.of(chain_graph([(1.0, 1.0), (1.0, 1.0), (4.0, 4.0), (1.0, 1.0)]))
    >>> uniform_cuts(ch, 2), balanced_cuts(ch, 2, [1.0, 1.0, 1.0, 8.0])
    ([0, 2, 4], [0, 3, 4])
"""

from __future__ import annotations

import enum
from typing import Sequence

from ..ir import Cluster
from .candidates import Candidate, Chain, Setting, classes, range_candidates

__all__ = ["Baseline", "uniform_cuts", "balanced_cuts", "baseline_stages", "stages_from_cuts", "cut_points"]


class Baseline(str, enum.Enum):
    """Which baseline partitioner."""

    UNIFORM = "uniform"
    PARAMS = "params"
    TIME = "time"


def cut_points(chain: Chain) -> list[int]:
    """Positions where only tensors cross (0 and n included): where a stage may begin or end."""
    return [k for k in range(chain.n + 1) if chain.cuttable[k]]


def uniform_cuts(chain: Chain, stages: int) -> list[int]:
    """Boundaries ``[0, ..., n]`` giving ``stages`` ranges of (nearly) equal node counts.

    Args:
        chain: the chain.
        stages: how many stages (at most the number of cuttable ranges).

    Returns:
        Increasing positions from 0 to n.
    """
    points = cut_points(chain)
    stages = min(stages, len(points) - 1)
    cuts = [0]
    for i in range(1, stages):
        ideal = round(i * chain.n / stages)
        # The nearest position where only tensors cross, after the previous cut, leaving room for the rest.
        ok = [p for p in points if cuts[-1] < p <= points[len(points) - 1 - (stages - i)]]
        cuts.append(min(ok, key=lambda p: (abs(p - ideal), p)))
    return cuts + [chain.n]


def balanced_cuts(chain: Chain, stages: int, weights: Sequence[float]) -> list[int]:
    """Boundaries minimising the largest per-stage weight sum (exact, O(n^2 S)).

    Args:
        chain: the chain.
        stages: how many stages.
        weights: one weight per graph node in order.

    Returns:
        Increasing positions from 0 to n.
    """
    points = cut_points(chain)
    stages = min(stages, len(points) - 1)
    pre = [0.0]
    for w in weights:
        pre.append(pre[-1] + w)
    inf = float("inf")
    # f[s][p]: best max-sum splitting order[:points[p]] into s ranges.
    f = [[inf] * len(points) for _ in range(stages + 1)]
    arg = [[0] * len(points) for _ in range(stages + 1)]
    f[0][0] = 0.0
    for s in range(1, stages + 1):
        for p in range(1, len(points)):
            for q in range(p):
                v = max(f[s - 1][q], pre[points[p]] - pre[points[q]])
                if v < f[s][p]:
                    f[s][p], arg[s][p] = v, q
    cuts, p = [], len(points) - 1
    for s in range(stages, 0, -1):
        cuts.append(points[p])
        p = arg[s][p]
    return [0] + cuts[::-1]


def baseline_stages(chain: Chain, cluster: Cluster, setting: Setting, which: Baseline) -> list[Candidate] | str:
    """The stages of one baseline, each with its cheapest configuration that fits.

    Args:
        chain: the chain.
        cluster: the cluster (one stage per device, in order).
        setting: microbatches, schedule, batch size, dtype.
        which: the baseline.

    Returns:
        The candidates in pipeline order, or a message naming the stage and device that does not fit.
    """
    devs = cluster.devices
    graph, order = chain.graph, chain.graph.order
    s = min(len(devs), len(cut_points(chain)) - 1)
    if which is Baseline.UNIFORM:
        cuts = uniform_cuts(chain, s)
    elif which is Baseline.PARAMS:
        cuts = balanced_cuts(chain, s, [graph.node(v).param_bytes for v in order])
    else:
        kind = devs[0].kind
        cuts = balanced_cuts(chain, s, [sum(graph.node(v).cost[kind]) for v in order])
    return stages_from_cuts(chain, cluster, setting, cuts)


def stages_from_cuts(chain: Chain, cluster: Cluster, setting: Setting, cuts: Sequence[int]) -> list[Candidate] | str:
    """One stage per range ``[cuts[i], cuts[i+1])`` on device ``i`` (cluster order), each with the cheapest
    memory configuration that fits: how any partitioner's split is scored on our cost model.

    Args:
        chain: the chain.
        cluster: the cluster (at least ``len(cuts) - 1`` devices).
        setting: microbatches, schedule, batch size, dtype.
        cuts: increasing positions from 0 to ``chain.n``, each one where only tensors cross.

    Returns:
        The candidates in pipeline order, or a message naming the stage and device that does not fit.

    Raises:
        ValueError: for cuts that are not increasing from 0 to n, cut where a non-tensor crosses, or
            need more stages than devices.
    """
    devs, order = cluster.devices, chain.graph.order
    cuts = list(cuts)
    if cuts[0] != 0 or cuts[-1] != chain.n or any(a >= b for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"cuts must increase from 0 to {chain.n}, got {cuts}")
    bad = [c for c in cuts if not chain.cuttable[c]]
    if bad:
        raise ValueError(f"cuts {bad} are where a non-tensor value crosses; a stage may not end there")
    s = len(cuts) - 1
    if s > len(devs):
        raise ValueError(f"{s} stages but only {len(devs)} devices")
    big_j = classes(setting, len(devs))
    out = []
    for i in range(s):
        dev = devs[i]
        need = min(s - 1 - i, big_j)
        fits = [c for c in range_candidates(chain, cluster, setting, cuts[i], cuts[i + 1], dev.kind, 1)
                if c.jmax >= need]
        if not fits:
            return f"stage {i} (nodes {order[cuts[i]]}..{order[cuts[i + 1] - 1]}) does not fit on {dev.name}"
        out.append(fits[0])
    return out
