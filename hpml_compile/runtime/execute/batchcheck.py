"""Every rank trains on the batch the plan says it does: a cheap check, agreed with the loss all-reduce.

A build's ranks are all handed the whole batch; each replica of a stage takes
its own rows of it, the first stage's replicas from the inputs and the last
stage's from the targets. A user who gives each rank its own shard (what a
data-parallel loop of their own would do) gets no error from the tensors,
whose shapes agree: replicas train on half of each batch, and a pipeline's
last stage scores the first stage's outputs against another batch's targets.
So each rank hashes what it was given (shapes, dtypes and up to 64 evenly
spaced values of every tensor of the inputs and the targets: microseconds),
and the hashes travel in the all-reduce that already makes the step's loss
the batch's: one vector of 4 float64s instead of one.

The test, exact in float64: for ``c`` ranks with 16-bit hashes ``h_i``, all
``h_i`` are equal iff ``c * sum(h_i^2) == sum(h_i)^2`` (Cauchy-Schwarz), and
the sums stay below 2^53 up to 1024 ranks. Two different batches share a hash with probability 2^-16 in one
step; a loop that keeps giving different batches is caught at once in
practice. Every rank sees the same sums, so every rank raises at the same
``LOSS`` action, before any optimizer step, and none is left waiting.

Example:
    >>> import torch
    >>> a, b = torch.arange(12.).reshape(4, 3), torch.arange(12.).reshape(4, 3)
    >>> fingerprint([a]) == fingerprint([b]), fingerprint([a]) == fingerprint([a + 1])
    (True, False)
    >>> v = torch.zeros(4, dtype=torch.float64)
    >>> for h in (5, 5):  # two ranks, the same batch
    ...     v += contribution(torch.tensor(0.0, dtype=torch.float64), h)
    >>> check_agreed(v, step=1)
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from ...errors import BatchMismatchError

__all__ = ["fingerprint", "contribution", "check_agreed", "agree_with_check"]

_BITS = 16
_SAMPLES = 64


def fingerprint(values: Iterable[Any]) -> int:
    """A 16-bit hash of the shapes, dtypes and a sample of the values of every tensor in ``values``."""
    h = 0
    for leaf in tree_leaves(list(values)):
        if isinstance(leaf, Tensor):
            h = zlib.crc32(f"{tuple(leaf.shape)}{leaf.dtype}".encode(), h)
            flat = leaf.detach().reshape(-1)
            if flat.numel():
                idx = torch.linspace(0, flat.numel() - 1, min(_SAMPLES, flat.numel()), device=flat.device).long()
                h = zlib.crc32(flat[idx].to("cpu", torch.float64).numpy().tobytes(), h)
        elif leaf is not None:
            h = zlib.crc32(repr(leaf).encode(), h)
    return h % (1 << _BITS)


def contribution(loss_sum: Tensor, batch_hash: int) -> Tensor:
    """This rank's share of the agreed vector: the loss, then 1, the hash and its square."""
    return torch.tensor([float(loss_sum), 1.0, float(batch_hash), float(batch_hash) ** 2], dtype=torch.float64)


def check_agreed(v: Tensor, step: int) -> None:
    """Raise when the summed vector says that the ranks were given different batches.

    Raises:
        BatchMismatchError: naming the step and what to do.
    """
    c, s, q = (float(x) for x in v[1:4])
    if c > 1 and c * q != s * s:
        raise BatchMismatchError(
            f"step {step}: the {int(c)} ranks were given different batches. Pass every rank the same whole "
            "batch, inputs and targets (each replica takes its own rows of it, the last stage scores the "
            "first stage's rows): load the same batches on every rank, e.g. from the same seed, rather than "
            "a shard per rank")


def agree_with_check(all_reduce: Callable[[Tensor], Any], batch_hash: int, step: int) -> Callable[[Tensor], None]:
    """The executor's ``agree`` for a rank: one all-reduce of the loss and the batch hash, then the check.

    Args:
        all_reduce: a SUM all-reduce over the job's ranks, in place (``torch.distributed.all_reduce``).
        batch_hash: :func:`fingerprint` of the inputs and targets this rank was given.
        step: the step number, for the message.
    """
    def agree(loss_sum: Tensor) -> None:
        v = contribution(loss_sum, batch_hash)
        all_reduce(v)
        loss_sum.copy_(v[0].to(loss_sum.dtype))
        check_agreed(v, step)

    return agree
