"""GPU tier of the runtime: NCCL between GPU stages, and a pipeline mixing a GPU stage with a CPU stage.

Skipped, with the reason, where CUDA is missing (tests/gpu/conftest.py); the
NCCL test also needs two GPUs (NCCL refuses two ranks on one device). Each
test trains gpt-tiny for a few steps through :class:`hpml_compile.runtime.Pipeline`
on real ranks and compares the losses with the model trained on the CPU in
one process (TF32 off, so float32 on both sides), then gathers the full
state dict and checks it against the reference.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.ir import Cluster, Device
from hpml_compile.plan import Plan, Schedule
from hpml_compile.runtime import Pipeline, spawn_ranks, rank_devices
from hpml_compile.trace import trace

pytestmark = pytest.mark.gpu

STEPS = 5
TOL = 1e-3  # CUDA kernels sum in other orders than the CPU's


def _loaded() -> models.LoadedModel:
    return models.load("gpt-tiny", batch_size=8, seq_len=16, seed=0)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    loaded = _loaded()
    opt = _optimizer(loaded.module.parameters())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loaded.loss_fn(loaded.module(*loaded.example_inputs), loaded.example_targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in loaded.module.state_dict().items()}


def _plan_on(devices: list[Device], tmp: Path) -> str:
    loaded = _loaded()
    gm = trace(loaded.module, loaded.example_inputs)
    base = split_plan(gm, "gpt-tiny", len(devices), microbatches=2, schedule=Schedule.ONE_F_ONE_B)
    stages = tuple(replace(st, devices=(d.name,)) for st, d in zip(base.stages, devices))
    plan = Plan(base.model, Cluster(tuple(devices), name="gpu-test"), base.schedule, base.microbatches, stages)
    generate(gm, plan, tmp / "build")
    return str(tmp / "build")


def _worker(rank: int, world: int, build_dir: str, out: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    loaded = _loaded()
    pipe = Pipeline.from_build(build_dir, loaded.module, optimizer=_optimizer)
    losses = [pipe.step(loaded.example_inputs, loaded.example_targets, loaded.loss_fn).item() for _ in range(STEPS)]
    state = pipe.state_dict()
    ref_losses, ref_state = _reference()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "device": str(pipe.device), "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "state": max((state[k].double() - v.double()).abs().max().item() for k, v in ref_state.items()),
        "memory_kind": pipe.metrics[-1].memory_kind, "peak": pipe.metrics[-1].peak_memory_bytes}))


def _run(build_dir: str, tmp: Path, world: int) -> list[dict[str, Any]]:
    spawn_ranks(_worker, world, tmp, build_dir, str(tmp))
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between GPU stages needs two GPUs "
                    f"(this machine has {torch.cuda.device_count()}; NCCL refuses two ranks on one GPU)")
def test_nccl_between_gpu_stages(tmp_path: Path) -> None:
    build = _plan_on([Device("gpu0", "A100-80GB", 80), Device("gpu1", "A100-80GB", 80)], tmp_path)
    reports = _run(build, tmp_path, 2)
    assert [r["device"] for r in reports] == ["cuda:0", "cuda:1"]
    for r in reports:
        assert r["loss"] < TOL and r["state"] < TOL, r
        assert r["memory_kind"] == "cuda" and r["peak"] > 0


def test_mixed_gpu_and_cpu_pipeline_stages_through_host_memory(tmp_path: Path) -> None:
    devices = [Device("gpu0", "A100-80GB", 80), Device("cpu0", "cpu", 16)]
    build = _plan_on(devices, tmp_path)
    plan = Plan.from_dict(json.loads((Path(build) / "plan.json").read_text()))
    assert [str(d) for d in rank_devices(plan)] == ["cuda:0", "cpu"]
    reports = _run(build, tmp_path, 2)
    assert [r["device"] for r in reports] == ["cuda:0", "cpu"]
    assert [r["memory_kind"] for r in reports] == ["cuda", "rss"]
    for r in reports:
        assert r["loss"] < TOL and r["state"] < TOL, r
