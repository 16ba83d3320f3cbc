"""A stage that holds no parameters (here the last: an activation and the loss) trains on its own rank.

torch's optimizers refuse an empty parameter list, so the rank of such a
stage has no optimizer (``Pipeline.optimizer is None``), while the rank
before it steps as usual; the losses equal the model trained in one process.
Found on a GPU + CPU pipeline whose cut left the CPU rank only the tail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.trace import trace

pytestmark = pytest.mark.dist


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)


def _sgd(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.1)


def _worker(rank: int, world: int, build: str, out: str) -> None:
    x, y = _batch()
    loss_fn = torch.nn.functional.mse_loss
    pipe = Pipeline.from_build(build, _net(), optimizer=_sgd)
    got = [float(pipe.step((x,), y, loss_fn)) for _ in range(3)]
    ref, opt, want = _net(), None, []
    opt = _sgd(list(ref.parameters()))
    for _ in range(3):
        opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "optimizer": pipe.optimizer is not None, "params": sum(1 for _ in pipe.parameters()), "got": got,
        "want": want}))


def test_a_stage_without_parameters_trains_on_its_own_rank(tmp_path: Path) -> None:
    net = _net()
    gm = trace(net, (_batch()[0],))
    linear = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "0")
    generate(gm, split_plan(gm, "paramless", 2, microbatches=2, after=[linear]), tmp_path / "build")
    spawn_ranks(_worker, 2, tmp_path, str(tmp_path / "build"), str(tmp_path))
    first, last = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert first["optimizer"] and first["params"] == 2
    assert not last["optimizer"] and last["params"] == 0
    assert last["got"] == pytest.approx(last["want"], abs=1e-6)  # the last stage computes the loss
    assert last["got"][0] > last["got"][-1]  # the first rank's steps reached the loss
