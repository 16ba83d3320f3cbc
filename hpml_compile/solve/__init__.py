"""Pass 4, solve: a cost graph and a cluster to a placement Plan.

Solvers (:class:`SolverName`): ``portfolio`` (default; ``ilp`` is accepted for it:
the DP bounds, a Lagrangian branch and bound and, where the
candidates are few enough, HiGHS's MILP (:mod:`.ilp`), each where the case
calls for it, exact with a reported gap), ``dp`` (:mod:`.dp`, exact min-bottleneck over the
topological order, for graphs too large for the ILP) and the baselines
``uniform``, ``params``, ``time`` (:mod:`.baselines`) and ``grid`` (:mod:`.grid`:
one tensor-parallel degree, depth and data-parallel degree for every stage, as
Megatron-LM or torchtitan are configured by hand). Each candidate stage may
take a tensor-parallel degree ``tp`` (:mod:`hpml_compile.tp`) where a host
holds that many devices of its kind: the table prices it
(:func:`.table.build_table`) like any other configuration. ``portfolio`` also tries
grid's uniform meshes (within :data:`MESH_BUDGET_S`), whose one stage may hold
replicas of several kinds, and returns the faster (named ``portfolio+grid``), so it
is never slower than that peer. Every plan is scored
by the one simulator (:mod:`hpml_compile.simulate`), and its predictions are
written into the plan.

The microbatch count, when not given, is searched over powers of two up to
``min(batch_size, 64)`` with the DP (each count: the candidate table in
numpy, :mod:`.table`, the vectorised DP, one simulation; ~0.1-0.2 s for
llama-70b on 64 devices); the ILP then solves at the best count. For ``ilp``
each count is ranked by the faster, simulated, of the DP's min-bottleneck
tiling (``dp``'s plan) and its least-sum tiling (:func:`.dp.tilings`): at few
microbatches the bottleneck buys nothing, and with fixed per-op parts the
min-bottleneck tiling at ``M = 1`` is a pipeline several times slower than one
stage of every device. ``ilp`` returns the better, by simulated step time, of
the ILP's plan and that DP plan, so it is never worse than ``dp``.

Clusters whose device-count vectors (``prod_k (count_k + 1)``) exceed
:data:`~.lagrange.EXACT_VECTORS` (several kinds, or one kind past ~128
devices) take the many-kind path of :mod:`.lagrange` instead of the exact DP
over count vectors, whose state grew to 17 million vectors for 3 kinds x 256:
the microbatch search runs two restricted exact DPs (device units; kinds in
blocks along the pipeline) per count, each at several bottlenecks (its
min-bottleneck tiling, its least-sum tiling and least-sum tilings under
thresholds between: :func:`.restricted.proxy_sweep`; the first count's at its
min-bottleneck alone, for a first plan early, swept right after), ranks the
counts by the ILP's proxy objective, the one the gap certifies (its first plan
is logged with the time it took; the search stops trying counts after
:data:`SEARCH_SHARE` of the time limit), then :func:`.msearch.anytime` bounds *every* count with a resumable
Lagrangian shortest path, best first, against one incumbent over all counts
(so the certified gap covers the microbatch count too), streams every
improvement as ``anytime: <s> s: incumbent <u> ms, bound <l> ms, gap <g>%
(...)`` and hands HiGHS the candidates the bound has not ruled out at the
count that limits the bound, if time is left. The time limit or Ctrl-C stops
it with the best plan so far and its certified gap. The plan returned is the
one that simulates fastest among the incumbent and the search's plans, and
its status and gap are *its own* proxy objective's against the bound
(``optimal`` only when they meet), logged as ``portfolio: returned M=<m>: ILP proxy
objective <u> ms, bound <l> ms, gap <g>%``. The
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
    >>> from hpml_compile.testing import chain_graph, cluster_of
    >>> g = chain_graph([{"fast": (1.0, 2.0), "slow": (2.0, 4.0)}] * 6)
    >>> plan = solve(g, cluster_of(["fast", "slow"]), solver="dp", microbatches=16)
    >>> [len(s.nodes) for s in plan.stages], plan.solver.status.value
    ([4, 2], 'optimal')
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import replace
from typing import Callable, Sequence

from ..cluster import check_devices_costed

from ..compression import CompressKind, Compression, parse_compress, powersgd_fraction
from ..costgraph import CostGraph
from ..errors import InfeasibleError
from ..ir import Cluster, Precision
from ..memory import GiB, ZeroStage, dtype_bytes
from ..plan import AllReduce, Plan, Schedule, SolverInfo, SolverStatus
from ..simulate import annotate, stage_costs
from ..stagecost import device_memory, in_flight
from .baselines import Baseline, balanced_cuts, baseline_stages, stages_from_cuts
from .candidates import Candidate, Chain, Setting, kind_counts, to_plan
from .dp import objective, solve_chain, tilings
from .ilp import solve_ilp
from .lagrange import (EXACT_VECTORS, coarse_chain, coarse_groups, lagrangian_bounds, ordered_chain, ordered_groups,
                       ordered_units, speed_order, vectors)
from .restricted import SWEEP, proxy_sweep
from .msearch import MILP_CANDIDATES, anytime, relative_gap
from .table import build_table
from .grid import grid_plan


__all__ = ["SolverName", "solve", "microbatch_choices", "plan_from_cuts", "choose_compression"]


#: Share of the time limit after which the many-kind ``ilp`` solve's microbatch search tries no further count (its
#: bounds cover every count, first plan or not): with the first plans swept over bottlenecks a count costs 0.4-0.9
#: CPU s, and gpt2-xl on 3 x 32 spent all of a 10 s limit (on a loaded machine) in the search, leaving counts unbounded.
SEARCH_SHARE = 0.3


class SolverName(str, enum.Enum):
    """The solvers ``solve`` offers. ``ilp`` is accepted for ``portfolio`` (``SolverName("ilp")``, ``--solver ilp``).

    Example:
        >>> SolverName("ilp") is SolverName.PORTFOLIO is SolverName.ILP, [s.value for s in SolverName][0]
        (True, 'portfolio')
    """

    PORTFOLIO = "portfolio"
    DP = "dp"
    UNIFORM = "uniform"
    PARAMS = "params"
    TIME = "time"
    GRID = "grid"
    ILP = "portfolio"  # an alias: ``--solver ilp`` selects the portfolio

    @classmethod
    def _missing_(cls, value: object) -> SolverName | None:
        return cls.PORTFOLIO if value == "ilp" else None


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
          hierarchical: bool = True, reduce_dtype: Precision | str = Precision.FP32,
          room: tuple[int, int] = (1, 0)) -> Plan:
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
        hierarchical: let a ZeRO-0 stage whose replicas span hosts all-reduce hierarchically, and a ZeRO-1 one
            shard its optimizer per host behind the hierarchical levels, where the cost model says it is faster
            (exact: the same sum); False keeps every all-reduce flat.
        reduce_dtype: the dtype of the gradient collectives (``Plan.reduce_dtype``), whose bytes the candidates'
            sync is priced at (:func:`hpml_compile.stagecost.sync_ms`) and which the plan carries.
        room: ``(v, S)``: every stage leaves memory for the microbatches interleaved 1F1B with ``v`` chunks over
            ``S`` device groups holds (:func:`.candidates.interleaved_in_flight`), for a placement that
            :mod:`.interleave` re-cuts into chunks; ``(1, 0)``: the schedule's own. The plan is 1F1B's.

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
    if name is SolverName.GRID:
        return grid_plan(costgraph, cluster, microbatches=microbatches, schedule=sched, dtype=dtype,
                         time_limit_s=time_limit_s, compute_bytes=compute_bytes, hierarchical=hierarchical)
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
            table = build_table(chain, cluster, setting)
            if name is SolverName.DP:
                return solve_chain(chain, cluster, setting, table)
            # ilp: each count ranked by the faster, simulated, of the min-bottleneck tiling (dp's plan, so ilp
            # is never worse than dp) and the least-sum one (the min-bottleneck tiling alone ranked M = 1 by a
            # pipeline run stage after stage where one stage of every device was fastest)
            plans = tilings(chain, cluster, setting, table)
            return min(plans, key=lambda c: _simulated_step(chain, cluster, setting, c, name.value, dtype, allowed),
                       default=None) if len(plans) > 1 else (plans[0] if plans else None)
        got = baseline_stages(chain, cluster, setting, Baseline(name.value))
        return None if isinstance(got, str) else got

    ms = ms[::-1]  # the most microbatches first: least memory, so the likeliest to fit, for a first plan early
    seen: dict[int, tuple[Setting, list[Candidate]]] = {}

    def search(setting: Setting) -> list[Candidate] | None:
        """``pick``; on the many-kind path the first count with a plan from the min-bottleneck tilings alone (a
        first plan early; swept after the search, :func:`_sweep_first`), the others swept over bottlenecks."""
        if large and name in (SolverName.ILP, SolverName.DP):
            return _first_plan(chain, cluster, setting, sweep=bool(seen))
        return pick(setting)

    best = _search(chain, cluster, ms, sched, dtype, search, name.value, say, t0, unimodal=large, compress=allowed,
                   fraction=frac, hierarchical=hierarchical, proxy=large and name in (SolverName.ILP, SolverName.DP),
                   compute_bytes=compute_bytes, seen=seen, reduce_dtype=Precision(reduce_dtype), room=room,
                   until=t0 + SEARCH_SHARE * time_limit_s if large and name is SolverName.ILP else math.inf)
    if best is None:
        raise InfeasibleError(diagnose(chain, cluster, Setting(max(ms), sched, costgraph.batch_size, dtype, allowed,
                                                               frac, compute_bytes=compute_bytes)))
    if large and name in (SolverName.ILP, SolverName.DP):
        best = _sweep_first(chain, cluster, seen, name.value, say) or best
    step, plan, setting, picked = best
    sims: dict[tuple[int, tuple[Candidate, ...]], tuple[float, Plan]] = {}
    if plan is not None:
        sims[(setting.microbatches, tuple(picked))] = (step, plan)

    def simulated(st: Setting, cands: list[Candidate]) -> tuple[float, Plan]:
        """A plan's simulated step (each plan simulated once)."""
        key = (st.microbatches, tuple(cands))
        if key not in sims:
            p, r = annotate(choose_compression(to_plan(chain, cluster, st, cands, SolverInfo(name.value)),
                                               costgraph, dtype, allowed), costgraph, dtype)
            sims[key] = (r.step_ms, p)
        return sims[key]

    gap = 0.0
    if name is SolverName.DP and large:  # the coarse DP is exact only over its units: certify its gap
        b, _ = lagrangian_bounds(chain, cluster, setting, build_table(chain, cluster, setting), start=picked,
                                 deadline=time.perf_counter() + min(time_limit_s, 2.0))
        gap = relative_gap(b.lower, objective(picked, setting.microbatches))
        status = SolverStatus.OPTIMAL if gap <= 1e-6 else SolverStatus.FEASIBLE
    if name is SolverName.ILP:
        # options: the bounded plan first, then the search's plans at its count and at the search's best count;
        # the one that simulates fastest is returned, with the gap of *its* proxy objective against the bound
        if large:
            every = [Setting(m, sched, costgraph.batch_size, dtype, allowed, frac, hierarchical, compute_bytes,
                             reduce_dtype=Precision(reduce_dtype), room_chunks=room[0], room_groups=room[1])
                     for m in ms]
            out = anytime(chain, cluster, every, {m: p for m, (_, p) in seen.items()}, time_limit_s, say, t0)
            lower, proven = out.lower, out.status is SolverStatus.OPTIMAL
            # with the first plan at the incumbent's count, the best first plan at another count (by the proxy;
            # the search's best count is one of the two): the swept first plans rank the counts as the bounds do,
            # so the search's best is mostly the incumbent's count, and the other count's plan is the likeliest
            # to simulate faster (the proxy and the simulator disagree by 1-40%: test_lagrange_msearch's 8-block
            # instance, where M=64's plan simulates 28% faster than M=32's proxy-optimal one). At most 3 plans.
            here = out.setting.microbatches
            other = min((k for k in seen if k != here), key=lambda k: (objective(seen[k][1], k), k), default=None)
            options = [(out.setting, out.picked)] + [seen[m] for m in (here, other) if m in seen]
        else:
            res = solve_ilp(chain, cluster, setting, time_limit_s=time_limit_s, warm=picked, progress=say)
            top = objective(res.picked, setting.microbatches) if res.picked else math.inf
            proven = res.status is SolverStatus.OPTIMAL
            lower = top if proven else top * (1 - res.gap) if res.picked else 0.0
            options = ([(setting, res.picked)] if res.picked else []) + [(setting, picked)]
        chosen: tuple[float, Plan, Setting, list[Candidate]] | None = None
        for st, cands in options:
            sim, p = simulated(st, cands)
            if chosen is None or sim < chosen[0]:
                chosen = (sim, p, st, cands)
        assert chosen is not None
        if len({(st.microbatches, tuple(c)) for st, c in options}) > 1:
            say("portfolio: simulated " + "; ".join(sorted({f"M={st.microbatches} proxy {objective(c, st.microbatches):.7g} "
                                                       f"ms: step {simulated(st, c)[0]:.7g} ms" for st, c in options})))
        step, plan, setting, picked = chosen
        proxy = objective(picked, setting.microbatches)  # what the bounds certify, not the simulated step
        gap = 0.0 if proven and proxy <= lower * (1 + 1e-9) else float(relative_gap(lower, proxy))
        status = SolverStatus.OPTIMAL if gap <= 1e-6 else SolverStatus.FEASIBLE
        gap = 0.0 if status is SolverStatus.OPTIMAL else gap
        say(f"portfolio: returned M={setting.microbatches}: ILP proxy objective {proxy:.7g} ms, bound {lower:.7g} ms, "
            f"gap {gap:.3%}; simulated step {step:.4g} ms")
    else:
        step, plan = simulated(setting, picked)
    info = SolverInfo(name.value, status, gap, time.perf_counter() - t0)
    if name is SolverName.ILP and not allowed and room[0] == 1:  # a uniform mesh may mix kinds in one stage, outside
        # the ILP's space (its memory is the schedule's: no room left for interleaving)
        left = max(1.0, time_limit_s - (time.perf_counter() - t0))  # within the time limit, a second at least
        mesh = _mesh(costgraph, cluster, microbatches, sched, dtype, compute_bytes, left, hierarchical)
        if mesh is not None and mesh.predicted.step_ms < step:
            say(f"portfolio: grid's uniform mesh simulates faster ({mesh.predicted.step_ms:.4g} ms against "
                f"{step:.4g} ms; its stages may mix kinds across tensor-parallel groups): returned")
            plan, info = mesh, SolverInfo(f"{SolverName.PORTFOLIO.value}+grid", SolverStatus.HEURISTIC, 0.0, time.perf_counter() - t0)
    if allowed is not None:
        chosen = [f"stage {st.index}: {st.compress}" for st in plan.stages if st.compress]
        say(f"{name.value}: compression {allowed} allowed: " + ("; ".join(chosen) if chosen else
            "no stage syncs faster with it, none compressed"))
    return replace(plan, solver=info)


