"""Who is left after a rank died: one answer for every survivor, and the plan they run without it."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch.distributed as dist

from hpml_compile.cluster import builtin_cluster
from hpml_compile.errors import CommFailure
from hpml_compile.ir import Schedule
from hpml_compile.memory import ZeroStage
from hpml_compile.plan import Plan, Stage
from hpml_compile.runtime.execute.members import Heartbeat, agree_survivors, in_place_refusal, without_ranks


def _plan(*devices: tuple[str, ...]) -> Plan:
    stages = tuple(Stage(k, d, (f"n{k}",)) for k, d in enumerate(devices))
    return Plan("mlp", builtin_cluster("local-cpu-4"), Schedule.GPIPE, 2, stages)


def test_the_survivors_agree_on_who_is_left_when_a_beat_stops() -> None:
    store = dist.HashStore()
    beats = [Heartbeat(store, r, interval_s=0.02) for r in range(3)]
    beats[1].stop()  # rank 1 is gone: its beat no longer moves (its process, this one, lives: only the beat tells)
    got: dict[int, list[int]] = {}

    def survivor(r: int) -> None:
        got[r] = agree_survivors(store, 1, r, [0, 1, 2], stale_s=0.3, timeout_s=20)

    threads = [threading.Thread(target=survivor, args=(r,)) for r in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert got == {0: [0, 2], 2: [0, 2]}
    # a transient failure: everybody arrives, nobody is lost (a new round)
    every: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda r=r: every.__setitem__(r, agree_survivors(
        store, 2, r, [0, 2], stale_s=0.3, timeout_s=20))) for r in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert every == {0: [0, 2], 2: [0, 2]}
    # rank 1 coming back to round 1 after it was judged gone must not train beside the others
    with pytest.raises(CommFailure, match="rank 1 was judged gone by the other ranks"):
        agree_survivors(store, 1, 1, [0, 1, 2], stale_s=0.3, timeout_s=5)
    for b in beats:
        b.stop()


def test_the_plan_without_a_lost_replica_splits_its_rows_over_those_left() -> None:
    plan = _plan(("cpu0",), ("cpu1", "cpu2", "cpu3"))
    out = without_ranks(plan, [2], 10)  # rank 2: stage 1's second replica (cpu2)
    assert [(st.devices, st.rows) for st in out.stages] == [(("cpu0",), ()), (("cpu1", "cpu3"), (5, 5))]
    assert without_ranks(plan, [1, 3], 7).stages[1].rows == (7,)  # explicit: the code was made at other rows
    assert without_ranks(_plan(("cpu0", "cpu1", "cpu2")), [0], 7).stages[0].rows == (4, 3)
    with pytest.raises(CommFailure, match="stage 0 lost its only replica \\(cpu0\\)"):
        without_ranks(plan, [0], 10)
    assert in_place_refusal(plan, [2]) is None
    zero = replace(plan, stages=(plan.stages[0], replace(plan.stages[1], zero=ZeroStage.OS)))
    assert "shards its optimizer state" in str(in_place_refusal(zero, [2]))
    assert in_place_refusal(zero, [0]) is None  # stage 0 holds no shard of stage 1's state
