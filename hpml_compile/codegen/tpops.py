"""The collectives a tensor-parallel stage runs, as autograd functions (Megatron-LM's ``f`` and ``g``).

Codegen inserts calls to these into the graph of a stage with ``tp > 1``
(:mod:`.tensor_parallel`); each takes the stage's :class:`TPGroup`
(``stage.hpml_tp``, set by the runtime) first:

- :func:`tp_copy` (``f``): identity forward, all-reduce of the gradient
  backward; put before a unit's column layers, whose input ``X`` every rank
  holds whole.
- :func:`tp_row`: the row layer on this rank's input features, all-reduced
  forward (``g``), the bias added once after the sum; identity backward.
- :func:`tp_embedding`: a lookup in this rank's rows of the vocabulary
  (tokens outside them give zeros), all-reduced forward.
- :func:`tp_head`: the LM head on this rank's slice of the vocabulary,
  all-gathered along the last dimension forward; backward takes this rank's
  slice of the gradient and all-reduces the gradient of the input.

Why not DTensor: a stage's graph calls its linear layers either as
submodules (``torch.fx``) or as ``aten.linear`` on lifted weights
(``torch.export``), and the runtime keeps every parameter a plain tensor (its
flat gradient buffers, ZeRO shards, optimizer factories and checkpoints take
plain tensors); ``parallelize_module`` rewrites submodules and makes the
parameters DTensors. Four small autograd functions over ``torch.distributed``
express what the graph needs on both kinds of graph.

Example:
    >>> import torch
    >>> g = TPGroup(None, 0, 1)
    >>> x = torch.randn(2, 3, requires_grad=True)
    >>> tp_copy(g, x).sum().backward()
    >>> x.grad.tolist() == torch.ones(2, 3).tolist()
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import HpmlError

__all__ = ["TPGroup", "tp_copy", "tp_row", "tp_embedding", "tp_head"]


@dataclass(frozen=True, slots=True)
class TPGroup:
    """The ranks sharing a stage's sharded layers.

    Attributes:
        group: the process group, used through its own methods (``allreduce``, ``allgather``): a gloo group
            the runtime makes on the job's store outside the default group; or an object whose ``tp_group``
            is that group (the runtime's session, which forms it again after a failed step). None: one rank.
        rank: this rank's place in the group (which shard it holds).
        size: the degree ``tp``.
    """

    group: Any
    rank: int
    size: int

    def all_reduce(self, t: Tensor) -> Tensor:
        """``t`` summed over the group (a new tensor)."""
        out = t.contiguous().clone()
        if self.size > 1:
            self.process_group().allreduce([out]).wait()
        return out

    def all_gather_last(self, t: Tensor) -> Tensor:
        """The group's ``t`` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.process_group().allgather([parts], [t]).wait()
        return torch.cat(parts, dim=-1)

    def process_group(self) -> Any:
        """The process group now (the session's current one where :attr:`group` is a session)."""
        return getattr(self.group, "tp_group", self.group)


def _check(group: TPGroup | None) -> TPGroup:
    if not isinstance(group, TPGroup):
        raise HpmlError("this stage is one rank's shard of a tensor-parallel stage (tp > 1) and runs only on the "
                        "plan's ranks: start one process per device (hpml-compile run --nproc N, or "
                        "Pipeline.from_build with init_method), or compile with --max-tp 1 to run in one process")
    return group


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: TPGroup, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:  # type: ignore[override]
        return None, ctx.group.all_reduce(grad)


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: TPGroup, x: Tensor) -> Tensor:  # type: ignore[override]
        return group.all_reduce(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:  # type: ignore[override]
        return None, grad


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: TPGroup, x: Tensor) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.width = group, x.shape[-1]
        return group.all_gather_last(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:  # type: ignore[override]
        g, w = ctx.group, ctx.width
        return None, grad[..., g.rank * w:(g.rank + 1) * w].contiguous()


def tp_copy(group: TPGroup, x: Tensor) -> Tensor:
    """``x`` unchanged; its gradient all-reduced over the group (the input of a unit's column layers)."""
    return _Copy.apply(_check(group), x)


def tp_row(group: TPGroup, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """A row-split linear layer: ``x`` (this rank's input features) times this rank's columns of ``weight``,
    summed over the group, plus ``bias`` (whole, added once)."""
    out = _Reduce.apply(_check(group), F.linear(x, weight))
    return out if bias is None else out + bias


def tp_embedding(group: TPGroup, idx: Tensor, weight: Tensor) -> Tensor:
    """A lookup in a vocabulary split by rows: this rank holds rows ``rank * n .. (rank + 1) * n`` of the
    table (``n`` = its rows); tokens outside them look up zeros, and the group's lookups are summed."""
    n = weight.shape[0]
    start = _check(group).rank * n
    inside = (idx >= start) & (idx < start + n)
    local = torch.where(inside, idx - start, torch.zeros_like(idx))
    out = F.embedding(local, weight) * inside.unsqueeze(-1).to(weight.dtype)
    return _Reduce.apply(group, out)


def tp_head(group: TPGroup, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """An output layer split by output features (the vocabulary): every rank's slice, gathered in rank order."""
    return _Gather.apply(_check(group), F.linear(tp_copy(group, x), weight, bias))
