"""A rank of a pipeline that idles while the other stages compute (one lane at batch 1) computes its next step
slower than one run back to back: the model's halves timed taking turns through the generator's pipes price it,
where the rank idles that long, and a stage that its lanes keep busy is priced as before."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import cost_models
from cost_models.roofline import OpKind, roofline_ms

from hpml_compile.errors import HandoffError
from hpml_compile.infer import DecoderShape, Workload, score
from hpml_compile.infer.adapt import slowed_spec
from hpml_compile.infer.cost import block_flops_bytes, block_ms, head_ms, woken_extra_ms
from hpml_compile.infer.handoff import busy_wait, ping_pong
from hpml_compile.infer.place import decode_compute_ms, stages_for
from hpml_compile.infer.timing import BlockTiming, timed_spec
from hpml_compile.ir import Cluster, Device
from hpml_compile.models.gpt import PRESETS

MINI = DecoderShape.from_config(PRESETS["gpt-mini"])
LOCAL = Cluster(devices=(Device("cpu0", "cpu", 8), Device("cpu1", "cpu", 8)), name="one host")
RANGES = [("cpu0", 0, 3, False), ("cpu1", 3, 6, False)]


def _timing(rows: int, more: tuple[tuple[float, float], ...] = ()) -> BlockTiming:
    """A timing of gpt-mini's 6 blocks whose two halves, taking turns, took ``more`` ms beyond their price back to
    back after ``idle`` ms idle, per ``(idle, more)``."""
    base = cost_models.get_device("cpu")
    work = Workload(rows, 32, 32)
    floor = roofline_ms(OpKind.MATMUL, *block_flops_bytes(MINI, work, decode=True), base, "float32")
    prefill = roofline_ms(OpKind.MATMUL, *block_flops_bytes(MINI, work, decode=False), base, "float32") + 0.5
    t = BlockTiming(prefill_ms=prefill, decode_ms=floor + 0.5, step_ms=0.3, rows=rows, prompt_len=32, new_tokens=32,
                    threads=1, handoff_us=5.0, handoff_gbps=4.0, llc_bytes=2**30)
    spec = timed_spec(base, MINI, t)
    warm = block_ms(spec, MINI, work, 6, decode=True) + head_ms(spec, MINI, work) + 2 * spec.step_ms
    return replace(t, decode_turns=tuple((idle, warm + m) for idle, m in more), turn_blocks=6 if more else 0)


def test_a_step_woken_from_a_wait_is_priced_from_the_halves_timed_taking_turns_where_the_rank_idles() -> None:
    base = cost_models.get_device("cpu")
    t = _timing(1, ((0.5, 1.2), (1.5, 2.4)))  # both halves' steps, beyond back to back, after each idle
    assert BlockTiming.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert BlockTiming.from_dict({k: v for k, v in t.to_dict().items() if k != "decode_turns"}).decode_turns == ()
    spec, warm = timed_spec(base, MINI, t), timed_spec(base, MINI, replace(t, decode_turns=(), turn_blocks=0))
    one = Workload(1, 32, 32)
    # a stage of half the blocks pays half of what the two halves took more; linear from a warm step at no idle
    assert woken_extra_ms(spec, MINI, one, 3, 0.5) == pytest.approx(0.6, abs=1e-6)
    assert woken_extra_ms(spec, MINI, one, 3, 0.25) == pytest.approx(0.3, abs=1e-6)
    assert woken_extra_ms(spec, MINI, one, 6, 5.0) == pytest.approx(2.4, abs=1e-6)  # past the last point
    assert woken_extra_ms(warm, MINI, one, 3, 5.0) == 0.0  # not timed: priced as back to back
    # a device measured twice as slow while serving wakes twice as slow too
    assert woken_extra_ms(slowed_spec(spec, 2.0), MINI, one, 3, 5.0) == pytest.approx(
        2 * woken_extra_ms(spec, MINI, one, 3, 5.0))
    # one lane: each rank idles while the other computes (1.9-2.1 ms here, past the last point), and the plan's
    # two stages, woken, are priced at what the two halves took taking turns: no part of it charged twice
    stages = stages_for(LOCAL, MINI, one, RANGES, {"cpu": spec})
    hot = stages_for(LOCAL, MINI, one, RANGES, {"cpu": warm})
    compute = decode_compute_ms(LOCAL, MINI, one, stages, specs={"cpu": spec})
    assert sum(compute) == pytest.approx(sum(s.decode_ms for s in hot) + 2.4, abs=1e-6), compute
    assert t.decode_turns[-1][1] == pytest.approx(sum(s.decode_ms for s in hot) + 2.4, abs=1e-6)
    with_woken, unwoken = (score(LOCAL, MINI, one, stages_for(LOCAL, MINI, one, RANGES, {"cpu": x}), specs={"cpu": x})
                           for x in (spec, warm))
    assert with_woken.token_ms == pytest.approx(unwoken.token_ms + 2.4)
    # two lanes of four rows on balanced stages: the ranks take turns and barely wait, so barely a change
    two = Workload(8, 32, 32, microbatches=2)
    t2 = _timing(4, ((0.5, 1.2), (2.0, 2.4)))
    busy, busy_hot = (score(LOCAL, MINI, two, stages_for(LOCAL, MINI, two, RANGES, {"cpu": x}), specs={"cpu": x})
                      for x in (timed_spec(base, MINI, t2), timed_spec(base, MINI, replace(t2, turn_blocks=0))))
    assert busy.token_ms == pytest.approx(busy_hot.token_ms, rel=0.05)


def test_two_sides_take_turns_through_the_pipes_and_each_step_is_timed_without_the_wait() -> None:
    seen: list[float] = []

    def first(x: torch.Tensor) -> torch.Tensor:
        seen.append(float(x[0]))
        busy_wait(2000)
        return x + 1

    def second(y: torch.Tensor) -> torch.Tensor:
        busy_wait(5000)
        return y + 1

    a, b, whole = ping_pong(first, second, torch.zeros(1), 7, spin_ms=1.0)
    # each round's input is what the other side handed back: one more from each side
    assert seen[2:] == [2.0 * k for k in range(1, len(seen) - 1)], seen
    assert 2.0 <= a < b and b >= 5.0, (a, b)  # each side's own step, not its wait for the other
    assert whole >= a + b + 2 * 1.0, whole  # a round: both steps and both spins


def test_two_sides_taking_turns_report_the_failing_side() -> None:
    calls = []

    def second(y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) > 3:
            raise ValueError("the second side broke")
        return y

    with pytest.raises(HandoffError, match="the second side broke"):
        ping_pong(lambda x: x + 0, second, torch.zeros(2), 5, timeout_s=10)
    with pytest.raises(HandoffError, match=r"returns \(3,\)"):
        ping_pong(lambda x: x + 0, lambda y: torch.zeros(3), torch.zeros(2), 5, timeout_s=10)
