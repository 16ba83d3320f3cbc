"""stagecost: each formula gives the same figure on scalars and on arrays, and the simulator and the
candidate table, which both read it, agree on the stages of a plan."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

import cost_models
from hpml_compile.cluster import CPU_OVERLAP, GPU_OVERLAP, host_link_spec, link_spec
from hpml_compile.ir import Cluster, Device
from hpml_compile.memory import ZeroStage
from hpml_compile.plan import Plan, Schedule, SolverInfo, Stage, sync_overlap
from hpml_compile.simulate import stage_costs
from hpml_compile.solve.candidates import CONFIGS, Chain, Setting, to_plan
from hpml_compile.solve.table import build_table
from hpml_compile.testing import dag_profile
from hpml_compile.costgraph import build
from hpml_compile import stagecost

ONE_CHUNK = [s for s in Schedule if s is not Schedule.INTERLEAVED]  # interleaved 1F1B: test_interleaved.py

MiB = 2**20
PARAMS = np.asarray([0, 1, 7 * MiB + 3, 300 * MiB + 11], dtype=np.int64)
ACTS = np.asarray([0, 5, 40 * MiB + 1, 9 * MiB], dtype=np.int64)
INPUTS = np.asarray([0, 3, 2 * MiB, 20 * MiB], dtype=np.int64)
NVLINK, PCIE = cost_models.get_link("nvlink3"), cost_models.get_link("pcie4")


@pytest.mark.parametrize("zero,recompute,offload,swap,host_is_device",
                         [(z, r, o, s, h) for z in ZeroStage for r, o, s, h in itertools.product((False, True),
                                                                                                  repeat=4)])
def test_memory_scalar_and_array_agree(zero: ZeroStage, recompute: bool, offload: bool, swap: bool,
                                       host_is_device: bool) -> None:
    common = dict(dtype_bytes=4, replicas=4, zero=zero, microbatches=8, recompute=recompute,
                  offload_optimizer=offload, host_is_device=host_is_device)
    arr = stagecost.memory_parts(param_bytes=PARAMS, activation_bytes=ACTS, input_bytes=INPUTS,
                                 swapped_bytes=ACTS if swap else ACTS * 0, **common)
    for i in range(len(PARAMS)):
        one = stagecost.memory_parts(param_bytes=int(PARAMS[i]), activation_bytes=int(ACTS[i]),
                                     input_bytes=int(INPUTS[i]), swapped_bytes=int(ACTS[i]) if swap else 0, **common)
        assert all(type(v) is int for v in one), one  # plain ints on the scalar path (plans serialise them)
        assert tuple(int(col[i]) for col in arr) == one


@pytest.mark.parametrize("schedule", ONE_CHUNK)
def test_in_flight_scalar_and_array_agree(schedule: Schedule) -> None:
    after = np.arange(0, 12)
    arr = stagecost.in_flight(schedule, 5, after)
    assert arr.tolist() == [stagecost.in_flight(schedule, 5, int(j)) for j in after]
    assert stagecost.in_flight(schedule, 5, 0) == (1 if schedule is Schedule.ONE_F_ONE_B else 5)
    # ZB-H1: min(M, S) on every stage, M where the stage count is not known yet
    assert stagecost.in_flight(schedule, 5, 0, 3) == {Schedule.GPIPE: 5, Schedule.ONE_F_ONE_B: 1}.get(schedule, 3)


@pytest.mark.parametrize("zero,offload,d,link", [(z, o, d, link) for z in ZeroStage for o in (False, True)
                                                 for d in (1, 2, 8) for link in (NVLINK, PCIE)])
def test_times_scalar_and_array_agree(zero: ZeroStage, offload: bool, d: int, link: cost_models.LinkSpec) -> None:
    group = link if d > 1 else None
    sync = stagecost.sync_ms(PARAMS, d, zero, offload, group, PCIE)
    copy = stagecost.copy_ms(PARAMS, d, 1e7, zero)
    opt = stagecost.optimizer_ms(PARAMS, d, zero, 1e-9)
    for i, p in enumerate(PARAMS.tolist()):
        # alpha-beta costs are applied to arrays as lines through two sizes: equal up to rounding
        assert sync[i] == pytest.approx(stagecost.sync_ms(p, d, zero, offload, group, PCIE), rel=1e-9, abs=1e-12)
        assert (copy[i] if d > 1 else copy) == stagecost.copy_ms(p, d, 1e7, zero)
        assert opt[i] == stagecost.optimizer_ms(p, d, zero, 1e-9)
    assert stagecost.sync_ms(0, d, zero, offload, group, PCIE) == 0.0


@pytest.mark.parametrize("d,link", [(2, PCIE), (8, NVLINK), (2, cost_models.get_link("gloo-loopback"))])
def test_the_overlapped_sync_lies_between_the_last_bucket_and_the_whole_collective(d: int, link) -> None:
    sizes = np.asarray([0, 2**19, 2**20, 3 * 2**20, 30 * 2**20, 80 * 2**20])
    for window in (0.0, 1.0, 10.0, 1e4):
        got = stagecost.sync_ms(sizes, d, ZeroStage.NONE, False, link, PCIE, bwd_ms=window)
        # the whole collective after the backward, which the runtime starts with a meeting (stagecost.meet_ms);
        # the buckets launched during the backward have none
        whole = stagecost.sync_ms(sizes, d, ZeroStage.NONE, False, link, PCIE) - stagecost.meet_ms(d, link) * (sizes > 0)
        for i, p in enumerate(sizes.tolist()):
            one = stagecost.sync_ms(p, d, ZeroStage.NONE, False, link, PCIE, bwd_ms=window)
            assert got[i] == pytest.approx(one, rel=1e-9, abs=1e-12)  # scalar and array agree
            later = -(-max(0, p - 2**20) // (25 * 2**20))  # buckets after the first (1 MiB, then 25 MiB each)
            last = p - 2**20 - 25 * 2**20 * (later - 1) if later else p
            alpha = cost_models.allreduce_ms(1, d, link)  # one more collective's latency per extra bucket
            # never more than after the backward plus the extra buckets' latencies, never less than the last bucket
            assert one <= whole[i] + later * alpha + 1e-9
            assert one >= (cost_models.allreduce_ms(last, d, link) if p else 0.0) - 1e-9
        if window == 0.0:  # no backward to hide in: every bucket's latency on top of the whole
            assert np.all(got >= whole * (1 - 1e-9))
    # a longer backward hides more, down to the last bucket
    ws = [stagecost.sync_ms(80 * 2**20, d, ZeroStage.NONE, False, link, PCIE, bwd_ms=w) for w in (0, 5, 50, 500)]
    assert ws == sorted(ws, reverse=True) and ws[-1] < ws[0]


def test_transfer_is_free_without_a_link_or_over_an_infinite_one() -> None:
    free = cost_models.LinkSpec("local", float("inf"), 0.0, "same device")
    for link in (None, free):
        assert stagecost.transfer_ms(cost_models.p2p_ms, 1e6, link) == 0.0
        assert stagecost.transfer_ms(cost_models.p2p_ms, np.asarray([1e6, 0.0]), link).tolist() == [0.0, 0.0]
    assert stagecost.transfer_ms(cost_models.p2p_ms, 1e6, PCIE) == cost_models.p2p_ms(1e6, PCIE)


def _graph():
    costs = [{"A100-80GB": (1.0 + i, 2.0 + i), "V100-32GB": (2.5 + i, 5.0 + i)} for i in range(6)]
    return build(dag_profile(costs, [[i - 1] if i else [] for i in range(6)], param_bytes=[64 * MiB] * 6,
                             activation_bytes=[512 * MiB, 256 * MiB, 256 * MiB, 128 * MiB, 64 * MiB, 32 * MiB],
                             output_bytes=16 * MiB, batch_size=64))


def _cluster() -> Cluster:
    # little memory, so that the table prices ZeRO, recompute, offload and swap, not only the plain stage
    devs = tuple(Device(f"a{i}", "A100-80GB", 1.5) for i in range(4)) + \
        tuple(Device(f"v{i}", "V100-32GB", 0.9) for i in range(4))
    return Cluster(devices=devs, name="mixed")


@pytest.mark.parametrize("schedule", ONE_CHUNK)
def test_simulator_and_table_price_a_plans_stages_alike(schedule: Schedule) -> None:
    """Two-stage plans made of table candidates: each stage's memory (at its position) and its tail
    (gradient sync, copies, optimizer step) are what the simulator computes for it."""
    graph, cluster = _graph(), _cluster()
    chain, setting = Chain.of(graph), Setting(4, schedule, 64)
    tab = build_table(chain, cluster, setting).candidates()
    firsts = [c for c in tab if c.a == 0 and c.b == 3 and c.kind == "A100-80GB"]
    seconds = [c for c in tab if c.a == 3 and c.b == 6 and c.kind == "V100-32GB"]
    assert {c.config for c in firsts + seconds} - {CONFIGS[0]} and len(firsts) > 1 and len(seconds) > 1
    checked = 0
    for first, second in itertools.product(firsts, seconds):
        plan = to_plan(chain, cluster, setting, [first, second], SolverInfo("test"))
        for i, (cand, cost) in enumerate(zip((first, second), stage_costs(plan, graph))):
            got, want = cost.memory, cand.memory
            assert (got.params, got.grads, got.optimizer, got.stored_per_microbatch, got.working, got.host_bytes) \
                == (want.params, want.grads, want.optimizer, want.stored_per_microbatch, want.working,
                    want.host_bytes)
            assert got.in_flight == stagecost.in_flight(schedule, 4, 1 - i, 2)
            assert cost.synced_ms + cost.optimizer_ms == pytest.approx(cand.tail, rel=1e-9, abs=1e-12)
            # the table's per-microbatch time comes from prefix sums: equal up to rounding
            assert cost.compute_ms + 2 * cost.swap_ms == pytest.approx(cand.t, rel=1e-9)
            checked += 1
    assert checked >= 8


def test_zero_shards_only_the_optimizer_state_at_the_peak() -> None:
    """What the runtime (runtime/sync/zero.py) holds at the end of the last backward: parameters and gradients whole
    (accumulated over every microbatch before the one reduce-scatter), Adam's state / d from ZeRO-1 on; ZeRO-3
    (runtime/sync/zero3.py) its shard of the parameters too, beside the whole stage gathered for the compute."""
    parts = {z: stagecost.memory_parts(param_bytes=800, activation_bytes=0, input_bytes=0, dtype_bytes=4,
                                       replicas=4, zero=z, microbatches=2) for z in ZeroStage}
    assert [(m.params, m.grads, m.optimizer) for m in parts.values()] == [
        (800, 800, 1600), (800, 800, 400), (800, 800, 400), (1000, 800, 400)]


def test_the_solver_offers_the_zero_stages_the_runtime_performs_but_zero2() -> None:
    from hpml_compile.solve.candidates import CONFIGS

    # ZeRO-2 holds what ZeRO-1 holds at the peak; ZeRO-3 is offered, never with optimizer offload
    assert {c.zero for c in CONFIGS} == {ZeroStage.NONE, ZeroStage.OS, ZeroStage.OS_G_P}
    assert not any(c.offload for c in CONFIGS if c.zero == ZeroStage.OS_G_P)


def test_zero3_gathers_the_parameters_for_each_microbatch_forward_and_backward() -> None:
    link = host = cost_models.LinkSpec("test", 10.0, 5.0, "a test link")
    rs = stagecost.transfer_ms(cost_models.reduce_scatter_ms, 1 << 20, link, 2)
    ag = stagecost.transfer_ms(cost_models.all_gather_ms, 1 << 20, link, 2)
    z3 = stagecost.sync_ms(1 << 20, 2, ZeroStage.OS_G_P, False, link, host, microbatches=3)
    meet = stagecost.meet_ms(2, link)  # its reduce-scatter and each gather after the members meet
    assert ag > 0 and meet > 0 and z3 == pytest.approx(meet + rs + 6 * (meet + ag))
    assert stagecost.meetings(ZeroStage.OS_G_P, 2, 3) == 7
    # ZeRO-1: the reduce-scatter after the backward and the gather after the step, each after the members meet
    assert stagecost.sync_ms(1 << 20, 2, ZeroStage.OS, False, link, host, microbatches=3) == \
        pytest.approx(rs + ag + 2 * meet)


def test_zero3_gathers_are_priced_by_the_probes_gather_after_compute_where_measured() -> None:
    """A link whose probe timed ZeRO-3's gather as it runs (``param_gather``) prices the gathers by it; ZeRO-1's
    all-gather after the step keeps the all-gather's own fit."""
    plain = cost_models.LinkSpec("test", 10.0, 5.0, "a test link", collectives=(("all_gather", 10.0, 5.0),))
    probed = replace(plain, collectives=plain.collectives + (("param_gather", 2.0, 900.0),))
    slow = replace(plain, collectives=(("all_gather", 2.0, 900.0),))
    n = 1 << 20
    z3 = stagecost.sync_ms(n, 2, ZeroStage.OS_G_P, False, probed, probed, microbatches=2)
    gathers = 4 * stagecost.transfer_ms(cost_models.all_gather_ms, n, slow, 2)
    rest = stagecost.sync_ms(n, 2, ZeroStage.OS_G_P, False, plain, plain, microbatches=2) - \
        4 * stagecost.transfer_ms(cost_models.all_gather_ms, n, plain, 2)
    assert gathers > 4 * 0.9 and z3 == pytest.approx(rest + gathers)
    assert stagecost.sync_ms(n, 2, ZeroStage.OS, False, probed, probed) == \
        pytest.approx(stagecost.sync_ms(n, 2, ZeroStage.OS, False, plain, plain))


