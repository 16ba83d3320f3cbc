"""Forward-only cost of a decoder model: weights in the serving dtype, the KV cache, the activations in flight.

An inference pipeline holds no gradients and no optimizer state. What a
stage of it costs is priced here from the model's shape and the device's
catalog entry (``cost_models``), phase by phase:

- **prefill**: each microbatch's prompt runs through the stage once,
  ``rows x prompt_len`` tokens attending causally (``prompt_len / 2`` keys on
  average): compute-bound on a GPU at any useful batch.
- **decode**: one token per sequence per step, attending over the cache
  (``prompt_len + new_tokens / 2`` keys on average): every step reads the
  stage's weights and its cache once, so it is memory-bound at small batch.

Each is a roofline (``cost_models.roofline.op_time_ms``: FLOPs over the peak,
bytes over the bandwidth, at least the host's per-kernel work on a GPU). A
stage whose weights stay on the host and are streamed to the GPU ahead of use
(prefetched while the previous layer computes) takes the longer of its
compute and the copy over the host link. The memory of a stage is its
resident weights (two layers' worth of buffers when streamed), the KV cache
of every sequence in flight at full context, and one microbatch's
activations (the widest of the MLP and the attention scores, doubled for the
buffer being sent).

Example:
    >>> from hpml_compile.models.gpt import PRESETS
    >>> shape = DecoderShape.from_config(PRESETS["llama-7b"])
    >>> round(shape.params() / 1e9, 2)
    6.74
    >>> work = Workload(batch=1, prompt_len=128, new_tokens=128, dtype="bfloat16")
    >>> shape.kv_bytes(work, blocks=32) // 2**20  # fp16 cache of one 256-token sequence
    128
"""

from __future__ import annotations

import bisect
import enum
import itertools
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import cost_models
from cost_models.roofline import OpKind, op_time_ms

from ..errors import OptionError
from ..ir import Device, base_kind

__all__ = ["Objective", "DecoderShape", "Workload", "DTYPE_BYTES", "KERNELS_PER_BLOCK", "TimedCpuSpec", "device_spec",
           "block_ms", "block_flops_bytes", "cpu_op_ms", "step_extra_ms", "cold_head_ms", "head_ms", "handoff_ms",
           "wake_us", "woken_extra_ms",
           "stream_ms", "stage_bytes"]

