"""Candidate stages as arrays: every range, kind, degree and memory configuration at once, with numpy.

:func:`~hpml_compile.solve.candidates.enumerate_candidates` is defined by the
rules stated there (per ``(a, b, kind, d)`` the configurations from cheapest
estimated ``M t + tail`` up, each kept only if it fits at a later pipeline
position than every cheaper one). Evaluating them one Python object at a
time took ~120 s for llama-70b on 64 devices at 7 microbatch counts; here
they are evaluated as ``(ranges x configurations)`` arrays:

- times from the chain's prefix sums, ``t = time(a, b) / (M d)`` (+ one more
  forward under recompute, + two host transfers under swap);
- communication, gradient sync, optimizer step and memory from the formulas of
  :mod:`hpml_compile.stagecost`, which the simulator uses too, applied to
  arrays (alpha-beta costs as lines in the bytes; memory with exactly the
  integer arithmetic of :func:`~hpml_compile.stagecost.device_memory`, so that
  a candidate fits exactly when the plan validator says it does). Memory grows
  with the microbatches in flight, so the latest position ``jmax`` at which a
  configuration fits has a closed form instead of a loop.

Example:
    >>> from hpml_compile.solve.candidates import Chain, Setting
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> from hpml_compile.plan import Schedule
    >>> ch = Chain.of(chain_graph([(1.0, 2.0)] * 3))
    >>> tab = build_table(ch, uniform_cluster(2), Setting(4, Schedule.ONE_F_ONE_B, 64))
    >>> len(tab), tab.candidate(0).a, tab.candidate(0).b, float(tab.t[0])
    (12, 0, 1, 0.75)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import cost_models

from ..cluster import host_link_spec, overlap_efficiency
from ..errors import UnknownDeviceError
from ..ir import Cluster
from ..memory import MemoryBreakdown, ZeroStage, dtype_bytes, tied_shm_bytes
from ..plan import Schedule
from ..stagecost import (weight_part_ms, compressed_sync_ms, copy_ms, in_flight, memory_parts, optimizer_ms, stream_bytes_per_ms,
                         steps_flat, sync_ms, tp_bytes, tp_comm_ms, tp_time, transfer_ms, wire_ratio)
from .candidates import (CONFIGS, Candidate, Chain, Setting, boundary_link, classes, degrees, group_hierarchies,
                         group_links, host_groups, interleaved_in_flight, kind_counts, zero_bubble_runs)

__all__ = ["CandidateTable", "build_table"]

_INT_FIELDS = ("a", "b", "kind", "d", "cfg", "jmax", "params", "grads", "optimizer", "stored", "working",
               "in_flight", "host")
_FLOAT_FIELDS = ("t", "tail", "comm")


@dataclass(frozen=True, slots=True)
class CandidateTable:
    """Candidates as parallel arrays (one entry per candidate); see :class:`~.candidates.Candidate`.

    Attributes:
        kinds: device kinds; ``kind`` holds indices into it.
        a, b, kind, d, cfg, jmax: range, kind index, degree, index into CONFIGS, latest class that fits.
        t, tail, comm: per-microbatch busy ms, gradient-sync ms, boundary transfer ms.
        params, grads, optimizer, stored, working, in_flight, host: the memory breakdown at ``jmax``.
    """

    kinds: tuple[str, ...]
    a: np.ndarray
    b: np.ndarray
    kind: np.ndarray
    d: np.ndarray
    cfg: np.ndarray
    jmax: np.ndarray
    t: np.ndarray
    tail: np.ndarray
    comm: np.ndarray
    params: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    stored: np.ndarray
    working: np.ndarray
    in_flight: np.ndarray
    host: np.ndarray

    def __len__(self) -> int:
        return int(self.a.shape[0])

    def candidate(self, i: int) -> Candidate:
        """Entry ``i`` as a :class:`~.candidates.Candidate`."""
        mem = MemoryBreakdown(int(self.params[i]), int(self.grads[i]), int(self.optimizer[i]), int(self.stored[i]),
                              int(self.working[i]), int(self.in_flight[i]), int(self.host[i]))
        return Candidate(int(self.a[i]), int(self.b[i]), self.kinds[int(self.kind[i])], int(self.d[i]),
                         CONFIGS[int(self.cfg[i])], float(self.t[i]), float(self.tail[i]), float(self.comm[i]),
                         int(self.jmax[i]), mem)

    def candidates(self) -> list[Candidate]:
        """Every entry as a Candidate (in table order)."""
        return [self.candidate(i) for i in range(len(self))]

    def select(self, index: np.ndarray) -> "CandidateTable":
        """The entries at ``index`` (a boolean mask or integer indices)."""
        return CandidateTable(self.kinds, **{f: getattr(self, f)[index] for f in (*_INT_FIELDS, *_FLOAT_FIELDS)})

    @classmethod
    def concat(cls, kinds: tuple[str, ...], parts: list[dict[str, np.ndarray]]) -> "CandidateTable":
        """A table from column dictionaries (all with the same keys)."""
        cols: dict[str, np.ndarray] = {}
        for f in _INT_FIELDS:
            cols[f] = np.concatenate([p[f] for p in parts]).astype(np.int64) if parts else np.zeros(0, np.int64)
        for f in _FLOAT_FIELDS:
            cols[f] = np.concatenate([p[f] for p in parts]).astype(np.float64) if parts else np.zeros(0)
        return cls(kinds, **cols)

    @classmethod
    def of(cls, candidates: list[Candidate], kinds: tuple[str, ...]) -> "CandidateTable":
        """A table holding ``candidates`` (the kinds must all be in ``kinds``)."""
        kidx = {k: i for i, k in enumerate(kinds)}
        cidx = {c: i for i, c in enumerate(CONFIGS)}
        row = {f: [] for f in (*_INT_FIELDS, *_FLOAT_FIELDS)}  # type: dict[str, list[float]]
        for c in candidates:
            m = c.memory
            for f, v in (("a", c.a), ("b", c.b), ("kind", kidx[c.kind]), ("d", c.d), ("cfg", cidx[c.config]),
                         ("jmax", c.jmax), ("params", m.params), ("grads", m.grads), ("optimizer", m.optimizer),
                         ("stored", m.stored_per_microbatch), ("working", m.working), ("in_flight", m.in_flight),
                         ("host", m.host_bytes), ("t", c.t), ("tail", c.tail), ("comm", c.comm)):
                row[f].append(v)
        return cls.concat(kinds, [{f: np.asarray(v) for f, v in row.items()}])


def _jmax(static: np.ndarray, stored: np.ndarray, working: np.ndarray, cap: int, setting: Setting,
          big_j: int) -> np.ndarray:
    """The most stages that may follow (up to ``big_j``) with the peak still within ``cap``; -1 if none.

    The peak is ``static + in_flight(j) * stored + working`` with ``in_flight(j) = j + 1`` under 1F1B
    (``j <= big_j < M``) and ``M`` under GPipe and ZB-H1 (``big_j = 0``; :func:`.candidates.classes`); with room
    left for interleaving (:attr:`.candidates.Setting.room_chunks`), :func:`.candidates.interleaved_in_flight`.
    """
    room = cap - static - working
    if setting.schedule in (Schedule.GPIPE, Schedule.ZB_H1):
        return np.where(room >= max(1, setting.microbatches) * stored, 0, -1)
    k = np.where(stored > 0, room // np.maximum(stored, 1), big_j + 1)  # microbatches that fit in flight
    if setting.room_chunks > 1:  # interleaving's ceil(min(2 j + (v - 1) S + 1, v M) / v) <= k (in_flight)
        v, s, m = setting.room_chunks, setting.room_groups, setting.microbatches
        j = (v * np.minimum(k, m) - 1 - (v - 1) * s) // 2
        return np.where(room < stored, -1, np.where((k >= m) | (stored == 0), big_j,
                                                    np.minimum(big_j, np.maximum(j, -1))))
    return np.where(room < stored, -1, np.minimum(big_j, k - 1))


def _tied(chain: Chain, ra: np.ndarray, rb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`hpml_compile.memory.tied_elsewhere` and :func:`~hpml_compile.memory.tied_shared` for every range
    ``[a, b)`` of the chain at once: the bytes of parameters a range uses whose first user (where the prefix sums
    count them) lies before it, and of those it shares with nodes outside it (their gradients' flat buffer)."""
    sizes, uses = chain.graph.param_sizes, {}
    for i, n in enumerate(chain.graph.order):
        for name in chain.graph.node(n).params:
            uses.setdefault(name, []).append(i)
    elsewhere, shared = np.zeros(len(ra), np.int64), np.zeros(len(ra), np.int64)
    for name, at in uses.items():
        if len(at) < 2 or not sizes.get(name):
            continue
        pos = np.asarray(at, np.int64)
        inside = (pos[None, :] >= ra[:, None]) & (pos[None, :] < rb[:, None])
        used, out = inside.any(1), (~inside).any(1)
        elsewhere += np.where(used & (ra > at[0]), sizes[name], 0)
        shared += np.where(used & out, sizes[name], 0)
    return elsewhere, shared


