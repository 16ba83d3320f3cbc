"""Interleaved 1F1B: the lowered order (Megatron-LM's, checked by hand), the validator, plan.json, refusals."""

from __future__ import annotations

import json

import pytest

from hpml_compile.errors import PlanError, ScheduleError
from hpml_compile.ir import Cluster, Device
from hpml_compile.plan import Plan, Schedule, Stage, load_plan, save_plan, validate_plan
from hpml_compile.schedule import (COMPUTE, ActionKind, interleaved_order, lower, parse_actions, rank_layout,
                                   rank_stages, relower, stage_ranks)
from hpml_compile.schedule_check import validate
from hpml_compile.testing import dag_profile

# Megatron-LM's interleaved order, worked out by hand from its rules (group g: 2 (S - g - 1) + (v - 1) S warm-up
# forwards; forward i runs chunk (i mod S v) // S on microbatch (i // S v) S + i mod S; backwards the same from the
# last chunk). S = 2, v = 2, M = 4: group 0 holds stages 0 and 2, group 1 stages 1 and 3.
S2V2M4 = ["0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
          "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"]
# S = 4, v = 2, M = 8: the schedule of Narayanan et al. (SC 2021), figure 4; stages g and g + 4 on group g.
S4V2M8 = ["0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 "
          "0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7",
          None, None,
          "3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 "
          "7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7"]


def _compute(acts) -> str:
    return " ".join(str(a) for a in acts if a.kind in COMPUTE)


@pytest.mark.parametrize(("s", "v", "m", "want"), [(2, 2, 4, S2V2M4), (4, 2, 8, S4V2M8)])
def test_the_lowered_order_is_megatrons(s: int, v: int, m: int, want: list[str | None]) -> None:
    ranks = lower(Schedule.INTERLEAVED, m, (1,) * (s * v), chunks=v)
    assert len(ranks) == s
    for g, row in enumerate(want):
        if row is not None:
            assert _compute(ranks[g]) == row
        assert _compute(ranks[g]).replace(" ", ",") == ",".join(
            f"{k}{kind.value}{j}" for kind, k, j in interleaved_order(g, s, v, m))


def test_messages_surround_compute_and_cross_from_the_last_group_to_the_first() -> None:
    ranks = lower(Schedule.INTERLEAVED, 2, (1,) * 4, chunks=2)
    first = [str(a) for a in ranks[0]]
    assert first.index("2RECV1:0") < first.index("2F0") < first.index("2SEND3:0")
    assert first.index("0F0") < first.index("0SEND1:0")
    last = [str(a) for a in ranks[1]]
    assert last.index("1F0") < last.index("1SEND2:0")  # stage 1 (last group) -> stage 2 (first group)
    assert last[-3:] == ["LOSS", "OPT1", "OPT3"]
    assert "3SEND4:0" not in last  # the model's last stage sends nothing on


@pytest.mark.parametrize(("s", "v", "m"), [(2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 3), (3, 3, 9), (4, 2, 8),
                                           (4, 4, 4), (4, 2, 12), (8, 2, 8)])
def test_every_lowering_validates_and_holds_megatrons_in_flight(s: int, v: int, m: int) -> None:
    replicas = tuple(2 if k % s == 0 else 1 for k in range(s * v))  # group 0 replicated
    grad = [[f"ALLREDUCE({k})"] if k % s == 0 else [] for k in range(s * v)]
    grad[0].append(f"ALLREDUCE(0,{s * v - 1})")  # tied first and last stage (different groups)
    grad[-1].append(f"ALLREDUCE(0,{s * v - 1})")
    ranks = lower(Schedule.INTERLEAVED, m, replicas, grad_sync=grad, chunks=v)
    validate(ranks, replicas, chunks=v)  # replays them with blocking receives: no deadlock
    assert relower(ranks, replicas, Schedule.INTERLEAVED, m, chunks=v) == ranks
    for rank, acts in enumerate(ranks[1:], 1):  # rank 0 and 1 are group 0's replicas
        g = rank - 1
        live = peak = 0
        for a in acts:
            live += {ActionKind.FORWARD: 1, ActionKind.BACKWARD: -1}.get(a.kind, 0)
            peak = max(peak, live)
        assert peak == min(2 * (s - g - 1) + (v - 1) * s + 1, v * m)
        assert sum(str(a) == "LOSS" for a in acts) == 1
        assert [a.stage for a in acts if a.kind is ActionKind.OPTIMIZER] == list(range(g, s * v, s))


