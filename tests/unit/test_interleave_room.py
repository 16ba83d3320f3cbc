"""Placements solved knowing interleaving follows: the memory left for its chunks' microbatches, the chunk counts
and cuts the pass tries, and the driver weighing such a placement beside the solver's."""

from __future__ import annotations

import numpy as np
import pytest

from hpml_compile.costgraph import build
from hpml_compile.interleave import peak_in_flight
from hpml_compile.plan import Plan, Schedule, Stage, device_need, validate_plan
from hpml_compile.solve import solve
from hpml_compile.solve.candidates import Chain, Setting, interleaved_in_flight
from hpml_compile.solve.interleave import chunk_counts, fit, interleave
from hpml_compile.solve.table import build_table
from hpml_compile.testing import chain_profile, cluster_of, uniform_cluster


@pytest.mark.parametrize("s,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 5), (3, 4, 16), (6, 2, 3), (5, 5, 64)])
def test_the_room_is_megatrons_peak_in_whole_stages(s: int, v: int, m: int) -> None:
    # chunks of equal bytes: the chunk-microbatches the lowered order holds at its peak, over v, rounded up
    for g in range(s):
        held = sum(peak_in_flight(g, s, v, m, [1.0] * v))
        room = interleaved_in_flight(m, s - g - 1, s, v)
        assert room == -(-held // v) if m % s == 0 else room >= -(-held // v), (g, held)  # M past a multiple of S:
        # the lowered order leaves the last round's empty slots out, so it holds at most that
    after = np.arange(s)
    assert interleaved_in_flight(m, after, s, v).tolist() == [interleaved_in_flight(m, j, s, v) for j in range(s)]


def test_a_candidate_fits_with_room_exactly_as_far_along_as_its_memory_allows() -> None:
    # 8 blocks, 1 MiB of activations a block and microbatch, devices of 20 MiB: the latest position each candidate
    # fits at, with interleaving's microbatches in flight, is the last whose peak is within the device
    m, mib = 8, 2**20
    prof = chain_profile([(1.0, 2.0)] * 8, activation_bytes=mib * m, kind="fast")
    chain, cluster = Chain.of(build(prof)), uniform_cluster(4, "fast", memory_gib=20 / 1024)
    plain = build_table(chain, cluster, Setting(m, Schedule.ONE_F_ONE_B, 64))
    room = build_table(chain, cluster, Setting(m, Schedule.ONE_F_ONE_B, 64, room_chunks=2, room_groups=4))
    cap, big_j = cluster.devices[0].memory_bytes, min(m, len(cluster.devices)) - 1
    for i in range(len(room)):
        c = room.candidate(i)
        static = c.memory.total - c.memory.in_flight * c.memory.stored_per_microbatch
        need = [static + interleaved_in_flight(m, j, 4, 2) * c.memory.stored_per_microbatch for j in range(big_j + 1)]
        fits = [j for j in range(big_j + 1) if need[j] <= cap]
        assert c.jmax == max(fits), (c, need)
        assert c.memory.in_flight == interleaved_in_flight(m, c.jmax, 4, 2)
    # interleaving holds more than 1F1B on the later stages: a candidate fits no later with room than without
    later = {(c.a, c.b, c.d, c.config): c.jmax for c in map(plain.candidate, range(len(plain)))}
    assert all(c.jmax <= later.get((c.a, c.b, c.d, c.config), c.jmax) for c in map(room.candidate, range(len(room))))
    assert sum(room.jmax < big_j) > sum(plain.jmax < big_j)


def _tight() -> tuple:
    """16 blocks of 1 MiB activations a microbatch at M = 8 (of one row: no data parallelism) on 4 devices of
    17 MiB: 1F1B's even cut fits (the first stage holds 4 microbatches of 4 blocks), interleaved over it does not
    (11 chunk-microbatches of 2 blocks)."""
    m, mib = 8, 2**20
    prof = chain_profile([(1.0, 2.0)] * 16, activation_bytes=mib * m, kind="fast", batch_size=m)
    return prof, build(prof), uniform_cluster(4, "fast", memory_gib=17 / 1024), m


def test_the_placement_with_room_interleaves_without_recomputing() -> None:
    prof, graph, cluster, m = _tight()
    plain = solve(graph, cluster, solver="dp", microbatches=m)
    roomy = solve(graph, cluster, solver="dp", microbatches=m, room=(2, len(plain.stages)))
    assert roomy.schedule is Schedule.ONE_F_ONE_B and not any(st.recompute for st in plain.stages)
    validate_plan(roomy, prof)
    bare = interleave(plain, graph, 2)
    assert bare is not None
    assert fit(bare, prof) != bare  # the solver's placement must recompute chunks to interleave
    ilv = interleave(roomy, graph, 2)
    assert ilv is not None and fit(ilv, prof) == ilv  # the one with room fits as it is
    validate_plan(ilv, prof)
    for d in cluster.devices:
        assert device_need(ilv, prof, d.name) <= d.memory_bytes


def test_the_driver_weighs_the_placement_with_room_and_says_so() -> None:
    from hpml_compile import driver
    prof, _, cluster, m = _tight()
    lines: list[str] = []
    plan = driver.plan(prof, cluster, driver.Options(solver="dp", microbatches=m, schedule="interleaved-1f1b",
                                                     uneven=False), progress=lines.append)
    assert plan.schedule is Schedule.INTERLEAVED
    assert any(x.startswith("schedule: placed again with room for") for x in lines)
    validate_plan(plan, prof)
    assert not driver.roomy_placement(plan, build(prof), prof, uniform_cluster(4, memory_gib=1.0),
                                      driver.Options(solver="dp"))  # CPU ranks: not solved again


def test_chunk_counts_include_a_block_a_piece() -> None:
    assert chunk_counts(16, 87) == [2, 3, 4, 5]  # 80 layers and a few small blocks over 16 groups: 5 chunks
    assert all(16 * v <= 87 for v in chunk_counts(16, 87))
    assert chunk_counts(4, 7) == [] and chunk_counts(2, 13) == [2, 3, 4, 6]


def test_running_loads_balance_groups_of_different_speeds() -> None:
    # d1 is twice as fast as d0 and held 9 of the 12 blocks under 1F1B (a load of 4.5 against d0's 3): each group's
    # running load held to its share keeps its total where the solver put it
    prof = chain_profile([{"slow": (1.0, 2.0), "fast": (0.5, 1.0)}] * 12)
    graph = build(prof)
    nodes = [graph.node(f"n{i}").members[0] for i in range(12)]
    placed = Plan("c", cluster_of(["slow", "fast"]), Schedule.ONE_F_ONE_B, 4,
                  (Stage(0, ("d0",), tuple(nodes[:3])), Stage(1, ("d1",), tuple(nodes[3:]))))

    def loads(p: Plan) -> list[int]:
        out = [0, 0]
        for st in p.stages:
            out[st.index % 2] += len(st.nodes)
        return out

    assert loads(interleave(placed, graph, 2, running=True)) == [3, 9]
    # piece by piece (each held to 1.5 and 4.5 blocks' time), d0's first piece takes 1 block and d1's 5, so d1
    # ends with 10 blocks: a load of 5 against the 4.5 it had
    assert loads(interleave(placed, graph, 2)) == [2, 10]
