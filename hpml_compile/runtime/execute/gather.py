"""Collect what is spread over the ranks: the full model's state, and the outputs of an evaluation pass.

Every rank builds the whole model and binds only its stage, so after
training each rank holds current values for its stage's tensors and stale
initial values for the rest. :func:`gather_state_dict` gives every rank the
current full state under the original names: the owner of a tensor is the
first rank of the first stage that binds it (tied parameters, which several
stages bind, are kept equal by their all-reduce); each owner broadcasts its
tensors flattened, one broadcast per owner and dtype, through the default
(gloo) group, from host memory.

Example:
    >>> import torch
    >>> flat, spans = flatten([torch.ones(2, 2), torch.zeros(3)])
    >>> flat.shape, [tuple(t.shape) for t in unflatten(flat, spans)]
    (torch.Size([7]), [(2, 2), (3,)])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...codegen import Build
from ...plan import Plan
from .executor import merge_outputs, stage_ranks

__all__ = ["flatten", "unflatten", "tensor_owners", "gather_state_dict", "gather_outputs"]


def flatten(tensors: list[Tensor]) -> tuple[Tensor, list[torch.Size]]:
    """One flat CPU tensor of ``tensors`` (same dtype) and their shapes."""
    if not tensors:
        return torch.empty(0), []
    return torch.cat([t.detach().reshape(-1).cpu() for t in tensors]), [t.shape for t in tensors]


def unflatten(flat: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    """The tensors :func:`flatten` packed, as fresh tensors."""
    out, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        out.append(flat[offset:offset + n].view(shape).clone())
        offset += n
    return out


def tensor_owners(model: nn.Module, build: Build, ranks: list[list[int]] | None = None
                  ) -> dict[str, tuple[int, Tensor | None]]:
    """For each state-dict key of ``model``: the owning rank and, on that rank, the stage's tensor.

    Keys that name the same tensor (tied weights) share an owner. A key no
    stage binds is owned by rank 0 (its value is the model's own). ``ranks``: each stage's ranks, the first
    one owning its tensors (None: the build's plan's).
    """
    ranks = ranks if ranks is not None else stage_ranks(build.plan)
    state = model.state_dict(keep_vars=True)
    alias: dict[int, list[str]] = {}
    for key, t in state.items():
        alias.setdefault(id(t), []).append(key)
    owner: dict[str, tuple[int, Tensor | None]] = {}
    for k, stage in enumerate(build.stages):
        held = {**dict(stage.named_parameters(remove_duplicate=False)),
                **dict(stage.named_buffers(remove_duplicate=False))}
        by_id = {id(t): t for t in held.values()}
        for key, t in state.items():
            if key in owner:
                continue
            mine = held.get(key)
            if mine is None and id(t) in by_id:  # bound under another name (a tied alias)
                mine = by_id[id(t)]
            if mine is not None:
                for name in alias[id(t)]:
                    owner.setdefault(name, (ranks[k][0], mine))
    for key, t in state.items():
        owner.setdefault(key, (0, t))
    return owner


def _value(held: Tensor | None, own: Tensor) -> Tensor:
    return held if held is not None else own


def gather_state_dict(model: nn.Module, build: Build, rank: int, ranks: list[list[int]] | None = None
                      ) -> dict[str, Tensor]:
    """The full model's current state on every rank (collective: every rank must call it).

    Args:
        model: this rank's model (the one the build is bound to).
        build: the build.
        rank: this rank.
        ranks: each stage's ranks, the same on every rank (None: the build's plan's); the first one of a stage
            sends its tensors.

    Returns:
        Original names -> CPU tensors.
    """
    owners = tensor_owners(model, build, ranks)
    state = model.state_dict(keep_vars=True)
    out: dict[str, Tensor] = {}
    groups: dict[tuple[int, torch.dtype], list[str]] = {}
    first: dict[int, str] = {}
    for key, (src, _) in owners.items():
        t = state[key]
        if id(t) in first:  # a tied alias: filled from its first name below
            continue
        first[id(t)] = key
        groups.setdefault((src, t.dtype), []).append(key)
    for (src, dtype), keys in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        shapes = [state[k].shape for k in keys]
        if rank == src:
            flat, _ = flatten([_value(owners[k][1], state[k]) for k in keys])
        else:
            flat = torch.empty(sum(int(s.numel()) for s in shapes), dtype=dtype)
        dist.broadcast(flat, src)
        for key, value in zip(keys, unflatten(flat, shapes)):
            out[key] = value
    for key, t in state.items():
        if key not in out:
            out[key] = out[first[id(t)]]
    return {k: out[k] for k in state}


def gather_outputs(outs: list[tuple[int, int, Any]], plan: Plan, rank: int, everywhere: bool,
                   last: list[int] | None = None) -> Any:
    """Merge the last stage's ``(microbatch, replica, output)`` slices into the batch output.

    Collective when the last stage has several replicas or ``everywhere`` is
    set (then every rank must call it with the same ``everywhere``).

    Returns:
        The output on the last stage's ranks (every rank with ``everywhere``), else None.
    """
    last = last if last is not None else stage_ranks(plan)[-1]
    if len(last) == 1 and not everywhere:
        return merge_outputs([o for _, _, o in sorted(outs, key=lambda t: (t[0], t[1]))]) if rank in last else None
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, outs)
    pieces = sorted((t for r in last for t in every[r]), key=lambda t: (t[0], t[1]))
    return merge_outputs([o for _, _, o in pieces]) if everywhere or rank in last else None
