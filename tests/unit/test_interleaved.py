"""Interleaved 1F1B: the lowered order (Megatron-LM's, checked by hand), the validator, plan.json, refusals."""

from __future__ import annotations

import json

import pytest

from hpml_compile.costgraph import build
from hpml_compile.errors import PlanError, ScheduleError
from hpml_compile.ir import Cluster, Device
from hpml_compile.plan import Plan, Schedule, Stage, device_need, load_plan, save_plan, stage_memory, validate_plan
from hpml_compile.schedule import (COMPUTE, ActionKind, interleaved_order, lower, parse_actions, rank_layout,
                                   rank_stages, relower, stage_ranks)
from hpml_compile.schedule_check import validate
from hpml_compile.simulate import EventKind, annotate, simulate
from hpml_compile.solve.interleave import choose, interleave
from hpml_compile.testing import chain_profile, cluster_of, dag_profile, uniform_cluster

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
                                           (4, 4, 4), (4, 2, 12), (8, 2, 8), (2, 2, 3), (4, 3, 5), (5, 2, 7),
                                           (8, 4, 3), (3, 2, 1)])
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
        padded = -(-m // s) * s  # Megatron's bound (for the next multiple of S, the rest left out)
        assert peak <= min(2 * (s - g - 1) + (v - 1) * s + 1, v * padded)
        if m == padded:
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


def _cut(graph, cluster, groups: int, chunks: int, m: int, act: bool = False) -> Plan:
    """The chain's nodes cut into ``groups * chunks`` equal stages, stage k on device k % groups."""
    n = len(graph.order)
    per = n // (groups * chunks)
    stages = tuple(Stage(k, (f"d{k % groups}",), tuple(x for i in range(k * per, (k + 1) * per)
                                                        for x in graph.node(f"n{i}").members))
                   for k in range(groups * chunks))
    schedule = Schedule.INTERLEAVED if chunks > 1 else Schedule.ONE_F_ONE_B
    return Plan("chain", cluster, schedule, m, stages, chunks=chunks)


@pytest.mark.parametrize(("s", "m"), [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_the_simulated_bubble_shrinks_as_megatrons_formula_says(s: int, m: int) -> None:
    # 8 equal blocks, free links: 1F1B's bubble is (S - 1) / (M + S - 1), interleaved's (S - 1) / (v M + S - 1)
    g = build(chain_profile([(1.0 * m, 2.0 * m)] * 8))
    c = uniform_cluster(s)
    one = simulate(_cut(g, c, s, 1, m), g)
    assert one.bubble == pytest.approx((s - 1) / (m + s - 1))
    for v in (2, 4) if s == 2 else (2,):
        ilv = simulate(_cut(g, c, s, v, m), g)
        assert ilv.bubble == pytest.approx((s - 1) / (v * m + s - 1))
        assert ilv.step_ms < one.step_ms
        # a device computes one thing at a time across its chunks
        for dev in c.devices:
            bars = sorted((b.start_ms, b.end_ms) for b in ilv.intervals if b.device == dev.name
                          and b.kind in (EventKind.FORWARD, EventKind.BACKWARD))
            assert all(a[1] <= b[0] + 1e-9 for a, b in zip(bars, bars[1:]))


def test_a_rank_steps_its_chunks_optimizers_one_after_another_on_a_shared_host() -> None:
    # two CPU ranks on a host of one core: a rank's chunks step their optimizers in turn, so the host sees two
    # busy ranks at once, as under 1F1B with the same bytes per device, not four
    from dataclasses import replace
    g = build(chain_profile([(1.0, 2.0)] * 8, param_bytes=1000))
    g = replace(g, cores={"cpu": 1}, optimizer_ms={"cpu": 8.0})
    c = uniform_cluster(2)
    one, ilv = (simulate(_cut(g, c, 2, v, 4), g) for v in (1, 2))
    assert one.step_ms - one.step_without_optimizer_ms > 0
    assert ilv.step_ms - ilv.step_without_optimizer_ms == pytest.approx(
        one.step_ms - one.step_without_optimizer_ms)


def test_a_device_holds_its_chunks_memory_as_the_model_says() -> None:
    # 100 bytes of activations a block per microbatch (the profile's 400 over M = 4), no parameters
    m = 4
    prof = chain_profile([(1.0 * m, 2.0 * m)] * 4, activation_bytes=400)
    g = build(prof)
    c = uniform_cluster(2)
    one, ilv = _cut(g, c, 2, 1, m), _cut(g, c, 2, 2, m)
    r1, r2 = simulate(one, g), simulate(ilv, g)
    # 1F1B: group 0 holds 2 microbatches of 2 blocks; interleaved: 3 of chunk 0 and 2 of chunk 2 (or 4 and 1)
    assert r1.peak["d0"] == device_need(one, prof, "d0") == 2 * 200
    assert r2.peak["d0"] == device_need(ilv, prof, "d0") == 5 * 100
    assert r2.peak["d1"] == device_need(ilv, prof, "d1") == 3 * 100
    assert r2.peak["d0"] > r1.peak["d0"]  # interleaving holds more warm-up microbatches
    assert sum(stage_memory(ilv, prof, st) for st in ilv.stages if "d0" in st.devices) == 5 * 100


def test_the_pass_cuts_pieces_by_each_groups_speed() -> None:
    # d1 is twice as fast: under 1F1B it held 8 of the 12 blocks; interleaved, each of its pieces holds 4 and
    # each of d0's 2, so each group keeps its load
    prof = chain_profile([{"cpu": (1.0, 2.0), "fast": (0.5, 1.0)}] * 12)
    graph = build(prof)
    c = cluster_of(["cpu", "fast"])
    nodes = [graph.node(f"n{i}").members[0] for i in range(12)]
    placed = Plan("c", c, Schedule.ONE_F_ONE_B, 4, (Stage(0, ("d0",), tuple(nodes[:4])),
                                                    Stage(1, ("d1",), tuple(nodes[4:]))))
    ilv = interleave(placed, graph, 2)
    assert [len(st.nodes) for st in ilv.stages] == [2, 4, 2, 4]
    assert [st.devices for st in ilv.stages] == [("d0",), ("d1",), ("d0",), ("d1",)]
    assert [n for st in ilv.stages for n in st.nodes] == nodes  # the model in order, every block once
    assert interleave(placed, graph, 8) is None  # 16 pieces of 12 blocks


def test_choose_takes_the_fastest_chunks_that_fit_and_says_so() -> None:
    prof = chain_profile([(4.0, 8.0)] * 16)
    graph = build(prof)
    nodes = [graph.node(f"n{i}").members[0] for i in range(16)]
    stages = tuple(Stage(i, (f"d{i}",), tuple(nodes[4 * i:4 * i + 4])) for i in range(4))
    one = annotate(Plan("toy", uniform_cluster(4), Schedule.ONE_F_ONE_B, 4, stages), graph)[0]
    lines: list[str] = []
    got = choose(one, graph, prof, say=lines.append)
    assert got.schedule is Schedule.INTERLEAVED and got.chunks == 4  # 16 blocks: 2 or 4 chunks; 4 is fastest
    assert got.predicted.step_ms < one.predicted.step_ms and got.predicted.bubble < one.predicted.bubble
    assert lines[-1].startswith("schedule: interleaved-1f1b with 4 chunks")
    validate(lower(Schedule.INTERLEAVED, got.microbatches, [1] * len(got.stages), chunks=got.chunks),
             [1] * len(got.stages), chunks=got.chunks)
    # memory: 100 MiB of activations a block and microbatch; 1F1B holds 4, 3, 2, 1 microbatches of 4 blocks on
    # d0..d3, interleaving more on the later groups (d1: 16 chunk-microbatches of 1 block at 4 chunks, 1600 MiB)
    heavy = chain_profile([(4.0, 8.0)] * 16, activation_bytes=100 * 2**20 * 4)
    hg = build(heavy)
    tight = Cluster(devices=tuple(Device(f"d{i}", "cpu", 1.6 if i == 0 else 1.5) for i in range(4)), name="tight")
    placed = annotate(Plan("toy", tight, Schedule.ONE_F_ONE_B, 4, stages), hg)[0]
    validate_plan(placed, heavy)
    from hpml_compile.solve.interleave import fit
    bare = interleave(placed, hg, 4)
    with pytest.raises(PlanError, match="stages 1, 5, 9, 13 need 1.56 GiB on d1"):
        validate_plan(bare, heavy)
    fitted = fit(bare, heavy)  # group 1 overflows by 0.06 GiB: one of its chunks recomputing is enough
    assert [st.index % 4 for st in fitted.stages if st.recompute] == [1]
    validate_plan(fitted, heavy)
    got = choose(placed, hg, heavy, say=lines.append)
    assert got.schedule is Schedule.INTERLEAVED and got.predicted.step_ms < placed.predicted.step_ms
    assert "(1 of its 16 stages recomputing to fit)" in lines[-1]
    validate_plan(got, heavy)


def test_the_driver_interleaves_when_asked() -> None:
    from hpml_compile import driver
    prof = chain_profile([(4.0, 8.0)] * 8, param_bytes=100 * 2**20)  # too large for one 2 GiB device with Adam
    cluster = uniform_cluster(2, memory_gib=2.0)
    lines: list[str] = []
    opts = driver.Options(solver="dp", microbatches=4, schedule="interleaved-1f1b", uneven=False)
    plan = driver.plan(prof, cluster, opts, progress=lines.append)
    assert plan.schedule is Schedule.INTERLEAVED and plan.chunks >= 2
    assert any(x.startswith("schedule: interleaved-1f1b") for x in lines)
    auto = driver.plan(prof, cluster, driver.Options(solver="dp", microbatches=4, schedule="auto", uneven=False))
    assert auto.schedule is Schedule.INTERLEAVED  # weighed by auto, CPU ranks included, and here it is faster
    assert auto.predicted.step_ms <= driver.plan(prof, cluster, driver.Options(
        solver="dp", microbatches=4, schedule="1f1b", uneven=False)).predicted.step_ms
    kept = driver.plan(prof, cluster, driver.Options(solver="dp", microbatches=4, schedule="auto", uneven=False,
                                                     interleave=False))
    assert kept.schedule is not Schedule.INTERLEAVED


def test_moving_rows_keeps_a_groups_chunks_alike() -> None:
    from hpml_compile.replan import move_rows
    prof = chain_profile([{"cpu": (4.0, 8.0), "fast": (1.0, 2.0)}] * 4)
    graph = build(prof)
    c = cluster_of(["cpu", "fast", "cpu"])
    nodes = [graph.node(f"n{i}").members[0] for i in range(4)]
    stages = tuple(Stage(k, ("d0", "d1") if k % 2 == 0 else ("d2",), (nodes[k],)) for k in range(4))
    plan = Plan("toy", c, Schedule.INTERLEAVED, 4, stages, chunks=2)
    moved = move_rows(plan, graph).plan
    assert moved.stages[0].rows == moved.stages[2].rows and moved.stages[0].rows[1] > moved.stages[0].rows[0]


def test_even_pieces_where_the_solver_left_a_group_almost_idle() -> None:
    graph = build(chain_profile([(1.0, 2.0)] * 12))
    nodes = [graph.node(f"n{i}").members[0] for i in range(12)]
    placed = Plan("c", uniform_cluster(2), Schedule.ONE_F_ONE_B, 4, (Stage(0, ("d0",), tuple(nodes[:1])),
                                                                     Stage(1, ("d1",), tuple(nodes[1:]))))
    assert [len(st.nodes) for st in interleave(placed, graph, 2).stages] == [1, 5, 1, 5]  # each group's share
    assert [len(st.nodes) for st in interleave(placed, graph, 2, even=True).stages] == [3, 3, 3, 3]
