"""Per-step measurements of every rank: JSON lines and TensorBoard event files in the run folder.

Each rank writes ``metrics/rank<r>.jsonl`` (one :class:`StepMetrics` per
line) and TensorBoard events under ``tb/rank<r>/`` (``torch.utils.tensorboard``;
open with ``tensorboard --logdir RUN_DIR/tb``). What is measured, per step:

- ``fwd_ms``/``bwd_ms``: wall time of this rank's forward and backward calls
  over all microbatches, less the time they sat blocked in a receive and the
  collectives run inside them (``inner_comm_ms``: a ZeRO-3 stage's parameter
  all-gathers, which the plan prices with the stage's sync, not its compute;
  ``inner_wait_ms``: waiting there for the other replicas);
- ``wait_ms``: time blocked in receives. Part of it is the transfer and the
  rest is waiting for a peer that is not done yet (pipeline idle). The
  fastest receive of the step in each direction is taken as the pure
  transfer time of one message (at least one microbatch's data is usually
  there already when it is asked for), so ``p2p_ms`` = messages x that
  minimum, and the excess is idle;
- ``comm_ms`` = ``p2p_ms`` + posting and completing sends + ``allreduce_ms``
  (the gradient synchronisation as this rank pays it: packing the gradients
  into one buffer, the collectives, unpacking; the collectives are timed from
  the moment the last member arrived, a one-element all-reduce first absorbing
  the skew between stages) + ``inner_comm_ms``;
- ``idle_ms``: the pipeline phase (step start to the last backward) less
  compute, point-to-point communication and the collectives inside the
  compute, plus ``sync_wait_ms``, the wait at every collective for the
  slowest member (``inner_wait_ms`` included);
- ``bubble`` = 1 - (fwd + bwd) / pipeline time, the simulator's definition
  (the pipeline time without the collectives inside the compute and their
  waits, which the simulator counts with the sync);
- where the step's time goes besides those parts: ``loss_ms``, the ``LOSS``
  token (waiting for this rank's sends, the loss agreement: its own
  all-reduce, or reading what rode the gradient collective);
  ``between_ms``, the executor's span (``step_ms``) outside every token (its
  set-up and the loop between tokens); ``before_ms`` and ``after_ms``,
  ``Pipeline.step``'s wall clock (``wall_ms``) before and after the
  executor's span (the batch check, gradients cleared, host sampling, memory
  counting);
- ``samples_per_s``: the batch over the whole step (optimizer included);
- ``peak_memory_bytes``: CUDA allocator peak of the step on a GPU rank
  (``torch.cuda.max_memory_allocated``), peak resident set size of the
  process on a CPU rank (``VmHWM``, reset each step through
  ``/proc/self/clear_refs`` where Linux allows it; else the process peak);
- ``steal``, ``others_load``: the shares of the host's CPU stolen by the
  hypervisor and used by processes not of this job during the step, and
  ``cpu_util``, this process's CPU time over the step, and ``contention_ms``,
  the time it lost to other programs and the hypervisor (:mod:`.host`);
- ``held_bytes``: what the rank's tensors hold at the step's peak, counted by
  storage (:mod:`.held`: parameters, gradients, optimizer state after the
  step; :mod:`.saved`: the most activation bytes saved for backward alive at
  once, ``held_activation_bytes``), the figure the memory model predicts and
  the device's capacity bounds (``report`` flags a device above it); by part,
  ``held_params_bytes``, ``held_grads_bytes`` (at their peak) and
  ``held_optimizer_bytes``;
- ``reserved_bytes``: on a GPU rank the CUDA allocator's peak reserved bytes
  (``torch.cuda.max_memory_reserved``): what it holds beyond the allocated
  peak is fragmentation and cache. 0 on a CPU rank, whose figure beyond the
  tensors is the resident set above ``held_bytes``;
- ``gpu_util``, ``gpu_memory_bytes``, ``gpu_power_w``: the device's NVML
  counters at the step's end on a GPU rank (:mod:`.gpustats`); None on a CPU
  rank.

With ``events=True`` the monitor also writes each step's events
(:mod:`.events`: every forward, backward, message and collective, on one
clock) under ``metrics/``.

Example:
    >>> m = StepMetrics(step=0, rank=0, stage=0, replica=0, device="cpu", microbatches=2, samples=8,
    ...                 step_ms=100.0, pipeline_ms=90.0, fwd_ms=30.0, bwd_ms=45.0)
    >>> round(m.bubble, 3), m.samples_per_s
    (0.167, 80.0)
    >>> StepMetrics.from_dict(m.to_dict()) == m
    True
"""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ...codegen.comm import Direction
from ...publish import read_json_lines
from ..sync.comm import CommStats
from .events import EventStore

