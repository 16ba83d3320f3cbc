"""The batch hash reads the same sample whichever way it reads a tensor, and sees a change in the sample."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from hpml_compile.runtime.execute.batchcheck import _sample_bytes, fingerprint


def _through_torch(t: torch.Tensor, stride: int) -> bytes:
    return t.reshape(-1)[::stride].to("cpu", torch.float64).numpy().tobytes()


@pytest.mark.parametrize("make", [
    lambda x: x, lambda x: x.half(), lambda x: x.bfloat16(), lambda x: (x * 100).long(), lambda x: x > 0,
    lambda x: x.t(), lambda x: x[:, ::3], lambda x: x.requires_grad_().detach(),
])
def test_sample_is_the_same_through_numpy_and_torch(make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    t = make(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)))
    for stride in (1, 3, 64):
        assert _sample_bytes(t, stride) == _through_torch(t, stride)


def test_hash_follows_shape_dtype_and_sampled_values() -> None:
    x = torch.arange(256.0).reshape(64, 4)
    y = x.clone()
    assert fingerprint([x, 1]) == fingerprint([y, 1])
    y.view(-1)[4] += 1  # every 4th value is sampled (256 values, 64 samples)
    assert fingerprint([x]) != fingerprint([y])
    assert fingerprint([x]) != fingerprint([x.reshape(128, 2)])
    assert fingerprint([x]) != fingerprint([x.double()])


@pytest.mark.parametrize("values", [
    [(torch.ones(2, 3), torch.zeros(2)), torch.arange(4.0)],
    [[torch.ones(2), None, torch.zeros(1)], None],
    [(torch.ones(2), 3), {"y": torch.zeros(2), "w": [torch.ones(1)]}],
    [torch.nn.Parameter(torch.ones(2)), ((torch.ones(1),),)],
    [(), [], 7],
])
def test_leaves_walked_directly_are_pytrees_in_its_order(values: list[object]) -> None:
    from torch.utils._pytree import tree_leaves

    from hpml_compile.runtime.execute.batchcheck import _leaves

    got, want = _leaves(values), [x for x in tree_leaves(list(values)) if x is not None]
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
