"""Exact dynamic program for pipeline placement over a linear (topological) order.

For graphs too large for the ILP. Over the candidate stages of
:mod:`~hpml_compile.solve.candidates` (contiguous ranges, a device kind, a
data-parallel degree, a memory configuration), it finds a tiling of the order
that minimises the bottleneck, the slowest stage's per-microbatch time
``T``, and among those the sum of stage times and boundary transfers (the
pipeline's fill and drain), using at most the devices of each kind the
cluster has. Devices of one kind are interchangeable (so the state holds
counts per kind, not device sets) and the order of kinds along the pipeline
is free, as in the heterogeneous pipeline DPs of Alpa (Zheng et al., OSDI
2022, inter-operator pass) and PipeDream (Narayanan et al., SOSP 2019).

State: ``g(k, c, j)`` = best ``(T, sum)`` covering ``order[k:]`` with at most
``c`` devices per kind, when the stage starting at ``k`` has ``j`` stages after
it (1F1B keeps ``min(M, j + 1)`` microbatches in flight there; under GPipe
``j`` does not matter). Classes beyond ``max_classes`` are treated as the
worst case, which keeps the DP small and never admits a plan over memory.

Example:
    >>> from hpml_compile.solve.candidates import Chain, Setting, enumerate_candidates
    >>> from hpml_compile.solve.testing import chain_graph, uniform_cluster
    >>> from hpml_compile.plan import Schedule
    >>> ch = Chain.of(chain_graph([(1.0, 2.0)] * 4))
    >>> st = Setting(microbatches=8, schedule=Schedule.ONE_F_ONE_B, batch_size=64)
    >>> picked = solve_chain(ch, uniform_cluster(2), st, enumerate_candidates(ch, uniform_cluster(2), st))
    >>> [(c.a, c.b, c.d) for c in picked]
    [(0, 4, 2)]
"""

from __future__ import annotations

import itertools

from ..ir import Cluster
from .candidates import Candidate, Chain, Setting, classes, kind_counts

__all__ = ["solve_chain", "objective"]


def objective(picked: list[Candidate], microbatches: int) -> float:
    """The ILP's step-time estimate of a tiling: ``(M - 1) T + sum(t + comm) + max tail``."""
    if not picked:
        return float("inf")
    t = max(c.t for c in picked)
    return (microbatches - 1) * t + sum(c.t + c.comm for c in picked) + max(c.tail for c in picked)


def solve_chain(chain: Chain, cluster: Cluster, setting: Setting, candidates: list[Candidate], *,
                max_classes: int = 4) -> list[Candidate] | None:
    """The min-bottleneck tiling of the chain by candidates, within the cluster's devices.

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        candidates: from :func:`~hpml_compile.solve.candidates.enumerate_candidates`.
        max_classes: exact pipeline-position classes kept for memory (more: exact but slower).

    Returns:
        The candidates in pipeline order, or None if no tiling fits.
    """
    n = chain.n
    counts = kind_counts(cluster)
    kinds = list(counts)
    kidx = {k: i for i, k in enumerate(kinds)}
    big_j = classes(setting, len(cluster.devices))
    jc = min(big_j, max_classes)
    by_a: list[list[Candidate]] = [[] for _ in range(n)]
    for c in candidates:
        by_a[c.a].append(c)
    vectors = list(itertools.product(*(range(counts[k] + 1) for k in kinds)))

    def need(j: int) -> int:  # the class a candidate must fit at to serve class j
        return j if j < jc else big_j

    def nexts(j: int) -> tuple[int, ...]:
        if jc == 0:
            return (0,)
        if j == 0:
            return ()
        return (j - 1,) if j < jc else (jc, jc - 1)

    # best[(k, vector, j)] = (T, sum, candidate, next key or None)
    best: dict[tuple[int, tuple[int, ...], int], tuple[float, float, Candidate, object]] = {}
    for k in range(n - 1, -1, -1):
        if not by_a[k]:
            continue
        for vec in vectors:
            for j in range(jc + 1):
                top: tuple[float, float, Candidate, object] | None = None
                for c in by_a[k]:
                    i = kidx[c.kind]
                    if c.d > vec[i] or c.jmax < need(j):
                        continue
                    own = c.t + c.comm + c.tail
                    if c.b == n:
                        if jc == 0 or j == 0:
                            val = (c.t, own, c, None)
                            top = val if top is None or val[:2] < top[:2] else top
                        continue
                    rem = vec[:i] + (vec[i] - c.d,) + vec[i + 1:]
                    for nj in nexts(j):
                        sub = best.get((c.b, rem, nj))
                        if sub is None:
                            continue
                        val = (max(c.t, sub[0]), own + sub[1], c, (c.b, rem, nj))
                        if top is None or val[:2] < top[:2]:
                            top = val
                if top is not None:
                    best[(k, vec, j)] = top
    full = tuple(counts[k] for k in kinds)
    starts = [best[key] for key in ((0, full, j) for j in range(jc + 1)) if key in best]
    if not starts:
        return None
    cur: object = min(starts, key=lambda v: v[:2])
    out: list[Candidate] = []
    while cur is not None:
        _, _, cand, nxt = cur  # type: ignore[misc]
        out.append(cand)
        cur = best[nxt] if nxt is not None else None  # type: ignore[index]
    return out
