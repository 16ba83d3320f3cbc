"""What a GPU rank's device did during a step: utilization, memory in use, power, read through NVML.

The CUDA allocator (:func:`~.monitor.peak_memory`) sees only this process's
tensors; NVML sees the device: the share of the last sample period a kernel
ran (``utilization.gpu``), the memory every process holds on it, and the
board's power draw. Each GPU rank reads them at the end of every step
(:class:`GpuStats`), and the row carries them (``gpu_util``,
``gpu_memory_bytes``, ``gpu_power_w``): ``report --html`` draws them beside
the CPU's, ``run --metrics-port`` serves them, and the live alert for a
device under 50% utilization uses the GPU's figure on a GPU rank.

Why NVML (``nvidia-ml-py``, NVIDIA's own binding) and not
``torch.cuda.utilization``: torch reads the same counters through the same
library but gives no power, and opens NVML on every call.

NVML's utilization is the share of its own sample period (1/6 s to 1 s by
board) in which a kernel ran, so over a step shorter than that it is the
last period's figure, not the step's mean.

Off CUDA, or where NVML cannot be opened (no driver, a container without
it), :meth:`GpuStats.sample` returns None and the row keeps ``None``.

Example:
    >>> import torch
    >>> GpuStats(torch.device("cpu")).sample() is None
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GpuSample", "GpuStats"]


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One reading of a GPU.

    Attributes:
        util: share of NVML's last sample period in which a kernel ran (0 to 1).
        memory_bytes: memory in use on the device, by every process.
        power_w: the board's power draw in watts (None where the board does not report it).
    """

    util: float
    memory_bytes: int
    power_w: float | None


class GpuStats:
    """Reads the NVML counters of the GPU a rank runs on (see the module docstring).

    Args:
        device: the rank's device; anything but a CUDA device reads nothing.
    """

    def __init__(self, device: torch.device) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        if device.type != "cuda" or not torch.cuda.is_available():
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            # by UUID: CUDA_VISIBLE_DEVICES renumbers devices for torch, not for NVML
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            try:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except pynvml.NVMLError:
                index = device.index if device.index is not None else torch.cuda.current_device()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 -- no driver or no NVML: the rows carry no GPU figures
            self._nvml = self._handle = None

    @property
    def available(self) -> bool:
        """Whether this rank reads a GPU's counters."""
        return self._handle is not None

    def sample(self) -> GpuSample | None:
        """The device's utilization, memory in use and power now (None off CUDA or without NVML)."""
        if self._handle is None:
            return None
        nv = self._nvml
        try:
            util = nv.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0
            used = int(nv.nvmlDeviceGetMemoryInfo(self._handle).used)
        except nv.NVMLError:
            return None
        try:
            power: float | None = nv.nvmlDeviceGetPowerUsage(self._handle) / 1000.0  # milliwatts
        except nv.NVMLError:
            power = None
        return GpuSample(util, used, power)
