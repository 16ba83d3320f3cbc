"""Pass 4, solve: a cost graph and a cluster to a placement Plan.

Solvers (:class:`SolverName`): ``ilp`` (default; :mod:`.ilp`, exact with a
reported gap), ``dp`` (:mod:`.dp`, exact min-bottleneck over the
topological order, for graphs too large for the ILP) and the baselines
``uniform``, ``params``, ``time`` (:mod:`.baselines`). Every plan is scored
by the one simulator (:mod:`hpml_compile.simulate`), and its predictions are
written into the plan.

The microbatch count, when not given, is searched over powers of two up to
``min(batch_size, 64)`` with the DP (each count: the candidate table in
numpy, :mod:`.table`, the vectorised DP, one simulation; ~0.1-0.2 s for
llama-70b on 64 devices); the ILP then solves at the best count. ``ilp``
returns the better, by simulated step time, of the ILP's plan and the DP's,
so it is never worse than ``dp``.

Clusters whose device-count vectors (``prod_k (count_k + 1)``) exceed
:data:`~.lagrange.EXACT_VECTORS` (several kinds, or one kind past ~128
devices) take the many-kind path of :mod:`.lagrange` instead of the exact DP
over count vectors, whose state grew to 17 million vectors for 3 kinds x 256:
the microbatch search runs two restricted exact DPs (device units; kinds in
blocks along the pipeline) and ranks the counts by the ILP's proxy objective,
the one the gap certifies, simulating only the chosen plan (its first plan is
logged with the time it took), then :func:`_anytime` bounds the chosen
count with a Lagrangian shortest path, streams every improvement as
``anytime: <s> s: incumbent <u> ms, bound <l> ms, gap <g>%`` and hands HiGHS
the candidates the bound has not ruled out if time is left. The time limit or Ctrl-C stops it
with the best plan so far and its certified gap (the plan's status is
``feasible`` with that gap, or ``optimal`` when the bounds meet). The
microbatch counts are tried from the most down (the likeliest to fit first),
and ties go to the fewest. A solve's memory is bounded by construction: the
coarse DP keeps at most 100 count vectors and the blocked DP at most 33 per
kind (``lagrange.ORDERED_STATES``) per position and memory class, the
Lagrangian paths none, and HiGHS gets at most ``MILP_CANDIDATES`` candidates
(benchmarks/solver_scaling/kinds.py measures the peak per solving process,
the profile included). :func:`plan_from_cuts` scores any other
partitioner's split (e.g. DeepSpeed's or torchgpipe's) the way the
baselines are scored.

Gradient compression is chosen only when the user allows one (``compress``):
every replicated ZeRO-0 candidate's sync is then priced as the cheaper of the
dense all-reduce and the compressed collectives plus the compression compute
(:func:`hpml_compile.stagecost.compressed_sync_ms`), so placement (how much
data parallelism pays) sees it, and :func:`choose_compression` names it on the
stages of the chosen plan where the simulator agrees it is faster. The
solver's math is otherwise unchanged: compression only lowers a candidate's
tail cost. Its effect on convergence is not in the objective; that is the
user's side of the trade (benchmarks/comm_options measures it).

Example:
    >>> from hpml_compile.solve.testing import chain_graph, cluster_of
    >>> g = chain_graph([{"fast": (1.0, 2.0), "slow": (2.0, 4.0)}] * 6)
    >>> plan = solve(g, cluster_of(["fast", "slow"]), solver="dp", microbatches=16)
    >>> [len(s.nodes) for s in plan.stages], plan.solver.status.value
    ([4, 2], 'optimal')
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import replace
from typing import Callable, Sequence

from ..cluster import check_devices_costed

from ..compression import CompressKind, Compression, parse_compress, powersgd_fraction
from ..costgraph import CostGraph
from ..errors import InfeasibleError
from ..ir import Cluster
from ..memory import GiB, ZeroStage, dtype_bytes
from ..plan import AllReduce, Plan, Schedule, SolverInfo, SolverStatus
from ..simulate import annotate, stage_costs
from ..stagecost import device_memory, in_flight
from .baselines import Baseline, balanced_cuts, baseline_stages, stages_from_cuts
from .candidates import Candidate, Chain, Setting, kind_counts, to_plan
from .dp import objective, solve_chain
from .ilp import IlpResult, milp, prune, solve_ilp
from .lagrange import (EXACT_VECTORS, coarse_chain, coarse_groups, lagrangian_bounds, ordered_chain, ordered_groups,
                       ordered_units, reduced_cost_prune, speed_order, vectors)
from .table import CandidateTable, build_table

#: Most candidates handed to HiGHS after pruning (beyond, the Lagrangian bounds alone decide; memory).
MILP_CANDIDATES = 15000
#: Share of the many-kind path's time left after the search that the Lagrangian bounds may take (then HiGHS).
BOUNDS_SHARE = 0.85
#: Share of that time the blocked DP may take in the other kind orders, for a better incumbent first.
ORDERS_SHARE = 0.2

__all__ = ["SolverName", "solve", "microbatch_choices", "plan_from_cuts", "choose_compression"]


class SolverName(str, enum.Enum):
    """The solvers ``solve`` offers."""

    ILP = "ilp"
    DP = "dp"
    UNIFORM = "uniform"
    PARAMS = "params"
    TIME = "time"


def microbatch_choices(batch_size: int, cap: int = 64) -> list[int]:
    """Powers of two up to ``min(batch_size, cap)``: the microbatch counts searched by default.

    A microbatch costs its nodes' fixed parts plus ``1 / M`` of the rest
    (profiled costs have fixed parts; costs without them make more
    microbatches always look better, and the cap keeps the search bounded).
    """
    top = max(1, min(batch_size, cap))
    return [2**i for i in range(int(math.log2(top)) + 1)]


def solve(costgraph: CostGraph, cluster: Cluster, *, solver: SolverName | str = SolverName.ILP,
          microbatches: int | None = None, schedule: Schedule | str = Schedule.ONE_F_ONE_B,
          time_limit_s: float = 30.0, dtype: str = "float32", compute_bytes: int = 0,
          progress: Callable[[str], None] | None = None, compress: Compression | str | None = None,
          hierarchical: bool = True) -> Plan:
    """Place ``costgraph`` on ``cluster``.

    Args:
        costgraph: the (usually coarsened) cost graph; its ``order`` is the pipeline order.
        cluster: the devices.
        solver: which solver.
        microbatches: ``M``; None searches :func:`microbatch_choices`.
        schedule: GPipe or 1F1B.
        time_limit_s: time limit of the ILP (on the many-kind path: of the whole solve, from its start).
        dtype: parameter dtype (Adam state size).
        compute_bytes: bytes per element of the autocast compute dtype (0: fp32; see
            :func:`hpml_compile.memory.autocast_copy_bytes`).
        progress: called with a line of text as the solve goes on.
        compress: a gradient compression the user allows (``powersgd:RANK`` / ``topk:RATIO``): priced for every
            replicated ZeRO-0 candidate stage, which takes it where its sync is faster so (:func:`choose_compression`);
            None: never compressed.
        hierarchical: let a ZeRO-0 stage whose replicas span hosts all-reduce hierarchically where the cost
            model says it is faster (exact: the same sum); False keeps every all-reduce flat.

    Returns:
        The plan, with the simulator's predictions and the solver's status.

    Raises:
        UnknownDeviceError: if a device kind has no costs in the graph.
        InfeasibleError: if nothing fits; names each device short of memory,
            by how much, and what would make it fit.
        ValueError: for a bad ``microbatches``.
    """
    name, sched = SolverName(solver), Schedule(schedule)
    say = progress or (lambda _: None)
    allowed = parse_compress(compress) if isinstance(compress, str) else compress
    frac = _powersgd_fraction(costgraph, dtype, allowed)
    check_devices_costed(cluster, costgraph.kinds)
    if microbatches is not None and microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    t0 = time.perf_counter()
    chain = Chain.of(costgraph)
    ms = [microbatches] if microbatches else microbatch_choices(costgraph.batch_size)
    status = SolverStatus.HEURISTIC if name in (SolverName.UNIFORM, SolverName.PARAMS, SolverName.TIME) \
        else SolverStatus.OPTIMAL

    large = vectors(kind_counts(cluster)) > EXACT_VECTORS  # many kinds or devices: no exact DP over counts

    def pick(setting: Setting) -> list[Candidate] | None:
        if name in (SolverName.ILP, SolverName.DP):
            if large:  # only the degrees the two restricted DPs use: a small table, a first plan early
                return _first_plan(chain, cluster, setting)
            return solve_chain(chain, cluster, setting, build_table(chain, cluster, setting))
        got = baseline_stages(chain, cluster, setting, Baseline(name.value))
        return None if isinstance(got, str) else got

    ms = ms[::-1]  # the most microbatches first: least memory, so the likeliest to fit, for a first plan early
    best = _search(chain, cluster, ms, sched, dtype, pick, name.value, say, t0, unimodal=large, compress=allowed,
                   fraction=frac, hierarchical=hierarchical, proxy=large and name in (SolverName.ILP, SolverName.DP),
                   compute_bytes=compute_bytes)
    if best is None:
        raise InfeasibleError(diagnose(chain, cluster, Setting(max(ms), sched, costgraph.batch_size, dtype, allowed,
                                                               frac, compute_bytes=compute_bytes)))
    step, plan, setting, picked = best

    def simulated() -> tuple[float, Plan]:  # the search's plan, simulated now if the search ranked by the proxy
        if plan is not None:
            return step, plan
        p, r = annotate(choose_compression(to_plan(chain, cluster, setting, picked, SolverInfo(name.value)),
                                           costgraph, dtype, allowed), costgraph, dtype)
        return r.step_ms, p

    gap = 0.0
    if name is SolverName.DP and large:  # the coarse DP is exact only over its units: certify its gap
        b, _ = lagrangian_bounds(chain, cluster, setting, build_table(chain, cluster, setting), start=picked,
                                 deadline=time.perf_counter() + min(time_limit_s, 2.0))
        gap = _gap(b.lower, objective(picked, setting.microbatches))
        status = SolverStatus.OPTIMAL if gap <= 1e-6 else SolverStatus.FEASIBLE
    if name is SolverName.ILP:
        res = (_anytime(chain, cluster, setting, picked, time_limit_s, say, t0) if large else
               solve_ilp(chain, cluster, setting, time_limit_s=time_limit_s, warm=picked, progress=say))
        status, gap = res.status, res.gap
        if res.picked:
            ilp_plan, r = annotate(choose_compression(to_plan(chain, cluster, setting, res.picked,
                                                              SolverInfo(name.value)), costgraph, dtype, allowed),
                                   costgraph, dtype)
            proxy = objective(res.picked, setting.microbatches)  # what the ILP minimised, not the simulated step
            say(f"ilp: M={setting.microbatches}: ILP proxy objective {proxy:.4g} ms; simulated step {r.step_ms:.4g} ms")
            if res.picked == picked or r.step_ms <= simulated()[0]:
                step, plan = r.step_ms, ilp_plan
    step, plan = simulated()
    info = SolverInfo(name.value, status, gap, time.perf_counter() - t0)
    if allowed is not None:
        chosen = [f"stage {st.index}: {st.compress}" for st in plan.stages if st.compress]
        say(f"{name.value}: compression {allowed} allowed: " + ("; ".join(chosen) if chosen else
            "no stage syncs faster with it, none compressed"))
    return replace(plan, solver=info)


def _powersgd_fraction(graph: CostGraph, dtype: str, allowed: Compression | None) -> float | None:
    """PowerSGD's share of the model's gradient elements on the wire (each parameter a square matrix)."""
    if allowed is None or allowed.kind is not CompressKind.POWERSGD or not graph.param_sizes:
        return None
    b = dtype_bytes(dtype)
    return powersgd_fraction([v // b for v in graph.param_sizes.values()], allowed.rank)


def choose_compression(plan: Plan, graph: CostGraph, dtype: str, allowed: Compression | None) -> Plan:
    """``plan`` with ``allowed`` on each replicated ZeRO-0 stage whose simulated sync it makes faster.

    The candidate table priced each stage's sync as the cheaper of the two (:mod:`.table`); this names
    the choice in the plan, stage by stage, with the simulator's own costs.
    """
    if allowed is None:
        return plan
    fit = [st.index for st in plan.stages if len(st.devices) > 1 and st.zero == ZeroStage.NONE]
    if not fit:
        return plan
    dense = stage_costs(plan, graph, dtype)
    trial = replace(plan, stages=tuple(replace(st, compress=str(allowed)) if st.index in fit else st
                                       for st in plan.stages))
    comp = stage_costs(trial, graph, dtype)
    # a compressed stage is flat: the runtime compresses over the stage's one group, not level by level
    stages = tuple(replace(st, compress=str(allowed), allreduce=AllReduce.FLAT) if st.index in fit
                   and comp[st.index].sync_ms < dense[st.index].sync_ms else st for st in plan.stages)
    return replace(plan, stages=stages)


def _search(chain: Chain, cluster: Cluster, ms: list[int], sched: Schedule, dtype: str,
            pick: Callable[[Setting], list[Candidate] | None], name: str, say: Callable[[str], None],
            t0: float | None = None, unimodal: bool = False, compress: Compression | None = None,
            fraction: float | None = None, hierarchical: bool = True, proxy: bool = False, compute_bytes: int = 0
            ) -> tuple[float, Plan | None, Setting, list[Candidate]] | None:
    """The microbatch count whose stages (from ``pick``) simulate fastest: ``(step, plan, setting, stages)``.

    Stopped by Ctrl-C (KeyboardInterrupt) after a first plan, it returns the best so far. ``unimodal``:
    stop once two counts in a row are worse than the best (the step time falls, then rises, as the
    bubble shrinks and the per-microbatch fixed costs grow); a heuristic, used where the search is not
    exact anyway (the many-kind path). ``proxy`` (the many-kind path's ILP and DP): the counts are ranked
    by the ILP's proxy objective (what the gap certifies) and only the chosen plan is simulated
    (simulating every count cost ~0.4 s each on 3 x 256 devices, more than finding the plans); the plan
    is then None (the caller simulates it).
    """
    graph = chain.graph
    best: tuple[float, Plan | None, Setting, list[Candidate]] | None = None
    worse = 0
    for m in ms:
        if unimodal and worse >= 2 and best is not None:
            say(f"{name}: M={m} and fewer not tried: two counts in a row were slower than M={best[2].microbatches}")
            break
        try:
            setting = Setting(m, sched, graph.batch_size, dtype, compress, fraction, hierarchical, compute_bytes)
            picked = pick(setting)
            if not picked:
                plan, step = None, math.inf
            elif proxy:  # ranked by the proxy the bounds certify; only the chosen plan is simulated
                plan, step = None, objective(picked, m)
            else:
                plan, r = annotate(choose_compression(to_plan(chain, cluster, setting, picked, SolverInfo(name)),
                                                      graph, dtype, compress), graph, dtype)
                step = r.step_ms
        except KeyboardInterrupt:
            if best is None:
                raise
            say(f"{name}: interrupted; keeping the best plan so far (M={best[2].microbatches})")
            break
        if not picked:  # not a reason to stop: fewer microbatches allow larger replica groups (and ZeRO)
            continue
        first = "" if best is not None or t0 is None else f" (first plan after {time.perf_counter() - t0:.3g} s)"
        what = "proxy objective" if proxy else "simulated step"
        say(f"{name}: M={m}: {len(picked)} stages, {what} {step:.4g} ms{first}")
        if best is None or step < best[0] or (step == best[0] and m < best[2].microbatches):
            best, worse = (step, plan, setting, picked), 0  # ties: the fewest microbatches
        else:
            worse += 1
    return best


def _first_plan(chain: Chain, cluster: Cluster, setting: Setting) -> list[Candidate] | None:
    """The better of the two restrictions' plans (None if neither fits): the coarse DP over device units of
    every kind at once, and the DP with the kinds in blocks (fastest first), whose state is one kind's
    devices, so its units stay small and it finds a plan where the coarse units leave too few devices."""
    groups = sorted(set(coarse_groups(cluster, setting)) | set(ordered_groups(cluster, setting)))
    tab = build_table(chain, cluster, setting, groups=groups)
    plans = [coarse_chain(chain, cluster, setting, tab),
             ordered_chain(chain, cluster, setting, tab, speed_order(chain, tab.kinds),
                           unit=ordered_units(cluster, setting))]
    return min((p for p in plans if p), key=lambda p: objective(p, setting.microbatches), default=None)


def _other_orders(chain: Chain, cluster: Cluster, setting: Setting, tab: CandidateTable, upper: float,
                  report: Callable[[float, float, list[Candidate] | None], None], until: float) -> None:
    """Better incumbents from the blocked DP in the other kind orders (the first plan tried the fastest first).

    Where memory binds, the kind with the least memory wants the end of the pipeline (fewest microbatches in
    flight) whatever its speed: llama-70b on 3 x 32 at 64 microbatches, H100, V100, A100 is 3.4% better than
    fastest first. Each order is one DP of ``sum_k`` states (~0.15 s there); they are tried until ``until``.
    """
    m, first = setting.microbatches, speed_order(chain, tab.kinds)
    unit = ordered_units(cluster, setting)
    for order in itertools.permutations(first):
        if order == first:
            continue
        if time.perf_counter() >= until:
            break
        got = ordered_chain(chain, cluster, setting, tab, order, unit=unit)
        if got and objective(got, m) < upper:
            upper = objective(got, m)
            report(0.0, upper, got)


def _gap(lower: float, upper: float) -> float:
    """Relative gap of ``upper`` over ``lower`` (0 when they meet, 1 when nothing is known)."""
    if not math.isfinite(upper) or upper <= 0:
        return 0.0 if upper == lower else 1.0
    return min(1.0, max(0.0, (upper - lower) / upper)) if math.isfinite(lower) else 0.0


def _anytime(chain: Chain, cluster: Cluster, setting: Setting, warm: list[Candidate], time_limit_s: float,
             say: Callable[[str], None], t0: float) -> IlpResult:
    """Many kinds or devices: Lagrangian bounds, then HiGHS on the candidates that can still win.

    Every improvement of either bound is logged as ``anytime: <s> s: incumbent <u> ms, bound <l> ms,
    gap <g>%``; the time limit or Ctrl-C stops it with the best plan so far and its certified gap.
    """
    start = time.perf_counter()
    deadline = max(t0 + time_limit_s, start + 0.5)  # the limit counts from the solve's start, search included
    m = setting.microbatches
    state = {"lower": 0.0, "upper": objective(warm, m), "plan": warm}

    def report(lower: float, upper: float, plan: list[Candidate] | None) -> None:
        if plan is not None and upper < state["upper"]:
            state["upper"], state["plan"] = upper, plan
        state["lower"] = max(state["lower"], min(lower, state["upper"]))
        say(f"anytime: {time.perf_counter() - t0:.3f} s: incumbent {state['upper']:.7g} ms, bound "
            f"{state['lower']:.7g} ms, gap {_gap(state['lower'], state['upper']):.3%}")

    def result(status: SolverStatus | None = None, variables: int = 0) -> IlpResult:
        gap = _gap(state["lower"], state["upper"])
        st = status or (SolverStatus.OPTIMAL if gap <= 1e-6 else SolverStatus.FEASIBLE)
        return IlpResult(state["plan"], st, 0.0 if st is SolverStatus.OPTIMAL else float(gap),
                         time.perf_counter() - start, variables)

    try:
        report(0.0, state["upper"], warm)
        tab = build_table(chain, cluster, setting, max_time=state["upper"] * (1 + 1e-9))
        _other_orders(chain, cluster, setting, tab, state["upper"], report, start + ORDERS_SHARE * (deadline - start))
        # The bounds first: their shortest paths that respect the limits are the best plans found at scale
        # (3 x 256: 74,734 ms where the restricted DPs' best was 79,548), and they prune for the MILP.
        b, lam = lagrangian_bounds(chain, cluster, setting, tab, start=state["plan"],
                                   deadline=start + BOUNDS_SHARE * (deadline - start), progress=report)
        report(b.lower, b.upper, b.plan)
        say(f"anytime: Lagrangian bounds after {b.evaluations} shortest paths")
        if _gap(state["lower"], state["upper"]) <= 1e-6 or time.perf_counter() >= deadline - 0.5:
            return result()
        keep = reduced_cost_prune(chain, cluster, setting, tab, state["upper"], lam)
        small = tab.select(keep)
        small = prune(chain, cluster, setting, small, state["upper"], b.t_min)
        if len(small) > MILP_CANDIDATES:
            # Too many for HiGHS: the bounds again, on the pruned table (faster paths) until the deadline.
            # Every plan better than the incumbent is still in it, so its bound (capped at the incumbent) holds.
            say(f"anytime: {len(small)} of {len(tab)} candidates left after pruning (over {MILP_CANDIDATES} for "
                "the MILP); bounding the rest")
            b2, _ = lagrangian_bounds(chain, cluster, setting, small, start=state["plan"], deadline=deadline,
                                      progress=report)
            report(b2.lower, b2.upper, b2.plan)
            return result()
        left = deadline - time.perf_counter() - len(small) * 2e-4  # building the model costs ~0.2 ms per candidate
        if left < 1.0:
            say(f"anytime: {left + len(small) * 2e-4:.2g} s left; too little for the MILP over {len(small)} candidates")
            return result()
        res = milp(chain, cluster, setting, small, state["plan"], t_min=b.t_min, lower=state["lower"],
                   time_limit_s=left, progress=say, full=len(tab), t0=start)
        if res.picked and objective(res.picked, m) < state["upper"]:
            state["upper"], state["plan"] = objective(res.picked, m), res.picked
        bound = state["upper"] * (1 - res.gap) if res.status is not SolverStatus.OPTIMAL else state["upper"]
        report(bound, state["upper"], None)
        return result(SolverStatus.OPTIMAL if res.status is SolverStatus.OPTIMAL else None, res.variables)
    except KeyboardInterrupt:
        say("anytime: interrupted; returning the best plan so far with its certified gap")
        return result()


def plan_from_cuts(costgraph: CostGraph, cluster: Cluster, cuts: Sequence[int], *, name: str = "manual",
                   microbatches: int | None = None, schedule: Schedule | str = Schedule.ONE_F_ONE_B,
                   dtype: str = "float32") -> Plan:
    """Score any partitioner's split on our cost model, as the baselines are scored.

    Stage ``i`` is ``costgraph.order[cuts[i]:cuts[i+1]]`` on the ``i``-th device of the cluster (no data
    parallelism), with the cheapest memory configuration that fits; the microbatch count is searched as
    for the other solvers and the plan carries the simulator's predictions.

    Args:
        costgraph: the cost graph.
        cluster: the devices (at least ``len(cuts) - 1``).
        cuts: increasing positions from 0 to ``len(costgraph.order)``.
        name: the solver name written into the plan.
        microbatches: ``M``; None searches :func:`microbatch_choices`.
        schedule: GPipe or 1F1B.
        dtype: parameter dtype.

    Returns:
        The plan (status ``heuristic``).

    Raises:
        InfeasibleError: if a stage fits on its device at no microbatch count.
        ValueError: for bad cuts.
    """
    sched = Schedule(schedule)
    t0 = time.perf_counter()
    chain = Chain.of(costgraph)
    ms = [microbatches] if microbatches else microbatch_choices(costgraph.batch_size)
    why: list[str] = []

    def pick(setting: Setting) -> list[Candidate] | None:
        got = stages_from_cuts(chain, cluster, setting, cuts)
        if isinstance(got, str):
            why.append(got)
            return None
        return got

    best = _search(chain, cluster, ms, sched, dtype, pick, name, lambda _: None)
    if best is None:
        raise InfeasibleError(f"{name}: the split {list(cuts)} fits at no microbatch count in {ms}: {why[-1]}")
    plan = best[1]
    assert plan is not None  # simulated: proxy ranking is off here
    return Plan(plan.model, plan.cluster, plan.schedule, plan.microbatches, plan.stages, plan.predicted,
                SolverInfo(name, SolverStatus.HEURISTIC, 0.0, time.perf_counter() - t0))


def diagnose(chain: Chain, cluster: Cluster, setting: Setting) -> str:
    """Why nothing fits: each device short of memory, by how much, and what would make it fit.

    The model is split over all devices in cluster order, one stage each,
    balancing parameter bytes; each stage's need is taken with every saving
    on (recompute, optimizer offload and swap where the device is not the host).

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.

    Returns:
        The message of an InfeasibleError.
    """
    order = chain.graph.order
    devs = cluster.devices
    cuts = balanced_cuts(chain, len(devs), [chain.graph.node(v).param_bytes for v in order])
    bpe = dtype_bytes(setting.dtype)
    lines, s = [], len(cuts) - 1
    for i in range(s):
        dev = devs[i]
        a, b = cuts[i], cuts[i + 1]
        params, acts = chain.params[b] - chain.params[a], chain.acts[b] - chain.acts[a]
        cpu = dev.is_cpu
        fl = in_flight(setting.schedule, setting.microbatches, s - i - 1)
        kw = dict(param_bytes=params, activation_bytes=acts, input_bytes=chain.cut[a], dtype_bytes=bpe,
                  replicas=1, zero=0, microbatches=setting.microbatches, in_flight=fl, host_is_device=cpu)
        plain = device_memory(**kw)  # type: ignore[arg-type]
        saved = device_memory(**kw, recompute=True, offload_optimizer=True,  # type: ignore[arg-type]
                              swapped_bytes=acts)
        if saved.total <= dev.memory_bytes:
            continue
        short = saved.total - dev.memory_bytes
        lines.append(
            f"- {dev.name} ({dev.kind}, {dev.memory_gib:.1f} GiB), stage {i} ({order[a]}..{order[b - 1]}): needs "
            f"{saved.total / GiB:.2f} GiB even with recompute, optimizer offload and swap (without them "
            f"{plain.total / GiB:.2f} GiB: parameters+gradients {(plain.params + plain.grads) / GiB:.2f}, "
            f"optimizer {plain.optimizer / GiB:.2f}, activations {plain.activations / GiB:.2f}); short by "
            f"{short / GiB:.2f} GiB")
    p_total = chain.params[-1]
    floor = 2 * p_total  # parameters + gradients, ZeRO-3-sharded over every device, optimizer offloaded
    cap = sum(d.memory_bytes for d in devs)
    biggest = max(d.memory_bytes for d in devs)
    more = max(1, math.ceil((floor - cap) / biggest)) if floor > cap else 1
    head = (f"no plan fits {chain.graph.model} (batch {setting.batch_size}, {setting.dtype}) on cluster "
            f"{cluster.name}: every combination of stages, data-parallel degree, ZeRO stage, recompute, optimizer "
            "offload and activation swap exceeds some device's memory.")
    fixes = (f"What would make it fit: more devices (parameters and gradients alone need {floor / GiB:.2f} GiB "
             f"sharded over all devices; the cluster has {cap / GiB:.2f} GiB; add at least {more} device(s) of "
             f"{biggest / GiB:.0f} GiB), devices with more memory, or a smaller batch (activations scale with it); "
             "ZeRO sharding needs several devices of one kind in a stage.")
    body = "\n".join(lines) if lines else ("- no single device is short when the model is spread evenly; the "
                                           "short one is whichever device holds the largest block")
    return f"{head}\n{body}\n{fixes}"
