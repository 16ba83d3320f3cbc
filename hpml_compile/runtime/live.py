"""Live figures of a running job: a Prometheus endpoint on rank 0, and alerts in the log.

``hpml-compile run --metrics-port P`` makes rank 0 serve, at
``http://HOST:P/metrics`` in the Prometheus text format (prometheus_client's
own HTTP server), the latest step of every rank whose rows it can read in
the run folder (``metrics/rank<r>.jsonl``: every rank of this host; ranks of
other hosts only where the run folder is shared), each gauge labelled with
``rank``, ``stage`` and ``device``: step, step time, forward, backward,
communication and idle time, samples per second, the process's CPU use, the
host's steal and other processes' load, peak memory and the loss; and the
plan's predicted step time.

Reading the rows the ranks write anyway costs the training nothing: no
message between ranks, no work in a step; a scrape reads the files' new
lines (:class:`RowTail`).

:class:`AlertWatch` reads the same rows after each step and returns warnings
in the style of an alerting policy, each once when it starts to hold:

- ``LowUtilization``: a rank under 50% of one core for ``k`` steps in a row;
- ``MemoryNearCapacity``: a rank's peak within 5% of its device's capacity;
- ``StepOverPrediction``: the step over ``threshold`` x the plan's prediction
  for ``k`` steps in a row.

Example:
    >>> from hpml_compile.runtime.monitor import StepMetrics
    >>> w = AlertWatch(predicted_ms=10.0, capacity={0: 1000}, k=2)
    >>> row = lambda s, ms, cpu: StepMetrics(s, 0, 0, 0, "cpu", 1, 8, ms, ms, 1.0, 2.0, cpu_util=cpu,
    ...                                      peak_memory_bytes=990)
    >>> [a.split(":")[0] for a in w.observe({0: row(0, 20.0, 0.3)})]
    ['MemoryNearCapacity']
    >>> [a.split(":")[0] for a in w.observe({0: row(1, 20.0, 0.3)})]
    ['LowUtilization', 'StepOverPrediction']
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .monitor import StepMetrics

__all__ = ["RowTail", "RunCollector", "serve_metrics", "AlertWatch", "GAUGES"]

GAUGES = {  # metric name -> (StepMetrics field, help)
    "hpml_step": ("step", "the latest step measured (from 0)"),
    "hpml_step_ms": ("step_ms", "wall time of the latest step, ms"),
    "hpml_fwd_ms": ("fwd_ms", "forward compute in the step, ms"),
    "hpml_bwd_ms": ("bwd_ms", "backward compute in the step, ms"),
    "hpml_comm_ms": ("comm_ms", "communication in the step, ms"),
    "hpml_idle_ms": ("idle_ms", "idle time in the step, ms"),
    "hpml_samples_per_second": ("samples_per_s", "throughput of the step"),
    "hpml_cpu_utilization": ("cpu_util", "the rank's CPU time over the step's wall time (1.0 = one core)"),
    "hpml_host_steal_ratio": ("steal", "share of the host's CPU stolen by the hypervisor in the step"),
    "hpml_host_others_ratio": ("others_load", "share of the host's CPU used by other processes in the step"),
    "hpml_peak_memory_bytes": ("peak_memory_bytes", "peak memory of the step (RSS on CPU, CUDA allocator on GPU)"),
    "hpml_gpu_utilization": ("gpu_util", "share of NVML's last sample period a kernel ran (GPU ranks)"),
    "hpml_gpu_memory_bytes": ("gpu_memory_bytes", "memory in use on the GPU by every process (GPU ranks)"),
    "hpml_gpu_power_watts": ("gpu_power_w", "the GPU board's power draw (GPU ranks)"),
    "hpml_loss": ("loss", "the batch loss of the step"),
}


class RowTail:
    """The latest row of each rank, read incrementally from ``RUN_DIR/metrics/rank*.jsonl``."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir) / "metrics"
        self._pos: dict[Path, int] = {}
        self.latest: dict[int, StepMetrics] = {}

    def read(self) -> dict[int, StepMetrics]:
        """Every rank's latest complete row (new lines only are read)."""
        for path in sorted(self.dir.glob("rank*.jsonl")):
            with path.open("rb") as f:
                f.seek(self._pos.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
            self._pos[path] = self._pos.get(path, 0) + end
            for line in data[:end].splitlines():
                if line.strip():
                    m = StepMetrics.from_dict(json.loads(line))
                    self.latest[m.rank] = m
        return dict(self.latest)


class RunCollector(Collector):
    """A prometheus_client collector of the latest row of every rank (see the module docstring).

    Args:
        run_dir: the run folder.
        devices: the plan's device of each rank (labels).
        predicted_ms: the plan's predicted step time.
    """

    def __init__(self, run_dir: str | Path, devices: list[str], predicted_ms: float) -> None:
        self.tail, self.devices, self.predicted_ms = RowTail(run_dir), devices, predicted_ms

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = self.tail.read()
        labels = ["rank", "stage", "device"]
        for name, (attr, doc) in GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=labels)
            for rank, m in sorted(rows.items()):
                value = getattr(m, attr)
                if value is not None:
                    dev = self.devices[rank] if rank < len(self.devices) else m.device
                    g.add_metric([str(rank), str(m.stage), dev], float(value))
            yield g
        yield GaugeMetricFamily("hpml_predicted_step_ms", "the plan's predicted step time, ms", value=self.predicted_ms)