def _dp_plan(kind: str, **stage: object) -> tuple[Plan, object]:
    """One stage of 3 nodes replicated on two devices of ``kind`` (a GPU kind or "cpu"), and its cost graph."""
    devs = tuple(Device(f"d{i}", kind, 64.0, host="h0") for i in range(2))
    graph = build(dag_profile([{kind: (4.0, 8.0)}] * 3, [[], [0], [1]], param_bytes=[40 * MiB] * 3,
                              activation_bytes=[MiB] * 3, batch_size=8))
    plan = Plan("toy", Cluster(devices=devs, name=kind), Schedule.GPIPE, 2,
                (Stage(0, ("d0", "d1"), ("n0", "n1", "n2"), **stage),))  # type: ignore[arg-type]
    return plan, graph


def test_plan_simulator_and_runtime_share_one_overlap_rule() -> None:
    """CPU ranks (gloo on the backward's cores) sync after the backward, priced so; GPU groups overlap."""
    cpu, cpu_graph = _dp_plan("cpu")
    gpu, gpu_graph = _dp_plan("A100-80GB")
    assert sync_overlap(cpu, 0) == CPU_OVERLAP == 0.0 and sync_overlap(gpu, 0) == GPU_OVERLAP == 1.0
    # what the runtime does not bucket is not overlapped, whatever the devices
    for kw in ({"compress": "topk:0.01"}, {"zero": ZeroStage.OS_G_P}):
        assert sync_overlap(_dp_plan("A100-80GB", **kw)[0], 0) == 0.0, kw
    assert sync_overlap(replace(gpu, sync_every=4), 0) == 0.0
    one = replace(gpu, stages=(replace(gpu.stages[0], devices=("d0",)),))
    assert sync_overlap(one, 0) == 0.0
    params = 120 * MiB
    for plan, graph, hides in ((cpu, cpu_graph, False), (gpu, gpu_graph, True)):
        c = plan.cluster
        cost = stage_costs(plan, graph)[0]
        link, host = link_spec(c, "d0", "d1"), host_link_spec(c.devices[0])
        after = stagecost.sync_ms(params, 2, ZeroStage.NONE, False, link, host)  # one collective after the backward
        if hides:
            assert cost.sync_ms < after
        else:
            assert cost.sync_ms == pytest.approx(after, rel=1e-9)
    # the solver's table prices a CPU group the same way (its candidates' tails match the simulator's)
    chain = Chain.of(cpu_graph)
    tab = build_table(chain, cpu.cluster, Setting(2, Schedule.GPIPE, 8)).candidates()
    cand = next(x for x in tab if x.a == 0 and x.b == 3 and x.d == 2 and x.config == CONFIGS[0])
    planned = to_plan(chain, cpu.cluster, Setting(2, Schedule.GPIPE, 8), [cand], SolverInfo("test"))
    got = stage_costs(planned, cpu_graph)[0]
    assert got.synced_ms + got.optimizer_ms == pytest.approx(cand.tail, rel=1e-9)


