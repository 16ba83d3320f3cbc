"""NVML figures of a GPU rank: utilization, memory in use and power read after real work (skipped without CUDA)."""

from __future__ import annotations

import torch

from hpml_compile.runtime.observe.gpustats import GpuStats


def test_a_busy_gpu_reads_utilization_memory_and_power() -> None:
    dev = torch.device("cuda", 0)
    stats = GpuStats(dev)
    assert stats.available, "NVML could not be opened on a machine with CUDA"
    a = torch.randn(4096, 4096, device=dev)
    for _ in range(200):  # long enough to fill NVML's sample period
        a = (a @ a).tanh_()
    torch.cuda.synchronize(dev)
    s = stats.sample()
    assert s is not None and 0.0 <= s.util <= 1.0
    assert s.memory_bytes >= a.numel() * 4  # every process's memory on the device, this tensor included
    assert s.power_w is None or s.power_w > 0
