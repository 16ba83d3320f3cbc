"""Optimizer offload: the update equals the optimizer's own, with the state in host tensors of its own.

On this CPU-only machine the host and the device are both the CPU: the same
code path runs (cpu -> cpu copies), which is what checks the numerics. What
needs CUDA (pinned buffers, state on the host while parameters are on the GPU)
is in tests/gpu/test_offload_cuda.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hpml_compile.errors import HpmlError
from hpml_compile.models import load
from hpml_compile.runtime.sync.offload import OffloadedOptimizer, offload_optimizer


def _pair() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    m = load("gpt-tiny")
    return m.module, copy.deepcopy(m.module), m.example_inputs[0]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int,
           sched: torch.optim.lr_scheduler.LRScheduler) -> list[float]:
    losses = []
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_offloaded_adamw_equals_adamw_exactly() -> None:
    a, b, x = _pair()
    plain = torch.optim.AdamW(a.parameters(), lr=1e-3, weight_decay=0.1)
    off = OffloadedOptimizer(torch.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.1), host=torch.device("cpu"))
    la = _train(a, plain, x, 3, torch.optim.lr_scheduler.StepLR(plain, 1, gamma=0.5))
    lb = _train(b, off, x, 3, torch.optim.lr_scheduler.StepLR(off, 1, gamma=0.5))
    assert la == lb
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    # the state is the inner optimizer's, in tensors of its own (not the parameters' storage)
    params = {p.untyped_storage().data_ptr() for p in b.parameters()}
    state = [v for st in off.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    assert state and not params & {v.untyped_storage().data_ptr() for v in state}
    n_params = sum(p.numel() for p in b.parameters())
    assert off.state_bytes() == 8 * n_params  # exp_avg + exp_avg_sq, fp32
    assert off.bytes_to_host == off.bytes_to_device == 3 * 4 * n_params
    # a change made on the device between steps (a checkpoint load) reaches the host master copy
    with torch.no_grad():
        for p, q in zip(a.parameters(), b.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
    osd = off.state_dict()
    off.load_state_dict(copy.deepcopy(osd))  # round trip through the state dict, state stays host-side
    assert _train(a, plain, x, 1, torch.optim.lr_scheduler.StepLR(plain, 1)) == \
        _train(b, off, x, 1, torch.optim.lr_scheduler.StepLR(off, 1))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_offload_refused_where_the_host_is_the_device() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(HpmlError, match="CPU device, where the host is the device"):
        offload_optimizer(lambda ps: torch.optim.AdamW(ps), model.parameters(), torch.device("cpu"))
    with pytest.raises(HpmlError, match="does not take a closure"):
        OffloadedOptimizer(torch.optim.AdamW(model.parameters())).step(lambda: 0.0)