def test_overlap_scales_the_backward_that_hides_the_sync() -> None:
    link = cost_models.get_link("gloo-loopback")
    whole = stagecost.sync_ms(80 * MiB, 2, ZeroStage.NONE, False, link, PCIE)
    got = [stagecost.sync_ms(80 * MiB, 2, ZeroStage.NONE, False, link, PCIE, bwd_ms=50.0, overlap=w)
           for w in (0.0, 0.5, 1.0)]
    assert got[0] == whole and got[0] > got[1] > got[2]  # 0: one collective after the backward, as the runtime
    for z in (ZeroStage.OS, ZeroStage.OS_G):
        assert stagecost.sync_ms(80 * MiB, 2, z, False, link, PCIE, bwd_ms=50.0, overlap=0.0) \
            == stagecost.sync_ms(80 * MiB, 2, z, False, link, PCIE)
    with pytest.raises(ValueError, match="overlap"):
        stagecost.sync_ms(MiB, 2, ZeroStage.NONE, False, link, PCIE, bwd_ms=5.0, overlap=1.5)


def test_tensor_parallel_collectives_are_priced_as_gloo_runs_them_not_as_the_sync_path() -> None:
    # a probed CPU link: its own fit (gloo send/recv and all-reduce) and the shared-memory fits of the gradient
    # sync's collectives, which the layers' gloo collectives do not use
    gloo = cost_models.LinkSpec("cpu0-cpu1", 2.85, 100.9, "probe", shared=True)
    probed = replace(gloo, collectives=(("all_reduce", 10.4, 241.3), ("all_gather", 10.0, 475.5),
                                        ("param_gather", 9.0, 400.0), ("tp_gather", 1.79, 338.2)))
    mib = 1 << 20
    reduces = stagecost.tp_comm_ms(12 * mib, 0, 3, 2, probed)
    assert reduces == pytest.approx(3 * cost_models.allreduce_ms(4 * mib, 2, gloo))
    assert reduces > 2 * 3 * cost_models.allreduce_ms(4 * mib, 2, probed.for_collective("all_reduce"))
    gathered = stagecost.tp_comm_ms(0, 16 * mib, 1, 2, probed)
    at_step = cost_models.LinkSpec("g", 1.79, 338.2, "probe", shared=True)
    assert gathered == pytest.approx(cost_models.all_gather_ms(16 * mib, 2, at_step))
    # the same as arrays (the solver's table) and on a link without fits of its own
    arr = stagecost.tp_comm_ms(np.array([12.0 * mib]), np.array([0.0]), np.array([3]), 2, probed)
    assert float(arr[0]) == pytest.approx(reduces)
    assert stagecost.tp_comm_ms(12 * mib, 0, 3, 2, gloo) == pytest.approx(reduces)
    # where the probe timed gloo's all-reduce in a chain of compute, as a layer runs it, that prices each all-reduce
    layer = cost_models.LinkSpec("r", 1.2, 700.0, "probe", shared=True)
    after = replace(probed, collectives=probed.collectives + (("tp_reduce", 1.2, 700.0),))
    assert stagecost.tp_comm_ms(12 * mib, 0, 3, 2, after) == pytest.approx(3 * cost_models.allreduce_ms(4 * mib, 2, layer))
    assert stagecost.tp_comm_ms(0, 16 * mib, 1, 2, after) == pytest.approx(gathered)  # the gather keeps its own
