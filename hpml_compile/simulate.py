"""Play a plan's pipeline schedule as events: step time, bubble, timeline and memory per device.

Every solver's plan is scored by this one simulator, so that plans compare on
one cost model. Each stage replays the list the schedule lowers to
(:func:`hpml_compile.schedule.stage_lists`, the computations, sends and
receives a build's ranks run; GPipe, Huang et al. 2019: all forwards then all
backwards; 1F1B, Narayanan et al. 2019/2021: ``S - i - 1`` warm-up forwards,
then one forward one backward, then the remaining backwards; ZB-H1, Qi et al.
2024: each backward as an input-gradient part, which the previous stage waits
for, and a weight-gradient part that only its own stage does, later): a
``SEND`` posts its values when the compute before it ends, a ``RECV`` waits
until they have crossed the link, and a compute starts when its stage is free
and its receive is done. A message that arrives before its CPU rank reaches
the receive (the rank still computing) keeps gloo's threads busy there: where
the host has no core to spare, the rank pays ``min(wait, recv_cpu_ms)`` of the
profile's probe (:mod:`hpml_compile.profile.messages`). Under ZB-H1 a stage's
activations are held until the weight-gradient part ends; its share of the backward's compute, and the split's
own cost per microbatch (the extra walk of the autograd graph), are the
profile's measurement of each block (:mod:`hpml_compile.profile.split`), or
where not measured :data:`hpml_compile.stagecost.WEIGHT_SHARE` and nothing (an
assumption the plan lists); a tensor-parallel stage's backward collectives,
the all-reduces of its inputs' gradients, belong to the input-gradient part. We write this small list scheduler rather than use
``torch.distributed.pipelining``'s ``_simulate_comms_compute`` because that
one has no durations, links or memory.

A stage's costs (microbatches in flight, memory, gradient sync, copies,
optimizer step) come from :mod:`hpml_compile.stagecost`, the formulas the
solvers' candidate table prices candidates with. Approximations, stated once:

- Times in the cost graph are for the profile's full batch. A node's time
  is a fixed part (its ``fixed`` cost: reading the weights, launching
  kernels, what a slice of the batch still pays in full) plus a part
  proportional to the rows; a microbatch on a stage replicated over ``d``
  devices holds ``1 / (M d)`` of the rows, so it takes
  ``fixed + (time - fixed) / (M d)`` (just ``time / (M d)`` without a fixed part).
- A stage on devices of several kinds runs at the pace of its slowest kind.
  A stage with ``rows`` (uneven data parallelism) runs each replica at its
  own kind's pace on its own rows (``fixed + (time - fixed) * rows / batch``
  per microbatch), and each operation ends when the slowest replica's does;
  each device holds the activations of its own rows. A boundary tensor is
  resharded between two stages' row splits; its send takes as long as the
  largest piece one device sends or receives.
- Sends run on their own stream and overlap compute; they delay the
  receiver only. A boundary tensor between stages with ``d_i`` and ``d_j``
  replicas moves in ``min(d_i, d_j)`` parallel pieces over the link between
  the stages' first devices (cost_models alpha-beta).
- Recompute is one extra forward just before each backward. Swapped
  activations go out over the host link after the forward and must be back
  before the backward starts.
- After its last backward a replicated stage synchronises gradients: a ring
  all-reduce (ZeRO-0; a stage whose plan says ``hierarchical``: reduce-scatter
  inside each host, all-reduce between hosts, all-gather inside each host, each
  priced on its own link), reduce-scatter + all-gather (ZeRO-1/2, Rajbhandari et
  al. 2020; a hierarchical ZeRO-1: those three levels after the backward, the
  last on the stepped parameters, its optimizer sharded over one host's devices; ZeRO-3: reduce-scatter, and the parameters' all-gathers before
  each microbatch's forward and backward, counted here with the tail). The
  ZeRO-0/1/2 all-reduce (flat, or hierarchical: each bucket's three
  collectives in a chain, :func:`hpml_compile.stagecost.hierarchical_overlapped_ms`)
  or reduce-scatter runs bucket by bucket during
  the last microbatch's backward, as the runtime launches it, so only what
  that backward does not hide is on the tail
  (:func:`hpml_compile.stagecost.overlapped_ms`), the backward scaled by the
  stage's :func:`hpml_compile.plan.sync_overlap` (0 on CPU ranks: there the
  runtime runs the collective after the backward, and it is priced so). ZeRO-1/2's
  all-gather of the stepped parameters runs where the runtime runs it: prefetched
  under the next forward where the sync is bucketed, else whole after the stage's
  own optimizer step (:func:`hpml_compile.stagecost.stepped_gather_ms`; the step
  ends when the slowest stage's optimizer step and gather do). An
  offloaded optimizer moves gradients to the host and parameters back.
  Parameters shared by several stages (tied embeddings) are then summed by
  one all-reduce over the devices of those stages, which waits for all of
  them.
- Then each stage runs its optimizer step: the graph's measured (or
  predicted) step time per parameter byte times the stage's parameter bytes
  (a ZeRO-sharded state: its shard); none when the graph has no optimizer time.
  Every stage starts it when the last stage has synchronised and the ranks
  have agreed that the step succeeded: the runtime's loss all-reduce (32
  bytes with the batch check, :func:`hpml_compile.stagecost.agree_ms`, priced
  as a tree of latencies over every rank; on CPU ranks of one host, as the
  runtime probe of the host measured it: :func:`loss_agreement_ms`) runs
  before any of them changes its weights, so that a failed step can be
  retried on all of them.
- A replicated stage's replicas reach their gradient sync at different times
  although they do the same work, and the sync starts when the latest one
  arrives: on CPU ranks, the skew the host's runtime probe measured between
  two ranks (:mod:`hpml_compile.profile.process`: a fixed part and a part per
  millisecond of the stage's compute in the step), grown for more replicas as
  the expected maximum of normal draws (:func:`hpml_compile.stagecost.skew_wait_ms`). A ZeRO-3 stage's
  replicas also meet before each microbatch's two parameter all-gathers, and a ZeRO-1/2 stage's before the
  all-gather after the optimizer step where the step runs it whole; they pay the wait and the meeting each
  time (:func:`hpml_compile.stagecost.meetings`), on the compute since the meeting before.
- CPU ranks of one host share its memory bandwidth (GPUs have their own).
  Every phase has a memory-streaming part: a microbatch's forward reads the
  stage's weights and writes its activations, its backward about twice that,
  a replicated stage's gradient sync copies the gradients into a flat buffer
  and back, and the optimizer step is all streaming. At the profile's
  one-thread rate a part takes ``bytes / stream_gbps``; while ``k`` ranks of
  the host are busy at once, a part stretches by
  ``max(1, k * stream_gbps / host_stream_gbps)`` (both rates measured by
  :func:`hpml_compile.profile.timing.time_streams`), averaged over the time
  it overlaps the other ranks' work. The schedule is played three times, each
  time with the stretches of the previous timeline. Without measured rates (a
  GPU, an old profile), nothing stretches and the copies go at the catalog's
  memory bandwidth.
  Where the profile measured the optimizer step while other processes
  stepped theirs (:func:`hpml_compile.profile.optcorun.time_optimizer_corun`:
  an AdamW step is several kernels, not a pure copy, and shares less than
  the stream rates say), the step stretches by that instead, times the cores'
  share below.
- CPU ranks of one host share its cores: each host is taken to have the
  logical CPUs of the host the profile was taken on (``profile.devices[kind]
  ["cpus"]``). While ``k`` of a host's ranks are busy at once on ``c`` cores,
  any of their work, compute included, stretches by ``max(1, k / c)`` (the
  larger of this and the bandwidth stretch), averaged the same way: four
  ranks on two cores take about twice as long as one rank per core (measured,
  gpt-mini data parallel on 4 ranks of a 2-core VM: 1.8x the compute of a
  core per rank, which the simulator had predicted: ``benchmarks/prediction``).
- The bubble is the idle fraction of the stages' compute time between 0 and
  the end of the last backward.

Example:
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> from hpml_compile.plan import Plan, Stage, Schedule
    >>> g = chain_graph([(2.0, 4.0), (2.0, 4.0)], kind="cpu")
    >>> c = uniform_cluster(2)
    >>> st = (Stage(0, ("d0",), g.node("n0").members), Stage(1, ("d1",), g.node("n1").members))
    >>> r = simulate(Plan("toy", c, Schedule.GPIPE, 2, st), g)
    >>> r.step_ms, round(r.bubble, 4)
    (9.0, 0.3333)
"""

from __future__ import annotations

import bisect
import enum
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import cost_models

from .cluster import Cluster, hierarchy, host_link_spec, link_spec
from .compression import CompressKind, parse_compress, powersgd_fraction
from .costgraph import CostGraph
from .errors import PlanError, UnknownDeviceError
from .ir import Device, Schedule
from .memory import (RIDE_IN_BYTES, SHM_DIRECT_BYTES, MemoryBreakdown, compute_bytes, dtype_bytes, tied_elsewhere,
                     tied_shared, tied_shm_bytes)
from .plan import AllReduce, Plan, PlanPrediction, Stage, StagePrediction, sync_overlap, tied_members, zero_shards
from .interleave import peak_in_flight
from .schedule import Action, ActionKind, deferral, op_order, stage_lists  # the lowered per-rank action lists
from .stagecost import (agree_ms, compressed_sync_ms, copy_ms, device_memory, even_rows, hierarchical_allreduce_ms, in_flight,
                        local_sgd_sync_ms, measured_agree_ms, meet_ms, meetings, optimizer_ms, skew_wait_ms, stepped_gather_ms,
                        steps_flat, stream_bytes_per_ms, stream_ms, sync_ms, tp_bytes, tp_comm_ms, tp_time, transfer_ms,
                        weight_part_ms, wire_ratio)

