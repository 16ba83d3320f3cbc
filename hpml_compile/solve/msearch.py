"""The many-kind path's anytime solve over every microbatch count, each bounded: a gap that covers ``M`` too.

The microbatch search of :func:`hpml_compile.solve.solve` finds a first plan per count ``M`` with the
restricted DPs of :mod:`.lagrange` and used to keep the count whose first plan had the least proxy
objective, then bound that count alone. The first plans are upper bounds of uneven quality, so that
ranking is not a proof and can be wrong: llama-70b on 3 x 256 (batch 512) has first plans of 77,408 ms at
M=32 and 78,515 ms at M=16, but 2 CPU s of Lagrangian bounds at each find a 71,293 ms plan at M=16
(0.8% from its bound) and none below 77,408 at M=32 (bound 67,142: 13%). The restricted DPs lose 10% at
M=16 and possibly nothing at M=32; only a bound per count tells.

Here every count is a node of one best-first branch and bound:

- each count gets its candidate table (only stages with ``M t`` below the incumbent: :func:`~.table.build_table`'s
  ``max_time``) and a resumable Lagrangian bound (:class:`~.lagrange.LagrangianRun`) whose cutoff is the
  best plan at *any* count, so a count is closed as soon as its bound reaches that plan;
- the count with the least bound is advanced a slice at a time (and, when first advanced, tries the
  blocked DP's other kind orders for a better plan, as the single-count path did); plans found at any count
  improve the one incumbent;
- the certified gap is the incumbent's proxy against the least bound over all counts (a count whose
  bound passed the incumbent no longer limits it), so ``optimal`` means optimal over every microbatch count
  searched, on the proxy ``(M - 1) T + S + R``;
- with time left, HiGHS gets the count that still limits the bound, on the candidates its prices and the
  incumbent have not ruled out (at most :data:`~.MILP_CANDIDATES`), as before.

Bounding a count costs its table (0.05-0.35 CPU s on 3 x 256) and a few shortest paths for its root bound;
counts whose root bound is already above the incumbent cost nothing more (at batch 512, M=1-4 on
llama-70b: their root bounds are 4-260 times the incumbent).

Example:
    >>> from hpml_compile.solve.candidates import Chain, Setting
    >>> from hpml_compile.testing import chain_graph, cluster_of
    >>> from hpml_compile.plan import Schedule
    >>> ch = Chain.of(chain_graph([{"a": (1.0, 1.0), "b": (3.0, 3.0)}] * 4, batch_size=64))
    >>> from hpml_compile.solve.dp import solve_chain
    >>> c, sets = cluster_of(["a", "b"]), [Setting(m, Schedule.ONE_F_ONE_B, 64) for m in (1, 2, 4, 8)]
    >>> firsts = {s.microbatches: solve_chain(ch, c, s, build_table(ch, c, s)) for s in sets}
    >>> out = anytime(ch, c, sets, firsts, 5.0, lambda _: None, time.perf_counter())
    >>> out.setting.microbatches, out.status.value, out.gap
    (8, 'optimal', 0.0)
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from typing import Callable

import numpy as np

from ..ir import Cluster
from ..plan import SolverStatus
from .bounds import exact_classes
from .candidates import Candidate, Chain, Setting, classes, kind_counts
from .dp import objective
from .ilp import milp, prune
from .lagrange import LagrangianRun, ordered_chain, ordered_units, reduced_cost_prune, speed_order
from .polish import POLISH_S, Polisher, polish
from .restricted import feasible, proxy_sweep
from .table import CandidateTable, build_table

__all__ = ["MILP_CANDIDATES", "BOUNDS_SHARE", "ORDERS_SHARE", "REPAIR_SHARE", "REPAIR_EXCESS", "REPAIR_GAP", "Outcome",
           "anytime", "AnytimeSearch", "relative_gap"]

#: Most candidates handed to HiGHS after pruning (beyond, the Lagrangian bounds alone decide; memory).
MILP_CANDIDATES = 15000
#: Share of the time left after the search that the Lagrangian bounds may take (then HiGHS, if it may help).
BOUNDS_SHARE = 0.85
#: Share of the time that the blocked DP may take in the other kind orders at the incumbent's count (half of it at
#: each count that comes to hold the incumbent), for a better plan.
ORDERS_SHARE = 0.2
#: Share of the wall time (since the anytime search began) that repairing the Lagrangian paths over a device count
#: into plans may take (:meth:`AnytimeSearch.repair_some`; at least :data:`~.polish.POLISH_S` in all).
REPAIR_SHARE = 0.15
#: Paths over the device counts by more than this share of the cluster's devices are not repaired (the paths at
#: zero prices put every stage on the fastest kind: thousands of devices over, far from any plan).
REPAIR_EXCESS = 0.25
#: Only the paths of counts whose bound is within this share of the incumbent are repaired (the others stay pooled):
#: far from the bound's optimum the prices, and so the paths, are far from a plan, and the time is the bound's.
#: llama-70b on 3 x 256 has its bound at 21,815 ms against a 70,456 ms incumbent until 5-7 s into its 10 s solve,
#: then at the optimum; repairs before that cost it its 1% in one run, and with 10% (and a share of 25%) it reached
#: 1% at ~7.0 s in three runs against 5.0-6.3 s before.
REPAIR_GAP = 0.05
#: Paths kept for repair (the fewest devices over).
REPAIR_POOL = 2048
#: Wall seconds a count is advanced before the next count is chosen.
SLICE_S = 0.2
#: A slice that raises a count's bound by less than this share of the incumbent stalls the count: the next slices
#: go to the other open counts (least bound first) until every open count has stalled. Best first by the bound
#: alone spent a 60 s solve of llama-70b on 3 x 256 on M=32 (its bound crept from 68,646 to 68,888 ms) while
#: M=16, whose shortest paths find a 71,293 ms plan within 2 CPU s, was never advanced again.
STALL = 1e-3


def relative_gap(lower: float, upper: float) -> float:
    """Relative gap of ``upper`` over ``lower`` (0 when they meet, 1 when nothing is known).

    >>> relative_gap(99.0, 100.0), relative_gap(0.0, math.inf)
    (0.01, 1.0)
    """
    if not math.isfinite(upper) or upper <= 0:
        return 0.0 if upper == lower else 1.0
    return min(1.0, max(0.0, (upper - lower) / upper)) if math.isfinite(lower) else 0.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The best plan over the counts, and what is proved about it.

    Attributes:
        picked: the incumbent's candidates in pipeline order.
        setting: its count (and the rest of the setting).
        upper: its proxy objective.
        lower: a lower bound on the proxy objective of every plan at every count searched.
        status: optimal (the bounds met) or feasible.
        variables: binaries of the MILP (0 when none was built).
    """

    picked: list[Candidate]
    setting: Setting
    upper: float
    lower: float
    status: SolverStatus
    variables: int = 0

    @property
    def gap(self) -> float:
        """The certified gap of the incumbent (0 when optimal)."""
        return 0.0 if self.status is SolverStatus.OPTIMAL else relative_gap(self.lower, self.upper)


