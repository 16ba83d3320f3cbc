"""Compiled stages (torch.compile, inductor: it runs the host's C++ compiler) train as the eager model does, in
one process and on two gloo ranks: losses, gradients and parameters after 3 SGD steps within 1e-5 (fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpml_compile.codegen import generate
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.testing import split_plan
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# fp32 under inductor: fused kernels reorder sums, so values agree to rounding, not bit for bit
TOL = 1e-5


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 2))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def _sgd(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.1)


def eager_reference(steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses, last gradients and parameters of the plain model trained ``steps`` SGD steps."""
    x, y = _batch()
    net = _net()
    opt = _sgd(list(net.parameters()))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        losses.append(loss.item())
        grads = {k: p.grad.clone() for k, p in net.named_parameters()}
        opt.step()
    return losses, grads, {k: v.detach().clone() for k, v in net.state_dict().items()}


def two_stage_build(out: Path, **kw: object) -> Path:
    """The net cut after its first Linear, two microbatches (``kw``: recompute, swap for split_plan)."""
    gm = trace(_net(), (_batch()[0],))
    cut = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "1")
    generate(gm, split_plan(gm, "compiled", 2, microbatches=2, after=[cut], **kw), out)  # type: ignore[arg-type]
    return out


# a recomputed or swapped stage runs its region as written (ops.checkpoint / ops.swap break the graph there)
@pytest.mark.parametrize("regions", [{}, {"recompute": [0]}, {"swap": [1]}], ids=["plain", "recompute", "swap"])
def test_a_compiled_build_trains_as_the_eager_model(tmp_path: Path, regions: dict[str, list[int]]) -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # count only this test's graphs
    lines: list[str] = []
    net = _net()
    pipe = Pipeline.from_build(two_stage_build(tmp_path / "b", **regions), net, optimizer=_sgd,
                               compile_stages="on", log=lines.append)
    assert len(pipe.compiled) == 2
    x, y = _batch()
    got = []
    for _ in range(3):
        got.append(float(pipe.step((x,), y, torch.nn.functional.mse_loss)))
        grads = {k: p.grad.clone() for k, p in net.named_parameters()}
    want, want_grads, want_params = eager_reference()
    assert not lines, f"nothing fell back: {lines}"
    compiled = 2 - sum(len(v) for v in regions.values())  # stages not wholly inside a region
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= compiled, "the stages ran compiled"
    assert got == pytest.approx(want, rel=TOL, abs=TOL)
    for k, g in want_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=TOL, atol=TOL)
    for k, v in want_params.items():
        torch.testing.assert_close(net.state_dict()[k], v, rtol=TOL, atol=TOL)
    with torch.no_grad():
        want_out = net(x)
    torch.testing.assert_close(pipe.eval_forward(x), want_out, rtol=TOL, atol=TOL)  # compiled again, no grad


def _worker(rank: int, world: int, build: str, out: str) -> None:
    x, y = _batch()
    net = _net()
    pipe = Pipeline.from_build(build, net, optimizer=_sgd, compile_stages="on")
    got = []
    for _ in range(3):  # the first two count memory on the eager forward; the third runs compiled
        got.append(float(pipe.step((x,), y, torch.nn.functional.mse_loss)))
        grads = {k: p.grad.tolist() for k, p in net.named_parameters() if p.grad is not None}
    state = pipe.state_dict()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "losses": got, "grads": grads, "params": {k: v.tolist() for k, v in state.items()},
        "fallbacks": [r for c in pipe.compiled for r in c.fallbacks],
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"], "compiled": len(pipe.compiled)}))
    pipe.close()


def test_compiled_stages_on_two_ranks_train_as_the_eager_model(tmp_path: Path) -> None:
    build = two_stage_build(tmp_path / "build")
    spawn_ranks(_worker, 2, tmp_path, str(build), str(tmp_path), timeout_s=600)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    want, want_grads, want_params = eager_reference()
    for r in ranks:
        assert r["compiled"] == 1 and not r["fallbacks"] and r["graphs"] >= 1, "each rank's stage ran compiled"
        assert r["losses"] == pytest.approx(want, rel=TOL, abs=TOL)
        for k, v in want_params.items():
            torch.testing.assert_close(torch.tensor(r["params"][k]), v, rtol=TOL, atol=TOL)
    grads = {**ranks[0]["grads"], **ranks[1]["grads"]}
    assert set(grads) == set(want_grads)
    for k, g in want_grads.items():
        torch.testing.assert_close(torch.tensor(grads[k]), g, rtol=TOL, atol=TOL)
