"""The bytes a rank really holds: parameters, gradients and optimizer state, counted by tensor storage.

The memory model (:func:`hpml_compile.stagecost.memory_parts`) predicts what
one device of a stage holds; this module measures it on the live objects, so
that a test or a benchmark can put the two side by side. It counts *storage*,
not tensors: every tensor is keyed by ``untyped_storage().data_ptr()`` and the
storage's ``nbytes()`` is counted once, so

- a view (a parameter that is a slice of a flat buffer, a gradient that views
  a bucket) counts its whole storage, once;
- a tied parameter (one tensor bound under two names, or two stages in one
  process sharing it) counts once;
- a storage that was freed by resizing it to 0 bytes (a sharded parameter
  between uses) counts 0.

A storage is counted in the first category that reaches it, in the order
parameters, gradients, optimizer state: a gradient that aliases a parameter's
storage is not counted twice. Parameters an optimizer steps that no module
holds (a flat fp32 shard the runtime built, master weights) are counted as
``params`` too: they are parameter bytes the rank holds. Buffers (BatchNorm
statistics) and activations are not counted here.

On a GPU the same counting applies per device; ``torch.cuda.max_memory_allocated``
is the allocator's view, which also sees activations and fragmentation.

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(4, 4)                      # 16 + 4 floats
    >>> opt = torch.optim.Adam(lin.parameters())
    >>> lin(torch.ones(2, 4)).sum().backward(); opt.step()
    >>> h = held_bytes([lin, lin], opt)                 # the module twice: counted once
    >>> h.params, h.grads, h.optimizer - 2 * 4, h.total == h.params + h.grads + h.optimizer
    (80, 80, 160, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor, nn

__all__ = ["Held", "held_bytes"]


@dataclass(frozen=True, slots=True)
class Held:
    """Bytes one rank holds, by what holds them (each storage counted once).

    Attributes:
        params: parameter storage (module parameters, and any parameter the optimizer steps).
        grads: gradient storage of those parameters.
        optimizer: optimizer state storage (Adam's moments and step counters).
    """

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        """Parameters, gradients and optimizer state together."""
        return self.params + self.grads + self.optimizer


def _tensors(value: Any) -> Iterator[Tensor]:
    """Every tensor inside an optimizer state value (tensors, dicts, lists, tuples)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class _Counter:
    def __init__(self) -> None:
        self.seen: set[tuple[torch.device, int]] = set()

    def add(self, t: Tensor | None) -> int:
        """Bytes of ``t``'s storage if it was not counted yet, else 0."""
        if t is None:
            return 0
        s = t.untyped_storage()
        n = s.nbytes()
        if n == 0:
            return 0
        key = (t.device, s.data_ptr())
        if key in self.seen:
            return 0
        self.seen.add(key)
        return n


def held_bytes(modules: nn.Module | Iterable[nn.Module], optimizer: torch.optim.Optimizer | None = None,
               *, extra_params: Iterable[Tensor] = ()) -> Held:
    """Count the parameter, gradient and optimizer-state bytes a rank holds (see the module docstring).

    Args:
        modules: the rank's stage modules (or one module).
        optimizer: the rank's optimizer (its parameter groups and its state), if any.
        extra_params: other tensors the rank holds as parameters (a shard kept outside any optimizer).

    Returns:
        The bytes, each storage counted once.
    """
    mods = [modules] if isinstance(modules, nn.Module) else list(modules)
    params: list[Tensor] = [p for m in mods for p in m.parameters()]
    if optimizer is not None:
        params += [p for g in optimizer.param_groups for p in g["params"]]
    params += list(extra_params)
    c = _Counter()
    n_params = sum(c.add(p) for p in params)
    n_grads = sum(c.add(p.grad) for p in params)
    n_opt = 0
    if optimizer is not None:
        n_opt = sum(c.add(t) for state in optimizer.state.values() for t in _tensors(state))
    return Held(n_params, n_grads, n_opt)
