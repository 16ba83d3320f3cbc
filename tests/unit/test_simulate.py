"""The event simulator: hand-computed pipelines, the bubble formula, comm, sync, recompute, memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

import cost_models
from cost_models import LinkSpec

from hpml_compile.costgraph import build
from hpml_compile.ir import Cluster, Device, Link
from hpml_compile.plan import Plan, Schedule, Stage, ZeroStage, stage_memory
from hpml_compile.schedule import ActionKind, stage_lists
from hpml_compile.simulate import EventKind, idle_intervals, loss_agreement_ms, op_order, simulate
from hpml_compile.stagecost import meet_ms
from hpml_compile.testing import chain_profile, uniform_cluster

ONE_CHUNK = [s for s in Schedule if s is not Schedule.INTERLEAVED]  # interleaved 1F1B: test_interleaved.py


def _plan(graph, cluster, groups, m, schedule, **stage_kw) -> Plan:
    stages = []
    for i, (devs, nodes) in enumerate(groups):
        members = tuple(x for n in nodes for x in graph.node(n).members)
        stages.append(Stage(i, devs, members, **stage_kw))
    return Plan("toy", cluster, schedule, m, tuple(stages))


def _two_stage(schedule: Schedule, m: int = 3, act: int = 0):
    # per microbatch: stage 0 fwd 1 bwd 2, stage 1 fwd 2 bwd 4 (the graph holds full-batch times)
    prof = chain_profile([(1.0 * m, 2.0 * m), (2.0 * m, 4.0 * m)], activation_bytes=act)
    g = build(prof)
    c = uniform_cluster(2)
    return prof, g, _plan(g, c, [(("d0",), ["n0"]), (("d1",), ["n1"])], m, schedule)


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
def test_two_stage_hand_computed(schedule: Schedule) -> None:
    _, g, plan = _two_stage(schedule)
    r = simulate(plan, g)
    # GPipe: s1 backwards 7-11, 11-15, 15-19; s0's last backward 19-21.
    # 1F1B: s0 F0 0-1 F1 1-2 B0 7-9 F2 9-10 B1 13-15 B2 19-21; same makespan, fewer in flight.
    assert r.step_ms == pytest.approx(21.0)
    busy = 3 * (3 + 6)
    assert r.bubble == pytest.approx(1 - busy / (2 * 21))
    # as each rank measures it: stage 0 computes 9 ms of its 21, stage 1 18 ms of the 19 up to its last backward
    assert r.stage_bubbles == pytest.approx((1 - 9 / 21, 1 - 18 / 19))
    assert r.bottleneck_stage == 1
    fwd0 = sorted((b.start_ms, b.end_ms) for b in r.intervals
                  if b.device == "d0" and b.kind is EventKind.FORWARD)
    if schedule is Schedule.GPIPE:
        assert fwd0 == [(0, 1), (1, 2), (2, 3)]
    else:
        assert fwd0 == [(0, 1), (1, 2), (9, 10)]


def test_zb_h1_fills_the_bubble_with_weight_parts() -> None:
    # weight part = half of each backward: s0 I 1 W 1, s1 I 2 W 2 per microbatch
    # s0: F0 0-1 F1 1-2 I0 5-6 W0 6-7 F2 7-8 I1 9-10 W1 10-11 I2 15-16 W2 16-17
    # s1: F0 1-3 I0 3-5 F1 5-7 I1 7-9 W0 9-11 F2 11-13 I2 13-15 W1 15-17 W2 17-19
    _, g, plan = _two_stage(Schedule.ZB_H1)
    r = simulate(plan, g)
    assert r.step_ms == pytest.approx(19.0)
    assert r.bubble == pytest.approx(1 - 27 / (2 * 19))
    assert r.bubble < simulate(_two_stage(Schedule.ONE_F_ONE_B)[2], g).bubble
    bwd0 = sorted((b.start_ms, b.end_ms) for b in r.intervals if b.device == "d0" and b.kind is EventKind.BACKWARD)
    assert bwd0 == [(5, 6), (6, 7), (9, 10), (10, 11), (15, 16), (16, 17)]


def test_two_stage_memory_gpipe_vs_1f1b() -> None:
    peaks = {}
    for s in ONE_CHUNK:
        prof, g, plan = _two_stage(s, act=300)  # 100 bytes per microbatch per stage
        r = simulate(plan, g)
        peaks[s] = r.peak
        for st in plan.stages:  # the simulated peak is the memory model's peak
            assert r.peak[st.devices[0]] == stage_memory(plan, prof, st)
    assert peaks[Schedule.GPIPE] == {"d0": 300, "d1": 300}
    assert peaks[Schedule.ONE_F_ONE_B] == {"d0": 200, "d1": 100}  # S - i microbatches in flight


@pytest.mark.parametrize("schedule", ONE_CHUNK)
@pytest.mark.parametrize("s,m", [(2, 1), (3, 5), (4, 8), (4, 2)])
def test_bubble_formula_balanced_free_comm(schedule: Schedule, s: int, m: int) -> None:
    g = build(chain_profile([(1.0 * m, 2.0 * m)] * s))
    plan = _plan(g, uniform_cluster(s), [((f"d{i}",), [f"n{i}"]) for i in range(s)], m, schedule)
    r = simulate(plan, g)
    if schedule is Schedule.ZB_H1:
        # Qi et al. 2024: ZB-H1's bubble is (S - 1)(F + I - W) a stage where 1F1B's is (S - 1)(F + I + W) (M >= S);
        # here F 1, I 1, W 1
        if m >= s:
            assert r.step_ms == pytest.approx(m * 3.0 + (s - 1) * 1.0)
            assert r.bubble == pytest.approx((s - 1) / (3.0 * m + (s - 1)))
        else:
            assert r.step_ms < (m + s - 1) * 3.0
        return
    assert r.bubble == pytest.approx((s - 1) / (m + s - 1))
    assert r.step_ms == pytest.approx((m + s - 1) * 3.0)


def test_send_delay_over_link() -> None:
    prof = chain_profile([(1.0, 2.0), (2.0, 4.0)], output_bytes=10**6)
    g = build(prof)
    c = Cluster(devices=(Device("d0", "cpu", 8), Device("d1", "cpu", 8)), links=(Link("d0", "d1", 1.0, 0.0),))
    r = simulate(_plan(g, c, [(("d0",), ["n0"]), (("d1",), ["n1"])], 1, Schedule.GPIPE), g)
    # F0 0-1, 1 MB over 1 GB/s = 1 ms, F1 2-4, B1 4-8, gradient back 1 ms, B0 9-11; then the ranks' loss
    # agreement (32 bytes: 64 ns on this latency-free link)
    assert r.step_ms == pytest.approx(11.0 + r.agree_ms) and 0 < r.agree_ms < 1e-4
    assert any(b.kind is EventKind.SEND for b in r.intervals)


@pytest.mark.parametrize("kind", ["A100-80GB", "cpu"])
def test_allreduce_tail_in_replicated_stage(kind: str) -> None:
    prof = chain_profile([(2.0, 4.0)], param_bytes=2 * 10**6, kind=kind)
    g = build(prof)
    c = Cluster(devices=(Device("d0", kind, 8), Device("d1", kind, 8)), links=(Link("d0", "d1", 1.0, 0.0),))
    r = simulate(_plan(g, c, [(("d0", "d1"), ["n0"])], 1, Schedule.GPIPE), g)
    # compute halves (F 0-1, B 1-3); ring all-reduce of 2 MB over 2 ranks: 2 (n-1)/n * 2 MB / 1 GB/s = 2 ms,
    # in place on the buffer the gradients accumulate in (no copies). On GPUs (plan.sync_overlap 1) in two
    # buckets (1 MiB, then the rest) launched during the 2 ms backward: the first is ready after 1 MiB of it,
    # so the backward hides 2 ms * (1 - 1 MiB / 2 MB) and the tail is the rest (more than the last bucket
    # alone). On CPU ranks (sync_overlap 0: gloo's threads would share the backward's cores) the runtime
    # all-reduces once after the backward: the whole 2 ms.
    hides = 1.0 if kind != "cpu" else 0.0
    first = 2**20 / 2e6
    meet = (1.0 - hides) * meet_ms(2, LinkSpec("d0-d1", 1.0, 0.0, "the test's link"))  # CPU: before the collective
    assert r.step_ms == pytest.approx(3.0 + 2.0 - hides * 2.0 * (1 - first) + r.agree_ms + meet)
    assert [b.kind for b in r.intervals if b.device == "d1"][-1] is EventKind.SYNC
    # ZeRO-1: reduce-scatter + all-gather, (n-1)/n * 2 MB / 1 GB/s each = 1 ms, and the summed gradient shard
    # copied into the kept buffer (1 MB read + written; the gather writes into place) at the memory bandwidth;
    # the reduce-scatter's buckets span
    # both shards, so only the last half of the backward (1 ms) hides it (on GPUs); the all-gather follows
    # the optimizer, on GPUs prefetched per bucket under the next forward: a bucket spans both
    # shards, so the forward's first half (0.5 ms) reads them all and hides 0.5 ms * (1 - 1 MiB / 2 MB) (the
    # first bucket gathered, the bottom 0.95 MB, costs more than what is left exposed: not the bound here)
    copy = 2 * 2e6 / 2 / (cost_models.get_device(kind).mem_bw / 1e3)
    r1 = simulate(_plan(g, c, [(("d0", "d1"), ["n0"])], 1, Schedule.GPIPE, zero=ZeroStage.OS), g)
    assert r1.step_ms == pytest.approx(3.0 + 1.0 - hides * 1.0 * (1 - first) + 1.0 - hides * 0.5 * (1 - first) + copy
                                       + r1.agree_ms + 2 * meet)


def test_recompute_is_an_extra_forward() -> None:
    g = build(chain_profile([(1.0, 2.0)]))
    r = simulate(_plan(g, uniform_cluster(1), [(("d0",), ["n0"])], 1, Schedule.GPIPE, recompute=True), g)
    assert r.step_ms == pytest.approx(4.0)
    assert [b.kind for b in r.intervals] == [EventKind.FORWARD, EventKind.RECOMPUTE, EventKind.BACKWARD]


def test_idle_intervals_and_op_order() -> None:
    _, g, plan = _two_stage(Schedule.GPIPE)
    r = simulate(plan, g)
    gaps = idle_intervals(r, "d0")
    assert gaps[0] == (3.0, 11.0) and sum(e - s for s, e in gaps) == pytest.approx(21 - 9)
    assert [f"{k.value}{j}" for k, j in op_order(Schedule.ONE_F_ONE_B, 0, 3, 4)] == [
        "F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]


def test_unknown_kind_in_graph() -> None:
    from hpml_compile.errors import UnknownDeviceError
    g = build(chain_profile([(1.0, 2.0)]))
    c = Cluster(devices=(Device("g", "T4", 16),))
    with pytest.raises(UnknownDeviceError, match="predict_kinds"):
        simulate(_plan(g, c, [(("g",), ["n0"])], 1, Schedule.GPIPE), g)


def _with(prof, *, fixed: float = 0.0, optimizer_ms: float | None = None, params: dict | None = None,
          node_params: dict | None = None):
    """``prof`` with each node's cost given a fixed part of ``fixed`` (fwd and bwd), an optimizer time, and
    parameter names per node."""
    from dataclasses import replace

    from hpml_compile.ir import NodeCost

    nodes = tuple(replace(n, cost={k: NodeCost(c.fwd_ms, c.bwd_ms, c.measured, fwd_fixed_ms=min(fixed, c.fwd_ms),
                                               bwd_fixed_ms=min(fixed, c.bwd_ms)) for k, c in n.cost.items()},
                          params=(node_params or {}).get(n.name, n.params)) for n in prof.nodes)
    return replace(prof, nodes=nodes, optimizer_ms={} if optimizer_ms is None else {"cpu": optimizer_ms},
                   optimizer="adamw" if optimizer_ms is not None else None, parameters=params or {})


def test_fixed_part_is_paid_by_every_microbatch() -> None:
    # full batch: fwd 8, bwd 16 per node, of which 2 is fixed; M = 4: a microbatch costs 2 + 6/4 and 2 + 14/4
    prof = chain_profile([(8.0, 16.0)])
    g = build(_with(prof, fixed=2.0))
    c = uniform_cluster(1)
    r = simulate(_plan(g, c, [(("d0",), ["n0"])], 4, Schedule.GPIPE), g)
    assert r.stages[0].fwd_ms == pytest.approx(2 + 6 / 4) and r.stages[0].bwd_ms == pytest.approx(2 + 14 / 4)
    assert r.step_ms == pytest.approx(4 * (3.5 + 5.5))
    plain = build(prof)  # no fixed part: time / M, as before
    assert simulate(_plan(plain, c, [(("d0",), ["n0"])], 4, Schedule.GPIPE), plain).step_ms == pytest.approx(24.0)


def test_fixed_part_and_data_parallel_replicas() -> None:
    prof = chain_profile([(8.0, 16.0)], param_bytes=0)
    g = build(_with(prof, fixed=2.0))
    c = uniform_cluster(2)
    r = simulate(_plan(g, c, [(("d0", "d1"), ["n0"])], 2, Schedule.GPIPE), g)
    assert r.stages[0].fwd_ms == pytest.approx(2 + 6 / 4)  # each replica runs a quarter of the rows


def test_optimizer_step_after_the_sync_scaled_by_parameter_bytes() -> None:
    prof = chain_profile([(2.0, 4.0), (2.0, 4.0)], param_bytes=[1000, 3000])
    g = build(_with(prof, optimizer_ms=8.0))  # 8 ms for 4000 bytes
    c = uniform_cluster(2)
    r = simulate(_plan(g, c, [(("d0",), ["n0"]), (("d1",), ["n1"])], 1, Schedule.GPIPE), g)
    assert [s.optimizer_ms for s in r.stages] == pytest.approx([2.0, 6.0])
    no_opt = simulate(_plan(build(prof), c, [(("d0",), ["n0"]), (("d1",), ["n1"])], 1, Schedule.GPIPE),
                      build(prof))
    assert r.step_without_optimizer_ms == pytest.approx(no_opt.step_ms)
    ends = {i: max(b.end_ms for b in r.intervals if b.stage == i and b.kind is EventKind.BACKWARD) for i in (0, 1)}
    # every stage steps once the last one is done (the ranks agree the step succeeded first): stage 1 finished
    # its backward first, but does not step before stage 0 is done
    assert ends[1] < ends[0]
    assert r.step_ms == pytest.approx(max(ends.values()) + 6.0)
    starts = {b.stage: b.start_ms for b in r.intervals if b.kind is EventKind.OPTIMIZER}
    assert starts == {0: pytest.approx(ends[0]), 1: pytest.approx(ends[0])}


def test_tied_parameter_all_reduce_between_stages() -> None:
    cluster = Cluster(devices=(Device("d0", "cpu", 64.0), Device("d1", "cpu", 64.0)),
                      links=(Link("d0", "d1", gbps=1.0, latency_us=0.0),))
    prof = chain_profile([(2.0, 4.0), (2.0, 4.0)], param_bytes=[10**6, 0])
    tied = _with(prof, params={"w": 10**6}, node_params={"n0": ("w",), "n1": ("w",)})
    g = build(tied)
    plan = _plan(g, cluster, [(("d0",), ["n0"]), (("d1",), ["n1"])], 1, Schedule.GPIPE)
    r = simulate(plan, g)
    base = simulate(plan, build(prof))
    assert len(r.tied_ms) == 1 and r.tied_ms[0][0] == (0, 1) and r.tied_ms[0][1] > 0
    assert r.step_ms == pytest.approx(base.step_ms + r.tied_ms[0][1])
    one = _plan(g, cluster, [(("d0",), ["n0", "n1"])], 1, Schedule.GPIPE)
    assert simulate(one, g).tied_ms == ()  # one stage holds both users: nothing to reduce


def _streaming(prof, one: float = 10.0, host: float = 12.5, optimizer_ms: float = 4.0):
    """The profile as measured on a host whose one thread streams ``one`` GB/s and all its threads ``host``."""
    from dataclasses import replace

    return build(replace(prof, optimizer="adamw", optimizer_ms={"cpu": optimizer_ms},
                         devices={"cpu": {"measured": True, "stream_gbps": one, "host_stream_gbps": host}}))


def _pair(same_host: bool) -> Cluster:
    devs = (Device("d0", "cpu", 8), Device("d1", "cpu", 8, host="node0" if same_host else "node1"))
    return Cluster(devices=devs, links=(Link("d0", "d1", 1.0, 0.0),))


def test_replicas_on_one_host_share_its_memory_bandwidth() -> None:
    g = _streaming(chain_profile([(2.0, 4.0)], param_bytes=2 * 10**6))
    zero1 = {"zero": ZeroStage.OS}  # the summed 1 MB gradient shard is copied into its buffer; Adam's step halves
    alone = simulate(_plan(g, _pair(False), [(("d0", "d1"), ["n0"])], 1, Schedule.GPIPE, **zero1), g)
    shared = simulate(_plan(g, _pair(True), [(("d0", "d1"), ["n0"])], 1, Schedule.GPIPE, **zero1), g)
    c = shared.stages[0]
    # 2 MB of weights at 10 GB/s: 0.2 ms of the forward streams, 0.4 ms of the backward; copies 2 x 1 MB
    assert (c.fwd_stream_ms, c.bwd_stream_ms, c.sync_copy_ms) == pytest.approx((0.2, 0.4, 0.2))
    # reduce-scatter + all-gather of 2 MB over 1 GB/s: 1 + 1 ms; different hosts: nothing stretches. CPU
    # ranks do not overlap the reduce-scatter with the backward (plan.sync_overlap): all of it after
    rs = 1.0
    agree = alone.agree_ms  # the ranks' loss agreement, between the sync and the optimizer
    meet = meet_ms(2, LinkSpec("d0-d1", 1.0, 0.0, "the test's link"))  # before each blocking collective
    assert alone.step_ms == pytest.approx(1.0 + 2.0 + rs + 1.0 + 0.2 + agree + 2.0 + 2 * meet)
    assert alone.contention == (1.0,)
    # ZeRO-0 accumulates gradients in the buffer it all-reduces in place: no copies
    plain = simulate(_plan(g, _pair(False), [(("d0", "d1"), ["n0"])], 1, Schedule.GPIPE), g)
    assert plain.stages[0].sync_copy_ms == 0.0 and plain.step_ms == pytest.approx(1.0 + 2.0 + 2.0 * rs + agree + 4.0
                                                                                   + meet)
    # both replicas stream at once, all the time: each streaming part takes 2 x 10 / 12.5 = 1.6x as long
    assert shared.step_ms == pytest.approx(1.0 + 0.2 * 0.6 + 2.0 + 0.4 * 0.6 + rs + 1.0 + 0.2 * 1.6 + agree + 2.0 * 1.6
                                           + 2 * meet)
    assert shared.contention[0] == pytest.approx((3.0 + 0.6 * 0.6) / 3.0)
    optim = [b for b in shared.intervals if b.kind is EventKind.OPTIMIZER]
    assert {round(b.end_ms - b.start_ms, 9) for b in optim} == {3.2}  # ZeRO-1: half the step, 1.6x as long


def test_pipeline_stages_stretch_only_while_they_overlap() -> None:
    m = 4
    prof = chain_profile([(1.0 * m, 2.0 * m), (1.0 * m, 2.0 * m)], param_bytes=10**7)
    g = _streaming(prof, optimizer_ms=0.0)
    r = simulate(_plan(g, _pair(True), [(("d0",), ["n0"]), (("d1",), ["n1"])], m, Schedule.GPIPE), g)
    plain = simulate(_plan(g, _pair(False), [(("d0",), ["n0"]), (("d1",), ["n1"])], m, Schedule.GPIPE), g)
    fwd = {(b.stage, b.microbatch): b.end_ms - b.start_ms for b in r.intervals if b.kind is EventKind.FORWARD}
    # stage 0's first forward runs while stage 1 waits for it: alone, at its own pace
    assert fwd[(0, 0)] == pytest.approx(1.0)
    # later forwards overlap stage 1's: their streaming part (10 MB at 10 GB/s = 1 ms, all of it) is 1.6x
    assert fwd[(0, 1)] > 1.3
    assert r.step_ms > plain.step_ms
    assert 1.0 < r.contention[0] < 1.6 and 1.0 < r.contention[1] < 1.6
    assert plain.contention == (1.0, 1.0)


def _cored(prof, cpus: int | None, optimizer_ms: float = 4.0):
    """The profile as taken on a host of ``cpus`` logical CPUs (None: not recorded), memory rates not measured."""
    from dataclasses import replace

    facts = {"measured": True, **({"cpus": cpus} if cpus else {})}
    return build(replace(prof, optimizer="adamw", optimizer_ms={"cpu": optimizer_ms}, devices={"cpu": facts}))


def _bars(r, kind: EventKind) -> dict[tuple[str, int], float]:
    return {(b.device, b.microbatch): b.end_ms - b.start_ms for b in r.intervals if b.kind is kind}


def test_ranks_beyond_the_hosts_cores_share_them() -> None:
    # measured: gpt-mini on 4 data-parallel ranks of a 2-core VM computed 1.8-2.5x as long as with a core each
    prof = chain_profile([(2.0, 4.0)], param_bytes=2 * 10**6)
    four = Cluster(devices=tuple(Device(f"d{i}", "cpu", 8) for i in range(4)),
                   links=tuple(Link("d0", f"d{i}", 1e6, 0.0) for i in range(1, 4)))
    devs = tuple(d.name for d in four.devices)
    runs = {c: simulate(_plan(g, four, [(devs, ["n0"])], 1, Schedule.GPIPE), g)
            for c, g in ((None, _cored(prof, None)), (4, _cored(prof, 4)), (2, _cored(prof, 2)),
                         (1, _cored(prof, 1)))}
    for kind in (EventKind.FORWARD, EventKind.BACKWARD, EventKind.OPTIMIZER):
        base = _bars(runs[None], kind)
        assert base and _bars(runs[4], kind) == pytest.approx(base)  # a core per rank: as if not recorded
        assert _bars(runs[2], kind) == pytest.approx({k: 2 * v for k, v in base.items()})  # 4 ranks, 2 cores
        assert _bars(runs[1], kind) == pytest.approx({k: 4 * v for k, v in base.items()})
    assert runs[2].step_ms > runs[4].step_ms and runs[4].step_ms == pytest.approx(runs[None].step_ms)
    from hpml_compile.explain import summary  # explain says where and why

    g2 = _cored(prof, 2)
    plan = _plan(g2, four, [(devs, ["n0"])], 1, Schedule.GPIPE)
    assert "sharing a host: stage 0 x2.00 as long per microbatch as alone (CPU ranks of a host share its memory " \
           "bandwidth, and its cores: node0 runs 4 ranks on 2 cores)" in summary(plan, g2, runs[2])
    g4 = _cored(prof, 4)
    assert "sharing a host" not in summary(_plan(g4, four, [(devs, ["n0"])], 1, Schedule.GPIPE), g4, runs[4])
    # ranks on other hosts do not share this one's cores: one rank per host of one core
    apart = Cluster(devices=tuple(Device(f"d{i}", "cpu", 8, host=f"node{i}") for i in range(4)), links=four.links)
    g1 = _cored(prof, 1)
    assert simulate(_plan(g1, apart, [(devs, ["n0"])], 1, Schedule.GPIPE), g1).step_ms == pytest.approx(
        runs[None].step_ms)


def test_pipeline_ranks_share_a_core_only_while_both_compute() -> None:
    m = 4
    prof = chain_profile([(1.0 * m, 2.0 * m), (1.0 * m, 2.0 * m)])
    plans = {c: (g, _plan(g, _pair(True), [(("d0",), ["n0"]), (("d1",), ["n1"])], m, Schedule.GPIPE))
             for c, g in ((1, _cored(prof, 1, 0.0)), (2, _cored(prof, 2, 0.0)))}
    one, two = (simulate(p, g) for g, p in plans.values())
    fwd = {(b.stage, b.microbatch): b.end_ms - b.start_ms for b in one.intervals if b.kind is EventKind.FORWARD}
    assert fwd[(0, 0)] == pytest.approx(1.0)  # stage 1 waits for it: stage 0 has the core to itself
    assert fwd[(0, 1)] > 1.3  # then both compute: each has half of it
    assert one.step_ms > two.step_ms
    assert all(b.end_ms - b.start_ms == pytest.approx(1.0) for b in two.intervals if b.kind is EventKind.FORWARD)


def _corun(prof, fwd: float, bwd: float, ranks: int = 2, streams: bool = True):
    """The profile as taken on a 2-core host where the blocks ran ``fwd`` / ``bwd`` times as long while ``ranks``
    processes ran them (``profile.corun.time_corun``), its memory rates measured too (``streams``)."""
    from dataclasses import replace

    facts = {"measured": True, "cpus": 2, "corun": {"fwd": fwd, "bwd": bwd, "ranks": ranks, "rounds": [[fwd, bwd]]},
             **({"stream_gbps": 10.0, "host_stream_gbps": 12.5} if streams else {})}
    return build(replace(prof, optimizer="adamw", optimizer_ms={"cpu": 0.0}, devices={"cpu": facts}))


def _each(bars: dict, ms: float) -> bool:
    return bool(bars) and all(v == pytest.approx(ms) for v in bars.values())


def test_ranks_computing_at_once_stretch_by_the_measured_corun() -> None:
    """mlp's blocks ran 1.10-1.14x as long beside a second process running them, gpt-mini's
    1.02x, on the 2-core VM, where the memory-bandwidth model predicts otherwise. Where the profile measured it,
    two replicas computing at once stretch by it (forward and backward each their own), instead of by the
    bandwidth; a rank alone, or ranks on other hosts, do not."""
    prof = chain_profile([(2.0, 4.0)], param_bytes=2 * 10**6)
    g = _corun(prof, 1.25, 1.5)
    assert g.corun("cpu") == (1.25, 1.5, 2)
    both = simulate(_plan(g, _pair(True), [(("d0", "d1"), ["n0"])], 1, Schedule.GPIPE), g)
    assert _each(_bars(both, EventKind.FORWARD), 0.5 * 2.0 * 1.25)  # 1 row each of 2
    assert _each(_bars(both, EventKind.BACKWARD), 0.5 * 4.0 * 1.5)
    apart = simulate(_plan(g, _pair(False), [(("d0", "d1"), ["n0"])], 1, Schedule.GPIPE), g)
    assert _each(_bars(apart, EventKind.FORWARD), 1.0)  # no neighbour on its host
    alone = simulate(_plan(g, _pair(True), [(("d0",), ["n0"])], 1, Schedule.GPIPE), g)
    assert _each(_bars(alone, EventKind.FORWARD), 2.0)
    # not measured: the bandwidth's stretch of the streaming part, as before
    plain = simulate(_plan(g, _pair(True), [(("d0", "d1"), ["n0"])], 1, Schedule.GPIPE),
                     _streaming(prof, optimizer_ms=0.0))
    assert _each(_bars(plain, EventKind.FORWARD), 1.0 + 0.2 * 0.6)  # 2 MB of weights at 10 GB/s: 0.2 ms stream
    assert both.step_ms > plain.step_ms
    from hpml_compile.explain import summary

    assert "measured by the profile: cpu's blocks ran x1.25 forward, x1.50 backward with 2 processes at once" in \
        summary(_plan(g, _pair(True), [(("d0", "d1"), ["n0"])], 1, Schedule.GPIPE), g, both)


def test_a_zero_stage_steps_its_flat_shard_at_the_flat_rate() -> None:
    """The runtime steps a ZeRO-1/2/3 stage's shard as one flat tensor (runtime.sync.zero): the profile's flat step
    (``optimizer_flat_ms``) prices it; a ZeRO-0 stage steps its parameters one by one, at ``optimizer_ms``."""
    from dataclasses import replace

    prof = chain_profile([(2.0, 4.0)], param_bytes=2 * 10**6)
    g = build(replace(prof, optimizer="adamw", optimizer_ms={"cpu": 8.0},
                      devices={"cpu": {"measured": True, "optimizer_flat_ms": 2.0}}))
    assert g.optimizer_ms_per_byte("cpu", True) == pytest.approx(g.optimizer_ms_per_byte("cpu") / 4)
    # a slowed device's variant kind (its own, slower optimizer_ms) keeps its base kind's flat ratio
    slowed = build(replace(prof, optimizer="adamw", optimizer_ms={"cpu": 8.0, "cpu~d1": 16.0},
                           devices={"cpu": {"measured": True, "optimizer_flat_ms": 2.0}}))
    assert slowed.optimizer_ms_per_byte("cpu~d1", True) == pytest.approx(2 * g.optimizer_ms_per_byte("cpu", True))
    steps = {}
    for zero in (ZeroStage.NONE, ZeroStage.OS, ZeroStage.OS_G_P):
        r = simulate(_plan(g, _pair(False), [(("d0", "d1"), ["n0"])], 1, Schedule.GPIPE, zero=zero), g)
        steps[zero] = {round(b.end_ms - b.start_ms, 9) for b in r.intervals if b.kind is EventKind.OPTIMIZER}
    assert steps == {ZeroStage.NONE: {8.0}, ZeroStage.OS: {1.0}, ZeroStage.OS_G_P: {1.0}}  # flat, half each


def test_pipeline_stages_stretch_by_the_corun_only_while_both_compute() -> None:
    m = 4
    prof = chain_profile([(1.0 * m, 2.0 * m), (1.0 * m, 2.0 * m)])
    g = _corun(prof, 1.4, 1.4, streams=False)
    r = simulate(_plan(g, _pair(True), [(("d0",), ["n0"]), (("d1",), ["n1"])], m, Schedule.GPIPE), g)
    fwd = {(b.stage, b.microbatch): b.end_ms - b.start_ms for b in r.intervals if b.kind is EventKind.FORWARD}
    assert fwd[(0, 0)] == pytest.approx(1.0)  # stage 1 waits for it: alone
    assert 1.0 < fwd[(0, 1)] <= 1.4 + 1e-9  # then both compute
    # measured with 4 processes: 2 busy ranks stretch a third of the way to it
    g4 = _corun(prof, 1.6, 1.6, ranks=4, streams=False)
    both = simulate(_plan(g4, _pair(True), [(("d0", "d1"), ["n0", "n1"])], 1, Schedule.GPIPE), g4)
    assert _each(_bars(both, EventKind.FORWARD), 0.5 * 8.0 * (1 + 0.6 / 3))


def test_the_ranks_agree_on_the_loss_between_the_sync_and_the_optimizer() -> None:
    """The runtime all-reduces the loss and the batch check (32 bytes) over every rank after the last sync and
    before any optimizer step: a tree of latencies, priced on the slowest link; one device pays nothing. Where the
    plan's one stage spans every rank, the agreement rides the stage's gradient collective as its meeting, which
    the sync prices already: nothing more."""
    g = _streaming(chain_profile([(2.0, 4.0), (2.0, 4.0)], param_bytes=2 * 10**6), one=1e9, host=2e9)
    slow = (Device("d0", "cpu", 8), Device("d1", "cpu", 8, host="node1"), Device("d2", "cpu", 8, host="node2"))
    c = Cluster(devices=slow, links=(Link("d0", "d1", 1e6, 500.0), Link("d0", "d2", 1e6, 800.0),
                                     Link("d1", "d2", 1e6, 800.0)))
    from hpml_compile.explain import summary

    both = ["n0", "n1"]
    one_rank = _plan(g, c, [(("d0",), both)], 1, Schedule.GPIPE)
    pipes = [_plan(g, c, [(("d0",), ["n0"]), (rest, ["n1"])], 1, Schedule.GPIPE) for rest in (("d1",), ("d1", "d2"))]
    rides = _plan(g, c, [(("d0", "d1", "d2"), both)], 1, Schedule.GPIPE)
    one, two, three, ridden = (simulate(p, g) for p in (one_rank, *pipes, rides))
    assert one.agree_ms == 0.0 and "loss agreement" not in summary(one_rank, g, one)
    assert "loss agreement: one 32-byte all-reduce over the 3 ranks before the optimizer steps, 3.2 ms" in summary(
        pipes[1], g, three)
    assert two.agree_ms == pytest.approx(2 * 0.5, rel=1e-4)  # 2 ceil(log2 2) messages of 0.5 ms
    assert three.agree_ms == pytest.approx(4 * 0.8, rel=1e-4)  # 4 messages, on the slower link
    assert ridden.agree_ms == 0.0 and "ride the gradient sync" in summary(rides, g, ridden)
    for r in (two, three, ridden):
        sync_end = max((b.end_ms for b in r.intervals if b.kind is EventKind.SYNC), default=0.0)
        last = max(b.end_ms for b in r.intervals if b.kind in (EventKind.FORWARD, EventKind.BACKWARD))
        opt = [b for b in r.intervals if b.kind is EventKind.OPTIMIZER]
        assert opt and all(b.start_ms == pytest.approx(max(sync_end, last) + r.agree_ms) for b in opt)
        assert r.step_without_optimizer_ms == pytest.approx(max(sync_end, last) + r.agree_ms)
    # priced apart (a pipeline over these ranks), their agreement would cost the tree of latencies
    assert loss_agreement_ms(c, list(rides.stages[0].devices)) == pytest.approx(4 * 0.8, rel=1e-4)


def test_zero1s_parameter_gather_follows_its_own_optimizer_step_where_the_runtime_runs_it() -> None:
    """On CPU ranks (no prefetch) the runtime all-gathers ZeRO-1's stepped shards after the optimizer step
    (``FlatShard.all_gather``), so the simulator puts the gather there: out of the sync before the loss
    agreement, after each stage's own step; the step ends with the slowest stage's step and gather."""
    from hpml_compile.cluster import link_spec
    from hpml_compile.explain import summary
    from hpml_compile.stagecost import stepped_gather_ms

    g = _streaming(chain_profile([(2.0, 4.0), (2.0, 4.0)], param_bytes=2 * 10**6), optimizer_ms=4.0)
    devs = tuple(Device(f"d{i}", "cpu", 8, host=f"node{i}") for i in range(3))
    c = Cluster(devices=devs, links=(Link("d0", "d1", 0.5, 100.0), Link("d0", "d2", 1.0, 50.0),
                                     Link("d1", "d2", 1.0, 50.0)))
    stages = (Stage(0, ("d0", "d1"), g.node("n0").members, zero=ZeroStage.OS),
              Stage(1, ("d2",), g.node("n1").members))
    plan = Plan("toy", c, Schedule.GPIPE, 1, stages)
    r = simulate(plan, g)
    s0, s1 = r.stages
    gather = float(stepped_gather_ms(2 * 10**6, 2, ZeroStage.OS, link_spec(c, "d0", "d1")))
    assert gather > 1.0 and s0.gather_ms == pytest.approx(gather) and s1.gather_ms == 0.0
    assert s0.synced_ms == pytest.approx(s0.sync_ms + gather)
    for dev in ("d0", "d1"):
        opt = [b for b in r.intervals if b.device == dev and b.kind is EventKind.OPTIMIZER]
        after = [b for b in r.intervals if b.device == dev and b.kind is EventKind.SYNC and b.start_ms >= opt[0].end_ms]
        assert len(opt) == 1 and len(after) == 1
        assert after[0].start_ms == pytest.approx(opt[0].end_ms)
        assert after[0].end_ms - after[0].start_ms == pytest.approx(gather)
    # the sync before the agreement is the reduce-scatter (and the copies) alone: stage 0's backward ends last
    sync = [b for b in r.intervals if b.device == "d0" and b.kind is EventKind.SYNC][0]
    assert sync.end_ms - sync.start_ms == pytest.approx(s0.sync_ms)
    assert r.step_without_optimizer_ms == pytest.approx(sync.end_ms + r.agree_ms)
    opt_ms = {b.stage: b.end_ms - b.start_ms for b in r.intervals if b.kind is EventKind.OPTIMIZER}
    assert r.step_ms == pytest.approx(r.step_without_optimizer_ms + max(opt_ms[0] + gather, opt_ms[1]))
    assert "parameter all-gather" in summary(plan, g, r)


@pytest.mark.parametrize("schedule", ONE_CHUNK)
@pytest.mark.parametrize("s,m", [(2, 1), (3, 4), (4, 2)])
def test_the_replayed_lists_send_and_receive_as_a_uniform_pipeline_runs(schedule: Schedule, s: int, m: int) -> None:
    # per microbatch: forward 1 ms, backward 2 ms, 1 MB across each boundary over 1 GB/s: 1 ms each way
    f, b, c = 1.0, 2.0, 1.0
    prof = chain_profile([(f * m, b * m)] * s, output_bytes=m * 10**6)
    g = build(prof)
    devs = tuple(Device(f"d{i}", "cpu", 8) for i in range(s))
    cluster = Cluster(devices=devs, links=tuple(Link(x.name, y.name, 1.0, 0.0) for i, x in enumerate(devs)
                                                for y in devs[i + 1:]))
    plan = _plan(g, cluster, [((f"d{i}",), [f"n{i}"]) for i in range(s)], m, schedule)
    r = simulate(plan, g)
    # GPipe: the first microbatch's forward crosses s - 1 boundaries and the last backward s - 1 back; in between
    # every stage computes one microbatch after another (1F1B waits for each gradient's round trip in between)
    ideal = (m + s - 1) * (f + b) + 2 * (s - 1) * c
    if schedule is Schedule.ZB_H1:  # the weight-gradient parts fill the bubble: never slower than 1F1B
        one_f_one_b = simulate(replace(plan, schedule=Schedule.ONE_F_ONE_B), g)
        assert m * (f + b) <= r.step_ms - r.agree_ms <= one_f_one_b.step_ms - one_f_one_b.agree_ms + 1e-9
    elif schedule is Schedule.GPIPE or m == 1:
        assert r.step_ms - r.agree_ms == pytest.approx(ideal)
    else:
        assert r.step_ms - r.agree_ms >= ideal - 1e-9
    lists = stage_lists(schedule, s, m)
    for i in range(s):  # a transfer bar for each SEND token of the stage's lowered list, where its compute ended
        ends: dict[tuple[EventKind, int], float] = {}  # ZB-H1: a backward's first part (I) sends, not its W
        for bar in sorted(r.intervals, key=lambda x: -x.end_ms):
            if bar.device == f"d{i}":
                ends[(bar.kind, bar.microbatch)] = bar.end_ms
        sends = sorted((bar.start_ms, bar.microbatch) for bar in r.intervals
                       if bar.device == f"d{i}" and bar.kind is EventKind.SEND)
        tokens = [a for a in lists[i] if a.kind is ActionKind.SEND]
        assert len(sends) == len(tokens) == (2 * m if 0 < i < s - 1 else m)
        for a in tokens:
            kind = EventKind.FORWARD if a.stages[1] > i else EventKind.BACKWARD
            assert (ends[(kind, a.microbatch)], a.microbatch) in sends


@pytest.mark.parametrize("param_bytes", [100_000, 4 << 20])
def test_a_small_all_reduce_issued_with_its_meeting_is_priced_as_the_longer_of_the_two(param_bytes: int) -> None:
    """Two CPU ranks of one host, ZeRO-0, the first of two stages (the loss agreement has its own all-reduce):
    below the shared mapping's threshold the runtime issues gloo's all-reduce with the meeting's, so the sync
    takes the longer of the two, not their sum; at or above it, the mapping's barrier comes first and the
    transfer after (the sum)."""
    from hpml_compile.cluster import link_spec
    from hpml_compile.memory import SHM_DIRECT_BYTES
    from hpml_compile.simulate import issued_with_meeting_ms, stage_costs
    from hpml_compile.stagecost import meet_ms, transfer_ms
    import cost_models

    g = _streaming(chain_profile([(2.0, 4.0), (1.0, 1.0)], param_bytes=param_bytes), one=1e9, host=2e9)
    c = Cluster(devices=(Device("d0", "cpu", 8), Device("d1", "cpu", 8), Device("d2", "cpu", 8)),
                links=(Link("d0", "d1", 0.5, 300.0), Link("d0", "d2", 0.5, 300.0), Link("d1", "d2", 0.5, 300.0)))
    plan = _plan(g, c, [(("d0", "d1"), ["n0"]), (("d2",), ["n1"])], 1, Schedule.GPIPE)
    link = link_spec(c, "d0", "d1")
    cst = stage_costs(plan, g)[0]
    transfer = transfer_ms(cost_models.allreduce_ms, param_bytes, link, 2)
    small = param_bytes < SHM_DIRECT_BYTES
    assert cst.together_ms == pytest.approx(transfer if small else 0.0) and cst.ride_in_ms == 0.0
    assert issued_with_meeting_ms(plan, plan.stages[0], param_bytes, link) == cst.together_ms
    bar = next(b for b in simulate(plan, g).intervals if b.kind is EventKind.SYNC and b.device == "d0")
    saved = min(meet_ms(2, link), transfer) if small else 0.0
    assert bar.end_ms - bar.start_ms == pytest.approx(cst.sync_ms - saved, rel=1e-6)
    assert saved < cst.sync_ms


@pytest.mark.parametrize("param_bytes", [100_000, 400_000])
def test_small_gradients_and_the_riding_agreement_are_priced_as_one_float64_all_reduce(param_bytes: int) -> None:
    """Plain data parallelism on two CPU ranks of one host: where the gradients and the agreement's four sums
    come to at most ``RIDE_IN_BYTES`` in float64, the runtime sums them as one float64 all-reduce without a
    meeting, and the sync is priced as that collective; above it, the meeting issued with the transfer."""
    from hpml_compile.cluster import link_spec
    from hpml_compile.memory import RIDE_IN_BYTES
    from hpml_compile.simulate import ride_in_ms, stage_costs
    from hpml_compile.stagecost import meet_ms, transfer_ms
    import cost_models

    g = _streaming(chain_profile([(2.0, 4.0)], param_bytes=param_bytes), one=1e9, host=2e9)
    c = Cluster(devices=(Device("d0", "cpu", 8), Device("d1", "cpu", 8)), links=(Link("d0", "d1", 0.5, 300.0),))
    plan = _plan(g, c, [(("d0", "d1"), ["n0"])], 1, Schedule.GPIPE)
    link = link_spec(c, "d0", "d1")
    cst = stage_costs(plan, g)[0]
    fused = (param_bytes // 4 + 4) * 8  # float32 parameters
    rides = fused <= RIDE_IN_BYTES
    assert rides == (param_bytes == 100_000)
    one = transfer_ms(cost_models.allreduce_ms, fused, link, 2)
    assert cst.ride_in_ms == pytest.approx(one if rides else 0.0)
    assert ride_in_ms(plan, plan.stages[0], param_bytes, "float32", link) == cst.ride_in_ms
    bar = next(b for b in simulate(plan, g).intervals if b.kind is EventKind.SYNC and b.device == "d0")
    want = one if rides else cst.sync_ms - min(meet_ms(2, link), cst.together_ms)
    assert bar.end_ms - bar.start_ms == pytest.approx(want, rel=1e-6)
