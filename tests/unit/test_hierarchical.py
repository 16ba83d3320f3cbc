"""Hierarchical all-reduce in the plan, the cost model and the solver (the collective itself: tests/dist/test_hierarchical_dist.py).

- ``Stage.allreduce`` round-trips through plan.json, written only when not flat;
- a plan asking it for a stage on one host, on hosts holding different numbers
  of the stage's devices, or for a ZeRO-2/3 stage is refused by name (ZeRO-1 is
  accepted: tests/unit/test_hier_zero.py);
- the cost model prices each level on its own link, and the solver picks
  hierarchical on two hosts where it is faster and never on one host;
- on GPUs the hierarchical all-reduce is priced overlapped with the last
  backward as the runtime now runs it (each bucket a chain of the three
  collectives: the last bucket's chain stays exposed), on CPU ranks after it;
- ``Plan.tied_allreduce`` (the all-reduce of a tied embedding over the stages
  using it) round-trips, is priced per level, and is refused where no such
  group spans hosts.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import cost_models
from hpml_compile import models
from hpml_compile.cluster import hierarchy, load_cluster
from hpml_compile.costgraph import build
from hpml_compile.testing import SkipNet, skipnet_batch, split_plan
from hpml_compile.errors import PlanError, SchemaError
from hpml_compile.explain import summary
from hpml_compile.ir import Cluster, Device
from hpml_compile.memory import ZeroStage
from hpml_compile.plan import (AllReduce, Plan, Schedule, Stage, check_comm, load_plan, save_plan, sync_overlap,
                               tied_groups, validate_plan, with_comm)
from hpml_compile.profile import profile
from hpml_compile.simulate import simulate, stage_costs, tied_syncs
from hpml_compile.solve import solve
from hpml_compile.solve.candidates import faster_allreduce
from hpml_compile.testing import chain_graph, dag_profile
from hpml_compile.stagecost import hierarchical_allreduce_ms, hierarchical_overlapped_ms, level_bytes, meet_ms, sync_ms
from hpml_compile.trace import trace


def two_hosts(plan: Plan, how: AllReduce) -> Plan:
    devs = tuple(Device(f"cpu{i}", "cpu", 2.0, host="hostA" if i < 2 else "hostB") for i in range(4))
    return replace(plan, cluster=Cluster(devices=devs, name="two-hosts"),
                   stages=(replace(plan.stages[0], allreduce=how),))


@pytest.fixture(scope="module")
def base() -> Plan:
    gm = trace(SkipNet(), skipnet_batch(rows=16)[:1])
    return split_plan(gm, "skipnet", 1, microbatches=2, replicas=[4])


def test_the_field_round_trips_and_is_written_only_when_not_flat(base: Plan, tmp_path: Path) -> None:
    flat, hier = two_hosts(base, AllReduce.FLAT), two_hosts(base, AllReduce.HIERARCHICAL)
    assert "allreduce" not in flat.to_dict()["stages"][0]
    assert hier.to_dict()["stages"][0]["allreduce"] == "hierarchical"
    assert load_plan(save_plan(hier, tmp_path / "p.json")) == hier
    assert Plan.from_dict(flat.to_dict()) == flat


def test_a_hierarchical_allreduce_where_it_cannot_run_is_refused_by_name(base: Plan, tmp_path: Path) -> None:
    one_host = replace(base, stages=(replace(base.stages[0], allreduce=AllReduce.HIERARCHICAL),))  # local-cpu-4
    with pytest.raises(SchemaError, match=r"stages\[0\]\.allreduce.*all on host localhost"):
        load_plan(save_plan(one_host, tmp_path / "plan.json"))
    prof = profile(SkipNet(), skipnet_batch(rows=16)[:1], name="skipnet", progress=False, repeats=1)
    with pytest.raises(PlanError, match="stage 0 asks for a hierarchical all-reduce, but its 4 devices are all on"):
        validate_plan(one_host, prof)
    hier = two_hosts(base, AllReduce.HIERARCHICAL)
    validate_plan(hier, prof)  # two hosts of two: fine
    uneven = replace(hier, cluster=Cluster(devices=tuple(
        replace(d, host="hostB" if d.name == "cpu3" else "hostA") for d in hier.cluster.devices), name="uneven"))
    with pytest.raises(PlanError, match="different numbers"):
        validate_plan(uneven, prof)
    with pytest.raises(SchemaError, match="different numbers"):
        Plan.from_dict(uneven.to_dict())
    validate_plan(replace(hier, stages=(replace(hier.stages[0], zero=ZeroStage.OS),)), prof)  # HSDP-like ZeRO-1
    for z in (ZeroStage.OS_G, ZeroStage.OS_G_P):
        sharded = replace(hier, stages=(replace(hier.stages[0], zero=z),))
        with pytest.raises(PlanError, match=f"ZeRO-{int(z)}, whose reduce-scatter and all-gather are flat"):
            validate_plan(sharded, prof)
        with pytest.raises(SchemaError, match=f"ZeRO-{int(z)}"):
            Plan.from_dict(sharded.to_dict())


def test_each_level_is_priced_on_its_own_link() -> None:
    c = load_cluster("2node-a100-16")
    h = hierarchy(c, [f"gpu{i}" for i in range(16)])
    assert h is not None and h.per_host == 8 and h.intra.gbps == 300 and h.inter.gbps == 12.5
    b = 2**30
    want = (cost_models.reduce_scatter_ms(b, 8, h.intra) + cost_models.allreduce_ms(b / 8, 2, h.inter)
            + cost_models.all_gather_ms(b, 8, h.intra))
    assert hierarchical_allreduce_ms(b, h) == pytest.approx(want)
    # after the backward (no bucketing asked): the three levels, after the stage's members meet
    assert sync_ms(b, 16, ZeroStage.NONE, False, h.inter, h.inter, h) == pytest.approx(want + meet_ms(16, h.inter))
    assert want < cost_models.allreduce_ms(b, 16, h.inter) / 5  # 1/8 of the bytes between hosts, no 15/8 ring
    assert level_bytes(b, 16, h) == {"intra": 2 * 7 * b // 8, "inter": b // 8}
    assert hierarchy(c, [f"gpu{i}" for i in range(8)]) is None  # one host
    assert hierarchy(c, ["gpu0", "gpu1", "gpu8"]) is None  # 2 + 1


def test_the_solver_picks_hierarchical_across_hosts_only_where_faster() -> None:
    c = load_cluster("2node-a100-16")
    two = Cluster(devices=tuple(d for d in c.devices if d.name in {"gpu0", "gpu1", "gpu8", "gpu9"}), name="2x2")
    g = chain_graph([(1.0, 2.0)] * 4, kind="A100-80GB", param_bytes=2**20, batch_size=64)
    plan = solve(g, two, solver="dp", microbatches=1)  # one microbatch: a pipeline would idle, so data parallel
    wide = [st for st in plan.stages if len(st.devices) == 4 and st.zero == ZeroStage.NONE]
    assert wide and all(st.allreduce is AllReduce.HIERARCHICAL for st in wide), plan.stages
    flat = solve(g, two, solver="dp", microbatches=1, hierarchical=False)
    assert all(st.allreduce is AllReduce.FLAT for st in flat.stages)
    assert plan.predicted.step_ms < flat.predicted.step_ms
    text = summary(plan, g, simulate(plan, g))  # what `show` prints: the scheme and the bytes of each level
    assert "hierarchical all-reduce (2 hosts x 2)" in text and "between hosts" in text, text
    one = Cluster(devices=tuple(d for d in c.devices if d.host == "node0")[:4], name="1x4")
    assert all(st.allreduce is AllReduce.FLAT for st in solve(g, one, solver="dp", microbatches=1).stages)


def test_the_tied_allreduce_is_recorded_priced_per_level_and_refused_where_no_group_spans_hosts(
        tmp_path: Path) -> None:
    loaded = models.load("gpt-tiny", batch_size=8, seq_len=16, device="meta")
    prof = profile(loaded.module, loaded.example_inputs, name="gpt-tiny", device_kinds=["A100-80GB"],
                   batch_size=8, seq_len=16, progress=False)
    graph = build(prof)
    gm = trace(models.load("gpt-tiny", batch_size=8, seq_len=16).module, loaded.example_inputs)
    two = split_plan(gm, "gpt-tiny", 2, microbatches=2, replicas=[2, 2])  # cpu0-1 | cpu2-3
    gpus = tuple(Device(f"cpu{i}", "A100-80GB", 80.0, host="n0" if i < 2 else "n1") for i in range(4))
    flat = replace(two, cluster=Cluster(devices=gpus, name="2x2"))
    hier = replace(flat, tied_allreduce=AllReduce.HIERARCHICAL)
    assert "tied_allreduce" not in flat.to_dict() and hier.to_dict()["tied_allreduce"] == "hierarchical"
    assert load_plan(save_plan(hier, tmp_path / "p.json")).tied_allreduce is AllReduce.HIERARCHICAL
    assert tied_groups(hier, ((n.name, n.params) for n in prof.nodes)) == [(0, 1)]
    (stages_f, ms_f), = tied_syncs(flat, graph)
    (stages_h, ms_h), = tied_syncs(hier, graph)
    nbytes = sum(size for name, size in graph.param_sizes.items() if "wte" in name or "head" in name)
    h = hierarchy(hier.cluster, [f"cpu{i}" for i in range(4)])
    assert stages_f == stages_h == (0, 1) and ms_h == pytest.approx(hierarchical_allreduce_ms(nbytes, h)) and ms_h < ms_f
    validate_plan(hier, prof)
    assert "tied parameters of stages 0, 1: hierarchical all-reduce (2 hosts x 2) over 4 devices" in summary(
        hier, graph, simulate(hier, graph))
    one_host = replace(hier, cluster=Cluster(devices=tuple(replace(d, host="n0") for d in gpus), name="1x4"))
    with pytest.raises(PlanError, match=r"tied parameters, but none of its groups of stages sharing parameters \(\[\[0, 1\]\]\)"):
        validate_plan(one_host, prof)


def test_the_plan_command_keeps_every_allreduce_flat_when_told() -> None:
    import argparse

    from hpml_compile import driver
    from hpml_compile.cli.plan import add_comm_options, comm_options
    from hpml_compile.testing import dag_profile

    p = argparse.ArgumentParser()
    add_comm_options(p)
    assert comm_options(p.parse_args([]))["hierarchical"] is True
    opts = comm_options(p.parse_args(["--no-hierarchical", "--no-uneven"]))
    assert opts["hierarchical"] is False and opts["uneven"] is False
    c = load_cluster("2node-a100-16")
    two = Cluster(devices=tuple(d for d in c.devices if d.name in {"gpu0", "gpu1", "gpu8", "gpu9"}), name="2x2")
    prof = dag_profile([(1.0, 2.0)] * 4, [[], [0], [1], [2]], kind="A100-80GB", param_bytes=2**20, batch_size=64)
    made = {h: driver.plan(prof, two, driver.Options(solver="dp", microbatches=1, **({} if h else opts)))
            for h in (True, False)}
    assert any(st.allreduce is AllReduce.HIERARCHICAL for st in made[True].stages), made[True].stages
    assert all(st.allreduce is AllReduce.FLAT for st in made[False].stages)


def test_a_compressed_stage_is_flat_since_the_runtime_compresses_over_the_stage_group() -> None:
    c = load_cluster("2node-a100-16")
    two = Cluster(devices=tuple(d for d in c.devices if d.name in {"gpu0", "gpu1", "gpu8", "gpu9"}), name="2x2")
    # 128 MiB per layer: enough that Top-K 0.005 (two all-gathers, each after a meeting) beats even the hierarchical
    # all-reduce overlapped with the backward
    # (a short forward: ZeRO-1's parameter gather, prefetched under the next forward, hides little)
    g = chain_graph([(0.1, 20.0)] * 4, kind="A100-80GB", param_bytes=2**27, batch_size=64)
    dense = solve(g, two, solver="dp", microbatches=1)
    assert any(st.allreduce is AllReduce.HIERARCHICAL for st in dense.stages), dense.stages
    plan = solve(g, two, solver="dp", microbatches=1, compress="topk:0.005")
    squeezed = [st for st in plan.stages if st.compress]
    assert squeezed and all(st.allreduce is AllReduce.FLAT for st in squeezed), plan.stages
    assert plan.predicted.step_ms < dense.predicted.step_ms  # chosen because the cost model says it is faster
    both = replace(plan, stages=tuple(replace(st, allreduce=AllReduce.HIERARCHICAL) if st.compress else st
                                      for st in plan.stages))
    with pytest.raises(PlanError, match=r"stage \d compresses its gradients \(topk:0.005\) and asks for a hierarchical"):
        check_comm(both)
    dense0 = replace(dense, stages=tuple(replace(st, zero=ZeroStage.NONE) for st in dense.stages))  # compressible
    forced = with_comm(dense0, compress="topk:0.01")  # the user's --compress on a hierarchical plan
    assert all(st.allreduce is AllReduce.FLAT for st in forced.stages if st.compress), forced.stages


@pytest.mark.parametrize("ms,param_bytes,batch", [(10.0, 2**26, 4), (50.0, 2**26, 4), (50.0, 2**26, 64),
                                                  (10.0, 2**22, 64)])
def test_allowing_hierarchical_never_makes_the_plan_slower(ms: float, param_bytes: int, batch: int) -> None:
    """Both all-reduces are overlapped with the last backward on GPUs (as the runtime runs them; a hierarchical
    bucket is a chain of three collectives): the choice is the simulator's, stage by stage, not the two
    collectives' bare times."""
    c = load_cluster("2node-a100-16")
    two = Cluster(devices=tuple(d for d in c.devices if d.name in {"gpu0", "gpu1", "gpu8", "gpu9"}), name="2x2")
    g = chain_graph([(ms, 2 * ms)] * 4, kind="A100-80GB", param_bytes=param_bytes, batch_size=batch)
    flat = solve(g, two, solver="ilp", hierarchical=False)
    hier = solve(g, two, solver="ilp")
    assert hier.predicted.step_ms <= flat.predicted.step_ms * (1 + 1e-9), (flat.stages, hier.stages)
    wide = Plan("toy", two, Schedule.ONE_F_ONE_B, 1, (Stage(0, ("gpu0", "gpu1", "gpu8", "gpu9"),
                                                            tuple(f"n{i}" for i in range(4))),))
    chosen = faster_allreduce(wide, g)
    costs = {how: simulate(replace(wide, stages=(replace(wide.stages[0], allreduce=how),)), g).stages[0].sync_ms
             for how in AllReduce}
    want = AllReduce.HIERARCHICAL if costs[AllReduce.HIERARCHICAL] < costs[AllReduce.FLAT] else AllReduce.FLAT
    assert chosen.stages[0].allreduce is want
    # overlapped alike, the hierarchical one (1/h of the bytes between hosts, a last chain shorter than the flat
    # ring's last bucket) wins here even behind 50 ms of backward, where it lost while only flat was overlapped
    assert want is AllReduce.HIERARCHICAL and costs[AllReduce.HIERARCHICAL] < costs[AllReduce.FLAT], costs


