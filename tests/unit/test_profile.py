"""profile: sizes, FLOPs, measured and predicted times, profile.json round trip and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from hpml_compile import load_profile, models, predict_kinds, profile, save_profile
from hpml_compile.errors import SchemaError, UnknownDeviceError
from hpml_compile.ir import BackwardTiming, NodeOp, Profile


@pytest.fixture(scope="module")
def tiny() -> Profile:
    m = models.load("gpt-tiny")
    return profile(m.module, m.example_inputs, name="gpt-tiny", device_kinds=("cpu", "A100-80GB", "H100-80GB"),
                   repeats=3, warmup=1, progress=False)


def test_linear_sizes_and_flops() -> None:
    b, i, o = 8, 32, 16
    p = profile(nn.Sequential(nn.Linear(i, o)), (torch.randn(b, i),), repeats=2, progress=False)
    n = p.node("_0")
    assert n.op_kind == "matmul"
    assert n.flops == 2 * b * i * o
    assert n.bwd_flops == 2 * n.flops  # grad of input and of weight
    assert n.param_bytes == (i * o + o) * 4
    assert n.output_bytes == b * o * 4
    assert n.activation_bytes == b * i * 4  # the saved input; the weight is not an activation
    assert n.params == ("0.weight", "0.bias")


def test_nodes_in_topological_order_with_known_inputs(tiny: Profile) -> None:
    seen: set[str] = set()
    for n in tiny.nodes:
        assert set(n.inputs) <= seen
        seen.add(n.name)
    assert tiny.nodes[0].op is NodeOp.PLACEHOLDER and tiny.nodes[-1].op is NodeOp.OUTPUT


def test_tied_parameters_counted_once(tiny: Profile) -> None:
    m = models.load("gpt-tiny")
    unique = sum(p.numel() * p.element_size() for p in m.module.parameters())
    assert sum(n.param_bytes for n in tiny.nodes) == unique
    users = [n.name for n in tiny.nodes if any(p.startswith("wte") for p in n.params)]
    assert len(users) >= 2, "embedding and LM head both list the tied weight"


def test_attention_flops_are_counted(tiny: Profile) -> None:
    attn = [n for n in tiny.nodes if n.op_kind == "attention"]
    assert attn and all(n.flops > 0 for n in attn)
    b, t, d = 4, 32, 64
    assert attn[0].flops == 4 * b * t * t * d  # QK^T and PV, 2 FLOPs per multiply-add


def test_measured_and_predicted_kinds(tiny: Profile) -> None:
    assert tiny.devices["cpu"]["measured"] is True
    assert tiny.devices["A100-80GB"]["measured"] is False
    assert tiny.backward_timing is BackwardTiming.PER_NODE
    fc = next(n for n in tiny.nodes if n.op_kind == "matmul")
    assert fc.cost["cpu"].measured and not fc.cost["A100-80GB"].measured
    assert fc.cost["cpu"].fwd_ms > 0 and fc.cost["cpu"].bwd_ms > 0
    assert tiny.total("H100-80GB").fwd_ms <= tiny.total("A100-80GB").fwd_ms


def test_predict_kinds_from_the_file_alone(tiny: Profile) -> None:
    more = predict_kinds(tiny, ["T4"])
    assert "T4" in more.device_kinds and not more.total("T4").measured
    # a T4 is never faster than an A100; gpt-tiny's ops are so small that both are host-bound (the eager per-op
    # cost, cost_models.EAGER_GPU_OP_MS), so here they are equal
    assert more.total("T4").fwd_ms >= tiny.total("A100-80GB").fwd_ms
    # the host's per-op work does not shrink with the rows: a quarter of the batch costs a host-bound op the same
    live = [n.cost["T4"] for n in more.nodes if n.cost["T4"].fwd_ms > 0]
    assert live and all(c.fwd_fixed_ms > 0 and c.at(0.25)[0] == pytest.approx(c.fwd_ms) for c in live)
    assert predict_kinds(tiny, ["cpu"]) is tiny


def test_meta_profile_predicts_everything() -> None:
    m = models.load("gpt2-small", device="meta")
    p = profile(m.module, m.example_inputs, name="gpt2-small", device_kinds=("A100-80GB",), progress=False)
    assert p.backward_timing is BackwardTiming.PREDICTED and not p.totals
    assert not p.total("A100-80GB").measured and p.total("A100-80GB").fwd_ms > 0
    assert sum(n.param_bytes for n in p.nodes) == pytest.approx(124.44e6 * 4, rel=0.01)


def test_profiling_leaves_buffers_alone() -> None:
    m = models.load("resnet-tiny")
    before = {k: v.clone() for k, v in m.module.state_dict().items()}
    profile(m.module, m.example_inputs, repeats=2, warmup=1, progress=False)
    for k, v in m.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_unknown_device_kind_is_named() -> None:
    with pytest.raises(UnknownDeviceError, match="'B300'.*A100-80GB"):
        profile(nn.Linear(2, 2), (torch.randn(1, 2),), device_kinds=("cpu", "B300"), progress=False)


def test_json_round_trip(tiny: Profile, tmp_path: Path) -> None:
    path = save_profile(tiny, tmp_path / "profile.json")
    again = load_profile(path)
    assert again == tiny
    data = json.loads(path.read_text())
    assert data["schema_version"] == 2 and data["backward_timing"] == "per_node"
    assert {"name", "op", "target", "inputs", "flops", "param_bytes", "output_bytes", "activation_bytes",
            "cost"} <= set(data["nodes"][1])


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("mutate", "field", "expected"), [
    (lambda d: d["nodes"][1]["cost"]["cpu"].__setitem__("fwd_ms", "fast"), "nodes[1].cost.cpu.fwd_ms", "a number"),
    (lambda d: d["nodes"][2].pop("flops"), "nodes[2].flops", "a required field"),
    (lambda d: d.__setitem__("dtype", "float12"), "dtype", "one of"),
    (lambda d: d.__setitem__("schema_version", 99), "schema_version", "this hpml-compile reads version 1 or 2"),
    (lambda d: d["nodes"][3]["inputs"].append("ghost"), "nodes[3].inputs", "an earlier node"),
])
def test_bad_file_names_the_field(tiny: Profile, tmp_path: Path, mutate, field: str, expected: str) -> None:
    data = tiny.to_dict()
    mutate(data)
    with pytest.raises(SchemaError) as err:
        load_profile(_write(tmp_path, data))
    assert field in str(err.value) and expected in str(err.value)


def test_not_json_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text("{nope")
    with pytest.raises(SchemaError, match="valid JSON"):
        load_profile(tmp_path / "x.json")
    with pytest.raises(SchemaError, match="no such file"):
        load_profile(tmp_path / "missing.json")


def test_hf_bert_traces_and_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = models.load("hf:bert?num_hidden_layers=2,hidden_size=64,num_attention_heads=2,intermediate_size=128",
                    batch_size=2, seq_len=16)
    p = profile(m.module, m.example_inputs, name="bert", repeats=2, warmup=1, progress=False)
    assert sum(n.flops for n in p.nodes) > 0 and p.total("cpu").fwd_ms > 0
    assert any(n.op_kind == "matmul" for n in p.nodes)


def test_hf_gpt2_traces_and_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = models.load("hf:gpt2?n_layer=2,n_embd=64,n_head=2", batch_size=2, seq_len=16)
    p = profile(m.module, m.example_inputs, name="gpt2", device_kinds=("cpu", "L4"), repeats=2, warmup=1,
                progress=False)
    assert p.front_end.value == "export"
    assert p.total("cpu").bwd_ms > 0 and p.total("L4").fwd_ms > 0


@pytest.mark.slow
def test_per_node_times_add_up_to_the_whole_model() -> None:
    """gpt-mini, batch 8, seq 128 on the CPU: sums of per-node times within 0.7-1.43x of whole-model times.

    (It was gpt2-small until the suite outgrew its 20 minutes: the same check, a minute of the suite's time.)

    Per-node and whole-model times are taken seconds apart; on a shared machine another job can slow one of
    them, so a miss is measured again, up to three times, before failing. A fresh-clone CI run read 0.744 and
    then 1.265 for the forward with the suite's other processes beside it (the bound was 0.75-1.25 and two
    tries); a per-node timing that was off by itself (a node timed twice, or not at all) reads 2x or 0.5x.
    """
    m = models.load("gpt-mini", batch_size=8, seq_len=128)
    lo, hi = 0.7, 1 / 0.7
    ratios = []
    for _ in range(3):
        p = profile(m.module, m.example_inputs, name="gpt-mini", repeats=3, warmup=1, progress=False,
                    micro_batch=0, optimizer=None)
        scale = p.devices["cpu"]["scaled_to_whole"]  # whole / sum of the raw per-node times
        ratios.append((1 / scale["fwd"], 1 / scale["bwd"]))
        if all(lo <= r <= hi for r in ratios[-1]):
            break
    fwd, bwd = ratios[-1]
    assert lo <= fwd <= hi, f"forward per-node/whole ratios {ratios}"
    assert lo <= bwd <= hi, f"backward per-node/whole ratios {ratios}"


def test_a_measured_kind_missing_from_the_catalog_does_not_block_predictions(tiny: Profile) -> None:
    """A GPU the catalog does not know (e.g. an H100 PCIe) is measured under its own name; others still predict."""
    from hpml_compile.ir import NodeCost, ProfileNode

    odd = "NVIDIA Foo 96GB"
    nodes = tuple(ProfileNode(**{**{f: getattr(n, f) for f in ProfileNode.__slots__},
                                 "cost": {**n.cost, odd: NodeCost(n.cost["cpu"].fwd_ms / 10, n.cost["cpu"].bwd_ms / 10,
                                                                  True)}}) for n in tiny.nodes)
    p = Profile(**{**{f: getattr(tiny, f) for f in Profile.__slots__}, "nodes": nodes,
                   "devices": {**tiny.devices, odd: {"measured": True}}})
    more = predict_kinds(p, ["L4"])
    assert more.total("L4").fwd_ms > 0 and "cpu calibration" in more.devices["L4"]["predicted_from"]


def test_fixed_parts_loss_and_optimizer_are_measured() -> None:
    m = models.load("mlp-tiny", batch_size=16)
    p = profile(m.module, m.example_inputs, name="mlp-tiny", repeats=3, warmup=1, progress=False,
                loss_fn=m.loss_fn, targets=m.example_targets)
    assert p.micro_batch == 2 and p.loss and p.optimizer == "adamw"
    assert p.optimizer_ms["cpu"] > 0
    # and the step over the same bytes as one flat tensor, as a ZeRO shard is stepped: without the per-tensor
    # work, which is most of a tiny model's step (the demo's ZeRO-1 step was priced 3x too long)
    flat = p.devices["cpu"]["optimizer_flat_ms"]
    assert 0 < flat < p.optimizer_ms["cpu"]
    from hpml_compile.costgraph import build

    g = build(p)
    assert g.optimizer_ms_per_byte("cpu", True) == pytest.approx(flat / sum(p.parameters.values()))
    assert g.optimizer_ms_per_byte("cpu") == pytest.approx(p.optimizer_ms["cpu"] / sum(p.parameters.values()))
    assert p.parameters and sum(p.parameters.values()) == sum(n.param_bytes for n in p.nodes)
    live = [n.cost["cpu"] for n in p.nodes if n.op not in (NodeOp.PLACEHOLDER, NodeOp.OUTPUT)]
    assert all(0 <= c.fwd_fixed_ms <= c.fwd_ms and 0 <= c.bwd_fixed_ms <= c.bwd_ms for c in live)
    # tiny layers are all overhead: most of their time does not shrink with the rows
    assert sum(c.fwd_fixed_ms for c in live) > 0.2 * sum(c.fwd_ms for c in live)
    out = p.nodes[-1].cost["cpu"]
    assert p.nodes[-1].op is NodeOp.OUTPUT and out.fwd_ms > 0 and out.bwd_ms > 0  # the loss
    scale = p.devices["cpu"]["scaled_to_whole"]
    model_sum = sum(c.fwd_ms for c in live)
    assert model_sum == pytest.approx(p.totals["cpu"].fwd_ms, rel=1e-6) and scale["fwd"] > 0


def test_scaling_without_micro_batch_loss_or_optimizer() -> None:
    m = models.load("mlp-tiny", batch_size=16)
    p = profile(m.module, m.example_inputs, repeats=2, warmup=1, progress=False, micro_batch=0, optimizer=None)
    assert p.micro_batch is None and p.loss is None and p.optimizer is None and not p.optimizer_ms
    assert all(c.fwd_fixed_ms == 0 and c.bwd_fixed_ms == 0 for n in p.nodes for c in n.cost.values())
    assert p.nodes[-1].cost["cpu"].fwd_ms == 0
    with pytest.raises(Exception, match="unknown optimizer"):
        profile(m.module, m.example_inputs, repeats=1, warmup=0, progress=False, optimizer="lion")


def test_predicted_kinds_get_an_optimizer_time(tiny: Profile) -> None:
    measured = tiny.optimizer_ms["cpu"]
    assert measured > 0 and tiny.optimizer_ms["H100-80GB"] > 0
    assert tiny.optimizer_ms["H100-80GB"] < measured  # faster memory: the same passes take less time


def test_version_1_file_still_loads(tiny: Profile, tmp_path: Path) -> None:
    data = tiny.to_dict()
    data["schema_version"] = 1
    for key in ("micro_batch", "loss", "optimizer", "optimizer_ms", "parameters"):
        data.pop(key)
    for n in data["nodes"]:
        for c in n["cost"].values():
            c.pop("fwd_fixed_ms"), c.pop("bwd_fixed_ms")
    p = load_profile(_write(tmp_path, data))
    assert p.micro_batch is None and not p.optimizer_ms
    assert all(c.fwd_fixed_ms == 0 for n in p.nodes for c in n.cost.values())


def test_segments_find_the_identical_blocks_of_a_transformer() -> None:
    from hpml_compile.profile.static import segments
    from hpml_compile.trace import trace

    m = models.load("gpt-mini")
    segs = segments(trace(m.module, m.example_inputs))
    blocks = [s for s in segs if s.block is not None]
    assert [s.block for s in blocks] == [f"layers.{i}" for i in range(6)]
    assert len({s.signature for s in blocks}) == 1  # the six layers: same modules, same shapes
    assert len({s.signature for s in segs}) == len(segs) - 5  # the regions around them are unlike
    names = [n for s in segs for n in s.nodes]
    assert len(names) == len(set(names))  # contiguous, each node once


def test_identical_blocks_get_one_cost_and_the_host_is_recorded(tiny: Profile) -> None:
    by_layer: dict[str, list[tuple[float, float]]] = {}
    for n in tiny.nodes:
        parts = n.scope.split(".")
        if len(parts) >= 2 and parts[1].isdigit():
            c = n.cost["cpu"]
            by_layer.setdefault(parts[1], []).append((c.fwd_ms, c.bwd_ms))
    assert len(by_layer) >= 2
    first = next(iter(by_layer.values()))
    assert all(costs == first for costs in by_layer.values())  # node by node, the layers cost the same
    cpu = tiny.devices["cpu"]
    assert cpu["segments"] >= 3 and cpu["identical_blocks"] == len(by_layer)
    assert cpu["cpu_model"] and cpu["cpus"] >= 1 and cpu["stream_gbps"] > 0
    assert any(level.startswith("L") for level in cpu["cache_bytes"])
    # the nodes add up to the blocks timed in sequence
    live = sum(n.cost["cpu"].fwd_ms for n in tiny.nodes if n.op is not NodeOp.OUTPUT)
    assert live == pytest.approx(tiny.totals["cpu"].fwd_ms, rel=1e-6)


def test_time_segments_runs_the_blocks_in_sequence_and_leaves_the_model_alone() -> None:
    from hpml_compile.profile.static import segments
    from hpml_compile.profile.timing import time_segments
    from hpml_compile.trace import trace

    m = models.load("gpt-tiny")
    gm = trace(m.module, m.example_inputs)
    segs = segments(gm)
    grads = {name: p.grad for name, p in gm.named_parameters()}
    samples = time_segments(gm, m.example_inputs, [s.nodes for s in segs], passes=2, warmup=1)
    assert len(samples) == len(segs) and all(len(f) == len(b) == 2 for f, b in samples)
    assert all(x > 0 for f, _ in samples for x in f)
    # every block with parameters runs a backward; the user's gradients are put back
    assert all(x > 0 for s, (_, b) in zip(segs, samples) if s.block is not None for x in b)
    assert all(p.grad is grads[name] for name, p in gm.named_parameters())


def test_the_blocks_are_timed_beside_busy_cores_and_no_process_is_left(tiny: Profile, tmp_path: Path) -> None:
    """CPU ranks of a host compute at once and share its cache and bandwidth, which a
    profile timing the blocks alone does not see. Asked to (``corun=True``), the profile times them again while
    forked processes run them on the other cores (each on its own copy of the parameters) and records the
    slow-down, and the optimizer step's beside their steps, which the cost graph carries to the simulator; every
    neighbour is gone afterwards."""
    import os

    import psutil

    from hpml_compile.costgraph import build
    from hpml_compile.profile.static import segments
    from hpml_compile.profile.optcorun import time_optimizer_corun
    from hpml_compile.profile.corun import QUIET_OTHERS, time_corun
    from hpml_compile.trace import trace

    assert "corun" not in tiny.devices["cpu"] and build(tiny).corun("cpu") is None  # asked for only
    others = {c.pid for c in psutil.Process().children(recursive=True)}  # others' (a forkserver of earlier tests)
    m = models.load("gpt-tiny")
    p = profile(m.module, m.example_inputs, name="gpt-tiny", repeats=3, warmup=1, progress=False, corun=True)
    cpus = len(os.sched_getaffinity(0))
    c = p.devices["cpu"]["corun"]
    o = p.devices["cpu"]["optimizer_corun"]  # the optimizer step beside the neighbours' steps too
    if cpus < 2:
        assert c == {"skipped": "one CPU"} and o == {"skipped": "one CPU"}
        return
    assert o["ranks"] == c["ranks"] and 0.5 < o["ratio"] < 10 and len(o["rounds"]) == 3 and o["clock"] == "cpu"
    assert build(p).optimizer_corun("cpu") == (o["ratio"], o["ranks"])
    assert load_profile(save_profile(p, tmp_path / "p.json")).devices["cpu"]["optimizer_corun"] == o  # schema
    assert c["ranks"] == min(cpus, 4) and 0.5 < c["fwd"] < 10 and 0.5 < c["bwd"] < 10 and len(c["rounds"]) == 5
    assert 0 <= c.get("others", 0.0) <= cpus  # other programs counted: the wall clock kept on a quiet host only
    assert c["clock"] == ("wall" if c.get("others", 1.0) < QUIET_OTHERS else "cpu")
    assert [c["fwd"], c["bwd"]] == c[c["clock"]] and len(c["wall"]) == len(c["cpu"]) == 2
    assert build(p).corun("cpu") == (c["fwd"], c["bwd"], c["ranks"])
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= others  # no neighbour left
    gm = trace(m.module, m.example_inputs)
    groups = [list(s.nodes) for s in segments(gm)]
    before = {n: p.detach().clone() for n, p in gm.named_parameters()}
    assert time_corun(gm, m.example_inputs, groups, neighbours=0) == {"skipped": "no other core"}
    # neighbours that cannot start in time (a timeout of nothing): reported, and killed
    slow = time_corun(gm, m.example_inputs, groups, neighbours=1, start_timeout_s=1e-9)
    assert slow["skipped"].startswith("a neighbour process did not start")
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= others  # no neighbour left
    assert all(torch.equal(p, before[n]) for n, p in gm.named_parameters())  # the model is left alone
    params = list(gm.parameters())
    assert time_optimizer_corun(params, neighbours=0) == {"skipped": "no other core"}
    late = time_optimizer_corun(params, neighbours=1, start_timeout_s=1e-9)
    assert late["skipped"].startswith("a neighbour process did not start")
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= others
    assert all(torch.equal(p, before[n]) for n, p in gm.named_parameters())  # stepped on copies


def test_a_scale_outside_the_expected_range_is_measured_again_then_believed(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """A whole-pass factor outside the range seen here was dropped; now it is re-measured, kept, said."""
    import importlib

    prof_mod = importlib.import_module("hpml_compile.profile")  # the package: hpml_compile.profile is the function

    monkeypatch.setattr(prof_mod, "_SCALE_RANGE", (1e6, 2e6))  # every real measurement falls outside
    m = models.load("mlp-tiny", batch_size=16)
    with pytest.warns(UserWarning, match="believed"):
        p = profile(m.module, m.example_inputs, repeats=2, warmup=1, progress=False, micro_batch=0, optimizer=None)
    cpu = p.devices["cpu"]
    assert cpu["remeasured"] >= 1 and "believed" in cpu["scale_note"]
    live = [n.cost["cpu"] for n in p.nodes if n.op is not NodeOp.OUTPUT]
    assert sum(c.fwd_ms for c in live) == pytest.approx(p.totals["cpu"].fwd_ms, rel=1e-6)  # scaled, not dropped
    assert sum(c.bwd_ms for c in live) == pytest.approx(p.totals["cpu"].bwd_ms, rel=1e-6)
    assert load_profile(save_profile(p, tmp_path / "p.json")).devices["cpu"]["scale_note"] == cpu["scale_note"]


def _others_cpu_seconds() -> float:
    """CPU seconds (user + system) every process but this one and its children has used since boot.

    From the machine's own total in ``/proc/stat``, not a sum over ``/proc/<pid>``: a process that exits
    between two readings takes its ticks out of such a sum, which then goes down (a busy machine read as quiet).
    """
    import os

    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = sum(fields[:3]) + sum(fields[5:7])  # user, nice, system, irq, softirq (not idle, iowait, steal)
    own = sum(os.times()[:4])  # this process and the children it waited for (a profile run by the test)
    return busy / os.sysconf("SC_CLK_TCK") - own


# One profile of gpt-mini in a fresh interpreter, as `hpml-compile profile` runs, and the data-parallel step on two
# CPU ranks it predicts (printed as the last line).
_PROFILE_ONCE = """
from hpml_compile import models, profile
from hpml_compile.cluster import load_cluster
from hpml_compile.costgraph import build
from hpml_compile.plan import Plan, Schedule, Stage
from hpml_compile.simulate import annotate