@dataclasses.dataclass
class _Count:
    """One microbatch count's node: its best plan, its bound, and its resumable Lagrangian run."""

    setting: Setting
    plan: list[Candidate] | None
    upper: float
    lower: float = 0.0
    tab: CandidateTable | None = None
    run: LagrangianRun | None = None
    prices: np.ndarray | None = None
    orders: bool = False
    t_min: float = 0.0
    stalled: bool = False
    flat: bool = False
    polisher: Polisher | None = None

    @property
    def m(self) -> int:
        return self.setting.microbatches


def other_orders(chain: Chain, cluster: Cluster, setting: Setting, tab: CandidateTable, upper: float,
                 report: Callable[[list[Candidate]], None], until: float) -> None:
    """Better plans from the blocked DP in the other kind orders (the first plan tried the fastest first).

    Where memory binds, the kind with the least memory wants the end of the pipeline (fewest microbatches in
    flight) whatever its speed: llama-70b on 3 x 32 at 64 microbatches, H100, V100, A100 is 3.4% better than
    fastest first. Each order is swept over bottlenecks (:func:`~.restricted.proxy_sweep`: three to five DPs of
    ``sum_k`` states, ~0.4 CPU s on llama-70b 3 x 128, where A100 first gives 113,726 ms at M=64 against 116,720
    fastest first, and 126,317 with its min-bottleneck tiling alone); they are tried until ``until``.
    """
    m, first = setting.microbatches, speed_order(chain, tab.kinds)
    unit = ordered_units(cluster, setting)
    for order in itertools.permutations(first):
        if order == first:
            continue
        if time.perf_counter() >= until:
            break
        got = proxy_sweep(lambda t, b, o=order: ordered_chain(chain, cluster, setting, t, o, unit=unit, bottleneck=b),
                          tab, m)
        if got and objective(got, m) < upper:
            upper = objective(got, m)
            report(got)


