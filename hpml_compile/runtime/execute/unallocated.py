"""Build a model without its parameters' memory, so that a rank holds only its own stage's weights.

When the weights come from a file (``TrainSpec.weights``), a rank has no use for the values the model's
constructor draws: it overwrites its own stage's tensors from the file and never reads the others. The
model is built inside :func:`parameters_unallocated`, which moves every parameter to the meta device as
it is registered (what ``accelerate.init_empty_weights`` does; that package is not a dependency): the
constructor's initialisation then touches no memory. Buffers are built as the model builds them, so a
buffer that is not saved (rotary ``inv_freq``, a causal mask) equals a normal build's.

:func:`reserve_parameters` then gives each meta parameter CPU storage from an anonymous memory map that
nothing has written: the kernel commits a page only when it is first written, so a parameter costs no
resident memory until the weights are copied into it, and the others never do. The parameters are
then real CPU tensors, and the re-trace each rank makes (``load_build`` checks its hash against the
compile's) gives the CPU compile's graph. Tracing meta parameters instead does not: ``torch.export``
records the device of tensors the model makes from its parameters' (``arange(..., device=x.device)``),
so the graph would say ``meta``. Reserved memory keeps them real CPU tensors, so the trace cannot differ
(``torch.export`` fakes them itself and reads no value), with nothing to fake by hand.

Example:
    >>> import torch
    >>> with parameters_unallocated():
    ...     lin = torch.nn.Linear(4, 4)
    >>> lin.weight.is_meta
    True
    >>> reserve_parameters(lin)
    2
    >>> lin.weight.device.type, lin.weight.requires_grad
    ('cpu', True)
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Iterator

import torch
from torch import nn

__all__ = ["parameters_unallocated", "reserve_parameters"]


@contextlib.contextmanager
def parameters_unallocated() -> Iterator[None]:
    """Inside, every parameter a module registers is moved to the meta device (buffers stay as made).

    A parameter registered again under another name (tied embeddings) is the same meta parameter.
    """
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and not param.is_meta:
            kind = type(param)
            self._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _reserved(like: torch.Tensor) -> torch.Tensor:
    """An unwritten CPU tensor shaped like ``like``: anonymous mapped pages, committed on first write."""
    nbytes = like.numel() * like.element_size()
    if nbytes == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    buf = mmap.mmap(-1, nbytes)  # zero pages until written; unmapped when the tensor is freed
    return torch.frombuffer(buf, dtype=like.dtype, count=like.numel()).view(like.shape)


def reserve_parameters(model: nn.Module) -> int:
    """Give each meta parameter of ``model`` unwritten CPU storage, keeping tied parameters one tensor.

    Args:
        model: a model built inside :func:`parameters_unallocated`.

    Returns:
        How many parameters were given storage.
    """
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                done[id(p)] = type(p)(_reserved(p), requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]
    return len(done)