def _tp_degrees(chain: Chain, setting: Setting) -> list[int]:
    """The tensor-parallel degrees above 1 the setting allows and the chain shards at."""
    return [t for t in sorted(chain.shard) if t <= setting.max_tp]


def _times(chain: Chain, kind: str, tp: int, ra: np.ndarray, rb: np.ndarray, m: int, replicas: int,
           link: cost_models.LinkSpec | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One microbatch's forward and backward ms of every range ``[ra, rb)`` on one rank of a stage of
    ``replicas x tp`` devices of ``kind`` (:func:`hpml_compile.stagecost.tp_time`), the tensor-parallel
    collectives on ``link`` included (:func:`hpml_compile.stagecost.tp_comm_ms`), and the backward's
    collectives alone (ZB-H1 runs them in the input-gradient part)."""
    fw, bw = np.asarray(chain.fwd[kind]), np.asarray(chain.bwd[kind])
    ffx, bfx = np.asarray(chain.fwd_fixed[kind]), np.asarray(chain.bwd_fixed[kind])
    frac = 1.0 / (m * replicas)
    if tp == 1:
        bwd = tp_time(bw[rb] - bw[ra], bfx[rb] - bfx[ra], 0.0, 0.0, frac, 1)
        return tp_time(fw[rb] - fw[ra], ffx[rb] - ffx[ra], 0.0, 0.0, frac, 1), bwd, bwd * 0.0
    sh = chain.shard[tp]
    fwd = tp_time(fw[rb] - fw[ra], ffx[rb] - ffx[ra], sh.fwd[kind][rb] - sh.fwd[kind][ra],
                  sh.fwd_fixed[kind][rb] - sh.fwd_fixed[kind][ra], frac, tp)
    bwd = tp_time(bw[rb] - bw[ra], bfx[rb] - bfx[ra], sh.bwd[kind][rb] - sh.bwd[kind][ra],
                  sh.bwd_fixed[kind][rb] - sh.bwd_fixed[kind][ra], frac, tp)
    fwd = fwd + tp_comm_ms((sh.fwd_allreduce[rb] - sh.fwd_allreduce[ra]) * frac,
                           (sh.fwd_gather[rb] - sh.fwd_gather[ra]) * frac, sh.fwd_count[rb] - sh.fwd_count[ra],
                           tp, link, fwd)  # the all-reduces' wait grows with the compute they follow
    comm = tp_comm_ms((sh.bwd_allreduce[rb] - sh.bwd_allreduce[ra]) * frac, 0 * frac,
                      sh.bwd_count[rb] - sh.bwd_count[ra], tp, link, bwd)
    return fwd, bwd + comm, comm


def build_table(chain: Chain, cluster: Cluster, setting: Setting, *, max_time: float = math.inf,
                ranges: tuple[np.ndarray, np.ndarray] | None = None,
                groups: list[tuple[str, int]] | None = None) -> CandidateTable:
    """The candidate stages of :func:`~.candidates.enumerate_candidates`, as a table.

    Args:
        chain: the chain.
        cluster: the cluster.
        setting: microbatches, schedule, batch size, dtype.
        max_time: drop candidates whose ``M * t`` (before recompute and swap) exceeds this.
        ranges: ``(a, b)`` arrays to restrict to (default: every range between cuttable positions).
        groups: ``(kind, d)`` pairs to restrict to (default: every kind with its degrees).

    Returns:
        The table, ordered by kind, degree, range, then cheapest configuration first.

    Raises:
        UnknownDeviceError: if a device kind has no costs in the graph.
    """
    counts = kind_counts(cluster)
    for kind in counts:
        if kind not in chain.fwd:
            raise UnknownDeviceError(
                f"cluster {cluster.name} has devices of kind {kind!r} but the cost graph of {chain.graph.model} "
                f"has costs only for {list(chain.graph.kinds)}; add predicted costs with "
                "hpml_compile.profile.predict_kinds(profile, kinds) before planning")
    kinds = tuple(counts)
    m, big_j = setting.microbatches, classes(setting, len(cluster.devices))
    if ranges is None:
        pts = np.flatnonzero(np.asarray(chain.cuttable))
        ia, ib = np.triu_indices(len(pts), 1)
        ra, rb = pts[ia], pts[ib]
    else:
        ra, rb = np.asarray(ranges[0], np.int64), np.asarray(ranges[1], np.int64)
    tied_all, shared_all = _tied(chain, ra, rb)
    if not cluster.devices:
        return CandidateTable.concat(kinds, [])
    params_all = np.asarray(chain.params, np.int64)[rb] - np.asarray(chain.params, np.int64)[ra] + tied_all
    acts_all = (np.asarray(chain.acts, np.int64)[rb] - np.asarray(chain.acts, np.int64)[ra])
    inputs_all = np.asarray(chain.cut, np.int64)[ra]
    if groups is None:  # a tensor-parallel stage needs only its replicas to split a microbatch's rows
        widest = max(_tp_degrees(chain, setting), default=1)
        groups = [(k, d) for k, c in counts.items() for d in degrees(c, max(1, setting.batch_size // m) * widest)]
    parts: list[dict[str, np.ndarray]] = []
    glinks = {k: group_links(cluster, k, [d for kk, d in groups if kk == k]) for k in {k for k, _ in groups}}
    hiers = {(k, t): group_hierarchies(cluster, k, [d for kk, d in groups if kk == k], t) if setting.hierarchical
             else {} for k in glinks for t in (1, *_tp_degrees(chain, setting))}
    blinks = {k: boundary_link(cluster, k) for k in glinks}
    tps = _tp_degrees(chain, setting)
    hgroups = {(k, t): host_groups(cluster, k, t) for k in glinks for t in tps}
    tlinks = {k: {t: group_links(cluster, k, [t])[t] for t in tps if hgroups[k, t]} for k in glinks}
    rows_mb = max(1, setting.batch_size // m)
    for kind, d in groups:
        first = next(x for x in cluster.devices if x.kind == kind)
        cap, is_cpu = first.memory_bytes, first.is_cpu
        host = host_link_spec(first)
        overlap = overlap_efficiency(cluster, [first.name])  # the runtime's rule (plan.sync_overlap), by kind
        degs = [1] * (rows_mb % d == 0) + [t for t in tlinks[kind] if d % t == 0 and rows_mb % (d // t) == 0
                                             and d // t <= hgroups[kind, t]]
        if not degs:
            continue
        full = {t: _times(chain, kind, t, ra, rb, m, d // t, tlinks[kind].get(t)) for t in degs}
        keep = np.flatnonzero(m * np.min([f + b for f, b, _ in full.values()], axis=0) <= max_time)
        if keep.size == 0:
            continue
        a, b = ra[keep], rb[keep]
        opt_rates = {flat: chain.graph.optimizer_ms_per_byte(kind, flat) for flat in (False, True)}
        rate = stream_bytes_per_ms(chain.graph, [kind])
        bpe = dtype_bytes(setting.dtype)
        wire = wire_ratio(setting.reduce_dtype.bytes, bpe)  # the gradient collectives' bytes per gradient byte
        cfg_ids = [i for i, c in enumerate(CONFIGS) if c.tp in degs and (d > c.tp or c.zero == ZeroStage.NONE)
                   and not (is_cpu and (c.offload or c.swap))
                   and (hiers[kind, c.tp].get(d) is not None or not c.hierarchical)
                   and (setting.schedule is not Schedule.ZB_H1 or zero_bubble_runs(c))
                   and (setting.room_chunks == 1 or not (c.swap or c.offload))]  # chunks neither swap nor offload
        if not cfg_ids:  # ZB-H1: a degree only the configurations it does not run would use
            continue
        ts, ests, jms, mems, comms = [], [], [], [], []
        for ci in cfg_ids:
            cfg = CONFIGS[ci]
            tp, dr = cfg.tp, d // cfg.tp
            fwd, bwd, bwd_comm = (x[keep] for x in full[tp])
            base = fwd + bwd
            params, acts = params_all[keep], acts_all[keep]
            if tp > 1:
                sh = chain.shard[tp]
                params = tp_bytes(params, sh.params[b] - sh.params[a], tp)
                acts = tp_bytes(acts, sh.acts[b] - sh.acts[a], tp)
            inputs, shared = inputs_all[keep], shared_all[keep]
            comm = np.where(a > 0, 2 * transfer_ms(cost_models.p2p_ms, inputs / (m * dr), blinks[kind]), 0.0)
            glink = glinks[kind][d]
            hier = hiers[kind, tp].get(d)
            swap_ms = 2 * transfer_ms(cost_models.p2p_ms, acts / (m * dr), host) if cfg.swap else 0.0
            # recompute: once before the backward, under ZB-H1 again before its weight-gradient part
            t = base + (fwd * (2 if setting.schedule is Schedule.ZB_H1 else 1) if cfg.recompute else 0.0) + swap_ms
            shards = hier.per_host if cfg.hierarchical and hier is not None else dr  # HSDP-like: one host's
            mem = memory_parts(param_bytes=params, activation_bytes=acts, input_bytes=inputs, dtype_bytes=bpe,
                               replicas=dr, zero=cfg.zero, microbatches=m, recompute=cfg.recompute,
                               swapped_bytes=acts if cfg.swap else acts * 0, offload_optimizer=cfg.offload,
                               host_is_device=is_cpu, compute_bytes=setting.compute_bytes, shards=shards,
                               process_bytes=chain.graph.process_bytes(kind, params, dr, cfg.zero) if is_cpu else 0)
            mem = mem._replace(grads=mem.grads + shared)  # the flat buffer of gradients tied to other stages
            if is_cpu:  # its sum through one host's shared memory: this stage's ranks and one more at least
                mem = mem._replace(process=mem.process + np.where(mem.process > 0, tied_shm_bytes(
                    shared, dr + 1), 0))
            jm = _jmax(mem.static, mem.stored, mem.working, cap, setting, big_j)
            if tp > 1 and chain.in_unit:  # a range that cuts a unit cannot shard it: never a candidate
                cuts_unit = np.asarray(chain.in_unit)
                jm = np.where(cuts_unit[a] | cuts_unit[b], -1, jm)
            ts.append(t)
            # the gradients land during the last backward, under ZB-H1 during its weight-gradient part (compute)
            window = weight_part_ms(bwd, comm_ms=bwd_comm) if setting.schedule is Schedule.ZB_H1 else bwd
            sync = sync_ms(params, dr, cfg.zero, cfg.offload, glink, host, hier if cfg.hierarchical else None,
                           bwd_ms=window, microbatches=m, overlap=overlap, fwd_ms=fwd, wire=wire)  # ZeRO-1/2: prefetched
            if hier is not None and cfg.zero == ZeroStage.NONE:  # the faster of flat and hierarchical (to_plan picks)
                sync = np.minimum(sync, sync_ms(params, dr, cfg.zero, cfg.offload, glink, host, hier, bwd_ms=window,
                                                microbatches=m, overlap=overlap, wire=wire))
            if setting.compress is not None and dr > 1 and cfg.zero == ZeroStage.NONE:  # allowed: where it pays
                sync = np.minimum(sync, compressed_sync_ms(params, dr, setting.compress, glink, dtype_bytes=bpe,
                                                           bytes_per_ms=rate, fraction=setting.compress_fraction))
            ests.append(m * t + sync
                        + copy_ms(params, dr, rate, cfg.zero, cfg.hierarchical, wire)
                        + optimizer_ms(params, dr, cfg.zero, opt_rates[steps_flat(cfg.zero, dr)], shards))
            jms.append(jm)
            mems.append(mem)
            comms.append(comm)
        est, jmx = np.stack(ests, 1), np.stack(jms, 1)
        order = np.argsort(est, axis=1, kind="stable")  # cheapest first; ties keep CONFIGS order
        jm_sorted = np.take_along_axis(jmx, order, 1)
        before = np.maximum.accumulate(np.concatenate([np.full((len(a), 1), -1), jm_sorted[:, :-1]], 1), 1)
        rows, pos = np.nonzero(jm_sorted > before)  # fits later than every cheaper configuration
        cols = order[rows, pos]
        t_all = np.stack(ts, 1)
        jm = jmx[rows, cols]
        part = {"a": a[rows], "b": b[rows], "kind": np.full(len(rows), kinds.index(kind)), "d": np.full(len(rows), d),
                "cfg": np.asarray(cfg_ids)[cols], "jmax": jm, "t": t_all[rows, cols],
                "tail": est[rows, cols] - m * t_all[rows, cols], "comm": np.stack(comms, 1)[rows, cols],
                "in_flight": in_flight(setting.schedule, m, jm) if setting.room_chunks == 1 else
                interleaved_in_flight(m, jm, setting.room_groups, setting.room_chunks)}
        for f in ("params", "grads", "optimizer", "stored", "working", "host"):
            part[f] = np.stack([getattr(mm, f) for mm in mems], 1)[rows, cols]
        parts.append(part)
    return CandidateTable.concat(kinds, parts)