def test_a_hierarchical_stage_is_priced_overlapped_on_gpus_its_last_chain_exposed_and_after_the_backward_on_cpus(
        ) -> None:
    mib = 2**20
    params = 3 * 40 * mib  # buckets of 1, 25, 25, 25, 25 and 19 MiB
    for kind, overlaps in (("A100-80GB", True), ("cpu", False)):
        devs = tuple(Device(f"d{i}", kind, 80.0, host="h0" if i < 2 else "h1") for i in range(4))
        graph = build(dag_profile([{kind: (4.0, 8.0)}] * 3, [[], [0], [1]], param_bytes=[40 * mib] * 3,
                                  activation_bytes=[mib] * 3, batch_size=8))
        stage = Stage(0, tuple(d.name for d in devs), ("n0", "n1", "n2"), allreduce=AllReduce.HIERARCHICAL)
        plan = Plan("toy", Cluster(devices=devs, name=f"2x2-{kind}"), Schedule.GPIPE, 2, (stage,))
        hier = hierarchy(plan.cluster, stage.devices)
        assert hier is not None
        cost = stage_costs(plan, graph)[0]
        after = hierarchical_allreduce_ms(params, hier)  # the three collectives after the backward
        assert sync_overlap(plan, 0) == (1.0 if overlaps else 0.0)  # the runtime buckets it where this is > 0
        if overlaps:
            assert cost.sync_ms == pytest.approx(hierarchical_overlapped_ms(params, hier, cost.bwd_ms), rel=1e-9)
            assert cost.sync_ms < after
        else:
            assert cost.sync_ms == pytest.approx(after + meet_ms(4, hier.inter), rel=1e-9)  # after a meeting
    # what a long backward leaves exposed is the last bucket's whole chain; with none, every chain in turn
    last = hierarchical_allreduce_ms(params - mib - 4 * 25 * mib, hier)
    assert hierarchical_overlapped_ms(params, hier, 1e6) == pytest.approx(last, rel=1e-9)
    assert hierarchical_overlapped_ms(params, hier, 0.0) == pytest.approx(
        hierarchical_allreduce_ms(mib, hier) + 4 * hierarchical_allreduce_ms(25 * mib, hier) + last, rel=1e-9)
