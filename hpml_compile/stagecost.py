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
(:mod:`hpml_compile.runtime.sync.zero`):

- parameters ``P``: whole under every ZeRO stage, since a stage's compute uses
  them whole; ZeRO-3 (:mod:`hpml_compile.runtime.sync.zero3`) holds only the owned
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
  after the forward and come back for one microbatch's backward. A replica
  given its own rows (uneven data parallelism, ``share``) holds
  ``A * rows / batch`` per microbatch instead; :func:`choose_rows` picks those
  rows so that the replicas finish together and each fits.

Times (milliseconds), per step:

- gradient sync (:func:`sync_ms`): a ring all-reduce (ZeRO-0; for a group
  spread over hosts, optionally hierarchical, :func:`hierarchical_allreduce_ms`), reduce-scatter of
  the flat gradient + all-gather of the stepped shards (ZeRO-1/2; a hierarchical ZeRO-1 runs the
  hierarchical all-reduce's first two levels bucket by bucket during the backward and the third on the
  stepped parameters after it, its optimizer state and step ``1 / L`` for ``L`` devices per host instead
  of ``1 / d``, plus ``P / L`` of parameters and of gradients for its shard; ZeRO-3 instead
  all-gathers the stage's parameters twice per microbatch, for its forward and
  its backward, counted here with the step's tail). The ZeRO-0/1/2 all-reduce or
  reduce-scatter runs bucket by bucket during the last backward, as the
  runtime launches it (:func:`overlapped_ms`): only what the backward does not
  hide counts, the backward scaled by the stage's overlap efficiency
  (:func:`hpml_compile.plan.sync_overlap`: 0 on CPU ranks, whose gloo threads
  share the backward's cores, where the runtime syncs after the backward); an offloaded optimizer moves its shard of gradients to the host and
  parameters back. Plus the copies the runtime makes (:func:`copy_ms`: ZeRO-1's
  summed gradient shard into its buffer; ZeRO-3's gathered parameters into place;
  gradients accumulate in the buffer the collective reads and ZeRO-1/2's gather
  writes into the parameters' buffer, so neither is copied).
- compressed gradient sync (:func:`compressed_sync_ms`, a stage with
  ``compress``, :mod:`hpml_compile.compression`): Top-K's two all-gathers of
  ``d k`` values and int32 indices, or PowerSGD's all-reduces of its ``P`` and
  ``Q`` factors (plus the small uncompressed rest as one more latency), and
  the compression compute as passes over the gradient at the device's
  streaming rate. Local SGD (:func:`local_sgd_sync_ms`, ``Plan.sync_every = H``)
  pays one parameter all-reduce every ``H`` steps: ``1 / H`` of it per step
  (the steady state, after the warm-up's per-step sync).
- optimizer step (:func:`optimizer_ms`): the graph's step time per parameter
  byte times the bytes the device updates (its shard under ZeRO-1 and up).
- memory streaming (:func:`stream_ms`): what part of a microbatch's forward and
  backward is reading the weights and writing the activations.

A hierarchical all-reduce over ``H`` hosts of ``h`` devices each (the 2D
scheme of Horovod's hierarchical all-reduce and of Mikami et al., "Massively
Distributed SGD", 2018) is three collectives, each priced on its own link: a
ring reduce-scatter inside each host (``B`` bytes, the intra-host link), a
ring all-reduce of each ``B / h`` shard among the ``H`` devices holding it
(the link between hosts), and a ring all-gather inside each host. The ``h``
shard all-reduces go at once, each over its own pair of devices, as the
cluster's pairwise links describe them; where a host's devices share one
network card, the ``h`` shards share it and the middle term is ``h`` times
longer (then it equals a leader per host all-reducing all ``B`` bytes).
:func:`level_bytes` says what each level moves.

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

import dataclasses
import heapq
import math
from typing import Callable, NamedTuple, Sequence, Union

import numpy as np

import cost_models

from .compression import CompressKind, Compression, powersgd_fraction
from .cluster import Hierarchy
from .costgraph import CostGraph
from .ir import Schedule, base_kind
from .memory import BUCKET_BYTES, FIRST_BUCKET_BYTES, MemoryBreakdown, ZeroStage, autocast_copy_bytes

__all__ = ["MemoryParts", "in_flight", "WEIGHT_SHARE", "weight_part_ms", "memory_parts", "device_memory", "transfer_ms",
           "sync_ms", "on_wire", "wire_ratio", "overlapped_ms",
           "hierarchical_overlapped_ms", "prefetched_gather_ms", "stepped_gather_ms", "param_gather_link", "hierarchical_allreduce_ms",
           "level_bytes",
           "compressed_sync_ms", "local_sgd_sync_ms", "copy_ms",
           "optimizer_ms", "steps_flat", "stream_ms", "stream_bytes_per_ms", "choose_rows", "even_rows", "agree_ms",
           "measured_agree_ms", "skew_wait_ms",
           "meet_ms", "meetings", "tp_bytes", "tp_time", "tp_comm_ms", "tp_link",
           "AGREE_BYTES"]

# A count or a duration: a Python scalar for one stage, a numpy array for many candidates at once.
Value = Union[int, float, np.ndarray]


def _minimum(a: Value, b: Value) -> Value:
    """``min`` for scalars (keeping Python ints), ``np.minimum`` when either is an array."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.minimum(a, b)
    return min(a, b)


def in_flight(schedule: Schedule, microbatches: int, after: Value, stages: int | None = None,
              deferred: int | None = None) -> Value:
    """Microbatches whose activations a stage holds at its peak.

    Args:
        schedule: GPipe (all ``M``), 1F1B (``min(M, j + 1)``; Narayanan et al. 2021: ``S - i``) or ZB-H1
            (``min(M, S)`` on every stage: a microbatch's activations live until its weight-gradient part,
            :mod:`hpml_compile.schedule`). Interleaved 1F1B: 1F1B's count here; a chunk's own depends on the
            bytes of its group's other chunks (:func:`hpml_compile.interleave.peak_in_flight`, which the
            simulator and :func:`hpml_compile.plan.stage_breakdown` use).
        microbatches: ``M``.
        after: ``j``, the number of stages after this one (``S - i - 1`` for stage ``i`` of ``S``).
        stages: ``S`` (ZB-H1; None: not known yet, as in the solvers' tables: ``M``, which bounds it).
        deferred: ZB-H1 with ``S`` known: the stage's cap ``w`` on weight-gradient parts held back
            (:attr:`hpml_compile.plan.Stage.max_deferred`): ``min(M, S - i + min(w, i))``, 1F1B's count plus the
            microbatches held for their ``W``; None: uncapped.

    Returns:
        The count, of the same form as ``after``.

    >>> [in_flight(Schedule.ZB_H1, 8, 1, 4, w) for w in (0, 1, 2, None)]
    [2, 3, 4, 4]
    """
    if schedule is Schedule.GPIPE:
        return after * 0 + microbatches
    if schedule is Schedule.ZB_H1:
        if stages is not None and deferred is not None:
            return _minimum(microbatches, after + 1 + _minimum(deferred, stages - 1 - after))
        return after * 0 + (microbatches if stages is None else min(microbatches, stages))
    return _minimum(microbatches, after + 1)


# ZB-H1's weight-gradient part as a share of the backward, where the profile times the backward whole: half
# (a matmul's backward is two matmuls of the forward's size, one for the input and one for the weight).
# Listed among the plan's assumptions (:mod:`hpml_compile.assumptions`).
WEIGHT_SHARE = 0.5


def weight_part_ms(bwd_ms: Value, share: float = WEIGHT_SHARE, comm_ms: Value = 0.0) -> Value:
    """ZB-H1: the weight-gradient part of a backward of ``bwd_ms`` (the input-gradient part is the rest).

    ``comm_ms``: the part of ``bwd_ms`` that a tensor-parallel stage's collectives take (the all-reduces of
    the inputs' gradients, :func:`tp_comm_ms`). They lie on the inputs' path, so they run in the
    input-gradient part; the weight gradients of the sharded layers are local. ``share`` applies to the
    compute only.

    >>> weight_part_ms(10.0), weight_part_ms(10.0, comm_ms=4.0)
    (5.0, 3.0)
    """
    return (bwd_ms - comm_ms) * share


class MemoryParts(NamedTuple):
    """Bytes on one device of a stage, without the in-flight count (scalars or arrays).

    Attributes:
        params: parameter bytes.
        grads: gradient bytes.
        optimizer: Adam state bytes on the device.
        stored: activation bytes kept per microbatch in flight.
        working: activation bytes of the one microbatch whose backward runs.
        host: bytes moved to host memory (offloaded optimizer state).
        process: bytes the device's process holds besides the stage's tensors (a CPU rank's, :func:`hpml_compile.
            memory.process_bytes`).
    """

    params: Value
    grads: Value
    optimizer: Value
    stored: Value
    working: Value
    host: Value
    process: Value = 0

    @property
    def static(self) -> Value:
        """Bytes held for the whole step: parameters, gradients, optimizer state, the process's own."""
        return self.params + self.grads + self.optimizer + self.process


def memory_parts(*, param_bytes: Value, activation_bytes: Value, input_bytes: Value, dtype_bytes: int,
                 replicas: int, zero: ZeroStage | int, microbatches: int, recompute: bool = False,
                 swapped_bytes: Value = 0, offload_optimizer: bool = False,
                 host_is_device: bool = False, share: tuple[int, int] | None = None,
                 compute_bytes: int = 0, shards: int | None = None, process_bytes: Value = 0) -> MemoryParts:
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
        share: ``(rows, batch)``: this replica trains on ``rows`` of each microbatch, of the ``batch`` rows of
            the whole step (uneven data parallelism); its activations are ``rows / batch`` of the stage's.
            None: the equal split, ``1 / (M d)``.
        compute_bytes: bytes per element of the autocast compute dtype (0: fp32, no autocast): each
            microbatch in flight then also holds its weight copies (:func:`~hpml_compile.memory.autocast_copy_bytes`).
        shards: the ranks the optimizer state is split over under ZeRO-1 and up (None: ``replicas``; a
            hierarchical ZeRO-1, :func:`hpml_compile.plan.zero_shards`: the ranks of one host, ``L``, fewer than
            ``replicas``: it also holds its shard of the parameters and of the summed gradients apart from the
            flat buffers, ``P / L`` each, :mod:`hpml_compile.runtime.sync.zero`).
        process_bytes: what the device's process holds besides the stage's tensors (a CPU rank:
            :meth:`hpml_compile.costgraph.CostGraph.process_bytes`; 0 on a GPU).

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
    opt = opt_full // max(1, shards or d) if z >= ZeroStage.OS else opt_full
    if z == ZeroStage.OS and shards is not None and shards < d:  # hierarchical ZeRO-1: the shard's own tensors
        params, grads = p + p // shards, p + p // shards
    host = p * 0
    if offload_optimizer and not host_is_device:
        host, opt = opt, p * 0
    per = max(1, microbatches) * d

    def one(x: Value) -> Value:  # what one microbatch on this replica holds of a whole-batch size
        return x // per if share is None else x * share[0] // max(1, share[1])

    act = one(activation_bytes)
    swapped = activation_bytes * 0 if host_is_device else one(_minimum(swapped_bytes, activation_bytes))
    if recompute:
        stored, working = _minimum(one(input_bytes), act), act
    else:
        stored, working = act - swapped, swapped
    copies = autocast_copy_bytes(p, dtype_bytes, compute_bytes, microbatches, d)
    if recompute:  # the copies of the one microbatch whose forward is recomputed
        working = working + copies
    else:
        stored = stored + copies
    return MemoryParts(params, grads, opt, stored, working, host, process_bytes + p * 0)  # of the form of p


def device_memory(*, param_bytes: int, activation_bytes: int, input_bytes: int, dtype_bytes: int,
                  replicas: int, zero: ZeroStage | int, microbatches: int, in_flight: int,
                  recompute: bool = False, swapped_bytes: int = 0, offload_optimizer: bool = False,
                  host_is_device: bool = False, share: tuple[int, int] | None = None,
                  compute_bytes: int = 0, shards: int | None = None, process_bytes: int = 0) -> MemoryBreakdown:
    """Peak memory of one device of a stage: :func:`memory_parts` with the microbatches in flight.

    Args:
        in_flight: microbatches whose activations are alive at the peak (:func:`in_flight`).
        param_bytes, activation_bytes, input_bytes, dtype_bytes, replicas, zero, microbatches, recompute,
            swapped_bytes, offload_optimizer, host_is_device, share, compute_bytes, shards, process_bytes: as for
            :func:`memory_parts` (scalars here).

    Returns:
        The breakdown.
    """
    m = memory_parts(param_bytes=param_bytes, activation_bytes=activation_bytes, input_bytes=input_bytes,
                     dtype_bytes=dtype_bytes, replicas=replicas, zero=zero, microbatches=microbatches,
                     recompute=recompute, swapped_bytes=swapped_bytes, offload_optimizer=offload_optimizer,
                     host_is_device=host_is_device, share=share, compute_bytes=compute_bytes, shards=shards,
                     process_bytes=process_bytes)
    return MemoryBreakdown(m.params, m.grads, m.optimizer, m.stored, m.working, max(1, in_flight), m.host,
                           int(m.process))


def tp_bytes(total: Value, sharded: Value, tp: int) -> Value:
    """Bytes on one rank of a tensor-parallel group of ``tp``: the replicated rest whole, the sharded part
    ``1 / tp`` (floored on the sum, in the solver's table and the validator alike).

    >>> tp_bytes(100, 80, 4), tp_bytes(100, 80, 1)
    (40, 100)
    """
    return total if tp <= 1 else total - sharded + sharded // tp


def tp_time(full: Value, fixed: Value, sharded: Value, sharded_fixed: Value, fraction: Value, tp: int) -> Value:
    """One rank's time for ``fraction`` of the batch rows under tensor parallelism of ``tp``.

    ``fixed + (full - fixed) * fraction`` (:meth:`hpml_compile.costgraph.CostGraph.cost_at`) with the
    per-row part of the sharded nodes divided by ``tp``; the fixed part (a GPU's per-op cost: every rank
    launches every op) stays whole.

    Args:
        full: time of the nodes for the whole batch.
        fixed: its fixed part.
        sharded: the sharded nodes' time for the whole batch (part of ``full``).
        sharded_fixed: their fixed part.
        fraction: the share of the batch rows (``1 / (M d)``).
        tp: the degree.

    >>> tp_time(10.0, 2.0, 6.0, 2.0, 0.5, 4), tp_time(10.0, 2.0, 6.0, 2.0, 0.5, 1)
    (4.5, 6.0)
    """
    per_row = full - fixed if tp <= 1 else full - fixed - (sharded - sharded_fixed) * (1 - 1 / tp)
    return fixed + per_row * fraction


def tp_comm_ms(allreduce_bytes: Value, gather_bytes: Value, count: Value, tp: int,
               link: cost_models.LinkSpec | None, compute_ms: Value = 0.0) -> Value:
    """The tensor-parallel collectives of one pass over a microbatch (blocking: the next op needs their result).

    ``count`` collectives in all: the all-gathers of ``gather_bytes`` (one per gathered tensor, an LM head's
    logits) and the rest all-reduces sharing ``allreduce_bytes`` equally (one per unit of a transformer:
    Megatron's two per layer forward, two backward), ring algorithms on the group's ``link``
    (:mod:`cost_models`), one latency each. Where the link says what each ms of compute before a layer's
    all-reduce adds to it (``LinkSpec.tp_reduce_per_ms``: the group waiting for its later rank, measured by
    :func:`hpml_compile.profile.links.tp_reduce_rows`), the all-reduces add that part of ``compute_ms``, the
    compute they follow: a rank's compute of the pass, the ops between one all-reduce and the next summed.

    Args:
        allreduce_bytes: bytes all-reduced (each rank's buffer), summed over the collectives.
        gather_bytes: bytes all-gathered (the gathered output on each rank).
        count: the number of collectives (all-reduces and all-gathers).
        tp: the group's ranks.
        link: the slowest link inside the group (None or infinitely fast: free).
        compute_ms: one rank's compute of the pass (the sharded ops at ``1 / tp``), of the form of the bytes.

    Returns:
        Milliseconds, of the form of the bytes.

    >>> nv = cost_models.LinkSpec("example", gbps=100.0, latency_us=10.0, source="example")
    >>> round(tp_comm_ms(2e6, 0, 2, 2, nv), 4) == round(2 * cost_models.allreduce_ms(1e6, 2, nv), 4)
    True
    >>> waits = dataclasses.replace(nv, tp_reduce_per_ms=0.1)
    >>> round(tp_comm_ms(2e6, 0, 2, 2, waits, compute_ms=8.0) - tp_comm_ms(2e6, 0, 2, 2, nv, compute_ms=8.0), 4)
    0.8
    """
    if tp <= 1 or link is None:
        return allreduce_bytes * 0.0
    link = tp_link(link)
    gathers = (gather_bytes > 0) * 1 if isinstance(gather_bytes, np.ndarray) else int(gather_bytes > 0)
    reduces = np.maximum(count - gathers, 0) if isinstance(count, np.ndarray) else max(0, count - gathers)
    safe = np.maximum(reduces, 1) if isinstance(reduces, np.ndarray) else max(1, reduces)
    one = transfer_ms(cost_models.allreduce_ms, allreduce_bytes / safe, link, tp)
    wait = link.tp_reduce_per_ms * compute_ms * (reduces > 0)
    return reduces * one + wait + transfer_ms(cost_models.all_gather_ms, gather_bytes, link, tp)


def tp_link(link: cost_models.LinkSpec) -> cost_models.LinkSpec:
    """The link as the tensor-parallel collectives see it: gloo's own all-reduce and all-gather, called on the
    stage's group inside each sharded layer (:mod:`hpml_compile.codegen.tpops`), not the runtime's data-parallel
    path.

    A probed CPU link carries fits of its own for the all-reduce, reduce-scatter and all-gather as the gradient
    sync runs them, through shared memory (:mod:`hpml_compile.profile.links`); the layers' collectives do not go
    that way. They are priced on the ``tp_reduce`` and ``tp_gather`` fits where the probe measured them (gloo's
    all-reduce in a chain of compute and all-gather just after the ranks computed, as a layer's are), else on the link's own fit (gloo's
    send/recv and all-reduce in a loop). Measured between two 1-thread ranks of a 2-core host: a gloo all-reduce
    of 4 MiB took 2.9 ms (the shared-memory fit said 1.3 ms, the link's own fit 3.1 ms), of 13 MiB 11.7 ms (3.1,
    9.8), and an all-gather into 16 MiB 16 ms with its concatenation (2.2 ms; 9.7 on the fit of gloo's all-gather
    after compute). The link's own fit, made at 64 KiB and up, says less than a layer's small all-reduce costs:
    0.15 ms at 64 KiB where gloo took 0.22-0.29 ms in a loop and after compute on the same host (its p10 over
    30 tries each while other jobs kept it busy).

    >>> lo = cost_models.LinkSpec("lo", 2.0, 100.0, "example", collectives=(("all_reduce", 10.0, 240.0),
    ...                                                                    ("tp_gather", 1.8, 340.0)))
    >>> tp_link(lo).for_collective("all_reduce").gbps, tp_link(lo).for_collective("all_gather").gbps
    (2.0, 1.8)
    >>> tp_link(dataclasses.replace(lo, collectives=(("tp_reduce", 1.5, 150.0),))).for_collective("all_reduce").gbps
    1.5
    """
    own = {"tp_gather": "all_gather", "tp_reduce": "all_reduce"}
    return dataclasses.replace(link, collectives=tuple((own[op], gbps, lat) for op, gbps, lat in link.collectives
                                                       if op in own))


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


def overlapped_ms(fn: Callable[..., float], param_bytes: Value, link: cost_models.LinkSpec | None, replicas: int,
                  window_ms: Value) -> Value:
    """What a gradient reduce launched bucket by bucket during the last backward adds to the step.

    The runtime (:class:`hpml_compile.runtime.sync.zero.GradBuckets`) cuts the ``P`` gradient bytes into a first
    bucket of ``s = min(P, 1 MiB)`` and then buckets of 25 MiB, in reverse order of the parameters, and
    launches each one as soon as its gradients are ready; the collectives run one after another. With the
    gradients becoming ready evenly over a ``window_ms`` of backward, bucket ``i`` is ready at
    ``r_i = W (1 - a_i / P)`` (``a_i``: bytes before it) and the last one ends at
    ``max_i (r_i + sum_{j >= i} c_j)``; the bucket costs being affine in their bytes, the maximum is at the
    first bucket or the last, so the step pays ``max(C - W (1 - s / P), c_last)`` past the backward: the whole
    ``C`` (all buckets, one latency each) minus the backward that runs after the first launch, and never
    less than the last bucket, which starts only when the backward ends.

    Args:
        fn: the collective's cost (``cost_models.allreduce_ms`` or ``cost_models.reduce_scatter_ms``).
        param_bytes: the gradient bytes (a scalar or an array).
        link: the slowest link of the group (None: one device, free).
        replicas: ranks in the group.
        window_ms: the backward over which the buckets become ready (the last microbatch's; ZeRO-1/2: its
            last ``1 / d``, since a bucket spans every replica's shard).

    Returns:
        Milliseconds, of the form of ``param_bytes``.

    >>> link = cost_models.LinkSpec("example", gbps=1.0, latency_us=0.0, source="example")
    >>> mib51 = 51 << 20  # buckets of 1, 25 and 25 MiB
    >>> round(transfer_ms(cost_models.allreduce_ms, mib51, link, 2), 3)  # after the backward
    53.477
    >>> [round(overlapped_ms(cost_models.allreduce_ms, mib51, link, 2, w), 3) for w in (0.0, 20.0, 100.0)]
    [53.477, 33.87, 26.214]

    (20 ms of backward hide 19.6 ms; 100 ms hide all but the last bucket.)
    """
    if replicas <= 1 or link is None:
        return param_bytes * 0.0
    return _bucketed(lambda b: transfer_ms(fn, b, link, replicas), param_bytes, window_ms)


def prefetched_gather_ms(param_bytes: Value, link: cost_models.LinkSpec | None, replicas: int,
                         window_ms: Value) -> Value:
    """What a flat ZeRO-1/2 parameter all-gather prefetched under the next forward adds to the step.

    The runtime (:meth:`hpml_compile.runtime.sync.zero.FlatShard.enable_prefetch`) launches each bucket's
    all-gather after the optimizer step, in the forward's order (from the bottom of the flat buffer), and the
    next step's forward waits for a bucket just before the first module reading it. Assumed here, as for the
    gradient buckets (:func:`overlapped_ms`): the gathers run one after another at the link's rate, the
    forward reads the parameters evenly over its ``window_ms``, and only the stage's first microbatch's
    forward hides them (later microbatches find them gathered; the pipeline's fill before a later stage's
    first forward, which would hide more, is not counted). The step pays what that forward does not cover:
    never less than the first bucket's gather (nothing runs before the forward needs it), and
    ``max(0, C - window)`` overall (``C``: every bucket's gather, one latency each), by
    :func:`overlapped_ms`'s arithmetic with the roles of the first and last bucket swapped. A flat bucket is the
    same sub-range of every replica's shard, so the forward has read all of them once it is ``1 / d`` through
    the stage: the window is ``1 / d`` of the forward (the hierarchical shard's buckets are contiguous, its
    window the whole forward: :func:`sync_ms`).

    Args:
        param_bytes: the stage's parameter bytes.
        link: the slowest link of the group (None: one device, free).
        replicas: ranks in the group.
        window_ms: the forward that hides the gathers (one microbatch's, times the overlap efficiency).

    >>> link = cost_models.LinkSpec("example", gbps=1.0, latency_us=0.0, source="example")
    >>> mib51 = 51 << 20
    >>> serial = transfer_ms(cost_models.all_gather_ms, mib51, link, 2)
    >>> [round(prefetched_gather_ms(mib51, link, 2, w), 3) for w in (0.0, 20.0, 1000.0)], round(serial, 3)
    ([26.739, 16.935, 13.107], 26.739)

    (No forward: the serial gather. 20 ms of forward over 2 replicas: its first 10 ms read every bucket, hiding 9.8 ms.
    A long forward hides all but the first bucket gathered, the bottom of the buffer: 25 MiB here.)
    """
    if replicas <= 1 or link is None:
        return param_bytes * 0.0
    return _bucketed(lambda b: transfer_ms(cost_models.all_gather_ms, b, link, replicas), param_bytes,
                     window_ms / replicas)


def hierarchical_overlapped_ms(param_bytes: Value, hier: Hierarchy, window_ms: Value, wire: float = 1.0) -> Value:
    """What a hierarchical all-reduce launched bucket by bucket during the last backward adds to the step.

    :func:`overlapped_ms` with a bucket's collective being its chain of three
    (:func:`hierarchical_allreduce_ms`: reduce-scatter in the host, all-reduce between hosts, all-gather), as
    the runtime runs it (:class:`hpml_compile.runtime.sync.comm.ChainQueue`: the chains one after another, each
    level after the previous one), so what stays exposed is at least the last bucket's whole chain.

    Args:
        param_bytes: the gradient bytes (a scalar or an array).
        hier: the group by host (:func:`hpml_compile.cluster.hierarchy`).
        window_ms: the backward over which the buckets become ready (the last microbatch's, scaled by the
            stage's overlap efficiency).
        wire: bytes each gradient byte takes on the wire (:func:`on_wire`; the buckets are cut on the gradients).

    Returns:
        Milliseconds, of the form of ``param_bytes``.

    >>> from hpml_compile.cluster import hierarchy, load_cluster
    >>> h = hierarchy(load_cluster("2node-a100-16"), [f"gpu{i}" for i in range(16)])
    >>> mib100 = 100 << 20  # 1 MiB, then 25 MiB buckets: the last of 24 MiB
    >>> round(hierarchical_allreduce_ms(mib100, h), 2)  # after the backward, one chain
    1.75
    >>> [round(hierarchical_overlapped_ms(mib100, h, w), 2) for w in (0.0, 1.0, 100.0)]
    [2.12, 1.13, 0.49]

    (No backward to hide behind: five chains' latencies; 1 ms hides about 1 ms; a long one all but the last
    bucket's chain, 0.49 ms.)
    """
    return _bucketed(lambda b: hierarchical_allreduce_ms(b * wire, hier), param_bytes, window_ms)


def _bucketed(cost: Callable[[float], float], param_bytes: Value, window_ms: Value) -> Value:
    """:func:`overlapped_ms` for any bucket cost affine in its bytes (``cost(bytes)``, milliseconds)."""
    c1 = float(cost(float(BUCKET_BYTES)))
    c2 = float(cost(2.0 * BUCKET_BYTES))
    beta = (c2 - c1) / BUCKET_BYTES
    alpha = max(0.0, c1 - beta * BUCKET_BYTES)
    first = np.minimum(param_bytes, FIRST_BUCKET_BYTES) if isinstance(param_bytes, np.ndarray) \
        else min(param_bytes, FIRST_BUCKET_BYTES)
    rest = param_bytes - first
    if isinstance(rest, np.ndarray):
        later = np.ceil(rest / BUCKET_BYTES)
        tail_bytes = np.where(rest > 0, rest - (later - 1) * BUCKET_BYTES, first)
    else:
        later = math.ceil(rest / BUCKET_BYTES)
        tail_bytes = rest - (later - 1) * BUCKET_BYTES if rest > 0 else first
    total = (1 + later) * alpha + beta * param_bytes
    last = alpha + beta * tail_bytes
    safe = np.maximum(param_bytes, 1) if isinstance(param_bytes, np.ndarray) else max(param_bytes, 1)
    hidden = window_ms * (1 - first / safe)
    out = np.maximum(total - hidden, last) if isinstance(total, np.ndarray) or isinstance(hidden, np.ndarray) \
        else max(total - hidden, last)
    return np.where(param_bytes > 0, out, 0.0) if isinstance(out, np.ndarray) else (out if param_bytes > 0 else 0.0)


def hierarchical_allreduce_ms(nbytes: Value, hier: Hierarchy) -> Value:
    """A hierarchical all-reduce of ``nbytes`` per device (see the module docstring).

    Args:
        nbytes: bytes each device contributes (a scalar or an array).
        hier: the group by host (:func:`hpml_compile.cluster.hierarchy`).

    Returns:
        Milliseconds: reduce-scatter and all-gather inside the hosts, all-reduce of a shard between them.

    Example:
        >>> from hpml_compile.cluster import hierarchy, load_cluster
        >>> c = load_cluster("2node-a100-16")
        >>> h = hierarchy(c, [f"gpu{i}" for i in range(16)])  # 2 hosts x 8, NVLink inside, 100 GbE between
        >>> round(hierarchical_allreduce_ms(2**30, h), 2), round(cost_models.allreduce_ms(2**30, 16, h.inter), 2)
        (17.09, 161.81)
    """
    h, hosts = hier.per_host, len(hier.hosts)
    return (transfer_ms(cost_models.reduce_scatter_ms, nbytes, hier.intra, h)
            + transfer_ms(cost_models.allreduce_ms, nbytes / h, hier.inter, hosts)
            + transfer_ms(cost_models.all_gather_ms, nbytes, hier.intra, h))


def level_bytes(nbytes: int, replicas: int, hier: Hierarchy | None) -> dict[str, int]:
    """Bytes one device sends per all-reduce of ``nbytes``, by level (ring algorithms).

    Args:
        nbytes: bytes each device contributes.
        replicas: devices in the group.
        hier: the group by host for a hierarchical all-reduce; None for a flat ring.

    Returns:
        ``{"flat": ...}`` for a flat ring (``2 (d-1)/d B``, every hop over the slowest link it crosses), or
        ``{"intra": ..., "inter": ...}``: ``2 (h-1)/h B`` inside the host and ``2 (H-1)/H B / h`` between hosts.

    >>> level_bytes(1600, 4, None)
    {'flat': 2400}
    """
    if hier is None:
        return {"flat": 2 * (replicas - 1) * nbytes // max(1, replicas)}
    h, hosts = hier.per_host, len(hier.hosts)
    return {"intra": 2 * (h - 1) * nbytes // h, "inter": 2 * (hosts - 1) * nbytes // (hosts * h)}


def on_wire(fn: Callable[..., float], wire: float) -> Callable[..., float]:
    """A collective's cost ``fn(bytes, ...)`` with each gradient byte taking ``wire`` bytes on the wire.

    ``wire`` is the reduce dtype's size over the gradients' (``Plan.reduce_dtype``: 0.5 for bf16 or fp16
    gradients of fp32 parameters, :func:`wire_ratio`); 1 gives ``fn`` itself. The buckets stay cut on the
    gradients' bytes, as the runtime cuts them (:mod:`hpml_compile.runtime.sync.reducecast`).
    """
    if wire == 1.0:
        return fn
    return lambda nbytes, *args: fn(nbytes * wire, *args)


def wire_ratio(reduce_bytes: int, grad_bytes: int) -> float:
    """Bytes on the wire per gradient byte: the reduce dtype's element size over the gradients' (at most 1).

    >>> wire_ratio(2, 4), wire_ratio(4, 4), wire_ratio(4, 2)
    (0.5, 1.0, 1.0)
    """
    return min(1.0, reduce_bytes / grad_bytes)


def sync_ms(param_bytes: Value, replicas: int, zero: ZeroStage | int, offload_optimizer: bool,
            link: cost_models.LinkSpec | None, host: cost_models.LinkSpec, hier: Hierarchy | None = None,
            bwd_ms: Value | None = None, microbatches: int = 1, overlap: float = 1.0,
            fwd_ms: Value | None = None, wire: float = 1.0) -> Value:
    """Gradient synchronisation of a stage past its last backward (the collectives and the offload copies).

    Args:
        param_bytes: parameter bytes of the stage (a scalar or an array).
        replicas: data-parallel degree ``d``.
        zero: ZeRO stage.
        offload_optimizer: the Adam state lives in host memory.
        link: the slowest link between the stage's devices (None for one device).
        host: the link between the stage's devices and their host's memory.
        hier: the stage's devices by host, for a hierarchical all-reduce (ZeRO-0: overlapped as the flat
            one is, :func:`hierarchical_overlapped_ms`; ZeRO-1: the reduce-scatter in the host and the shard's
            all-reduce between hosts on the gradients, bucket by bucket during the backward as ZeRO-0's chains,
            then the all-gather in the host of the stepped parameters, whole); None: a flat ring.
        bwd_ms: one microbatch's backward on one replica: the all-reduce (ZeRO-0) or reduce-scatter (ZeRO-1/2)
            overlaps it bucket by bucket (:func:`overlapped_ms`), as the runtime runs it on ranks. None: the
            whole collective after the backward.
        microbatches: ``M`` (ZeRO-3 gathers the parameters for each microbatch's forward and backward).
        overlap: the fraction of ``bwd_ms`` that hides the collective (:func:`hpml_compile.plan.sync_overlap`,
            the rule the runtime follows); 0: the runtime does not bucket this stage's sync, so it is priced
            as one collective after the backward.
        fwd_ms: one microbatch's forward on one replica, where the ZeRO-1/2 parameter all-gather is prefetched
            (the runtime does it where it buckets: ``overlap > 0``; :meth:`hpml_compile.runtime.sync.zero.FlatShard.
            enable_prefetch`): each bucket's gather launched after the optimizer step, in the forward's order,
            one after another, and waited where the next step's first forward reads the bucket. Priced by
            :func:`prefetched_gather_ms`. None: the gather after the step, serial (as before).
        wire: bytes each gradient byte takes in the gradient collectives (all-reduce, reduce-scatter, the
            hierarchical levels), the plan's reduce dtype over the gradients' (:func:`wire_ratio`); the
            parameter all-gathers stay in the parameters' dtype. 1: the gradients' own.

    Returns:
        Milliseconds, of the form of ``param_bytes``.

    >>> lo = cost_models.LinkSpec("loopback", gbps=3.1, latency_us=50.0, source="example")
    >>> mib23 = 23 << 20
    >>> [round(sync_ms(mib23, 2, 0, False, lo, lo, bwd_ms=10.0, overlap=w), 3) for w in (1.0, 0.0)]
    [7.542, 7.98]

    (Overlap 1 hides only the first 1 MiB bucket here: the other 22 MiB start when the backward ends. Overlap
    0, a CPU group, pays the whole all-reduce once, as the runtime runs it, after the members meet:
    :func:`meet_ms`.)
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be a fraction of the backward in [0, 1], got {overlap}")
    z = ZeroStage(zero)
    total: Value = param_bytes * 0.0
    if replicas > 1 and z == ZeroStage.OS and hier is not None:  # hierarchical ZeRO-1 (runtime.sync.zero)
        h, hosts = hier.per_host, len(hier.hosts)

        def chain(b: Value) -> Value:  # one bucket: reduce-scatter in the host, its shard's all-reduce between
            return (transfer_ms(cost_models.reduce_scatter_ms, b * wire, hier.intra, h)
                    + transfer_ms(cost_models.allreduce_ms, b * wire / h, hier.inter, hosts))
        def gather(b: Value) -> Value:  # the stepped parameters, in the host
            return transfer_ms(cost_models.all_gather_ms, b, hier.intra, h)
        if bwd_ms is None or overlap <= 0:  # one bucket, after the backward; the gather after the step
            total = (total + _met(param_bytes, replicas, hier.inter) + chain(param_bytes)
                     + stepped_gather_ms(param_bytes, replicas, z, None, hier))
        else:  # the levels during the backward; after the step one all-gather per bucket, under the next forward
            window = 0.0 if fwd_ms is None else overlap * fwd_ms  # contiguous buckets: the whole forward reads them
            total = total + _bucketed(chain, param_bytes, overlap * bwd_ms) + _bucketed(gather, param_bytes, window)
    elif replicas > 1:
        reduce = on_wire(cost_models.allreduce_ms if z == ZeroStage.NONE else cost_models.reduce_scatter_ms, wire)
        if z == ZeroStage.NONE and hier is not None and (bwd_ms is None or overlap <= 0):
            # three collectives after the backward, after the members meet
            total = total + _met(param_bytes, replicas, hier.inter) + hierarchical_allreduce_ms(param_bytes * wire,
                                                                                                hier)
        elif z == ZeroStage.NONE and hier is not None:  # each bucket's chain of three during the backward
            total = total + hierarchical_overlapped_ms(param_bytes, hier, overlap * bwd_ms, wire)
        elif bwd_ms is None or z == ZeroStage.OS_G_P or overlap <= 0:  # ZeRO-3's is not overlapped (zero3)
            # one collective after the backward, after the members meet (ZeRO-3's too: its COLL_WAIT events)
            total = total + _met(param_bytes, replicas, link) + transfer_ms(reduce, param_bytes, link, replicas)
        else:
            window = overlap * (bwd_ms if z == ZeroStage.NONE else bwd_ms / replicas)
            total = total + overlapped_ms(reduce, param_bytes, link, replicas, window)
        prefetch = z in (ZeroStage.OS, ZeroStage.OS_G) and bwd_ms is not None and overlap > 0 and fwd_ms is not None
        if prefetch:  # ZeRO-1/2 bucketed: the stepped shards' gathers under the next forward (prefetched_gather_ms)
            total = total + prefetched_gather_ms(param_bytes, link, replicas, overlap * fwd_ms)
        elif z == ZeroStage.OS_G_P:  # ZeRO-3: the parameters twice per microbatch, each after compute, each
            # after the members meet (the communicator's collectives all do: .runtime.sync.comm)
            total = total + (meetings(z, replicas, microbatches) - 1) * (
                _met(param_bytes, replicas, link)
                + transfer_ms(cost_models.all_gather_ms, param_bytes, param_gather_link(link), replicas))
        elif z != ZeroStage.NONE:  # ZeRO-1/2: the stepped shards once, after the optimizer step
            total = total + stepped_gather_ms(param_bytes, replicas, z, link)
    if offload_optimizer:
        shards = hier.per_host if hier is not None and z == ZeroStage.OS else replicas
        shard = param_bytes // shards if z >= ZeroStage.OS else param_bytes
        total = total + 2 * transfer_ms(cost_models.p2p_ms, shard, host)
    return total


def param_gather_link(link: cost_models.LinkSpec | None) -> cost_models.LinkSpec | None:
    """The link as ZeRO-3's parameter all-gathers see it: its ``param_gather`` fit as the all-gather's, where the
    probe measured one (:data:`hpml_compile.profile.links.PARAM_GATHER`: the all-gather started after the ranks
    computed, through the transport the runtime uses, :mod:`hpml_compile.runtime.sync.zero3`); else the link itself.

    >>> lo = cost_models.LinkSpec("lo", 4.0, 60.0, "example", collectives=(("all_gather", 11.0, 280.0),
    ...                                                                    ("param_gather", 2.0, 1500.0)))
    >>> param_gather_link(lo).for_collective("all_gather").latency_us, param_gather_link(None)
    (1500.0, None)
    """
    if link is None:
        return None
    for name, gbps, lat in link.collectives:
        if name == "param_gather":
            rest = tuple(c for c in link.collectives if c[0] != "all_gather")
            return dataclasses.replace(link, collectives=rest + (("all_gather", gbps, lat),))
    return link


def stepped_gather_ms(param_bytes: Value, replicas: int, zero: ZeroStage | int, link: cost_models.LinkSpec | None,
                      hier: Hierarchy | None = None) -> Value:
    """ZeRO-1/2's all-gather of the stepped parameters where it runs whole, after the optimizer step.

    The runtime (:meth:`hpml_compile.runtime.sync.zero.FlatShard.all_gather`) gathers the shards once the optimizer
    has stepped them. Where it buckets the stage's sync, the gathers are prefetched under the next forward
    (:func:`prefetched_gather_ms`); elsewhere (CPU ranks, which sync after the backward) it is one blocking
    collective after the step, which :func:`sync_ms` counts in the stage's sync and
    :func:`hpml_compile.simulate.simulate` places after the optimizer step, where the runtime does it.

    Args:
        param_bytes: parameter bytes of the stage.
        replicas: data-parallel degree ``d``.
        zero: ZeRO stage (0 and 3 have no such gather: 0.0).
        link: the slowest link between the stage's devices (a flat gather).
        hier: a hierarchical ZeRO-1's devices by host: the gather runs inside each host.

    Returns:
        Milliseconds, of the form of ``param_bytes``.

    >>> lo = cost_models.LinkSpec("loopback", gbps=2.0, latency_us=100.0, source="example")
    >>> [round(float(stepped_gather_ms(64e6, 2, z, lo)), 3) for z in (0, 1, 2, 3)]
    [0.0, 16.3, 16.3, 0.0]
    """
    z = ZeroStage(zero)
    if replicas <= 1 or z not in (ZeroStage.OS, ZeroStage.OS_G):
        return param_bytes * 0.0
    if hier is not None:  # the members of the stage meet, then each host gathers its ranks' shards
        return (_met(param_bytes, replicas, hier.inter)
                + transfer_ms(cost_models.all_gather_ms, param_bytes, hier.intra, hier.per_host))
    return _met(param_bytes, replicas, link) + transfer_ms(cost_models.all_gather_ms, param_bytes, link, replicas)


def meet_ms(replicas: int, link: cost_models.LinkSpec | None) -> float:
    """The meeting before each of the runtime's blocking gradient collectives: one 4-byte all-reduce over the stage.

    :meth:`hpml_compile.runtime.sync.comm.DistComm._collective` has the members meet (a one-element all-reduce, or the
    shared-memory collectives' barrier, which is one) before the transfer, so that waiting for the slowest member
    is not counted as communication. On the 2-core development VM it measured 0.42 ms at least (the demo's
    ``COLL_WAIT`` events), twice per step of a ZeRO-1 stage, and was priced at nothing before.
    All latency: priced as :func:`agree_ms` prices the loss agreement, on the slowest link between the members.
    The collectives launched during the backward (bucketed, on GPUs) do not meet; ZeRO-3's reduce-scatter does,
    and so does each of its parameter all-gathers (:func:`meetings`).

    >>> lo = cost_models.LinkSpec("loopback", gbps=1.6, latency_us=500.0, source="example")
    >>> round(meet_ms(2, lo), 3), meet_ms(1, lo), meet_ms(2, None)
    (1.0, 0.0, 0.0)
    """
    return _latency_bound_ms(4, replicas, link)


def meetings(zero: ZeroStage | int, replicas: int, microbatches: int, stepped_gather: bool = False) -> int:
    """How many times a step the replicas of a stage meet (:func:`meet_ms`): before the gradient sync, and under
    ZeRO-3 also before each microbatch's two parameter all-gathers (its forward's and its backward's), which run
    through the communicator's blocking collective (:meth:`hpml_compile.runtime.sync.comm.DistComm.all_gather`);
    with ``stepped_gather``, before ZeRO-1/2's all-gather after the optimizer step too
    (:func:`stepped_gather_ms`, which prices that meeting on the link).
    At each meeting the step pays the wait for the later replica and the meeting itself, which the simulator
    takes from the host's probe where it measured them (:func:`hpml_compile.simulate.replica_meeting_ms`,
    :func:`skew_wait_ms`). On the demo's ZeRO-3 stage (2 CPU ranks, one microbatch) the gathers' meetings
    (``COLL_WAIT`` events) took what the sync's did, about 0.5-0.8 ms each on the busy development VM, and were
    priced at nothing before. One replica meets nobody; it counts 1 (the sync's place) so that a caller may
    divide by the count.

    >>> meetings(3, 2, 4), meetings(1, 2, 4), meetings(1, 2, 4, stepped_gather=True), meetings(3, 1, 4)
    (9, 1, 2, 1)
    """
    if replicas <= 1:
        return 1
    return 1 + (2 * max(1, microbatches) if ZeroStage(zero) == ZeroStage.OS_G_P else 0) + int(stepped_gather)


def _met(param_bytes: Value, replicas: int, link: cost_models.LinkSpec | None) -> Value:
    """:func:`meet_ms` where there are bytes to sync (a stage without parameters runs no collective)."""
    return meet_ms(replicas, link) * (param_bytes > 0)


# The loss agreement's vector (hpml_compile.runtime.execute.batchcheck): the loss sum and three float64s of the batch check.
AGREE_BYTES = 4 * 8


def agree_ms(ranks: int, link: cost_models.LinkSpec | None) -> float:
    """The step's loss agreement: one all-reduce of ``AGREE_BYTES`` over every rank of the job.

    Before any rank steps its optimizer, the runtime's ranks all-reduce the step's loss together with the
    batch check (:mod:`hpml_compile.runtime.execute.batchcheck`, :func:`hpml_compile.runtime.execute.executor.run_actions`'
    ``LOSS`` action), so that every rank reports the batch's loss and a failed step can be retried on all of
    them. 32 bytes are all latency: priced as a binomial tree (``2 ceil(log2 n)`` messages), which is how
    gloo and NCCL run messages this small, on the slowest link between the job's ranks. One process (one
    rank, or every stage in one process) pays nothing.

    Args:
        ranks: the job's ranks (the plan's devices).
        link: the slowest link between them (None: one rank).

    >>> lo = cost_models.LinkSpec("loopback", gbps=1.6, latency_us=500.0, source="example")
    >>> round(agree_ms(2, lo), 3), round(agree_ms(8, lo), 3), agree_ms(1, None)
    (1.0, 3.0, 0.0)
    """
    return _latency_bound_ms(AGREE_BYTES, ranks, link)


def measured_agree_ms(pair_ms: float, ranks: int) -> float:
    """The loss agreement over ``ranks`` CPU ranks of one host, from its measured time between two of them.

    ``pair_ms`` is the all-reduce as the runtime runs it between two ranks of this host
    (:func:`hpml_compile.profile.process.replicated_step_figures`): a binomial tree over ``n`` ranks takes
    ``ceil(log2 n)`` such rounds (one for two ranks, where the figure is exact; more ranks are that many rounds,
    which was not measured). One rank pays nothing.

    >>> measured_agree_ms(0.9, 2), measured_agree_ms(0.9, 4), measured_agree_ms(0.9, 1)
    (0.9, 1.8, 0.0)
    """
    return pair_ms * math.ceil(math.log2(ranks)) if ranks > 1 else 0.0


def skew_wait_ms(pair_ms: float, replicas: int) -> float:
    """What a replicated stage waits each step for its latest replica, from two ranks' measured skew.

    Replicas that do the same work reach their first collective at different times, and the step goes on when
    the last one arrives: with each replica's arrival a draw around the mean, the step pays the expected maximum
    over ``replicas`` draws less the mean. ``pair_ms`` is that for two ranks of this host, measured
    (:func:`hpml_compile.profile.process.replicated_step_figures`); for ``d`` replicas it grows as the expected
    maximum of ``d`` normal draws does (Blom's approximation, ``Phi^-1((d - 0.375) / (d + 0.25))``, over its
    value at 2; an assumption: only two ranks were measured). One replica waits for nobody.

    >>> skew_wait_ms(0.5, 2), round(skew_wait_ms(0.5, 4), 3), skew_wait_ms(0.5, 1)
    (0.5, 0.89, 0.0)
    """
    if replicas <= 1 or pair_ms <= 0:
        return 0.0
    return pair_ms * _blom(replicas) / _blom(2)


def _blom(n: int) -> float:
    """Blom's approximation of the expected maximum of ``n`` standard normal draws."""
    from statistics import NormalDist

    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def _latency_bound_ms(nbytes: int, ranks: int, link: cost_models.LinkSpec | None) -> float:
    """An all-reduce of a few bytes over ``ranks``: a binomial tree of messages (nothing in one process)."""
    if ranks <= 1 or link is None or link.gbps == float("inf"):
        return 0.0
    return cost_models.allreduce_ms(nbytes, ranks, link, cost_models.CollectiveAlgo.TREE)


def compressed_sync_ms(param_bytes: Value, replicas: int, compress: Compression, link: cost_models.LinkSpec | None,
                       *, dtype_bytes: int, bytes_per_ms: float, fraction: float | None = None) -> Value:
    """A compressed stage's gradient sync: the collectives on the compressed payload plus the compression compute.

    Args:
        param_bytes: the stage's gradient bytes (ZeRO-0: the flat buffer).
        replicas: ``d`` (one device: 0).
        compress: the compression.
        link: the slowest link between the stage's devices.
        dtype_bytes: bytes per gradient element.
        bytes_per_ms: the device's streaming rate (:func:`stream_bytes_per_ms`).
        fraction: PowerSGD's share of elements on the wire (:func:`hpml_compile.compression.powersgd_fraction`
            over the stage's parameters; None: the stage as one square matrix).

    Returns:
        Milliseconds per step.

    >>> import cost_models
    >>> eth = cost_models.get_link("eth10")
    >>> dense = sync_ms(64e6, 2, 0, False, eth, eth)
    >>> hbm = 1.5e9  # bytes per ms: an A100's memory, so compressing costs ~0.3 ms here
    >>> top = compressed_sync_ms(64e6, 2, Compression.parse("topk:0.01"), eth, dtype_bytes=4, bytes_per_ms=hbm)
    >>> round(dense, 1), round(top, 1)
    (51.3, 1.4)
    """
    if replicas <= 1:
        return param_bytes * 0.0
    if compress.kind is CompressKind.TOPK:
        k_pairs = replicas * compress.ratio * param_bytes / dtype_bytes  # ceil(k) left out: arrays, and it is tiny
        comm = (transfer_ms(cost_models.all_gather_ms, k_pairs * dtype_bytes, link, replicas)  # each after a meeting
                + transfer_ms(cost_models.all_gather_ms, k_pairs * 4, link, replicas) + 2 * _met(param_bytes, replicas, link))
    else:
        if fraction is None:
            fraction = powersgd_fraction([int(np.max(param_bytes)) // dtype_bytes], compress.rank)
        one = param_bytes * 0.0 + (param_bytes > 0)  # one byte stands for the small uncompressed rest's latency
        comm = 2 * transfer_ms(cost_models.allreduce_ms, fraction * param_bytes / 2, link, replicas) \
            + transfer_ms(cost_models.allreduce_ms, one, link, replicas)  # P, Q, and the uncompressed rest
    return comm + compress.passes * param_bytes / bytes_per_ms


def local_sgd_sync_ms(param_bytes: float, replicas: int, every: int, link: cost_models.LinkSpec | None) -> float:
    """Local SGD's gradient sync per step: one parameter all-reduce every ``every`` steps (the steady state).

    >>> import cost_models
    >>> eth = cost_models.get_link("eth10")
    >>> round(local_sgd_sync_ms(64e6, 2, 4, eth) * 4, 6) == round(sync_ms(64e6, 2, 0, False, eth, eth), 6)
    True
    """
    if replicas <= 1:
        return 0.0
    return (float(_met(param_bytes, replicas, link)) + float(transfer_ms(cost_models.allreduce_ms, param_bytes, link, replicas))) / every


def copy_ms(param_bytes: Value, replicas: int, bytes_per_ms: float, zero: ZeroStage | int = ZeroStage.NONE,
            hierarchical: bool = False, wire: float = 1.0) -> Value:
    """The memory copies of a replicated stage's gradient sync (:mod:`hpml_compile.runtime.sync.zero`).

    The gradients accumulate into the flat buffer the collective reads, so ZeRO-0's in-place all-reduce
    copies nothing, and ZeRO-1/2's parameter all-gather writes straight into the parameters' flat buffer
    (the backend's own copies are in the link's fitted all-gather, which the probe times that way). ZeRO-1
    copies its summed shard of the gradients into the gradient buffer it keeps (read + write of ``P / d``);
    ZeRO-2 keeps the collective's shard as it is. ZeRO-3 (:mod:`hpml_compile.runtime.sync.zero3`) is counted as
    before: the gathered parameters copied into place, read + write, twice.

    Args:
        param_bytes: parameter bytes of the stage.
        replicas: data-parallel degree (one device copies nothing).
        bytes_per_ms: the device's streaming rate (:func:`stream_bytes_per_ms`).
        zero: the ZeRO stage.
        hierarchical: a hierarchical ZeRO-1, whose pieces are gathered straight into the flat buffer and whose
            summed shard is reduced straight into the shard's gradient: no copy.
        wire: the reduce dtype's bytes per gradient byte (:func:`wire_ratio`); below 1 the casts to it and back
            are counted.

    Returns:
        Milliseconds, of the form of ``param_bytes`` (0.0 for one device, ZeRO-0 or a hierarchical ZeRO-1).
    """
    z = ZeroStage(zero)
    if replicas <= 1:
        return 0.0
    # a reduce dtype (wire < 1): the gradients cast down before the collective (read P, write w P) and its result
    # cast back (the whole buffer under ZeRO-0, the shard under ZeRO-1/2/3: runtime.sync.reducecast)
    cast = 0.0 if wire >= 1.0 else (1 + wire) * param_bytes * (1 + (1 if z == ZeroStage.NONE else 1 / replicas))
    if hierarchical and z == ZeroStage.OS:
        return param_bytes * 0.0 + cast / bytes_per_ms
    if z == ZeroStage.OS:
        return (2 * param_bytes / replicas + cast) / bytes_per_ms
    return ((4 * param_bytes if z == ZeroStage.OS_G_P else param_bytes * 0.0) + cast) / bytes_per_ms


def steps_flat(zero: ZeroStage | int, replicas: int) -> bool:
    """Whether a stage's optimizer steps one flat tensor (a ZeRO-1/2/3 shard, :mod:`hpml_compile.runtime.sync.zero`),
    priced at :meth:`hpml_compile.costgraph.CostGraph.optimizer_ms_per_byte`'s flat rate, rather than its
    parameters one by one."""
    return ZeroStage(zero) >= ZeroStage.OS and replicas > 1


def optimizer_ms(param_bytes: Value, replicas: int, zero: ZeroStage | int, ms_per_byte: float,
                 shards: int | None = None) -> Value:
    """The optimizer step of one device of a stage: its parameter bytes (its shard under ZeRO-1 and up).

    Args:
        param_bytes: parameter bytes of the stage.
        replicas: data-parallel degree.
        zero: ZeRO stage.
        ms_per_byte: step time per parameter byte (:meth:`CostGraph.optimizer_ms_per_byte`).
        shards: the ranks the shards are spread over (None: ``replicas``; a hierarchical ZeRO-1: one host's).

    Returns:
        Milliseconds, of the form of ``param_bytes``.
    """
    return ms_per_byte * (param_bytes // max(1, shards or replicas) if ZeroStage(zero) >= ZeroStage.OS
                          else param_bytes)


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


def even_rows(total: int, replicas: int) -> tuple[float, ...]:
    """The rows of one microbatch each of ``replicas`` equal replicas trains on (``total / replicas`` each; a
    fraction where it does not divide, as the cost model's ``1 / (M d)`` assumes).

    Example:
        >>> even_rows(8, 2)
        (4.0, 4.0)
    """
    return (total / max(1, replicas),) * max(1, replicas)


def choose_rows(fixed_ms: Sequence[float], per_row_ms: Sequence[float], total: int,
                caps: Sequence[int | None] | None = None) -> tuple[int, ...]:
    """Integer rows of one microbatch for each replica of a stage, so that the slowest replica is as fast as it
    can be and each holds no more rows than fit its memory (uneven data parallelism).

    Replica ``i`` takes ``fixed_ms[i] + per_row_ms[i] * r`` for ``r`` rows (the cost model's fixed part per
    microbatch plus a part per row, :meth:`hpml_compile.ir.NodeCost.at`), so with no fixed parts the best
    rows are proportional to each replica's speed, ``1 / per_row_ms[i]``. Rounding those to integers is what
    costs: this gives every replica one row (a replica with none would not be one) and then hands out the
    remaining rows one at a time, each to the replica that would finish it soonest. Each replica's time grows
    with its rows, so the times the rows are handed out at form, per replica, an increasing sequence, and the
    ``total - n`` smallest values of all of them are what the greedy takes; any other split takes a value at
    least as large somewhere, so no integer split has a faster slowest replica (this is exact, not a
    rounding heuristic). Ties go to the replica listed first. ``O(total log n)``.

    Args:
        fixed_ms: per replica, the milliseconds a microbatch costs whatever its rows.
        per_row_ms: per replica, the milliseconds per row (> 0 for a replica that may get more than one).
        total: rows of one microbatch (the profile's batch over the microbatch count).
        caps: per replica, the most rows that fit its memory (None: no limit).

    Returns:
        Rows per replica, in order, summing to ``total``, each at least 1 and at most its cap.

    Raises:
        ValueError: lengths differ, ``total`` is below the replica count, a cap is below 1, or the caps
            together hold fewer than ``total`` rows (the message says which).

    Example:
        >>> choose_rows([0.0, 0.0], [1.0, 3.0], 8)  # 3x faster replica: 6 rows against 2
        (6, 2)
        >>> choose_rows([0.0, 0.0], [1.0, 3.0], 8, caps=[5, None])  # the fast one holds only 5
        (5, 3)
        >>> choose_rows([4.0, 0.0], [1.0, 1.0], 8)  # a fixed cost of 4 rows' time: the other takes 4 more
        (2, 6)
    """
    n = len(fixed_ms)
    limit = list(caps) if caps is not None else [None] * n
    if len(per_row_ms) != n or len(limit) != n:
        raise ValueError(f"choose_rows: {n} fixed costs, {len(per_row_ms)} per-row costs and {len(limit)} caps; "
                         "give one of each per replica")
    if n == 0 or total < n:
        raise ValueError(f"choose_rows: {total} rows cannot give each of {n} replicas at least one; use fewer "
                         "replicas or more rows per microbatch (fewer microbatches)")
    bad = [i for i, c in enumerate(limit) if c is not None and c < 1]
    if bad:
        raise ValueError(f"choose_rows: replica {bad[0]} fits no row in its memory (cap {limit[bad[0]]})")
    room = sum(total if c is None else min(c, total) for c in limit)
    if room < total:
        raise ValueError(f"choose_rows: the replicas' memories hold {room} rows together, fewer than the {total} "
                         "of a microbatch; add a device, use more microbatches, or enable ZeRO or recompute")
    rows = [1] * n
    heap = [(fixed_ms[i] + per_row_ms[i] * 2, i) for i in range(n) if limit[i] is None or limit[i] > 1]
    heapq.heapify(heap)
    for _ in range(total - n):
        _, i = heapq.heappop(heap)
        rows[i] += 1
        if limit[i] is None or rows[i] < limit[i]:
            heapq.heappush(heap, (fixed_ms[i] + per_row_ms[i] * (rows[i] + 1), i))
    return tuple(rows)
