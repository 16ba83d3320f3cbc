"""Re-plan: ``solve`` fed with measured costs, and what changed (:func:`hpml_compile.driver.replan` runs it).

Measurements from the runtime are a Profile too, so re-planning is the solver
run on that profile (on the same cluster, or on what is left of it after a
device is lost). The old plan is scored by the same simulator on the *new*
costs, so the comparison is fair: the switch is worth it only when the new
plan beats the old one under the costs the job actually sees. If it does not,
the old plan is kept (re-annotated with the new predictions).

The user's communication options carry over (:func:`carried_comm`): a
compression the user let the solver choose (``Plan.allow_compress``) is
offered to the solver again, one the user put on every replicated stage
(``--compress``: stages compressed without an allowance) is put on the new
plan's replicated stages, and local SGD (``sync_every``, ``sync_warmup``)
stays; the new plan is scored with them, as it will run. A new plan that
cannot run them (local SGD on a stage the solver shards with ZeRO) is not
taken while the old plan can still run.

A device that slows down inside a replicated stage has a cheaper answer than a
new solve: :func:`move_rows` keeps the stages and their devices and only gives
that stage's replicas new rows per microbatch (:func:`~hpml_compile.stagecost.choose_rows`
on the measured costs, where the slowed device has a kind of its own), scored
by the same simulator, so the closed loop can weigh it against the full
re-plan (:mod:`hpml_compile.runtime.job.adapt`).

Example:
    >>> from hpml_compile.testing import chain_graph, cluster_of
    >>> from hpml_compile.solve import solve
    >>> g = chain_graph([{"cpu": (1.0, 2.0)}] * 4)
    >>> old = solve(g, cluster_of(["cpu", "cpu"]), solver="uniform", microbatches=4)
    >>> slow = chain_graph([{"cpu": (1.0, 2.0)}] * 3 + [{"cpu": (4.0, 8.0)}])
    >>> r = replan_graph(old, slow, solver="dp")
    >>> r.diff.new_step_ms < r.diff.old_step_ms
    True
    >>> dp = solve(g, cluster_of(["cpu", "cpu"]), solver="dp", microbatches=1)
    >>> slowed = replace(dp.cluster, devices=(dp.cluster.devices[0], replace(dp.cluster.devices[1], kind="cpu~d1")))
    >>> g2 = chain_graph([{"cpu": (1.0, 2.0), "cpu~d1": (3.0, 6.0)}] * 4, batch_size=8)
    >>> [st.rows for st in dp.stages], [st.rows for st in move_rows(dp, g2, cluster=slowed).plan.stages]
    ([()], [(6, 2)])
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping

from .costgraph import CostGraph, block_key
from .compression import Compression
from .errors import HpmlError, OptionError, PlanError
from .ir import Cluster, Precision, Profile
from .memory import compute_bytes
from .plan import Plan, Schedule, with_comm
from .simulate import annotate
from .solve import SolverName, solve
from .stagecost import choose_rows

__all__ = ["PlanDiff", "ReplanResult", "plan_diff", "replan_graph", "without_devices", "carried_comm", "move_rows"]


@dataclass(frozen=True, slots=True)
class PlanDiff:
    """What a new plan changes against an old one, scored on the same (new) costs.

    Attributes:
        moved: ``(fx node, old stage, new stage)`` for every node whose stage changed.
        old_stages, new_stages: per stage, its devices.
        old_step_ms: the old plan's predicted step time on the new costs.
        new_step_ms: the new plan's predicted step time.
        old_claimed_ms: what the old plan predicted when it was made.
        old_rows, new_rows: per stage, its replicas' rows per microbatch (``()``: an equal split).
    """

    moved: tuple[tuple[str, int, int], ...]
    old_stages: tuple[tuple[str, ...], ...]
    new_stages: tuple[tuple[str, ...], ...]
    old_step_ms: float
    new_step_ms: float
    old_claimed_ms: float
    old_rows: tuple[tuple[int, ...], ...] = ()
    new_rows: tuple[tuple[int, ...], ...] = ()

    @property
    def gain(self) -> float:
        """Predicted speed-up of the new plan over the old one on the new costs (1.0: none)."""
        return self.old_step_ms / self.new_step_ms if self.new_step_ms > 0 else 1.0

    @property
    def changed(self) -> bool:
        return bool(self.moved) or self.old_stages != self.new_stages or self.old_rows != self.new_rows

    def summary(self, scope_of: Callable[[str], str] | None = None) -> str:
        """Text for a person: stage devices, the blocks that moved, step time old -> new."""
        lines = [f"step time: {self.old_step_ms:.4g} ms (old plan, on the new costs; it predicted "
                 f"{self.old_claimed_ms:.4g} ms) -> {self.new_step_ms:.4g} ms (new plan): {self.gain:.2f}x"]
        if self.old_stages != self.new_stages:
            lines.append("stages: " + " | ".join(",".join(d) for d in self.old_stages) + "  ->  "
                         + " | ".join(",".join(d) for d in self.new_stages))
        if self.old_rows != self.new_rows and self.old_stages == self.new_stages:
            for k, (a, b) in enumerate(zip(self.old_rows, self.new_rows)):
                if a != b:
                    lines.append(f"  rows of stage {k} ({','.join(self.new_stages[k])}): "
                                 f"{':'.join(map(str, a)) or 'even'} -> {':'.join(map(str, b)) or 'even'}")
        groups: dict[tuple[str, int, int], int] = {}
        for node, a, b in self.moved:
            key = (block_key(scope_of(node)) if scope_of else node, a, b)
            groups[key] = groups.get(key, 0) + 1
        for (block, a, b), n in groups.items():
            lines.append(f"  moved {block or '(top level)'} ({n} node{'s' if n > 1 else ''}): stage {a} -> stage {b}")
        if not self.changed:
            lines.append("  no node moved: the old plan is still the best one predicted")
        elif not self.moved and self.old_stages == self.new_stages:
            lines.append("  no node moved: the same stages on the same devices")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ReplanResult:
    """The plan to run (new, or the old one kept) and the diff that justifies it."""

    plan: Plan
    diff: PlanDiff
    switched: bool


def plan_diff(old: Plan, new: Plan, old_step_ms: float) -> PlanDiff:
    """Compare two plans of one model (``old_step_ms``: the old plan scored on the new costs)."""
    where = {n: st.index for st in old.stages for n in st.nodes}
    moved = tuple((n, where[n], st.index) for st in new.stages for n in st.nodes
                  if n in where and where[n] != st.index)
    return PlanDiff(moved, tuple(st.devices for st in old.stages), tuple(st.devices for st in new.stages),
                    old_step_ms, new.predicted.step_ms, old.predicted.step_ms,
                    tuple(st.rows for st in old.stages), tuple(st.rows for st in new.stages))


def without_devices(cluster: Cluster, lost: Iterable[str]) -> Cluster:
    """The cluster less the ``lost`` devices (and their links).

    Raises:
        HpmlError: naming a device that is not in the cluster, or when none would be left.
    """
    gone = set(lost)
    unknown = gone - {d.name for d in cluster.devices}
    if unknown:
        raise HpmlError(f"cannot drop {sorted(unknown)}: cluster {cluster.name} has {[d.name for d in cluster.devices]}")
    devices = tuple(d for d in cluster.devices if d.name not in gone)
    if not devices:
        raise HpmlError(f"no device of cluster {cluster.name} is left after dropping {sorted(gone)}")
    links = tuple(x for x in cluster.links if x.a not in gone and x.b not in gone)
    hosts = tuple(h for h in cluster.hosts if any(d.host == h.name for d in devices))  # what the links follow from
    return Cluster(devices, links, f"{cluster.name}-minus-{'-'.join(sorted(gone))}", hosts=hosts)


def carried_comm(old: Plan) -> tuple[str | None, dict[str, Any]]:
    """The user's communication options a running plan records, which its re-plan must keep.

    Args:
        old: the running plan.

    Returns:
        ``(allowed, forced)``: the compression the solver may choose again (``Plan.allow_compress``, None for
        none), and the :func:`hpml_compile.plan.with_comm` options to put on the new plan: ``compress`` where
        stages were compressed without an allowance (the user's ``--compress``; the most common value if a
        hand-edited plan mixes them), ``sync_every`` / ``sync_warmup`` under local SGD, ``reduce_dtype`` where
        not fp32.

    >>> from hpml_compile.testing import chain_graph, cluster_of
    >>> from hpml_compile.solve import solve
    >>> p = with_comm(solve(chain_graph([{"cpu": (1.0, 2.0)}] * 2), cluster_of(["cpu", "cpu"]), solver="uniform",
    ...               microbatches=1), sync_every=4, sync_warmup=2)
    >>> carried_comm(p)
    (None, {'sync_every': 4, 'sync_warmup': 2})
    """
    forced: dict[str, Any] = {}
    chosen = Counter(st.compress for st in old.stages if st.compress)
    if chosen and not old.allow_compress:
        forced["compress"] = chosen.most_common(1)[0][0]
    if old.sync_every > 1:
        forced.update(sync_every=old.sync_every, sync_warmup=old.sync_warmup)
    if old.reduce_dtype is not Precision.FP32:
        forced["reduce_dtype"] = old.reduce_dtype.value
    return old.allow_compress or None, forced


def replan_graph(old: Plan, graph: CostGraph, *, cluster: Cluster | None = None,
                 solver: SolverName | str = SolverName.ILP, microbatches: int | None = None,
                 schedule: Schedule | str | None = None, time_limit_s: float = 30.0, dtype: str = "float32",
                 progress: Callable[[str], None] | None = None,
                 score_graph: CostGraph | None = None, allow_compress: Compression | str | None = None,
                 comm: Mapping[str, Any] | None = None, hierarchical: bool = True) -> ReplanResult:
    """Re-solve on ``graph`` (new costs) and keep the old plan unless the new one is predicted faster.

    Args:
        old: the plan running now.
        graph: the cost graph of the new (measured) profile, coarsened, for the solver.
        cluster: the devices to plan for (default: the old plan's).
        solver, microbatches, schedule, time_limit_s, dtype, progress: as for :func:`hpml_compile.solve.solve`;
            microbatches and schedule default to the old plan's.
        score_graph: the graph both plans are scored on (default ``graph``). Coarsening by cost depends on
            the costs, so the old plan's stages need not align with ``graph``'s blocks; the profile's own
            nodes (``costgraph.build(profile)``, not coarsened) score any plan, and give the same figures
            as its blocks (coarsening keeps every sum).
        allow_compress: a compression the solver may choose per stage (recorded in the new plan).
        comm: the user's options to put on the new plan (:func:`hpml_compile.plan.with_comm`: ``compress`` on
            every replicated stage, local SGD), before it is scored.
        hierarchical: let a stage whose replicas span hosts all-reduce hierarchically where faster.

    Returns:
        The plan to run, its diff against the old one, and whether it switched.

    Raises:
        InfeasibleError: nothing fits on ``cluster``.
        PlanError: the old plan cannot run on ``cluster`` and the new one cannot run the user's ``comm``.
    """
    target = cluster or old.cluster
    sched = Schedule(schedule) if schedule else old.schedule
    scorer = score_graph or graph
    new = solve(graph, target, solver=solver, microbatches=microbatches or old.microbatches, schedule=sched,
                time_limit_s=time_limit_s, dtype=dtype, compute_bytes=compute_bytes(old.precision.value),
                progress=progress, compress=allow_compress, hierarchical=hierarchical,
                reduce_dtype=(comm or {}).get("reduce_dtype", "fp32"))
    new = replace(new, precision=old.precision,  # the measured profile was timed as the old plan trains
                  allow_compress=str(allow_compress or ""))
    refused: PlanError | None = None
    if comm:  # the user's options, on the new plan as it will run
        try:
            new = with_comm(new, **comm)
        except OptionError:  # compression or a reduce dtype, but the new plan has no replicated stage: no gradient sync
            new = with_comm(new, **{k: v for k, v in comm.items() if k not in ("compress", "reduce_dtype")},
                            reduce_dtype="fp32")
        except PlanError as e:  # local SGD on a stage the solver sharded: not a plan the runtime performs
            refused = e
    if score_graph is not None or comm:
        new, _ = annotate(new, scorer, dtype)
    same_devices = {d.name for d in target.devices} >= {d for st in old.stages for d in st.devices}
    fits = same_devices
    if same_devices:  # scored on the devices as they are now (a slowed device may have a kind of its own)
        rescored, _ = annotate(replace(old, cluster=target), scorer, dtype)
        old_ms = rescored.predicted.step_ms
        # a device whose memory is now less than the old plan needs there (the runtime measured more than
        # predicted): the old plan cannot run either
        fits = all(st.predicted.memory_bytes <= target.device(d).memory_bytes
                   for st in rescored.stages for d in st.devices)
    if not fits:  # the old plan cannot run any more: any feasible plan is a gain
        if refused is not None:
            raise PlanError(f"re-plan: the running plan no longer fits, and the new one cannot keep the user's "
                            f"communication options: {refused}") from refused
        rescored, old_ms = old, float("inf")
    if fits and (refused is not None or old_ms <= new.predicted.step_ms):
        return ReplanResult(rescored, plan_diff(old, rescored, old_ms), switched=False)
    return ReplanResult(new, plan_diff(old, new, old_ms), switched=True)


def move_rows(old: Plan, graph: CostGraph, *, cluster: Cluster | None = None, stages: Iterable[int] | None = None,
              dtype: str = "float32") -> ReplanResult:
    """The old plan with new rows per replica in its replicated stages, and nothing else changed.

    Each chosen stage's replicas get the integer rows per microbatch that make
    the slowest of them fastest on ``graph``'s costs
    (:func:`~hpml_compile.stagecost.choose_rows` with each replica's fixed and
    per-row time on its own kind: a slowed device, a kind of its own, gets
    fewer); stages, devices, microbatches and schedule stay. Both plans are
    scored by the simulator on ``graph`` (as :func:`replan_graph` scores), so
    the two candidates of the closed loop compare on the same costs.

    Args:
        old: the plan running now.
        graph: the costs to move rows on: a graph whose nodes each lie in one stage of ``old`` (the
            profile's own nodes, ``costgraph.build(profile)``), with costs for every kind of ``cluster``.
        cluster: the devices as they are now (default the old plan's; a slowed device may have a kind of its own).
        stages: the stages whose rows may change (default: every stage with more than one device).
        dtype: parameter dtype.

    Returns:
        The plan with the new rows (``switched`` when some rows changed and it is predicted faster), or the old
        plan rescored (``switched`` False).

    Raises:
        HpmlError: a microbatch of ``graph``'s batch does not split into whole rows, or has fewer rows than
            a stage has replicas.
    """
    target = cluster or old.cluster
    m = old.microbatches
    if graph.batch_size % m:
        raise HpmlError(f"a batch of {graph.batch_size} rows does not split into {m} microbatches: no rows to move")
    per_mb = graph.batch_size // m
    chosen = {st.index for st in old.stages if len(st.devices) > 1} if stages is None else set(stages)
    fx_stage = {n: st.index for st in old.stages for n in st.nodes}
    nodes: dict[int, list[str]] = {}
    for g in graph.order:
        nodes.setdefault(fx_stage.get(graph.node(g).members[0], -1), []).append(g)
    new_stages = []
    groups = len(old.stages) // old.chunks  # interleaved 1F1B: a device group's chunks take the same rows
    chosen = {k % groups for k in chosen}
    for st in old.stages:
        if st.index % groups not in chosen or len(st.devices) < 2:
            new_stages.append(st)
            continue
        held = [n for k in range(st.index % groups, len(old.stages), groups) for n in nodes.get(k, [])]
        fixed, per_row = [], []
        for d in st.devices:
            kind = target.device(d).kind
            zero = [graph.cost_at(n, kind, 0.0) for n in held]
            one = [graph.cost_at(n, kind, 1.0 / graph.batch_size) for n in held]
            fixed.append(sum(f + b for f, b in zero))
            per_row.append(max(sum(f + b for f, b in one) - fixed[-1], 1e-12))
        try:
            rows = choose_rows(fixed, per_row, per_mb)
        except ValueError as e:
            raise HpmlError(f"cannot move rows in stage {st.index}: {e}") from None
        even = len(set(rows)) == 1
        new_stages.append(replace(st, rows=() if even and not st.rows else rows))
    rescored, _ = annotate(replace(old, cluster=target), graph, dtype)
    candidate, _ = annotate(replace(old, cluster=target, stages=tuple(new_stages)), graph, dtype)
    changed = any(a.rows != b.rows for a, b in zip(old.stages, candidate.stages))
    old_ms = rescored.predicted.step_ms
    if changed and candidate.predicted.step_ms < old_ms:
        return ReplanResult(candidate, plan_diff(old, candidate, old_ms), switched=True)
    return ReplanResult(rescored, plan_diff(old, rescored, old_ms), switched=False)