__all__ = ["EventKind", "Interval", "StageCost", "SimResult", "simulate", "step_ms", "stage_costs", "bookkeeping_ms", "annotate", "crowded_devices",
           "node_ms",
           "idle_intervals", "op_order", "tied_syncs", "loss_agreement_ms", "replica_skew_ms", "replica_meeting_ms",
           "agreement_rides", "issued_with_meeting_ms", "ride_in_ms", "boundary_copies"]


class EventKind(str, enum.Enum):
    """What a device does during an interval of the timeline."""

    FORWARD = "fwd"
    BACKWARD = "bwd"
    RECOMPUTE = "recompute"
    SEND = "send"
    SWAP = "swap"
    SYNC = "sync"  # gradient all-reduce / ZeRO collectives / offload copies
    OPTIMIZER = "optim"  # the optimizer step after the gradient sync


@dataclass(frozen=True, slots=True)
class Interval:
    """One bar of the Gantt chart (microbatch is -1 for per-step work such as SYNC)."""

    device: str
    start_ms: float
    end_ms: float
    kind: EventKind
    microbatch: int
    stage: int


@dataclass(frozen=True, slots=True)
class StageCost:
    """Per-microbatch costs of one stage on one of its devices.

    Attributes:
        fwd_ms: forward of one microbatch.
        bwd_ms: backward of one microbatch (recompute excluded).
        recompute_ms: the extra forward under recompute (0 without).
        swap_ms: one way of the swap traffic of one microbatch.
        sends: ``(receiving stage, ms)`` for each later stage this one feeds.
        sync_ms: gradient synchronisation after the last backward (``gather_ms`` excluded).
        memory: the memory breakdown of each device of the stage.
        optimizer_ms: the optimizer step after the sync.
        fwd_stream_ms: the memory-streaming part of ``fwd_ms`` (weights read, activations written).
        bwd_stream_ms: the memory-streaming part of ``bwd_ms``.
        sync_copy_ms: the part of ``sync_ms`` spent copying (:func:`hpml_compile.stagecost.copy_ms`).
        device_memory: the breakdown of each device of the stage, in the stage's device order (uneven rows:
            each from its own rows); ``memory`` is the largest of them.
        replica_ms: ``(fwd_ms, bwd_ms)`` of one microbatch on each device of the stage, at its own kind's
            pace on its own rows; ``fwd_ms`` and ``bwd_ms`` are the slowest replica's.
        gather_ms: ZeRO-1/2's parameter all-gather after this stage's optimizer step, where the runtime runs it
            whole there (not prefetched: :func:`hpml_compile.stagecost.stepped_gather_ms`).
        returns: ``(later stage, ms)`` of the gradients each later stage sends back, where that differs from
            ``sends`` (stages of different ``tp``: :func:`boundary_copies`); empty: the same as ``sends``.
        weight_ms: ZB-H1: the weight-gradient part of ``bwd_ms`` (run as its own operation, after a recompute of
            its own where the stage recomputes; 0 otherwise).
        together_ms: the transfer part of ``sync_ms`` that the runtime issues together with the members' meeting
            (:func:`issued_with_meeting_ms`; 0 where the transfer follows the meeting).
        early_recv_ms: the most CPU a message that arrived before this stage's rank posted its receive takes from
            the rank (:func:`_early_receive_ms`; 0: none charged).
        ride_in_ms: where the runtime sums that transfer and the loss agreement's vector as one float64
            all-reduce without a meeting (:func:`ride_in_ms`), its price on the link; else 0.
    """

    fwd_ms: float
    bwd_ms: float
    recompute_ms: float
    swap_ms: float
    sends: tuple[tuple[int, float], ...]
    sync_ms: float
    memory: MemoryBreakdown
    optimizer_ms: float = 0.0
    fwd_stream_ms: float = 0.0
    bwd_stream_ms: float = 0.0
    sync_copy_ms: float = 0.0
    device_memory: tuple[MemoryBreakdown, ...] = ()
    replica_ms: tuple[tuple[float, float], ...] = ()
    gather_ms: float = 0.0
    returns: tuple[tuple[int, float], ...] = ()
    weight_ms: float = 0.0
    together_ms: float = 0.0
    early_recv_ms: float = 0.0
    ride_in_ms: float = 0.0

    @property
    def back(self) -> tuple[tuple[int, float], ...]:
        """``(later stage, ms)`` of the gradients coming back over each boundary this stage sends on."""
        return self.returns or self.sends

    def op_ms(self, phase: int) -> float:
        """The duration of one operation of the phase (:data:`FWD`, :data:`BWD`, :data:`WGT`)."""
        if phase == FWD:
            return self.fwd_ms
        if phase == WGT:  # a recomputed region runs again for it (autograd unpacks its saved tensors again)
            return self.weight_ms + (self.recompute_ms if self.weight_ms else 0.0)
        return self.recompute_ms + self.bwd_ms - self.weight_ms

    @property
    def compute_ms(self) -> float:
        """Busy time per microbatch: forward, recompute (twice under ZB-H1) and backward."""
        return self.fwd_ms + self.recompute_ms * (2 if self.weight_ms else 1) + self.bwd_ms

    @property
    def synced_ms(self) -> float:
        """The stage's whole gradient sync per step: before the optimizer step and after it (``gather_ms``)."""
        return self.sync_ms + self.gather_ms


@dataclass(frozen=True, slots=True)
class SimResult:
    """What the simulator predicts for one step (one optimizer update over the full batch).

    Attributes:
        step_ms: time of the whole step, gradient sync and optimizer step included.
        bubble: idle fraction of the stages during the pipeline phase.
        bottleneck_stage: the stage with the most compute per step (a host's shared memory and cores included).
        intervals: every bar of the timeline, all devices.
        memory: per device, ``(time_ms, bytes)`` after each change.
        peak: per device, the peak bytes.
        stages: the costs the simulation used, per stage.
        step_without_optimizer_ms: the step up to the end of the last gradient sync (no optimizer step).
        tied_ms: the all-reduces of parameters shared between stages, ``(stages, ms)`` each.
        contention: per stage, how much longer its microbatches took on average because CPU ranks of its
            host streamed memory at the same time, or were more than its cores (1.0: not at all).
        stage_bubbles: per stage, the idle share of its own pipeline phase (from 0 to its last backward),
            which is what a rank measures (``bubble`` is over the whole pipeline phase of every stage).
        agree_ms: the loss agreement between the last sync and the optimizer steps (in
            ``step_without_optimizer_ms``; :func:`loss_agreement_ms`; 0 where it rides the sync,
            :func:`agreement_rides`).
        skew_ms: per stage, what it waited for its latest replica before its gradient sync (in its sync bar;
            :func:`replica_skew_ms`).
    """

    step_ms: float
    bubble: float
    bottleneck_stage: int
    intervals: tuple[Interval, ...]
    memory: dict[str, tuple[tuple[float, int], ...]]
    peak: dict[str, int]
    stages: tuple[StageCost, ...]
    step_without_optimizer_ms: float = 0.0
    tied_ms: tuple[tuple[tuple[int, ...], float], ...] = ()
    contention: tuple[float, ...] = ()
    stage_bubbles: tuple[float, ...] = ()
    agree_ms: float = 0.0
    skew_ms: tuple[float, ...] = ()


def _stage_of_graph_nodes(plan: Plan, graph: CostGraph) -> dict[str, int]:
    fx_stage = {n: st.index for st in plan.stages for n in st.nodes}
    out: dict[str, int] = {}
    for g in graph.order:
        owners = {fx_stage.get(m, -1) for m in graph.node(g).members}
        if len(owners) != 1 or -1 in owners:
            raise PlanError(f"graph node {g!r} has members in stages {sorted(owners)}; simulate with a graph "
                            "whose nodes each lie in one stage (e.g. costgraph.build(profile))")
        out[g] = owners.pop()
    return out


def _kind_cost(graph: CostGraph, node: str, kinds: list[str], fraction: float = 1.0) -> tuple[float, float]:
    """``(fwd_ms, bwd_ms)`` of ``node`` for ``fraction`` of the batch rows on the slowest of ``kinds``."""
    costs = graph.node(node).cost
    for k in kinds:
        if k not in costs:
            raise UnknownDeviceError(f"the cost graph of {graph.model} has no costs for device kind {k!r} "
                                     f"(it has {list(graph.kinds)}); add predicted costs with "
                                     "hpml_compile.profile.predict_kinds before planning")
    at = [graph.cost_at(node, k, fraction) for k in kinds]
    return max(a[0] for a in at), max(a[1] for a in at)


def _replica_cost(graph: CostGraph, nodes: list[str], kind: str, fraction: float) -> tuple[float, float]:
    """``(fwd_ms, bwd_ms)`` of ``nodes`` on one device of ``kind`` for ``fraction`` of the batch rows."""
    at = [_kind_cost(graph, n, [kind], fraction) for n in nodes]
    return sum(f for f, _ in at), sum(b for _, b in at)


