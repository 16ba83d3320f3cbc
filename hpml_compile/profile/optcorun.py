"""How much slower an optimizer step runs on a CPU while the host's other ranks step theirs.

CPU ranks of one host step their optimizers at about the same time (the data-parallel replicas right after
their sync, a pipeline's stages after their last backward). An AdamW step on a CPU streams the parameters,
gradients and both moments through several kernels, so the ranks share the host's caches and memory
bandwidth; but its kernels are not a pure copy, and the stream rates (:func:`.timing.time_streams`) predict
more sharing than there is. On the 2-core development VM the two stages of mlp's pipeline, half the model
each, stepped in 7.0-7.3 ms side by side, where the whole model alone took 11.7 ms: 1.2x the half alone,
while the stream rates (44.1 GB/s one thread, 44.7 GB/s both) had priced 2x. So the step is measured as it
runs: this process times its step alone (the neighbours stopped by ``SIGSTOP``) and with forked neighbours
stepping their own copies (``SIGCONT``), alternately, and the simulator stretches the optimizer step by the
ratio while that many ranks of the host step at once (:mod:`hpml_compile.simulate`).

Why fork and not a library: the same reasons as :func:`.corun.time_corun` (separate copies of the
parameters in separate memory; neighbours that die with this process).

Example:
    >>> import torch
    >>> r = time_optimizer_corun([torch.randn(256, 256)], neighbours=1, rounds=1, passes=2)
    >>> r["ranks"] == 2 and r["ratio"] > 0 or "skipped" in r
    True
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from .corun import _host_busy_s, _stop, fork_neighbours
from .timing import _cache_bytes

__all__ = ["time_optimizer_corun"]

# The step is timed on copies of at most this many parameter bytes (per process): the ratio, not the time, is
# what is kept, and a model beyond the caches streams the same way at any size.
_CORUN_BYTES_CAP = 64 * 2**20


def _copies(params: Sequence[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters of this process's own (at most :data:`_CORUN_BYTES_CAP` bytes), each with a random gradient."""
    out: list[torch.nn.Parameter] = []
    nbytes = 0
    for p in params:
        size = p.numel() * p.element_size()
        if out and nbytes + size > _CORUN_BYTES_CAP:
            break
        c = torch.nn.Parameter(p.detach().to("cpu", copy=True))
        c.grad = torch.randn_like(c)
        out.append(c)
        nbytes += size
    return out


def _stepper(params: Sequence[torch.Tensor],
             make: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None) -> Callable[[], Any]:
    """One optimizer step over copies of ``params`` (default: ``torch.optim.AdamW``, as the runtime builds it)."""
    make = make or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    return make(_copies(params)).step  # type: ignore[arg-type]


def _start(params: Sequence[torch.Tensor], make: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None,
           n: int, timeout_s: float) -> list[int] | None:
    """Fork ``n`` processes stepping optimizers over their own copies; their pids once each has stepped, or None
    (every one killed) when they are not all stepping within ``timeout_s``."""
    return fork_neighbours(n, lambda _i: _stepper(params, make), timeout_s)


def _pause(pids: Sequence[int], stop: bool) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)
    for pid in pids if stop else ():
        os.waitpid(pid, os.WUNTRACED)  # back once it is stopped


def time_optimizer_corun(params: Sequence[torch.Tensor],
                         make: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None, *,
                         neighbours: int, passes: int = 3, rounds: int = 3,
                         start_timeout_s: float = 60.0) -> dict[str, Any]:
    """The optimizer step's slow-down on a CPU while ``neighbours`` other processes step theirs.

    Each measurement is the median of ``passes`` steps, each after the caches were flushed (as the step runs
    after a training step's backward), on this process's CPU time (a moment the core ran another program is
    not counted; a stall on the shared cache or memory is). Each round's ratio is the steps' time with the
    neighbours over the mean of the alone times around it; the median over ``rounds`` is returned.

    Args:
        params: the model's parameters (copied; at most 64 MiB of them are stepped).
        make: ``parameters -> optimizer`` (default: ``torch.optim.AdamW``).
        neighbours: processes stepping beside this one (1 on a 2-core host).
        passes: timed steps per measurement.
        rounds: measurements with the neighbours, each between two alone.
        start_timeout_s: how long to wait for the neighbours to be stepping.

    Returns:
        ``{"ratio": slow-down, "ranks": neighbours + 1, "rounds": [...], "clock": "cpu", "others": share}``
        (``others``: the mean number of the host's cores other programs kept busy meanwhile), or
        ``{"skipped": why}`` (no neighbours asked, no parameters, no ``fork``, a neighbour did not start).
    """
    if neighbours < 1:
        return {"skipped": "no other core"}
    if not any(p.numel() for p in params):
        return {"skipped": "no parameters"}
    if not hasattr(os, "fork"):
        return {"skipped": "no fork on this platform"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core each, as the neighbours (and a process's CPU time has no idle spins)
    try:
        step = _stepper(params, make)
        flush = torch.empty(max(2 * max(_cache_bytes().values(), default=0), 8 << 20) // 4)

        def measure() -> float:
            times = []
            for i in range(max(1, passes) + 1):  # one untimed step first
                flush.fill_(float(i))
                t0 = time.thread_time()
                step()
                if i:
                    times.append((time.thread_time() - t0) * 1e3)
            return statistics.median(times)

        pids = _start(params, make, neighbours, start_timeout_s)
        if pids is None:
            return {"skipped": f"a neighbour process did not start within {start_timeout_s:g} s"}
        try:
            busy0 = _host_busy_s(pids)
            _pause(pids, True)
            alone, ratios = [measure()], []
            for _ in range(max(1, rounds)):
                _pause(pids, False)
                together = measure()
                _pause(pids, True)
                alone.append(measure())
                ratios.append(together / ((alone[-2] + alone[-1]) / 2) if alone[-2] + alone[-1] > 0 else 1.0)
            busy1 = _host_busy_s(pids)
        finally:
            _stop(pids)
    finally:
        torch.set_num_threads(threads)
    out: dict[str, Any] = {"ratio": round(statistics.median(ratios), 4), "ranks": neighbours + 1,
                           "rounds": [round(r, 4) for r in ratios], "clock": "cpu"}
    if busy0 is not None and busy1 is not None and busy1[1] > busy0[1]:
        out["others"] = round(max(0.0, (busy1[0] - busy0[0]) / (busy1[1] - busy0[1])), 3)
    return out
