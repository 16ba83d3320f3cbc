"""Plans for clusters of many device kinds from two restrictions of the exact DP (the first plans).

The exact DP of :mod:`.dp` keeps the devices left of every kind in its
state: ``prod_k (count_k + 1)`` vectors (17 million for 3 kinds x 256), times
positions and memory classes, which is what ran llama-70b on 3 x 256 GPUs out
of memory. Two restrictions of the problem keep less, so both return real
plans (upper bounds), and the first plan is the better of the two:
:func:`coarse_chain` counts each kind's devices in units of ``g_k`` (a power
of two, the smallest that keeps ``prod_k (count_k // g_k + 1)`` under
:data:`COARSE_VECTORS`) and keeps only degrees that are multiples of ``g_k``;
:func:`ordered_chain` keeps every kind's devices but puts each kind's stages
in one block along the pipeline, kinds in a given order (fastest first for
the first plan), so its state is the devices left of the kind in use:
``sum_k`` instead of ``prod_k``. The coarse units can leave too few devices
for any plan (llama-70b on 3 x 256 at 64 microbatches, where a replica group
holds at most 8 devices: 4 units of 8 per kind), which the blocked DP does
not. The lower bounds are :mod:`.lagrange`'s (split from it: it had grown
past the house's ~600 lines), the local search on plans :mod:`.polish`'s
(split from here for the same reason).

Example:
    >>> from hpml_compile.solve.candidates import Chain, Setting
    >>> from hpml_compile.solve.table import build_table
    >>> from hpml_compile.testing import chain_graph, cluster_of
    >>> from hpml_compile.plan import Schedule
    >>> ch = Chain.of(chain_graph([{"a": (1.0, 1.0), "b": (3.0, 3.0)}] * 4))
    >>> c, st = cluster_of(["a", "b"]), Setting(8, Schedule.ONE_F_ONE_B, 64)
    >>> plan = ordered_chain(ch, c, st, build_table(ch, c, st), ("b", "a"))
    >>> [(x.kind, x.b - x.a) for x in plan]
    [('b', 1), ('a', 3)]
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from typing import Callable

from ..ir import Cluster
from .candidates import Candidate, Chain, Setting, classes, degrees, kind_counts
from .dp import objective, tile
from .table import CandidateTable

__all__ = ["COARSE_VECTORS", "EXACT_VECTORS", "ORDERED_STATES", "SWEEP", "vectors", "units", "feasible",
           "coarse_groups", "coarse_chain", "ordered_units", "ordered_groups", "speed_order", "ordered_chain",
           "least_sum", "suffix_sums", "proxy_sweep"]

#: Device-count vectors up to which the exact DP (and its bounds) are used as before.
EXACT_VECTORS = 130
#: Device-count vectors of the coarse DP's state (its memory is ~40 bytes x positions x 5 classes x this).
COARSE_VECTORS = 100
#: Device-count states per kind of the first plan's :func:`ordered_chain` (devices counted in units beyond).
ORDERED_STATES = 32
#: Where between the min-bottleneck tiling's bottleneck ``T0`` and the least-sum tiling's ``T1`` (on a log scale:
#: ``T0 (T1 / T0) ** q``) :func:`proxy_sweep` also takes the least-sum tiling of the stages at most that slow.
SWEEP = (0.35, 0.7)


def vectors(counts: dict[str, int]) -> int:
    """States per position of the exact DP: ``prod (count_k + 1)``."""
    return int(np.prod([c + 1 for c in counts.values()], dtype=np.float64))


def units(counts: dict[str, int], budget: int = COARSE_VECTORS) -> dict[str, int]:
    """Per kind, the unit ``g_k`` (a power of two) of the coarse DP: the largest count is halved first.

    >>> units({"a": 256, "b": 256, "c": 256}, 400)
    {'a': 64, 'b': 64, 'c': 32}
    >>> units({"a": 32, "b": 32}, 100)
    {'a': 4, 'b': 4}
    >>> units({"a": 64}, 400)
    {'a': 1}
    """
    g = {k: 1 for k in counts}
    while np.prod([counts[k] // g[k] + 1 for k in counts], dtype=np.float64) > budget:
        k = max(counts, key=lambda x: (counts[x] // g[x], -list(counts).index(x)))
        if counts[k] // g[k] <= 1:
            break
        g[k] *= 2
    return g


def feasible(picked: list[Candidate], counts: dict[str, int], big_j: int) -> bool:
    """A tiling respects every kind's device count and every stage's memory class."""
    used: dict[str, int] = {}
    for c in picked:
        used[c.kind] = used.get(c.kind, 0) + c.d
    if any(used[k] > counts.get(k, 0) for k in used):
        return False
    s = len(picked)
    return all(c.jmax >= min(big_j, s - 1 - i) for i, c in enumerate(picked))


def _units_at(counts: dict[str, int], setting: Setting, budget: int) -> tuple[dict[str, int], dict[str, int]]:
    """Units and unit counts of the coarse DP at this microbatch size.

    A unit above the largest degree the microbatch's rows allow would leave a kind no candidate: it is
    shrunk, and only as many units are used as before (fewer devices: still a restriction, so still plans).
    """
    g0 = units(counts, budget)
    rows = max(1, setting.batch_size // setting.microbatches)
    top = {k: max(degrees(c, rows), default=1) for k, c in counts.items()}
    g = {k: min(g0[k], 2 ** int(math.log2(top[k]))) for k in counts}
    return g, {k: min(counts[k] // g[k], counts[k] // g0[k]) for k in counts}


def coarse_groups(cluster: Cluster, setting: Setting, budget: int = COARSE_VECTORS) -> list[tuple[str, int]]:
    """The ``(kind, degree)`` groups :func:`coarse_chain` can use: build only these for a first plan."""
    counts = kind_counts(cluster)
    g, _ = _units_at(counts, setting, budget)
    rows = max(1, setting.batch_size // setting.microbatches)
    return [(k, d) for k, c in counts.items() for d in degrees(c, rows) if d % g[k] == 0]


def coarse_chain(chain: Chain, cluster: Cluster, setting: Setting, tab: CandidateTable, *,
                 budget: int = COARSE_VECTORS, max_classes: int = 4, bottleneck: bool = True
                 ) -> list[Candidate] | None:
    """A plan from the exact DP over devices counted in units (see the module docstring); None if none.

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        tab: the candidate stages.
        budget: most device-count vectors of the DP.
        max_classes: memory classes kept exactly (the rest as the worst case: never over memory).
        bottleneck: the min-bottleneck tiling (then least sum); False: the least-sum tiling, the bottleneck
            ignored (:func:`~.dp.proxy_chain`'s other extreme).

    Returns:
        The candidates in pipeline order.
    """
    counts = kind_counts(cluster)
    g, ucounts = _units_at(counts, setting, budget)
    gk = np.asarray([g[k] for k in tab.kinds], dtype=np.int64)
    keep = np.flatnonzero(tab.d % gk[tab.kind] == 0)
    if keep.size == 0:
        return None
    sub = tab.select(keep)
    sub = dataclasses.replace(sub, d=sub.d // gk[sub.kind])
    big_j = classes(setting, len(cluster.devices))
    key = sub.t if bottleneck else np.zeros(len(sub))
    got = tile(chain.n, ucounts, sub, key, sub.t + sub.comm + sub.tail, sub.jmax, big_j, min(big_j, max_classes))
    return None if got is None else [tab.candidate(int(keep[i])) for i in got[2]]


def ordered_units(cluster: Cluster, setting: Setting, states: int = ORDERED_STATES) -> dict[str, int]:
    """Per kind, the device unit of :func:`ordered_chain`: a power of two, the least that keeps
    ``count / unit`` at most ``states``, but no more than the largest degree the microbatch's rows allow.

    >>> from hpml_compile.plan import Schedule
    >>> from hpml_compile.testing import cluster_of
    >>> ordered_units(cluster_of(["a"] * 256), Setting(64, Schedule.ONE_F_ONE_B, 512), 32)
    {'a': 8}
    """
    rows = max(1, setting.batch_size // setting.microbatches)
    out = {}
    for k, c in kind_counts(cluster).items():
        top = max(degrees(c, rows), default=1)
        g = 1
        while c // g > states and g * 2 <= top:
            g *= 2
        out[k] = g
    return out


def ordered_groups(cluster: Cluster, setting: Setting, states: int = ORDERED_STATES) -> list[tuple[str, int]]:
    """The ``(kind, degree)`` groups :func:`ordered_chain` uses with :func:`ordered_units`: build only these."""
    g = ordered_units(cluster, setting, states)
    rows = max(1, setting.batch_size // setting.microbatches)
    return [(k, d) for k, c in kind_counts(cluster).items() for d in degrees(c, rows) if d % g[k] == 0]


def speed_order(chain: Chain, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The kinds from the fastest (least forward + backward time of the whole chain) to the slowest."""
    return tuple(sorted(kinds, key=lambda k: chain.fwd[k][-1] + chain.bwd[k][-1]))


def ordered_chain(chain: Chain, cluster: Cluster, setting: Setting, tab: CandidateTable,
                  order: tuple[str, ...] | None = None, *, max_classes: int = 4,
                  unit: dict[str, int] | None = None, bottleneck: bool = True) -> list[Candidate] | None:
    """The min-bottleneck tiling (then least sum) whose kinds come in blocks, in ``order``, along the pipeline.

    A restriction of the problem (each kind's stages are contiguous, kinds in the given order; a kind may be
    skipped), so its answer is a plan; but every degree is kept, so unlike :func:`coarse_chain` it never
    loses feasibility to a device unit. The state holds only the devices left of the kind in use:
    ``sum_k (count_k + 1)`` vectors instead of ``prod_k``, so 3 kinds x 256 cost 771 where the exact
    DP needs 17 million. Memory classes as in :func:`~.dp.tile`.

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        tab: the candidate stages.
        order: the kinds in pipeline order (default: the table's).
        max_classes: memory classes kept exactly (the rest as the worst case: never over memory).
        unit: per kind, count devices in units of this many (only degrees that are multiples of it are used;
            default 1: every degree, exact within the order).
        bottleneck: the min-bottleneck tiling (then least sum); False: the least-sum tiling within the order,
            the bottleneck ignored.

    Returns:
        The candidates in pipeline order, or None if no such tiling fits.
    """
    n, counts = chain.n, kind_counts(cluster)
    order = tuple(order or tab.kinds)
    big_j = classes(setting, len(cluster.devices))
    jc = min(big_j, max_classes)
    inf = np.inf
    full = tab
    g = np.asarray([(unit or {}).get(k, 1) for k in tab.kinds], dtype=np.int64)
    keep = np.flatnonzero(tab.d % g[tab.kind] == 0)
    tab = dataclasses.replace(tab.select(keep), d=tab.d[keep] // g[tab.kind[keep]])
    kinds = [tab.kinds.index(k) for k in order]
    caps = [counts[k] // int(g[tab.kinds.index(k)]) for k in order]
    nk = len(kinds)
    # per kind in order: (n + 1, jc + 1, cap + 2) values; the last column is a sentinel that stays inf
    vt = [np.full((n + 1, jc + 1, c + 2), inf) for c in caps]
    vs = [np.full((n + 1, jc + 1, c + 2), inf) for c in caps]
    pk = [np.full((n + 1, jc + 1, c + 1), -1, dtype=np.int64) for c in caps]  # candidate, -2: next kind
    pj = [np.full((n + 1, jc + 1, c + 1), -1, dtype=np.int64) for c in caps]
    own = tab.t + tab.comm + tab.tail
    key = tab.t if bottleneck else np.zeros(len(tab))  # what is minimised first (then the sum of ``own``)
    groups = []
    for ki in kinds:
        idx = np.flatnonzero(tab.kind == ki)
        idx = idx[np.argsort(tab.a[idx], kind="stable")]
        cuts = np.searchsorted(tab.a[idx], np.arange(n + 2))
        groups.append([idx[cuts[k]:cuts[k + 1]] for k in range(n + 1)])
    j1 = jc + 1
    need = np.asarray([j if j < jc else big_j for j in range(j1)])  # least jmax admitted at each class
    jr = np.arange(j1)
    for k in range(n - 1, -1, -1):
        for i in range(nk - 1, -1, -1):  # a kind's value at k may switch to the next kind's at k
            cap, here = caps[i], groups[i][k]
            cols = np.arange(cap + 1)
            ot, os_, oc, oj = [], [], [], []  # options: (x, j1, cap + 1) values, (x, j1) candidate and next class
            if here.size:
                ok = cols[None, :] >= tab.d[here][:, None]
                rem = np.where(ok, cols[None, :] - tab.d[here][:, None], cap + 1)
                adm = tab.jmax[here][:, None] >= need[None, :]
                t_h, own_h = key[here][:, None, None], own[here][:, None, None]
                last = tab.b[here] == n
                if last.any():  # the last stage: class 0 only
                    x = int(last.sum())
                    v = np.full((x, j1, cap + 1), inf)
                    v[:, 0] = np.where(ok[last] & adm[last, :1], key[here[last]][:, None], inf)
                    ot.append(v)
                    os_.append(np.broadcast_to(own_h[last], v.shape))
                    oc.append(np.broadcast_to(here[last][:, None], (x, j1)))
                    oj.append(np.full((x, j1), -1))
                mid = ~last
                if mid.any():
                    h, x = here[mid], int(mid.sum())
                    at = ((tab.b[h][:, None] * j1 + jr[None, :]) * (cap + 2))[:, :, None] + rem[mid][:, None, :]
                    gt, gs = vt[i].reshape(-1)[at], vs[i].reshape(-1)[at]  # (x, next class, cap + 1)
                    shifted = [(0, 0)] if jc == 0 else [(j, j - 1) for j in range(1, j1)]  # (class, next class)
                    if jc > 0:
                        shifted.append((jc, jc))
                    for pairs in ([p for p in shifted if p != (jc, jc) or jc == 0], [(jc, jc)] if jc > 0 else []):
                        if not pairs:
                            continue
                        v_t, v_s = np.full((x, j1, cap + 1), inf), np.full((x, j1, cap + 1), inf)
                        nj = np.full((x, j1), -1)
                        for j, q in pairs:
                            v_t[:, j] = np.where(adm[mid, j:j + 1], np.maximum(t_h[mid, 0], gt[:, q]), inf)
                            v_s[:, j] = own_h[mid, 0] + gs[:, q]
                            nj[:, j] = q
                        ot.append(v_t)
                        os_.append(v_s)
                        oc.append(np.broadcast_to(h[:, None], (x, j1)))
                        oj.append(nj)
            if i + 1 < nk:  # this kind's blocks end before k: the next kind's value with all its devices
                nxt = caps[i + 1]
                ot.append(np.broadcast_to(vt[i + 1][k, :, nxt][None, :, None], (1, j1, cap + 1)))
                os_.append(np.broadcast_to(vs[i + 1][k, :, nxt][None, :, None], (1, j1, cap + 1)))
                oc.append(np.full((1, j1), -2))
                oj.append(jr[None, :])
            if not ot:
                continue
            at_, as_ = np.concatenate(ot), np.concatenate(os_)
            tmin = at_.min(0)
            as_ = np.where(at_ == tmin, as_, inf)  # among the options at the least bottleneck, the least sum
            o = as_.argmin(0)  # (j1, cap + 1)
            found = np.isfinite(tmin)
            vt[i][k, :, :cap + 1] = tmin
            vs[i][k, :, :cap + 1] = np.where(found, np.take_along_axis(as_, o[None], 0)[0], inf)
            pk[i][k] = np.where(found, np.concatenate(oc)[o, jr[:, None]], -1)
            pj[i][k] = np.where(found, np.concatenate(oj)[o, jr[:, None]], -1)
    starts = [(vt[0][0, j, caps[0]], vs[0][0, j, caps[0]], j) for j in range(jc + 1) if pk[0][0, j, caps[0]] != -1]
    if not starts:
        return None
    _, _, j = min(starts)
    i, k, c, out = 0, 0, caps[0], []
    while True:
        p = int(pk[i][k, j, c])
        if p == -2:
            i += 1
            c = caps[i]
            continue
        out.append(full.candidate(int(keep[p])))
        nj = int(pj[i][k, j, c])
        if nj < 0:
            return out
        k, c, j = int(tab.b[p]), c - int(tab.d[p]), nj


def least_sum(tab: CandidateTable, weight: np.ndarray) -> float:
    """Least ``sum weight`` over tilings of ``[0, n)`` by ``tab``'s candidates (``n``: where the last ends), device
    counts and memory classes ignored: a lower bound for every plan's (``inf`` if nothing tiles).

    >>> from hpml_compile.solve.table import build_table
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> from hpml_compile.plan import Schedule
    >>> tab = build_table(Chain.of(chain_graph([(1.0, 2.0)] * 2)), uniform_cluster(1), Setting(1, Schedule.GPIPE, 8))
    >>> least_sum(tab, tab.t)  # one stage of both blocks: forward and backward, 3 ms each
    6.0
    """
    if len(tab) == 0:
        return math.inf
    return float(suffix_sums(int(tab.b.max()), tab, weight)[0])


def suffix_sums(n: int, tab: CandidateTable, w: np.ndarray) -> np.ndarray:
    """Per block ``k`` (``0..n``), the least ``sum w`` of a tiling of ``[k, n)`` by ``tab``'s candidates (``inf``
    where none tiles; ``0`` at ``n``), device counts and memory classes ignored."""
    suf = np.full(n + 1, np.inf)
    suf[n] = 0.0
    by_a = np.argsort(tab.a, kind="stable")
    cut = np.searchsorted(tab.a[by_a], np.arange(n + 2))
    for k in range(n - 1, -1, -1):
        h = by_a[cut[k]:cut[k + 1]]
        if h.size:
            suf[k] = float(np.min(w[h] + suf[tab.b[h]]))
    return suf


def proxy_sweep(dp: Callable[[CandidateTable, bool], list[Candidate] | None], tab: CandidateTable, microbatches: int,
                levels: tuple[float, ...] | None = SWEEP) -> list[Candidate] | None:
    """The best, on the ILP's proxy objective ``(M - 1) T + S + R``, of a restricted DP's tilings at several
    bottlenecks: the min-bottleneck one (``dp(tab, True)``), the least-sum one (``dp(tab, False)``), and the
    least-sum tilings of the stages no slower than thresholds between the two's bottlenecks (``levels``;
    None: the min-bottleneck tiling alone, as before the sweep).

    The restricted DPs minimise the bottleneck ``T`` first, which is the proxy's choice only when ``(M - 1) T``
    dominates; with a GPU's fixed per-op costs, at few microbatches (or where a wide stage is cheap) a plan
    with a larger bottleneck and a much smaller sum is better (:func:`~.dp.proxy_chain` makes the same choice on
    the exact path). The proxy's optimum within the restriction is ``min over T of (M - 1) T + S(T)`` (``S(T)``:
    the least sum with every stage at most ``T``), so each threshold is one point of that curve, and the two
    ends are the DP's own extremes. Every tiling returned fits (the thresholds only remove candidates, and the
    min-bottleneck plan is in each restricted set), so it is a plan, an upper bound; None when nothing fits.

    Only stages faster than ``T_max = (u - s) / (M - 1)`` are offered to the least-sum runs, ``u`` the
    min-bottleneck plan's objective and ``s`` the least ``sum(t + comm) + min tail`` of any tiling with devices
    and memory ignored (:func:`least_sum`): a plan holding a slower stage has an objective of at least
    ``(M - 1) T_max + s = u``. At many microbatches that leaves few candidates, so the sweep costs little
    there (the unrestricted least-sum run costs as much as the min-bottleneck one).

    >>> from hpml_compile.solve.table import build_table
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> from hpml_compile.plan import Schedule
    >>> ch, c, st = Chain.of(chain_graph([(1.0, 2.0)] * 6)), uniform_cluster(3), Setting(1, Schedule.ONE_F_ONE_B, 64)
    >>> tab = build_table(ch, c, st)
    >>> run = lambda t, b: ordered_chain(ch, c, st, t, bottleneck=b)
    >>> [(x.b - x.a, x.d) for x in run(tab, True)], objective(run(tab, True), 1)  # two stages, one after the other
    ([(2, 1), (4, 2)], 12.0)
    >>> [(x.b - x.a, x.d) for x in proxy_sweep(run, tab, 1)], objective(proxy_sweep(run, tab, 1), 1)
    ([(6, 2)], 9.0)
    """
    best = dp(tab, True)
    if best is None or levels is None:  # the least-sum tilings have the same stages to choose from
        return best
    m, upper = microbatches, objective(best, microbatches)
    lo = max(c.t for c in best)
    if m > 1:
        top = (upper - least_sum(tab, tab.t + tab.comm) - float(tab.tail.min())) / (m - 1)
        if top <= lo:  # no plan with a larger bottleneck can beat it
            return best
        if top < float(tab.t.max()):
            tab = tab.select(np.flatnonzero(tab.t < top))
    plans = [best]
    least = dp(tab, False)
    if least is not None:
        plans.append(least)
        hi = max(c.t for c in least)
        seen = len(tab)
        for q in levels if 0 < lo < hi else ():
            keep = np.flatnonzero(tab.t <= lo * (hi / lo) ** q * (1 + 1e-12))
            if keep.size == seen:  # the same stages as the last threshold: the same tiling
                continue
            seen = keep.size
            got = dp(tab.select(keep), False)
            if got is not None:
                plans.append(got)
    return min(plans, key=lambda p: objective(p, m))
