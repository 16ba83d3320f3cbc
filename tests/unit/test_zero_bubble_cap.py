"""Memory-capped ZB-H1: a stage holds back at most its cap of weight-gradient parts, and the rest follows.

The lowering respects each stage's cap (0: 1F1B's order with each backward split; the stage's index: ZB-H1's
own), keeps every microbatch's ``I`` before its ``W`` and the messages in order; the validator refuses a list
over its cap; the simulator's bubble lies between 1F1B's and uncapped ZB-H1's and falls as the cap grows; the
plan carries the cap through plan.json; ``auto`` takes a capped ZB-H1 where the uncapped one does not fit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpml_compile import driver
from hpml_compile.costgraph import build
from hpml_compile.errors import PlanError, SchemaError, ScheduleError
from hpml_compile.ir import Profile
from hpml_compile.memory import GiB
from hpml_compile.plan import Plan, Schedule, Stage, fit_deferral, stage_memory, validate_plan
from hpml_compile.schedule import ActionKind, deferral, lower, op_order, relower
from hpml_compile.schedule_check import validate
from hpml_compile.simulate import annotate
from hpml_compile.stagecost import in_flight
from hpml_compile.testing import chain_profile, uniform_cluster

ZB, ONE = Schedule.ZB_H1, Schedule.ONE_F_ONE_B
F, B, I, W = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)


def _peaks(stage: int, stages: int, m: int, cap: int | None) -> tuple[int, int]:
    """The most weight-gradient parts held back before any F or I, and the most microbatches held (F done, W not)."""
    owed = held = most_owed = most_held = 0
    for kind, _ in op_order(ZB, stage, stages, m, cap):
        if kind in (F, I):
            most_owed = max(most_owed, owed)
        owed += (kind is I) - (kind is W)
        held += (kind is F) - (kind is W)
        most_held = max(most_held, held)
    return most_owed, most_held


@pytest.mark.parametrize("stages, m", [(2, 4), (4, 8), (4, 2), (5, 16)])
def test_the_lowering_keeps_each_cap_and_validates(stages: int, m: int) -> None:
    for cap in range(stages):
        caps = tuple(min(cap, i) for i in range(stages))
        for i in range(stages):
            owed, held = _peaks(i, stages, m, caps[i])
            assert owed <= caps[i], (i, cap, owed)
            assert held == in_flight(ZB, m, stages - i - 1, stages, caps[i]) == min(m, stages - i + caps[i])
        # every I before its W and every message next to its compute (the validator checks both), and the cap
        validate(lower(ZB, m, [1] * stages, defer=caps), [1] * stages, defer=caps)
        reps = [2, *[1] * (stages - 1)]
        validate(lower(ZB, m, reps, defer=caps), reps, defer=caps)


@pytest.mark.parametrize("stages, m", [(3, 6), (4, 4)])
def test_cap_zero_is_1f1b_with_the_backward_split_and_the_full_cap_is_zb_h1(stages: int, m: int) -> None:
    for i in range(stages):
        split = [(B if k is I else k, j) for k, j in op_order(ZB, i, stages, m, 0) if k is not W]
        assert split == op_order(ONE, i, stages, m)
        zero = op_order(ZB, i, stages, m, 0)
        assert all(zero[n + 1] == (W, j) for n, (k, j) in enumerate(zero) if k is I)  # each W right after its I
        assert op_order(ZB, i, stages, m, i) == op_order(ZB, i, stages, m)
    # the sends of each input-gradient part come before its weight-gradient part: the earlier stage waits less
    acts = [str(a) for a in lower(ZB, m, [1] * stages, defer=[0] * stages)[1]]
    assert acts.index("1SEND0:0") == acts.index("1I0") + 1 and acts.index("1W0") == acts.index("1I0") + 2


def test_the_validator_refuses_a_list_over_its_cap_and_relower_keeps_the_caps() -> None:
    full = lower(ZB, 4, [1, 1, 1])
    validate(full, [1, 1, 1], defer=(None, None, 2))
    with pytest.raises(ScheduleError, match=r"rank 2 \(stage 2, replica 0\): 2F2 runs while 2 weight-gradient "
                                            r"part\(s\) are held back, over stage 2's cap of 1"):
        validate(full, [1, 1, 1], defer=(None, None, 1))
    capped = lower(ZB, 2, [1, 1, 1], defer=(None, 0, 1))
    again = relower(capped, [1, 1, 1], ZB, 6, defer=(None, 0, 1))
    validate(again, [1, 1, 1], defer=(None, 0, 1))
    assert again == lower(ZB, 6, [1, 1, 1], defer=(None, 0, 1)) != lower(ZB, 6, [1, 1, 1])


def _toy(schedule: Schedule, m: int, caps: tuple[int | None, ...] = (), memory_gib: float = 1024.0,
         costs: tuple[tuple[float, float], ...] = ((4.0, 8.0),) * 4, acts: tuple[int, ...] = (0,) * 4
         ) -> tuple[Plan, Profile]:
    prof = chain_profile(list(costs), activation_bytes=list(acts), batch_size=64)
    graph = build(prof)
    caps = caps or (None,) * len(costs)
    stages = tuple(Stage(i, (f"d{i}",), (f"n{i}",), max_deferred=caps[i]) for i in range(len(costs)))
    return annotate(Plan("toy", uniform_cluster(len(costs), memory_gib=memory_gib), schedule, m, stages),
                    graph)[0], prof


@pytest.mark.parametrize("m, costs", [(8, ((4.0, 8.0),) * 4), (4, ((2.0, 6.0), (4.0, 8.0), (3.0, 9.0), (5.0, 6.0)))])
def test_the_bubble_lies_between_1f1b_and_zb_h1_and_falls_as_the_cap_grows(
        m: int, costs: tuple[tuple[float, float], ...]) -> None:
    one = _toy(ONE, m, costs=costs)[0].predicted
    full = _toy(ZB, m, costs=costs)[0].predicted
    capped = [_toy(ZB, m, tuple(min(w, i) for i in range(4)), costs=costs)[0].predicted for w in range(4)]
    assert one.bubble > capped[0].bubble  # each I's gradient leaves before its W
    assert capped[-1] == full and full.bubble < capped[0].bubble
    for lo, hi in zip(capped, capped[1:]):
        assert hi.bubble <= lo.bubble + 1e-12 and hi.step_ms <= lo.step_ms + 1e-9


def test_plan_json_and_the_summary_carry_the_cap_and_a_wrong_one_is_refused() -> None:
    from hpml_compile.explain import summary
    from hpml_compile.simulate import simulate

    plan, prof = _toy(ZB, 8, (None, 0, 1, 1))
    graph = build(prof)
    text = summary(plan, graph, simulate(plan, graph))
    assert "stage 1: " in text and "holds back at most 0 of ZB-H1's 1 weight-gradient parts" in text
    assert "holds back at most 1 of ZB-H1's 3" in text and "of ZB-H1's 0" not in text
    d = plan.to_dict()
    assert [s.get("max_deferred") for s in d["stages"]] == [None, 0, 1, 1]
    back = Plan.from_dict(d)
    assert deferral(back) == (None, 0, 1, 1) and back == plan
    assert deferral(_toy(ZB, 8)[0]) is None  # a plan without the field: ZB-H1's own
    bad = {**d, "stages": [*d["stages"][:3], {**d["stages"][3], "max_deferred": 4}]}
    with pytest.raises(SchemaError, match=r"stages\[3\]\.max_deferred.*from 0 to 3"):
        Plan.from_dict(bad)
    with pytest.raises(SchemaError, match="under schedule 1f1b"):
        Plan.from_dict({**d, "schedule": "1f1b"})
    with pytest.raises(PlanError, match=r"stage\(s\) \[1, 2, 3\] set max_deferred"):
        replace(plan, schedule=ONE)


def test_auto_takes_capped_zb_h1_where_the_full_one_does_not_fit() -> None:
    acts = (1 * GiB, 8 * GiB, 8 * GiB, 8 * GiB)  # 64 rows at 8 microbatches: 1 GiB a microbatch on stages 1-3
    one, prof = _toy(ONE, 8, acts=acts)
    fits3 = stage_memory(one, prof, one.stages[1]) / GiB + 0.5  # three microbatches of stage 1, not four
    one, prof = _toy(ONE, 8, acts=acts, memory_gib=fits3)
    graph = build(prof)
    validate_plan(one, prof)
    zb = replace(one, schedule=ZB)
    with pytest.raises(PlanError, match="stage 1 needs"):
        validate_plan(zb, prof)
    capped = fit_deferral(zb, prof)
    assert deferral(capped) == (None, 0, 1, 2)  # S - i + w <= 3
    validate_plan(capped, prof)
    lines: list[str] = []
    got = driver.faster_schedule(one, graph, prof, lines.append)
    assert got.schedule is ZB and deferral(got) == (None, 0, 1, 2), lines
    assert got.predicted.step_ms < one.predicted.step_ms
    assert lines[-1].startswith("schedule: zb-h1 capped on 3 of 4 stages")
    assert [st.predicted.memory_bytes for st in got.stages] == [stage_memory(got, prof, st) for st in got.stages]


def test_a_zb_h1_plan_is_certified_against_a_bound_that_holds_for_it() -> None:
    """One row a microbatch through 4 stages: ZB-H1's step is below a path bound that charges whole backwards."""
    from hpml_compile.certify import certify, fixed_bound

    prof = chain_profile([(1.0, 2.0)] * 4, batch_size=1)
    graph = build(prof)
    stages = tuple(Stage(i, (f"d{i}",), (f"n{i}",)) for i in range(4))
    zb, one = (annotate(Plan("toy", uniform_cluster(4), s, 1, stages), graph)[0] for s in (ZB, ONE))
    assert zb.predicted.step_ms < fixed_bound(graph, zb.cluster) <= one.predicted.step_ms
    got = certify(zb, graph)
    assert got.bound_ms is not None and got.bound_ms <= zb.predicted.step_ms, got.text
    assert certify(one, graph).bound_ms == got.bound_ms  # one bound over every plan, whatever its schedule