def serve_metrics(run_dir: str | Path, port: int, devices: list[str], predicted_ms: float,
                  addr: str = "0.0.0.0") -> Any:
    """Serve the run's figures on ``port`` (prometheus_client's HTTP server, a daemon thread).

    Returns:
        The server (``shutdown()`` stops it).

    Raises:
        OSError: the port is taken.
    """
    registry = CollectorRegistry()
    registry.register(RunCollector(run_dir, devices, predicted_ms))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server


class AlertWatch:
    """Alerts from the rows after each step (see the module docstring).

    Args:
        predicted_ms: the plan's step time (0: no step alert).
        capacity: rank -> its device's memory in bytes.
        k: steps in a row a condition must hold.
        threshold: a step over this times the prediction counts.
        low: CPU use (cores) under which a rank is underused.
    """

    def __init__(self, predicted_ms: float, capacity: Mapping[int, int], *, k: int = 5, threshold: float = 1.25,
                 low: float = 0.5) -> None:
        self.predicted_ms, self.capacity, self.k, self.threshold, self.low = predicted_ms, capacity, k, threshold, low
        self._low: dict[int, int] = {}
        self._over = 0
        self._firing: set[tuple[str, int]] = set()

    def _edge(self, key: tuple[str, int], on: bool, text: str, out: list[str]) -> None:
        if on and key not in self._firing:
            out.append(text)
        (self._firing.add if on else self._firing.discard)(key)

    def observe(self, rows: Mapping[int, StepMetrics]) -> list[str]:
        """The alerts that start with this step's rows (rank -> its latest row)."""
        out: list[str] = []
        for rank, m in sorted(rows.items()):
            gpu = m.gpu_util is not None  # a GPU rank: its device's utilization, not its host thread's
            util = m.gpu_util if gpu else m.cpu_util
            self._low[rank] = self._low.get(rank, 0) + 1 if util < self.low else 0
            self._edge(("low", rank), self._low[rank] >= self.k,
                       f"LowUtilization: rank {rank} used under {self.low:.0%} of "
                       f"{'its GPU' if gpu else 'a core'} for {self._low[rank]} steps (now {util:.0%}): it mostly "
                       "waits", out)
            cap = self.capacity.get(rank, 0)
            self._edge(("mem", rank), cap > 0 and m.peak_memory_bytes >= 0.95 * cap,
                       f"MemoryNearCapacity: rank {rank} peaked at {m.peak_memory_bytes / 2**30:.2f} GiB of "
                       f"{cap / 2**30:.2f} GiB (within 5%)", out)
        if rows and self.predicted_ms > 0:
            step = max(m.step_ms for m in rows.values())
            self._over = self._over + 1 if step > self.threshold * self.predicted_ms else 0
            self._edge(("step", -1), self._over >= self.k,
                       f"StepOverPrediction: {self._over} steps over {self.threshold:g} x the predicted "
                       f"{self.predicted_ms:.1f} ms (now {step:.1f} ms)", out)
        return out