__all__ = ["StepMetrics", "Monitor", "peak_memory", "reset_peak_memory", "split_wait", "metrics_path",
           "read_metrics"]

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """One rank's measurements of one training step (times in milliseconds)."""

    step: int
    rank: int
    stage: int
    replica: int
    device: str
    microbatches: int
    samples: int
    step_ms: float
    pipeline_ms: float
    fwd_ms: float
    bwd_ms: float
    # Pipeline.step's wall clock: everything the rank did in the step (the batch check, host sampling, memory
    # counting, the events), less a validation pass; step_ms is the executor's span inside it (0.0: not measured)
    wall_ms: float = 0.0
    # the step's parts besides the compute, the transfers, the sync and the optimizer (see the module docstring)
    loss_ms: float = 0.0
    between_ms: float = 0.0
    before_ms: float = 0.0
    wait_ms: float = 0.0
    p2p_ms: float = 0.0
    send_ms: float = 0.0
    allreduce_ms: float = 0.0
    sync_wait_ms: float = 0.0
    optimizer_ms: float = 0.0
    inner_comm_ms: float = 0.0  # collectives inside the forward and backward calls (ZeRO-3's parameter gathers)
    inner_wait_ms: float = 0.0  # waiting there for the other members (part of sync_wait_ms)
    peak_memory_bytes: int = 0
    memory_kind: str = "rss"
    bytes_sent: int = 0
    bytes_received: int = 0
    loss: float | None = None
    retries: int = 0
    val_loss: float | None = None  # validation loss after this step's update, where one was measured
    host: str = ""
    steal: float = 0.0
    others_load: float = 0.0
    cpu_util: float = 0.0
    contention_ms: float = 0.0
    held_bytes: int = 0
    held_activation_bytes: int = 0
    held_params_bytes: int = 0
    held_grads_bytes: int = 0
    held_optimizer_bytes: int = 0
    reserved_bytes: int = 0
    gpu_util: float | None = None
    gpu_memory_bytes: int | None = None
    gpu_power_w: float | None = None
    sync_bytes: int = 0  # payload this rank put into its stage's gradient sync (compressed, or 0 on a local step)
    sync_dense_bytes: int = 0  # what the uncompressed all-reduce of the same gradients would have put
    # hierarchical all-reduces: bytes this rank sent inside its host and between hosts, and what flat
    # rings of the same all-reduces would have sent (runtime.sync.comm.level_bytes, from the collectives that ran)
    sync_intra_bytes: int = 0
    sync_inter_bytes: int = 0
    sync_flat_bytes: int = 0

    @property
    def comm_ms(self) -> float:
        """Point-to-point transfer, posting sends, gradient collectives, and collectives inside the compute."""
        return self.p2p_ms + self.send_ms + self.allreduce_ms + self.inner_comm_ms

    @property
    def idle_ms(self) -> float:
        """Time spent neither computing nor moving data: in the pipeline phase, and waiting at the collectives."""
        return max(0.0, self.pipeline_ms - self.fwd_ms - self.bwd_ms - self.p2p_ms - self.send_ms
                   - self.inner_comm_ms - self.inner_wait_ms) + self.sync_wait_ms

    @property
    def after_ms(self) -> float:
        """``Pipeline.step``'s wall clock after the executor's span (0.0 where the wall clock was not measured)."""
        return max(0.0, self.wall_ms - self.step_ms - self.before_ms) if self.wall_ms > 0 else 0.0

    @property
    def bubble(self) -> float:
        """Idle share of the pipeline phase: 1 - compute / pipeline time (the collectives inside the compute and
        their waits left out of both, as the simulator counts them with the sync)."""
        pipe = self.pipeline_ms - self.inner_comm_ms - self.inner_wait_ms
        return max(0.0, 1.0 - (self.fwd_ms + self.bwd_ms) / pipe) if pipe > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / (self.step_ms / 1e3) if self.step_ms > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(comm_ms=self.comm_ms, idle_ms=self.idle_ms, after_ms=self.after_ms, bubble=self.bubble,
                 samples_per_s=self.samples_per_s)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepMetrics":
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def split_wait(stats: CommStats) -> tuple[float, float]:
    """``(total wait, transfer estimate)`` in ms: per direction, messages x the fastest receive."""
    total = sum(s for _, s in stats.recv_s)
    transfer = 0.0
    for direction in Direction:
        waits = [s for d, s in stats.recv_s if d is direction]
        if waits:
            transfer += len(waits) * min(waits)
    return total * 1e3, transfer * 1e3


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's, or the process's resident set (Linux)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass  # not Linux, or not allowed: the peak stays the process's lifetime peak


