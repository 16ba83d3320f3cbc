"""The per-device memory model shared by the solvers, the simulator and plan validation.

One device of a pipeline stage replicated over ``d`` devices holds:

- parameters ``P`` (ZeRO-3 shards them: ``P / d``),
- gradients ``P`` (ZeRO-2 and ZeRO-3 shard them: ``P / d``),
- Adam state: two fp32 tensors per parameter, ``8 * P / dtype_bytes`` (ZeRO-1/2/3
  shard it: ``/ d``; optimizer offload moves it to host memory: 0 on the device),
  following ZeRO (Rajbhandari et al., SC 2020). Mixed-precision fp32 master
  weights are not modelled.
- activations: what autograd saves for one microbatch on one replica is
  ``A / (M * d)`` (the profile's ``A`` is for the whole batch), times the
  microbatches in flight: all ``M`` under GPipe (Huang et al., NeurIPS 2019),
  ``min(M, S - i)`` for stage ``i`` of ``S`` under 1F1B (Narayanan et al.,
  SOSP 2019). With recompute (checkpointing) only the stage's input is kept
  per microbatch in flight, plus one microbatch's activations while its
  backward runs; swapped activations leave the device after the forward and
  come back for one microbatch's backward.

Example:
    >>> m = device_memory(param_bytes=100, activation_bytes=80, input_bytes=8, dtype_bytes=4,
    ...                   replicas=2, zero=ZeroStage.OS, microbatches=4, in_flight=2)
    >>> (m.params, m.grads, m.optimizer, m.stored_per_microbatch, m.total)
    (100, 100, 100, 10, 320)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["ZeroStage", "MemoryBreakdown", "device_memory", "dtype_bytes", "GiB"]

GiB = 2**30


class ZeroStage(enum.IntEnum):
    """ZeRO stage of a replicated stage: what is sharded over its replicas."""

    NONE = 0  # plain data parallel: everything replicated
    OS = 1  # optimizer state sharded
    OS_G = 2  # + gradients
    OS_G_P = 3  # + parameters


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a profile dtype name (``"float32"`` -> 4)."""
    return {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 4)


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes on one device of a stage, by what holds them.

    Attributes:
        params: parameter bytes.
        grads: gradient bytes.
        optimizer: Adam state bytes on the device.
        stored_per_microbatch: activation bytes kept per microbatch in flight.
        working: activation bytes of the one microbatch whose backward runs
            (recomputed or swapped back in).
        in_flight: microbatches whose activations are kept at the peak.
        host_bytes: bytes moved to host memory (offloaded optimizer state).
    """

    params: int
    grads: int
    optimizer: int
    stored_per_microbatch: int
    working: int
    in_flight: int
    host_bytes: int = 0

    @property
    def static(self) -> int:
        """Bytes held for the whole step: parameters, gradients, optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def activations(self) -> int:
        """Activation bytes at the peak."""
        return self.in_flight * self.stored_per_microbatch + self.working

    @property
    def total(self) -> int:
        """Peak bytes on the device."""
        return self.static + self.activations


def device_memory(*, param_bytes: int, activation_bytes: int, input_bytes: int, dtype_bytes: int,
                  replicas: int, zero: ZeroStage | int, microbatches: int, in_flight: int,
                  recompute: bool = False, swapped_bytes: int = 0, offload_optimizer: bool = False,
                  host_is_device: bool = False) -> MemoryBreakdown:
    """Peak memory of one device of a stage (see the module docstring for the model).

    Args:
        param_bytes: parameter bytes of the whole stage.
        activation_bytes: activation bytes the stage saves for the whole batch.
        input_bytes: bytes entering the stage for the whole batch (kept under recompute).
        dtype_bytes: bytes per parameter element.
        replicas: data-parallel degree ``d`` of the stage.
        zero: ZeRO stage.
        microbatches: ``M``.
        in_flight: microbatches whose activations are alive at the peak.
        recompute: activation checkpointing of the whole stage.
        swapped_bytes: activation bytes (whole batch) swapped to host memory.
        offload_optimizer: keep the Adam state in host memory.
        host_is_device: the device is the host CPU, so offload and swap save nothing.

    Returns:
        The breakdown.
    """
    z = ZeroStage(zero)
    d = max(1, replicas)
    p = param_bytes
    params = p // d if z >= ZeroStage.OS_G_P else p
    grads = p // d if z >= ZeroStage.OS_G else p
    opt_full = 8 * p // max(1, dtype_bytes)
    opt = opt_full // d if z >= ZeroStage.OS else opt_full
    host = 0
    if offload_optimizer and not host_is_device:
        host, opt = opt, 0
    per = max(1, microbatches) * d
    act = activation_bytes // per
    swapped = 0 if host_is_device else min(swapped_bytes, activation_bytes) // per
    if recompute:
        stored, working = min(input_bytes // per, act), act
    else:
        stored, working = act - swapped, swapped
    return MemoryBreakdown(params, grads, opt, stored, working, max(1, in_flight), host)
