"""The cost of one pipeline stage, written once for the simulator and for the solvers' candidate table.

The simulator (:func:`hpml_compile.simulate.stage_costs`) prices the stages of
one plan, one stage at a time; the solvers' candidate table
(:func:`hpml_compile.solve.table.build_table`) prices every range, degree and
memory configuration at once as numpy arrays. Both read their formulas from
here, so that a change to a cost is made in one place and the solvers keep
optimising what the simulator scores. Every function takes Python scalars or
numpy arrays (of byte counts) and returns the same kind; the memory model
floors on integers in both forms, so a candidate fits exactly when the plan
validator says it does.

The memory of one device of a stage replicated over ``d`` devices, at its peak
(the end of the step's last backward), as the runtime holds it
(:mod:`hpml_compile.runtime.zero`):

- parameters ``P``: whole under every ZeRO stage, since a stage's compute uses
  them whole; ZeRO-3 (:mod:`hpml_compile.runtime.zero3`) holds only the owned
  shard ``P / d`` between uses, but gathers the whole stage (its one unit) for
  each microbatch's forward and backward, so at the peak ``P + P / d``: more
  than ZeRO-1/2, and the solver never prefers it for memory (it is offered; a
  plan may name it);
- gradients ``P``: they accumulate whole over all microbatches before the one
  reduce-scatter of the step, so ZeRO-2, which keeps only the shard after it,
  holds ``P`` at the peak like ZeRO-1;
- Adam state: two fp32 tensors per parameter, ``8 * P / dtype_bytes`` (ZeRO-1 and
  up shard it: ``/ d``, the optimizer being built over the replica's flat shard;
  optimizer offload moves it to host memory: 0 on the device),
  following ZeRO (Rajbhandari et al., SC 2020). ``P`` is in the parameters'
  dtype, so under mixed precision (bf16/fp16 autocast) these are the fp32
  master weights, gradients and moments; the activations below then come from
  a profile taken under autocast, which counts them in the compute dtype and
  includes the compute-dtype weight copies autocast keeps for the backward.
  Those copies are counted once per batch and so divided among the
  microbatches like the activations, whereas each microbatch in flight holds
  a whole copy: the rest of it is a term of its own per microbatch in flight
  (:func:`hpml_compile.memory.autocast_copy_bytes`, ``compute_bytes``).
- activations: what autograd saves for one microbatch on one replica is
  ``A / (M * d)`` (the profile's ``A`` is for the whole batch), times the
  microbatches in flight (:func:`in_flight`): all ``M`` under GPipe (Huang et
  al., NeurIPS 2019), ``min(M, S - i)`` for stage ``i`` of ``S`` under 1F1B
  (Narayanan et al., SOSP 2019). With recompute (checkpointing) only the
  stage's input is kept per microbatch in flight, plus one microbatch's
  activations while its backward runs; swapped activations leave the device
  after the forward and come back for one microbatch's backward.

Times (milliseconds), per step:

- gradient sync (:func:`sync_ms`): a ring all-reduce (ZeRO-0), reduce-scatter of
  the flat gradient + all-gather of the stepped shards (ZeRO-1/2; ZeRO-3 instead
  all-gathers the stage's parameters twice per microbatch, for its forward and
  its backward, counted here with the step's tail); an offloaded optimizer moves its shard of gradients to the host and
  parameters back. Plus, under ZeRO-1/2, copying the gathered parameters into
  their flat buffer (:func:`copy_ms`; gradients accumulate in the buffer the
  collective reads, so they are not copied).
- optimizer step (:func:`optimizer_ms`): the graph's step time per parameter
  byte times the bytes the device updates (its shard under ZeRO-1 and up).
- memory streaming (:func:`stream_ms`): what part of a microbatch's forward and
  backward is reading the weights and writing the activations.

Communication is cost_models' alpha-beta model, which is affine in the bytes
(``alpha + bytes * beta``, 0 for no bytes); on arrays each function is
evaluated at two sizes and applied as a line (:func:`transfer_ms`). No link (a
lone device) or an infinitely fast one (a CPU's own memory) costs nothing.

Example:
    >>> m = device_memory(param_bytes=100, activation_bytes=80, input_bytes=8, dtype_bytes=4,
    ...                   replicas=2, zero=ZeroStage.OS, microbatches=4, in_flight=2)
    >>> (m.params, m.grads, m.optimizer, m.stored_per_microbatch, m.total)
    (100, 100, 100, 10, 320)
    >>> import numpy as np
    >>> parts = memory_parts(param_bytes=np.array([100, 200]), activation_bytes=np.array([80, 80]),
    ...                      input_bytes=np.array([8, 8]), dtype_bytes=4, replicas=2, zero=ZeroStage.OS,
    ...                      microbatches=4)
    >>> parts.optimizer.tolist(), in_flight(Schedule.ONE_F_ONE_B, 4, np.array([0, 5])).tolist()
    ([100, 200], [1, 4])
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Union

import numpy as np

import cost_models

from .costgraph import CostGraph
from .ir import Schedule, base_kind
from .memory import MemoryBreakdown, ZeroStage, autocast_copy_bytes

__all__ = ["MemoryParts", "in_flight", "memory_parts", "device_memory", "transfer_ms", "sync_ms", "copy_ms",
           "optimizer_ms", "stream_ms", "stream_bytes_per_ms"]

# A count or a duration: a Python scalar for one stage, a numpy array for many candidates at once.
Value = Union[int, float, np.ndarray]


def _minimum(a: Value, b: Value) -> Value:
    """``min`` for scalars (keeping Python ints), ``np.minimum`` when either is an array."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.minimum(a, b)
    return min(a, b)