#: The most seconds ``ilp`` spends on grid's uniform meshes after its own plan (:func:`_mesh`).
MESH_BUDGET_S = 5.0


def _mesh(graph: CostGraph, cluster: Cluster, microbatches: int | None, sched: Schedule, dtype: str,
          compute_bytes: int, time_limit_s: float, hierarchical: bool) -> Plan | None:
    """grid's fastest uniform mesh within :data:`MESH_BUDGET_S` (or the time limit, if shorter), so that ``ilp``
    is never slower than the peer (None: no mesh fits)."""
    try:
        return grid_plan(graph, cluster, microbatches=microbatches, schedule=sched, dtype=dtype,
                         time_limit_s=min(MESH_BUDGET_S, time_limit_s), compute_bytes=compute_bytes,
                         hierarchical=hierarchical)
    except InfeasibleError:
        return None


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
                   and comp[st.index].synced_ms < dense[st.index].synced_ms else st for st in plan.stages)
    return replace(plan, stages=stages)


def _simulated_step(chain: Chain, cluster: Cluster, setting: Setting, picked: list[Candidate], name: str,
                    dtype: str, compress: Compression | None) -> float:
    """The simulated step of ``picked`` at ``setting``, as :func:`_search` scores a count's plan."""
    graph = chain.graph
    _, r = annotate(choose_compression(to_plan(chain, cluster, setting, picked, SolverInfo(name)), graph, dtype,
                                       compress), graph, dtype)
    return r.step_ms


