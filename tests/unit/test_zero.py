"""runtime.sync.zero in one process: a flat shard steps like the plain optimizer, and its state maps to names and back.

Two or three replicas run on real gloo ranks in tests/dist/test_zero_dist.py; here one replica owns the whole
flat buffer, which checks the views, the padding-free layout and the name mapping of the checkpoint state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpml_compile.errors import HpmlError
from hpml_compile.runtime.observe.held import held_bytes
from hpml_compile.runtime.sync.zero import FlatGrads, FlatShard, full_optimizer_state, load_full_optimizer_state


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _step(model: nn.Module, opt: torch.optim.Optimizer, shard: FlatShard | None) -> None:
    if shard is not None:
        shard.begin_step()
    model(torch.ones(5, 4)).pow(2).sum().backward()
    if shard is not None:  # one replica: the reduce-scatter is the identity
        shard.param.grad = shard.grad_flat[shard.owned]
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1)])
def test_flat_shard_steps_like_the_plain_optimizer_and_saves_by_name(make) -> None:
    ref, ours = _model(), _model()
    ref_opt = make(ref.parameters())
    shard = FlatShard(0, list(ours.parameters()), replicas=1, replica=0, zero=1)
    opt = make([shard.param])
    opt.hpml_zero = [shard]
    for _ in range(3):
        _step(ref, ref_opt, None)
        _step(ours, opt, shard)
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b)
    assert held_bytes(ours, opt).params == 4 * sum(p.numel() for p in ours.parameters())  # views, counted once
    state = full_optimizer_state(ours, opt)
    names = dict(ref.named_parameters())
    for name, per in state.items():
        for key, value in per.items():
            torch.testing.assert_close(value, ref_opt.state[names[name]][key], msg=f"{name}.{key}")
    # loaded into a fresh shard, the next step is the reference's
    fresh = _model()
    fresh.load_state_dict(ours.state_dict())
    shard2 = FlatShard(0, list(fresh.parameters()), replicas=1, replica=0, zero=2)
    opt2 = make([shard2.param])
    opt2.hpml_zero = [shard2]
    load_full_optimizer_state(fresh, opt2, state)
    _step(ref, ref_opt, None)
    _step(fresh, opt2, shard2)
    for a, b in zip(ref.parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b)


def test_zero3_and_mixed_dtypes_are_refused() -> None:
    m = _model()
    with pytest.raises(HpmlError, match="not ZeRO-3"):
        FlatShard(0, list(m.parameters()), replicas=2, replica=0, zero=3)
    m[2].double()
    with pytest.raises(HpmlError, match="one flat buffer"):
        FlatShard(0, list(m.parameters()), replicas=2, replica=0, zero=1)


def test_flat_grads_accumulate_in_the_buffer_step_after_step_and_repoint_a_cleared_gradient() -> None:
    ref, ours = _model(), _model()
    grads = FlatGrads(0, list(ours.parameters()))
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(ours.parameters(), lr=0.1)
    views = None
    for step in range(3):
        if step == 2:  # a user's zero_grad(set_to_none=True) between steps: the slice is pointed at again
            ours[0].weight.grad = None
        grads.begin_step()
        if views is None:
            views = [p.grad for p in ours.parameters()]
        # the same views every step, each a slice of the one zeroed buffer
        assert all(p.grad is v for p, v in zip(ours.parameters(), views))
        assert all(p.grad.untyped_storage().data_ptr() == grads.grad_flat.untyped_storage().data_ptr()
                   for p in ours.parameters())
        assert float(grads.grad_flat.abs().sum()) == 0.0
        for model, o in ((ref, ref_opt), (ours, opt)):
            model(torch.ones(5, 4) * (step + 1)).pow(2).sum().backward()
            o.step()
        ref_opt.zero_grad(set_to_none=True)
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b)