def reserved_memory(device: torch.device) -> int:
    """The CUDA allocator's peak reserved bytes of the step (0 off CUDA)."""
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else 0


def peak_memory(device: torch.device) -> tuple[int, str]:
    """``(bytes, kind)``: the CUDA allocator peak, or the peak resident set size of this process."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda"
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024, "rss"
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale, "rss"


def metrics_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its JSON lines."""
    return Path(run_dir) / "metrics" / f"rank{rank}.jsonl"


def read_metrics(run_dir: str | Path) -> dict[int, list[StepMetrics]]:
    """Every rank's steps from a run folder, by rank."""
    out: dict[int, list[StepMetrics]] = {}
    for path in sorted((Path(run_dir) / "metrics").glob("rank*.jsonl")):
        rows = [StepMetrics.from_dict(d) for d in read_json_lines(path)]
        if rows:
            out[rows[0].rank] = rows
    return out


_TB_TAGS = {
    "time/step_ms": "step_ms", "time/fwd_ms": "fwd_ms", "time/bwd_ms": "bwd_ms", "time/comm_ms": "comm_ms",
    "time/idle_ms": "idle_ms", "time/allreduce_ms": "allreduce_ms", "time/optimizer_ms": "optimizer_ms",
    "time/inner_comm_ms": "inner_comm_ms",
    "pipeline/bubble": "bubble", "throughput/samples_per_s": "samples_per_s",
    "memory/peak_bytes": "peak_memory_bytes", "host/steal": "steal", "host/others_load": "others_load",
    "host/cpu_util": "cpu_util",
}
TB_EVERY = 10  # steps per point of the _TB_TAGS curves: a scalar costs ~36 us to write, 14 a step ~0.5 ms


class Monitor:
    """Writes each step's :class:`StepMetrics` as a JSON line and as TensorBoard scalars.

    Args:
        run_dir: the run folder (None: keep the rows in memory only).
        rank: this rank.
        tensorboard: also write TensorBoard event files.
    """

    def __init__(self, run_dir: str | Path | None, rank: int, *, tensorboard: bool = True, events: bool = True) -> None:
        self.rows: list[StepMetrics] = []
        self._file = None
        self._tb: Any = None
        self._events: EventStore | None = None
        self._window: list[StepMetrics] = []  # steps not yet in the TensorBoard curves
        if run_dir is None:
            return
        path = metrics_path(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w")
        if events:
            self._events = EventStore(run_dir, rank)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked

            self._tb = SummaryWriter(str(Path(run_dir) / "tb" / f"rank{rank}"))

    def record(self, m: StepMetrics, events: dict[str, Any] | None = None) -> None:
        """Append one step, and its events where given (flushed at once, so a crash keeps what was measured)."""
        self.rows.append(m)
        if self._file is not None:
            self._file.write(json.dumps(m.to_dict()) + "\n")
            self._file.flush()
        if events is not None and self._events is not None:
            self._events.write(events)
        if self._tb is not None:
            self._window.append(m)
            if len(self._window) >= TB_EVERY:
                self._write_window()
            if m.loss is not None:
                self._tb.add_scalar("loss", m.loss, m.step)
            if m.val_loss is not None:
                self._tb.add_scalar("loss/validation", m.val_loss, m.step)

    def _write_window(self) -> None:
        """The time, memory and host curves: one point per :data:`TB_EVERY` steps, the window's mean at its last
        step (the JSON lines keep every step; writing 14 scalars each step cost ~0.5 ms of a 25 ms step)."""
        if not self._window or self._tb is None:
            return
        rows = [w.to_dict() for w in self._window]
        for tag, key in _TB_TAGS.items():
            self._tb.add_scalar(tag, sum(float(r[key]) for r in rows) / len(rows), self._window[-1].step)
        self._window.clear()

    def close(self) -> None:
        self._write_window()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._events is not None:
            self._events.close()
            self._events = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
