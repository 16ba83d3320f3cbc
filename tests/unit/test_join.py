"""A replica that joins: where the plan puts it, what it refuses by name, and one decision per step boundary."""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest
import torch.distributed as dist

from hpml_compile.cluster import builtin_cluster
from hpml_compile.ir import Schedule
from hpml_compile.memory import ZeroStage
from hpml_compile.plan import Plan, Stage
from hpml_compile.runtime.execute.join import Door, JoinRefused, announce, ask, wait_grant, with_replica
from hpml_compile.runtime.execute.members import Heartbeat

ROWS = 12


def _plan(*devices: tuple[str, ...]) -> Plan:
    stages = tuple(Stage(k, d, (f"n{k}",)) for k, d in enumerate(devices))
    return Plan("mlp", builtin_cluster("local-cpu-4"), Schedule.GPIPE, 2, stages)


GENERATED = _plan(("cpu0",), ("cpu1", "cpu2"))
LEFT = replace(GENERATED, stages=(GENERATED.stages[0], replace(GENERATED.stages[1], devices=("cpu2",), rows=(12,))))


def test_a_joiner_takes_the_device_a_lost_replica_had_or_the_free_one_it_names() -> None:
    plan, k, dev = with_replica(LEFT, GENERATED, None, ROWS)
    assert (k, dev) == (1, "cpu1")
    assert plan.stages[1].devices == ("cpu2", "cpu1") and plan.stages[1].rows == (6, 6)
    assert plan.stages[0] == LEFT.stages[0]
    # cpu3: a device of the cluster the plan never used goes to the replicated stage short of the most replicas
    plan, k, dev = with_replica(LEFT, GENERATED, "cpu3", ROWS)
    assert (k, dev, plan.stages[1].devices, plan.stages[1].rows) == (1, "cpu3", ("cpu2", "cpu3"), (6, 6))
    # a third replica where the plan had two: rows 4 each
    plan, _, _ = with_replica(with_replica(LEFT, GENERATED, None, ROWS)[0], GENERATED, "cpu3", ROWS)
    assert plan.stages[1].devices == ("cpu2", "cpu1", "cpu3") and plan.stages[1].rows == (4, 4, 4)


@pytest.mark.parametrize(("plan", "device", "why"), [
    (LEFT, "cpu2", "device cpu2 already runs a rank of the job"),
    (LEFT, "gpu7", "device 'gpu7' is not in cluster local-cpu-4"),
    (GENERATED, None, "every device of the plan's replicated stages is in use"),
    (LEFT, "cpu0", "device cpu0 already runs a rank of the job"),
    (replace(LEFT, stages=(replace(LEFT.stages[0], devices=("cpu3",)), LEFT.stages[1])), "cpu0",
     "stage 0 is not replicated by the plan (one device, cpu0)"),
    (replace(LEFT, stages=(LEFT.stages[0], replace(LEFT.stages[1], zero=ZeroStage.OS))), None,
     "shards its optimizer state over its replicas (ZeRO-1)"),
    (replace(GENERATED, stages=(GENERATED.stages[0], replace(GENERATED.stages[1], tp=2))), "cpu3",
     "the plan runs tensor parallelism"),
], ids=["in-use", "unknown", "no-free-device", "unreplicated-in-use", "unreplicated", "zero", "tp"])
def test_what_cannot_join_is_refused_by_name(plan: Plan, device: str | None, why: str) -> None:
    with pytest.raises(JoinRefused, match=re.escape(why)):
        with_replica(plan, GENERATED, device, ROWS)


def test_a_plan_that_replicates_no_stage_takes_no_joiner() -> None:
    one = _plan(("cpu0",), ("cpu1",))
    with pytest.raises(JoinRefused, match="the plan replicates no stage"):
        with_replica(one, one, "cpu3", ROWS)


def test_every_running_rank_lets_the_same_joiners_in_at_the_same_boundary() -> None:
    store = dist.HashStore()
    doors = [Door(store, GENERATED, ROWS) for _ in range(2)]
    members, gen = [0, 2], 3  # job rank 1 (cpu1) was lost
    assert [d.boundary(0, 0, LEFT, members, gen, False) for d in doors] == [None, None]
    ticket, me = announce(store, 3)
    beat = Heartbeat(store, me, interval_s=0.02)
    ask(store, ticket, me, None)
    bad, other = announce(store, 3)
    ask(store, bad, other, "cpu2")
    # the first rank at boundary 1 has seen the asks, the second not yet: both act on the first one's view
    grants = [doors[0].boundary(1, 2, LEFT, members, gen, False), doors[1].boundary(1, 0, LEFT, members, gen, False)]
    assert grants[0] == grants[1] and grants[0] is not None
    g = grants[0]
    assert (g.step, g.generation, g.members, g.devices, g.rows) == (1, 4, [0, 2, me], [["cpu0"], ["cpu2", "cpu1"]],
                                                                    [[], [6, 6]])
    assert wait_grant(store, ticket, 5) == g
    assert doors[0].boundary(1, 3, LEFT, members, gen, False) is None  # the step run again: no second decision
    with pytest.raises(JoinRefused, match="device cpu2 already runs a rank of the job"):
        wait_grant(store, bad, 5)
    # the next boundary: nobody new
    assert [d.boundary(2, 2, g.plan(LEFT), g.members, 4, False) for d in doors] == [None, None]
    # ranks that take no joiner at all refuse each with their reason, and go on as they were
    late, last = announce(store, 3)
    ask(store, late, last, None)
    refused = [d.boundary(3, 3, g.plan(LEFT), g.members, 4, False, "no joiners here") for d in doors]
    assert refused[0] == refused[1] and refused[0] is not None and refused[0].members == g.members
    with pytest.raises(JoinRefused, match="no joiners here"):
        wait_grant(store, late, 5)
    beat.stop()


def test_the_heartbeat_counts_the_joiners_for_the_boundary() -> None:
    store = dist.HashStore()
    beat = Heartbeat(store, 0, interval_s=0.02)
    announce(store, 3)
    deadline = time.monotonic() + 5
    while beat.joiners < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    beat.stop()
    assert beat.joiners == 1


def test_a_joiner_of_an_earlier_stage_takes_its_place_in_rank_order() -> None:
    store = dist.HashStore()
    generated = _plan(("cpu0", "cpu1"), ("cpu2",))
    left = replace(generated, stages=(replace(generated.stages[0], devices=("cpu0",), rows=(12,)),
                                      generated.stages[1]))
    ticket, me = announce(store, 3)
    ask(store, ticket, me, None)
    g = Door(store, generated, ROWS).boundary(5, 1, left, [0, 2], 1, True)
    assert g is not None and (g.members, g.devices, g.rows) == ([0, me, 2], [["cpu0", "cpu1"], ["cpu2"]], [[6, 6], []])