def _search(chain: Chain, cluster: Cluster, ms: list[int], sched: Schedule, dtype: str,
            pick: Callable[[Setting], list[Candidate] | None], name: str, say: Callable[[str], None],
            t0: float | None = None, unimodal: bool = False, compress: Compression | None = None,
            fraction: float | None = None, hierarchical: bool = True, proxy: bool = False, compute_bytes: int = 0,
            seen: dict[int, tuple[Setting, list[Candidate]]] | None = None, until: float = math.inf,
            reduce_dtype: Precision = Precision.FP32,
            room: tuple[int, int] = (1, 0)) -> tuple[float, Plan | None, Setting, list[Candidate]] | None:
    """The microbatch count whose stages (from ``pick``) simulate fastest: ``(step, plan, setting, stages)``.

    Stopped by Ctrl-C (KeyboardInterrupt) after a first plan, it returns the best so far. ``unimodal``:
    stop once two counts in a row are worse than the best (the step time falls, then rises, as the
    bubble shrinks and the per-microbatch fixed costs grow; a count without a plan after the first plan
    counts as worse); a heuristic, used only on the many-kind path, where the ``ilp`` solver's bounds then
    cover every count (:mod:`.msearch`): a count skipped here loses its first plan, not its place in the
    certificate (the ``dp`` solver's gap is at its chosen count only). ``proxy`` (the many-kind path's ILP and DP): the counts are ranked
    by the ILP's proxy objective (what the gap certifies) and only the chosen plan is simulated
    (simulating every count cost ~0.4 s each on 3 x 256 devices, more than finding the plans); the plan
    is then None (the caller simulates it). ``seen`` collects every count's plan. ``until``: a
    ``time.perf_counter()`` value after which no further count is tried once there is a plan (the many-kind
    path's ``ilp``, whose bounds cover the counts left without a first plan).
    """
    graph = chain.graph
    best: tuple[float, Plan | None, Setting, list[Candidate]] | None = None
    worse = 0
    for m in ms:
        if unimodal and worse >= 2 and best is not None:
            say(f"{name}: M={m} and fewer: no first plan tried (two counts in a row were slower than "
                f"M={best[2].microbatches} or had none)")
            break
        if best is not None and time.perf_counter() > until:
            say(f"{name}: M={m} and fewer: no first plan tried (the search's share of the time limit is spent)")
            break
        try:
            setting = Setting(m, sched, graph.batch_size, dtype, compress, fraction, hierarchical, compute_bytes,
                              reduce_dtype=reduce_dtype, room_chunks=room[0], room_groups=room[1])
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
            if unimodal and best is not None:
                worse += 1  # but after a first plan it counts as worse: the many-kind path bounds every count anyway
            continue
        if seen is not None:
            seen[m] = (setting, picked)
        first = "" if best is not None or t0 is None else f" (first plan after {time.perf_counter() - t0:.3g} s)"
        what = "proxy objective" if proxy else "simulated step"
        say(f"{name}: M={m}: {len(picked)} stages, {what} {step:.4g} ms{first}")
        if best is None or step < best[0] or (step == best[0] and m < best[2].microbatches):
            best, worse = (step, plan, setting, picked), 0  # ties: the fewest microbatches
        else:
            worse += 1
    return best


