"""A CPU device's memory is its process's: the runtime's measured baseline, the rest of the model, the tensors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpml_compile import profile
from hpml_compile.cluster import load_cluster
from hpml_compile.costgraph import build
from hpml_compile.hostmem import MMAP_THRESHOLD
from hpml_compile.memory import HEAP_SLACK_BLOCKS, heap_slack_bytes, process_bytes
from hpml_compile.plan import Plan, Schedule, Stage, stage_breakdown
from hpml_compile.profile.process import BASELINE_CODE, cached, host_key, remember, this_host, with_process
from hpml_compile.simulate import simulate

MiB = 2**20


def _toy() -> tuple[Plan, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    prof = profile(model, (torch.randn(8, 64),), name="toy", repeats=1, warmup=0, progress=False)
    names = tuple(n.name for n in prof.nodes)
    plan = Plan("toy", load_cluster("local-cpu-2"), Schedule.ONE_F_ONE_B, 2,
                (Stage(0, ("cpu0",), names[:2]), Stage(1, ("cpu1",), names[2:])))
    return plan, prof


def test_each_cpu_device_counts_the_baseline_and_the_rest_of_the_model() -> None:
    plan, prof = _toy()
    base = 300 * MiB
    with_base = with_process(prof, {"bytes": base, "source": "a test"})
    total = sum(n.param_bytes for n in prof.nodes)
    plain, counted = simulate(plan, build(prof)), simulate(plan, build(with_base))
    largest = max(prof.parameters.values())
    for st in plan.stages:
        own = sum(n.param_bytes for n in prof.nodes if n.name in st.nodes)
        dev = st.devices[0]
        # the baseline, the rest of the model as built, AdamW's two temporaries of the largest parameter it steps, and
        # the heap's slack: two of that block again
        want = base + total - own + 2 * min(own, largest) + HEAP_SLACK_BLOCKS * min(own, largest)
        assert counted.peak[dev] - plain.peak[dev] == want == process_bytes(base, total, own, largest_param=largest)
        # the part-by-part breakdown (benchmarks/memory_truth) counts it alike, and apart from the tensors
        parts = stage_breakdown(plan, with_base, st, dev)
        assert parts.process == want and parts.tensors == stage_breakdown(plan, prof, st, dev).total


def test_a_rank_of_saved_weights_counts_only_its_own_stage_as_built() -> None:
    # with TrainSpec.weights each rank builds only its stage (runtime.execute.unallocated): the rest of the model
    # is not in its process, in the simulator and in the breakdown alike
    plan, prof = _toy()
    base = 300 * MiB
    whole, own_only = (with_process(prof, {"bytes": base, "source": "a test", **extra})
                       for extra in ({}, {"stage_only": True}))
    total = sum(n.param_bytes for n in prof.nodes)
    full, mine = simulate(plan, build(whole)), simulate(plan, build(own_only))
    for st in plan.stages:
        own = sum(n.param_bytes for n in prof.nodes if n.name in st.nodes)
        dev = st.devices[0]
        assert full.peak[dev] - mine.peak[dev] == total - own > 0
        assert stage_breakdown(plan, whole, st, dev).process - stage_breakdown(plan, own_only, st, dev).process \
            == total - own


def test_a_replicated_zero_stage_counts_the_whole_model_built_its_shared_memory_and_its_shards_step() -> None:
    p, base = 40 * MiB, 300 * MiB
    got = process_bytes(base, p, p, replicas=2, zero=1, largest_param=p)
    # the model as built, two shm slots, AdamW over the shard, the heap's slack of the shard
    assert got == base + p + 2 * p + 2 * (p // 2) + HEAP_SLACK_BLOCKS * (p // 2)
    big = 200 * MiB  # a gradient above one slot goes through the slots in pieces
    assert process_bytes(base, big, big, replicas=2, zero=0, largest_param=MiB) \
        == base + 2 * 64 * MiB + 2 * MiB + HEAP_SLACK_BLOCKS * MiB


def test_the_heap_slack_is_of_the_largest_block_a_step_allocates_again_and_at_most_the_mmap_threshold() -> None:
    p = 30 * MiB
    # ZeRO-2 frees and allocates its whole flat gradient buffer each step, ZeRO-1 only shards of it
    assert heap_slack_bytes(p, replicas=2, zero=2) == heap_slack_bytes(p, replicas=2, zero=3) == HEAP_SLACK_BLOCKS * p
    assert heap_slack_bytes(p, replicas=2, zero=1) == HEAP_SLACK_BLOCKS * (p // 2)
    # unsharded: AdamW's temporaries of the largest parameter (none given: the stage's)
    assert heap_slack_bytes(p, largest_param=4 * MiB) == HEAP_SLACK_BLOCKS * 4 * MiB
    assert heap_slack_bytes(p) == heap_slack_bytes(p, replicas=2, zero=0) == HEAP_SLACK_BLOCKS * p
    # a block above malloc's mmap threshold is mapped apart and returned when freed: it leaves no hole in the heap
    assert heap_slack_bytes(200 * MiB, replicas=2, zero=2) == HEAP_SLACK_BLOCKS * MMAP_THRESHOLD
    # numpy arrays of candidates alike (the solvers' tables)
    import numpy as np
    got = heap_slack_bytes(np.array([p, 200 * MiB]), replicas=2, zero=2)
    assert got.tolist() == [HEAP_SLACK_BLOCKS * p, HEAP_SLACK_BLOCKS * MMAP_THRESHOLD]


def test_the_host_cache_gives_the_figures_back_without_starting_a_process(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPML_HOST_CACHE", str(tmp_path / "host.json"))
    assert this_host(log=lambda _l: None, measure=False) == {}  # nothing cached, nothing measured
    from hpml_compile.profile.timing import host_facts

    key = host_key(host_facts())
    link = {"gbps": 3.0, "latency_us": 60.0, "shared": True, "source": "a test"}
    remember(key, "link", link)
    remember(key, "runtime_baseline", {"bytes": 123 * MiB, "step_ms": 0.5, "source": "a test"})
    lines: list[str] = []
    got = this_host(log=lines.append, measure=False)
    assert got["link"] == link and got["process"]["bytes"] == 123 * MiB and got["process"]["step_ms"] == 0.5
    assert any("cached in" in line for line in lines)  # the user sees where the figures came from
    assert cached("another CPU | python 0 | torch 0 | hpml-compile 0", "link") is None  # keyed by the host
    assert json.loads((tmp_path / "host.json").read_text())[key]["link"] == link


@pytest.mark.dist
def test_the_baseline_probe_reads_a_fresh_processs_peak_resident_set() -> None:
    out = subprocess.run([sys.executable, "-c", BASELINE_CODE], capture_output=True, text=True, check=True)
    rss, extra, inside = out.stdout.split()[-3:]
    assert 100 * MiB < int(rss) < 4096 * MiB  # torch and the runtime, a model of 10 parameters
    assert 0.0 < float(extra) < 1000.0  # Pipeline.step's wall clock beyond the executor's span, ms
    assert 0.0 < float(inside) < 1000.0  # the executor's span beyond the parts it times, ms


def test_the_runtimes_measured_bookkeeping_is_part_of_the_predicted_step() -> None:
    """Pipeline.step does more than the executor (the batch check, host sampling, memory counting): its measured
    time is in the prediction, which the report compares with Pipeline.step's wall clock."""
    plan, prof = _toy()
    plain = simulate(plan, build(prof))
    kept = simulate(plan, build(with_process(prof, {"bytes": 0, "step_ms": 1.25, "source": "a test"})))
    assert kept.step_ms == pytest.approx(plain.step_ms + 1.25)
    assert kept.step_without_optimizer_ms == pytest.approx(plain.step_without_optimizer_ms + 1.25)
    # the executor's own work between the parts it times (its set-up, its loop, the events) is priced with it
    inside = simulate(plan, build(with_process(prof, {"bytes": 0, "step_ms": 1.25, "executor_ms": 0.5,
                                                      "source": "a test"})))
    assert inside.step_ms == pytest.approx(plain.step_ms + 1.75)


