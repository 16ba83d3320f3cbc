"""Tensors a graph reads that the user's model does not hold: carried by the build as data.

``torch.export`` lifts tensors that ``forward`` makes (a ``torch.tensor(...)``
scale, a mask built from constants) into the graph as constants. They are
not attributes of the model, so a stage cannot bind them by name; the build
carries them in ``constants.safetensors`` (listed in the manifest with its
hash, as every data file) and binds them from there. Safetensors holds only
tensors: loading it runs no code.

Example:
    >>> import torch
    >>> data = constants_bytes({"lifted_tensor_0": torch.tensor([2.0])})
    >>> read_constants(data)["lifted_tensor_0"]
    tensor([2.])
"""

from __future__ import annotations

from typing import Mapping

import torch
from safetensors.torch import load, save

__all__ = ["CONSTANTS_FILE", "constants_bytes", "read_constants"]

CONSTANTS_FILE = "constants.safetensors"


def constants_bytes(constants: Mapping[str, torch.Tensor]) -> bytes:
    """The safetensors bytes of ``constants`` (each copied, contiguous, on the CPU; keys sorted)."""
    return save({k: constants[k].detach().to("cpu").contiguous().clone() for k in sorted(constants)})


def read_constants(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of :func:`constants_bytes`'s output."""
    return dict(load(data))