def _tp_cost(graph: CostGraph, node: str, kinds: list[str], fraction: float, tp: int) -> tuple[float, float]:
    """``(fwd_ms, bwd_ms)`` of ``node`` on one rank of a tensor-parallel group of ``tp`` (1: :func:`_kind_cost`),
    for ``fraction`` of the batch rows, on the slowest of ``kinds`` (:func:`hpml_compile.stagecost.tp_time`)."""
    rec = graph.node(node)
    part = rec.shard.get(tp) if tp > 1 else None
    if part is None:
        return _kind_cost(graph, node, kinds, fraction)
    _kind_cost(graph, node, kinds, fraction)  # names a kind the graph lacks
    out = []
    for k in kinds:
        (f, b), (ff, bf) = rec.cost[k], rec.fixed_at(k)
        (sf, sb), (sff, sbf) = part.cost.get(k, (0.0, 0.0)), part.fixed.get(k, (0.0, 0.0))
        out.append((tp_time(f, ff, sf, sff, fraction, tp), tp_time(b, bf, sb, sbf, fraction, tp)))
    return max(a for a, _ in out), max(b for _, b in out)


def node_ms(graph: CostGraph, node: str, kinds: list[str], fraction: float, tp: int = 1) -> tuple[float, float]:
    """``(fwd_ms, bwd_ms)`` of graph node ``node`` as a stage prices it: on one rank of a tensor-parallel group of
    ``tp`` (the collectives apart), for ``fraction`` of the batch rows, on the slowest of ``kinds``.

    Raises:
        UnknownDeviceError: a kind the graph has no costs for.
    """
    return _tp_cost(graph, node, kinds, fraction, tp)


def _tp_link(cluster: Cluster, st: Stage) -> cost_models.LinkSpec | None:
    """The slowest link inside the stage's first tensor-parallel group (None: ``tp`` is 1)."""
    if st.tp <= 1:
        return None
    group = st.tp_groups()[0]
    return min((link_spec(cluster, group[0], x) for x in group[1:]), key=lambda sp: sp.gbps)


