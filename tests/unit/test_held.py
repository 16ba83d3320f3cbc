"""held_bytes counts storage once: views, tied parameters, freed storage, optimizer-only parameters."""

from __future__ import annotations

import torch
from torch import nn

from hpml_compile.runtime.observe.held import Held, held_bytes


def test_views_and_tied_parameters_count_once() -> None:
    flat = torch.zeros(10)
    a, b = nn.Parameter(flat[:6]), nn.Parameter(flat[6:])  # two parameters viewing one buffer
    m = nn.Module()
    m.register_parameter("a", a)
    m.register_parameter("b", b)
    m.register_parameter("tied", a)
    assert held_bytes(m) == Held(40, 0, 0)
    a.grad = torch.ones(6)
    b.grad = torch.ones(4)
    assert held_bytes([m, m]).grads == 40


def test_freed_storage_counts_zero_and_optimizer_parameters_count() -> None:
    w = nn.Parameter(torch.ones(8))
    m = nn.Module()
    m.register_parameter("w", w)
    shard = nn.Parameter(torch.ones(4))  # a shard only the optimizer holds
    opt = torch.optim.Adam([shard])
    shard.grad = torch.ones(4)
    opt.step()
    w.data.untyped_storage().resize_(0)
    h = held_bytes(m, opt)
    assert (h.params, h.grads) == (16, 16)
    assert h.optimizer == 2 * 16 + opt.state[shard]["step"].untyped_storage().nbytes()

