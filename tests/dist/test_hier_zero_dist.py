"""Hierarchical ZeRO-1 on two simulated hosts: two torchrun agents (``--nnodes 2``) of two ranks each.

SkipNet on one stage of four CPU devices, two on each of two hosts, ZeRO-1 with ``allreduce: hierarchical``
(the optimizer sharded over the two ranks of each host, replicated across hosts: reduce-scatter in the host,
all-reduce of the shard between hosts, AdamW on the shard, all-gather in the host). One job checks:

- transparency: three AdamW steps give the one-process model's losses and parameters (within float
  tolerance: the same sums, added in another order), on every rank, both as the plan runs it on CPU ranks
  (after the backward) and with the buckets forced on (``overlap=True``, as on GPU groups: each bucket's
  reduce-scatter and all-reduce chained during the backward, every bucket launched by a gradient hook);
- the shard is ``1 / L`` of the stage (``L = 2`` ranks per host, not ``1 / d = 1 / 4``), and so is every
  Adam moment; ranks at the same position on the two hosts hold the same moments; the bytes a rank holds by
  part (parameters and gradients: the flat buffers plus the shard's own, ``P + P / L``; optimizer state)
  are :func:`hpml_compile.plan.stage_breakdown`'s;
- the bytes the runtime counted per level are the hierarchical all-reduce's (between hosts ``1 / L`` of a
  ring's share);
- the parameter all-gather after the step is prefetched with the buckets on (each bucket's launched after the
  optimizer step, waited by the next forward's pre-hooks): the steps leave every bucket's gather in flight, the
  next step's forward waits for them, an eval forward with them in flight gives the reference's eval loss,
  and the checkpoint below is saved with them in flight (the save waits for them);
- a checkpoint saved under it (the bucketed layout: each shard a piece of every bucket) resumes under the
  flat ZeRO-0 build of the same model: the two steps after it
  give the losses and parameters of the run that went on under the hierarchical ZeRO-1 plan (so the Adam
  moments came back whole), and so does resuming it under the hierarchical ZeRO-1 plan again (each shard,
  its own tensor, takes its pieces of the loaded parameters).
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
from hpml_compile.testing import SkipNet, skipnet_loss, split_plan
from hpml_compile.ir import Cluster, Device
from hpml_compile.memory import ZeroStage
from hpml_compile.plan import AllReduce, Plan, load_plan, stage_breakdown
from hpml_compile.profile import profile
from hpml_compile.runtime.job.launcher import free_port
from hpml_compile.trace import trace

WORKER = Path(__file__).with_name("hzero_worker.py")
sys.path.insert(0, str(WORKER.parent))
from hzero_worker import LR, STEPS, batches  # noqa: E402  (the worker's data and optimizer, used here too)
ROOT = Path(__file__).resolve().parents[2]


def two_hosts(plan: Plan, zero: ZeroStage, how: AllReduce) -> Plan:
    """``plan`` (one stage on cpu0..cpu3) on two hosts, cpu0-1 on hostA and cpu2-3 on hostB."""
    devs = tuple(Device(f"cpu{i}", "cpu", 2.0, host="hostA" if i < 2 else "hostB") for i in range(4))
    return replace(plan, cluster=Cluster(devices=devs, name="two-hosts"),
                   stages=(replace(plan.stages[0], zero=zero, allreduce=how),))


def _reference() -> tuple[list[float], dict[str, torch.Tensor], list[float], dict[str, torch.Tensor], float]:
    """The model in this process: losses and parameters after STEPS AdamW steps, and after two more, and then
    its eval loss on the last batch."""
    torch.manual_seed(0)
    model = SkipNet()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for i, (x, y) in enumerate(batches()):
        if i == STEPS:
            first = {k: v.detach().clone().flatten() for k, v in model.named_parameters()}
        opt.zero_grad()
        loss = skipnet_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        x, y = batches()[-1]
        last_eval = float(skipnet_loss(model(x), y))
    return (losses[:STEPS], first, losses[STEPS:], {k: v.detach().flatten() for k, v in model.named_parameters()},
            last_eval)


@pytest.mark.dist
@pytest.mark.slow  # two torchrun agents, four gloo ranks, two pipelines each: ~30-60 s on 2 shared cores
def test_hierarchical_zero1_on_two_torchrun_hosts_is_transparent_sharded_per_host_and_resumes_flat(
        tmp_path: Path) -> None:
    gm = trace(SkipNet(), batches()[0][:1])
    base = split_plan(gm, "skipnet", 1, microbatches=2, replicas=[4])
    hz, dp = tmp_path / "hz", tmp_path / "dp"
    generate(gm, two_hosts(base, ZeroStage.OS, AllReduce.HIERARCHICAL), hz)
    generate(gm, two_hosts(base, ZeroStage.NONE, AllReduce.FLAT), dp)
    got = load_plan(hz / "plan.json").stages[0]
    assert (got.zero, got.allreduce) == (ZeroStage.OS, AllReduce.HIERARCHICAL)
    out = tmp_path / "out"
    out.mkdir()
    endpoint = f"localhost:{free_port()}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}

    def agent(node: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
             "--rdzv-backend=static", f"--rdzv-endpoint={endpoint}", "--nproc-per-node=2", str(WORKER),
             str(hz), str(dp), str(out)],
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
    losses, params, later, final, last_eval = _reference()
    n = sum(v.numel() for v in params.values())
    prof = profile(SkipNet(), batches()[0][:1], name="skipnet", progress=False, repeats=1)
    hz_plan = load_plan(hz / "plan.json")
    held = stage_breakdown(hz_plan, prof, hz_plan.stages[0])
    assert held.optimizer == 2 * n * 4 // 2  # Adam's two fp32 moments, / L = 2 (flat ZeRO-1 would be / 4)
    assert held.params == held.grads == n * 4 + n * 4 // 2  # the flat buffers, and the shard's own of each
    padded = -(-n // 2) * 2 * 4  # fp32 bytes of the flat buffer, padded to the host's 2 ranks
    for run in ("after", "buckets"):
        for r, rank in enumerate(ranks):
            rep = rank[run]
            assert rep["hierarchy"] == [[0]], run  # the runtime did as planned
            assert (rep["replicas"], rep["local"]) == (2, r % 2)  # sharded over the host's 2 ranks, by position
            assert rep["numel"] == n and rep["shard_numel"] == -(-n // 2)  # 1/L of the stage, not 1/d
            assert rep["state_numel"]["exp_avg"] == rep["state_numel"]["exp_avg_sq"] == rep["shard_numel"]
            # what the rank holds is the prediction: the flat parameters and the shard's own, the flat gradient
            # buffer and the shard's summed gradient (its own storage), the moments 1/L, plus the step counter of
            # the one parameter the optimizer steps (the shard)
            assert rep["optimizer_params"] == 1, rep
            assert rep["held_params"] == held.params and rep["held_optimizer"] == held.optimizer + 4, (run, rep)
            assert rep["grad_storage"] == [n * 4, n * 4 // 2, True] and sum(rep["grad_storage"][:2]) == held.grads
            assert rep["losses"] == pytest.approx(losses, abs=1e-6), (run, r)
            for name, want in params.items():
                got = torch.tensor(rep["params"][name])
                assert torch.allclose(got, want, atol=1e-6), (run, r, name)
                assert got.equal(torch.tensor(ranks[0][run]["params"][name])), (run, r, name)  # every rank alike
            # per step: reduce-scatter + all-gather in the host (each (L-1)/L), the shard's all-reduce between the
            # 2 hosts (2 (H-1)/H of 1/L), against a flat ring's 2 (d-1)/d of the buffer; buckets: at least that
            if run == "after":
                assert rep["levels"] == [padded, padded // 2, 3 * padded // 2], rep["levels"]
                assert rep["buckets"] is None  # CPU ranks: after the backward, as the plan prices it
            else:
                assert all(a >= b > 0 for a, b in zip(rep["levels"], [padded, padded // 2, 3 * padded // 2]))
                count, in_backward, early = rep["buckets"]
                assert count > 2 and in_backward == count and early >= 1, rep["buckets"]  # launched by the hooks
                # the prefetch: the last step's parameter gathers still in flight after it, one per bucket, and
                # every earlier step's waited by the next step's forward (pre-hooks), not by the step itself
                assert rep["prefetch"] == [count, (STEPS - 1) * count], (r, rep["prefetch"])
                pending, got_eval, left = rep["eval"]  # an eval forward with the gathers in flight sees the step
                assert (pending, left) == (count, 0) and got_eval == pytest.approx(last_eval, abs=1e-6), rep["eval"]
            if run == "after":
                assert rep["prefetch"] == [0, 0]  # CPU ranks by the plan's rule: gathered in the step, blocking
        for a, b in ((0, 2), (1, 3)):  # the same shard on both hosts: the same Adam moments
            assert torch.allclose(torch.tensor(ranks[a][run]["exp_avg"]), torch.tensor(ranks[b][run]["exp_avg"]),
                                  atol=1e-9)
        assert not torch.allclose(torch.tensor(ranks[0][run]["exp_avg"]), torch.tensor(ranks[1][run]["exp_avg"]))
    for r, rank in enumerate(ranks):  # saved from the bucketed layout, resumed under the flat ZeRO-0 build
        rep = rank["buckets"]
        assert rep["resumed"] == pytest.approx(rep["continued"], abs=1e-6), r
        assert rep["resumed_here"] == pytest.approx(rep["continued"], abs=1e-6), r  # and under this plan again
        assert rep["continued"] == pytest.approx(later, abs=1e-6), r
        for name, want in final.items():
            assert torch.allclose(torch.tensor(rep["resumed_params"][name]),
                                  torch.tensor(rep["continued_params"][name]), atol=1e-6), (r, name)
            assert torch.allclose(torch.tensor(rep["continued_params"][name]), want, atol=1e-6), (r, name)
