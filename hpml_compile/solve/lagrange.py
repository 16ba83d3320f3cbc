"""Clusters of many device kinds: restricted exact DPs for plans (:mod:`.restricted`), a Lagrangian DP for the bound.

The exact DP of :mod:`.dp` keeps the devices left of every kind in its
state: ``prod_k (count_k + 1)`` vectors (17 million for 3 kinds x 256), times
positions and memory classes, which is what ran llama-70b on 3 x 256 GPUs out
of memory. Here neither side of the search keeps that product:

- **Plans (upper bounds)**, two restrictions of the problem, so both return
  real plans, and the first plan is the better of the two:
  :func:`coarse_chain` counts each kind's devices in units of ``g_k`` (a
  power of two, the smallest that keeps ``prod_k (count_k // g_k + 1)`` under
  :data:`COARSE_VECTORS`) and keeps only degrees that are multiples of
  ``g_k``; :func:`ordered_chain` keeps every kind's devices but puts each
  kind's stages in one block along the pipeline, kinds in a given order
  (fastest first for the first plan), so its state is the devices left of
  the kind in use: ``sum_k`` instead of ``prod_k``. The coarse units can leave
  too few devices for any plan (llama-70b on 3 x 256 at 64 microbatches,
  where a replica group holds at most 8 devices: 4 units of 8 per kind), which
  the blocked DP does not.
- **Bounds (lower)**, :func:`lagrangian_bounds`: the per-kind device limits
  ``sum d <= count_k`` are moved into the objective with prices
  ``lambda_k >= 0`` (Lagrangian relaxation). What is left is a shortest path
  over positions and memory classes (:func:`path_min`, no device state at
  all: a few milliseconds), and for every ``lambda``,
  ``Q(lambda) - lambda . count`` is below the least ``sum(t + comm)`` of any
  plan. The bottleneck and tail are enumerated as thresholds in the
  best-first branch and bound of :mod:`.bounds`; each box's bound is the
  Lagrangian dual of its threshold pair, maximised by cutting planes (the
  box-step method of :mod:`.bundle`: every shortest path is a plane above the
  dual, the planes are shared by every pair whose thresholds admit the path,
  and the next prices maximise the planes near the best prices found (projected
  subgradient steps, tried instead, aimed at the value
  that would settle the box, far above what the dual can reach, and left
  llama-70b on 3 x 32 at 64 microbatches 11% under its optimum after 20 CPU
  s, where the planes prove it in 3). A box of one threshold pair is not
  settled after its first dozen paths: it goes back on the heap with its
  bound and prices and is advanced again when it is the least open box,
  until its dual converges. (Settling after twelve steps froze llama-70b on
  3 x 256 at a 6.1% gap for the last 10 s of a
  60 s solve; resumed, the same table reaches 0.7% in 3.8 CPU s.) Paths
  the relaxation returns that happen to respect every limit and every memory
  class are plans too, and improve the incumbent: at scale they are the best
  plans found. With many stages the duality gap is small (each kind's limit
  is one constraint against dozens of stages), which is what makes the
  certificate tight at scale.
- **Floored-units DPs** (:class:`~.floored._Floored`): where the prices stall on a threshold pair (its dual converged
  below the incumbent, or at once where the first plan has few stages per kind, :data:`FEW_STAGES`), the
  pair's bound is raised by exact DPs over device counts kept in the state in units rounded down (each
  kind alone, the others priced; then every kind in coarse units), over only the candidates on a path
  that may beat the incumbent at the pair's prices (:func:`through`). Rounding down admits every plan, so
  each is a relaxation, and it has no duality gap from the prices: gpt2-xl on 3 x 32 (six stages of 16
  devices) sat at 1.9% with prices alone and reaches 1% in ~4 CPU s with them. A box's bound also keeps its
  parent's (its plans are among the parent's), so the least open box never falls.
- :func:`reduced_cost_prune` drops candidates that cannot be in a plan better
  than the incumbent, by the Lagrangian bound of the best path through them,
  before the MILP (:mod:`.ilp`) sees the table.

Example:
    >>> from hpml_compile.solve.candidates import Chain, Setting
    >>> from hpml_compile.solve.table import build_table
    >>> from hpml_compile.testing import chain_graph, cluster_of
    >>> from hpml_compile.plan import Schedule
    >>> ch = Chain.of(chain_graph([{"a": (1.0, 1.0), "b": (3.0, 3.0)}] * 4))
    >>> c, st = cluster_of(["a", "b"]), Setting(8, Schedule.ONE_F_ONE_B, 64)
    >>> tab = build_table(ch, c, st)
    >>> plan = coarse_chain(ch, c, st, tab)
    >>> b, prices = lagrangian_bounds(ch, c, st, tab, start=plan)
    >>> b.lower <= b.upper, sorted((x.b - x.a, x.kind) for x in b.plan)
    (True, [(1, 'b'), (3, 'a')])
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Callable, Iterator

import numpy as np

from ..ir import Cluster
from .bounds import Bounds, exact_classes
from .bundle import Planes, box_argmax
from .candidates import Candidate, Chain, Setting, classes, kind_counts
from .dp import objective
from .floored import FLOOR_WORK, _Floored, floor_variants
from .restricted import (COARSE_VECTORS, EXACT_VECTORS, ORDERED_STATES, coarse_chain, coarse_groups, feasible,
                         ordered_chain, ordered_groups, ordered_units, speed_order, suffix_sums, units, vectors)
from .table import CandidateTable

# the restricted DPs moved to .restricted, the floored-units DPs to .floored; their names stay importable from here
__all__ = ["COARSE_VECTORS", "EXACT_VECTORS", "ORDERED_STATES", "vectors", "units", "coarse_groups", "coarse_chain",
           "ordered_units", "ordered_groups", "speed_order", "ordered_chain", "path_min",
           "lagrangian_bounds", "LagrangianRun", "reduced_cost_prune", "through", "floor_variants", "feasible"]

#: Most shortest paths spent on one threshold pair's dual.
DUAL_STEPS = 240
#: A pair's dual is converged once the cutting-plane model (:mod:`.bundle`) promises no more than this share of its
#: value near the best prices.
DUAL_TOL = 1e-6
#: Memory classes of the Lagrangian DP (optimistic beyond: still a lower bound). Every class the table needs
#: (:func:`~.bounds.exact_classes`, at most ``M - 1``) up to 64 microbatches: with 8 (the classes past 8 merged) a stage that
#: fits only with at most 8-30 stages after it was admitted anywhere past the 8th, so on pipelines of 16-32 stages
#: the shortest paths broke memory, were never plans, and the bound stopped below the optimum. llama-70b on 3 x 256
#: at M=32 (31 classes): with 8, 38 CPU s gave bound 70,830 ms and no plan below 74,356; with every class the
#: paths proved the optimum, 70,830.38 ms, in 3.1 CPU s (each shortest path costs more, far fewer are needed).
LAGRANGE_CLASSES = 64
#: Subgradient steps on one threshold pair after which its bound is raised by the floored-units DPs, where the
#: first plan has at most :data:`FEW_STAGES` stages per kind (else only once its prices have converged: with
#: many stages per kind the prices' duality gap is small and the floored DPs cost more than they raise:
#: llama-70b on 3 x 256 reached 1% after 6.8 CPU s this way and not within 11 s when floored at once).
FLOOR_AFTER = 12
#: Stages per kind of the first plan up to which the floored DPs come early (gpt2-xl on 3 x 32: six stages,
#: 1% after 4.9 CPU s with them early, 11.6 s when only converged pairs get them; at M=64, ten stages, cut off at
#: the M=32 incumbent 363.69 ms: 343.2 ms after 12.5 CPU s with 3, 349.8 ms against its own 350.6 ms plan after
#: 9.5 s with 4).
FEW_STAGES = 4


class _Paths:
    """Shortest paths over (position, memory class) for per-candidate weights; no device state.

    Class ``j < J``: exactly ``j`` stages follow; class ``J``: at least ``J`` follow, and a candidate is
    admitted there if ``jmax >= J`` (optimistic when ``J`` is below the exact class count, so still a
    relaxation). Candidates are grouped by start once; each call is ``n`` numpy steps over
    ``(candidates starting here) x (J + 1)`` arrays.
    """

    def __init__(self, n: int, tab: CandidateTable, big_j: int, max_classes: int = LAGRANGE_CLASSES) -> None:
        self.n, self.tab = n, tab
        self.J = min(exact_classes(tab, big_j), max_classes)
        self.order = np.argsort(tab.a, kind="stable")
        cuts = np.searchsorted(tab.a[self.order], np.arange(n + 2))
        self.cuts = cuts
        self.here = [self.order[cuts[k]:cuts[k + 1]] for k in range(n + 1)]
        self.ends = [tab.b[h] for h in self.here]
        jr = np.arange(self.J + 1)
        # 0 where a candidate is admitted at a class, inf where not: added to the weights (no -inf weights)
        self.blocked = [np.where(tab.jmax[h][:, None] >= jr[None, :], 0.0, np.inf) for h in self.here]

    def run(self, w: np.ndarray) -> tuple[float, list[int]] | None:
        """Least ``sum w`` over tilings (``w = inf`` excludes a candidate) and its candidate indices.

        Only values are kept on the way back from the end (a min per position, no argmin); the path is
        recovered forwards afterwards, one argmin per stage (~2x faster than keeping every choice).
        """
        n, J = self.n, self.J
        inf = np.inf
        nx = np.full((n + 1, J + 1), inf)  # value of what follows a stage ending at b, per class of that stage
        nx[n, 0] = 0.0
        val = np.full((n + 1, J + 1), inf)
        ws = w[self.order]
        cuts, ends, blocked = self.cuts, self.ends, self.blocked
        for k in range(n - 1, -1, -1):
            if cuts[k + 1] > cuts[k]:
                val[k] = (ws[cuts[k]:cuts[k + 1], None] + nx[ends[k]] + blocked[k]).min(0)
            if k == 0:
                break
            if J == 0:
                nx[k, 0] = val[k, 0]
            else:
                nx[k, 1:J] = val[k, 0:J - 1]
                nx[k, J] = min(val[k, J], val[k, J - 1])
        j = int(val[0].argmin())
        if not np.isfinite(val[0, j]):
            return None
        total, out, k = float(val[0, j]), [], 0
        while True:
            i = int((ws[cuts[k]:cuts[k + 1]] + nx[ends[k], j] + blocked[k][:, j]).argmin())
            c = int(self.here[k][i])
            out.append(c)
            k = int(ends[k][i])
            if k == n:
                return total, out
            if J > 0:
                j = j - 1 if j < J or val[k, J - 1] <= val[k, J] else J


def path_min(n: int, tab: CandidateTable, w: np.ndarray, big_j: int,
             max_classes: int = LAGRANGE_CLASSES) -> tuple[float, list[int]] | None:
    """Least ``sum w`` over tilings of ``[0, n)`` by ``tab``, ignoring device counts (see :class:`_Paths`)."""
    return _Paths(n, tab, big_j, max_classes).run(w)


def lagrangian_bounds(chain: Chain, cluster: Cluster, setting: Setting, tab: CandidateTable, *,
                      start: list[Candidate] | None = None, deadline: float = math.inf,
                      target_gap: float = 1e-6, iterations: int = 12,
                      progress: Callable[[float, float, list[Candidate] | None], None] | None = None
                      ) -> tuple[Bounds, np.ndarray]:
    """Lower and upper bounds on ``(M - 1) T + S + R`` without the device-count state (module docstring).

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        tab: the candidate stages.
        start: a known plan (the first incumbent).
        deadline: ``time.perf_counter()`` value at which to stop (the bounds found so far stay valid).
        target_gap: stop once ``(upper - lower) / upper`` is at most this.
        iterations: shortest paths (dual steps) per threshold box when it is first bounded.
        progress: called ``(lower, upper, plan)`` whenever either bound improves.

    Returns:
        The bounds with the best plan found (``evaluations`` counts shortest-path runs), and the last
        box's prices (for :func:`reduced_cost_prune`).
    """
    return LagrangianRun(chain, cluster, setting, tab, start=start, target_gap=target_gap, iterations=iterations,
                         progress=progress).advance(deadline)


class LagrangianRun:
    """:func:`lagrangian_bounds`, resumable: each :meth:`advance` goes on where the last one stopped.

    ``cutoff`` gives the least objective known elsewhere (the best plan at another microbatch count, which
    may improve between calls): a box whose bound reaches it is not split further, since no plan in it can
    beat that plan. ``lower`` is then a lower bound on this count's optimum or at least the cutoff (either
    way, a bound on what this count could add), which is what the search over microbatch counts
    (:mod:`.msearch`) needs to drop a count. ``prices``: the first box's starting prices (another count's,
    for instance; any start is valid, a good one only saves steps). ``done``: the branch and bound has nothing
    left to do. ``repair``: called ``(path, proxy, excess)`` once per distinct shortest path that breaks some
    kind's device count (``excess`` per kind) with a proxy objective below what a box must beat: near the dual's
    optimum such paths are a few stages from a plan (:meth:`~.polish.Polisher.repair`); the caller decides
    whether to spend the time, and reports a plan it finds through its own incumbent (which ``cutoff`` sees).
    """

    def __init__(self, chain: Chain, cluster: Cluster, setting: Setting, tab: CandidateTable, *,
                 start: list[Candidate] | None = None, target_gap: float = 1e-6, iterations: int = 12,
                 progress: Callable[[float, float, list[Candidate] | None], None] | None = None,
                 cutoff: Callable[[], float] | None = None, prices: np.ndarray | None = None,
                 repair: Callable[[list[int], float, np.ndarray], None] | None = None) -> None:
        self.deadline = math.inf
        self.done = False
        self.result: tuple[Bounds, np.ndarray] | None = None
        self._steps = _lagrangian(self, chain, cluster, setting, tab, start, target_gap, iterations,
                                  progress or (lambda *_: None), cutoff or (lambda: math.inf), prices, repair)

    def advance(self, deadline: float = math.inf) -> tuple[Bounds, np.ndarray]:
        """Go on until ``deadline`` (a ``time.perf_counter()`` value; at least one step is taken) or the end;
        the bounds so far and the last box's prices."""
        self.deadline = deadline
        if not self.done:
            self.result = next(self._steps)
        assert self.result is not None
        return self.result