def _tp_comm(graph: CostGraph, nodes: list[str], tp: int, share: int, link: cost_models.LinkSpec | None,
             compute: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """``(forward, backward)`` ms of one microbatch's tensor-parallel collectives over ``nodes`` (``share``:
    ``M d``, the parts of the batch a microbatch on one replica holds; ``compute``: a rank's forward and backward
    compute of it), :func:`hpml_compile.stagecost.tp_comm_ms`."""
    parts = [graph.node(n).shard[tp] for n in nodes if tp > 1 and tp in graph.node(n).shard]
    if not parts:
        return 0.0, 0.0
    fwd = tp_comm_ms(sum(p.fwd_allreduce for p in parts) / share, sum(p.fwd_gather for p in parts) / share,
                     sum(p.fwd_count for p in parts), tp, link, compute[0])
    bwd = tp_comm_ms(sum(p.bwd_allreduce for p in parts) / share, 0, sum(p.bwd_count for p in parts), tp, link,
                     compute[1])
    return float(fwd), float(bwd)


def boundary_copies(tp_src: int, tp_dst: int) -> tuple[int, int]:
    """How many copies of a boundary tensor one rank sends one after another, ``(forward, backward)``, between
    a stage of ``tp_src`` and the next of ``tp_dst`` (:class:`hpml_compile.codegen.tensor_parallel.Places`):
    each receiving place reads from one sending place, so the narrower side sends to every place of the wider
    group that reads from it.

    >>> boundary_copies(2, 2), boundary_copies(2, 1), boundary_copies(1, 4)
    ((1, 1), (1, 2), (4, 1))
    """
    return -(-tp_dst // tp_src), -(-tp_src // tp_dst)


def _rows(st: Stage, microbatches: int, batch: int) -> tuple[float, ...]:
    """Rows of one microbatch each replica of ``st`` trains on (the equal split where the plan gives none)."""
    return tuple(float(r) for r in st.rows) if st.rows else even_rows(batch / microbatches, st.replicas)


def stage_costs(plan: Plan, graph: CostGraph, dtype: str = "float32") -> tuple[StageCost, ...]:
    """Per-microbatch times and per-device memory of every stage of ``plan``.

    Args:
        plan: the plan.
        graph: a cost graph whose nodes each lie in one stage (fine or coarse).
        dtype: parameter dtype (for the Adam state size).

    Returns:
        One StageCost per stage.

    Raises:
        UnknownDeviceError: if a stage's device kind has no costs in ``graph``.
    """
    owner = _stage_of_graph_nodes(plan, graph)
    g, c, m, s_count = graph.graph, plan.cluster, plan.microbatches, len(plan.stages)
    batch = graph.batch_size
    out: list[StageCost] = []
    for st in plan.stages:
        nodes = [n for n in graph.order if owner[n] == st.index]
        kinds = sorted({c.device(d).kind for d in st.devices})
        d, tp = st.replicas, st.tp
        if st.rows:  # uneven: each replica at its own kind's pace on its own rows; the stage waits for the slowest
            own = [_replica_cost(graph, nodes, c.device(x).kind, r / batch) for x, r in zip(st.devices, st.rows)]
            tp_bwd = 0.0
        else:
            per_mb = [_tp_cost(graph, n, kinds, 1.0 / (m * d), tp) for n in nodes]
            compute = (sum(f for f, _ in per_mb), sum(b for _, b in per_mb))
            tp_fwd, tp_bwd = _tp_comm(graph, nodes, tp, m * d, _tp_link(c, st), compute)
            own = [(compute[0] + tp_fwd, compute[1] + tp_bwd)] * len(st.devices)
        fwd, bwd = max(f for f, _ in own), max(b for _, b in own)
        recs = [graph.node(n) for n in nodes]
        shards = [r.shard[tp] for r in recs if tp in r.shard]
        params = tp_bytes(sum(r.param_bytes for r in recs), sum(p.param_bytes for p in shards), tp) + tied_elsewhere(
            ((n, graph.node(n).params) for n in graph.order), graph.param_sizes, set(nodes))
        acts = tp_bytes(sum(r.activation_bytes for r in recs), sum(p.activation_bytes for p in shards), tp)
        swap_set = set(st.swap)
        swapped = sum(r.activation_bytes for r in recs if set(r.members) <= swap_set and swap_set)
        inputs: dict[str, int] = {}
        sends: dict[int, dict[str, int]] = {}
        for u, v, e in g.edges(data=True):
            if owner[v] == st.index and owner[u] != st.index:
                inputs.update(e["producers"])
            if owner[u] == st.index and owner[v] != st.index:
                sends.setdefault(owner[v], {}).update(e["producers"])
        shared = tied_shared(((n, graph.node(n).params) for n in graph.order), graph.param_sizes, set(nodes))
        mems = []
        for j, x in enumerate(st.devices):
            mem = device_memory(param_bytes=params, activation_bytes=acts, input_bytes=sum(inputs.values()),
                                dtype_bytes=dtype_bytes(dtype), replicas=d, zero=st.zero,
                                shards=zero_shards(c, st), microbatches=m,
                                in_flight=in_flight(plan.schedule, m, s_count - st.index - 1, s_count,
                                                    st.max_deferred),
                                recompute=st.recompute, swapped_bytes=swapped,
                                offload_optimizer=st.offload_optimizer, host_is_device=c.device(x).is_cpu,
                                share=(st.rows[j], batch) if st.rows else None,
                                compute_bytes=compute_bytes(plan.precision.value),
                                process_bytes=graph.process_bytes(c.device(x).kind, params, d, st.zero)
                                if c.device(x).is_cpu else 0)
            # the tied gradients' buffer, and on CPU ranks of one host the shared memory their sum goes through
            users = ((graph.node(n).members[0], graph.node(n).params) for n in graph.order)  # fx names, as the plan's
            shm = tied_shm_bytes(shared, tied_members(plan, users, st.index)) if shared and mem.process else 0
            mems.append(replace(mem, grads=mem.grads + shared, process=mem.process + shm) if shared else mem)
            if not st.rows and all(c.device(y).is_cpu == c.device(x).is_cpu for y in st.devices):
                mems = [mems[0]] * len(st.devices)  # equal replicas hold equal bytes
                break
        send_ms, back_ms = [], []
        for j, prods in sorted(sends.items()):
            dst = plan.stages[j]
            # the largest piece one device sends or receives: its share of a microbatch's rows, in either split
            nbytes = sum(prods.values()) * max(max(_rows(st, m, batch)), max(_rows(dst, m, batch))) / batch \
                if st.rows or dst.rows else sum(prods.values()) / (m * min(d, dst.replicas))
            link = link_spec(c, st.devices[0], dst.devices[0])
            one = transfer_ms(cost_models.p2p_ms, nbytes, link)
            fwd_copies, bwd_copies = boundary_copies(st.tp, dst.tp)
            send_ms.append((j, one * fwd_copies))
            back_ms.append((j, one * bwd_copies))
        host = host_link_spec(c.device(st.devices[0]))
        most = max(_rows(st, m, batch)) / batch  # the largest replica's share of the batch per microbatch
        swap_ms = transfer_ms(cost_models.p2p_ms, swapped * most if st.rows else swapped / (m * d), host) \
            if swapped else 0.0
        flat = steps_flat(st.zero, d)
        opt_ms = optimizer_ms(params, d, st.zero, max(graph.optimizer_ms_per_byte(k, flat) for k in kinds),
                              zero_shards(c, st))
        rate = stream_bytes_per_ms(graph, kinds)
        copy = copy_ms(params, d, rate, st.zero, st.allreduce is AllReduce.HIERARCHICAL,
                       _wire(plan, st, dtype))
        dp = st.dp_groups()[0]  # the devices that sum each other's gradients (all of them when tp is 1)
        group = min((link_spec(c, dp[0], x) for x in dp[1:]), key=lambda sp: sp.gbps) if d > 1 else None
        hier = hierarchy(c, st.sync_group()) if st.allreduce is AllReduce.HIERARCHICAL else None
        fwd_stream, bwd_stream = stream_ms(fwd, bwd, params, acts * most * m * d if st.rows else acts, m, d, rate)
        # ZB-H1: the last microbatch's weight part is the last backward work the sync could overlap
        # (its share of the compute: the tensor-parallel collectives belong to the input-gradient part)
        weight = 0.0
        if plan.schedule is Schedule.ZB_H1:  # as the profile measured the split where it did (plus its own cost)
            split = graph.split_at(nodes, kinds, most if st.rows else 1.0 / (m * d))
            weight = weight_part_ms(bwd, comm_ms=tp_bwd) if split is None else \
                weight_part_ms(bwd, split[0], comm_ms=tp_bwd) + split[2]
            bwd += split[1] if split is not None else 0.0
        sync, gather = _sync_cost(plan, graph, st, nodes, params, group, host, dtype, rate, weight or bwd, hier, m,
                                  fwd_ms=fwd)
        out.append(StageCost(fwd, bwd, fwd if st.recompute else 0.0, swap_ms, tuple(send_ms), sync - gather + copy,
                             max(mems, key=lambda b: b.total), opt_ms, fwd_stream, bwd_stream, copy,
                             tuple(mems), tuple(own), gather, tuple(back_ms) if back_ms != send_ms else (), weight,
                             issued_with_meeting_ms(plan, st, params * _wire(plan, st, dtype), group),
                             _early_receive_ms(plan, graph, st), ride_in_ms(plan, st, params, dtype, group)))
    return _chunk_memory(plan, out) if plan.chunks > 1 else tuple(out)


def _early_receive_ms(plan: Plan, graph: CostGraph, st: Stage) -> float:
    """The most CPU a message that waited for its receive takes from a rank of ``st`` (a message waiting ``w`` ms
    takes ``min(w, this)``; :func:`hpml_compile.profile.messages.probe_early_receive`): where the stage's host has
    no core to spare (the plan's CPU ranks there at least its cores), else 0 (another core runs gloo's threads)."""
    dev = plan.cluster.device(st.devices[0])
    cores = graph.host_cores(dev.kind) if dev.is_cpu else None
    if not cores:
        return 0.0
    ranks = {d for s in plan.stages for d in s.devices
             if plan.cluster.device(d).is_cpu and plan.cluster.device(d).host == dev.host}
    return graph.early_receive_ms(dev.kind) if len(ranks) >= cores else 0.0


def _chunk_memory(plan: Plan, costs: list[StageCost]) -> tuple[StageCost, ...]:
    """Interleaved 1F1B: each stage's microbatches in flight, as its device group holds them at the group's peak
    of activation bytes over all its chunks (:func:`hpml_compile.interleave.peak_in_flight`)."""
    groups, out = len(costs) // plan.chunks, list(costs)
    for g in range(groups):
        mine = list(range(g, len(costs), groups))
        held = peak_in_flight(g, groups, plan.chunks, plan.microbatches,
                              [costs[k].memory.stored_per_microbatch for k in mine])
        for k, n in zip(mine, held):
            c = costs[k]
            out[k] = replace(c, memory=replace(c.memory, in_flight=n),
                             device_memory=tuple(replace(b, in_flight=n) for b in c.device_memory))
    return tuple(out)


def _sync_cost(plan: Plan, graph: CostGraph, st: Stage, nodes: list[str], params: int,
               group: cost_models.LinkSpec | None, host: cost_models.LinkSpec, dtype: str, rate: float,
               bwd_ms: float, hier: Any = None, microbatches: int = 1, *, fwd_ms: float | None = None
               ) -> tuple[float, float]:
    """A stage's gradient sync per step: dense (:func:`sync_ms`, overlapped with the last backward ``bwd_ms``; a
    ZeRO-1/2 stage's parameter all-gather, where bucketed, prefetched under the next step's first forward
    ``fwd_ms``), compressed, or local SGD's amortised average (neither overlapped: the runtime runs them after
    the backward). Returns ``(sync, gather)``: the whole, and the part of it that runs after the optimizer step
    (:func:`hpml_compile.stagecost.stepped_gather_ms`: ZeRO-1/2's gather where it is not prefetched)."""
    d = st.replicas
    comp = parse_compress(st.compress)
    if comp is not None and d > 1:
        frac = None
        if comp.kind is CompressKind.POWERSGD:
            names = {name for n in nodes for name in graph.node(n).params}
            b = dtype_bytes(dtype)
            frac = powersgd_fraction([graph.param_sizes[x] // b for x in names if x in graph.param_sizes], comp.rank) \
                if names & set(graph.param_sizes) else None
        return float(compressed_sync_ms(params, d, comp, group, dtype_bytes=dtype_bytes(dtype), bytes_per_ms=rate,
                                        fraction=frac)), 0.0
    if plan.sync_every > 1 and d > 1:
        return local_sgd_sync_ms(params, d, plan.sync_every, group), 0.0
    overlap = sync_overlap(plan, st.index)
    whole = float(sync_ms(params, d, st.zero, st.offload_optimizer, group, host, hier, bwd_ms=bwd_ms,
                          microbatches=microbatches, overlap=overlap, fwd_ms=fwd_ms, wire=_wire(plan, st, dtype)))
    bucketed = bwd_ms is not None and overlap > 0
    return whole, 0.0 if bucketed else float(stepped_gather_ms(params, d, st.zero, group, hier))


def _wire(plan: Plan, st: Stage, dtype: str) -> float:
    """Bytes per gradient byte in the stage's dense gradient collectives: the plan's reduce dtype over the
    gradients' (1 where it is theirs, or where the stage compresses: the plan refuses both together)."""
    if st.compress:
        return 1.0
    return wire_ratio(plan.reduce_dtype.bytes, dtype_bytes(dtype))


def tied_syncs(plan: Plan, graph: CostGraph) -> list[tuple[tuple[int, ...], float]]:
    """The all-reduces of parameters used by several stages, ``(stages, ms)``, one per group of stages
    (as codegen buckets them); the sizes come from the graph's ``param_sizes`` (none known: none). Under
    ``plan.tied_allreduce == hierarchical`` a group spread evenly over hosts is priced per level."""
    owner = _stage_of_graph_nodes(plan, graph)
    users: dict[str, set[int]] = {}
    for n in graph.order:
        for name in graph.node(n).params:
            users.setdefault(name, set()).add(owner[n])
    buckets: dict[tuple[int, ...], int] = {}
    for name, stages in users.items():
        if len(stages) > 1 and name in graph.param_sizes:
            key = tuple(sorted(stages))
            buckets[key] = buckets.get(key, 0) + graph.param_sizes[name]
    out = []
    for stages, nbytes in sorted(buckets.items()):
        devices = list(dict.fromkeys(d for i in stages for d in plan.stages[i].devices))  # chunks share devices
        if len(devices) < 2:  # the stages are chunks of one device: their gradients are summed in place
            out.append((stages, 0.0))
            continue
        hier = hierarchy(plan.cluster, devices) if plan.tied_allreduce is AllReduce.HIERARCHICAL else None
        if hier is not None:
            out.append((stages, float(hierarchical_allreduce_ms(nbytes, hier))))
            continue
        link = min((link_spec(plan.cluster, devices[0], x) for x in devices[1:]), key=lambda sp: sp.gbps)
        out.append((stages, cost_models.allreduce_ms(nbytes, len(devices), link)
                    if link.gbps != float("inf") else 0.0))
    return out


Op = tuple[int, int, int]  # (phase, stage, microbatch)
# The phase of an operation: a forward is 1 and a backward 0, as True and False would be (``(True, i, k)`` still
# finds a forward); ZB-H1's input-gradient part has the backward's phase, its weight-gradient part its own.
FWD, BWD, WGT = 1, 0, 2
_PHASE = {ActionKind.FORWARD: FWD, ActionKind.BACKWARD: BWD, ActionKind.BACKWARD_INPUT: BWD,
          ActionKind.BACKWARD_WEIGHT: WGT}


class _Replay:
    """The lowered lists of every stage (:func:`hpml_compile.schedule.stage_lists`) played as a list scheduler.

    ``kFj`` / ``kBj`` / ``kIj`` / ``kWj`` take the stage for their duration, from when it is free and their values
    are there (``kWj``: after its own ``kIj``, nothing from another stage); ``kSENDp:j`` posts the values when the
    compute before it ends (a bar per transfer, on its own stream: the stage goes on); ``kRECVp:j`` waits, without
    taking the stage, until every transfer to it has arrived (the costs of :attr:`StageCost.sends` forward and
    :attr:`StageCost.back` backward: a value skipping stages goes straight to its consumer, as priced, where the
    runtime relays it through the stages between).
    """

    def __init__(self, plan: Plan, costs: tuple[StageCost, ...], stretch: dict[Op, float] | None) -> None:
        self.plan, self.costs, self.stretch = plan, costs, stretch or {}
        # per stage, what reaches it: forward (sender, ms); backward (later stage, ms) of the gradients coming back
        self.into: dict[int, list[list[tuple[int, float]]]] = {FWD: [[] for _ in plan.stages],
                                                                BWD: [list(c.back) for c in costs]}
        # per stage, what it sends: forward (later stage, ms); backward (earlier stage, ms)
        self.out: dict[int, list[list[tuple[int, float]]]] = {FWD: [list(c.sends) for c in costs],
                                                              BWD: [[] for _ in plan.stages]}
        for i, cst in enumerate(costs):
            for j, ms in cst.sends:
                self.into[FWD][j].append((i, ms))
            for j, ms in cst.back:
                self.out[BWD][j].append((i, ms))
        self.done: dict[Op, tuple[float, float]] = {}
        self.posted: dict[Op, float] = {}  # (phase, sender, microbatch) -> when its SEND posted the values
        self.arrived: dict[Op, float] = {}  # (phase, receiver, microbatch) -> when its RECV had them all
        self.groups = len(plan.stages) // plan.chunks  # interleaved 1F1B: stage i computes on group i % S
        self.free = [0.0] * self.groups
        self.bars: list[Interval] = []

    def _arrival(self, phase: int, i: int, k: int) -> float | None:
        """When every transfer to stage ``i`` of microbatch ``k`` (activations or their gradients) has arrived."""
        t = 0.0
        for j, ms in self.into[phase][i]:
            if (phase, j, k) not in self.posted:
                return None
            t = max(t, self.posted[(phase, j, k)] + ms)
        return t

    def play(self, i: int, a: Action) -> bool:
        """Run token ``a`` of stage ``i`` if it can run now; whether it did."""
        k = a.microbatch or 0
        cst = self.costs[i]
        if a.kind is ActionKind.RECV:
            phase = FWD if a.stages[1] < i else BWD
            t = self._arrival(phase, i, k)
            if t is None:
                return False
            self.arrived[(phase, i, k)] = t
            g = i % self.groups
            if t < self.free[g]:  # it waited for the rank to post its receive: gloo's threads took CPU meanwhile
                self.free[g] += min(self.free[g] - t, cst.early_recv_ms)
        elif a.kind is ActionKind.SEND:
            phase = FWD if a.stages[1] > i else BWD
            t = self.done[(phase, i, k)][1]
            self.posted[(phase, i, k)] = t
            for _, ms in self.out[phase][i]:
                self.bars.append(Interval(self.plan.stages[i].devices[0], t, t + ms, EventKind.SEND, k, i))
        else:
            phase = _PHASE[a.kind]
            if phase == WGT:
                ready = self.done[(BWD, i, k)][1]
            else:
                ready = self.arrived.get((phase, i, k), 0.0)
            if phase == BWD:
                ready = max(ready, self.done[(FWD, i, k)][1] + 2 * cst.swap_ms)
            dur = cst.op_ms(phase) * self.stretch.get((phase, i, k), 1.0)
            start = max(self.free[i % self.groups], ready)
            self.done[(phase, i, k)] = (start, start + dur)
            self.free[i % self.groups] = start + dur
        return True


def _run(plan: Plan, costs: tuple[StageCost, ...], stretch: dict[Op, float] | None = None
         ) -> tuple[dict[Op, tuple[float, float]], list[Interval]]:
    """Replay every stage's lowered list (:class:`_Replay`; interleaved 1F1B: every device group's, which holds its
    stages' actions in one order); returns ``(fwd?, stage, mb) -> (start, end)`` and the send bars. ``stretch``
    multiplies an operation's duration (a host's shared memory bandwidth and cores).

    Raises:
        PlanError: the lists deadlock (every stage waits at a receive).
    """
    lists = stage_lists(plan.schedule, len(plan.stages), plan.microbatches, deferral(plan),  # the lowered lists
                        plan.chunks)
    run = _Replay(plan, costs, stretch)
    ptr = [0] * len(lists)
    remaining = sum(len(x) for x in lists)
    while remaining:
        progressed = False
        for i, acts in enumerate(lists):
            while ptr[i] < len(acts) and run.play(acts[ptr[i]].stage, acts[ptr[i]]):
                ptr[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PlanError(f"schedule {plan.schedule.value} deadlocks: stages wait at "
                            f"{[str(acts[ptr[i]]) if ptr[i] < len(acts) else None for i, acts in enumerate(lists)]}"
                            "; re-plan with schedule gpipe, whose order cannot deadlock")
    return run.done, run.bars


def crowded_devices(cluster: Cluster, graph: CostGraph) -> list[str]:
    """The CPU devices of each host beyond its cores, where the profile recorded them: the slowest kinds (by the
    whole graph's forward and backward), and among equals the last ones listed.

    Every host is taken to have the profiled host's logical CPUs (``devices.cpu.cpus``), as the simulator takes
    it (:mod:`hpml_compile.simulate`): profile on the hosts the plan is for, or pass ``--every-device``.
    """
    def pace(kind: str) -> float:  # ms of one whole forward and backward on ``kind``; not costed: last
        if kind not in graph.kinds:
            return math.inf
        return sum(sum(graph.cost_at(n, kind, 1.0)) for n in graph.order)

    by_host: dict[str, list[Device]] = {}
    for d in cluster.devices:
        if d.is_cpu:
            by_host.setdefault(d.host, []).append(d)
    out: list[str] = []
    for devs in by_host.values():
        cores = graph.host_cores(devs[0].kind)
        if cores and len(devs) > cores:
            ranked = sorted(range(len(devs)), key=lambda i: (pace(devs[i].kind), i))
            out += [devs[i].name for i in sorted(ranked[cores:])]
    return out


class _HostShare:
    """Which stages' CPU ranks share a host, and how much their work stretches there: a streaming part by the
    host's memory bandwidth, and any work by its cores while more of its ranks are busy than it has. Where the
    profile measured how much slower the model's blocks run while other processes run them on the host's other
    cores (:func:`hpml_compile.profile.corun.time_corun`: the shared cache and bandwidth, as they are), a
    rank's forward and backward stretch by that instead of by the bandwidth: by ``1 + (x - 1) (c - 1) / (n - 1)``
    while ``c`` of the host's ranks are busy, ``x`` measured with ``n`` processes (``c`` at most ``n``)."""

    def __init__(self, plan: Plan, graph: CostGraph) -> None:
        # per stage: {host: ranks of the stage there}, only CPU devices whose kind has measured rates or cores
        self.ranks: list[dict[str, int]] = []
        self.rates: dict[str, tuple[float, float]] = {}
        self.cores: dict[str, int] = {}
        self.coruns: dict[str, tuple[float, float, int]] = {}
        self.opt_coruns: dict[str, tuple[float, int]] = {}
        for st in plan.stages:
            here: dict[str, int] = {}
            for name in st.devices:
                dev = plan.cluster.device(name)
                if not dev.is_cpu:
                    continue
                rates, cores, corun = graph.stream_gbps(dev.kind), graph.host_cores(dev.kind), graph.corun(dev.kind)
                if rates and rates[1] > 0:
                    self.rates[dev.host] = rates
                if corun:
                    self.coruns[dev.host] = corun
                if opt := graph.optimizer_corun(dev.kind):
                    self.opt_coruns[dev.host] = opt
                if cores:
                    self.cores[dev.host] = cores
                if dev.host in self.rates or dev.host in self.cores or dev.host in self.opt_coruns:
                    here[dev.host] = here.get(dev.host, 0) + 1
            self.ranks.append(here)
        self.hosts = sorted(set(self.rates) | set(self.cores) | set(self.coruns) | set(self.opt_coruns))
        first = self.ranks[:len(plan.stages) // plan.chunks]  # interleaved 1F1B: a group's ranks hold several
        total = {h: sum(r.get(h, 0) for r in first) for h in self.hosts}
        self.active = any(((h in self.rates or h in self.coruns or h in self.opt_coruns) and total[h] > 1)
                          or total[h] > self.cores.get(h, total[h]) for h in self.hosts)

    def load(self, busy: list[list[tuple[float, float]]]) -> dict[str, tuple[list[float], list[int]]]:
        """Per host, the busy ranks over time as a step function: ``(times, count from each time on)``."""
        out = {}
        for host in self.hosts:
            delta: dict[float, int] = {}
            for i, spans in enumerate(busy):
                n = self.ranks[i].get(host, 0)
                for a, b in spans if n else ():
                    delta[a] = delta.get(a, 0) + n
                    delta[b] = delta.get(b, 0) - n
            times, counts, c = [], [], 0
            for t in sorted(delta):
                c += delta[t]
                times.append(t)
                counts.append(c)
            out[host] = (times, counts)
        return out

    @staticmethod
    def _mean(start: float, end: float, steps: tuple[list[float], list[int]], slow: Callable[[int], float]) -> float:
        """The mean of ``slow(busy ranks)`` over ``[start, end]`` (1 where the step function says nothing)."""
        times, counts = steps
        k = max(0, bisect.bisect_right(times, start) - 1)
        total, t = 0.0, start
        while t < end and k < len(times):
            nxt = min(end, times[k + 1]) if k + 1 < len(times) else end
            total += (nxt - t) * slow(counts[k])
            t, k = nxt, k + 1
        return (total + max(0.0, end - t)) / (end - start)

    def factor(self, i: int, start: float, end: float, load: dict[str, tuple[list[float], list[int]]],
               streaming: float = 1.0, compute: int | None = None) -> float:
        """Mean slow-down over ``[start, end]`` (a span ``load`` counts stage ``i`` busy in) of work of stage ``i``
        whose ``streaming`` share is memory streaming, the worst of its hosts: the streaming share stretches by
        the host's bandwidth shared among its busy ranks, and all of it by its cores shared among them (the
        larger of the two). ``compute`` (0 forward, 1 backward) marks a rank's compute: where the host's co-run
        slow-down was measured, that replaces the bandwidth's stretch."""
        if end <= start or not self.ranks[i]:
            return 1.0
        worst = 1.0
        for host in self.ranks[i]:
            if compute is not None and host in self.coruns:
                x, n = self.coruns[host][compute], self.coruns[host][2]
                worst = max(worst, self._mean(start, end, load[host],
                                              lambda c: 1.0 + (x - 1.0) * (min(max(c, 1), n) - 1) / (n - 1)))
            elif host in self.rates:
                one, whole = self.rates[host]
                bw = self._mean(start, end, load[host], lambda c: max(1.0, c * one / whole))
                worst = max(worst, 1.0 + streaming * (bw - 1.0))
            if host in self.cores:
                cores = self.cores[host]
                worst = max(worst, self._mean(start, end, load[host], lambda c: max(1.0, c / cores)))
        return worst

    def optimizer_factor(self, i: int, start: float, end: float,
                         load: dict[str, tuple[list[float], list[int]]]) -> float:
        """Mean slow-down of stage ``i``'s optimizer step over ``[start, end]``, the worst of its hosts: where the
        profile measured the step beside other ranks' steps (``x`` with ``n`` processes), ``1 + (x - 1) (c - 1) /
        (n - 1)`` while ``c`` ranks step (``c`` at most ``n``), times the cores' share while more ranks step
        than the host has cores (a core's turns, then the memory its running ranks share); elsewhere as any
        streaming work (:meth:`factor`)."""
        if end <= start or not self.ranks[i]:
            return 1.0
        if not all(h in self.opt_coruns for h in self.ranks[i]):
            return self.factor(i, start, end, load)
        worst = 1.0
        for host in self.ranks[i]:
            x, n = self.opt_coruns[host]
            cores = self.cores.get(host)
            worst = max(worst, self._mean(start, end, load[host], lambda c: (
                1.0 + (x - 1.0) * (min(max(c, 1), n) - 1) / (n - 1)) * (max(1.0, c / cores) if cores else 1.0)))
        return worst


def _busy(done: dict[Op, tuple[float, float]], stages: int) -> list[list[tuple[float, float]]]:
    out: list[list[tuple[float, float]]] = [[] for _ in range(stages)]
    for (_, i, _), span in done.items():
        out[i].append(span)
    return out


def _contended(plan: Plan, costs: tuple[StageCost, ...], share: _HostShare, passes: int = 3
               ) -> tuple[dict[Op, tuple[float, float]], list[Interval]]:
    """Play the schedule ``passes`` times, each time stretching every operation by the contention its host saw
    in the previous timeline (:meth:`_HostShare.factor`)."""
    done, bars = _run(plan, costs)
    for _ in range(passes - 1):
        load = share.load(_busy(done, len(plan.stages)))
        stretch: dict[Op, float] = {}
        for (phase, i, k), (a, b) in done.items():
            cst = costs[i]
            dur = cst.op_ms(phase)
            fwd = phase == FWD
            whole = cst.recompute_ms + cst.bwd_ms
            part = cst.fwd_stream_ms if fwd else \
                (cst.bwd_stream_ms + (cst.fwd_stream_ms if cst.recompute_ms else 0)) * (dur / whole if whole else 1)
            stretch[(phase, i, k)] = share.factor(i, a, b, load, part / dur, 0 if fwd else 1) if dur > 0 else 1.0
        done, bars = _run(plan, costs, stretch)
    return done, bars


@dataclass(slots=True)
class _Timeline:
    """The schedule played out up to the step's end: what :func:`simulate` draws and measures from."""

    costs: tuple[StageCost, ...]
    done: dict[Op, tuple[float, float]]
    bars: list[Interval]
    lasts: list[float]
    sync: list[float]
    tied: list[tuple[tuple[int, ...], float]]
    agree: float
    step_no_opt: float
    optim: list[float]
    step: float
    skew: tuple[float, ...] = ()


def _timeline(plan: Plan, graph: CostGraph, dtype: str) -> _Timeline:
    """Play ``plan``: the stages' operations, their syncs, the tied parameters' all-reduce, the loss agreement
    and the optimizer step (:func:`simulate` adds the per-device bars and memory curves)."""
    costs = stage_costs(plan, graph, dtype)
    share = _HostShare(plan, graph)
    done, bars = _contended(plan, costs, share) if share.active else _run(plan, costs)
    s_count, m = len(plan.stages), plan.microbatches
    lasts = [max(done.get((WGT, i, k), done[(BWD, i, k)])[1] for k in range(m)) for i in range(s_count)]
    busy = _busy(done, s_count)
    # after its last backward each stage syncs; the copies stretch with what the other stages of the host do
    # meanwhile (their compute and their own sync); a replicated stage first waits for its latest replica
    # (and meets it, where it has a sync: a stage without parameters runs no collective; where the transfer is
    # issued with the meeting, the two take as long as the longer of them); a ZeRO-3 stage's replicas meet before
    # each parameter gather too, each time after the compute since the last meeting
    skew = [_waits(plan, graph, st, cst) for st, cst in zip(plan.stages, costs)]
    tails = [[(lasts[j] + skew[j], lasts[j] + skew[j] + costs[j].sync_ms)] for j in range(s_count)]
    load = share.load([b + t for b, t in zip(busy, tails)]) if share.active else {}
    sync = [skew[i] + cst.sync_ms + cst.sync_copy_ms * (share.factor(i, *tails[i][0], load) - 1.0)
            if share.active else skew[i] + cst.sync_ms for i, cst in enumerate(costs)]
    synced = [lasts[i] + sync[i] for i in range(s_count)]
    tied = tied_syncs(plan, graph)
    for stages, ms in tied:  # one collective: it starts when every stage in it is ready
        start = max(synced[i] for i in stages)
        for i in stages:
            for dev in plan.stages[i].devices:
                if ms > 0:
                    bars.append(Interval(dev, start, start + ms, EventKind.SYNC, -1, i))
            synced[i] = start + ms
    # the ranks agree that the step succeeded (the loss all-reduce) before any of them changes its weights; where
    # that rides the one stage's gradient collective, its meeting was priced with the sync
    computed = max((_group_sum(plan, [m * cst.compute_ms for cst in costs])), default=0.0)  # a rank's, a step
    agree = 0.0 if agreement_rides(plan) and costs[0].sync_ms > 0 else loss_agreement_ms(
        plan.cluster, list(dict.fromkeys(d for st in plan.stages for d in st.devices)), graph, computed)
    # every rank's Pipeline.step does the runtime's bookkeeping around the executor (measured with the profile)
    keep = bookkeeping_ms(plan, graph, costs)
    step_no_opt = max(synced, default=0.0) + agree + keep
    begin = step_no_opt
    # a rank holding several stages (interleaved 1F1B) steps them one after another, not side by side
    opt_at = [begin + b for b in _before(plan, [cst.optimizer_ms for cst in costs])]
    load = share.load([[(t, t + cst.optimizer_ms)] for t, cst in zip(opt_at, costs)]) if share.active else {}
    optim = [cst.optimizer_ms * (share.optimizer_factor(i, t, t + cst.optimizer_ms, load) if share.active else 1.0)
             for i, (t, cst) in enumerate(zip(opt_at, costs))]
    # ZeRO-1/2's parameter all-gather follows each stage's own optimizer step where it is not prefetched; a rank
    # holding several stages (interleaved 1F1B) steps them one after another
    step = begin + max(_group_sum(plan, [o + cst.gather_ms for o, cst in zip(optim, costs)]), default=0.0)
    return _Timeline(costs, done, bars, lasts, sync, tied, agree, step_no_opt, optim, step, tuple(skew))


def bookkeeping_ms(plan: Plan, graph: CostGraph, costs: Sequence[StageCost]) -> float:
    """The runtime's bookkeeping a step of ``plan`` pays around its executor on the rank that pays most
    (:meth:`hpml_compile.costgraph.CostGraph.bookkeeping_ms`), its part per ms on the compute of the rank that
    computes most in a step (``costs``: the stages' costs the simulation used)."""
    computed = max(_group_sum(plan, [plan.microbatches * cst.compute_ms for cst in costs]), default=0.0)
    return max((graph.bookkeeping_ms(plan.cluster.device(d).kind, computed) for st in plan.stages
                for d in st.devices), default=0.0)


def _group_sum(plan: Plan, per_stage: Sequence[float]) -> list[float]:
    """Per device group, the sum over its stages (interleaved 1F1B: ``v`` of them; else each stage alone)."""
    groups = len(per_stage) // plan.chunks
    return [sum(per_stage[g::groups]) for g in range(groups)]


def _before(plan: Plan, per_stage: Sequence[float]) -> list[float]:
    """Per stage, the sum over the earlier stages of its device group (0 without interleaving)."""
    groups = len(per_stage) // plan.chunks
    return [sum(per_stage[i % groups:i:groups]) for i in range(len(per_stage))]


def step_ms(plan: Plan, graph: CostGraph, dtype: str = "float32") -> float:
    """The simulated step of ``plan`` alone: :func:`simulate`'s ``step_ms`` without drawing every device's bars
    and memory curve (a search that scores thousands of plans on hundreds of devices needs only this).

    Raises:
        UnknownDeviceError, PlanError: as :func:`simulate`.
    """
    return _timeline(plan, graph, dtype).step


def simulate(plan: Plan, graph: CostGraph, dtype: str = "float32") -> SimResult:
    """Play ``plan`` on its cluster and predict one training step.

    Args:
        plan: the plan.
        graph: its cost graph (each graph node within one stage).
        dtype: parameter dtype (Adam state size).

    Returns:
        Step time, bubble, timeline, memory curves and peaks.

    Raises:
        UnknownDeviceError: if a device kind has no costs in ``graph``.
        PlanError: if the schedule deadlocks (a malformed plan) or a graph node spans stages.
    """
    tl = _timeline(plan, graph, dtype)
    costs, done, bars, lasts, sync = tl.costs, tl.done, tl.bars, tl.lasts, tl.sync
    tied, agree, step_no_opt, optim, step = tl.tied, tl.agree, tl.step_no_opt, tl.optim, tl.step
    s_count, m = len(plan.stages), plan.microbatches
    pipe_end = max((end for _, end in done.values()), default=0.0)
    begin = step_no_opt
    deltas: dict[str, list[tuple[float, int]]] = {}
    groups = s_count // plan.chunks
    opt_at = [begin + x for x in _before(plan, [o + cst.gather_ms for o, cst in zip(optim, costs)])]
    for i, st in enumerate(plan.stages):
        cst = costs[i]
        last = lasts[i]
        for j, dev in enumerate(st.devices):
            mem = cst.device_memory[j] if cst.device_memory else cst.memory
            ev = deltas.setdefault(dev, [])
            ev.append((0.0, mem.static - (mem.process if i >= groups else 0)))  # a process counted once
            for bar in _stage_bars(dev, i, cst, done, m, j):
                bars.append(bar)
            for k in range(m):
                f_end = done[(FWD, i, k)][1]
                b_start, b_end = done[(BWD, i, k)]
                if (WGT, i, k) in done:  # ZB-H1: the activations live until the weight-gradient part ends
                    w_start, w_end = done[(WGT, i, k)]
                    ev += [(f_end, mem.stored_per_microbatch), (b_start, mem.working), (b_end, -mem.working),
                           (w_start, mem.working), (w_end, -(mem.stored_per_microbatch + mem.working))]
                    continue
                ev += [(f_end, mem.stored_per_microbatch), (b_start, mem.working),
                       (b_end, -(mem.stored_per_microbatch + mem.working))]
            if sync[i] > 0:
                bars.append(Interval(dev, last, last + sync[i], EventKind.SYNC, -1, i))
            if optim[i] > 0:
                bars.append(Interval(dev, opt_at[i], opt_at[i] + optim[i], EventKind.OPTIMIZER, -1, i))
            if cst.gather_ms > 0:
                bars.append(Interval(dev, opt_at[i] + optim[i], opt_at[i] + optim[i] + cst.gather_ms, EventKind.SYNC,
                                     -1, i))
    curves, peaks = {}, {}
    for dev, ev in deltas.items():
        # Frees before allocations at the same instant: a backward's buffers go before the next one's arrive.
        ev.sort(key=lambda x: (x[0], x[1]))
        cur, curve = 0, []
        for t, delta in ev:
            cur += delta
            curve.append((t, cur))
        curves[dev], peaks[dev] = tuple(curve), max(b for _, b in curve)
    worked = sum(b - a for a, b in done.values())
    bubble = 1.0 - worked / (groups * pipe_end) if pipe_end > 0 else 0.0  # a device group computes one thing at once
    took = [sum(b - a for (_, x, _), (a, b) in done.items() if x == i) for i in range(s_count)]
    contention = tuple(t / (m * cst.compute_ms) if cst.compute_ms > 0 else 1.0 for t, cst in zip(took, costs))
    bottleneck = max(range(s_count), key=lambda i: took[i])
    # a rank's own bubble: its idle share up to its last backward, over every stage it holds
    busy, end = _group_sum(plan, took), [max(lasts[g::groups]) for g in range(groups)]
    own = tuple(max(0.0, 1.0 - busy[i % groups] / end[i % groups]) if end[i % groups] > 0 else 0.0
                for i in range(s_count))
    return SimResult(step, max(0.0, bubble), bottleneck, tuple(sorted(bars, key=lambda b: (b.device, b.start_ms))),
                     curves, peaks, costs, step_no_opt, tuple(tied), contention, own, agree, tl.skew)


def loss_agreement_ms(cluster: Cluster, devices: Sequence[str], graph: CostGraph | None = None,
                      compute_ms: float = 0.0) -> float:
    """The loss agreement of a plan on ``devices``: one rank each, after ``compute_ms`` of a rank's compute.

    Where every device is a CPU of one host whose kind's agreement the profile measured (``graph``:
    :meth:`hpml_compile.costgraph.CostGraph.agreement_ms`), that measurement
    (:func:`hpml_compile.stagecost.measured_agree_ms`); else :func:`hpml_compile.stagecost.agree_ms` on the link
    from the first device that takes longest for a small message (the tree's messages cross it)."""
    if len(devices) <= 1:
        return 0.0
    devs = [cluster.device(d) for d in devices]
    pair = [graph.agreement_ms(d.kind, compute_ms) for d in devs] if graph is not None else [None]
    if all(d.is_cpu for d in devs) and len({d.host for d in devs}) == 1 and None not in pair:
        return measured_agree_ms(max(x for x in pair if x is not None), len(devices))
    links = {link_spec(cluster, devices[0], x) for x in devices[1:]}
    return max(agree_ms(len(devices), sp) for sp in links)


def _waits(plan: Plan, graph: CostGraph, st: Stage, cst: StageCost) -> float:
    """What stage ``st``'s replicas pay a step at their meetings (:func:`hpml_compile.stagecost.meetings`) beyond
    the link's price of them: at each, the wait for the latest replica (:func:`replica_skew_ms`) and the measured
    meeting (:func:`replica_meeting_ms`, where the stage has a sync), after its share of the step's compute
    (ZeRO-1/2's gather after the optimizer step meets too, where the step runs it whole)."""
    n = meetings(st.zero, st.replicas, plan.microbatches, stepped_gather=cst.gather_ms > 0)
    compute = plan.microbatches * cst.compute_ms / n
    if cst.sync_ms <= 0:
        return n * replica_skew_ms(plan, graph, st, compute)
    # the sync's own meeting may be issued with its transfer (:func:`_meeting_ms`); the others meet alone
    return (n * replica_skew_ms(plan, graph, st, compute) + (n - 1) * replica_meeting_ms(plan, graph, st, compute)
            + _meeting_ms(plan, graph, st, cst, compute))


def replica_skew_ms(plan: Plan, graph: CostGraph, st: Stage, compute_ms: float) -> float:
    """What stage ``st``, computing ``compute_ms`` a step on each replica, waits each step for its latest replica
    before its gradient sync (:func:`hpml_compile.stagecost.skew_wait_ms`): where its devices are CPUs of kinds
    whose skew the profile measured (:meth:`hpml_compile.costgraph.CostGraph.skew_ms`); 0.0 for one replica or
    where not measured."""
    devs = [plan.cluster.device(d) for d in st.devices]
    if st.replicas <= 1 or not all(d.is_cpu for d in devs):
        return 0.0
    return skew_wait_ms(max(graph.skew_ms(d.kind, compute_ms) for d in devs), st.replicas)


def agreement_rides(plan: Plan) -> bool:
    """Whether the runtime's loss agreement rides the gradient collective instead of an all-reduce of its own.

    It does (:mod:`hpml_compile.runtime.execute.batchcheck`) where the plan's one stage spans every rank (no
    tensor parallelism), is replicated, and its sync is a collective every step after the backward on a gloo
    group (a CPU among its devices; not bucketed, compressed or local SGD): the agreement's vector is then the
    sync's meeting, which the stage's sync prices (:func:`replica_meeting_ms`), so the ranks meet once a step and
    the agreement costs nothing more. Elsewhere it is :func:`loss_agreement_ms`.

    >>> from hpml_compile.cluster import load_cluster
    >>> c = load_cluster("local-cpu-2")
    >>> dp = Plan("m", c, Schedule.GPIPE, 1, (Stage(0, ("cpu0", "cpu1"), ("x",)),))
    >>> pipe = Plan("m", c, Schedule.GPIPE, 2, (Stage(0, ("cpu0",), ("x",)), Stage(1, ("cpu1",), ("y",))))
    >>> agreement_rides(dp), agreement_rides(pipe)
    (True, False)
    """
    if len(plan.stages) != 1:
        return False
    st = plan.stages[0]
    return (st.replicas > 1 and st.tp == 1 and not st.compress and plan.sync_every <= 1
            and any(plan.cluster.device(d).is_cpu for d in st.devices) and sync_overlap(plan, 0) <= 0)


def issued_with_meeting_ms(plan: Plan, st: Stage, wire_bytes: float, group: cost_models.LinkSpec | None) -> float:
    """The transfer of stage ``st``'s gradient all-reduce where the runtime issues it with the members' meeting.

    :meth:`hpml_compile.runtime.sync.comm.DistComm._collective` starts a gloo all-reduce right behind the
    meeting's (both ``async_op``), so the transfer starts as soon as the members have met: the two take about as
    long as the longer (two busy gloo ranks, a 109 KB all-reduce: 1.9 ms one after the other, 0.8 ms issued
    together, the all-reduce alone 1.1 ms). That is ZeRO-0's flat all-reduce after the backward on a gloo group
    whose bytes do not go through the host's shared memory (CPU ranks of one host sum
    :data:`hpml_compile.memory.SHM_DIRECT_BYTES` and more there, after a barrier). 0.0 elsewhere. Where the loss
    agreement rides it and the two are small, they are one float64 all-reduce instead (:func:`ride_in_ms`).

    Args:
        plan: the plan.
        st: the stage.
        wire_bytes: the bytes its all-reduce moves (the gradients in the reduce dtype).
        group: the slowest link between its replicas.
    """
    devs = [plan.cluster.device(d) for d in st.dp_groups()[0]]
    plain = (st.replicas > 1 and st.zero == 0 and not st.compress and plan.sync_every <= 1 and not st.offload_optimizer
             and st.allreduce is not AllReduce.HIERARCHICAL and sync_overlap(plan, st.index) <= 0)
    shared = all(d.is_cpu for d in devs) and len({d.host for d in devs}) == 1 and wire_bytes >= SHM_DIRECT_BYTES
    if not plain or shared or not any(d.is_cpu for d in devs) or wire_bytes <= 0:
        return 0.0
    return float(transfer_ms(cost_models.allreduce_ms, wire_bytes, group, st.replicas))


def ride_in_ms(plan: Plan, st: Stage, params: float, dtype: str, group: cost_models.LinkSpec | None
               ) -> float:
    """The one float64 all-reduce of the loss agreement's vector and stage ``st``'s gradients, where the runtime
    sums them so (:meth:`hpml_compile.runtime.sync.comm.DistComm._ride_in`): the agreement rides
    (:func:`agreement_rides`), the gradients go through gloo issued with the meeting (:func:`issued_with_meeting_ms`)
    and the two come to at most :data:`hpml_compile.memory.RIDE_IN_BYTES` in float64. 0.0 elsewhere.

    Args:
        plan: the plan.
        st: the stage.
        params: its parameters' bytes.
        dtype: the parameters' dtype.
        group: the slowest link between its replicas.
    """
    fused = (params / dtype_bytes(dtype) + 4) * 8  # the agreement's four float64 sums, then the gradients
    if fused > RIDE_IN_BYTES or not agreement_rides(plan) or \
            issued_with_meeting_ms(plan, st, params * _wire(plan, st, dtype), group) <= 0:
        return 0.0
    return float(transfer_ms(cost_models.allreduce_ms, fused, group, st.replicas))


def _meeting_ms(plan: Plan, graph: CostGraph, st: Stage, cst: StageCost, compute_ms: float) -> float:
    """What stage ``st``'s meeting adds to its sync's price (:func:`replica_meeting_ms`), less what the transfer
    issued with it runs meanwhile (:attr:`StageCost.together_ms`): the pair takes the longer of the two.

    Where the runtime runs the two as one float64 all-reduce (:attr:`StageCost.ride_in_ms`), there is no meeting:
    the sync is that collective, at what a collective after the compute costs beyond the link's latency (the
    measured meeting, :func:`replica_meeting_ms`) plus the link's price of it."""
    extra = replica_meeting_ms(plan, graph, st, compute_ms)
    if cst.together_ms <= 0:
        return extra
    dp = st.dp_groups()[0]
    link = min((link_spec(plan.cluster, dp[0], x) for x in dp[1:]), key=lambda sp: sp.gbps)
    if cst.ride_in_ms > 0:  # sync_ms priced a meeting and the transfer: one float64 collective instead
        return extra - meet_ms(st.replicas, link) + cst.ride_in_ms - cst.together_ms
    meeting = meet_ms(st.replicas, link) + extra
    return extra - max(0.0, min(meeting, cst.together_ms))


def replica_meeting_ms(plan: Plan, graph: CostGraph, st: Stage, compute_ms: float) -> float:
    """What the meeting before stage ``st``'s gradient sync costs beyond the link's price of it, as two ranks of
    its host measured it after ``compute_ms`` of compute (:meth:`hpml_compile.costgraph.CostGraph.meeting_ms`,
    over ``ceil(log2 d)`` rounds for ``d`` replicas as the loss agreement's figure is): the stage's sync prices
    the meeting on the link (:func:`hpml_compile.stagecost.meet_ms`), where a one-element all-reduce is all
    latency, but the ranks pay more (gloo's threads wake after the compute). 0.0 for one replica, devices that
    are not CPUs of one host, a sync that does not meet (compressed, local SGD, hierarchical), or no probe; the
    caller leaves out a stage without parameters (no sync).

    The result may be negative: the measurement replaces the link's price.
    """
    devs = [plan.cluster.device(d) for d in st.devices]
    flat = not st.compress and plan.sync_every <= 1 and st.allreduce is not AllReduce.HIERARCHICAL
    if st.replicas <= 1 or not flat or not all(d.is_cpu for d in devs) or len({d.host for d in devs}) > 1:
        return 0.0
    pair = [graph.meeting_ms(d.kind, compute_ms) for d in devs]
    if None in pair:
        return 0.0
    dp = st.dp_groups()[0]
    group = min((link_spec(plan.cluster, dp[0], x) for x in dp[1:]), key=lambda sp: sp.gbps)
    return measured_agree_ms(max(x for x in pair if x is not None), st.replicas) - meet_ms(st.replicas, group)


def _stage_bars(dev: str, i: int, cst: StageCost, done: dict[Op, tuple[float, float]],
                m: int, replica: int = 0) -> Iterator[Interval]:
    """The compute bars of replica ``replica`` of stage ``i``: a replica faster than the stage's slowest (uneven
    rows, or a faster kind beside a slower one) ends each operation early and waits for the rest."""
    own = cst.replica_ms[replica] if cst.replica_ms else (cst.fwd_ms, cst.bwd_ms)
    if own == (cst.fwd_ms, cst.bwd_ms):
        yield from _slowest_bars(dev, i, cst, done, m)
        return
    f_share = own[0] / cst.fwd_ms if cst.fwd_ms > 0 else 1.0
    b_share = (own[0] * bool(cst.recompute_ms) + own[1]) / (cst.recompute_ms + cst.bwd_ms) \
        if cst.recompute_ms + cst.bwd_ms > 0 else 1.0
    for k in range(m):
        fs, fe = done[(FWD, i, k)]
        yield Interval(dev, fs, fs + (fe - fs) * f_share, EventKind.FORWARD, k, i)
        bs, be = done[(BWD, i, k)]
        be = bs + (be - bs) * b_share
        rec = own[0] * (be - bs) / (own[0] + own[1]) if cst.recompute_ms and own[0] + own[1] > 0 else 0.0
        if cst.recompute_ms:
            yield Interval(dev, bs, bs + rec, EventKind.RECOMPUTE, k, i)
        yield Interval(dev, bs + rec, be, EventKind.BACKWARD, k, i)
        if (WGT, i, k) in done:
            ws, we = done[(WGT, i, k)]
            yield Interval(dev, ws, ws + (we - ws) * b_share, EventKind.BACKWARD, k, i)
        if cst.swap_ms:
            yield Interval(dev, fe, fe + cst.swap_ms, EventKind.SWAP, k, i)
            yield Interval(dev, bs - cst.swap_ms, bs, EventKind.SWAP, k, i)


def _slowest_bars(dev: str, i: int, cst: StageCost, done: dict[Op, tuple[float, float]],
                  m: int) -> Iterator[Interval]:
    for k in range(m):
        fs, fe = done[(FWD, i, k)]
        yield Interval(dev, fs, fe, EventKind.FORWARD, k, i)
        bs, be = done[(BWD, i, k)]
        if cst.recompute_ms:
            yield Interval(dev, bs, bs + cst.recompute_ms, EventKind.RECOMPUTE, k, i)
        yield Interval(dev, bs + cst.recompute_ms, be, EventKind.BACKWARD, k, i)
        if (WGT, i, k) in done:  # ZB-H1's weight-gradient part, drawn as backward
            yield Interval(dev, *done[(WGT, i, k)], EventKind.BACKWARD, k, i)
        if cst.swap_ms:
            yield Interval(dev, fe, fe + cst.swap_ms, EventKind.SWAP, k, i)
            yield Interval(dev, bs - cst.swap_ms, bs, EventKind.SWAP, k, i)


def idle_intervals(result: SimResult, device: str) -> list[tuple[float, float]]:
    """Gaps in ``device``'s compute (forward, recompute, backward) between 0 and the step's end.

    Args:
        result: a simulation result.
        device: a device name.

    Returns:
        ``(start_ms, end_ms)`` of each idle gap.
    """
    compute = (EventKind.FORWARD, EventKind.BACKWARD, EventKind.RECOMPUTE)
    bars = sorted((b.start_ms, b.end_ms) for b in result.intervals if b.device == device and b.kind in compute)
    gaps, t = [], 0.0
    for s, e in bars:
        if s > t + 1e-12:
            gaps.append((t, s))
        t = max(t, e)
    if result.step_ms > t + 1e-12:
        gaps.append((t, result.step_ms))
    return gaps


def annotate(plan: Plan, graph: CostGraph, dtype: str = "float32") -> tuple[Plan, SimResult]:
    """Simulate ``plan`` and return a copy carrying the predictions, with the result.

    Args:
        plan: the plan.
        graph: its cost graph.
        dtype: parameter dtype.

    Returns:
        ``(plan with predicted fields filled in, simulation result)``.
    """
    r = simulate(plan, graph, dtype)
    stages = tuple(  # every other field kept as it is (compression, rows, ...)
        replace(st, predicted=StagePrediction(c.fwd_ms * x, (c.recompute_ms + c.bwd_ms) * x, c.memory.total, b))
        for st, c, x, b in zip(plan.stages, r.stages, r.contention, r.stage_bubbles))
    new = replace(plan, stages=stages, predicted=PlanPrediction(r.step_ms, r.bottleneck_stage, r.bubble))
    return new, r
