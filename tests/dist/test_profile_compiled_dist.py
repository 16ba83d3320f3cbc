"""Compiled block times: the profile times blocks compiled, the cost graph and the plan price compiled stages by them.

Marked ``dist``: inductor runs the host's C++ compiler in processes of its own."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hpml_compile import driver
from hpml_compile.cluster import load_cluster
from hpml_compile.costgraph import build
from hpml_compile.ir import NodeOp
from hpml_compile.profile import load_profile, profile, save_profile

pytestmark = pytest.mark.dist


def _model(width: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Linear(width, width)), (torch.randn(8, width),)


@pytest.fixture(scope="module")
def compiled_profile():
    """Two identical blocks (one compile), timed compiled at the batch and at 2 rows."""
    cluster = load_cluster("local-cpu-1")
    m, x = _model(48)
    lines: list[str] = []
    prof = profile(m, x, repeats=3, warmup=1, progress=False, micro_batch=2, optimizer=None, compiled=True,
                   say=lines.append, threads=driver.local_threads(cluster))
    return prof, lines, cluster


@pytest.mark.slow  # the shared profile compiles: ~25 s on a busy 2-core machine
def test_blocks_timed_compiled_once_per_kind_and_carried_by_the_cost_graph(compiled_profile, tmp_path):
    prof, lines, _ = compiled_profile
    facts = prof.devices["cpu"]["compiled"]
    assert (facts["blocks"], facts["distinct"], facts["fallbacks"], facts["rows"]) == (2, 1, {}, [8, 2])
    assert sum(line.strip().startswith("block 0 and 1 identical") for line in lines) == 1  # one compile, both
    blocks = [n for n in prof.nodes if n.op is NodeOp.CALL_MODULE]
    assert blocks and all("cpu" in n.compiled for n in blocks)
    assert all(not n.compiled for n in prof.nodes if n.op is not NodeOp.CALL_MODULE)
    for n in blocks:  # each compiled cost is its eager cost in sequence times its block's measured ratio
        rf, rb = facts["ratios"][n.name.removeprefix("_")]
        assert math.isclose(n.compiled["cpu"].fwd_ms, n.cost["cpu"].fwd_ms * rf, rel_tol=1e-3)
        assert math.isclose(n.compiled["cpu"].bwd_ms, n.cost["cpu"].bwd_ms * rb, rel_tol=1e-3)
        assert n.compiled["cpu"].fwd_fixed_ms <= n.compiled["cpu"].fwd_ms
    eager, fast = build(prof), build(prof, compiled=True)
    assert eager.compiled == frozenset() and fast.compiled == frozenset({"cpu"})
    for n in blocks:
        assert eager.node(n.name).cost["cpu"] == (n.cost["cpu"].fwd_ms, n.cost["cpu"].bwd_ms)
        assert fast.node(n.name).cost["cpu"] == (n.compiled["cpu"].fwd_ms, n.compiled["cpu"].bwd_ms)
    assert fast.coarsen().compiled == frozenset({"cpu"})
    back = load_profile(save_profile(prof, tmp_path / "profile.json"))  # the file keeps them
    assert [n.compiled for n in back.nodes] == [n.compiled for n in prof.nodes]


@pytest.mark.slow
def test_a_compiled_plan_predicts_the_compiled_compute(compiled_profile):
    prof, _, cluster = compiled_profile
    eager = driver.plan(prof, cluster, driver.Options(microbatches=1, uneven=False))
    fast = driver.plan(prof, cluster, driver.Options(microbatches=1, uneven=False, compiled=True))
    want = {k: sum(getattr(n.compiled.get("cpu", n.cost["cpu"]), k) for n in prof.nodes) for k in ("fwd_ms", "bwd_ms")}
    was = {k: sum(getattr(n.cost["cpu"], k) for n in prof.nodes) for k in ("fwd_ms", "bwd_ms")}
    assert math.isclose(fast.stages[0].predicted.fwd_ms, want["fwd_ms"], rel_tol=1e-6)
    assert math.isclose(fast.stages[0].predicted.bwd_ms, want["bwd_ms"], rel_tol=1e-6)
    assert math.isclose(eager.stages[0].predicted.fwd_ms, was["fwd_ms"], rel_tol=1e-6)
    assert not math.isclose(fast.stages[0].predicted.fwd_ms, eager.stages[0].predicted.fwd_ms, rel_tol=1e-3)
    names = [a.name for a in fast.assumptions]
    assert {"compiled stages on cpu", "compiled fixed parts on cpu", "compiled call overhead on cpu"} <= set(names)
    assert not any(a.name.startswith("compiled") for a in eager.assumptions)


def test_a_block_that_does_not_compile_keeps_its_eager_times_said_once():
    m, x = _model(24)
    lines: list[str] = []
    # a machine without a working C++ compiler: inductor fails on every block (no cache may stand in for it)
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        prof = profile(m, x, repeats=1, warmup=0, progress=False, micro_batch=0, optimizer=None, compiled=True,
                       say=lines.append)
    said = [line for line in lines if "priced eager" in line]
    assert len(said) == 1 and "block 0 and 1 identical" in said[0] and "C++ compiler" in said[0]
    assert set(prof.devices["cpu"]["compiled"]["fallbacks"]) == {"0", "1"}
    assert all(not n.compiled for n in prof.nodes)
    fast = build(prof, compiled=True)
    assert fast.compiled == frozenset() and fast.total("", "cpu") == build(prof).total("", "cpu")
    plan = driver.plan(prof, load_cluster("local-cpu-1"), driver.Options(microbatches=1, uneven=False, compiled=True))
    assert {"block 0 on cpu", "block 1 on cpu"} <= {a.name for a in plan.assumptions}
