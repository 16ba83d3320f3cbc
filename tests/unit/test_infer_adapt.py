"""Re-planning a server around a slow device: the watch fires on a stage persistently slower than the others
relative to their predictions (not on a host slow for every stage, nor on one noisy batch), and a device
entered at its measured speed is given less of the model."""

from __future__ import annotations

import pytest

from hpml_compile.infer import DecoderShape, Workload, place
from hpml_compile.infer.adapt import AdaptOptions, SpeedWatch, expected_stage_ms, replan_on_speeds
from hpml_compile.ir import Cluster, Device
from hpml_compile.models.gpt import PRESETS

LLAMA7 = DecoderShape.from_config(PRESETS["llama-7b"])
TWO = Cluster(devices=(Device("gpu0", "A100-80GB", 80), Device("gpu1", "A100-80GB", 80)), name="two")
WORK = Workload(batch=16, prompt_len=256, new_tokens=64, dtype="bfloat16")


def test_the_watch_fires_on_a_persistently_slow_stage_only() -> None:
    w = SpeedWatch(AdaptOptions(threshold=1.5, patience=3, baseline=2))
    devs = ["gpu0", "gpu1"]
    for _ in range(2):  # the baseline: gpu1 usually runs 1.3x its share (a mispriced head, say)
        assert w.observe(devs, [10.0, 13.0], [10.0, 10.0]) == {}
    for _ in range(5):  # the whole host twice as slow, and gpu1 as usual: nothing to move
        assert w.observe(devs, [20.0, 26.0], [10.0, 10.0]) == {}
    assert w.observe(devs, [10.0, 80.0], [10.0, 10.0]) == {}  # one slow batch
    assert w.observe(devs, [10.0, 13.0], [10.0, 10.0]) == {}
    fired = [w.observe(devs, [10.0, 80.0], [10.0, 10.0]) for _ in range(3)]
    assert fired[:2] == [{}, {}] and fired[2] == {"gpu1": pytest.approx(8.0)}
    w.accept(fired[2])
    assert w.factors == {"gpu1": pytest.approx(8.0)}
    specs = w.specs(TWO)
    assert set(specs) == {"gpu1"} and specs["gpu1"].mem_bw == pytest.approx(2.0e12 / 8, rel=0.2)


def test_a_device_at_its_measured_speed_gets_less_of_the_model_and_its_stage_is_expected_slower() -> None:
    plan = place(LLAMA7, TWO, WORK, explain_idle=False, model="llama-7b")
    blocks = {s.device: s.end - s.first for s in plan.stages}
    assert set(blocks) == {"gpu0", "gpu1"}  # two equal GPUs share the model
    w = SpeedWatch(AdaptOptions(baseline=0))
    w.accept({"gpu1": 4.0})
    specs = w.specs(TWO)
    before = expected_stage_ms(plan, 16, 256, 64, plan.workload.microbatches)
    after = expected_stage_ms(plan, 16, 256, 64, plan.workload.microbatches, specs)
    k = [s.device for s in plan.stages].index("gpu1")
    assert after[k] == pytest.approx(4 * before[k], rel=0.01) and after[1 - k] == pytest.approx(before[1 - k])
    new, old = replan_on_speeds(plan, specs)
    assert sum(s.end - s.first for s in new.stages if s.device == "gpu1") < blocks["gpu1"]
    assert new.predicted.tokens_per_s > old.tokens_per_s  # on the measured speeds, the new plan is faster
    assert new.model == "llama-7b"


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold > 1"):
        AdaptOptions(threshold=1.0)
