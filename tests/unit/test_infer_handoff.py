"""The generator's hand-offs through pipes: a message larger than the pipe is queued and written while the rank
waits to read, a neighbour's exit is seen as an error at once, the hand-off time measured here prices the sends
of a plan whose CPUs share this host (the cluster's link prices others), and a stage of a pipeline is priced with
its weights out of the caches, and a rank that waits while the others compute is priced to wake at the hand-off
timed after such a wait."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

import cost_models
from cost_models.comm import p2p_ms
from cost_models.roofline import OpKind, roofline_ms

from hpml_compile.cluster import link_spec
from hpml_compile.infer import DecoderShape, Workload, score
from hpml_compile.infer.cost import (TimedCpuSpec, block_flops_bytes, block_ms, cold_head_ms, handoff_ms, head_ms,
                                     wake_us)
from hpml_compile.infer.handoff import HandoffError, PipeLink, measure_handoff, pipe_ring
from hpml_compile.infer.place import stages_for
from hpml_compile.infer.timing import BlockTiming, last_level_cache_bytes, timed_spec
from hpml_compile.ir import Cluster, Device
from hpml_compile.models.gpt import PRESETS

MINI = DecoderShape.from_config(PRESETS["gpt-mini"])
WORK = Workload(batch=8, prompt_len=32, new_tokens=32, microbatches=2)


def test_a_message_larger_than_the_pipe_is_queued_and_written_while_the_rank_waits_to_read() -> None:
    (r, w), = pipe_ring(1)  # a ring of one: this rank writes to itself
    link = PipeLink(r, w, "itself / itself", timeout_s=10)
    big = torch.arange(3 * 2**20, dtype=torch.float32)  # 12 MiB: more than any pipe's buffer
    try:
        link.send(big)  # returns at once with most of it queued (a blocking write would never return here)
        assert link._out, "the rest of the message waits in the queue"
        got = torch.empty_like(big)
        link.recv(got)
        assert torch.equal(got, big)
        assert not link._out
    finally:
        link.close()


def test_a_neighbour_that_closed_its_end_fails_the_read_and_the_write_at_once_naming_it() -> None:
    r, w = os.pipe()
    link = PipeLink(r, w, "rank 1 / rank 2", timeout_s=30)
    os.close(w)  # the previous rank exited
    with pytest.raises(HandoffError, match="rank 1 closed its end"):
        link.recv(torch.empty(4))
    r2, w2 = os.pipe()
    link2 = PipeLink(r2, w2, "rank 1 / rank 2", timeout_s=30)
    os.close(r2)  # the next rank exited
    with pytest.raises(HandoffError, match="rank 2 closed its end"):
        link2.send(torch.zeros(4))
    for fd in (r, w2):
        os.close(fd)


def test_the_hand_off_is_measured_through_the_pipes_per_size_and_per_idle_time_of_the_receiver() -> None:
    rows, idle = measure_handoff((64, 1 << 20), repeats=3, idle_ms=(0.2, 50.0))
    assert [n for n, _ in rows] == [64, 1 << 20]
    assert all(0 < ms < 1000 for _, ms in rows)
    assert [ms for ms, _ in idle] == [0.2, 50.0]
    # each side computed 50 ms before it sent: that is left out, only the wake-up is counted (not 25 ms or more)
    assert all(0 <= ms < 25 for _, ms in idle), idle


def _spec(**kw: float) -> TimedCpuSpec:
    base = cost_models.get_device("cpu")
    return TimedCpuSpec(**{f: getattr(base, f) for f in base.__dataclass_fields__}, **kw)  # type: ignore[arg-type]


def test_sends_between_cpus_of_one_host_are_priced_at_the_measured_hand_off_and_others_at_the_link() -> None:
    spec = _spec(handoff_us=40.0, handoff_gbps=0.5)
    local = Cluster(devices=(Device("cpu0", "cpu", 8), Device("cpu1", "cpu", 8)), name="one host")
    apart = Cluster(devices=(Device("cpu0", "cpu", 8), Device("cpu1", "cpu", 8, host="node1")), name="two hosts")
    ranges = [("cpu0", 0, 3, False), ("cpu1", 3, 6, False)]
    hidden = WORK.rows * MINI.d_model * 4  # one lane's decode message, float32
    for cluster, send, back in [
        (local, 0.04 + hidden / 0.5e6, 0.04 + 8 * WORK.rows / 0.5e6),
        (apart, p2p_ms(hidden, link_spec(apart, "cpu0", "cpu1")),
         p2p_ms(8 * WORK.rows, link_spec(apart, "cpu1", "cpu0"))),
    ]:
        stages = stages_for(cluster, MINI, WORK, ranges, {"cpu": spec})
        pred = score(cluster, MINI, WORK, stages, specs={"cpu": spec})
        d0, d1 = stages[0].decode_ms, stages[1].decode_ms + send
        assert pred.token_ms == pytest.approx(max(WORK.microbatches * max(d0, d1), d0 + d1 + back)), cluster.name
    assert handoff_ms(replace(spec, handoff_gbps=0.0), hidden) is None  # not measured: the link prices it


def test_a_rank_that_waits_while_the_other_computes_is_priced_at_the_hand_off_timed_after_such_a_wait() -> None:
    local = Cluster(devices=(Device("cpu0", "cpu", 8), Device("cpu1", "cpu", 8)), name="one host")
    ranges = [("cpu0", 0, 3, False), ("cpu1", 3, 6, False)]
    hot = _spec(handoff_us=5.0, handoff_gbps=4.0)
    # waking after 0.05 ms costs what a hot hand-off does; after a stage's compute (well over 0.05 ms), 300 us
    woken = replace(hot, handoff_idle=((0.05, 5.0), (0.06, 300.0)))
    one = Workload(batch=1, prompt_len=32, new_tokens=32)
    step = {}
    for name, spec in (("hot", hot), ("woken", woken)):
        stages = stages_for(local, MINI, one, ranges, {"cpu": spec})
        step[name] = score(local, MINI, one, stages, specs={"cpu": spec}).token_ms
    # one lane: each step wakes rank 1 (the hidden states) and rank 0 (the token), each 295 us later than hot
    assert step["woken"] == pytest.approx(step["hot"] + 2 * 0.295)
    # two lanes of four: the ranks take turns and wait little, and a wake-up is dearer only after a longer wait
    quiet = replace(hot, handoff_idle=((0.1, 5.0), (0.2, 6.0), (0.5, 150.0), (1.0, 400.0)))
    for work, same in ((WORK, True), (one, False)):
        hot_ms, quiet_ms = (score(local, MINI, work, stages_for(local, MINI, work, ranges, {"cpu": spec}),
                                  specs={"cpu": spec}).token_ms for spec in (hot, quiet))
        assert (quiet_ms == hot_ms) is same, (work, hot_ms, quiet_ms)
    assert wake_us(woken, 0.0) == 5.0 and wake_us(woken, 0.055) == pytest.approx(152.5)
    assert wake_us(replace(woken, handoff_idle=((0.1, 80.0), (1.0, 40.0))), 5.0) == 80.0  # never faster for longer
    # a timing carries its idle points through the plan's JSON; one written before has none
    t = BlockTiming(prefill_ms=4.0, decode_ms=0.3, step_ms=0.5, rows=1, prompt_len=32, new_tokens=32, threads=1,
                    handoff_us=5.0, handoff_gbps=4.0, handoff_idle=((0.1, 5.0), (1.0, 90.0)))
    assert BlockTiming.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert timed_spec(cost_models.get_device("cpu"), MINI, t).handoff_idle == t.handoff_idle
    old = {k: v for k, v in t.to_dict().items() if k != "handoff_idle"}
    assert BlockTiming.from_dict(old).handoff_idle == ()


def test_a_stage_of_a_pipeline_is_priced_with_its_weights_out_of_the_cache_and_a_lone_stage_is_not() -> None:
    base = cost_models.get_device("cpu")
    work = Workload(4, 32, 32)
    flops, moved = block_flops_bytes(MINI, work, decode=True)
    floor = roofline_ms(OpKind.MATMUL, flops, moved, base, "float32")  # this host's catalog CPU: the fit's floor
    prefill = roofline_ms(OpKind.MATMUL, *block_flops_bytes(MINI, work, decode=False), base, "float32") + 0.5
    timing = BlockTiming(prefill_ms=prefill, decode_ms=floor + 0.2, step_ms=0.3, rows=4, prompt_len=32, new_tokens=32,
                         threads=1, decode_cold_ms=floor + 0.6, step_cold_ms=0.7, handoff_us=5.0, handoff_gbps=4.0)
    assert BlockTiming.from_dict(timing.to_dict()) == timing
    old = {k: v for k, v in timing.to_dict().items() if not k.startswith(("decode_cold", "step_cold", "handoff"))}
    assert BlockTiming.from_dict(old).decode_cold_ms == 0.0  # a plan written before: warm figures only
    spec = timed_spec(base, MINI, timing)
    warm, cold = (block_ms(spec, MINI, work, 1, decode=True, cold=c) for c in (False, True))
    assert warm == pytest.approx(timing.decode_ms, rel=0.01) and cold == pytest.approx(timing.decode_cold_ms, rel=0.01)
    assert cold_head_ms(spec, MINI, work) == pytest.approx(0.4)
    head = head_ms(spec, MINI, work)
    cl = Cluster(devices=(Device("cpu0", "cpu", 8), Device("cpu1", "cpu", 8)), name="one host")
    (alone,) = stages_for(cl, MINI, work, [("cpu0", 0, 6, False)], {"cpu": spec})
    first, last = stages_for(cl, MINI, work, [("cpu0", 0, 3, False), ("cpu1", 3, 6, False)], {"cpu": spec})
    assert alone.decode_ms == pytest.approx(6 * warm + head + spec.step_ms)
    assert first.decode_ms == pytest.approx(3 * cold + spec.step_ms)
    assert last.decode_ms == pytest.approx(3 * cold + head + 0.4 + spec.step_ms)
    two = replace(work, batch=8, microbatches=2)  # the same rows in two lanes: the second follows the first warm
    first, last = stages_for(cl, MINI, two, [("cpu0", 0, 3, False), ("cpu1", 3, 6, False)], {"cpu": spec})
    assert first.decode_ms == pytest.approx(3 * (warm + cold) / 2 + spec.step_ms)
    assert last.decode_ms == pytest.approx(3 * (warm + cold) / 2 + head + 0.4 / 2 + spec.step_ms)
    # a model whose decode working set fits the host's last-level cache stays warm in every stage
    roomy = timed_spec(base, MINI, replace(timing, llc_bytes=2**30))
    assert BlockTiming.from_dict(replace(timing, llc_bytes=2**30).to_dict()).llc_bytes == 2**30
    first, last = stages_for(cl, MINI, work, [("cpu0", 0, 3, False), ("cpu1", 3, 6, False)], {"cpu": roomy})
    warm = block_ms(roomy, MINI, work, 1, decode=True)
    assert first.decode_ms == pytest.approx(3 * warm + roomy.step_ms)
    assert last.decode_ms == pytest.approx(3 * warm + head_ms(roomy, MINI, work) + roomy.step_ms)
    tight = timed_spec(base, MINI, replace(timing, llc_bytes=2**20))  # 1 MiB: the model does not fit
    assert block_ms(tight, MINI, work, 1, decode=True, cold=True) == pytest.approx(timing.decode_cold_ms, rel=0.01)


def test_the_hosts_last_level_cache_is_read_where_the_host_reports_it() -> None:
    size = last_level_cache_bytes()
    if os.path.isdir("/sys/devices/system/cpu/cpu0/cache"):
        assert size >= 2**20  # every CPU of a machine that runs this has at least a MiB of last-level cache
    else:
        assert size == 0
