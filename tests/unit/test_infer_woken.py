"""A rank of a pipeline that idles while the other stages compute (one lane at batch 1) computes its next step
slower than one run back to back: the step timed after such a gap prices it, where the rank idles that long, and
a stage that its lanes keep busy is priced as before."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

import cost_models
from cost_models.roofline import OpKind, roofline_ms

from hpml_compile.infer import DecoderShape, Workload, score
from hpml_compile.infer.adapt import slowed_spec
from hpml_compile.infer.cost import block_flops_bytes, woken_extra_ms
from hpml_compile.infer.place import decode_compute_ms, stages_for
from hpml_compile.infer.timing import BlockTiming, _Idler, timed_spec
from hpml_compile.ir import Cluster, Device
from hpml_compile.models.gpt import PRESETS

MINI = DecoderShape.from_config(PRESETS["gpt-mini"])
LOCAL = Cluster(devices=(Device("cpu0", "cpu", 8), Device("cpu1", "cpu", 8)), name="one host")
RANGES = [("cpu0", 0, 3, False), ("cpu1", 3, 6, False)]


def _timing(rows: int, woken: tuple[tuple[float, float, float], ...]) -> BlockTiming:
    base = cost_models.get_device("cpu")
    work = Workload(rows, 32, 32)
    floor = roofline_ms(OpKind.MATMUL, *block_flops_bytes(MINI, work, decode=True), base, "float32")
    prefill = roofline_ms(OpKind.MATMUL, *block_flops_bytes(MINI, work, decode=False), base, "float32") + 0.5
    decode = floor + 0.5
    return BlockTiming(prefill_ms=prefill, decode_ms=decode, step_ms=0.3, rows=rows, prompt_len=32, new_tokens=32,
                       threads=1, handoff_us=5.0, handoff_gbps=4.0, llc_bytes=2**30,
                       decode_idle=tuple((gap, decode + blk, 0.3 + out) for gap, blk, out in woken))


def test_a_step_woken_from_a_wait_is_priced_at_the_step_timed_after_such_a_gap_where_the_rank_idles() -> None:
    base = cost_models.get_device("cpu")
    woken = ((0.2, 0.05, 0.02), (1.0, 0.3, 0.2))  # per block and outside the blocks, more than back to back
    t = _timing(1, woken)
    assert BlockTiming.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert BlockTiming.from_dict({k: v for k, v in t.to_dict().items() if k != "decode_idle"}).decode_idle == ()
    spec, warm = timed_spec(base, MINI, t), timed_spec(base, MINI, replace(t, decode_idle=()))
    one = Workload(1, 32, 32)
    assert woken_extra_ms(spec, MINI, one, 1, 0.2) == pytest.approx(0.05 + 0.02, abs=0.01)
    assert woken_extra_ms(spec, MINI, one, 3, 5.0) == pytest.approx(3 * 0.3 + 0.2, abs=0.02)  # past the last gap
    assert woken_extra_ms(warm, MINI, one, 3, 5.0) == 0.0  # not timed: priced as back to back
    # a device measured twice as slow while serving wakes twice as slow too
    assert woken_extra_ms(slowed_spec(spec, 2.0), MINI, one, 3, 5.0) == pytest.approx(
        2 * woken_extra_ms(spec, MINI, one, 3, 5.0))
    # one lane: each rank idles while the other computes (over 1 ms here), and its next step costs the woken price
    stages = stages_for(LOCAL, MINI, one, RANGES, {"cpu": spec})
    compute = decode_compute_ms(LOCAL, MINI, one, stages, specs={"cpu": spec})
    for s, c in zip(stages, compute):
        assert c == pytest.approx(s.decode_ms + 3 * 0.3 + 0.2, abs=0.02), (s, c)
    with_woken, hot = (score(LOCAL, MINI, one, stages_for(LOCAL, MINI, one, RANGES, {"cpu": x}), specs={"cpu": x})
                       for x in (spec, warm))
    assert with_woken.token_ms == pytest.approx(hot.token_ms + sum(compute) - sum(s.decode_ms for s in stages))
    # two lanes of four rows on balanced stages: the ranks take turns and barely wait, so barely a change
    two = Workload(8, 32, 32, microbatches=2)
    t2 = _timing(4, woken)
    busy, busy_hot = (score(LOCAL, MINI, two, stages_for(LOCAL, MINI, two, RANGES, {"cpu": x}), specs={"cpu": x})
                      for x in (timed_spec(base, MINI, t2), timed_spec(base, MINI, replace(t2, decode_idle=()))))
    assert busy.token_ms == pytest.approx(busy_hot.token_ms, rel=0.05)
    assert with_woken.token_ms > hot.token_ms + 2.0  # each of the two ranks, woken once a step


def test_the_step_after_an_idle_gap_is_timed_without_the_gap_or_the_wake_up() -> None:
    with _Idler(lambda: time.sleep(1e-4)) as idler:  # a piece of the other stages' work
        t0 = time.perf_counter()
        ms = idler.after(50.0, lambda: None)
        waited = (time.perf_counter() - t0) * 1e3
    assert waited >= 50.0  # the thread standing for the other stages kept this one waiting for the gap
    assert 0 <= ms < 25.0, ms  # and the time is the step's alone
