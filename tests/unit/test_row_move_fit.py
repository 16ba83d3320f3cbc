"""The rows a row move chooses where each call costs a fixed part: a slowed device is slower at every
part of its work, the fixed part included, and the rows chosen balance the replicas on those costs.

On CPU the per-call part of a replica's time (Python, kernel launches, reading the weights) is large: gpt-tiny's
profiles for local-cpu-2 at batch 48 put a microbatch's fixed part at 2 to 7 rows' worth of its per-row part.
A slowed replica pays its fixed part slowed too, so at one row it still takes ``slowdown x fixed``: the fast
replica can take far more than the ``1 / (1 + slowdown)`` share that per-row costs alone would give it. If the
measured graph put the whole slowdown in the per-row part instead, the move would give the slowed replica too
many rows; if it left the fixed part out, too few. These tests pin both halves: the slowed kind's costs
(:func:`~hpml_compile.runtime.observe.summary.measured_setup`) and the rows :func:`~hpml_compile.replan.move_rows` takes
from them, against every split the simulator can score.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpml_compile.costgraph import build as build_costgraph
from hpml_compile.ir import NodeCost, Profile
from hpml_compile.plan import Plan, Schedule, Stage
from hpml_compile.replan import move_rows
from hpml_compile.runtime.observe.monitor import StepMetrics
from hpml_compile.runtime.observe.summary import device_slowdowns, measured_setup, summarise
from hpml_compile.simulate import annotate
from hpml_compile.testing import chain_profile, cluster_of

BATCH, MICRO, NODES = 48, 2, 6
FWD, BWD = 2.0, 3.0  # per node, ms, at the profile's batch
FIXED = 0.125  # of each time, the part a call pays whatever its rows: ~7 rows' worth, gpt-tiny's most on CPU


def _profile() -> Profile:
    prof = chain_profile([(FWD, BWD)] * NODES, batch_size=BATCH)
    with_fixed = tuple(replace(n, cost={k: replace(c, fwd_fixed_ms=c.fwd_ms * FIXED, bwd_fixed_ms=c.bwd_ms * FIXED)
                                        for k, c in n.cost.items()}) for n in prof.nodes)
    return replace(prof, nodes=with_fixed)


def _plan(prof: Profile) -> Plan:
    stage = Stage(0, ("d0", "d1"), tuple(n.name for n in prof.nodes))
    base = Plan(model="toy", cluster=cluster_of(["cpu", "cpu"]), schedule=Schedule.GPIPE, microbatches=MICRO,
                stages=(stage,))
    return annotate(base, build_costgraph(prof))[0]


def _measured(plan: Plan, prof: Profile, factor: float, lost: tuple[float, float] = (0.0, 0.0),
              expect: float | None = None) -> tuple[Profile, object]:
    """The closed loop's measured profile and cluster after d1 computed ``factor`` x its first steps; d1 also
    waited ``lost[0]`` then ``lost[1]`` ms per step for a core (inside its compute, as ``contention_ms``)."""
    c = (plan.stages[0].predicted.fwd_ms + plan.stages[0].predicted.bwd_ms) * MICRO

    def steps(rank: int, compute: list[float], waited: list[float]) -> list[StepMetrics]:
        return [replace(StepMetrics(i, rank, 0, rank, f"d{rank}", MICRO, BATCH, 100.0, 100.0, x * 0.4, x * 0.6),
                        contention_ms=w) for i, (x, w) in enumerate(zip(compute, waited))]

    rows = {0: steps(0, [c] * 6, [0.0] * 6),
            1: steps(1, [c + lost[0]] * 3 + [c * factor + lost[1]] * 3, [lost[0]] * 3 + [lost[1]] * 3)}
    recent = {r: rs[3:] for r, rs in rows.items()}
    slow = device_slowdowns(plan, {r: rs[:3] for r, rs in rows.items()}, recent, 1.25)
    assert slow == {"d1": pytest.approx(factor if expect is None else expect)}
    return measured_setup(prof, summarise(plan, recent, skip=0), slow)


def test_the_slowed_kind_is_slower_at_its_fixed_part_too() -> None:
    prof = _profile()
    measured, cluster = _measured(_plan(prof), prof, 3.0)
    slowed = cluster.device("d1").kind  # type: ignore[attr-defined]
    assert slowed != "cpu" and cluster.device("d0").kind == "cpu"  # type: ignore[attr-defined]
    for n in measured.nodes:
        fast, slow = n.cost["cpu"], n.cost[slowed]
        assert isinstance(slow, NodeCost)
        # every part 3x: the fixed part of each direction, and the per-row part (time less fixed part)
        assert slow.fwd_fixed_ms == pytest.approx(3.0 * fast.fwd_fixed_ms) and fast.fwd_fixed_ms > 0
        assert slow.bwd_fixed_ms == pytest.approx(3.0 * fast.bwd_fixed_ms) and fast.bwd_fixed_ms > 0
        assert slow.fwd_ms - slow.fwd_fixed_ms == pytest.approx(3.0 * (fast.fwd_ms - fast.fwd_fixed_ms))
        assert slow.bwd_ms - slow.bwd_fixed_ms == pytest.approx(3.0 * (fast.bwd_ms - fast.bwd_fixed_ms))


@pytest.mark.parametrize("factor", [2.0, 3.0, 6.0])
def test_the_rows_chosen_are_the_fastest_split_on_the_fixed_and_per_row_costs(factor: float) -> None:
    prof = _profile()
    plan = _plan(prof)
    measured, cluster = _measured(plan, prof, factor)
    graph = build_costgraph(measured)
    r = move_rows(plan, graph, cluster=cluster)  # type: ignore[arg-type]
    assert r.switched
    chosen = r.plan.stages[0].rows
    per_mb = BATCH // MICRO
    # every split the move could have made, scored by the simulator on the same costs
    scored = {(a, per_mb - a): annotate(replace(plan, cluster=cluster, stages=(replace(plan.stages[0], rows=(
        a, per_mb - a)),)), graph)[0].predicted.step_ms for a in range(1, per_mb)}
    best = min(scored.values())
    assert scored[chosen] == pytest.approx(best, rel=1e-9), (chosen, sorted(scored.items(), key=lambda x: x[1])[:3])
    # the fixed part moves the split past the proportional share: the slowed replica's fixed part is paid slowed
    # at any rows, so the fast one takes more than factor / (1 + factor) of the rows (of 24 rows at 3x: 18)
    assert chosen[0] > per_mb * factor / (1 + factor) + 1
    # and the replicas finish together: their predicted compute differs by at most one row's time of the
    # replica that would take it (or the slowed one is down to its last row)
    kinds = [cluster.device(d).kind for d in plan.stages[0].devices]  # type: ignore[attr-defined]

    def compute(kind: str, rows: int) -> float:
        return sum(sum(graph.cost_at(n, kind, rows / BATCH)) for n in graph.order)

    times = [compute(k, n) for k, n in zip(kinds, chosen)]
    row_of = [compute(k, 1) - compute(k, 0) for k in kinds]
    assert abs(times[0] - times[1]) <= max(row_of) + 1e-9 or chosen[1] == 1, (chosen, times, row_of)


def test_the_slowdown_leaves_out_the_time_the_slowed_rank_waited_for_a_core() -> None:
    """On a shared host a rank's compute includes waiting for a core, which comes and goes with the host's other
    programs: in the few baseline steps it made a 3x-slowed rank look 2.6x (rows 17:7 chosen, the rank's own
    compute then 4x the other's). The slowed kind's multiplier is its compute less that waiting."""
    prof = _profile()
    plan = _plan(prof)
    c = (plan.stages[0].predicted.fwd_ms + plan.stages[0].predicted.bwd_ms) * MICRO
    # d1's first steps waited as long as they computed, its slowed ones not at all: 3x its own compute, not 1.5x
    measured, cluster = _measured(plan, prof, 3.0, lost=(c, 0.0), expect=3.0)
    noisy = move_rows(plan, build_costgraph(measured), cluster=cluster)  # type: ignore[arg-type]
    clean_measured, clean_cluster = _measured(plan, prof, 3.0)
    clean = move_rows(plan, build_costgraph(clean_measured), cluster=clean_cluster)  # type: ignore[arg-type]
    assert noisy.plan.stages[0].rows == clean.plan.stages[0].rows
    assert noisy.diff.new_step_ms == pytest.approx(clean.diff.new_step_ms, rel=0.05)
