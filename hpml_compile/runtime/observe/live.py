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

In the style of an alerting policy, :class:`AlertWatch` reads the same rows
after each step and returns warnings, each once when it starts to hold:

- ``LowUtilization``: a rank under 50% of one core for ``k`` steps in a row;
- ``MemoryNearCapacity``: a rank's peak within 5% of its device's capacity;
- ``StepSlowdown``: the run slowed. Like the closed loop's watch
  (:class:`hpml_compile.runtime.observe.policy.ImbalanceWatch`), it fires on a change,
  not on a level: the first ``baseline`` steps after the warm-up learn the
  run's own pace against the prediction (a machine the cost model misjudges
  by a constant runs healthily at, say, 1.2x it), and the alert holds while
  the median of the last ``window`` steps is over ``threshold`` x that pace,
  and it is said once that has held for ``for_s`` seconds of steps (an
  alerting rule's ``for`` clause). A median over a window, held for a while,
  not ``k`` slow steps in a row: on a shared VM a healthy run has stretches
  of five or six steps 1.3-1.4x its median, and once 25 steps (1.3 s) at
  1.6x (the demo): the machine's minute, not the run's, and
  nothing a person could act on.

Example:
    >>> from hpml_compile.runtime.observe.monitor import StepMetrics
    >>> w = AlertWatch(predicted_ms=10.0, capacity={0: 1000}, k=2, warmup=0, baseline=2, window=3, for_s=0)
    >>> row = lambda s, ms, cpu: StepMetrics(s, 0, 0, 0, "cpu", 1, 8, ms, ms, 1.0, 2.0, cpu_util=cpu,
    ...                                      peak_memory_bytes=990)
    >>> [a.split(":")[0] for a in w.observe({0: row(0, 12.0, 0.9)})]
    ['MemoryNearCapacity']
    >>> [w.observe({0: row(s, 12.0, 0.9)}) for s in range(1, 5)], round(w.level, 2)
    ([[], [], [], []], 1.2)
    >>> [[a.split(":")[0] for a in w.observe({0: row(s, 30.0, 0.3)})] for s in range(5, 7)]
    [[], ['LowUtilization', 'StepSlowdown']]
"""

from __future__ import annotations

import json
import statistics
from collections import deque
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
        k: steps in a row a rank must be underused.
        threshold: the step alert holds while the window's median is over this times the run's pace.
        low: CPU use (cores) under which a rank is underused.
        warmup: first steps left out of the pace (allocation, first-touch pages).
        baseline: steps after the warm-up whose median measured / predicted is the run's pace
            (0: the pace is the prediction itself).
        window: the latest steps whose median is compared with the pace.
        for_s: seconds of steps the window's median must stay over before the alert is said.
    """

    def __init__(self, predicted_ms: float, capacity: Mapping[int, int], *, k: int = 5, threshold: float = 1.25,
                 low: float = 0.5, warmup: int = 2, baseline: int = 10, window: int = 20,
                 for_s: float = 30.0) -> None:
        if threshold <= 1.0 or k < 1 or warmup < 0 or baseline < 0 or window < 1 or for_s < 0:
            raise ValueError(f"AlertWatch needs threshold > 1, k >= 1, warmup >= 0, baseline >= 0, window >= 1, "
                             f"for_s >= 0; got {threshold}, {k}, {warmup}, {baseline}, {window}, {for_s}")
        self.predicted_ms, self.capacity, self.k, self.threshold, self.low = predicted_ms, capacity, k, threshold, low
        self.warmup, self.baseline, self.for_ms, self.level = warmup, baseline, 1000.0 * for_s, 1.0
        self._held_ms = 0.0  # milliseconds of steps the window's median has been over
        self._low: dict[int, int] = {}
        self._firing: set[tuple[str, int]] = set()
        self._seen = 0  # steps seen
        self._first: list[float] = []  # the baseline steps' times (the slowest rank's: the job's)
        self._last = -1  # the latest step index seen
        self._recent: deque[float] = deque(maxlen=window)

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
        step = max((m.step for m in rows.values()), default=-1)
        if step <= self._last or self.predicted_ms <= 0:
            return out  # no new step (the rows of a rank that has not written yet), or nothing to compare with
        self._last = step
        ms = max(m.step_ms for m in rows.values())  # the ranks wait for each other: the slowest is the job's
        self._seen += 1
        head = self.warmup + self.baseline
        if self._seen <= self.warmup:
            return out
        if self._seen <= head:
            self._first.append(ms)
            if self._seen == head:
                self.level = statistics.median(self._first) / self.predicted_ms
            return out
        self._recent.append(ms)
        pace = self.level * self.predicted_ms
        median = statistics.median(self._recent)
        over = len(self._recent) == self._recent.maxlen and median > self.threshold * pace
        self._held_ms = self._held_ms + ms if over else 0.0
        fire = over and self._held_ms >= self.for_ms
        text = ""
        if fire and ("step", -1) not in self._firing:  # the words only when they are said
            since = (f"its steps {self.warmup + 1}-{head} ran {self.level:.2f}x the predicted "
                     f"{self.predicted_ms:.1f} ms" if self.baseline else "the prediction")
            text = (f"StepSlowdown: for {self._held_ms / 1e3:.0f} s the last {len(self._recent)} steps have taken "
                    f"over {self.threshold:g} x this run's pace of {pace:.1f} ms (now {median:.1f} ms, the median; "
                    f"{since})")
        self._edge(("step", -1), fire, text, out)
        return out
