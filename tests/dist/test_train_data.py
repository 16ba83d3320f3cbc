"""Training on a TrainSpec's data across real gloo ranks equals a plain PyTorch loop over the same data order.

Each rank loads only its rows (first stage: inputs, last stage: targets, each
replica its own part of every microbatch); the per-step losses of a 2-stage
pipeline and of a 1-stage 2-replica plan, over 50 steps (six epochs and a
bit, so the per-epoch reshuffle is crossed) with a step-wise learning-rate
schedule, match a single process running ``model(x)`` on ``data[indices]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.runtime import spawn_ranks
from hpml_compile.runtime.execute.data import global_batch
from hpml_compile.runtime.execute.pipeline import Pipeline
from hpml_compile.runtime.execute.trainer import Trainer
from hpml_compile.trace import trace
from hpml_compile.trainspec import TrainSpec

pytestmark = pytest.mark.dist
STEPS, BATCH, ITEMS, SEED = 50, 8, 64, 7


def _spec() -> TrainSpec:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ITEMS, 6, generator=g)
    y = x[:, :3].argmax(1)  # something learnable: class targets
    return TrainSpec(net, TensorDataset(x, y), nn.functional.cross_entropy, batch_size=BATCH, seed=SEED,
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
                     lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5))


def _reference() -> list[float]:
    """The same model, optimizer and schedule in one process, a plain loop over the same batches."""
    spec = _spec()
    opt = spec.optimizer(spec.module.parameters())
    sched = spec.lr_scheduler(opt)
    x, y = spec.dataset.tensors
    losses = []
    for step in range(STEPS):
        idx = global_batch(ITEMS, BATCH, SEED, step)
        opt.zero_grad()
        loss = spec.loss_fn(spec.module(x[idx]), y[idx])
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


PLANS = {"2-stage": (2, [1, 1]), "1-stage-2-replicas": (1, [2])}


def _train(rank: int, world: int, root: str) -> None:
    """Both plans, one after the other, in one job (one start of the ranks)."""
    out = {}
    for name in PLANS:
        spec = _spec()
        pipe = Pipeline.from_build(Path(root) / name, spec.module, optimizer=spec.optimizer)
        trainer = Trainer(pipe, spec)
        losses = [float(trainer.step()) for _ in range(STEPS)]
        out[name] = {"losses": losses, "rows": trainer.rows, "inputs": trainer.needs_inputs,
                     "targets": trainer.needs_targets}
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))


@pytest.mark.slow
def test_losses_equal_a_plain_loop_over_the_same_data(tmp_path: Path) -> None:
    spec = _spec()
    gm = trace(spec.module, (spec.dataset.tensors[0][:BATCH],))
    for name, (stages, replicas) in PLANS.items():
        generate(gm, split_plan(gm, "mlp", stages, microbatches=2, replicas=replicas), tmp_path / name)
    spawn_ranks(_train, 2, tmp_path, str(tmp_path), timeout_s=600)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    want = _reference()
    assert sum(want[-5:]) < 0.5 * sum(want[:5])  # it learns: the comparison is not of flat lines
    # who loads what: stage 0 the inputs, the last stage the targets; each replica its part of each microbatch
    two, reps = [g["2-stage"] for g in got], [g["1-stage-2-replicas"] for g in got]
    assert [(g["inputs"], g["targets"], g["rows"]) for g in two] == [(True, False, list(range(8))),
                                                                     (False, True, list(range(8)))]
    assert [g["rows"] for g in reps] == [[0, 1, 4, 5], [2, 3, 6, 7]] and all(g["inputs"] and g["targets"]
                                                                             for g in reps)
    for name in PLANS:
        assert got[0][name]["losses"] == got[1][name]["losses"]  # every rank reports the batch's loss
        for step, (a, b) in enumerate(zip(got[0][name]["losses"], want, strict=True)):
            assert a == pytest.approx(b, rel=1e-5), f"{name}, step {step + 1}: pipeline {a}, plain loop {b}"
