"""Optimizer offload on a GPU: the Adam state lives in pinned host memory, the device holds none of it.

Skipped without CUDA (tests/gpu/conftest.py says so). The numerics of the
same code path are checked exactly on the CPU in tests/unit/test_offload.py.
"""

from __future__ import annotations

import copy

import torch

from hpml_compile.models import load
from hpml_compile.runtime.sync.offload import offload_optimizer


def test_offloaded_state_is_on_the_host_and_the_update_matches() -> None:
    dev = torch.device("cuda")
    m = load("gpt-tiny")
    a, b = m.module.to(dev), copy.deepcopy(m.module).to(dev)
    x = m.example_inputs[0].to(dev)
    plain = torch.optim.AdamW(a.parameters(), lr=1e-3)
    off = offload_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3), list(b.parameters()), dev)
    n_bytes = sum(p.numel() * 4 for p in b.parameters())
    for _ in range(3):
        for model, opt in ((a, plain), (b, off)):
            for p in model.parameters():
                p.grad = None
            model(x).float().square().mean().backward()
            opt.step()
    torch.cuda.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        assert q.device.type == "cuda"
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # CPU and CUDA Adam round differently
    state = [v for st in off.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    assert state and all(v.device.type == "cpu" for v in state)
    assert all(t.is_pinned() for t in off._grad.values())
    assert off.state_bytes() == 2 * n_bytes
    # on the device: parameters and gradients, no Adam state
    for p in b.parameters():
        p.grad = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    b(x).float().square().mean().backward()
    off.step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(dev) - before < 1.5 * n_bytes  # the gradients, not + 2x state
