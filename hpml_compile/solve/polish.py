"""Local search on plans within one candidate table: polish a plan, or repair a tiling that breaks the device counts.

Split from :mod:`.restricted` (which had grown past the house's ~600 lines).
:func:`polish` improves a plan by moves that keep it a plan (a stage's
candidate replaced, a boundary shifted, two stages merged or one split);
:meth:`Polisher.repair` walks a tiling that uses more devices of some kind than
the cluster has (a Lagrangian shortest path, :mod:`.lagrange`) to a plan near
it, charging each device over a count a price instead of ruling the move out.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .candidates import CONFIGS, Candidate
from .table import CandidateTable

__all__ = ["POLISH_S", "POLISH_SHIFT", "REPAIR_PENALTY", "Polisher", "polish"]

#: Wall seconds :func:`polish` may take by default.
POLISH_S = 0.3


class Polisher:
    """Local search on a plan within one candidate table: the moves of :func:`polish`, over table indices.

    The table's candidates are grouped by range ``(a, b)`` once (a dict, ~0.1 s per 100,000 candidates);
    each move then scores all its options at once with numpy: the proxy ``(M - 1) T + S + R`` of the plan
    with the options in place, where an option breaking a kind's device count or its memory class (``jmax``
    at least the stages after it, up to ``J``) scores ``inf``.
    """

    def __init__(self, tab: CandidateTable, counts: dict[str, int], big_j: int, microbatches: int) -> None:
        self.tab, self.big_j, self.m = tab, big_j, microbatches
        self.cap = np.asarray([counts.get(k, 0) for k in tab.kinds], dtype=np.int64)
        self.w = tab.t + tab.comm
        order = np.lexsort((tab.b, tab.a))
        keys = tab.a[order] * (int(tab.b.max(initial=0)) + 1) + tab.b[order]
        # an empty table (no candidate fits at this count) has no ranges: every plan is then "not in it"
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if keys.size else np.zeros(0, dtype=np.int64)
        ends = np.r_[starts[1:], keys.size]
        self.ranges = {(int(tab.a[order[s]]), int(tab.b[order[s]])): order[s:e] for s, e in zip(starts, ends)}

    def index(self, plan: list[Candidate], *, same: bool = True) -> list[int] | None:
        """The plan's candidates as indices into the table (None if one is not in it). ``same``: the very
        candidates (times alike); else the stages of the same range, kind, degree and memory options, whatever
        their times (a tiling found at another microbatch count, moved to this table's count), each fitting
        the memory class of its place."""
        out = []
        tab, s = self.tab, len(plan)
        for i, c in enumerate(plan):
            idx = self.ranges.get((c.a, c.b))
            if idx is None or c.kind not in tab.kinds:
                return None
            ok = (tab.kind[idx] == tab.kinds.index(c.kind)) & (tab.d[idx] == c.d)
            if same:
                ok &= (np.abs(tab.t[idx] - c.t) <= 1e-9 * max(1.0, abs(c.t))) \
                    & (np.abs(tab.tail[idx] - c.tail) <= 1e-9 * max(1.0, abs(c.tail)))
            else:
                ok &= (tab.cfg[idx] == CONFIGS.index(c.config)) & (tab.jmax[idx] >= min(self.big_j, s - 1 - i))
            hit = idx[ok]
            if hit.size == 0:
                return None
            out.append(int(hit[0]))
        return out

    def score(self, p: list[int]) -> float:
        """The proxy objective of the tiling ``p`` (indices)."""
        tab = self.tab
        return float((self.m - 1) * tab.t[p].max() + self.w[p].sum() + tab.tail[p].max())

    def _options(self, a: int, b: int, after: int) -> np.ndarray:
        """Candidates of range ``[a, b)`` that fit with ``after`` stages after them."""
        idx = self.ranges.get((a, b))
        if idx is None:
            return np.zeros(0, np.int64)
        return idx[self.tab.jmax[idx] >= min(self.big_j, after)]

    def _best(self, rest: list[int], opts: list[np.ndarray],
              penalty: float = 0.0) -> tuple[tuple[float, int], tuple[int, ...]] | None:
        """The best choice of one option per array in ``opts`` beside the stages ``rest``: ((score, stages at the
        bottleneck), choice); the second breaks ties, so that a plateau of equal bottlenecks is walked down.
        ``penalty`` > 0: a choice over a kind's device count is not ruled out but scores ``penalty`` more per device
        over (what :meth:`repair` descends on); 0: it scores ``inf``."""
        tab, m = self.tab, self.m
        if any(o.size == 0 for o in opts):
            return None
        r = np.asarray(rest, dtype=np.int64)
        used = np.bincount(tab.kind[r], weights=tab.d[r], minlength=len(tab.kinds)) if r.size else \
            np.zeros(len(tab.kinds))
        t0 = float(tab.t[r].max()) if r.size else 0.0
        s0 = float(self.w[r].sum()) if r.size else 0.0
        r0 = float(tab.tail[r].max()) if r.size else 0.0
        shape = [o.size for o in opts]
        tmax, ssum, rmax = np.full(shape, t0), np.full(shape, s0), np.full(shape, r0)
        dev = [np.full(shape, float(used[k])) for k in range(len(tab.kinds))]
        for ax, o in enumerate(opts):
            view = [1] * len(opts)
            view[ax] = o.size
            tmax = np.maximum(tmax, tab.t[o].reshape(view))
            ssum = ssum + self.w[o].reshape(view)
            rmax = np.maximum(rmax, tab.tail[o].reshape(view))
            for k in range(len(tab.kinds)):
                dev[k] = dev[k] + np.where(tab.kind[o] == k, tab.d[o], 0).reshape(view)
        val = (m - 1) * tmax + ssum + rmax
        for k in range(len(tab.kinds)):
            val = val + penalty * np.maximum(dev[k] - self.cap[k], 0.0) if penalty > 0 else \
                np.where(dev[k] <= self.cap[k], val, np.inf)
        least = float(val.min())
        if not math.isfinite(least):
            return None
        # among the options within rounding of the least, the fewest stages at the bottleneck
        ties = np.where(tmax == t0, int(np.sum(tab.t[r] >= t0)) if r.size else 0, 0)
        for ax, o in enumerate(opts):
            view = [1] * len(opts)
            view[ax] = o.size
            ties = ties + (tab.t[o].reshape(view) >= tmax)
        near = val <= least + 1e-12 * abs(least)
        at = int(np.argmin(np.where(near, ties, np.iinfo(np.int64).max)))
        pick = np.unravel_index(at, val.shape)
        return (float(val.flat[at]), int(ties.flat[at])), tuple(int(o[i]) for o, i in zip(opts, pick))

    def key(self, p: list[int], penalty: float = 0.0) -> tuple[float, int]:
        """The score of ``p`` and its stages at the bottleneck (what a move must lower, in that order); with a
        ``penalty``, plus that much per device over a kind's count (see :meth:`_best`)."""
        t = self.tab.t[p]
        return self.score(p) + penalty * float(self.excess(p).sum()), int(np.sum(t >= t.max()))

    def excess(self, p: list[int]) -> np.ndarray:
        """Per kind, the devices ``p`` uses beyond the kind's count (0 where it fits)."""
        tab = self.tab
        used = np.bincount(tab.kind[p], weights=tab.d[p], minlength=len(tab.kinds))
        return np.maximum(used - self.cap, 0.0)

    def repair(self, p: list[int], until: float) -> list[int] | None:
        """A tiling within every kind's device count near ``p``, a tiling (indices) that may use too many devices
        (a Lagrangian shortest path: the prices let it break the counts): steepest descent over the moves of
        :meth:`moves` on the score plus :data:`REPAIR_PENALTY` times the score per device over, so each move takes
        the cheapest way to fewer devices over and, once none is, the best move as :func:`polish` does. None if
        it still uses too many devices when no move helps or ``until`` passes. The moves keep memory classes only
        for the stages they place: the caller checks the result (:func:`feasible`)."""
        import time

        if not np.any(self.excess(p) > 0):
            return p
        penalty = REPAIR_PENALTY * max(self.score(p), 1e-9)
        value = self.key(p, penalty)
        while time.perf_counter() < until and np.any(self.excess(p) > 0):
            got = self.moves(p, penalty)
            if got is None or not _less(got[0], value):
                return None
            value, p = got
        return None if np.any(self.excess(p) > 0) else p

    def moves(self, p: list[int], penalty: float = 0.0) -> tuple[tuple[float, int], list[int]] | None:
        """The best neighbour of ``p``: one stage replaced (kind, degree, memory options), one boundary shifted by
        up to :data:`POLISH_SHIFT` positions (each side any candidate of its new range), two neighbours merged, or
        one stage split in two. None if no neighbour fits. ``penalty``: as :meth:`_best`'s."""
        tab, s = self.tab, len(p)
        a = [int(tab.a[i]) for i in p]
        b = [int(tab.b[i]) for i in p]
        best: tuple[tuple[float, int], list[int]] | None = None

        def take(got: tuple[tuple[float, int], tuple[int, ...]] | None,
                 new: Callable[[tuple[int, ...]], list[int]]) -> None:
            nonlocal best
            if got is not None and (best is None or _less(got[0], best[0])):
                best = (got[0], new(got[1]))

        for i in range(s):  # replace stage i
            take(self._best(p[:i] + p[i + 1:], [self._options(a[i], b[i], s - 1 - i)], penalty),
                 lambda c, i=i: p[:i] + [c[0]] + p[i + 1:])
        for i in range(s - 1):  # shift the boundary between i and i + 1
            for cut in range(max(a[i] + 1, b[i] - POLISH_SHIFT), min(b[i + 1] - 1, b[i] + POLISH_SHIFT) + 1):
                if cut != b[i]:
                    take(self._best(p[:i] + p[i + 2:], [self._options(a[i], cut, s - 1 - i),
                                                          self._options(cut, b[i + 1], s - 2 - i)], penalty),
                         lambda c, i=i: p[:i] + list(c) + p[i + 2:])
        for i in range(s - 1):  # merge i and i + 1 (the stages before need one class less: they still fit)
            q = p[:i] + p[i + 2:]
            take(self._best(q, [self._options(a[i], b[i + 1], s - 2 - i)], penalty),
                 lambda c, i=i: p[:i] + [c[0]] + p[i + 2:])
        for i in range(s):  # split i (the stages before must fit with one more after them)
            if any(int(tab.jmax[p[j]]) < min(self.big_j, s - j) for j in range(i)):
                continue
            for cut in range(a[i] + 1, b[i]):
                take(self._best(p[:i] + p[i + 1:], [self._options(a[i], cut, s - i), self._options(cut, b[i], s - 1 - i)],
                                penalty),
                     lambda c, i=i: p[:i] + list(c) + p[i + 1:])
        return best


def _less(x: tuple[float, int], y: tuple[float, int]) -> bool:
    """``x`` before ``y``: a lower score (beyond rounding), or the same score with fewer stages at the bottleneck."""
    if x[0] < y[0] * (1 - 1e-12):
        return True
    return x[0] <= y[0] * (1 + 1e-12) and x[1] < y[1]


#: Positions a boundary moves at most in one :func:`polish` move.
POLISH_SHIFT = 2
#: :meth:`Polisher.repair`'s price of one device over a kind's count, as a share of the starting plan's score: at
#: 1 every move that frees a device beats every move that does not (bar one that doubles the score), so the
#: descent first ends the excess, each move the cheapest for the devices it frees, then polishes.
REPAIR_PENALTY = 1.0


def polish(tab: CandidateTable, plan: list[Candidate], counts: dict[str, int], big_j: int, microbatches: int, *,
           until: float | None = None, polisher: Polisher | None = None, same: bool = True) -> list[Candidate]:
    """A plan at least as good as ``plan`` by steepest descent over local moves (replace a stage's kind, degree or
    memory options; shift a boundary; merge two neighbours; split a stage), each within ``tab`` and keeping every
    kind's device count and every stage's memory class, until no move improves or ``until`` (a
    ``time.perf_counter()`` value; default :data:`POLISH_S` from now) passes.

    The many-kind search's incumbents are Lagrangian shortest paths and restricted DPs' tilings; neither is
    locally optimal in the full problem (a blocked DP keeps each kind in one block, a priced path ignores the
    counts), and a better incumbent closes counts sooner. Only the upper side: bounds are untouched.
    ``plan`` is returned as it is when one of its stages is not in ``tab``. With ``same=False`` ``plan`` may come
    from another microbatch count's table: its stages are looked up by range, kind, degree and memory options (the
    move "change ``M``"), and the result is at this count (its objective is not comparable with ``plan``'s).

    >>> from hpml_compile.solve.candidates import Chain, Setting, classes
    >>> from hpml_compile.solve.dp import objective
    >>> from hpml_compile.solve.table import build_table
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> from hpml_compile.plan import Schedule
    >>> ch, c, st = Chain.of(chain_graph([(1.0, 2.0)] * 6)), uniform_cluster(2), Setting(4, Schedule.ONE_F_ONE_B, 64)
    >>> tab = build_table(ch, c, st)
    >>> bad = [tab.candidate(i) for i in range(len(tab)) if (tab.a[i], tab.b[i], tab.d[i]) in ((0, 1, 1), (1, 6, 1))]
    >>> good = polish(tab, bad, {"cpu": 2}, classes(st, 2), 4)
    >>> objective(good, 4) < objective(bad, 4), [(x.a, x.b, x.d) for x in good]  # one stage, both devices
    (True, [(0, 6, 2)])
    """
    import time

    stop = time.perf_counter() + POLISH_S if until is None else until
    pol = polisher or Polisher(tab, counts, big_j, microbatches)
    p = pol.index(plan, same=same)
    if p is None:
        return plan
    start = pol.score(p)
    value = pol.key(p)
    while time.perf_counter() < stop:
        got = pol.moves(p)
        if got is None or not _less(got[0], value):
            break
        value, p = got
    if same and value[0] >= start * (1 - 1e-12):
        return plan
    return [tab.candidate(i) for i in p]