def in_flight(schedule: Schedule, microbatches: int, after: Value) -> Value:
    """Microbatches whose activations a stage holds at its peak.

    Args:
        schedule: GPipe (all ``M``) or 1F1B (``min(M, j + 1)``; Narayanan et al. 2021: ``S - i``).
        microbatches: ``M``.
        after: ``j``, the number of stages after this one (``S - i - 1`` for stage ``i`` of ``S``).

    Returns:
        The count, of the same form as ``after``.
    """
    if schedule is Schedule.GPIPE:
        return after * 0 + microbatches
    return _minimum(microbatches, after + 1)


class MemoryParts(NamedTuple):
    """Bytes on one device of a stage, without the in-flight count (scalars or arrays).

    Attributes:
        params: parameter bytes.
        grads: gradient bytes.
        optimizer: Adam state bytes on the device.
        stored: activation bytes kept per microbatch in flight.
        working: activation bytes of the one microbatch whose backward runs.
        host: bytes moved to host memory (offloaded optimizer state).
    """

    params: Value
    grads: Value
    optimizer: Value
    stored: Value
    working: Value
    host: Value

    @property
    def static(self) -> Value:
        """Bytes held for the whole step: parameters, gradients, optimizer state."""
        return self.params + self.grads + self.optimizer


def memory_parts(*, param_bytes: Value, activation_bytes: Value, input_bytes: Value, dtype_bytes: int,
                 replicas: int, zero: ZeroStage | int, microbatches: int, recompute: bool = False,
                 swapped_bytes: Value = 0, offload_optimizer: bool = False,
                 host_is_device: bool = False, compute_bytes: int = 0) -> MemoryParts:
    """Per-device memory of a stage (see the module docstring), on ints or int64 arrays alike.

    Args:
        param_bytes: parameter bytes of the whole stage.
        activation_bytes: activation bytes the stage saves for the whole batch.
        input_bytes: bytes entering the stage for the whole batch (kept under recompute).
        dtype_bytes: bytes per parameter element.
        replicas: data-parallel degree ``d`` of the stage.
        zero: ZeRO stage.
        microbatches: ``M``.
        recompute: activation checkpointing of the whole stage.
        swapped_bytes: activation bytes (whole batch) swapped to host memory.
        offload_optimizer: keep the Adam state in host memory.
        host_is_device: the device is the host CPU, so offload and swap save nothing.
        compute_bytes: bytes per element of the autocast compute dtype (0: fp32, no autocast): each
            microbatch in flight then also holds its weight copies (:func:`~hpml_compile.memory.autocast_copy_bytes`).

    Returns:
        The parts, each of the form of ``param_bytes`` and ``activation_bytes``.
    """
    z = ZeroStage(zero)
    d = max(1, replicas)
    p = param_bytes
    params = grads = p  # whole at the peak under every ZeRO stage (see the module docstring)
    if z == ZeroStage.OS_G_P:
        params = p + p // d  # ZeRO-3: the owned shard, plus the whole stage gathered while a microbatch computes
    opt_full = 8 * p // max(1, dtype_bytes)
    opt = opt_full // d if z >= ZeroStage.OS else opt_full
    host = p * 0
    if offload_optimizer and not host_is_device:
        host, opt = opt, p * 0
    per = max(1, microbatches) * d
    act = activation_bytes // per
    swapped = activation_bytes * 0 if host_is_device else _minimum(swapped_bytes, activation_bytes) // per
    if recompute:
        stored, working = _minimum(input_bytes // per, act), act
    else:
        stored, working = act - swapped, swapped
    copies = autocast_copy_bytes(p, dtype_bytes, compute_bytes, microbatches, d)
    if recompute:  # the copies of the one microbatch whose forward is recomputed
        working = working + copies
    else:
        stored = stored + copies
    return MemoryParts(params, grads, opt, stored, working, host)


def device_memory(*, param_bytes: int, activation_bytes: int, input_bytes: int, dtype_bytes: int,
                  replicas: int, zero: ZeroStage | int, microbatches: int, in_flight: int,
                  recompute: bool = False, swapped_bytes: int = 0, offload_optimizer: bool = False,
                  host_is_device: bool = False, compute_bytes: int = 0) -> MemoryBreakdown:
    """Peak memory of one device of a stage: :func:`memory_parts` with the microbatches in flight.

    Args:
        in_flight: microbatches whose activations are alive at the peak (:func:`in_flight`).
        param_bytes, activation_bytes, input_bytes, dtype_bytes, replicas, zero, microbatches, recompute,
            swapped_bytes, offload_optimizer, host_is_device, compute_bytes: as for :func:`memory_parts`
            (scalars here).

    Returns:
        The breakdown.
    """
    m = memory_parts(param_bytes=param_bytes, activation_bytes=activation_bytes, input_bytes=input_bytes,
                     dtype_bytes=dtype_bytes, replicas=replicas, zero=zero, microbatches=microbatches,
                     recompute=recompute, swapped_bytes=swapped_bytes, offload_optimizer=offload_optimizer,
                     host_is_device=host_is_device, compute_bytes=compute_bytes)
    return MemoryBreakdown(m.params, m.grads, m.optimizer, m.stored, m.working, max(1, in_flight), m.host)


def _affine(fn: Callable[..., float], link: cost_models.LinkSpec, *args: object
            ) -> Callable[[np.ndarray], np.ndarray]:
    """``fn(bytes, *args, link)`` for an array of byte counts, using that alpha-beta costs are affine in bytes.

    Evaluated at two sizes (2^30 and 2^31 bytes, where the bandwidth term dominates and the
    slope is exact to rounding); 0 bytes cost 0, as in cost_models.
    """
    x1, x2 = float(2**30), float(2**31)
    y1, y2 = fn(x1, *args, link), fn(x2, *args, link)
    slope = (y2 - y1) / (x2 - x1)
    icpt = y1 - slope * x1
    return lambda x: np.where(np.asarray(x) > 0, icpt + slope * np.asarray(x, dtype=np.float64), 0.0)


def transfer_ms(fn: Callable[..., float], nbytes: Value, link: cost_models.LinkSpec | None, *args: object
                ) -> Value:
    """One alpha-beta cost, ``fn(nbytes, *args, link)``, on a byte count or an array of them.

    Args:
        fn: a cost_models function (``p2p_ms``, ``allreduce_ms``, ``reduce_scatter_ms``, ...).
        nbytes: bytes, a scalar or an array.
        link: the link; None (no peer) or an infinitely fast one costs 0.
        *args: what ``fn`` takes between the bytes and the link (the rank count of a collective).

    Returns:
        Milliseconds, of the form of ``nbytes``.

    Raises:
        ValueError: from cost_models, for negative bytes or a bad rank count.
    """
    free = link is None or link.gbps == float("inf")
    if isinstance(nbytes, np.ndarray):
        return np.zeros(np.shape(nbytes)) if free else _affine(fn, link, *args)(nbytes)  # type: ignore[arg-type]
    return 0.0 if free else fn(nbytes, *args, link)


def sync_ms(param_bytes: Value, replicas: int, zero: ZeroStage | int, offload_optimizer: bool,
            link: cost_models.LinkSpec | None, host: cost_models.LinkSpec, microbatches: int = 1) -> Value:
    """Gradient synchronisation of a stage after its last backward (the collectives and the offload copies).

    Args:
        param_bytes: parameter bytes of the stage (a scalar or an array).
        replicas: data-parallel degree ``d``.
        zero: ZeRO stage.
        offload_optimizer: the Adam state lives in host memory.
        link: the slowest link between the stage's devices (None for one device).
        host: the link between the stage's devices and their host's memory.
        microbatches: ``M`` (ZeRO-3 gathers the parameters for each microbatch's forward and backward).

    Returns:
        Milliseconds, of the form of ``param_bytes``.
    """
    z = ZeroStage(zero)
    total: Value = param_bytes * 0.0
    if replicas > 1:
        if z == ZeroStage.NONE:
            total = total + transfer_ms(cost_models.allreduce_ms, param_bytes, link, replicas)
        else:
            gathers = 2 * max(1, microbatches) if z == ZeroStage.OS_G_P else 1
            total = total + (transfer_ms(cost_models.reduce_scatter_ms, param_bytes, link, replicas)
                             + gathers * transfer_ms(cost_models.all_gather_ms, param_bytes, link, replicas))
    if offload_optimizer:
        shard = param_bytes // replicas if z >= ZeroStage.OS else param_bytes
        total = total + 2 * transfer_ms(cost_models.p2p_ms, shard, host)
    return total


def copy_ms(param_bytes: Value, replicas: int, bytes_per_ms: float, zero: ZeroStage | int = ZeroStage.NONE
            ) -> Value:
    """The memory copies of a replicated stage's gradient sync (:mod:`hpml_compile.runtime.zero`).

    The gradients accumulate into the flat buffer the collective reads, so ZeRO-0's in-place all-reduce
    copies nothing; under ZeRO-1/2 the all-gathered shards are concatenated and copied into the
    parameters' flat buffer (read + write, twice).

    Args:
        param_bytes: parameter bytes of the stage.
        replicas: data-parallel degree (one device copies nothing).
        bytes_per_ms: the device's streaming rate (:func:`stream_bytes_per_ms`).
        zero: the ZeRO stage.

    Returns:
        Milliseconds, of the form of ``param_bytes`` (0.0 for one device or ZeRO-0).
    """
    if replicas <= 1:
        return 0.0
    return 4 * param_bytes / bytes_per_ms if ZeroStage(zero) >= ZeroStage.OS else param_bytes * 0.0


def optimizer_ms(param_bytes: Value, replicas: int, zero: ZeroStage | int, ms_per_byte: float) -> Value:
    """The optimizer step of one device of a stage: its parameter bytes (its shard under ZeRO-1 and up).

    Args:
        param_bytes: parameter bytes of the stage.
        replicas: data-parallel degree.
        zero: ZeRO stage.
        ms_per_byte: step time per parameter byte (:meth:`CostGraph.optimizer_ms_per_byte`).

    Returns:
        Milliseconds, of the form of ``param_bytes``.
    """
    return ms_per_byte * (param_bytes // replicas if ZeroStage(zero) >= ZeroStage.OS else param_bytes)


def stream_ms(fwd_ms: Value, bwd_ms: Value, param_bytes: Value, activation_bytes: Value, microbatches: int,
              replicas: int, bytes_per_ms: float) -> tuple[Value, Value]:
    """The memory-streaming parts of one microbatch's forward and backward.

    A forward reads the stage's weights and writes its share of the activations; a backward streams about
    twice that. Neither part exceeds the time it belongs to.

    Args:
        fwd_ms: forward of one microbatch.
        bwd_ms: backward of one microbatch.
        param_bytes: parameter bytes of the stage.
        activation_bytes: activation bytes of the stage for the whole batch.
        microbatches: ``M``.
        replicas: data-parallel degree ``d`` (a microbatch on one replica holds ``1 / (M d)`` of the rows).
        bytes_per_ms: the streaming rate (:func:`stream_bytes_per_ms`).

    Returns:
        ``(forward part, backward part)`` in milliseconds.
    """
    moved = param_bytes + activation_bytes / (microbatches * replicas)
    return _minimum(fwd_ms, moved / bytes_per_ms), _minimum(bwd_ms, 2 * moved / bytes_per_ms)


def stream_bytes_per_ms(graph: CostGraph, kinds: list[str]) -> float:
    """Bytes per millisecond one rank streams on the slowest of ``kinds``.

    Args:
        graph: the cost graph (its measured stream rates).
        kinds: device kinds of a stage.

    Returns:
        The profile's one-thread rate where measured, else the catalog's memory bandwidth (inf for a kind
        the catalog does not know).
    """
    rates = []
    for k in kinds:
        measured = graph.stream_gbps(k)
        if measured:
            rates.append(measured[0] * 1e6)
            continue
        try:
            rates.append(cost_models.get_device(base_kind(k)).mem_bw / 1e3)
        except cost_models.UnknownDeviceKind:
            rates.append(float("inf"))
    return min(rates)