DTYPE_BYTES: Mapping[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
# Kernels one decoder block issues in eager PyTorch: 2 norms, 4 (GPT-2) or 3+1 (Llama) projections, the
# attention, the MLP's 2-3 matmuls and activation, 2 residual adds, and the views and cache writes between.
KERNELS_PER_BLOCK = 16
# On a CPU the host runs every op of the cached forward in turn, views, cache writes and the mask included
# (about 24 per block). What one costs, when no block was timed on the host (hpml_compile.infer.timing): a
# gpt-mini decode step at batch 1 took 0.33 ms per block with one torch thread on a 2-core host, of which the
# roofline explains 0.1 ms: ~8 us per op, against ~1 us for the bare one-element add cost_models times.
CPU_OPS_PER_BLOCK = 24
CPU_EAGER_OP_MS = 0.008


@dataclass(frozen=True, slots=True)
class TimedCpuSpec(cost_models.DeviceSpec):
    """A CPU's entry fitted to a block timed on this host (:mod:`hpml_compile.infer.timing`): its per-op cost is
    the fitted one (no :data:`CPU_EAGER_OP_MS` floor), and each stage step also pays ``step_ms``, what a step
    of a stage costs beyond its blocks (embedding, positions and mask, head, handing the tokens on).

    A stage of a pipeline of several stages runs with its weights out of the caches (the other stages ran in
    between): ``cold_op_ms`` is the per-op cost fitted to blocks so timed (0: not timed, the warm one applies),
    ``cold_head_ms`` what the output head costs more so (its table read from memory). ``handoff_us`` and
    ``handoff_gbps``: one hand-off between two ranks of this host, as the generator makes it (0 GB/s: not
    measured); ``handoff_idle``: ``(idle ms, latency us)`` of a hand-off whose receiver was idle that long
    before it (:func:`wake_us`). ``llc_bytes``: the CPU's last-level cache as the host reports it (0: unknown);
    a model whose decode working set fits in it stays warm in every stage (:func:`evicts`). ``idle_compute``:
    ``(idle ms, per-op ms)`` of a block's decode step run by a rank that idled that long before it, per point
    timed (:func:`woken_extra_ms`)."""

    step_ms: float = 0.0
    cold_op_ms: float = 0.0
    cold_head_ms: float = 0.0
    handoff_us: float = 0.0
    handoff_gbps: float = 0.0
    llc_bytes: int = 0
    handoff_idle: tuple[tuple[float, float], ...] = ()
    idle_compute: tuple[tuple[float, float], ...] = ()


class Objective(str, enum.Enum):
    """What an inference plan optimises."""

    THROUGHPUT = "throughput"  # generated tokens per second over the batch, under an optional per-token bound
    LATENCY = "latency"  # time to first token plus per-token time, at batch 1


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """The sizes of a decoder-only transformer that its cost depends on."""

    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    vocab_size: int
    gated: bool  # SwiGLU (3 MLP matrices) rather than GELU (2)
    tie_embeddings: bool
    learned_pos: bool
    max_seq_len: int

    @classmethod
    def from_config(cls, config: Any) -> "DecoderShape":
        """From a :class:`hpml_compile.models.gpt.GPTConfig`."""
        from ..models.gpt import MLPKind, PosEncoding

        return cls(config.n_layer, config.d_model, config.n_head, config.n_kv_head, config.d_ff, config.vocab_size,
                   config.mlp is MLPKind.SWIGLU, config.tie_embeddings, config.pos is PosEncoding.LEARNED,
                   config.max_seq_len)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def block_params(self) -> int:
        """Parameters of one decoder block (attention, MLP, two norms)."""
        kv = self.n_kv_head * self.head_dim
        attn = 2 * self.d_model * self.d_model + 2 * self.d_model * kv
        return attn + (3 if self.gated else 2) * self.d_model * self.d_ff + 2 * self.d_model

    def embed_params(self) -> int:
        """Token table (and the learned position table)."""
        return (self.vocab_size + (self.max_seq_len if self.learned_pos else 0)) * self.d_model

    def head_params(self) -> int:
        """Final norm and output projection (the projection is the token table when tied)."""
        return self.d_model + self.vocab_size * self.d_model

    def params(self) -> int:
        """Every parameter, a tied table counted once."""
        head = self.d_model if self.tie_embeddings else self.head_params()
        return self.n_layer * self.block_params() + self.embed_params() + head

    def kv_bytes(self, work: "Workload", blocks: int) -> int:
        """KV cache of ``blocks`` blocks for every sequence in flight at full context."""
        per_token = 2 * self.n_kv_head * self.head_dim * DTYPE_BYTES[work.dtype]
        return blocks * work.batch * work.context * per_token


@dataclass(frozen=True, slots=True)
class Workload:
    """What the plan serves: ``batch`` sequences in flight, split into ``microbatches`` lanes.

    Raises:
        OptionError: on a non-positive size, more lanes than sequences, or an unknown dtype.
    """

    batch: int
    prompt_len: int
    new_tokens: int
    microbatches: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_len", "new_tokens", "microbatches"):
            if getattr(self, name) < 1:
                raise OptionError(f"inference workload: {name} must be >= 1, got {getattr(self, name)}")
        if self.microbatches > self.batch:
            raise OptionError(f"inference workload: {self.microbatches} microbatches need at least as many "
                              f"sequences, got batch {self.batch}")
        if self.dtype not in DTYPE_BYTES:
            raise OptionError(f"inference workload: dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

    @property
    def context(self) -> int:
        return self.prompt_len + self.new_tokens

    @property
    def rows(self) -> int:
        """Sequences of the largest microbatch (lanes are as even as the batch allows)."""
        return -(-self.batch // self.microbatches)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_spec(device: Device, specs: Mapping[str, cost_models.DeviceSpec] | None = None) -> cost_models.DeviceSpec:
    """The catalog entry of ``device``; ``specs`` overrides it by device name (a device measured slower than its
    kind, :mod:`hpml_compile.infer.adapt`) or else by kind (e.g. a server CPU for a simulation).

    Raises:
        OptionError: if the kind is neither in ``specs`` nor in the catalog.
    """
    if specs and device.name in specs:
        return specs[device.name]
    kind = base_kind(device.kind)
    if specs and kind in specs:
        return specs[kind]
    try:
        return cost_models.get_device(kind)
    except cost_models.UnknownDeviceKind as e:
        raise OptionError(f"device {device.name}: {e}") from None


def block_ms(spec: cost_models.DeviceSpec, shape: DecoderShape, work: Workload, blocks: int, *, decode: bool,
             cold: bool = False) -> float:
    """Time of ``blocks`` decoder blocks on one microbatch of ``work.rows`` sequences.

    Args:
        spec: the device.
        shape: the model.
        work: the workload (dtype, prompt and output lengths).
        blocks: how many consecutive blocks.
        decode: one decode step (one token per sequence) rather than the prompt's prefill.
        cold: a stage of a pipeline of several stages, whose weights the others push out of a CPU's caches
            between two of its steps (:class:`TimedCpuSpec`'s cold figures, where timed).

    Returns:
        Milliseconds.
    """
    if blocks == 0:
        return 0.0
    flops, moved = block_flops_bytes(shape, work, decode=decode)
    one = op_time_ms(OpKind.MATMUL, flops, moved, spec, work.dtype, ops=KERNELS_PER_BLOCK)
    if spec.category is cost_models.DeviceCategory.CPU:  # the CPU runs each op's dispatch after the last
        cold = cold and decode and evicts(spec, shape, work)
        one += CPU_OPS_PER_BLOCK * cpu_op_ms(spec, cold=cold) - spec.launch_overhead_ms
    return blocks * one


def block_flops_bytes(shape: DecoderShape, work: Workload, *, decode: bool) -> tuple[float, float]:
    """FLOPs and bytes moved of one block on one microbatch of ``work.rows`` sequences (see :func:`block_ms`)."""
    nbytes = DTYPE_BYTES[work.dtype]
    tokens = work.rows * (1 if decode else work.prompt_len)
    keys = work.prompt_len + work.new_tokens / 2 if decode else work.prompt_len / 2
    flops = 2 * tokens * shape.block_params() + 4 * tokens * keys * shape.d_model
    kv_read = work.rows * keys * 2 * shape.n_kv_head * shape.head_dim * nbytes
    return flops, shape.block_params() * nbytes + kv_read + 6 * tokens * shape.d_model * nbytes


def cpu_op_ms(spec: cost_models.DeviceSpec, *, cold: bool = False) -> float:
    """What one op of a CPU block's eager forward costs: the spec's own per-op cost when it was fitted to a
    block timed on this host (:class:`TimedCpuSpec`; its cold one with ``cold``, where timed), else at least
    :data:`CPU_EAGER_OP_MS`."""
    if isinstance(spec, TimedCpuSpec):
        return spec.cold_op_ms if cold and spec.cold_op_ms > 0 else spec.launch_overhead_ms
    return max(spec.launch_overhead_ms, CPU_EAGER_OP_MS)


def step_extra_ms(spec: cost_models.DeviceSpec) -> float:
    """What one step of a stage on ``spec`` costs beyond its blocks and head when that was timed (else 0)."""
    return spec.step_ms if isinstance(spec, TimedCpuSpec) else 0.0


def cold_head_ms(spec: cost_models.DeviceSpec, shape: DecoderShape, work: Workload) -> float:
    """What the output head's decode step costs more on a stage of a pipeline (its table out of the caches), where
    timed and the model does not fit the cache (:func:`evicts`; else 0)."""
    return spec.cold_head_ms if isinstance(spec, TimedCpuSpec) and evicts(spec, shape, work) else 0.0


def evicts(spec: cost_models.DeviceSpec, shape: DecoderShape, work: Workload) -> bool:
    """Whether the other stages of a pipeline push a stage's weights out of a CPU's caches between two of its
    decode steps: when what a decode step of the whole model reads (every weight and the KV cache of the batch)
    is more than the last-level cache the host reports; where that size is unknown, they are taken to.

    Example:
        >>> from dataclasses import fields, replace
        >>> from hpml_compile.models.gpt import PRESETS
        >>> shape = DecoderShape.from_config(PRESETS["gpt-mini"])  # about 23 MiB of fp32 weights
        >>> spec = TimedCpuSpec(**{f.name: getattr(cost_models.get_device("cpu"), f.name)
        ...                        for f in fields(cost_models.DeviceSpec)}, llc_bytes=32 * 2**20)
        >>> evicts(spec, shape, Workload(1, 32, 32)), evicts(spec, shape, Workload(16, 32, 32))
        (False, True)
    """
    if not isinstance(spec, TimedCpuSpec) or spec.llc_bytes <= 0:
        return True
    return shape.params() * DTYPE_BYTES[work.dtype] + shape.kv_bytes(work, shape.n_layer) > spec.llc_bytes


def handoff_ms(spec: cost_models.DeviceSpec, nbytes: float, idle_ms: float = 0.0) -> float | None:
    """One hand-off of ``nbytes`` between two ranks of this host as measured here (:class:`TimedCpuSpec`), its
    receiver idle for ``idle_ms`` before it (:func:`wake_us`), or None where it was not (the cluster's link
    prices it)."""
    if not isinstance(spec, TimedCpuSpec) or spec.handoff_gbps <= 0:
        return None
    return wake_us(spec, idle_ms) / 1e3 + nbytes / (spec.handoff_gbps * 1e9) * 1e3


def wake_us(spec: TimedCpuSpec, idle_ms: float) -> float:
    """The latency of a hand-off whose receiver was idle for ``idle_ms`` before it: linear between the points
    timed (:attr:`TimedCpuSpec.handoff_idle`, with the hot hand-off at 0 ms), the last one's beyond them. A longer
    idle is never priced to wake faster than a shorter one (on a busy host the medians of nearby points may
    cross).

    Example:
        >>> from dataclasses import fields
        >>> base = cost_models.get_device("cpu")
        >>> spec = TimedCpuSpec(**{f.name: getattr(base, f.name) for f in fields(cost_models.DeviceSpec)},
        ...                     handoff_us=5.0, handoff_idle=((0.1, 5.0), (1.0, 95.0)))
        >>> wake_us(spec, 0.0), round(wake_us(spec, 0.55), 6), wake_us(spec, 10.0)
        (5.0, 50.0, 95.0)
    """
    return _interpolate([0.0, *(ms for ms, _ in spec.handoff_idle)],
                        [spec.handoff_us, *(us for _, us in spec.handoff_idle)], idle_ms)


def _interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """Linear between the points, the last one's value beyond them; ``ys`` made non-decreasing first (a longer idle
    never priced cheaper than a shorter one: on a busy host the medians of nearby points may cross)."""
    ys = list(itertools.accumulate(ys, max))
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, max(x, 0.0))
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (max(x, 0.0) - xs[i - 1]) / (xs[i] - xs[i - 1])


def woken_extra_ms(spec: cost_models.DeviceSpec, shape: DecoderShape, work: Workload, blocks: int,
                   idle_ms: float) -> float:
    """What a decode step of a stage of ``blocks`` blocks costs more than warm when its rank was idle for
    ``idle_ms`` before it (a rank of a pipeline whose lanes do not keep it busy), where that was timed
    (:attr:`TimedCpuSpec.idle_compute`; else 0): each of the blocks' ops at the per-op cost of a step so woken.
    Linear between the points timed (a warm step at 0 ms), the last point's beyond them.

    Example:
        >>> from dataclasses import fields
        >>> from hpml_compile.models.gpt import PRESETS
        >>> base = cost_models.get_device("cpu")
        >>> spec = TimedCpuSpec(**{**{f.name: getattr(base, f.name) for f in fields(cost_models.DeviceSpec)},
        ...                        "launch_overhead_ms": 0.01}, idle_compute=((1.0, 0.02),))
        >>> shape, work = DecoderShape.from_config(PRESETS["gpt-mini"]), Workload(1, 32, 32)
        >>> round(woken_extra_ms(spec, shape, work, 3, 0.5), 6), round(woken_extra_ms(spec, shape, work, 3, 4.0), 6)
        (0.36, 0.72)
    """
    if not isinstance(spec, TimedCpuSpec) or not spec.idle_compute or blocks < 0:
        return 0.0
    op = _interpolate([0.0, *(idle for idle, _ in spec.idle_compute)],
                      [spec.launch_overhead_ms, *(o for _, o in spec.idle_compute)], idle_ms)
    return blocks * CPU_OPS_PER_BLOCK * max(0.0, op - spec.launch_overhead_ms)


def head_ms(spec: cost_models.DeviceSpec, shape: DecoderShape, work: Workload) -> float:
    """The final norm and the logits of each sequence's last position (one microbatch)."""
    nbytes = DTYPE_BYTES[work.dtype]
    flops = 2 * work.rows * shape.head_params()
    return op_time_ms(OpKind.MATMUL, flops, shape.head_params() * nbytes, spec, work.dtype, ops=3)


def stream_ms(spec: cost_models.DeviceSpec, shape: DecoderShape, work: Workload, blocks: int) -> float:
    """Copying ``blocks`` blocks' weights from host memory to the device over its host link."""
    if blocks == 0 or spec.category is cost_models.DeviceCategory.CPU:
        return 0.0
    link = cost_models.get_link(spec.host_link)
    return blocks * shape.block_params() * DTYPE_BYTES[work.dtype] / (link.gbps * 1e9) * 1e3


def stage_bytes(shape: DecoderShape, work: Workload, blocks: int, *, embed: bool, head: bool,
                stream: bool = False) -> int:
    """Device memory of a stage: weights (or two blocks' buffers when streamed), KV cache, activations.

    Args:
        shape: the model.
        work: the workload.
        blocks: blocks on the stage.
        embed: whether it holds the token table (the first stage).
        head: whether it holds the final norm and the output projection (the last stage; with tied
            embeddings it holds its own copy of the table unless it is also the first).
        stream: whether its blocks' weights stay on the host and are copied in ahead of use.

    Returns:
        Bytes.
    """
    nbytes = DTYPE_BYTES[work.dtype]
    resident = min(blocks, 2) if stream else blocks
    weights = resident * shape.block_params()
    if embed:
        weights += shape.embed_params()
    if head:
        weights += shape.head_params() if not (embed and shape.tie_embeddings) else shape.d_model
    tokens = work.rows * work.prompt_len
    widest = max(tokens * (shape.d_ff + 4 * shape.d_model), work.rows * shape.n_head * work.prompt_len ** 2)
    act = 2 * widest * nbytes + (work.rows * shape.vocab_size * 4 if head else 0)
    return weights * nbytes + shape.kv_bytes(work, blocks) + act
