"""Inference plans: the placement's choices on cases with a known answer, memory respected, the JSON
round trip, and a training plan and an inference plan each refused by the other's loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import cost_models

from hpml_compile.cluster import load_cluster
from hpml_compile.errors import InfeasibleError, SchemaError
from hpml_compile.infer import DecoderShape, InferencePlan, Workload, load_inference_plan, place, score
from hpml_compile.infer.place import stages_for
from hpml_compile.ir import Cluster, Device
from hpml_compile.models.gpt import PRESETS
from hpml_compile.plan import load_plan

LLAMA7 = DecoderShape.from_config(PRESETS["llama-7b"])
BF16 = dict(dtype="bfloat16")


def _cluster(*devs: tuple[str, str, float]) -> Cluster:
    return Cluster(devices=tuple(Device(n, k, g) for n, k, g in devs), name="test")


def test_a_slow_gpu_beside_a_fast_one_that_holds_the_model_is_left_idle_with_the_reason() -> None:
    cl = _cluster(("fast", "H100-80GB", 80), ("slow", "T4", 16))
    work = Workload(batch=1, prompt_len=128, new_tokens=128, **BF16)
    plan = place(LLAMA7, cl, work, objective="latency")
    alone = score(cl, LLAMA7, plan.workload, stages_for(cl, LLAMA7, plan.workload, [("fast", 0, 32, False)]))
    assert [s.device for s in plan.stages] == ["fast"]
    assert plan.predicted.total_ms == pytest.approx(alone.total_ms)
    (idle, why), = plan.idle
    assert idle == "slow" and "no more than" in why


def test_never_slower_than_the_best_single_device_nor_a_memory_proportional_split() -> None:
    cl = _cluster(("a", "RTX-4090", 24), ("b", "T4", 16))
    work = Workload(batch=16, prompt_len=256, new_tokens=128, microbatches=2, **BF16)
    plan = place(LLAMA7, cl, work)
    single = score(cl, LLAMA7, plan.workload, stages_for(cl, LLAMA7, plan.workload, [("a", 0, 32, False)]))
    split = stages_for(cl, LLAMA7, plan.workload, [("a", 0, 19, False), ("b", 19, 32, False)])  # 24:16 by memory
    assert plan.predicted.tokens_per_s >= single.tokens_per_s * (1 - 1e-9)
    assert plan.predicted.tokens_per_s >= score(cl, LLAMA7, plan.workload, split).tokens_per_s * (1 - 1e-9)


# A server's CPU, not this machine's (measured at start-up): the placement must not depend on the test host.
SERVER_CPU = cost_models.DeviceSpec("cpu", "cpu", 512 * 2**30, 200e9, {"float32": 2e12}, 0.005, "gloo-loopback",
                                    None, source="a two-socket server, for the test")


def test_a_model_larger_than_the_gpu_spills_to_the_cpu_or_streams_and_every_stage_fits_its_memory() -> None:
    work = Workload(batch=16, prompt_len=512, new_tokens=256, **BF16)  # 13.5 GB of weights + 6.4 GB of cache
    cl = _cluster(("gpu0", "T4", 16), ("host", "cpu", 64))
    plan = place(LLAMA7, cl, work, explain_idle=False, specs={"cpu": SERVER_CPU})
    assert [s.device for s in plan.stages] == ["gpu0", "host"]  # the T4 is faster per block, so first
    alone = place(LLAMA7, _cluster(("gpu0", "T4", 16)), work)
    assert [s.stream for s in alone.stages] == [True]  # the weights cannot all stay: streamed from host memory
    assert plan.predicted.tokens_per_s > alone.predicted.tokens_per_s
    for p in (plan, alone):
        for s in p.stages:
            assert s.memory_bytes <= p.cluster.device(s.device).memory_bytes * 0.9


def test_a_cache_that_fits_nowhere_is_refused_naming_the_memory() -> None:
    cl = _cluster(("gpu0", "T4", 16))
    with pytest.raises(InfeasibleError, match=r"needs about .* GiB .* offers"):
        place(LLAMA7, cl, Workload(64, 2048, 2048, **BF16))  # its KV cache alone is 128 GiB


def test_a_latency_bound_is_met_or_refused_by_name() -> None:
    cl = load_cluster("hetero-4")
    work = Workload(batch=16, prompt_len=256, new_tokens=64, **BF16)
    free = place(LLAMA7, cl, work, explain_idle=False)
    bound = free.predicted.token_ms * 0.999
    try:
        bounded = place(LLAMA7, cl, work, latency_bound_ms=bound, explain_idle=False)
    except InfeasibleError as e:
        assert "per-token bound" in str(e)
    else:
        assert bounded.predicted.token_ms <= bound
    with pytest.raises(InfeasibleError, match="per-token bound of 0.001 ms"):
        place(LLAMA7, cl, work, latency_bound_ms=0.001, explain_idle=False)


def test_the_plan_round_trips_and_each_loader_refuses_the_other_kind(tmp_path: Path) -> None:
    plan = place(DecoderShape.from_config(PRESETS["gpt-mini"]), load_cluster("local-cpu-2"), Workload(4, 16, 16))
    assert InferencePlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    with pytest.raises(SchemaError, match="kind.*generate"):
        load_plan(path)
    d = plan.to_dict()
    d.pop("kind")
    path.write_text(json.dumps(d))
    with pytest.raises(SchemaError, match="kind.*training"):
        load_inference_plan(path)
    d = plan.to_dict()
    d["stages"][0]["blocks"] = [1, 3]
    path.write_text(json.dumps(d))
    with pytest.raises(SchemaError, match=r"stages\[0\]\.blocks"):
        load_inference_plan(path)


def test_a_replan_without_a_device_keeps_the_hosts_of_the_devices_left_and_so_their_links() -> None:
    from hpml_compile.cluster import dgx_pod, link_spec
    from hpml_compile.infer.place import replan_without

    cl = dgx_pod("A100-80GB", 80, 2, "nvlink3", "ib-hdr", "two", per_host=2)  # gpu0-1 on node0, gpu2-3 on node1
    plan = place(LLAMA7, cl, Workload(batch=4, prompt_len=128, new_tokens=32, **BF16), explain_idle=False)
    new = replan_without(plan, ["gpu1"])
    assert {d.name for d in new.cluster.devices} == {"gpu0", "gpu2", "gpu3"}
    assert new.cluster.hosts == cl.hosts  # both hosts still hold a device
    for a, b in (("gpu0", "gpu2"), ("gpu2", "gpu3")):
        assert link_spec(new.cluster, a, b) == link_spec(cl, a, b)
    only = replan_without(plan, ["gpu2", "gpu3"])
    assert [h.name for h in only.cluster.hosts] == ["node0"]  # a host without a device is not kept
    with pytest.raises(InfeasibleError, match="no device is left"):
        replan_without(plan, ["gpu0", "gpu1", "gpu2", "gpu3"])


def test_no_pipeline_that_fits_steps_faster_than_the_decode_floor() -> None:
    import random

    from hpml_compile.infer.place import MEMORY_FRACTION, decode_floor_ms

    llama70 = DecoderShape.from_config(PRESETS["llama-70b"])
    cl = load_cluster("hetero-4")
    work = Workload(batch=16, prompt_len=512, new_tokens=128, **BF16)
    floor = decode_floor_ms(llama70, cl, work)
    plan = place(llama70, cl, work, explain_idle=False)
    # the weights read once per step bound the plan's step closely: no plan can step 1.5x faster than it
    assert floor <= plan.predicted.token_ms < 1.5 * floor
    rng, tried = random.Random(0), 0
    names = [d.name for d in cl.devices]
    while tried < 40:
        devs = rng.sample(names, rng.randint(1, len(names)))
        cuts = sorted(rng.sample(range(1, llama70.n_layer), len(devs) - 1))
        bounds = [0, *cuts, llama70.n_layer]
        m = rng.choice([1, 2, 4, 8])
        w = Workload(16, 512, 128, microbatches=m, **BF16)
        ranges = [(d, a, b, rng.random() < 0.5 and not cl.device(d).is_cpu)
                  for d, a, b in zip(devs, bounds, bounds[1:])]
        stages = stages_for(cl, llama70, w, ranges)
        if any(s.memory_bytes > cl.device(s.device).memory_bytes * MEMORY_FRACTION for s in stages):
            continue  # not a plan: it does not fit
        tried += 1
        assert score(cl, llama70, w, stages).token_ms >= floor, ranges
