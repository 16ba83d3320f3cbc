"""Interleaved 1F1B on tensor-parallel device groups: the pass weighs it, keeps each group's ``tp`` on its chunks,
and a device's memory sums its sharded chunks (the simulator's replay and the formula agree)."""

from __future__ import annotations

import pytest

from hpml_compile import models
from hpml_compile.cluster import load_cluster
from hpml_compile.costgraph import CostGraph, build
from hpml_compile.ir import Profile
from hpml_compile.plan import Plan, Schedule, Stage, device_need, validate_plan
from hpml_compile.profile import profile
from hpml_compile.runtime.execute.chunks import interleave_refusal
from hpml_compile.simulate import annotate, simulate
from hpml_compile.solve.interleave import choose


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
