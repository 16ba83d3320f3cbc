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

:func:`tile` evaluates the recursion with numpy over every count vector at
once (for 64 identical devices, 0.02 s where Python loops took ~1.5 s under cProfile);
:mod:`.bounds` runs the same function with other keys (a sum alone, the
largest tail) to bound the ILP.

Example:
    >>> from hpml_compile.solve.candidates import Chain, Setting, enumerate_candidates
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> from hpml_compile.plan import Schedule
    >>> ch = Chain.of(chain_graph([(1.0, 2.0)] * 4))
    >>> st = Setting(microbatches=8, schedule=Schedule.ONE_F_ONE_B, batch_size=64)
    >>> picked = solve_chain(ch, uniform_cluster(2), st, enumerate_candidates(ch, uniform_cluster(2), st))
    >>> [(c.a, c.b, c.d) for c in picked]
    [(0, 4, 2)]
"""

from __future__ import annotations

import numpy as np

from ..ir import Cluster
from .candidates import Candidate, Chain, Setting, classes, kind_counts
from .table import CandidateTable

__all__ = ["solve_chain", "proxy_chain", "tilings", "objective", "tile"]


def objective(picked: list[Candidate], microbatches: int) -> float:
    """The ILP's proxy of a tiling's step time (not the simulated step): ``(M - 1) T + sum(t + comm) + max tail``."""
    if not picked:
        return float("inf")
    t = max(c.t for c in picked)
    return (microbatches - 1) * t + sum(c.t + c.comm for c in picked) + max(c.tail for c in picked)


def _vector_space(counts: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Strides and per-kind digits of the flattened space of device-count vectors ``0..count_k`` per kind."""
    dims = [c + 1 for c in counts.values()]
    strides = np.asarray([int(np.prod(dims[i + 1:])) for i in range(len(dims))], dtype=np.int64)
    v = np.arange(int(np.prod(dims)), dtype=np.int64)
    digits = np.stack([(v // strides[i]) % dims[i] for i in range(len(dims))])
    return strides, digits


def tile(n: int, counts: dict[str, int], tab: CandidateTable, t: np.ndarray, own: np.ndarray, jmax: np.ndarray,
          big_j: int, jc: int) -> tuple[float, float, list[int]] | None:
    """Lexicographic min of ``(max t, sum own)`` over tilings of ``[0, n)`` by the candidates of ``tab``.

    ``t``, ``own`` and ``jmax`` are per-candidate arrays (usually ``tab.t``, ``tab.t + tab.comm + tab.tail``
    and ``tab.jmax``; :mod:`.bounds` passes others); ``big_j`` and ``jc`` are as in :func:`solve_chain`.
    Returns ``(T, S, candidate indices in pipeline order)``, or None when nothing tiles.

    Vectorised over the device-count vectors: for each start position and
    class, every candidate starting there is combined with every vector at
    once, so the work is ``candidates x classes`` array operations of length
    ``vectors`` rather than Python steps.
    """
    strides, digits = _vector_space(counts)
    nv = digits.shape[1]
    take = tab.d * strides[tab.kind]  # a candidate's devices, as an offset in the flattened vector space
    inf = np.inf
    # Column nv is a sentinel that stays inf: a candidate pointed there (not enough devices) is never chosen.
    best_t = np.full((n + 1, jc + 1, nv + 1), inf)
    best_s = np.full((n + 1, jc + 1, nv + 1), inf)
    flat_t, flat_s = best_t.reshape(-1), best_s.reshape(-1)  # views, for one-step gathers
    pick = np.full((n + 1, jc + 1, nv), -1, dtype=np.int64)  # candidate index
    pick_nj = np.full((n + 1, jc + 1, nv), -1, dtype=np.int64)  # class of the next stage; -1: last stage
    by_a = np.argsort(tab.a, kind="stable")
    bounds = np.searchsorted(tab.a[by_a], np.arange(n + 1))
    cols = np.arange(nv)
    for k in range(n - 1, -1, -1):
        here = by_a[bounds[k]:bounds[k + 1]]
        if here.size == 0:
            continue
        # rem[c, v]: the vector left after candidate c takes its devices from v, or the sentinel.
        ok_all = digits[tab.kind[here]] >= tab.d[here][:, None]
        rem_all = np.where(ok_all, cols[None, :] - take[here][:, None], nv)
        for j in range(jc + 1):
            sel = jmax[here] >= (j if j < jc else big_j)
            opts_t, opts_s, opts_c, opts_nj = [], [], [], []
            is_last = sel & (tab.b[here] == n)
            if is_last.any() and (jc == 0 or j == 0):
                last = here[is_last]
                opts_t.append(np.where(ok_all[is_last], t[last][:, None], inf))
                opts_s.append(np.broadcast_to(own[last][:, None], (last.size, nv)))
                opts_c.append(last)
                opts_nj.append(np.full(last.size, -1))
            is_mid = sel & (tab.b[here] < n)
            mid = here[is_mid]
            nexts = (0,) if jc == 0 else (() if j == 0 else ((j - 1,) if j < jc else (jc, jc - 1)))
            for nj in nexts if mid.size else ():
                at = ((tab.b[mid] * (jc + 1) + nj) * (nv + 1))[:, None] + rem_all[is_mid]
                opts_t.append(np.maximum(t[mid][:, None], flat_t[at]))
                opts_s.append(own[mid][:, None] + flat_s[at])
                opts_c.append(mid)
                opts_nj.append(np.full(mid.size, nj))
            if not opts_t:
                continue
            vt, vs = np.concatenate(opts_t), np.concatenate(opts_s)
            tmin = vt.min(0)
            vs = np.where(vt == tmin, vs, inf)  # among the options at the least bottleneck, the least sum
            o = vs.argmin(0)
            found = np.isfinite(tmin)
            best_t[k, j, :nv] = tmin
            best_s[k, j, :nv] = np.where(found, vs[o, cols], inf)
            pick[k, j] = np.where(found, np.concatenate(opts_c)[o], -1)
            pick_nj[k, j] = np.where(found, np.concatenate(opts_nj)[o], -1)
    full = int(sum(c * int(strides[i]) for i, c in enumerate(counts.values())))
    starts = [(best_t[0, j, full], best_s[0, j, full], j) for j in range(jc + 1) if pick[0, j, full] >= 0]
    if not starts:
        return None
    t_best, s_best, j = min(starts)
    k, v, out = 0, full, []
    while True:
        c = int(pick[k, j, v])
        out.append(c)
        nj = int(pick_nj[k, j, v])
        if nj < 0:
            return float(t_best), float(s_best), out
        k, v, j = int(tab.b[c]), v - int(take[c]), nj


def _table(cluster: Cluster, candidates: CandidateTable | list[Candidate]) -> tuple[dict[str, int], CandidateTable]:
    counts = kind_counts(cluster)
    tab = candidates if isinstance(candidates, CandidateTable) else CandidateTable.of(candidates, tuple(counts))
    if tuple(counts) != tab.kinds:
        raise ValueError(f"candidate kinds {tab.kinds} are not the cluster's {tuple(counts)}")
    return counts, tab


def solve_chain(chain: Chain, cluster: Cluster, setting: Setting, candidates: CandidateTable | list[Candidate], *,
                max_classes: int = 4) -> list[Candidate] | None:
    """The min-bottleneck tiling of the chain by candidates, within the cluster's devices.

    Among tilings with the least bottleneck, the least sum of ``t + comm + tail``.

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        candidates: a table from :func:`~.table.build_table` (or a list of candidates).
        max_classes: exact pipeline-position classes kept for memory (more: exact but slower).

    Returns:
        The candidates in pipeline order, or None if no tiling fits.
    """
    counts, tab = _table(cluster, candidates)
    big_j = classes(setting, len(cluster.devices))
    got = tile(chain.n, counts, tab, tab.t, tab.t + tab.comm + tab.tail, tab.jmax, big_j, min(big_j, max_classes))
    return None if got is None else [tab.candidate(i) for i in got[2]]


def proxy_chain(chain: Chain, cluster: Cluster, setting: Setting, candidates: CandidateTable | list[Candidate], *,
                max_classes: int = 4) -> list[Candidate] | None:
    """Of the min-bottleneck tiling (:func:`solve_chain`) and the least-sum tiling (least ``sum(t + comm +
    tail)``, the bottleneck ignored), the one with the lower :func:`objective` (ties: the min-bottleneck one).

    The ILP's microbatch search ranks each count by one DP plan and runs the ILP only at the best count
    (:func:`hpml_compile.solve.solve`). The min-bottleneck tiling is the right one when ``(M - 1) T`` dominates;
    with one microbatch the objective is ``sum(t + comm) + max tail`` and the bottleneck buys nothing. With
    fixed parts (a GPU's per-op cost, paid whole by every microbatch) one stage of every device has a larger
    ``t`` than a pipeline's stages, so the min-bottleneck tiling at ``M = 1`` is a pipeline run one stage after
    another, and the count at which one stage of all devices is fastest was ranked by a plan several times
    slower (gpt2-small on 2node-a100-16: 117 ms of objective against 44.9). Between the two extremes neither is
    exact; the ILP then solves the chosen count exactly (its bounds enumerate the bottleneck,
    :mod:`.bounds`). Two DP runs instead of one.

    >>> from hpml_compile.solve.candidates import enumerate_candidates
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> from hpml_compile.plan import Schedule
    >>> ch = Chain.of(chain_graph([(1.0, 2.0)] * 4))
    >>> st, two = Setting(microbatches=1, schedule=Schedule.ONE_F_ONE_B, batch_size=64), uniform_cluster(2)
    >>> [(c.a, c.b, c.d) for c in proxy_chain(ch, two, st, enumerate_candidates(ch, two, st))]
    [(0, 4, 2)]
    """
    return min(tilings(chain, cluster, setting, candidates, max_classes=max_classes),
               key=lambda p: objective(p, setting.microbatches), default=None)


def tilings(chain: Chain, cluster: Cluster, setting: Setting, candidates: CandidateTable | list[Candidate], *,
            max_classes: int = 4) -> list[list[Candidate]]:
    """The min-bottleneck tiling (what :func:`solve_chain` returns) and the least-sum tiling, in that order,
    each once (one when they are the same, none when nothing fits): the two plans :func:`proxy_chain` chooses
    from, for a caller that ranks them by another measure (``solve``'s ``ilp`` by the simulated step, so that
    it is never worse than ``dp``, whose plan is the first)."""
    counts, tab = _table(cluster, candidates)
    big_j = classes(setting, len(cluster.devices))
    jc = min(big_j, max_classes)
    own = tab.t + tab.comm + tab.tail
    got = [tile(chain.n, counts, tab, t, own, tab.jmax, big_j, jc) for t in (tab.t, np.zeros(len(tab)))]
    plans: list[list[Candidate]] = []
    for g in got:
        if g is not None and [tab.candidate(i) for i in g[2]] not in plans:
            plans.append([tab.candidate(i) for i in g[2]])
    return plans
