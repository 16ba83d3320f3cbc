"""Mixed precision as the profile, codegen and runtime apply it: the compute dtype, autocast, the wire dtype.

A plan trains in one :class:`~hpml_compile.ir.Precision` (``fp32``, ``bf16``
or ``fp16``), recorded in profile.json, plan.json and the build's manifest.
Under ``bf16``/``fp16``:

- **autocast** (``torch.autocast``) wraps each stage's forward (and the loss)
  on the stage's own device type, CPU included: matmuls and convolutions run
  in the compute dtype, precision-sensitive ops (softmax, norms, losses) in
  fp32, as torch's autocast op lists decide. The backward runs outside it and
  follows the dtypes of the forward.
- **master weights**: parameters, their gradients and the optimizer state stay
  fp32; autocast casts a weight to the compute dtype where an op uses it (the
  cast is cached for the one forward call and saved for its backward: the
  profile counts it among the activations).
- **the wire**: every floating-point tensor crossing a stage boundary, and its
  gradient coming back, travels in the compute dtype (half the bytes of fp32);
  :func:`wire_dtype` gives the dtype codegen writes into each boundary spec.
- **fp16 loss scaling**: see :mod:`hpml_compile.runtime.execute.scaler`.

Why autocast and not casting the model: the master weights must stay fp32
for the optimizer (an fp16/bf16 weight loses small updates), and autocast's
op lists keep the numerically delicate ops in fp32 without a hand-kept list
of ours. This module keeps only the mapping from the plan's precision to
torch's dtypes, so that every pass uses the same one.

Example:
    >>> import torch
    >>> from hpml_compile.ir import Precision
    >>> torch_dtype(Precision.BF16), wire_dtype(torch.float32, Precision.FP16), wire_dtype(torch.int64, "bf16")
    (torch.bfloat16, torch.float16, torch.int64)
    >>> with autocast("cpu", "bf16"):
    ...     y = torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))
    >>> y.dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .ir import Precision

__all__ = ["Precision", "torch_dtype", "wire_dtype", "autocast"]

_TORCH = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def torch_dtype(precision: Precision | str) -> torch.dtype:
    """The compute dtype of ``precision`` as a torch dtype."""
    return _TORCH[Precision(precision)]


def wire_dtype(dtype: torch.dtype, precision: Precision | str) -> torch.dtype:
    """The dtype a boundary tensor of traced ``dtype`` crosses in: the compute dtype for a floating one."""
    p = Precision(precision)
    if p.is_mixed and dtype.is_floating_point:
        return _TORCH[p]
    return dtype


def autocast(device_type: str, precision: Precision | str, *, cache: bool = True) -> Any:
    """``torch.autocast`` to the compute dtype on ``device_type`` (``cpu``, ``cuda``); nothing for fp32.

    Args:
        device_type: the device type the ops run on.
        precision: the plan's precision.
        cache: keep each weight's cast for the rest of the context (the runtime: one stage call); the
            profile times nodes without it, so that every timed call pays its casts as a stage call does.
    """
    p = Precision(precision)
    if not p.is_mixed:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=_TORCH[p], cache_enabled=cache)