def _lagrangian(run: LagrangianRun, chain: Chain, cluster: Cluster, setting: Setting, tab: CandidateTable,
                start: list[Candidate] | None, target_gap: float, iterations: int,
                say: Callable[[float, float, list[Candidate] | None], None], cutoff: Callable[[], float],
                prices: np.ndarray | None = None,
                repair: Callable[[list[int], float, np.ndarray], None] | None = None
                ) -> Iterator[tuple[Bounds, np.ndarray]]:
    """The body of :class:`LagrangianRun`: yields its bounds each time ``run.deadline`` passes, and at the end
    (``run.done`` set)."""
    m, n = setting.microbatches, chain.n
    counts = kind_counts(cluster)
    cap = np.asarray([counts[k] for k in tab.kinds], dtype=np.float64)
    big_j = classes(setting, len(cluster.devices))
    paths = _Paths(n, tab, big_j)
    onehot = np.zeros((len(tab), len(tab.kinds)))
    onehot[np.arange(len(tab)), tab.kind] = tab.d
    base = tab.t + tab.comm
    evals = 0
    best = start
    upper = objective(start, m) if start else math.inf
    lam = np.zeros(len(tab.kinds)) if prices is None else np.maximum(0.0, np.asarray(prices, dtype=np.float64))

    def limit() -> float:
        """What a box must beat to be split: this count's best plan, or a better one elsewhere."""
        return min(upper, cutoff())

    def consider(idx: list[int]) -> None:
        nonlocal best, upper
        plan = [tab.candidate(i) for i in idx]
        if feasible(plan, counts, big_j) and objective(plan, m) < upper:
            best, upper = plan, objective(plan, m)
            say(lower_now, upper, best)

    offered: set[bytes] = set()

    def offer(idx: np.ndarray, used: np.ndarray) -> None:
        """A path over some kind's count whose proxy is below what a box must beat, to ``repair`` (once)."""
        if repair is None:
            return
        value = (m - 1) * float(tab.t[idx].max()) + float(base[idx].sum()) + float(tab.tail[idx].max())
        if value >= limit() * (1 - 1e-9):
            return
        key = idx.tobytes()
        if key in offered:
            return
        offered.add(key)
        repair([int(i) for i in idx], value, np.maximum(used - cap, 0.0))

    planes = Planes(len(tab.kinds))  # every path's plane, shared by the pairs whose thresholds admit the path

    class _Dual:
        """One threshold pair's Lagrangian dual, maximised a few paths at a time (resumable): its thresholds
        ``u`` (stage time) and ``v`` (tail), best value and prices, the prices to evaluate next (``cur``), the
        box-step radius and the model's last prediction (:mod:`.bundle`)."""

        __slots__ = ("w0", "u", "v", "value", "lam", "cur", "radius", "pred", "edge", "done", "steps", "floored")

        def __init__(self, sel: np.ndarray, u: float, v: float) -> None:
            self.w0 = np.where(sel, base, np.inf)
            self.u, self.v = u, v
            self.value, self.lam, self.cur, self.done, self.steps = -math.inf, lam.copy(), lam.copy(), False, 0
            self.radius, self.pred, self.edge = math.inf, math.inf, False
            self.floored = False

    def dual(st: _Dual, slack: float, steps: int) -> float:
        """``steps`` more shortest paths on ``st``; its best dual value so far (a lower bound on the least
        ``sum(t + comm)`` among tilings by its candidates).

        The prices come from the box-step method (:mod:`.bundle`): each path adds its plane to the shared
        model, and the next prices maximise the model within ``radius`` of the best prices (doubled when a
        step that reached the box's edge gained at least half what the model predicted, halved when it
        gained less than a tenth: a null step). ``done`` once a path respects the limits at zero
        complementary slack (optimal), the value reaches ``slack``, the model's maximum near the best
        prices is within :data:`DUAL_TOL` of their value (a local maximum of a concave model is its
        global one, and the model is above the dual: the best prices are optimal), or after
        :data:`DUAL_STEPS` paths in all.
        """
        nonlocal lam, evals
        for _ in range(steps):
            if st.steps >= DUAL_STEPS:
                st.done = True  # enough: its bound stands as it is
                break
            evals += 1
            st.steps += 1
            cur = st.cur
            got = paths.run(st.w0 + onehot @ cur)
            if got is None:
                st.value, st.done = math.inf, True
                return math.inf
            idx = np.asarray(got[1])
            used = onehot[idx].sum(0)
            g = used - cap
            h = got[0] - float(cur @ cap)
            planes.add(got[0] - float(cur @ used), g, float(tab.t[idx].max()), float(tab.tail[idx].max()))
            was, moved = st.value, bool(np.any(cur != st.lam))
            if h > st.value + 1e-9 * max(1.0, abs(h)):
                st.value, st.lam = h, cur.copy()
            if np.all(used <= cap):
                consider(got[1])
                if float(cur @ (cap - used)) <= 1e-12 * max(abs(got[0]), 1.0):
                    st.done = True  # complementary slackness: this path is optimal for the box
                    break
            else:
                offer(idx, used)
            if st.value >= slack:
                st.done = True
                break
            if not math.isfinite(st.radius):  # the first path: a price that makes its excess cost its value
                st.radius = max(float(cur.max()), max(abs(h), 1.0) / max(float(np.abs(g).max()), 1.0))
            elif moved and math.isfinite(was) and math.isfinite(st.pred) and st.pred > was:
                gain = (h - was) / (st.pred - was)
                if gain >= 0.5 and st.edge:
                    st.radius *= 2.0
                elif gain < 0.1:
                    st.radius = max(st.radius / 2.0, 1e-9 * max(1.0, float(st.lam.max())))
            c, gs = planes.valid(st.u, st.v, st.lam)
            st.cur, st.pred = box_argmax(c, gs, st.lam, st.radius)
            st.edge = float(np.abs(st.cur - st.lam).max()) >= 0.999 * st.radius
            if st.pred <= st.value + DUAL_TOL * max(abs(st.value), 1.0):
                st.done = True  # the model has nothing better near the best prices: they are optimal
                break
            if time.perf_counter() > run.deadline:
                break
        lam = st.lam
        return st.value

    floor_after = FLOOR_AFTER if start is not None and len(start) <= FEW_STAGES * len(tab.kinds) else DUAL_STEPS
    floors = [f for g in floor_variants(counts, tab.kinds) if (f := _Floored(n, tab, counts, big_j, paths.J, g)).useful]

    def floor(st: _Dual, slack: float) -> None:
        """Raise ``st``'s bound by the floored-units DPs (:class:`_Floored`), each at its best prices with the
        kinds in its state at zero, and at zero prices; the pair is then settled."""
        nonlocal evals
        st.floored = st.done = True
        if not floors:
            return
        sel = np.isfinite(st.w0)
        if math.isfinite(slack):  # only candidates on a path that may beat the incumbent, at the pair's prices
            sel &= through(n, tab, st.w0 + onehot @ st.lam) - float(st.lam @ cap) <= slack + 1e-9 * max(1.0, slack)
        work = int(sel.sum())
        for f in floors:
            if work * f.vectors > FLOOR_WORK or st.value >= slack:
                continue
            options = [np.where(f.kept, 0.0, st.lam)]
            if not np.all(f.kept) and np.any(st.lam > 0):
                options.append(np.zeros_like(st.lam))
            for prices in options:
                evals += 1
                got = f.run(sel, st.w0 + onehot @ prices)
                if got is None:
                    st.value = math.inf
                    return
                st.value = max(st.value, got[0] - float(prices @ cap))
                consider(got[1])

    lower_now = 0.0
    us, vs = np.unique(tab.t), np.unique(tab.tail)
    if us.size == 0:
        run.done = True
        yield Bounds(math.inf, math.inf, math.inf, math.inf, math.inf, None, evals, True), lam
        return
    t_min = float(us[0])
    if m == 1:  # (M - 1) T is 0: every bottleneck threshold bounds alike, so only the largest is kept (as in .bounds);
        us = us[-1:]  # else thousands of pairs of one bound each, all to be settled before the least open box rises
    duals: dict[tuple[int, int], _Dual] = {}

    def s_at(i: int, k: int, slack: float, more: int = 0) -> float:
        """The dual of pair ``(i, k)``: ``iterations`` steps when first asked, then ``more`` per call."""
        st = duals.get((i, k))
        if st is None:
            st = duals[(i, k)] = _Dual((tab.t <= us[i]) & (tab.tail <= vs[k]), float(us[i]), float(vs[k]))
            return dual(st, slack, iterations)
        if more and not st.done:
            dual(st, slack, more)
        return st.value

    s_all = s_at(len(us) - 1, len(vs) - 1, limit() - (m - 1) * us[0] - vs[0])
    if not math.isfinite(s_all):
        run.done = True
        yield Bounds(t_min, math.inf, float(vs[0]), math.inf, upper, best, evals, True), lam
        return
    lower_now = (m - 1) * us[0] + vs[0] + s_all
    say(lower_now, upper, best)
    heap = [(lower_now, 0, len(us) - 1, 0, len(vs) - 1)]
    settled = math.inf  # the least bound of the threshold pairs whose duals are done

    def bounds() -> tuple[Bounds, np.ndarray]:
        open_low = min((h[0] for h in heap), default=math.inf)
        complete = bool(open_low >= limit() * (1 - 1e-9))
        lower = float(max(lower_now, min(limit(), settled, open_low)))
        return Bounds(t_min, s_all, float(vs[0]), lower, upper, best, evals, complete), lam

    while heap and heap[0][0] < limit() * (1 - target_gap):
        if time.perf_counter() > run.deadline:
            yield bounds()  # paused: resumed by the next advance()
            continue
        was, i, j, k, l = heapq.heappop(heap)  # its bound so far holds for every part of it
        if i == j and k == l:  # one threshold pair: more dual steps, unless its dual is done
            base_ik = (m - 1) * us[i] + vs[k]
            got = base_ik + s_at(i, k, limit() - base_ik, 2 * iterations)
            st = duals[(i, k)]
            if (st.done or st.steps >= floor_after) and not st.floored and got < limit() * (1 - target_gap):
                floor(st, limit() - base_ik)  # the prices alone stall here: keep the devices in the state, in floored units
                got = base_ik + st.value
            if st.done:
                settled = min(settled, max(got, was))
            else:
                heapq.heappush(heap, (max(got, was), i, i, k, k))
        else:
            if j - i <= 1 and l - k <= 1:  # the (up to four) threshold pairs of the box
                halves = [(a, a, c, c) for a in {i, j} for c in {k, l}]
            elif j - i >= l - k:
                mid = (i + j) // 2
                halves = [(i, mid, k, l), (mid, j, k, l)]
            else:
                mid = (k + l) // 2
                halves = [(i, j, k, mid), (i, j, mid, l)]
            for a, b, c, d in halves:
                base_ac = (m - 1) * us[a] + vs[c]
                got = base_ac + s_at(b, d, limit() - base_ac)
                if a == b and c == d and duals[(b, d)].done and not duals[(b, d)].floored \
                        and got < limit() * (1 - target_gap):
                    floor(duals[(b, d)], limit() - base_ac)
                    got = base_ac + duals[(b, d)].value
                if a == b and c == d and duals[(b, d)].done:
                    settled = min(settled, max(got, was))
                else:
                    heapq.heappush(heap, (max(got, was), a, b, c, d))
        now = min(min((h[0] for h in heap), default=math.inf), settled, limit())
        if now > lower_now:
            lower_now = now
            say(lower_now, upper, best)
    run.done = True
    yield bounds()


