"""Uneven data parallelism: plans whose stages' replicas are devices of different kinds, each with its own rows.

The solvers (:mod:`.ilp`, :mod:`.dp`, :mod:`.lagrange`) place a stage on
devices of one kind with equal rows each, so on a mixed cluster an A100 and a
V100 can never share a stage. This module proposes plans that do, and scores
each with the simulator (:func:`hpml_compile.simulate.annotate`), the one cost
model every plan is compared on; :func:`improve` returns the fastest of them
and the solver's own plan, so its result is never slower than the solver's.
It is a separate pass over the solver's result rather than a change to the
candidate table: a mixed group's cost depends on the rows its replicas get,
which the table's per-(range, kind, degree) prices cannot express.

Every candidate is built by :func:`.mixed.build_plan`: rows per replica from
:func:`hpml_compile.stagecost.choose_rows`, each capped at what its memory
holds, and each stage the first memory configuration of :data:`.mixed.CONFIGS`
that fits (ZeRO 0-2, recompute, the Adam state offloaded on a group of GPUs;
swap and ZeRO-3 are not tried).

The candidates, for every microbatch count that splits the batch into at
least one row per replica:

- ``data-parallel``: one stage over every device, or over the fastest ``k``
  (a device too slow to pay its share of the fixed costs is better left out);
- ``extend``: the solver's plan with each idle device added to the stage it
  helps most, greedily, until none helps;
- ``merge``: the solver's plan with neighbouring stages merged into one over
  both groups (a shorter pipeline, a smaller bubble, for a gradient sync);
- ``mixed-pipeline``: ``S`` stages, each a group of devices of about equal
  total speed (devices dealt out fastest first, back and forth), the chain cut
  so that each stage's time is balanced;
- ``local-search``: steepest descent over plan shapes (:func:`local_search`)
  from the fastest plan the families above found, then from the solver's: a
  device moved to another stage, left out, brought in, or swapped with one of
  another stage (:func:`moved_devices`); a stage boundary moved one or two cut
  points (:func:`shifted_cuts`); the microbatch count changed to the next
  divisor of the batch (:func:`other_counts`), which moves the rows and the
  bubble together. Each neighbour's rows and memory configuration are chosen
  again, so the search sees rows, groups, cuts and ``M`` jointly.

What was chosen is written into the plan's solver name (``portfolio+uneven:data-parallel``) and returned by :func:`improve`.

The search runs within a budget (:class:`Budget`), checked before every plan it builds or simulates, so
what it adds to the solver's time is bounded whatever the cluster; it says how many families it got
through, in what time, against what budget. On a large cluster its neighbourhoods grow with the device
classes (kind, memory, host: :func:`device_class`) rather than the devices: one device of a class stands
for the others in a move or swap, and one stage's ``k`` devices are tried at the counts of
:func:`group_sizes`.

Example:
    >>> from hpml_compile.solve import solve
    >>> from hpml_compile.testing import chain_graph, cluster_of
    >>> g = chain_graph([{"fast": (1.0, 2.0), "slow": (3.0, 6.0)}] * 4)
    >>> c = cluster_of(["fast", "slow"])
    >>> best = improve(g, c, solve(g, c, solver="dp", microbatches=2))
    >>> best.plan.stages[0].rows, best.chosen
    ((768, 256), 'data-parallel')
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Hashable, Iterator, Sequence

from ..costgraph import CostGraph
from ..errors import HpmlError
from ..ir import Cluster, Device
from ..plan import Plan, Schedule, SolverInfo, SolverStatus
from ..simulate import annotate, step_ms
from .baselines import balanced_cuts, cut_points
from .candidates import Chain
from .mixed import CONFIGS, Score, allowed, build_plan, fastest, microbatch_counts, stage_blocks, stage_rows

__all__ = ["CONFIGS", "FAMILIES", "Budget", "Uneven", "Shape", "group_sizes", "device_class", "stage_rows",
           "build_plan", "improve", "data_parallel", "extend", "merge", "mixed_pipeline", "local_search", "shape_of", "moved_devices", "shifted_cuts", "other_counts"]

@dataclass(frozen=True, slots=True)
class Uneven:
    """What :func:`improve` chose.

    Attributes:
        plan: the fastest plan (the solver's own when nothing beat it).
        chosen: ``"solver"``, or the family of the winning candidate (``data-parallel``, ``extend``,
            ``merge``, ``mixed-pipeline``, ``local-search``).
        base_ms: the solver's plan's simulated step.
        tried: candidate plans simulated.
    """

    plan: Plan
    chosen: str
    base_ms: float
    tried: int


def _speed(graph: CostGraph, dev: Device) -> float:
    """Whole-batch steps per millisecond of ``dev`` on the model (fwd + bwd), the dealing order's key."""
    return 1.0 / max(1e-12, graph.total("", kind=dev.kind))


def _no_check() -> None:
    """The budget check of a search run on its own (no time limit)."""


#: Up to this many devices, :func:`data_parallel` tries every ``k``; beyond, the counts of :func:`group_sizes`.
EVERY_K = 64


def group_sizes(speeds: Sequence[float], every: int = EVERY_K) -> list[int]:
    """The group sizes ``k`` :func:`data_parallel` tries over devices sorted fastest first (``speeds``).

    Every ``k`` from 2 up to ``every`` devices; on a larger cluster, the powers of two, each ``k`` where the
    speed changes (every device of the faster kinds in) and all of them: the step changes smoothly between
    those (each added device of one speed takes a like share of the rows), so the search stays linear in
    the kinds rather than quadratic in the devices.
    """
    n = len(speeds)
    if n <= every:
        return list(range(2, n + 1))
    ks = {n, *(2 ** i for i in range(1, n.bit_length()) if 2 ** i <= n)}
    ks.update(k for k in range(2, n) if speeds[k] != speeds[k - 1])
    return sorted(ks)


def data_parallel(graph: CostGraph, cluster: Cluster, score: Score, *, microbatches: int | None = None,
                  schedule: Schedule = Schedule.ONE_F_ONE_B, dtype: str = "float32",
                  check: Callable[[], None] = _no_check) -> list[Plan]:
    """One stage over the fastest ``k`` devices (``k`` of :func:`group_sizes`), uneven rows; the best plan
    per ``k``. ``check`` is called before each plan is built (the caller's budget stops the search by raising)."""
    fast = sorted(cluster.devices, key=lambda d: -_speed(graph, d))
    out = []

    def built(devs: list[str], m: int, first: int) -> Plan | None:
        check()
        return build_plan(graph, cluster, [devs], [0, len(graph.order)], m, schedule, dtype, "data-parallel",
                          CONFIGS[first:])

    for k in group_sizes([_speed(graph, d) for d in fast]):
        devs = [d.name for d in fast[:k]]
        # one stage: each configuration that fits, not only the first (the first that fits may sync more)
        best = fastest((built(devs, m, first)
                        for m in microbatch_counts(graph, k, microbatches) for first in range(len(CONFIGS))), score)
        if best is not None:
            out.append(best)
    return out


def mixed_pipeline(graph: CostGraph, cluster: Cluster, score: Score, *, microbatches: int | None = None,
                   schedule: Schedule = Schedule.ONE_F_ONE_B, dtype: str = "float32",
                   max_stages: int = 8, check: Callable[[], None] = _no_check) -> list[Plan]:
    """``S`` stages (2 .. ``max_stages``, at most half the devices), each a group of about equal speed with
    devices of several kinds, the chain cut to balance time; the best plan per ``S`` (``check``: before each
    plan is built)."""
    chain = Chain.of(graph)
    fast = sorted(cluster.devices, key=lambda d: -_speed(graph, d))
    kind = fast[0].kind
    weights = [sum(graph.node(n).cost[kind]) for n in graph.order]
    out = []
    for s in range(2, min(max_stages, len(fast) // 2) + 1):
        groups: list[list[str]] = [[] for _ in range(s)]
        for i, d in enumerate(fast):  # deal fastest first, back and forth: groups of about equal speed
            r = i % (2 * s)
            groups[r if r < s else 2 * s - 1 - r].append(d.name)
        cuts = balanced_cuts(chain, s, weights)
        if len(cuts) - 1 != s:
            continue
        def built(m: int, groups: list[list[str]] = groups, cuts: list[int] = cuts) -> Plan | None:
            check()
            return build_plan(graph, cluster, groups, cuts, m, schedule, dtype, "mixed-pipeline")

        best = fastest((built(m) for m in microbatch_counts(graph, max(len(g) for g in groups), microbatches)),
                       score)
        if best is not None:
            out.append(best)
    return out


def extend(graph: CostGraph, cluster: Cluster, base: Plan, score: Score, *, dtype: str = "float32",
           check: Callable[[], None] = _no_check) -> list[Plan]:
    """``base`` with idle devices added, one at a time, each to the stage where it shortens the step most
    (rows chosen again for that stage), until no idle device helps; [] when none ever does (``check``: before
    each stage's rows are chosen)."""
    blocks_of = stage_blocks(graph, base)
    current, best_t = base, score(base)
    idle = [d.name for d in cluster.devices if d.name not in {x for st in base.stages for x in st.devices}]
    improved = False
    while idle:
        found: tuple[float, Plan, str] | None = None
        for dev in idle:
            for st in current.stages:
                if st.tp > 1:  # a tensor-parallel stage grows by whole groups on one host, not a device at a time
                    continue
                devs = [*st.devices, dev]
                for zero, rec, off in [(st.zero, st.recompute, st.offload_optimizer), *CONFIGS]:
                    if not allowed(cluster, devs, off, current.schedule):
                        continue
                    check()
                    rows = stage_rows(graph, cluster, blocks_of[st.index], devs, microbatches=current.microbatches,
                                      schedule=current.schedule, index=st.index, stages=len(current.stages),
                                      zero=zero, recompute=rec, dtype=dtype, offload=off)
                    if rows is None:
                        continue
                    even = len(set(rows)) == 1 and len({cluster.device(d).kind for d in devs}) == 1
                    new = replace(st, devices=tuple(devs), rows=() if even else rows, zero=zero, recompute=rec,
                                  swap=(), offload_optimizer=off)
                    cand = replace(current, stages=tuple(new if x.index == st.index else x for x in current.stages),
                                   solver=SolverInfo("extend"))
                    t = score(cand)
                    if t < best_t and (found is None or t < found[0]):
                        found = (t, cand, dev)
                    break
        if found is None:
            break
        best_t, current, _ = found
        idle.remove(found[2])
        improved = True
    return [current] if improved else []


def merge(graph: CostGraph, cluster: Cluster, base: Plan, score: Score, *, microbatches: int | None = None,
          dtype: str = "float32", check: Callable[[], None] = _no_check) -> list[Plan]:
    """``base``'s stages with neighbours merged into one stage over both groups (rows chosen again, the
    kinds mixed where they differ): a shorter pipeline, so a smaller bubble, for a gradient sync; greedily,
    the merge that shortens the step most first, at every microbatch count that leaves the merged groups
    a row per replica. [] when no merge helps (``check``: before each plan is built)."""
    blocks_of = stage_blocks(graph, base)
    base_cuts = [0]
    for blocks in blocks_of:
        base_cuts.append(base_cuts[-1] + len(blocks))
    best_t, out = score(base), []
    for m in microbatch_counts(graph, 1, microbatches):
        groups, cuts = [list(st.devices) for st in base.stages], list(base_cuts)
        current: Plan | None = None
        while len(groups) > 1:
            found: tuple[float, Plan, int] | None = None
            for i in range(len(groups) - 1):
                g2 = [*groups[:i], groups[i] + groups[i + 1], *groups[i + 2:]]
                if graph.batch_size // m < max(len(g) for g in g2):
                    continue
                check()
                p = build_plan(graph, cluster, g2, [*cuts[:i + 1], *cuts[i + 2:]], m, base.schedule, dtype, "merge")
                t = score(p) if p is not None else float("inf")
                if p is not None and (found is None or t < found[0]):
                    found = (t, p, i)
            if found is None or (current is not None and found[0] >= score(current)):
                break
            _, current, i = found
            groups = [*groups[:i], groups[i] + groups[i + 1], *groups[i + 2:]]
            cuts = [*cuts[:i + 1], *cuts[i + 2:]]
        if current is not None and score(current) < best_t:
            best_t = score(current)
            out = [current]
    return out


#: A plan's shape for the local search: devices per stage, stage boundaries (positions in ``graph.order``),
#: microbatch count.
Shape = tuple[tuple[tuple[str, ...], ...], tuple[int, ...], int]


def shape_of(graph: CostGraph, plan: Plan) -> Shape:
    """``plan``'s devices per stage, boundaries in ``graph.order`` and microbatch count (its rows, memory
    configurations and communication options are chosen again when the shape is built)."""
    cuts = [0]
    for blocks in stage_blocks(graph, plan):
        cuts.append(cuts[-1] + len(blocks))
    return tuple(st.devices for st in plan.stages), tuple(cuts), plan.microbatches


def moved_devices(shape: Shape, devices: Sequence[str],
                  alike: Callable[[str], Hashable] | None = None) -> Iterator[Shape]:
    """Every shape with one device moved: from a stage of several devices to another stage or out of the plan,
    or from ``devices`` not in the plan into a stage; and with two devices of different stages swapped.

    With ``alike`` (a device's class: devices of one class are interchangeable to the cost model), one
    device per class stands for the others: a move is tried once per class and stage, a swap once per
    pair of classes of two stages and never between devices of one class. On a cluster of hundreds of
    devices of a few kinds this turns the neighbourhood from quadratic in the devices to quadratic in the
    stages.
    """
    groups, cuts, m = shape
    used = {d for g in groups for d in g}
    key = alike or (lambda d: d)
    reps = [_one_per_class(g, key) for g in groups]
    idle = _one_per_class(tuple(d for d in devices if d not in used), key)

    def put(i: int, group: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
        return tuple(group if j == i else g for j, g in enumerate(groups))

    for i, g in enumerate(groups):
        if len(g) < 2:
            continue  # a stage keeps at least one device (the cut search removes stages: merge)
        for d in reps[i]:
            rest = tuple(x for x in g if x != d)
            yield put(i, rest), cuts, m
            for j, h in enumerate(groups):
                if j != i:
                    yield tuple(rest if k == i else (*h, d) if k == j else x for k, x in enumerate(groups)), cuts, m
    for d in idle:
        for j, h in enumerate(groups):
            yield put(j, (*h, d)), cuts, m
    for i, g in enumerate(groups):
        for j in range(i + 1, len(groups)):
            for a in reps[i]:
                for b in reps[j]:
                    if alike is not None and key(a) == key(b):
                        continue  # two devices of one class: the same plan
                    yield tuple(tuple(b if x == a else x for x in g) if k == i else
                                tuple(a if x == b else x for x in groups[j]) if k == j else x
                                for k, x in enumerate(groups)), cuts, m


def _one_per_class(group: tuple[str, ...], key: Callable[[str], Hashable]) -> tuple[str, ...]:
    """The last device of each class of ``group`` (each device when ``key`` is the name), in order of the
    classes' first appearance."""
    last: dict[Hashable, str] = {}
    for d in group:
        last[key(d)] = d
    return tuple(last.values())


def shifted_cuts(shape: Shape, points: Sequence[int], steps: Sequence[int] = (1, 2)) -> Iterator[Shape]:
    """Every shape with one stage boundary moved ``steps`` cut points (of ``points``, the positions where a
    stage may end) earlier or later, the stages keeping at least one block each."""
    groups, cuts, m = shape
    where = {p: k for k, p in enumerate(points)}
    for i in range(1, len(cuts) - 1):
        k = where.get(cuts[i])
        if k is None:
            continue
        for step in steps:
            for j in (k - step, k + step):
                if 0 <= j < len(points) and cuts[i - 1] < points[j] < cuts[i + 1]:
                    yield groups, (*cuts[:i], points[j], *cuts[i + 1:]), m


def other_counts(shape: Shape, counts: Sequence[int]) -> Iterator[Shape]:
    """The shape at the next smaller and the next larger microbatch count of ``counts`` (fewer, larger
    microbatches give the rows of a stage finer steps; more shrink the pipeline's bubble)."""
    groups, cuts, m = shape
    smaller = [c for c in counts if c < m]
    larger = [c for c in counts if c > m]
    for c in ([smaller[-1]] if smaller else []) + ([larger[0]] if larger else []):
        yield groups, cuts, c


def device_class(cluster: Cluster) -> Callable[[str], Hashable]:
    """A device's class for :func:`moved_devices`: its kind, memory, whether it is a CPU, and its host (the
    links a replica's all-reduce crosses); devices of one class are interchangeable to the cost model."""
    return lambda name: (lambda d: (d.kind, d.memory_bytes, d.is_cpu, d.host))(cluster.device(name))


def local_search(graph: CostGraph, cluster: Cluster, start: Plan, score: Score, *, microbatches: int | None = None,
                 dtype: str = "float32", check: Callable[[], None] = _no_check) -> list[Plan]:
    """Steepest descent from ``start`` over plan shapes.

    Each round builds every neighbour of the current shape (a device moved or two swapped,
    :func:`moved_devices`; a stage boundary moved, :func:`shifted_cuts`; the microbatch count changed,
    :func:`other_counts`, unless the user fixed it), rows and memory configuration chosen again by
    :func:`build_plan`, and moves to the fastest if it beats the current plan; a shape is built once.

    Args:
        graph: the cost graph.
        cluster: the devices (those ``start`` leaves idle may be brought in).
        start: where to start (its schedule is kept).
        score: a plan's simulated step.
        microbatches: a count the user fixed (None: searched).
        dtype: parameter dtype.
        check: called before each neighbour is built; the caller's stops the search at its time limit by raising.

    Returns:
        The plan where the descent stopped, or [] when no neighbour of ``start`` is faster.
    """
    points = cut_points(Chain.of(graph))
    counts = microbatch_counts(graph, 1, microbatches)
    names = [d.name for d in cluster.devices]
    alike = device_class(cluster)
    shape, best_t, current = shape_of(graph, start), score(start), None
    seen = {shape}
    while True:
        found: tuple[float, Plan, Shape] | None = None
        moves = [*shifted_cuts(shape, points), *(other_counts(shape, counts) if microbatches is None else ()),
                 *moved_devices(shape, names, alike)]
        for nxt in moves:
            groups, cuts, m = nxt
            if nxt in seen or graph.batch_size // m < max(len(g) for g in groups):
                continue
            seen.add(nxt)
            check()
            p = build_plan(graph, cluster, groups, cuts, m, start.schedule, dtype, "local-search")
            t = score(p) if p is not None else float("inf")
            if p is not None and t < best_t and (found is None or t < found[0]):
                found = (t, p, nxt)
        if found is None:
            return [current] if current is not None else []
        best_t, current, shape = found


class _OutOfTime(Exception):
    """The search's time limit passed: the best plan scored so far stands."""


class Budget:
    """The uneven search's time budget, checked before every plan it builds or scores.

    Args:
        seconds: how long the search may run.
        clock: seconds now (default :func:`time.perf_counter`); a test passes its own to make the deadline
            deterministic.
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = seconds
        self.clock = clock
        self.start = clock()
        self.checks = 0

    def check(self) -> None:
        """Count one unit of work; raise :class:`_OutOfTime` once the budget is spent."""
        self.checks += 1
        if self.clock() - self.start > self.seconds:
            raise _OutOfTime

    def spent(self) -> float:
        """Seconds since the search started, by the budget's clock."""
        return self.clock() - self.start


#: The families of :func:`improve`, in the order they run.
FAMILIES = ("data-parallel", "extend", "merge", "mixed-pipeline", "local-search", "local-search from the solver's")


def improve(graph: CostGraph, cluster: Cluster, base: Plan, *, dtype: str = "float32",
            microbatches: int | None = None, time_limit_s: float = 10.0,
            progress: Callable[[str], None] | None = None,
            clock: Callable[[], float] = time.perf_counter) -> Uneven:
    """The fastest of ``base`` and the uneven candidates (module docstring), all scored by the simulator.

    On a cluster of one device kind nothing is tried and ``base`` comes back: equal rows are already what
    choose_rows gives equal devices, and which of them to group is the solver's own search. Every plan
    built or scored is first checked against the budget (:class:`Budget`), and past ``time_limit_s`` the
    search stops with the best so far, so what it adds to the solver's time is bounded; one line says how
    far it got, in what time, against what budget.

    Args:
        graph: the cost graph ``base`` was solved on (each block within one stage of ``base``).
        cluster: the devices.
        base: the solver's plan (its schedule is kept; ``microbatches``, when given, is kept too).
        dtype: parameter dtype.
        microbatches: a count the user fixed (None: searched over the batch's divisors).
        time_limit_s: the search's budget in seconds.
        progress: called with the line saying what was searched and what won.
        clock: the budget's clock (:class:`Budget`).

    Returns:
        The chosen plan (with the simulator's predictions and, when a candidate won, solver name
        ``<base>+uneven:<family>``, status ``heuristic``) and what was tried.
    """
    t0 = time.perf_counter()
    budget = Budget(time_limit_s, clock)
    say = progress or (lambda _: None)
    seen: dict[int, tuple[Plan, float]] = {}
    base_ms = base.predicted.step_ms if base.predicted.step_ms > 0 else annotate(base, graph, dtype)[1].step_ms
    best: list[tuple[float, Plan]] = [(base_ms, base)]
    seen[id(base)] = (base, base_ms)

    def score(p: Plan) -> float:
        if id(p) in seen:
            return seen[id(p)][1]
        budget.check()
        try:
            t = step_ms(p, graph, dtype)  # the step alone: no per-device bars or memory curves
        except HpmlError:
            t = float("inf")
        seen[id(p)] = (p, t)  # the plan is kept, so its id is not reused
        if t < best[0][0]:
            best[0] = (t, p)
        return t

    kinds = sorted({d.kind for d in cluster.devices})
    if len(kinds) == 1:  # equal rows and the solver's own groups already
        say(f"uneven rows: skipped, every device is a {kinds[0]} (equal rows per replica are the solver's own)")
        return Uneven(base, "solver", base_ms, 1)
    check = budget.check
    families: list[Callable[[], object]] = [
        lambda: data_parallel(graph, cluster, score, microbatches=microbatches, schedule=base.schedule, dtype=dtype,
                              check=check),
        lambda: extend(graph, cluster, base, score, dtype=dtype, check=check),
        lambda: merge(graph, cluster, base, score, microbatches=microbatches, dtype=dtype, check=check),
        lambda: mixed_pipeline(graph, cluster, score, microbatches=microbatches, schedule=base.schedule,
                               dtype=dtype, check=check),
        # from the fastest plan so far, then from the solver's when that is another
        lambda: local_search(graph, cluster, best[0][1], score, microbatches=microbatches, dtype=dtype, check=check),
        lambda: local_search(graph, cluster, base, score, microbatches=microbatches, dtype=dtype, check=check)]
    done = 0
    try:
        for family in families:
            family()
            done += 1
        how = "searched"
    except _OutOfTime:
        how = f"stopped at its time limit in {FAMILIES[done]}:"
    tried = len(seen)
    say(f"uneven rows: {how} {done} of {len(families)} candidate families, {tried} plans simulated, in "
        f"{budget.spent():.1f} s (budget {time_limit_s:g} s)")
    if best[0][1] is base:
        say(f"uneven rows: none of {tried} candidate plans beat {base.solver.name}'s {base_ms:.4g} ms")
        return Uneven(base, "solver", base_ms, tried)
    family_name = best[0][1].solver.name
    annotated, _ = annotate(best[0][1], graph, dtype)
    info = SolverInfo(f"{base.solver.name}+uneven:{family_name}", SolverStatus.HEURISTIC, 0.0,
                      base.solver.seconds + time.perf_counter() - t0)
    plan = replace(annotated, solver=info, precision=base.precision)
    say(f"uneven rows: {family_name} {plan.predicted.step_ms:.4g} ms beats {base.solver.name}'s {base_ms:.4g} ms")
    return Uneven(plan, family_name, base_ms, tried)
