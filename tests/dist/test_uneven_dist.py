"""Uneven data parallelism (``Stage.rows``), dist tier: replicas with their own rows on real gloo ranks.

One spawn of five ranks runs every check (starting ranks is the expensive
part): two 2-stage gpt-tiny builds whose stages split each microbatch 1:2:5
and 3:1, in both orders (so activations and their gradients reshard both
ways between the splits; the second under ZeRO-1), each rank comparing its
stage's gradients, its parameters after an SGD step and its outputs with the
original model's; and a TrainSpec trained with AdamW for a
few steps through the runtime's own data path (each rank loads only its rows
of every batch, ``rank_rows``), whose losses equal a plain loop's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hpml_compile import models
from hpml_compile.codegen import generate, load_build
from hpml_compile.testing import max_grad_diff, split_plan
from hpml_compile.plan import Schedule
from hpml_compile.runtime import dist_comm, spawn_ranks, step_rank
from hpml_compile.runtime.execute.data import global_batch
from hpml_compile.runtime.execute.pipeline import Pipeline
from hpml_compile.runtime.execute.trainer import Trainer
from hpml_compile.trace import trace
from hpml_compile.trainspec import TrainSpec

pytestmark = [pytest.mark.dist, pytest.mark.slow]
TOL = 1e-5
LR = 0.1
BATCH = 16  # two microbatches of 8 rows
# name -> (rows of stage 0's replicas, of stage 1's, schedule, ZeRO stage of both): 5 ranks each
BUILDS = {"125-31": ((1, 2, 5), (6, 2), Schedule.GPIPE, 0), "31-125": ((6, 2), (1, 2, 5), Schedule.ONE_F_ONE_B, 1)}
TRAIN_ROWS, STEPS, ITEMS, SEED = ((3, 1), (1, 2, 1)), 4, 32, 3  # microbatches of 4 rows, one per batch


def _gpt() -> Any:
    return models.load("gpt-tiny", batch_size=BATCH)


def _spec() -> TrainSpec:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ITEMS, 6, generator=g)
    return TrainSpec(net, TensorDataset(x, x[:, :3].argmax(1)), nn.functional.cross_entropy, batch_size=4,
                     seed=SEED, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))


def _worker(rank: int, world: int, root: str) -> None:
    report: dict[str, Any] = {}
    for name in BUILDS:
        loaded = _gpt()
        model, ref = loaded.module, copy.deepcopy(loaded.module)
        build = load_build(Path(root) / name, model)
        comm = dist_comm(build)
        x, y = loaded.example_inputs, loaded.example_targets
        result = step_rank(build, comm, x, y, loaded.loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
        out = ref(*x)
        ref_loss = loaded.loss_fn(out, y)
        ref_loss.backward()
        torch.optim.SGD(ref.parameters(), lr=LR).step()
        stage = build.plan.stages[comm.stage]
        names = {id(p): n for n, p in model.named_parameters()}
        mine = sorted({names[id(p)] for p in build.stages[comm.stage].parameters()})
        worst_out = 0.0
        for j, r, o in result.outputs:  # rows lo..hi of microbatch j are this replica's
            lo = sum(stage.rows[:r])
            want = out[j * 8 + lo: j * 8 + lo + stage.rows[r]]
            assert o.shape == want.shape, (o.shape, want.shape)
            worst_out = max(worst_out, (o - want).abs().max().item())
        report[name] = {"stage": comm.stage, "loss": None if result.loss is None else result.loss.item(),
                        "ref_loss": ref_loss.item(), "params": len(mine), "grad": max_grad_diff(model, ref, mine),
                        "param": max((dict(model.named_parameters())[n] - dict(ref.named_parameters())[n]).abs().max()
                                     .item() for n in mine),
                        "out": worst_out, "outputs": len(result.outputs)}
    spec = _spec()
    pipe = Pipeline.from_build(Path(root) / "train", spec.module, optimizer=spec.optimizer)
    trainer = Trainer(pipe, spec)
    report["train"] = {"losses": [float(trainer.step()) for _ in range(STEPS)], "rows": trainer.rows}
    Path(root, f"rank{rank}.json").write_text(json.dumps(report))


def _reference() -> list[float]:
    spec = _spec()
    assert spec.optimizer is not None
    opt = spec.optimizer(spec.module.parameters())
    x, y = spec.dataset.tensors
    losses = []
    for step in range(STEPS):
        idx = global_batch(ITEMS, spec.batch_size, SEED, step)
        opt.zero_grad()
        loss = spec.loss_fn(spec.module(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_uneven_replicas_on_gloo_ranks(tmp_path: Path) -> None:
    loaded = _gpt()
    gm = trace(loaded.module, loaded.example_inputs)
    for name, (a, b, schedule, zero) in BUILDS.items():
        plan = split_plan(gm, "gpt-tiny", 2, microbatches=2, rows=[a, b], schedule=schedule, zero=zero)
        generate(gm, plan, tmp_path / name)
    spec = _spec()
    x0 = spec.dataset.tensors[0][:4]
    gm = trace(spec.module, (x0,))
    generate(gm, split_plan(gm, "mlp", 2, microbatches=1, rows=list(TRAIN_ROWS)), tmp_path / "train")
    spawn_ranks(_worker, 5, tmp_path, str(tmp_path), timeout_s=600)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(5)]
    for name, (a, b, _, _) in BUILDS.items():
        rows = [r[name] for r in reports]
        assert [r["stage"] for r in rows] == [0] * len(a) + [1] * len(b)
        losses = [r["loss"] for r in rows if r["loss"] is not None]
        assert len(losses) == len(b) and abs(sum(losses) - rows[0]["ref_loss"]) < TOL, (name, losses)
        for r in rows:
            assert r["params"] > 0 and r["grad"] < TOL and r["param"] < TOL, (name, r)
        assert all(r["out"] < TOL and r["outputs"] == 2 for r in rows if r["stage"] == 1), (name, rows)
    ref = _reference()
    for r in reports:
        assert all(abs(a - b) < 1e-5 for a, b in zip(r["train"]["losses"], ref)), (r["train"]["losses"], ref)
    # each rank loaded its own rows of each batch: 3 and 1 on stage 0, 1, 2 and 1 on stage 1
    assert [len(r["train"]["rows"]) for r in reports] == [3, 1, 1, 2, 1]
