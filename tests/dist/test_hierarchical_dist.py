"""Hierarchical all-reduce on two simulated hosts: two torchrun agents (``--nnodes 2``) of two ranks each.

A plan whose one stage runs on four CPU devices, two on each of two hosts,
with ``allreduce: hierarchical`` (reduce-scatter inside each host,
all-reduce between them, all-gather inside each host). One job (the two
agents) checks every case:

- the collective alone gives the flat all-reduce's sum: bit for bit on
  integer-valued tensors, to float64 rounding on random ones, for lengths
  that split into the hosts' ranks and lengths that need padding;
- one SGD step of the hierarchical build moves every parameter as the flat
  build and as the original model trained in this process do (so the
  gradients agree), and every rank ends with the same parameters; the bytes
  the runtime counted at each level (what ``report`` prints) are the ring's;
- the same for gpt-tiny on two stages, one per host, whose tied embedding and
  LM head are summed over both stages with ``tied_allreduce: hierarchical``;
- the hierarchical build with its buckets forced on (``overlap=True``, as on
  GPU groups): each bucket's reduce-scatter, all-reduce and all-gather chained
  during the backward give the same parameters bit for bit as the
  hierarchical all-reduce after the backward (so the flat build's and the
  model's), every bucket is launched by a gradient hook and the first
  collectives start before the backward ends; on CPU ranks the plan's rule
  buckets nothing. gpt-tiny likewise, its tied weight kept out of the buckets
  (its own all-reduce across the stages). Chains of that path driven by polls
  alone (as the gradient hooks drive them) all finish, with the same sums.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hpml_compile.codegen import generate
from hpml_compile.testing import SkipNet, skipnet_batch, skipnet_loss, split_plan
from hpml_compile.ir import Cluster, Device
from hpml_compile.plan import AllReduce, Plan, load_plan
from hpml_compile.runtime.job.launcher import free_port
from hpml_compile.trace import trace

WORKER = Path(__file__).with_name("hier_worker.py")
sys.path.insert(0, str(WORKER.parent))
from hier_worker import gpt_tiny  # noqa: E402  (the worker's model, built the same way here)
ROOT = Path(__file__).resolve().parents[2]
LR = 0.5  # as in hier_worker.py


def two_hosts(plan: Plan, how: AllReduce) -> Plan:
    """``plan`` (one stage on cpu0..cpu3) on a cluster of two hosts, cpu0-1 on hostA and cpu2-3 on hostB."""
    devs = tuple(Device(f"cpu{i}", "cpu", 2.0, host="hostA" if i < 2 else "hostB") for i in range(4))
    return replace(plan, cluster=Cluster(devices=devs, name="two-hosts"),
                   stages=(replace(plan.stages[0], allreduce=how),))


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = SkipNet()
    x, y = skipnet_batch(rows=16)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    skipnet_loss(model(x), y).backward()
    opt.step()
    return {k: v.detach().flatten() for k, v in model.named_parameters()}


def _tied_reference() -> dict[str, torch.Tensor]:
    loaded = gpt_tiny()
    opt = torch.optim.SGD(loaded.module.parameters(), lr=LR)
    loaded.loss_fn(loaded.module(*loaded.example_inputs), loaded.example_targets).backward()
    opt.step()
    return {k: v.detach().flatten() for k, v in loaded.module.named_parameters(remove_duplicate=False)}


@pytest.mark.dist
@pytest.mark.slow  # two torchrun agents, four gloo ranks, six runs of the builds: ~40-80 s on 2 shared cores
def test_hierarchical_allreduce_on_two_torchrun_hosts_equals_flat_and_the_model(tmp_path: Path) -> None:
    gm = trace(SkipNet(), skipnet_batch(rows=16)[:1])
    base = split_plan(gm, "skipnet", 1, microbatches=2, replicas=[4])
    builds = {}
    for how in AllReduce:
        builds[how] = tmp_path / how.value
        generate(gm, two_hosts(base, how), builds[how])
    assert load_plan(builds[AllReduce.HIERARCHICAL] / "plan.json").stages[0].allreduce is AllReduce.HIERARCHICAL
    tiny = gpt_tiny()
    gm_tiny = trace(tiny.module, tiny.example_inputs)
    two = split_plan(gm_tiny, "gpt-tiny", 2, microbatches=2, replicas=[2, 2])  # cpu0-1 | cpu2-3: one per host
    tied = {}
    for how in AllReduce:
        tied[how] = tmp_path / f"tied-{how.value}"
        on_hosts = replace(two, cluster=two_hosts(base, AllReduce.FLAT).cluster, tied_allreduce=how)
        generate(gm_tiny, on_hosts, tied[how])
    out = tmp_path / "out"
    out.mkdir()
    endpoint = f"localhost:{free_port()}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}

    def agent(node: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
             "--rdzv-backend=static", f"--rdzv-endpoint={endpoint}", "--nproc-per-node=2", str(WORKER),
             str(builds[AllReduce.FLAT]), str(builds[AllReduce.HIERARCHICAL]), str(tied[AllReduce.FLAT]),
             str(tied[AllReduce.HIERARCHICAL]), str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    agents = [agent(1), agent(0)]
    try:
        results = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert all(a.returncode == 0 for a in agents), [r[1][-3000:] for r in results]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    ref = _reference()
    for rep in ranks:
        assert rep["world"] == 4 and rep["per_host"] == 2
        assert rep["flat_hierarchy"] == [] and rep["hierarchical_hierarchy"] == [[0]]  # the runtime did as planned
        n = sum(v.numel() for v in ref.values()) * 4  # fp32 gradient bytes; even: no padding for 2 ranks a host
        assert rep["hierarchical_levels"] == [n, n // 2, 3 * n // 2]  # inside 2(h-1)/h, between 2(H-1)/H / h, ring
        # the overlapped path counts the same bytes, bucket by bucket (buckets may pad: at least the whole)
        assert all(a >= b > 0 for a, b in zip(rep["hierarchical_overlap_levels"], rep["hierarchical_levels"]))
        assert rep["flat_levels"] == [0, 0, 0]
        assert all(rep["integers_equal"]), rep["integers_equal"]
        assert max(rep["random_max_diff"]) < 1e-12, rep["random_max_diff"]
        # the first chain's reduce-scatter starts when queued, the others wait their turn (a chain starts only
        # once the one before it has started all 3 levels: how far the first got while the others were queued
        # is timing); polls alone (no blocking wait) start every later level and finish every chain, with the
        # sums of the blocking path
        started = rep["chain_started_at_add"]
        assert started[0] >= 1 and all(s == 0 or before == 3 for before, s in zip(started, started[1:])), started
        assert all(rep["chains_finished_by_polls"]) and all(rep["chains_equal"]), rep
        assert rep["hierarchical_loss"] == pytest.approx(rep["flat_loss"], abs=1e-6)
        for name, want in ref.items():
            flat = torch.tensor(rep["flat"][name])
            hier = torch.tensor(rep["hierarchical"][name])
            assert torch.allclose(hier, flat, atol=1e-6), name  # the same gradients, summed in another order
            assert torch.allclose(hier, want, atol=1e-5), name  # ... and the original model's
            assert hier.equal(torch.tensor(ranks[0]["hierarchical"][name])), name  # every replica the same
            # the chained buckets during the backward: the same sums, bit for bit
            assert torch.tensor(rep["hierarchical_overlap"][name]).equal(hier), name
        assert rep["hierarchical_overlap_loss"] == rep["hierarchical_loss"]
        assert rep["flat_buckets"] == rep["hierarchical_buckets"] == {"count": 0}  # CPU ranks: after the backward
        b = rep["hierarchical_overlap_buckets"]
        # launched by the hooks, every one, the first while gradients were still to come; its collectives had
        # started when the backward ended (the later levels' start depends on the network's timing: recorded)
        assert b["count"] > 2 and b["launched_in_backward"] == b["count"] and b["launched_early"] >= 1, b
        assert b["started_in_backward"] >= 1 and b["levels_in_backward"] >= 1, b
    tied_ref = _tied_reference()
    for r, rep in enumerate(ranks):  # ranks 0-1 run stage 0 on hostA, 2-3 stage 1 on hostB
        assert rep["tied_flat_hierarchy"] == [] and rep["tied_hierarchical_hierarchy"] == [[0, 1]]
        assert set(rep["tied_hierarchical"]) == set(rep["tied_flat"]) and rep["tied_hierarchical"]
        for name, got in rep["tied_hierarchical"].items():
            hier, flat = torch.tensor(got), torch.tensor(rep["tied_flat"][name])
            assert torch.allclose(hier, flat, atol=1e-6), (r, name)
            assert torch.allclose(hier, tied_ref[name], atol=1e-5), (r, name)  # the tied weight: both uses summed
            assert torch.tensor(rep["tied_hierarchical_overlap"][name]).equal(hier), (r, name)
        b = rep["tied_hierarchical_overlap_buckets"]  # each stage's own replicas (one host): flat buckets
        assert b["count"] >= 1 and b["launched_in_backward"] == b["count"], b