class _Tied(torch.nn.Module):
    """An embedding and a head that share one weight (as gpt-mini's do)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.mid = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(x))))


def test_the_shared_memory_of_a_tied_weights_gradient_sum_is_the_processs() -> None:
    # the tied weight's gradients are summed over the two ranks through one host's shared memory: every rank maps
    # both slots (measured: 8 MiB for gpt-mini's 4 MiB embedding), beside the flat buffer counted with the gradients
    torch.manual_seed(0)
    prof = profile(_Tied(), (torch.randint(0, 64, (4, 8)),), name="tied", repeats=1, warmup=0, progress=False)
    names = tuple(n.name for n in prof.nodes)
    cut = next(i for i, n in enumerate(prof.nodes) if n.name.startswith("head"))
    plan = Plan("tied", load_cluster("local-cpu-2"), Schedule.ONE_F_ONE_B, 2,
                (Stage(0, ("cpu0",), names[:cut]), Stage(1, ("cpu1",), names[cut:])))
    base = 300 * MiB
    with_base = with_process(prof, {"bytes": base, "source": "a test"})
    weight = 64 * 32 * 4
    total = sum(n.param_bytes for n in prof.nodes)
    largest = max(prof.parameters.values())
    sim = simulate(plan, build(with_base))
    for st in plan.stages:
        dev = st.devices[0]
        parts = stage_breakdown(plan, with_base, st, dev)
        own = parts.params  # the stage's parameters, the tied weight's copy included
        built = process_bytes(base, total, own, largest_param=largest)
        assert parts.grads == own + weight  # the flat buffer of the tied gradients
        assert parts.process == built + 2 * weight  # both ranks' slots
        assert sim.peak[dev] >= parts.total - 1  # the simulator counts it as well
        assert stage_breakdown(plan, prof, st, dev).process == 0  # no baseline measured: no process counted


def test_the_plan_says_what_it_prices_for_the_runtimes_bookkeeping() -> None:
    from hpml_compile.explain import summary

    plan, prof = _toy()
    g = build(with_process(prof, {"bytes": 0, "step_ms": 0.25, "executor_ms": 0.05, "source": "a test"}))
    assert "runtime bookkeeping: 0.3 ms a step" in summary(plan, g, simulate(plan, g))
    assert "runtime bookkeeping" not in summary(plan, build(prof), simulate(plan, build(prof)))  # not measured