m = models.load("gpt-mini", seed=0)
p = profile(m.module, m.example_inputs, name="gpt-mini", repeats=5, warmup=2, progress=False,
            loss_fn=m.loss_fn, targets=m.example_targets, micro_batch=0, threads=1)
graph = build(p)
coarse = graph.coarsen()
every = tuple(n for v in coarse.order for n in coarse.node(v).members)
plan = Plan("gpt-mini", load_cluster("local-cpu-2"), Schedule.GPIPE, 1, (Stage(0, ("cpu0", "cpu1"), every),))
whole = p.totals["cpu"]
print(annotate(plan, graph)[0].predicted.step_ms, whole.fwd_ms + whole.bwd_ms + p.optimizer_ms["cpu"])
"""


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_profiles_of_gpt_mini_predict_the_same_data_parallel_step() -> None:
    """Profiles of one model on one machine, taken one after the other, must agree on a plan.

    Before the blocks were timed in sequence, gpt-mini data parallel on 2 ranks was predicted 317 ms by one
    profile and 246.6 ms by another (measured 316-322 ms). Each profile runs in a fresh interpreter, as a
    user's `hpml-compile profile` does: profiled inside the test process after a thousand other tests, the
    same model's step varied by 20% on a quiet machine (373-470 ms; a fresh process: 318-334 ms). A profile
    measures the machine of its minute: only profiles during which other processes left the CPUs alone
    (under 0.25 CPU-seconds per second, the prediction benchmark's bar) are compared, up to six profiles
    until two in a row agree; on a machine that never is quiet, the test is skipped with what it saw.

    The VM's own speed moves with nothing else of ours running (quiet: fresh profiles predicted
    357-420 ms within minutes, older code alike, and every part of a profile moved with
    it: the whole model's forward 205-249 ms, backward 406-475 ms, the optimizer step 22.7-27.3 ms). So
    each profile's prediction is compared relative to that profile's own measured whole step (the
    whole-model forward and backward and the optimizer step, timed in the same minute): what must agree
    is what the profile makes of its measurements (segments, identical blocks, the microbatch's fixed
    parts), not the machine's minute. Those ratios spread 0.541-0.554 where the raw predictions spread 16%.
    The prediction also carries the host probe's means of the loss agreement and of the meeting before the
    gradient sync, timed in the same minute (means of heavy-tailed waits, as a step pays them), which move
    more from one profile to the next than its medians did: two quiet profiles of a fresh clone gave
    0.563 and 0.602. They must agree within 8%.
    """
    import os
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    quiet: list[float] = []  # predicted data-parallel step / the profile's own measured whole step
    seen: list[tuple[float, float, float]] = []
    for _ in range(6):
        before, t0 = _others_cpu_seconds(), time.perf_counter()
        done = subprocess.run([sys.executable, "-c", _PROFILE_ONCE], capture_output=True, text=True, env=env,
                              timeout=600)
        busy = (_others_cpu_seconds() - before) / (time.perf_counter() - t0)
        assert done.returncode == 0, done.stderr[-3000:]
        step, whole = (float(v) for v in done.stdout.split()[-2:])
        seen.append((round(step, 1), round(whole, 1), round(busy, 2)))
        if busy <= 0.25:
            quiet.append(step / whole)
        if len(quiet) >= 2 and abs(quiet[-1] - quiet[-2]) <= 0.08 * min(quiet[-2:]):
            break  # a pair in a row agrees; else a burst of load may have hit one of them: one more
    if len(quiet) < 2:
        pytest.skip(f"the machine was busy: (predicted ms, whole step ms, other processes' CPUs) per profile {seen}")
    print(f"data-parallel step predicted, the profile's whole step (ms), other processes' CPUs: {seen}")
    assert abs(quiet[-1] - quiet[-2]) <= 0.08 * min(quiet[-2:]), \
        f"predicted data-parallel step / the profile's whole step: {[round(q, 3) for q in quiet]} ({seen})"
