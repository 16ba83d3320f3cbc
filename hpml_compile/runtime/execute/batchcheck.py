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

Where the plan's one stage spans every rank (plain data parallelism), that
vector rides the gradient collective (:class:`~..sync.comm.Rider`): it is the
collective's meeting, issued with it (or, for small gradients through gloo,
summed with them as one float64 all-reduce), so the ranks meet once a step, as
DDP's do, not twice. It is summed once every rank has reached its gradient
collective, so the guarantees hold as with an all-reduce of its own after it:
the check is made at ``LOSS`` on the same sums everywhere, before any optimizer
step. Elsewhere (a pipeline, tensor parallelism, a GPU group, a sync that
runs no collective this step) the vector has an all-reduce of its own at
``LOSS``.

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
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from ...errors import BatchMismatchError
from ..sync.comm import Rider

__all__ = ["fingerprint", "contribution", "check_agreed", "Agreement", "StepAgreement", "agree_with_check"]

_BITS = 16
_SAMPLES = 64
# dtypes whose values numpy reads as torch does (bfloat16 and complex go through torch)
_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
                           torch.int64, torch.uint8, torch.bool})


def fingerprint(values: Iterable[Any]) -> int:
    """A 16-bit hash of the shapes, dtypes and a sample of the values of every tensor in ``values``.

    The sample is every ``ceil(n / 64)``-th value (at most 64), hashed as float64 wherever the tensor lives, so
    that ranks holding the same batch on different devices agree. A CPU tensor of a dtype numpy holds is read
    through numpy (a strided view, no index tensor): a third of the cost of gathering through torch, once a step.
    """
    h = 0
    for leaf in _leaves(values):
        if isinstance(leaf, Tensor):
            h = zlib.crc32(f"{tuple(leaf.shape)}{leaf.dtype}".encode(), h)
            n = leaf.numel()
            if n:
                h = zlib.crc32(_sample_bytes(leaf.detach(), -(-n // _SAMPLES)), h)
        elif leaf is not None:
            h = zlib.crc32(repr(leaf).encode(), h)
    return h % (1 << _BITS)


def _leaves(values: Iterable[Any]) -> list[Any]:
    """``tree_leaves(list(values))``: plain tuples and lists of tensors walked here (pytree's walk was a third of
    the check on a batch of two tensors), anything else through pytree."""
    out: list[Any] = []
    for v in values:
        if type(v) is tuple or type(v) is list:
            if all(type(x) is Tensor or x is None for x in v):
                out.extend(x for x in v if x is not None)  # pytree has no leaf for None
                continue
            out.extend(tree_leaves(v))
        elif type(v) is Tensor:
            out.append(v)
        elif v is not None:
            out.extend(tree_leaves(v))
    return out


def _sample_bytes(t: Tensor, stride: int) -> bytes:
    """Every ``stride``-th value of ``t`` (flattened), as float64 bytes (a subclass of Tensor: through torch)."""
    if (type(t) is Tensor and t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and t.layout == torch.strided
            and not t.is_neg()):
        return t.numpy().reshape(-1)[::stride].astype(np.float64).tobytes()
    return t.reshape(-1)[::stride].to("cpu", torch.float64).numpy().tobytes()


def contribution(loss_sum: Tensor, batch_hash: int) -> Tensor:
    """This rank's share of the agreed vector: the loss, then 1, the hash and its square."""
    return torch.tensor([float(loss_sum), 1.0, float(batch_hash), float(batch_hash) ** 2], dtype=torch.float64)


def check_agreed(v: Tensor, step: int) -> None:
    """Raise when the summed vector says that the ranks were given different batches.

    Raises:
        BatchMismatchError: naming the step and what to do.
    """
    _check_sums(*v[1:4].tolist(), step=step)


def _check_sums(c: float, s: float, q: float, *, step: int) -> None:
    """:func:`check_agreed` on the summed count, hash and squared hash."""
    if c > 1 and c * q != s * s:
        raise BatchMismatchError(
            f"step {step}: the {int(c)} ranks were given different batches. Pass every rank the same whole "
            "batch, inputs and targets (each replica takes its own rows of it, the last stage scores the "
            "first stage's rows): load the same batches on every rank, e.g. from the same seed, rather than "
            "a shard per rank")


class Agreement:
    """One step's loss agreement with the batch check: an all-reduce of its own, or a ride on the gradient collective.

    Args:
        all_reduce: a SUM all-reduce over the job's ranks, in place (``torch.distributed.all_reduce``).
        batch_hash: :func:`fingerprint` of the inputs and targets this rank was given.
        step: the step number, for the message.
        rides: the stages of the gradient collective whose group is every rank of the job, on which the vector
            may ride (:meth:`board`); None: it never rides.
    """

    def __init__(self, all_reduce: Callable[[Tensor], Any], batch_hash: int, step: int,
                 rides: tuple[int, ...] | None = None) -> None:
        self.all_reduce, self.batch_hash, self.step, self.rides = all_reduce, batch_hash, step, rides
        self.rider: Rider | None = None

    def board(self, stages: tuple[int, ...], loss_sum: Tensor) -> Rider | None:
        """This rank's share, to ride the gradient collective of ``stages`` (the loss is final by then: every
        forward of the step came before it); None where it may not ride that one."""
        if stages != self.rides or self.rider is not None:
            return None
        self.rider = Rider(stages, contribution(loss_sum, self.batch_hash))
        return self.rider

    @property
    def boarded(self) -> bool:
        """Whether this rank's share went out with the gradient collective (it rode)."""
        return self.rider is not None and self.rider.carried

    def __call__(self, loss_sum: Tensor) -> None:
        """At ``LOSS``: the summed vector (the ride's, else an all-reduce now) made the loss; then the check.

        Raises:
            BatchMismatchError: the ranks were given different batches.
        """
        if self.rider is not None and self.rider.carried:
            v = self.rider.vector
        else:
            v = contribution(loss_sum, self.batch_hash)
            self.all_reduce(v)
        total, c, s, q = v.tolist()  # one read of the four sums
        loss_sum.fill_(total)
        _check_sums(c, s, q, step=self.step)


@dataclass(frozen=True)
class StepAgreement:
    """What the executor is handed as ``agree``: ``agree`` called at ``LOSS`` (True: the process group was
    re-formed to learn the outcome), and ``board`` at a gradient collective (a :class:`~..sync.comm.Rider` for the
    communicator, or None)."""

    agree: Callable[[Tensor], bool]
    board: Callable[[tuple[int, ...], Tensor], Rider | None]

    def __call__(self, loss_sum: Tensor) -> bool:
        return self.agree(loss_sum)


def agree_with_check(all_reduce: Callable[[Tensor], Any], batch_hash: int, step: int,
                     rides: tuple[int, ...] | None = None) -> Agreement:
    """The executor's ``agree`` for a rank: one all-reduce of the loss and the batch hash (or a ride on the
    gradient collective of ``rides``, :class:`Agreement`), then the check.

    Args:
        all_reduce: a SUM all-reduce over the job's ranks, in place (``torch.distributed.all_reduce``).
        batch_hash: :func:`fingerprint` of the inputs and targets this rank was given.
        step: the step number, for the message.
        rides: see :class:`Agreement`.
    """
    return Agreement(all_reduce, batch_hash, step, rides)