def test_a_rank_with_two_stages_syncs_a_shared_collective_once() -> None:
    grad = [["ALLREDUCE(0,2)"], [], ["ALLREDUCE(0,2)"], []]  # a parameter tied between the two chunks of group 0
    ranks = lower(Schedule.INTERLEAVED, 2, (1,) * 4, grad_sync=grad, chunks=2)
    assert [str(a) for a in ranks[0]].count("ALLREDUCE(0,2)") == 1
    validate(ranks, (1,) * 4, chunks=2)


def test_the_validator_refuses_a_deadlocking_interleaved_order() -> None:
    ranks = lower(Schedule.INTERLEAVED, 2, (1,) * 4, chunks=2)
    rows = [[str(a) for a in acts] for acts in ranks]
    # group 0 runs stage 2's first forward before stage 0's: it waits for stage 1, which waits for stage 0
    moved = ["2RECV1:0", "2F0", "2SEND3:0"]
    bad = moved + [t for t in rows[0] if t not in moved]
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 \(stages 0,2, replica 0\) waits at 2RECV1:0"):
        validate(parse_actions([bad, rows[1]]), (1,) * 4, chunks=2)
    with pytest.raises(ScheduleError, match="not one of stages 0, 2's"):
        validate(parse_actions([["1F0", *rows[0]], rows[1]]), (1,) * 4, chunks=2)
    with pytest.raises(ScheduleError, match="S >= 2"):
        validate(ranks, (1, 1, 1), chunks=2)


@pytest.mark.parametrize(("schedule", "replicas", "chunks", "m", "match"), [
    (Schedule.ONE_F_ONE_B, (1,) * 4, 2, 4, "chunks"),
    (Schedule.INTERLEAVED, (1,) * 4, 1, 4, "chunks"),
    (Schedule.INTERLEAVED, (1,) * 2, 2, 4, "S >= 2"),
    (Schedule.INTERLEAVED, (1,) * 4, 2, 3, "multiple of 2"),
    (Schedule.INTERLEAVED, (2, 1, 1, 1), 2, 4, "repeat"),
])
def test_lowering_refuses_what_interleaving_cannot_run(schedule, replicas, chunks, m, match) -> None:
    with pytest.raises(ValueError, match=match):
        lower(schedule, m, replicas, chunks=chunks)


def _cluster() -> Cluster:
    return Cluster(devices=tuple(Device(f"d{i}", "cpu", 8.0) for i in range(3)), name="t")


def _plan(devices=("d0", ("d1", "d2"), "d0", ("d1", "d2")), chunks=2, m=4, schedule=Schedule.INTERLEAVED) -> Plan:
    stages = tuple(Stage(k, d if isinstance(d, tuple) else (d,), (f"n{k}",)) for k, d in enumerate(devices))
    return Plan("toy", _cluster(), schedule, m, stages, chunks=chunks)


def test_plan_round_trips_and_names_its_ranks(tmp_path) -> None:
    plan = _plan()
    save_plan(plan, tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["chunks"] == 2
    assert load_plan(tmp_path / "plan.json") == plan
    assert "chunks" not in _plan(("d0", "d1"), chunks=1, schedule=Schedule.ONE_F_ONE_B).to_dict()
    assert stage_ranks(plan) == [[0], [1, 2], [0], [1, 2]]
    assert rank_stages(plan) == [(0, 2), (1, 3), (1, 3)]
    assert rank_layout(plan) == [(0, 0), (1, 0), (1, 1)]
    validate_plan(plan, dag_profile([(1.0, 2.0)] * 4, [[], [0], [1], [2]]))


@pytest.mark.parametrize(("kw", "match"), [
    ({"chunks": 2, "schedule": Schedule.ONE_F_ONE_B}, "chunks above 1 go with schedule interleaved-1f1b"),
    ({"chunks": 1}, "chunks above 1 go with"),
    ({"devices": ("d0", "d1", "d0")}, "3 stages"),
    ({"devices": ("d0", "d1"), "chunks": 2}, "S >= 2"),
    ({"m": 3}, "a multiple of 2"),
    ({"devices": ("d0", "d1", "d1", "d0")}, "stage k runs on stage k % 2's devices"),
    ({"devices": ("d0", ("d1", "d2"), "d0", ("d2", "d1"))}, "same devices in the same order"),
])
def test_plans_that_cannot_interleave_are_refused(kw, match) -> None:
    with pytest.raises(PlanError, match=match):
        _plan(**kw)


def test_plan_json_with_a_device_in_two_unrelated_stages_is_refused(tmp_path) -> None:
    d = _plan().to_dict()
    d["stages"][3]["devices"] = ["d0"]  # stage 3 belongs on stage 1's devices
    (tmp_path / "plan.json").write_text(json.dumps(d))
    with pytest.raises(Exception, match="which stage 0 uses too"):
        load_plan(tmp_path / "plan.json")
