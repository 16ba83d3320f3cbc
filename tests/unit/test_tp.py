"""Tensor parallelism in the compiler: the units found in the graph, the plan's ``tp``, the cost model and the
candidate table, the solver's choice, the certificate, clusters described by their hosts, and the grid peer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from hpml_compile import models
from hpml_compile.certify import fixed_bound
from hpml_compile.cluster import dgx_pod, link_between, load_cluster
from hpml_compile.costgraph import build
from hpml_compile.errors import PlanError, SchemaError
from hpml_compile.explain import tp_lines
from hpml_compile.ir import Cluster, Device, Link
from hpml_compile.models.gpt import GPT, GPTConfig
from hpml_compile.plan import Plan, Schedule, SolverInfo, Stage, load_plan, save_plan, validate_plan
from hpml_compile.profile import profile
from hpml_compile.simulate import BWD, WGT, simulate, stage_costs
from hpml_compile.solve import solve
from hpml_compile.solve.candidates import CONFIGS, Chain, Setting, to_plan
from hpml_compile.solve.table import build_table
from hpml_compile.stagecost import tp_bytes
from hpml_compile.tp import Role, analyze

KINDS = ["H100-80GB", "A100-80GB"]


def _profile(module: nn.Module, inputs: tuple, batch: int, **kw: object):
    return profile(module, inputs, name="m", device_kinds=KINDS, batch_size=batch, progress=False, **kw)


@pytest.fixture(scope="module")
def llama():
    """A Llama-flavoured zoo GPT (RMSNorm, SwiGLU, RoPE, 8 query heads over 2 key/value heads), on meta."""
    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=8, n_kv_head=2, d_model=128, d_ff=256, max_seq_len=64,
                    norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, tie_embeddings=False)
    with torch.device("meta"):
        m = GPT(cfg)
    return _profile(m, (torch.zeros(8, 64, dtype=torch.long, device="meta"),), 8, seq_len=64)


@pytest.fixture(scope="module")
def gpt2():
    m = models.load("gpt-tiny", batch_size=8, device="meta")
    return _profile(m.module, m.example_inputs, 8, seq_len=m.seq_len)


def test_the_megatron_units_of_gpt2_and_llama_shapes(gpt2, llama) -> None:
    tp = analyze(gpt2)
    assert [u.kind for u in tp.units] == ["embedding", "attention", "mlp", "attention", "mlp", "head"]
    attn, mlp = tp.units[1], tp.units[2]
    assert [c.split("_")[-2] for c in attn.columns] == ["q", "k", "v"] and attn.row.endswith("o_proj")
    assert [h for _, h in attn.reshapes] == [4, 4, 4] and attn.max_tp == 4  # 4 heads
    assert mlp.columns[0].endswith("up_proj") and mlp.row.endswith("down_proj") and mlp.max_tp == 8
    assert tp.role(attn.row, 2) is Role.ROW and tp.role(attn.row, 8) is None and tp.unmatched == ()
    lt = analyze(llama)
    attn, mlp = lt.units[1], lt.units[2]
    assert attn.max_tp == 2  # grouped-query: 2 key/value heads
    assert sorted(c.split("_")[-2] for c in mlp.columns) == ["gate", "up"]
    assert lt.units[-1].kind == "head" and lt.units[-1].columns == ("lm_head",)


def test_a_layer_that_does_not_match_keeps_tp_1_and_says_why() -> None:
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16))
    tp = analyze(_profile(m, (torch.zeros(4, 16, device="meta"),), 4))
    assert tp.units == ()
    assert any("norm" in why for _, why in tp.unmatched), tp.unmatched


def test_transformers_llama_and_gpt2_through_export() -> None:
    lm = models.load("hf:llama?num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
                     "num_key_value_heads=2,vocab_size=128", batch_size=2)
    tp = analyze(_profile(lm.module, lm.example_inputs, 2, repeats=1, warmup=0))
    assert [u.kind for u in tp.units] == ["embedding", "attention", "mlp", "attention", "mlp", "head"]
    assert tp.units[1].max_tp == 2 and [h for _, h in tp.units[1].reshapes] == [4, 2, 2]
    assert all(w.endswith("_weight") for w, _ in tp.units[1].weights) and len(tp.units[1].weights) == 4
    g2 = models.load("hf:gpt2?n_layer=2,n_embd=64,n_head=4,vocab_size=128,n_positions=128", batch_size=2)
    tp2 = analyze(_profile(g2.module, g2.example_inputs, 2, repeats=1, warmup=0))
    fused = next(u for u in tp2.units if u.kind == "attention")
    assert len(fused.columns) == 1 and len(fused.reshapes) == 3  # one fused q/k/v layer, split into heads
    assert [s for s, _ in tp2.unmatched] == ["transformer.wpe"]  # positions: kept whole


def test_plan_json_carries_tp_and_older_plans_load_with_tp_1(tmp_path: Path) -> None:
    c = load_cluster("dgx-a100-8")
    st = Stage(0, tuple(f"gpu{i}" for i in range(8)), ("x",), tp=4)
    assert st.replicas == 2 and st.tp_groups()[1] == ("gpu4", "gpu5", "gpu6", "gpu7")
    assert st.dp_groups()[0] == ("gpu0", "gpu4")
    p = Plan("toy", c, Schedule.ONE_F_ONE_B, 2, (st,))
    path = save_plan(p, tmp_path / "plan.json")
    d = json.loads(path.read_text())
    assert d["schema_version"] == 3 and d["stages"][0]["tp"] == 4 and load_plan(path) == p
    d["schema_version"] = 2
    del d["stages"][0]["tp"]
    assert Plan.from_dict(d).stages[0].tp == 1
    d["stages"][0]["tp"] = 3
    with pytest.raises(SchemaError, match="stages\\[0\\].tp"):
        Plan.from_dict(d)


def test_a_group_across_hosts_or_kinds_is_refused_by_name(llama) -> None:
    nodes = tuple(n.name for n in llama.nodes)
    two = load_cluster("2node-a100-16")
    p = Plan("m", two, Schedule.ONE_F_ONE_B, 1, (Stage(0, ("gpu6", "gpu7", "gpu8", "gpu9"), nodes, tp=4),),
             precision=llama.precision)
    with pytest.raises(PlanError, match="gpu6, gpu7, gpu8, gpu9 spans hosts node0, node1.*set its tp to 1"):
        validate_plan(p, llama)
    mixed = Cluster((Device("a", "H100-80GB", 80), Device("b", "A100-80GB", 80)))
    with pytest.raises(PlanError, match="mixes kinds"):
        validate_plan(replace(p, cluster=mixed, stages=(Stage(0, ("a", "b"), nodes, tp=2),)), llama)


def test_tp_divides_the_stage_and_adds_its_collectives(llama) -> None:
    g = build(llama).coarsen()
    nodes = tuple(n.name for n in llama.nodes)
    c = load_cluster("dgx-h100-8")

    def cost(tp: int, cluster: Cluster = c):
        return stage_costs(Plan("m", cluster, Schedule.ONE_F_ONE_B, 1, (Stage(0, ("gpu0", "gpu1"), nodes, tp=tp),)),
                           g, llama.dtype)[0]
    dp, tp = cost(1), cost(2)
    tpa = analyze(llama)
    sharded = sum(n.param_bytes for n in llama.nodes if tpa.role(n.name, 2) is not None)
    whole = sum(n.param_bytes for n in llama.nodes)
    assert 0 < sharded < whole and tp.memory.params == tp_bytes(whole, sharded, 2) < dp.memory.params
    slow = replace(c, links=(Link("gpu0", "gpu1", 0.01, 3.0),))
    assert cost(2, slow).fwd_ms > tp.fwd_ms and cost(2, slow).bwd_ms > tp.bwd_ms  # the collectives are priced


def test_simulator_and_table_price_a_tp_stage_alike(llama) -> None:
    g = build(llama).coarsen()
    chain, c = Chain.of(g), load_cluster("dgx-h100-8")
    setting = Setting(2, Schedule.ONE_F_ONE_B, llama.batch_size, llama.dtype)
    tab = [x for x in build_table(chain, c, setting).candidates() if x.a == 0 and x.b == chain.n and x.config.tp > 1]
    assert {x.config.tp for x in tab} == {2} and tab  # the attention units allow 2 (2 key/value heads)
    for cand in tab:
        plan = to_plan(chain, c, setting, [cand], SolverInfo("test"))
        assert plan.stages[0].tp == cand.config.tp
        got = stage_costs(plan, g, llama.dtype)[0]
        want = cand.memory
        assert (got.memory.params, got.memory.optimizer, got.memory.stored_per_microbatch) == \
            (want.params, want.optimizer, want.stored_per_microbatch)
        assert got.compute_ms == pytest.approx(cand.t, rel=1e-9)
        assert got.synced_ms + got.optimizer_ms == pytest.approx(cand.tail, rel=1e-9, abs=1e-12)


def test_the_solver_chooses_tp_beats_grid_and_its_bound_holds() -> None:
    """llama-7b in bf16 on 8 DGX H100 hosts: the solver's plan shards, the grid peer is no faster, and the
    certificate's bound is below both (tensor parallelism may divide a row's work, not its fixed per-op part)."""
    m = models.load("llama-7b", batch_size=64, device="meta")
    prof = profile(m.module, m.example_inputs, name="llama-7b", device_kinds=["H100-80GB"], batch_size=64,
                   seq_len=m.seq_len, progress=False, precision="bf16")
    c = load_cluster("dgx-h100-8x8")
    fine = build(prof)
    g = fine.coarsen()
    ilp = solve(g, c, time_limit_s=10, dtype=prof.dtype, compute_bytes=2)
    grid = solve(g, c, solver="grid", time_limit_s=30, dtype=prof.dtype, compute_bytes=2)
    assert any(st.tp > 1 for st in ilp.stages) and ilp.predicted.step_ms <= grid.predicted.step_ms
    bound = fixed_bound(fine, c)
    assert bound <= ilp.predicted.step_ms and bound <= grid.predicted.step_ms
    for plan in (ilp, grid):  # each fits as the validator prices it (autocast's copies included)
        validate_plan(replace(plan, precision=prof.precision), prof)
    assert any("tensor parallel, stage" in line for line in tp_lines(ilp, g))


def test_assigned_groups_stay_on_one_host() -> None:
    from hpml_compile.solve.candidates import assign_tp_devices

    c = load_cluster("2node-a100-16")
    devs, tps = assign_tp_devices(c, [("A100-80GB", 4, 1), ("A100-80GB", 8, 4), ("A100-80GB", 4, 2)])
    assert tps == [1, 4, 2]
    for group, tp in zip(devs[1:], tps[1:]):
        for k in range(0, len(group), tp):
            assert len({c.device(x).host for x in group[k:k + tp]}) == 1
    assert len({x for d in devs for x in d}) == 16


def test_hosts_describe_the_links_and_pairwise_links_override(tmp_path: Path) -> None:
    pod = load_cluster("dgx-h100-8x8")
    assert len(pod.devices) == 64 and len({d.host for d in pod.devices}) == 8
    assert link_between(pod, "gpu0", "gpu7") == (450, 3.0) and link_between(pod, "gpu0", "gpu8") == (50.0, 5.0)
    assert len(load_cluster("dgx-a100-8x4").devices) == 32
    d = dgx_pod("A100-80GB", 80, 2, "nvlink3", "ib-hdr", "two").to_dict()
    d["hosts"][1]["nics"] = 2  # 4 GPUs share each card of node1: a quarter of its 25 GB/s each
    d["links"] = [{"a": "gpu1", "b": "gpu9", "gbps": 1.0}]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d))
    c = load_cluster(str(path))
    assert link_between(c, "gpu0", "gpu8")[0] == 25.0 / 4 and link_between(c, "gpu1", "gpu9")[0] == 1.0
    d["hosts"][0]["nic"] = "carrier-pigeon"
    path.write_text(json.dumps(d))
    with pytest.raises(SchemaError, match="hosts\\[0\\].nic"):
        load_cluster(str(path))


def test_tp_configs_are_offered_last_without_offload_or_swap() -> None:
    tps = [c for c in CONFIGS if c.tp > 1]
    assert tps and CONFIGS.index(tps[0]) > max(i for i, c in enumerate(CONFIGS) if c.tp == 1)
    assert not any(c.offload or c.swap for c in tps)
    assert {c.tp for c in tps} == {2, 4, 8}


def test_a_unit_cut_between_stages_is_refused_where_one_is_tensor_parallel(gpt2) -> None:
    names = [n.name for n in gpt2.nodes]
    cut = names.index(next(n for n in names if n.endswith("o_proj")))  # inside the first attention unit
    c = load_cluster("dgx-a100-8")
    stages = (Stage(0, ("gpu0", "gpu1"), tuple(names[:cut]), tp=2), Stage(1, ("gpu2",), tuple(names[cut:])))
    plan = Plan("m", c, Schedule.ONE_F_ONE_B, 1, stages, precision=gpt2.precision)
    with pytest.raises(PlanError, match="attention unit at layers.0.attn.q_proj is split between stages \\[0, 1\\]"):
        validate_plan(plan, gpt2)
    validate_plan(replace(plan, stages=(replace(stages[0], tp=1), stages[1])), gpt2)  # no tp: a plain cut


def test_the_table_offers_no_tensor_parallel_stage_that_cuts_a_unit(gpt2) -> None:
    """Every node its own chain position, so ranges may end inside an attention or MLP unit: a ``tp > 1``
    candidate never does (validate_plan would refuse its plan), while ``tp = 1`` ones may."""
    chain, c = Chain.of(build(gpt2)), load_cluster("dgx-a100-8")
    assert any(chain.in_unit) and not all(chain.in_unit)
    setting = Setting(1, Schedule.ONE_F_ONE_B, gpt2.batch_size, gpt2.dtype)
    cands = build_table(chain, c, setting).candidates()
    sharded = [x for x in cands if x.config.tp > 1]
    assert sharded and any(chain.in_unit[x.a] or chain.in_unit[x.b] for x in cands if x.config.tp == 1)
    assert not [x for x in sharded if chain.in_unit[x.a] or chain.in_unit[x.b]]


def test_a_compiled_per_op_cost_is_priced_and_stated() -> None:
    from hpml_compile.assumptions import assumptions
    from hpml_compile.errors import OptionError

    m = models.load("gpt-tiny", batch_size=8, device="meta")
    eager = profile(m.module, m.example_inputs, name="t", device_kinds=["H100-80GB"], batch_size=8, progress=False)
    fast = profile(m.module, m.example_inputs, name="t", device_kinds=["H100-80GB"], batch_size=8, progress=False,
                   gpu_op_us=5)
    fixed = [sum(n.cost["H100-80GB"].fwd_fixed_ms for n in p.nodes) for p in (eager, fast)]
    assert fixed[1] < fixed[0] / 10 and fast.devices["H100-80GB"]["op_ms"] == 0.005
    plan = solve(build(fast), load_cluster("dgx-h100-8"), microbatches=1)
    said = {a.name: a.value for a in assumptions(replace(plan, precision=fast.precision), fast)}
    assert said["per-op host cost on a GPU"] == "5 us an op"
    with pytest.raises(OptionError, match="gpu_op_us"):
        profile(m.module, m.example_inputs, device_kinds=["H100-80GB"], progress=False, gpu_op_us=-1)


def test_a_cluster_less_a_device_keeps_its_hosts() -> None:
    from hpml_compile.replan import without_devices

    pod = load_cluster("dgx-a100-8x4")
    left = without_devices(pod, [f"gpu{i}" for i in range(8)])  # node0 gone whole
    assert [h.name for h in left.hosts] == ["node1", "node2", "node3"]
    assert link_between(left, "gpu8", "gpu16") == link_between(pod, "gpu8", "gpu16") == (25.0, 5.0)


def test_ilp_is_never_slower_than_the_grid_mesh() -> None:
    """gpt2-small on hetero-4: one stage over both kinds (each replica one kind) is outside the ILP's stages of one
    kind; ilp takes the mesh where it simulates faster."""
    m = models.load("gpt2-small", batch_size=32, device="meta")
    c = load_cluster("hetero-4")
    prof = profile(m.module, m.example_inputs, name="g", device_kinds=sorted({d.kind for d in c.devices}),
                   batch_size=32, seq_len=m.seq_len, progress=False)
    g = build(prof).coarsen()
    ilp, grid = (solve(g, c, solver=s, time_limit_s=10) for s in ("ilp", "grid"))
    assert ilp.predicted.step_ms <= grid.predicted.step_ms
    assert ilp.solver.name == "portfolio+grid" and len({c.device(d).kind for d in ilp.stages[0].devices}) == 2


def test_a_plan_with_a_tp_per_stage_validates_prices_shows_and_explains(llama) -> None:
    """Stages of tp 2 and 1 in one plan: the plan carries each stage's degree through validation, the simulator
    (only stage 0's memory is divided, only it pays the collectives), the picture and the explanation."""
    from hpml_compile.viz import plan_graph

    nodes = [n.name for n in llama.nodes]
    cut = next(i for i, n in enumerate(llama.nodes) if n.scope.startswith("layers.1"))
    c = load_cluster("dgx-h100-8")
    two = (Stage(0, ("gpu0", "gpu1"), tuple(nodes[:cut]), tp=2), Stage(1, ("gpu2",), tuple(nodes[cut:])))
    p = Plan("m", c, Schedule.ONE_F_ONE_B, 2, two, precision=llama.precision)
    validate_plan(p, llama)
    g = build(llama).coarsen()
    mixed = stage_costs(p, g, llama.dtype)
    flat = stage_costs(replace(p, stages=(replace(two[0], devices=("gpu0",), tp=1), two[1])), g, llama.dtype)
    assert mixed[0].memory.params < flat[0].memory.params and mixed[1].memory == flat[1].memory
    assert mixed[1].fwd_ms == flat[1].fwd_ms
    # the tp-1 rank sends the gradient to both places of the tp-2 stage: two copies back, one forward
    assert dict(mixed[0].back)[1] == pytest.approx(2 * dict(mixed[0].sends)[1]) and flat[0].back == flat[0].sends
    lines = tp_lines(p, g)
    assert lines[0].startswith("  tensor parallel, stage 0 (tp 2") and not any("stage 1 (tp" in x for x in lines)
    assert any(x.startswith("  tensor parallel, boundary 0 -> 1 (tp 2 -> 1)") and "2 copies from each rank of stage 1"
               in x for x in lines), lines
    src = plan_graph(p, g, simulate(p, g)).source
    assert src.count("tp 2 x 1 replicas") == 1


def test_compile_keeps_a_tp_per_stage_unless_a_tied_weight_crosses_degrees(gpt2, llama) -> None:
    """compile runs the solver's plan with a tp per stage as it is; it plans again without tensor parallelism
    only where an embedding tied to the LM head would be held at two degrees (or tp meets swap or offload)."""
    from hpml_compile.driver import _unrunnable_tp

    def two_stages(prof, tp: tuple[int, int]) -> Plan:
        names = [n.name for n in prof.nodes]
        cut = next(i for i, n in enumerate(prof.nodes) if n.scope.startswith("layers.1"))
        devs = (tuple(f"gpu{i}" for i in range(tp[0])), tuple(f"gpu{i}" for i in range(tp[0], tp[0] + tp[1])))
        return Plan("m", load_cluster("dgx-h100-8"), Schedule.ONE_F_ONE_B, 2,
                    (Stage(0, devs[0], tuple(names[:cut]), tp=tp[0]), Stage(1, devs[1], tuple(names[cut:]), tp=tp[1])),
                    precision=prof.precision)

    assert _unrunnable_tp(two_stages(llama, (2, 1)), llama) is None  # untied
    why = _unrunnable_tp(two_stages(gpt2, (2, 1)), gpt2)
    assert why is not None and "wte.weight" in why and "[2, 1]" in why, why
    assert _unrunnable_tp(two_stages(gpt2, (2, 2)), gpt2) is None
def test_zb_h1_prices_the_tp_collectives_in_the_input_part(llama) -> None:
    """A tp=2 stage under ZB-H1: a slower link inside the group lengthens the backward's input-gradient part
    (the all-reduces of the inputs' gradients) and leaves its weight-gradient part (local) as it was."""
    g = build(llama).coarsen()
    nodes = tuple(n.name for n in llama.nodes)
    c = load_cluster("dgx-h100-8")

    def cost(cluster: Cluster):
        return stage_costs(Plan("m", cluster, Schedule.ZB_H1, 2, (Stage(0, ("gpu0", "gpu1"), nodes, tp=2),)),
                           g, llama.dtype)[0]
    fast, slow = cost(c), cost(replace(c, links=(Link("gpu0", "gpu1", 0.01, 3.0),)))
    assert slow.bwd_ms > fast.bwd_ms + 1.0  # the collectives are priced, and they are not free on this link
    assert slow.weight_ms == pytest.approx(fast.weight_ms, rel=1e-12) and 0 < fast.weight_ms < fast.bwd_ms / 2
    assert slow.op_ms(BWD) - fast.op_ms(BWD) == pytest.approx(slow.bwd_ms - fast.bwd_ms, rel=1e-9)
    assert slow.op_ms(WGT) == pytest.approx(fast.op_ms(WGT), rel=1e-12)


def test_zb_h1_tables_offer_tensor_parallel_stages_priced_as_the_simulator(llama) -> None:
    chain, c = Chain.of(build(llama).coarsen()), load_cluster("dgx-h100-8")
    setting = Setting(2, Schedule.ZB_H1, llama.batch_size, llama.dtype)
    tab = [x for x in build_table(chain, c, setting).candidates() if x.a == 0 and x.b == chain.n and x.config.tp > 1]
    assert tab and all(not x.config.offload and not x.config.swap for x in tab)
    assert any(x.d > x.config.tp for x in tab)  # replicas that sync their gradients
    g = build(llama).coarsen()
    for cand in tab:
        plan = to_plan(chain, c, setting, [cand], SolverInfo("test"))
        assert plan.schedule is Schedule.ZB_H1 and plan.stages[0].tp == cand.config.tp
        got = stage_costs(plan, g, llama.dtype)[0]
        assert got.compute_ms == pytest.approx(cand.t, rel=1e-9)
        # the gradient sync overlaps the last weight-gradient part: the same window on both sides
        assert got.synced_ms + got.optimizer_ms == pytest.approx(cand.tail, rel=1e-9, abs=1e-12)


def test_grid_and_ilp_shard_under_zb_h1_where_only_a_shard_fits(llama) -> None:
    """Two devices too small for the model whole: under ZB-H1 both solvers place it as one tp=2 stage."""
    g = build(llama).coarsen()
    small = Cluster((Device("a", "H100-80GB", 0.007), Device("b", "H100-80GB", 0.007)))
    for solver in ("grid", "ilp"):
        plan = solve(g, small, solver=solver, schedule="zb-h1", time_limit_s=5, dtype=llama.dtype)
        assert plan.schedule is Schedule.ZB_H1 and [st.tp for st in plan.stages] == [2], (solver, plan.stages)