def reduced_cost_prune(chain: Chain, cluster: Cluster, setting: Setting, tab: CandidateTable, upper: float,
                       lam: np.ndarray | None = None) -> np.ndarray:
    """Mask of the candidates that may be in a plan with objective below ``upper``.

    For prices ``lam`` (default 0) a plan holding candidate ``c`` costs at least ``(M - 1) t_c + r_min +
    pre(a_c) + w_c + suf(b_c) - lam . count``, with ``w = t + comm + lam_kind d`` and ``pre``/``suf`` the
    least ``sum w`` of tilings of ``[0, a)`` and ``[b, n)`` (memory classes and device counts relaxed).
    """
    m, n = setting.microbatches, chain.n
    counts = kind_counts(cluster)
    cap = np.asarray([counts[k] for k in tab.kinds], dtype=np.float64)
    lam = np.zeros(len(tab.kinds)) if lam is None else lam
    w = tab.t + tab.comm + lam[tab.kind] * tab.d
    r_min = float(tab.tail.min()) if len(tab) else 0.0
    bound = (m - 1) * tab.t + r_min + through(n, tab, w) - float(lam @ cap)
    return bound <= upper * (1 + 1e-9)


def through(n: int, tab: CandidateTable, w: np.ndarray) -> np.ndarray:
    """Per candidate, the least ``sum w`` of a tiling of ``[0, n)`` that holds it (``inf`` where none does):
    ``pre(a) + w + suf(b)``, with ``pre`` and ``suf`` the least ``sum w`` of tilings of ``[0, a)`` and ``[b, n)``
    (memory classes and device counts relaxed)."""
    suf = suffix_sums(n, tab, w)
    pre = np.full(n + 1, np.inf)
    pre[0] = 0.0
    by_b = np.argsort(tab.b, kind="stable")
    cut_b = np.searchsorted(tab.b[by_b], np.arange(n + 2))
    for k in range(1, n + 1):
        h = by_b[cut_b[k]:cut_b[k + 1]]
        if h.size:
            pre[k] = float(np.min(pre[tab.a[h]] + w[h]))
    return pre[tab.a] + w + suf[tab.b]