def anytime(chain: Chain, cluster: Cluster, settings: list[Setting], firsts: dict[int, list[Candidate]],
            time_limit_s: float, say: Callable[[str], None], t0: float) -> Outcome:
    """The best plan over ``settings``' microbatch counts, with a gap certified over all of them.

    Every improvement of the incumbent or of the bound is logged as ``anytime: <s> s: incumbent <u> ms,
    bound <l> ms, gap <g>% (M=<m>)``; the time limit (counted from ``t0``, the solve's start) or Ctrl-C stops
    it with the best plan so far and its certified gap. The search is :class:`AnytimeSearch`.

    Args:
        chain: the chain.
        cluster: the cluster.
        settings: one per microbatch count searched (the rest of the setting alike).
        firsts: the first plan found at a count, by count (the restricted DPs' plans of the search).
        time_limit_s: seconds from ``t0``.
        say: where the log lines go.
        t0: ``time.perf_counter()`` at the solve's start.

    Returns:
        The incumbent and its bound.

    Raises:
        ValueError: if no count has a first plan (the caller reports infeasibility before).
    """
    return AnytimeSearch(chain, cluster, settings, firsts, time_limit_s, say, t0).run()


class AnytimeSearch:
    """Best-first branch and bound over every microbatch count (see the module docstring), as named steps.

    :meth:`run` takes each count's :meth:`root` (its table and root bound, the first plan polished), then
    advances the count with the least bound a slice at a time (:meth:`step`, :meth:`pick`), repairs pooled
    paths into plans (:meth:`repair_some`), and hands what is left to HiGHS (:meth:`finish`). Every plan found
    goes through :meth:`found` (polished, the incumbent kept, its tiling moved to the other counts).

    Args: as :func:`anytime`'s.

    Raises:
        ValueError: if no count has a first plan.
    """

    def __init__(self, chain: Chain, cluster: Cluster, settings: list[Setting], firsts: dict[int, list[Candidate]],
                 time_limit_s: float, say: Callable[[str], None], t0: float) -> None:
        self.chain, self.cluster, self.say, self.t0 = chain, cluster, say, t0
        self.start = time.perf_counter()
        self.deadline = max(t0 + time_limit_s, self.start + 0.5)
        self.nodes = [_Count(s, firsts.get(s.microbatches), objective(firsts[s.microbatches], s.microbatches)
                             if firsts.get(s.microbatches) else math.inf) for s in settings]
        if not any(c.plan for c in self.nodes):
            raise ValueError("anytime needs a first plan at some microbatch count")
        self.node = min((c for c in self.nodes if c.plan), key=lambda c: (c.upper, c.m))  # the incumbent's count
        self.best: list[Candidate] = self.node.plan  # type: ignore[assignment]
        self.shown = (-1.0, math.inf)  # the (lower, upper) last logged
        self.variables = 0
        self.counts = kind_counts(cluster)
        self.repair_s = 0.0  # wall seconds spent repairing paths
        self.total = float(sum(self.counts.values()))
        self.pools: dict[int, list[tuple[float, float, int, list[int]]]] = {}  # by count's index
        self.turn = False

    # --- the incumbent and the bound ---------------------------------------------------------------------------
    def upper(self) -> float:
        """The incumbent's objective."""
        return self.node.upper

    def lower(self) -> float:
        """The bound over every count."""
        return min(min(c.lower, self.node.upper) for c in self.nodes)

    def log(self) -> None:
        """Say the incumbent, the bound and the gap when either moved."""
        lo, up = self.lower(), self.upper()
        if (lo, up) != self.shown:
            self.shown = (lo, up)
            weakest = min(self.nodes, key=lambda c: (c.lower, c.m))
            self.say(f"anytime: {time.perf_counter() - self.t0:.3f} s: incumbent {up:.7g} ms, bound {lo:.7g} ms, "
                     f"gap {relative_gap(lo, up):.3%} (incumbent at M={self.node.m}, bound at M={weakest.m})")

    def outcome(self, status: SolverStatus | None = None) -> Outcome:
        """The incumbent, its bound and status."""
        lo = self.lower()
        if status is None:
            status = SolverStatus.OPTIMAL if relative_gap(lo, self.upper()) <= 1e-6 else SolverStatus.FEASIBLE
        return Outcome(list(self.best), self.node.setting, self.upper(), lo, status, self.variables)

    # --- plans found -------------------------------------------------------------------------------------------
    def polished(self, c: _Count, plan: list[Candidate], same: bool = True) -> list[Candidate]:
        """``plan`` after the local search of :func:`~.polish.polish` in the count's table (e.g. gpt2-xl
        on 3 x 256 at M=8, the first plan's 318.8 ms becomes 286.7 in 0.2 CPU s, where 10 s of bounds had found
        289.0), within :data:`~.polish.POLISH_S` and the deadline."""
        if c.tab is None or len(c.tab) == 0:
            return plan
        if c.polisher is None:
            c.polisher = Polisher(c.tab, self.counts, classes(c.setting, len(self.cluster.devices)), c.m)
        return polish(c.tab, plan, self.counts, c.polisher.big_j, c.m, polisher=c.polisher, same=same,
                      until=min(self.deadline, time.perf_counter() + POLISH_S))

    def found(self, c: _Count, plan: list[Candidate], spread: bool = True) -> None:
        """A plan at count ``c``: polished, kept if better, and (``spread``) moved to the other counts."""
        plan = self.polished(c, plan)
        value = objective(plan, c.m)
        better = value < self.node.upper
        if value < c.upper:
            c.upper, c.plan = value, plan
        if better:
            self.node, self.best = c, plan
            if spread:
                self.moved_on(c)
        self.log()

    def moved_on(self, c: _Count) -> None:
        """A new incumbent's tiling moved to every other open count with a table and polished there ("change
        ``M``", as each count's root does with the incumbent of its time): gpt2-xl on 3 x 256 found 281.19 ms at
        M=8 only 8 s into a 10 s solve, from M=8's own paths, while M=4 held 283.36 from 6.4 s."""
        for x in self.nodes:
            if x is c or x.tab is None or len(x.tab) == 0 or x.lower >= self.upper() * (1 - 1e-6):
                continue
            moved = self.polished(x, self.best, same=False)
            if moved is not self.best and feasible(moved, self.counts, x.polisher.big_j if x.polisher else 0) \
                    and objective(moved, x.m) < x.upper:
                self.found(x, moved, spread=False)

    # --- repairing paths over a device count ---------------------------------------------------------------------
    def repairer(self, c: _Count) -> Callable[[list[int], float, np.ndarray], None]:
        """Collect the count's shortest paths that break a device count by at most :data:`REPAIR_EXCESS` of the
        devices, for :meth:`repair_some`."""
        at = self.nodes.index(c)

        def rep(idx: list[int], value: float, excess: np.ndarray) -> None:
            over = float(excess.sum())
            if over <= REPAIR_EXCESS * self.total:
                pool = self.pools.setdefault(at, [])
                heapq.heappush(pool, (over, value, len(pool), idx))
                if len(pool) > 2 * REPAIR_POOL:  # keep the fewest devices over
                    pool[:] = heapq.nsmallest(REPAIR_POOL, pool)
        return rep

    def repair_some(self, until: float) -> None:
        """Repair pooled paths into plans (:meth:`~.polish.Polisher.repair`, then :meth:`found`, which polishes
        them), within :data:`REPAIR_SHARE` of the time since the search began, at counts whose bound is within
        :data:`REPAIR_GAP` of the incumbent and has stopped rising (its last slice raised it by less than
        :data:`STALL`, or its branch and bound is done: the prices have done what they can, and a plan at the
        bound must come from elsewhere; llama-70b's rows, whose bounds rise to their plans, lost 0.5-3 s to
        repairs before), fewest devices over first, taking in turn the open count with the least
        bound (where a plan at the bound closes the gap) and the path fewest over at any open count.

        gpt2-xl on 4 x 256 at M=8: the bound met 266.33 ms at 5.6 s of a 60 s solve, but the paths
        at the prices that hold it put some kind over its count (by 32 devices or more in those seen), and only
        paths within every count were plans, so the incumbent stayed at 270.70 ms (1.6%) to the end. Of 106 such
        paths (from 25 s of M=8's bound alone, cutoff 270.70 ms) at most 256 devices over, the four fewest over
        (32-80 devices) repair to 270.99, 267.56, 266.33 (the bound: optimal) and 267.56 ms; by proxy objective
        the first path that repairs below 267.6 ms was the 44th. A repair and its polish cost ~0.12 s there. The
        paths of M=4 are fewer devices over than M=8's and repair to 268.58 ms (1% early): one pool, fewest over
        first, reached 1% at 5.0-6.7 s but 266.33 at 6.3-19 s in three runs and not within 60 s in two; the
        bound's count alone found 266.33 but reached 1% only at 17-35 s (three runs, load 1.1-3.2)."""
        nodes, pools = self.nodes, self.pools
        while time.perf_counter() < until:
            now = time.perf_counter()
            if self.repair_s > max(REPAIR_SHARE * (now - self.start), POLISH_S):  # a few repairs even when short
                return
            for at in [at for at, pool in pools.items() if not pool or nodes[at].lower >= self.upper() * (1 - 1e-6)]:
                del pools[at]  # a closed count's paths cannot beat the incumbent
            near = [at for at in pools if nodes[at].lower >= self.upper() * (1 - REPAIR_GAP)
                    and (nodes[at].flat or (nodes[at].run is not None and nodes[at].run.done))]
            if not near:
                return
            self.turn ^= True  # in turn: the count that holds the bound, and the path fewest over at any open count
            at = min(near, key=lambda i: (nodes[i].lower, nodes[i].m) if self.turn else (pools[i][0][0], nodes[i].m))
            _, value, _, idx = heapq.heappop(pools[at])
            c = nodes[at]
            if value >= min(c.upper, self.upper()) * (1 - 1e-9) or c.tab is None:
                continue
            if c.polisher is None:
                c.polisher = Polisher(c.tab, self.counts, classes(c.setting, len(self.cluster.devices)), c.m)
            try:
                got = c.polisher.repair(idx, until=min(self.deadline, now + POLISH_S))
                if got is not None:
                    plan = [c.tab.candidate(i) for i in got]
                    if feasible(plan, self.counts, c.polisher.big_j):
                        self.found(c, plan)
            finally:
                self.repair_s += time.perf_counter() - now

    # --- bounding the counts -----------------------------------------------------------------------------------
    def progress(self, c: _Count) -> Callable[[float, float, list[Candidate] | None], None]:
        """What count ``c``'s Lagrangian run reports each bound and plan to."""
        def got(lo: float, up: float, plan: list[Candidate] | None) -> None:
            c.lower = max(c.lower, lo)
            if plan is not None and up < c.upper:
                self.found(c, plan)
            self.log()
        return got

    def root(self, c: _Count) -> None:
        """The count's table (stages that could be in a plan below the incumbent) and its root bound."""
        c.tab = build_table(self.chain, self.cluster, c.setting, max_time=self.upper() * (1 + 1e-9))
        if len(c.tab) == 0:  # no stage fits below the incumbent: nothing here can beat it
            c.lower = math.inf
            return
        if c.plan is not None:  # the first plan, polished (its stages are in the table: none is above upper())
            better = self.polished(c, c.plan)
            if objective(better, c.m) < c.upper:
                self.found(c, better)
        if c is not self.node:  # the incumbent's tiling moved to this count, polished: a plan where the search
            moved = self.polished(c, self.best, same=False)  # found none (out of time), often better where it did
            if moved is not self.best and feasible(moved, self.counts, c.polisher.big_j if c.polisher else 0) \
                    and objective(moved, c.m) < c.upper:
                self.found(c, moved)
        c.run = LagrangianRun(self.chain, self.cluster, c.setting, c.tab, start=c.plan, progress=self.progress(c),
                              cutoff=self.upper, prices=self.node.prices,  # the incumbent count's: closer than zero
                              repair=self.repairer(c))
        b, c.prices = c.run.advance(time.perf_counter())  # the root box only
        c.lower, c.t_min = max(c.lower, b.lower), b.t_min
        if c.lower >= self.upper() * (1 - 1e-6) and c is not self.node:
            self.say(f"anytime: M={c.m} cannot beat the incumbent: its bound is {c.lower:.7g} ms")
        self.log()

    def step(self, c: _Count, until: float) -> None:
        """Advance the count's bound until ``until`` (its root first, if it has none yet)."""
        if c.run is None:
            self.root(c)
            return
        was = c.lower
        b, c.prices = c.run.advance(until)
        c.lower = max(c.lower, b.lower)
        c.stalled = c.flat = c.lower - was < STALL * self.upper()
        self.log()

    def open_nodes(self) -> list[_Count]:
        """The counts whose bound is below the incumbent and whose search is not done."""
        return [c for c in self.nodes
                if c.lower < self.upper() * (1 - 1e-6) and not (c.run is not None and c.run.done)]

    def pick(self) -> _Count | None:
        """The open count with the least bound, stalled ones last (all fresh again once all have stalled)."""
        live = self.open_nodes()
        if live and all(c.stalled for c in live):
            for c in live:
                c.stalled = False
        return min(live, key=lambda x: (x.stalled, x.lower, x.m), default=None)

    def other_orders_once(self, share: float) -> bool:
        """The blocked DP in the other kind orders at the incumbent's count, once per count that holds it, when
        the table's classes are exact (otherwise the order moves only boundary transfers: gpt2-xl on 3 x 256
        spent 2 of 10 CPU s, for none). True when it was considered this time (the bounding loop then picks
        again)."""
        node = self.node
        if node.orders or node.tab is None:
            return False
        node.orders = True
        if exact_classes(node.tab, classes(node.setting, len(self.cluster.devices))):
            other_orders(self.chain, self.cluster, node.setting, node.tab, node.upper,
                         lambda p, c=node: self.found(c, p),
                         time.perf_counter() + ORDERS_SHARE * (share - self.start) / 2)
        return True

    def bound(self, share: float) -> None:
        """Best first until ``share``: the count with the least bound is advanced, a slice at a time."""
        while time.perf_counter() < share and relative_gap(self.lower(), self.upper()) > 1e-6:
            c = self.pick()
            if c is None:
                break
            if c.run is None:
                self.root(c)
                continue
            assert c.tab is not None
            if self.other_orders_once(share):
                continue
            self.step(c, min(share, time.perf_counter() + SLICE_S))
            self.repair_some(share)
        self.repair_some(share)  # the bounds may have ended with paths still pooled (small tables: at the roots)

    def finish(self) -> Outcome:
        """HiGHS on the count that limits the bound, over the candidates that can still beat the incumbent (or,
        when they are too many or the time too short, bounding on until the deadline)."""
        c = min((x for x in self.nodes if x.tab is not None), key=lambda x: (x.lower, x.m))
        if c.plan is None or c.tab is None:
            return self.outcome()
        chain, cluster = self.chain, self.cluster
        small = c.tab.select(reduced_cost_prune(chain, cluster, c.setting, c.tab, self.upper(), c.prices))
        small = prune(chain, cluster, c.setting, small, self.upper(), c.t_min)
        left = self.deadline - time.perf_counter() - len(small) * 2e-4  # building the model: ~0.2 ms a candidate
        if len(small) > MILP_CANDIDATES or left < 1.0:
            self.say(f"anytime: M={c.m}: {len(small)} of {len(c.tab)} candidates left after pruning; "
                     + ("over the MILP's limit" if len(small) > MILP_CANDIDATES else f"{left:.2g} s left, too "
                        "little for the MILP") + "; bounding on")
            while time.perf_counter() < self.deadline - 0.05 and relative_gap(self.lower(), self.upper()) > 1e-6:
                x = self.pick()
                if x is None:
                    break
                self.step(x, min(self.deadline, time.perf_counter() + SLICE_S))
                self.repair_some(self.deadline - 0.05)
            return self.outcome()
        res = milp(chain, cluster, c.setting, small, c.plan, t_min=c.t_min, lower=c.lower, time_limit_s=left,
                   progress=self.say, full=len(c.tab), t0=self.start)
        self.variables = res.variables
        if res.picked:
            self.found(c, res.picked)
            # HiGHS's gap is against its own incumbent at this count (no worse than c.plan was)
            c.lower = max(c.lower, objective(res.picked, c.m) * (1 - (0.0 if res.status is SolverStatus.OPTIMAL
                                                                           else res.gap)))
        self.log()
        return self.outcome()

    def run(self) -> Outcome:
        """The search: every count's root, best-first bounding, then HiGHS; Ctrl-C returns the best so far."""
        try:
            self.log()
            # Each count's root, from the best first plan down; the rest in the loop if time runs out.
            for c in sorted(self.nodes, key=lambda c: (c.upper, -c.m)):
                if time.perf_counter() < self.deadline or c is self.node:
                    self.root(c)
            self.bound(self.start + BOUNDS_SHARE * (self.deadline - self.start))
            if relative_gap(self.lower(), self.upper()) <= 1e-6:
                return self.outcome()
            return self.finish()
        except KeyboardInterrupt:
            self.say("anytime: interrupted; returning the best plan so far with its certified gap")
            return self.outcome()
