"""Hierarchical ZeRO-1 (HSDP-like) in the plan, the cost model and the solver.

The runtime: tests/dist/test_hier_zero_dist.py.

A ZeRO-1 stage whose devices span hosts evenly may say ``allreduce: hierarchical``: its optimizer is
sharded over the ``L`` devices of each host (replicated across hosts), its gradients reduce-scattered in the
host and all-reduced between hosts (bucket by bucket during the backward on GPU groups), its parameters
all-gathered in the host after the optimizer step.

- the plan accepts it (validation and plan.json), ZeRO-2/3 stay refused (tests/unit/test_hierarchical.py);
  ``zero_shards`` is the host's device count; ``sync_overlap`` buckets it where ZeRO-0's would be;
- the cost model: optimizer state and step ``1 / L`` (not ``1 / d``), parameters and gradients ``P + P / L``
  (the shard's own tensors), sync: the two gradient levels overlapped with the backward as ZeRO-0's chains
  (after it on CPU ranks), then the parameter all-gather in the host, whole; no copy;
- ``to_plan`` keeps it only on devices that shard at least as finely as the candidate was priced for;
- the solver takes it where it is the fastest that fits (a stage over 2 hosts x 2 whose ZeRO-0 state does not
  fit and whose flat ZeRO-1 crosses the slow link), never where the setting forbids hierarchical syncs, and the
  table prices its candidate as the simulator prices the plan.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import cost_models
from hpml_compile.cluster import hierarchy, load_cluster
from hpml_compile.costgraph import build
from hpml_compile.ir import Cluster
from hpml_compile.memory import ZeroStage
from hpml_compile.plan import AllReduce, Plan, Schedule, Stage, load_plan, save_plan, sync_overlap, zero_shards
from hpml_compile.simulate import simulate, stage_costs
from hpml_compile.solve import solve
from hpml_compile.solve.candidates import Chain, Setting, StageConfig, enumerate_candidates
from hpml_compile.testing import chain_profile
from hpml_compile.stagecost import (copy_ms, hierarchical_allreduce_ms, meet_ms, prefetched_gather_ms, stream_bytes_per_ms,
                                   sync_ms, transfer_ms)

GB = 10**9
KIND = "A100-80GB"


def _two_by_two() -> Cluster:
    c = load_cluster("2node-a100-16")
    return Cluster(devices=tuple(d for d in c.devices if d.name in {"gpu0", "gpu1", "gpu8", "gpu9"}), name="2x2")


def _graph(param_gb: float, opt_ms_per_gb: float = 40.0, fwd_ms: float = 1000.0):
    """Four nodes of heavy compute (data parallelism pays) and ``param_gb`` GB of parameters, AdamW at
    ``opt_ms_per_gb`` (whole, on one device); ``fwd_ms`` per node's forward (short: the forward hides no
    prefetched parameter gather)."""
    prof = chain_profile([(fwd_ms, 2000.0)] * 4, kind=KIND, param_bytes=int(param_gb * GB / 4), batch_size=64)
    return build(replace(prof, optimizer="adamw", optimizer_ms={KIND: opt_ms_per_gb * param_gb}))


def _one_stage(cluster: Cluster, zero: ZeroStage, how: AllReduce) -> Plan:
    devs = tuple(d.name for d in cluster.devices)
    return Plan("toy", cluster, Schedule.GPIPE, 1, (Stage(0, devs, ("n0", "n1", "n2", "n3"), zero, allreduce=how),))


def test_the_plan_accepts_it_and_it_shards_over_one_host(tmp_path: Path) -> None:
    c = _two_by_two()
    hz = _one_stage(c, ZeroStage.OS, AllReduce.HIERARCHICAL)
    assert load_plan(save_plan(hz, tmp_path / "plan.json")) == hz
    assert zero_shards(c, hz.stages[0]) == 2
    assert zero_shards(c, _one_stage(c, ZeroStage.OS, AllReduce.FLAT).stages[0]) == 4
    assert sync_overlap(hz, 0) == 1.0  # bucketed on GPUs, as ZeRO-0's
    cpus = Cluster(devices=tuple(replace(d, kind="cpu") for d in c.devices), name="cpus")
    assert sync_overlap(replace(hz, cluster=cpus), 0) == 0.0  # after the backward on CPU ranks


def test_the_cost_model_shards_the_optimizer_per_host_and_prices_the_three_levels() -> None:
    c, g = _two_by_two(), _graph(20.0)
    p = 20 * GB
    hz, flat1, hier0 = (stage_costs(_one_stage(c, z, how), g)[0] for z, how in (
        (ZeroStage.OS, AllReduce.HIERARCHICAL), (ZeroStage.OS, AllReduce.FLAT),
        (ZeroStage.NONE, AllReduce.HIERARCHICAL)))
    # Adam's two fp32 moments: / L = 2 here, / d = 4 flat, whole under ZeRO-0
    assert (hz.memory.optimizer, flat1.memory.optimizer, hier0.memory.optimizer) == (2 * p // 2, 2 * p // 4, 2 * p)
    assert hz.memory.params == hz.memory.grads == p + p // 2  # the shard's own parameters and summed gradient
    assert flat1.memory.params == flat1.memory.grads == p
    assert hz.optimizer_ms == pytest.approx(40.0 * 20 / 2) and flat1.optimizer_ms == pytest.approx(40.0 * 20 / 4)
    h = hierarchy(c, [d.name for d in c.devices])
    assert h is not None and h.per_host == 2
    levels = cost_models.reduce_scatter_ms(p, 2, h.intra) + cost_models.allreduce_ms(p / 2, 2, h.inter)
    buckets = 1 + -(-(p - 2**20) // (25 * 2**20))  # 1 MiB, then 25 MiB: each gathered on its own after the step
    gather = cost_models.all_gather_ms(p, 2, h.intra) + (buckets - 1) * cost_models.all_gather_ms(1, 2, h.intra)
    assert levels + cost_models.all_gather_ms(p, 2, h.intra) == pytest.approx(hierarchical_allreduce_ms(p, h))
    copy = copy_ms(p, 4, stream_bytes_per_ms(g, [KIND]), ZeroStage.OS)
    assert hz.sync_copy_ms == 0.0 and flat1.sync_copy_ms == pytest.approx(copy) and copy > 0  # gathered in place
    # the gradient levels run bucket by bucket during the last backward (as ZeRO-0's chains); the parameter
    # all-gather after the step serial (no forward given), or prefetched under the next forward
    serial = sync_ms(p, 4, ZeroStage.OS, False, h.inter, h.inter, h, bwd_ms=hz.bwd_ms)
    assert gather < serial < levels + gather
    assert hz.sync_ms == pytest.approx(sync_ms(p, 4, ZeroStage.OS, False, h.inter, h.inter, h, bwd_ms=hz.bwd_ms,
                                               fwd_ms=hz.fwd_ms))
    # 1 s of forward hides every bucket's gather but the first one gathered (the bottom of the buffer, which the
    # forward reads first): the tail of the 1 MiB + 25 MiB cut
    tail = (p - 2**20) - (buckets - 2) * 25 * 2**20
    assert 0 < tail <= 25 * 2**20
    assert serial - hz.sync_ms == pytest.approx(gather - cost_models.all_gather_ms(tail, 2, h.intra), rel=1e-6)
    on_cpu = sync_ms(p, 4, ZeroStage.OS, False, h.inter, h.inter, h, bwd_ms=hz.bwd_ms, overlap=0.0)
    # one bucket: the three levels after it, each of the two blocking collectives after the members meet
    assert on_cpu == pytest.approx(hierarchical_allreduce_ms(p, h) + 2 * meet_ms(4, h.inter))
    assert hz.sync_ms < flat1.sync_ms / 2  # the flat reduce-scatter and all-gather cross 100 GbE with 3/4 of P each


def test_the_solver_takes_it_where_it_is_the_fastest_that_fits() -> None:
    # a slow optimizer step (400 ms unsharded): ZeRO-0 steps it whole, flat ZeRO-1 crosses 100 GbE with 3/4 of P
    # twice (~480 ms), the hierarchical ZeRO-1 steps half of it behind the overlapped levels and a 7 ms gather
    # (a short forward: neither gather hides under it, so the comparison is the gradients' and optimizer's)
    c, g = _two_by_two(), _graph(4.0, 100.0, fwd_ms=1.0)
    plan = solve(g, c, solver="dp", microbatches=1)
    wide = [st for st in plan.stages if len(st.devices) == 4]
    assert wide and wide[0].zero == ZeroStage.OS and wide[0].allreduce is AllReduce.HIERARCHICAL, plan.stages
    no = solve(g, c, solver="dp", microbatches=1, hierarchical=False)
    assert all(st.allreduce is AllReduce.FLAT for st in no.stages)
    assert plan.predicted.step_ms < no.predicted.step_ms
    assert simulate(plan, g).step_ms == pytest.approx(plan.predicted.step_ms)
    # its candidate's tail is what the simulator prices: sync (two levels overlapped + the gather) and the
    # optimizer on 1/L
    setting = Setting(1, Schedule.GPIPE, 64)
    cands = [x for x in enumerate_candidates(Chain.of(g), c, setting)
             if x.config.hierarchical and x.a == 0 and x.b == 4]
    assert cands and all(x.config.zero == ZeroStage.OS and x.d == 4 for x in cands)
    cost = stage_costs(_one_stage(c, ZeroStage.OS, AllReduce.HIERARCHICAL), g)[0]
    plain = next(x for x in cands if x.config == StageConfig(ZeroStage.OS, hierarchical=True))
    assert plain.tail == pytest.approx(cost.synced_ms + cost.optimizer_ms, rel=1e-6)
    assert plain.memory.optimizer == cost.memory.optimizer
    # one host: nothing to make hierarchical, no such candidate
    one = Cluster(devices=tuple(d for d in load_cluster("2node-a100-16").devices if d.host == "node0")[:4],
                  name="1x4")
    assert not [x for x in enumerate_candidates(Chain.of(g), one, setting) if x.config.hierarchical]


def test_show_and_explain_name_it() -> None:
    from hpml_compile.explain import summary
    from hpml_compile.viz import allreduce_label

    c, g = _two_by_two(), _graph(20.0)
    hz = _one_stage(c, ZeroStage.OS, AllReduce.HIERARCHICAL)
    label = allreduce_label(hz, hz.stages[0])
    assert label == "hierarchical reduce-scatter + all-gather (2 hosts x 2, optimizer sharded per host)"
    text = summary(hz, g, simulate(hz, g))
    assert "ZeRO-1, " + label in text and "between hosts" in text, text
    hier0 = _one_stage(c, ZeroStage.NONE, AllReduce.HIERARCHICAL)
    assert allreduce_label(hier0, hier0.stages[0]) == "hierarchical all-reduce (2 hosts x 2)"


def test_report_names_the_levels_of_a_hierarchical_zero1_stage() -> None:
    from hpml_compile.runtime.observe.monitor import StepMetrics
    from hpml_compile.runtime.observe.summary import format_summary, summarise

    hz = _one_stage(_two_by_two(), ZeroStage.OS, AllReduce.HIERARCHICAL)
    rows = {r: [StepMetrics(step=i, rank=r, stage=0, replica=r, device=hz.stages[0].devices[r], microbatches=1,
                            samples=16, step_ms=10.0, pipeline_ms=8.0, fwd_ms=3.0, bwd_ms=5.0,
                            sync_intra_bytes=16 << 20, sync_inter_bytes=8 << 20, sync_flat_bytes=24 << 20)
                for i in range(3)] for r in range(4)}  # as the runtime counts one step: 2 hosts x 2 ranks
    text = format_summary(summarise(hz, rows, skip=1))
    assert ("hierarchical reduce-scatter + all-gather (ZeRO-1), stage 0: 8.0 MiB between hosts + 16.0 MiB inside "
            "the host per step per rank; a flat ring: 24.0 MiB") in text, text


def test_to_plan_keeps_it_only_on_devices_that_shard_as_finely_as_priced() -> None:
    from hpml_compile.ir import Device
    from hpml_compile.plan import SolverInfo
    from hpml_compile.solve.candidates import to_plan

    g = _graph(4.0, 100.0, fwd_ms=1.0)  # a short forward: the hierarchical candidate is not dominated
    ch = Chain.of(g)
    # six hosts: the kind's first 4 devices are 2 hosts x 2 (priced L = 2); a second stage of 4 gets the rest
    devs = tuple(Device(f"g{i}", KIND, 80.0, host=f"h{i // 2}") for i in range(4)) \
        + tuple(Device(f"g{i}", KIND, 80.0, host=f"h{2 + (i - 4) % 4}") for i in range(4, 8))
    c = Cluster(devices=devs, name="uneven-hosts")
    setting = Setting(1, Schedule.GPIPE, 64)
    cand = next(x for x in enumerate_candidates(ch, c, setting)
                if x.config == StageConfig(ZeroStage.OS, hierarchical=True) and x.d == 4 and (x.a, x.b) == (0, 2))
    later = next(x for x in enumerate_candidates(ch, c, setting)
                 if x.config == cand.config and x.d == 4 and (x.a, x.b) == (2, 4))
    plan = to_plan(ch, c, setting, [cand, later], SolverInfo("test"))
    first, second = plan.stages
    assert first.devices == ("g0", "g1", "g2", "g3") and first.allreduce is AllReduce.HIERARCHICAL
    # g4..g7 sit one per host (h2..h5): L = 1, coarser than the priced 2 (more memory), so flat (1/4 shards)
    assert second.devices == ("g4", "g5", "g6", "g7") and second.allreduce is AllReduce.FLAT, plan.stages
    assert second.zero == ZeroStage.OS


def test_the_prefetched_parameter_gather_is_priced_under_the_next_forward_only_where_the_runtime_prefetches() -> None:
    # ZeRO-1/2's all-gather after the step, launched per bucket and waited by the next forward
    # (runtime.sync.zero.FlatShard.enable_prefetch, where the stage's sync overlaps): only what the first
    # microbatch's forward cannot cover is paid; nothing changes where the runtime does not prefetch
    c = _two_by_two()
    h = hierarchy(c, [d.name for d in c.devices])
    assert h is not None
    p, bwd, link = 2 * GB, 50.0, h.inter
    serial_gather = transfer_ms(cost_models.all_gather_ms, p, link, 4)
    for fwd in (0.0, 40.0, 400.0, 10_000.0):  # flat ZeRO-1/2: the forward's first 1/d reads every bucket
        for z in (ZeroStage.OS, ZeroStage.OS_G):
            got = sync_ms(p, 4, z, False, link, link, bwd_ms=bwd, fwd_ms=fwd)
            base = sync_ms(p, 4, z, False, link, link, bwd_ms=bwd)  # serial gather
            hidden = base - got
            # the serial gather meets first (stagecost.meet_ms); the prefetched one is launched without
            assert hidden == pytest.approx(serial_gather + meet_ms(4, link) - prefetched_gather_ms(p, link, 4, fwd),
                                           abs=1e-9)
            # never below the first bucket gathered; without a forward, the buckets' gathers one after another
            # (one latency each: a little more than one gather); with one, less
            assert hidden < serial_gather
            assert (hidden > 0) == (fwd > 0), (fwd, hidden)
    whole = prefetched_gather_ms(p, link, 4, 0.0)  # C: every bucket's gather, serial
    buckets = 1 + -(-(p - 2**20) // (25 * 2**20))
    assert serial_gather < whole < 1.1 * serial_gather  # one latency per bucket more than one gather
    tail = transfer_ms(cost_models.all_gather_ms, (p - 2**20) - (buckets - 2) * 25 * 2**20, link, 4)
    for window in (10.0, 40.0, 400.0, 1e5):  # max(C - window / d (1 - 1 MiB / P), the first bucket gathered)
        assert prefetched_gather_ms(p, link, 4, window) == pytest.approx(
            max(whole - window / 4 * (1 - 2**20 / p), tail), rel=1e-6), window
    # not prefetched: CPU ranks (overlap 0), ZeRO-0 (no gather), ZeRO-3 (its own per-microbatch gathers)
    for z, ov in ((ZeroStage.OS, 0.0), (ZeroStage.NONE, 1.0), (ZeroStage.OS_G_P, 1.0)):
        assert sync_ms(p, 4, z, False, link, link, bwd_ms=bwd, overlap=ov, fwd_ms=1e4) == \
            sync_ms(p, 4, z, False, link, link, bwd_ms=bwd, overlap=ov)
    # the hierarchical ZeRO-1's in-host gather: contiguous buckets, the whole forward hides them
    hz = [sync_ms(p, 4, ZeroStage.OS, False, link, link, h, bwd_ms=bwd, fwd_ms=f) for f in (0.0, 1.0, 1e4)]
    assert hz[0] > hz[1] >= hz[2] > 0
    assert hz[0] == pytest.approx(sync_ms(p, 4, ZeroStage.OS, False, link, link, h, bwd_ms=bwd))
    # the simulator prices a GPU stage's gather so (its sync is sync_ms with the stage's forward)
    g = _graph(20.0)
    for how in (AllReduce.HIERARCHICAL, AllReduce.FLAT):
        cost = stage_costs(_one_stage(c, ZeroStage.OS, how), g)[0]
        hh = h if how is AllReduce.HIERARCHICAL else None
        grp = h.inter
        with_fwd = sync_ms(20 * GB, 4, ZeroStage.OS, False, grp, grp, hh, bwd_ms=cost.bwd_ms, fwd_ms=cost.fwd_ms)
        without = sync_ms(20 * GB, 4, ZeroStage.OS, False, grp, grp, hh, bwd_ms=cost.bwd_ms)
        assert with_fwd < without
        assert cost.sync_ms - cost.sync_copy_ms == pytest.approx(with_fwd, rel=1e-9), how
