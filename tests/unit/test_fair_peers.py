"""The plan_quality benchmark's peers, scored as a user runs them: each partitioner's split with the data-parallel
degree, microbatch count and ZeRO stage searched (benchmarks/plan_quality/fair.py), not one stage per device."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hpml_compile.solve import plan_from_cuts
from hpml_compile.testing import chain_graph, cluster_of

HERE = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_quality"


@pytest.fixture(scope="module")
def fair() -> ModuleType:
    sys.path.insert(0, str(HERE))  # fair.py finds the benchmark's main.peer_cuts by name
    try:
        spec = importlib.util.spec_from_file_location("fair", HERE / "fair.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(HERE))


def _even(weights: list[float], parts: int) -> list[int]:
    """A partitioner of the peers' interface: equal numbers of segments per part."""
    return [round(i * len(weights) / parts) for i in range(parts + 1)]


def _cuts(graph, cluster, which, fn, parts):  # the split over the graph's blocks themselves
    return fn([1.0] * len(graph.order), parts)


def test_shapes_are_what_a_user_can_set(fair: ModuleType) -> None:
    got = list(fair.shapes(4, 8))
    assert all(s * d <= 4 and 8 % (m * d) == 0 for s, d, m in got)
    assert (1, 4, 2) in got and (4, 1, 8) in got and (2, 2, 4) in got and (1, 4, 4) not in got


def test_a_peer_gets_data_parallelism_where_it_pays(fair: ModuleType) -> None:
    """Four equal devices, a model that fits on each: one stage per device (the old scoring) pipelines it; a
    user would replicate it, and the fair peer is at least as fast as every one-stage-per-device split."""
    g = chain_graph([{"a": (1.0, 2.0)}] * 8, param_bytes=1000, batch_size=16)
    c = cluster_of(["a"] * 4)
    best = fair.fair_peer_plan(g, c, "even", _even, cuts_of=_cuts)
    assert any(len(st.devices) > 1 for st in best.stages) and all(not st.rows for st in best.stages)
    for k in range(1, 5):
        sub = cluster_of(["a"] * k)
        pipelined = plan_from_cuts(g, sub, _cuts(g, sub, "even", _even, k), name="even")
        assert best.predicted.step_ms <= pipelined.predicted.step_ms + 1e-9


def test_a_peer_shards_the_optimizer_where_nothing_else_fits(fair: ModuleType) -> None:
    """1 GiB of parameters on 2.5 GiB devices: ZeRO-0 holds 4 GiB a device (parameters, gradients, Adam); a user
    sets ZeRO-2 and the fair peer finds it, each device within its memory."""
    g = chain_graph([{"a": (1.0, 2.0)}] * 4, param_bytes=2**28, batch_size=8)
    c = cluster_of(["a"] * 4, memory_gib=2.5)
    best = fair.fair_peer_plan(g, c, "even", _even, cuts_of=_cuts)
    assert any(int(st.zero) > 0 for st in best.stages)
    assert all(st.predicted.memory_bytes <= 2.5 * 2**30 for st in best.stages)
    with pytest.raises(Exception, match="no split"):
        fair.fair_peer_plan(g, cluster_of(["a"], memory_gib=2.5), "even", _even, cuts_of=_cuts)
