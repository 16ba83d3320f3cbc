"""costgraph: the graph view of a profile, coarsening (acyclic, totals kept), discover()."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpml_compile import build_costgraph, discover, models, profile
from hpml_compile.costgraph import block_key
from hpml_compile.ir import NodeCost, NodeOp, Profile, ProfileNode


@pytest.fixture(scope="module")
def tiny() -> Profile:
    m = models.load("gpt-tiny")
    return profile(m.module, m.example_inputs, name="gpt-tiny", device_kinds=("cpu", "A100-80GB"),
                   repeats=2, warmup=1, progress=False)


def _totals(cg) -> dict[str, float]:
    out = {a: cg.total(a) for a in ("flops", "param_bytes", "activation_bytes", "output_bytes")}
    for k in cg.kinds:
        out[k] = cg.total("", kind=k)
    return out


def test_graph_mirrors_profile(tiny: Profile) -> None:
    cg = build_costgraph(tiny)
    assert set(cg.graph) == {n.name for n in tiny.nodes}
    assert cg.graph.number_of_edges() == len({(i, n.name) for n in tiny.nodes for i in n.inputs})
    for n in tiny.nodes:
        for i in n.inputs:
            assert cg.graph.edges[i, n.name]["bytes"] == tiny.node(i).output_bytes
    assert cg.kinds == ("A100-80GB", "cpu")


def test_coarsen_gpt_into_layers(tiny: Profile) -> None:
    cg = build_costgraph(tiny)
    blocks = cg.coarsen()
    assert "layers.0" in blocks.order and "layers.1" in blocks.order
    assert len(blocks.order) < 12 < len(cg.order)
    assert nx.is_directed_acyclic_graph(blocks.graph)
    assert list(nx.topological_sort(blocks.graph)) == list(blocks.order) or all(
        blocks.order.index(u) < blocks.order.index(v) for u, v in blocks.graph.edges)
    for attr, value in _totals(cg).items():
        assert _totals(blocks)[attr] == pytest.approx(value), attr
    members = [m for b in blocks.order for m in blocks.node(b).members]
    assert members == list(cg.order)


def test_shape_edges_are_marked_non_tensor(tiny: Profile) -> None:
    cg = build_costgraph(tiny)
    non_tensor = [(u, v) for u, v, d in cg.graph.edges(data=True) if not d["tensors"]]
    assert non_tensor, "gpt reads idx.size(1): an int flows along some edge"
    assert all(cg.graph.edges[e]["bytes"] == 0 for e in non_tensor)


def test_block_key() -> None:
    assert block_key("layers.3.attn.q_proj") == "layers.3"
    assert block_key("layer2.1.conv1") == "layer2.1"
    assert block_key("lm_head") == "lm_head"
    assert block_key("") == ""


def _skip_profile() -> Profile:
    c = {"cpu": NodeCost(1.0, 2.0, True)}
    nodes = (
        ProfileNode("x", NodeOp.PLACEHOLDER, "x", output_bytes=100, cost={"cpu": NodeCost(0, 0, True)}),
        ProfileNode("a", NodeOp.CALL_MODULE, "a", ("x",), scope="b.0", output_bytes=10, cost=c),
        ProfileNode("b", NodeOp.CALL_MODULE, "b", ("a",), scope="b.1", output_bytes=20, cost=c),
        ProfileNode("c", NodeOp.CALL_MODULE, "c", ("b", "a"), scope="b.2", output_bytes=30, cost=c),
        ProfileNode("d", NodeOp.CALL_MODULE, "d", ("c", "a"), scope="b.3", output_bytes=40, cost=c),
        ProfileNode("output", NodeOp.OUTPUT, "output", ("d",), cost={"cpu": NodeCost(0, 0, True)}),
    )
    return Profile(model="skip", batch_size=1, dtype="float32", nodes=nodes)


def test_cut_bytes_counts_a_skip_connection_once() -> None:
    cg = build_costgraph(_skip_profile())
    # cutting after b: a (read by c and d) and b cross; a is counted once
    assert cg.cut_bytes(["x", "a", "b"]) == 10 + 20
    blocks = cg.coarsen()
    assert blocks.cut_bytes(blocks.order[:2]) == 10 + 20


@st.composite
def _random_profiles(draw: st.DrawFn) -> Profile:
    n = draw(st.integers(2, 25))
    nodes = [ProfileNode("n0", NodeOp.PLACEHOLDER, "x", output_bytes=8, cost={"cpu": NodeCost(0, 0, True)})]
    for i in range(1, n):
        k = draw(st.integers(1, min(3, i)))
        inputs = tuple(sorted(set(draw(st.lists(st.integers(0, i - 1), min_size=1, max_size=k)))))
        scope = draw(st.sampled_from(["", "emb", "h.0.a", "h.0.b", "h.1.a", "h.2", "head"]))
        nodes.append(ProfileNode(
            f"n{i}", NodeOp.CALL_FUNCTION, "f", tuple(f"n{j}" for j in inputs), scope=scope,
            flops=draw(st.integers(0, 1000)), output_bytes=draw(st.integers(0, 100)),
            param_bytes=draw(st.integers(0, 50)),
            cost={"cpu": NodeCost(draw(st.floats(0, 5)), draw(st.floats(0, 5)), True)}))
    return Profile(model="rand", batch_size=1, dtype="float32", nodes=tuple(nodes))


@settings(max_examples=60, deadline=None)
@given(_random_profiles())
def test_coarsening_keeps_dags_acyclic_and_totals(p: Profile) -> None:
    cg = build_costgraph(p)
    blocks = cg.coarsen()
    assert nx.is_directed_acyclic_graph(blocks.graph)
    pos = {b: i for i, b in enumerate(blocks.order)}
    assert all(pos[u] < pos[v] for u, v in blocks.graph.edges)
    for attr, value in _totals(cg).items():
        assert _totals(blocks)[attr] == pytest.approx(value)
    # a cut after any block prefix carries the same bytes in both views
    for i in range(1, len(blocks.order)):
        members = [m for b in blocks.order[:i] for m in blocks.node(b).members]
        assert blocks.cut_bytes(blocks.order[:i]) == cg.cut_bytes(members)


def test_merge_rejects_non_contiguous_groups(tiny: Profile) -> None:
    cg = build_costgraph(tiny)
    order = list(cg.order)
    with pytest.raises(ValueError, match="contiguous"):
        cg.merge([order[1:], order[:1]])


def test_discover_without_nvml_is_cpu_only() -> None:
    cluster = discover()
    cpus = [d for d in cluster.devices if d.kind == "cpu"]
    assert len(cpus) == 1 and cpus[0].memory_gib > 1
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        has_gpu = True
    except Exception:
        has_gpu = False
    assert (len(cluster.devices) > 1) == has_gpu


def test_node_records_carry_what_the_profile_says(tiny: Profile) -> None:
    cg = build_costgraph(tiny)
    for n in tiny.nodes:
        rec = cg.node(n.name)
        assert rec.members == (n.name,) and rec.op == n.op.value and rec.params == n.params
        assert rec.param_bytes == n.param_bytes and rec.activation_bytes == n.activation_bytes
        assert rec.cost == {k: (c.fwd_ms, c.bwd_ms) for k, c in n.cost.items()}
        assert rec.fixed_at("cpu") == (n.cost["cpu"].fwd_fixed_ms, n.cost["cpu"].bwd_fixed_ms)
    assert cg.node(tiny.nodes[0].name) is cg.node(tiny.nodes[0].name)  # made once
    blocks = cg.coarsen()
    first = blocks.node(blocks.order[0])
    assert first.op == "block" and len(first.members) > 1
    assert sum(blocks.node(b).param_bytes for b in blocks.order) == cg.total("param_bytes")
    with pytest.raises(KeyError):
        cg.node("no such node")


def test_compiled_costs_price_only_a_compiled_graph_and_survive_coarsening() -> None:
    from dataclasses import replace

    from hpml_compile.testing import chain_profile

    p = chain_profile([{"cpu": (1.0, 2.0)}, {"cpu": (3.0, 4.0)}, {"cpu": (5.0, 6.0)}])
    fast = {"n0": NodeCost(0.5, 1.0, True, fwd_fixed_ms=0.1), "n1": NodeCost(1.5, 2.5, True)}  # n2: fell back
    p = replace(p, nodes=tuple(replace(n, compiled={"cpu": fast[n.name]}) if n.name in fast else n for n in p.nodes))
    eager, compiled = build_costgraph(p), build_costgraph(p, compiled=True)
    assert eager.compiled == frozenset() and compiled.compiled == frozenset({"cpu"})
    assert [compiled.node(n).cost["cpu"] for n in ("n0", "n1", "n2")] == [(0.5, 1.0), (1.5, 2.5), (5.0, 6.0)]
    assert compiled.node("n0").fixed_at("cpu") == (0.1, 0.0) and eager.node("n0").fixed_at("cpu") == (0.0, 0.0)
    assert eager.total("", "cpu") == 21.0 and compiled.total("", "cpu") == 16.5
    merged = compiled.merge([["n0", "n1"], ["n2"]])
    assert merged.compiled == compiled.compiled and merged.node(merged.order[0]).cost["cpu"] == (2.0, 3.5)
