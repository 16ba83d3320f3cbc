"""The interleave pass on the groups large plans have: tensor-parallel device groups (it weighs them, keeps each
group's ``tp`` on its chunks, and a device's memory sums its sharded chunks: the simulator's replay and the
formula agree), and an end group the solver left almost idle (left out where a block per chunk overloads it)."""

from __future__ import annotations

import pytest

from hpml_compile import models
from hpml_compile.cluster import load_cluster
from hpml_compile.costgraph import CostGraph, build
from hpml_compile.testing import chain_profile, cluster_of
from hpml_compile.ir import Profile
from hpml_compile.plan import Plan, Schedule, Stage, device_need, validate_plan
from hpml_compile.profile import profile
from hpml_compile.runtime.execute.chunks import interleave_refusal
from hpml_compile.simulate import annotate, simulate
from hpml_compile.solve.interleave import choose, interleave, without_idle_ends


@pytest.fixture(scope="module")
def gpt() -> tuple[Profile, CostGraph]:
    """The zoo's gpt-tiny on meta, priced for H100s: its attention and MLP units shard at tp 2."""
    m = models.load("gpt-tiny", batch_size=8, device="meta")
    prof = profile(m.module, m.example_inputs, name="m", device_kinds=["H100-80GB"], batch_size=8,
                   seq_len=m.seq_len, progress=False)
    return prof, build(prof).coarsen()


def _placed(prof: Profile, graph: CostGraph, tp: int) -> Plan:
    """Two 1F1B stages, half the blocks each, on ``tp`` GPUs each (one replica)."""
    order = list(graph.order)
    nodes = [tuple(x for b in part for x in graph.node(b).members)
             for part in (order[:len(order) // 2], order[len(order) // 2:])]
    groups = [tuple(f"gpu{2 * g + j}" for j in range(tp)) for g in range(2)]
    plan = Plan("m", load_cluster("dgx-h100-8"), Schedule.ONE_F_ONE_B, 4,
                tuple(Stage(g, groups[g], nodes[g], tp=tp) for g in range(2)))
    return annotate(plan, graph, prof.dtype)[0]


def test_the_pass_interleaves_tensor_parallel_groups_and_the_runtime_runs_the_result(gpt) -> None:
    prof, graph = gpt
    placed = _placed(prof, graph, 2)
    lines: list[str] = []
    got = choose(placed, graph, prof, say=lines.append)
    assert got.schedule is Schedule.INTERLEAVED and got.chunks >= 2, lines
    assert lines[-1].startswith(f"schedule: interleaved-1f1b with {got.chunks} chunks")
    assert [st.tp for st in got.stages] == [2] * len(got.stages)  # each chunk keeps its group's degree
    assert [st.devices for st in got.stages] == [placed.stages[k % 2].devices for k in range(len(got.stages))]
    assert got.predicted.step_ms < placed.predicted.step_ms and got.predicted.bubble < placed.predicted.bubble
    assert interleave_refusal(got) is None  # the plan names only what the runtime performs
    validate_plan(got, prof)


def test_a_device_holds_its_sharded_chunks_as_the_simulator_replays_them(gpt) -> None:
    prof, graph = gpt
    whole, split = (choose(_placed(prof, graph, tp), graph, prof, forced=True) for tp in (1, 2))
    assert whole.chunks == split.chunks >= 2
    peak = simulate(split, graph, prof.dtype).peak
    # the first group's peak: its chunks' sharded parameters, gradients, optimizer state and activations at
    # the group's peak of in-flight microbatches, counted by the formula and by the replay alike
    assert peak["gpu0"] == device_need(split, prof, "gpu0") == device_need(split, prof, "gpu1")
    assert device_need(split, prof, "gpu0") < 0.6 * device_need(whole, prof, "gpu0")  # about halved by tp 2


def test_an_end_group_holding_the_embedding_alone_is_left_out_where_a_block_per_chunk_overloads_it() -> None:
    # a slow device holds the cheap first block alone; two fast ones the 12 layers. Interleaved over all three,
    # the slow group's second chunk needs a layer (30 ms there, against 18 ms on the slowest fast group):
    # the pipeline would wait on it
    cheap, layer = {"cpu": (0.1, 0.2), "fast": (0.1, 0.2)}, {"cpu": (10.0, 20.0), "fast": (1.0, 2.0)}
    graph = build(chain_profile([cheap] + [layer] * 12))
    prof = chain_profile([cheap] + [layer] * 12)
    nodes = [graph.node(f"n{i}").members[0] for i in range(13)]
    stages = (Stage(0, ("d0",), tuple(nodes[:1])), Stage(1, ("d1",), tuple(nodes[1:7])),
              Stage(2, ("d2",), tuple(nodes[7:])))
    placed = annotate(Plan("c", cluster_of(["cpu", "fast", "fast"]), Schedule.ONE_F_ONE_B, 8, stages), graph)[0]
    ilv = interleave(placed, graph, 2)
    assert ilv is not None and any(len(st.nodes) and st.devices == ("d0",) for st in ilv.stages[3:])
    trimmed = without_idle_ends(placed, graph, ilv)
    assert trimmed is not None
    assert [(st.index, st.devices, len(st.nodes)) for st in trimmed.stages] == [(0, ("d1",), 7), (1, ("d2",), 6)]
    lines: list[str] = []
    got = choose(placed, graph, prof, say=lines.append)
    assert got.schedule is Schedule.INTERLEAVED and all(st.devices != ("d0",) for st in got.stages), lines
    assert "d0's group left idle" in lines[-1]
    assert got.predicted.step_ms < min(placed.predicted.step_ms, simulate(ilv, graph).step_ms)
    # a balanced pipeline keeps every group
    even = annotate(Plan("c", cluster_of(["fast"] * 3), Schedule.ONE_F_ONE_B, 8, stages), graph)[0]
    assert without_idle_ends(even, graph, interleave(even, graph, 2)) is None