def _sweep_first(chain: Chain, cluster: Cluster, seen: dict[int, tuple[Setting, list[Candidate]]], name: str,
                 say: Callable[[str], None]) -> tuple[float, Plan | None, Setting, list[Candidate]] | None:
    """The first count with a plan took its min-bottleneck tilings alone (a first plan early); sweep it now
    (:func:`_first_plan`), and the best count again by the proxy objective (None: nothing changed)."""
    if not seen:
        return None
    m = next(iter(seen))
    setting, picked = seen[m]
    swept = _first_plan(chain, cluster, setting)
    if not swept or objective(swept, m) >= objective(picked, m):
        return None
    seen[m] = (setting, swept)
    say(f"{name}: M={m}: {len(swept)} stages, proxy objective {objective(swept, m):.4g} ms (its first plan swept "
        "over bottlenecks)")
    top = min(seen.values(), key=lambda x: (objective(x[1], x[0].microbatches), x[0].microbatches))
    return objective(top[1], top[0].microbatches), None, top[0], top[1]


def _first_plan(chain: Chain, cluster: Cluster, setting: Setting, sweep: bool = True) -> list[Candidate] | None:
    """The best, on the ILP's proxy objective, of the two restrictions' plans (None if neither fits): the coarse
    DP over device units of every kind at once, and the DP with the kinds in blocks (fastest first), whose state
    is one kind's devices, so its units stay small and it finds a plan where the coarse units leave too few
    devices. Each is taken at several bottlenecks (:func:`~.restricted.proxy_sweep`: its min-bottleneck tiling,
    its least-sum tiling and the least-sum tilings under thresholds between), since the min-bottleneck tiling
    alone ranked counts by plans up to 25% over the restriction's best (llama-70b on 3 x 256 at M=32: 94,568 ms
    against 75,565) and gpt2-xl on 3 x 32 at M=1 by a pipeline 2.2 times slower than one stage of all devices.
    ``sweep`` False: the min-bottleneck tilings alone (half the time or less: the first count's first plan)."""
    groups = sorted(set(coarse_groups(cluster, setting)) | set(ordered_groups(cluster, setting)))
    tab = build_table(chain, cluster, setting, groups=groups)
    m, order, unit = setting.microbatches, speed_order(chain, tab.kinds), ordered_units(cluster, setting)
    levels = SWEEP if sweep else None
    plans = [proxy_sweep(lambda t, b: coarse_chain(chain, cluster, setting, t, bottleneck=b), tab, m, levels),
             proxy_sweep(lambda t, b: ordered_chain(chain, cluster, setting, t, order, unit=unit, bottleneck=b),
                         tab, m, levels)]
    return min((p for p in plans if p), key=lambda p: objective(p, m), default=None)


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
        fl = in_flight(setting.schedule, setting.microbatches, s - i - 1, s)
        kw = dict(param_bytes=params, activation_bytes=acts, input_bytes=chain.cut[a], dtype_bytes=bpe,
                  replicas=1, zero=0, microbatches=setting.microbatches, in_flight=fl, host_is_device=cpu,
                  process_bytes=chain.graph.process_bytes(dev.kind, params) if cpu else 0)
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
