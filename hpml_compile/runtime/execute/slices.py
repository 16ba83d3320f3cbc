"""How a batch splits into microbatches and each microbatch among a stage's replicas, and how slices join again.

Example:
    >>> [tuple(p.shape) for p in split_microbatches(torch.zeros(4, 2), 2)]
    [(2, 2), (2, 2)]
    >>> tuple(merge_outputs([torch.zeros(2, 2), torch.ones(1, 2)]).shape)
    (3, 2)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ...errors import HpmlError
from ...trainspec import Split

__all__ = ["split_microbatches", "split_replicas", "loss_share", "merge_outputs", "to_device"]


def _flatten(value: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """``value``'s leaves and how to rebuild it from new ones: a tensor, or a plain tuple or list of tensors, taken
    apart here (pytree's flatten and unflatten were most of a split of a batch of two tensors, twice a step), the
    rest through pytree."""
    if type(value) is Tensor:
        return [value], lambda leaves: leaves[0]
    if (type(value) is tuple or type(value) is list) and all(type(x) is Tensor for x in value):
        kind = type(value)
        return list(value), kind
    leaves, spec = tree_flatten(value)
    return leaves, lambda new: tree_unflatten(new, spec)


def split_microbatches(value: Any, microbatches: int) -> list[Any]:
    """Split every tensor in ``value`` along dim 0 into ``microbatches`` equal parts.

    Raises:
        HpmlError: if a tensor's first dimension does not divide evenly.
    """
    leaves, rebuild = _flatten(value)
    parts: list[list[Any]] = [[] for _ in range(microbatches)]
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            if leaf.dim() == 0 or leaf.shape[0] % microbatches:
                raise HpmlError(f"a batch of shape {tuple(leaf.shape)} does not split into {microbatches} equal "
                                "microbatches along its first dimension; use a batch divisible by it")
            chunks: Sequence[Any] = leaf.tensor_split(microbatches, dim=0)
        else:
            chunks = [leaf] * microbatches
        for j in range(microbatches):
            parts[j].append(chunks[j])
    return [rebuild(p) for p in parts]


def split_replicas(value: Any, split: Split) -> list[Any]:
    """Split every tensor in one microbatch ``value`` along dim 0 among a stage's replicas.

    ``split`` is the stage's :data:`~hpml_compile.trainspec.Split`: a replica
    count (equal parts) or the plan's rows of each replica (consecutive runs).

    Example:
        >>> [tuple(p.shape) for p in split_replicas(torch.zeros(4, 2), (3, 1))]
        [(3, 2), (1, 2)]

    Raises:
        HpmlError: a tensor's rows do not split so.
    """
    if split == 1:
        return [value]  # one replica takes the microbatch as it is
    if isinstance(split, int):
        return split_microbatches(value, split)
    leaves, rebuild = _flatten(value)
    parts: list[list[Any]] = [[] for _ in split]
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            if leaf.dim() == 0 or leaf.shape[0] != sum(split):
                raise HpmlError(f"a microbatch of shape {tuple(leaf.shape)} does not split into the plan's rows "
                                f"{list(split)} per replica: its first dimension must be {sum(split)}")
            chunks: Sequence[Any] = leaf.split(list(split), dim=0)
        else:
            chunks = [leaf] * len(split)
        for r, c in enumerate(chunks):
            parts[r].append(c)
    return [rebuild(p) for p in parts]


def loss_share(loss: Tensor, split: Split, replica: int, microbatches: int) -> Tensor:
    """One slice's loss (a mean over its rows) as its share of the batch mean.

    Equal replicas: ``/ (microbatches x replicas)``; plan rows: ``x rows[r] / (microbatches x sum(rows))``, so a
    replica's gradient counts by its rows and their plain sum is the batch mean's gradient.
    """
    if isinstance(split, int):
        # one slice is the whole batch: no division (an op in the forward and one in the backward)
        return loss if microbatches * split == 1 else loss / (microbatches * split)
    return loss * (split[replica] / (microbatches * sum(split)))


def merge_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate outputs of consecutive slices along dim 0 (tensors anywhere in a tuple/dict/``ModelOutput``).

    A scalar (a loss the model returns) has no rows: the slices' values are stacked instead.
    """
    flat = [tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    cols = zip(*(leaves for leaves, _ in flat))
    return tree_unflatten([(torch.cat(c) if c[0].dim() else torch.stack(c)) if isinstance(c[0], Tensor) else c[0]
                           for c in cols], spec)


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor not on ``device`` moved there."""
    if type(value) is Tensor:
        return value if value.device == device else value.to(device)
    return tree_map(lambda t: t.to(device) if isinstance(t, Tensor) and t.device != device else t, value)
