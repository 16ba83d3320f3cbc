"""Uneven data parallelism on mixed-kind clusters: today's best plan, the plan with mixed stages, peers, bound.

For each zoo model and each mixed-kind cluster (``hetero-4``, ``hetero-cpu``
and ``mix3-8``, 2 x A100-80GB + 3 x V100-32GB + 3 x T4 in ``mix3-8.json``
beside this file) it prints, all scored by the one simulator:

- ``ilp``: today's best plan (every stage on devices of one kind, equal rows);
- ``uneven``: what the driver now returns, the fastest of ``ilp`` and the
  candidates of :mod:`hpml_compile.solve.uneven` (stages mixing kinds, rows per
  replica chosen by :func:`hpml_compile.stagecost.choose_rows`), and which
  family won;
- the peers' partitioners where importable (DeepSpeed, torchgpipe, scored as
  in ``main.py``);
- ``bound``: :func:`main.compute_bound`, the whole step's compute (forward,
  backward, optimizer step) spread over every device in proportion to its
  speed, communication free; ``target``, half way from ``ilp`` to it;
- ``1-stage``: :func:`one_stage_floor`, below which no one-stage plan can go
  (where it is above ``target``, only a pipeline could meet the goal);
- ``closed``: the share of the distance from ``ilp`` to the bound that
  ``uneven`` closes (the goal: at least 0.5 where kinds can share a stage,
  never negative), and where ``uneven``'s step goes (:func:`parts`);
- ``fixed``: :func:`main.fixed_bound`, which charges each node's fixed part
  (a GPU's per-op cost) once per microbatch per replica, as the simulator
  does, and the share of the distance to it that ``uneven`` closes.
- ``charged``: :func:`charged_bound`, which also charges rows rounded to whole
  ones, the optimizer step at a mixed stage's slowest kind's pace, the
  gradient syncs and the tied embedding's all-reduce on the links they cross,
  and memory, as the simulator does; no plan simulates below it, so where it
  is above ``target`` the goal is out of reach on that pair. The ``closed``
  after it is the share of the distance from ``ilp`` to it that ``uneven``
  closes (scipy's HiGHS linear programs; up to ~40 s a pair on mix3-8).

Run:
    python benchmarks/plan_quality/uneven.py            # ~5 min on 2 busy cores
    python benchmarks/plan_quality/uneven.py --quick    # gpt2-xl only
    python benchmarks/plan_quality/uneven.py --two-stage  # every 2-stage plan of gpt2-xl on hetero-4
Writes benchmarks/plan_quality/results/uneven.json.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).parent))
from main import best_peer_plan, compute_bound, fixed_bound, graph_of, load_peers, write_result  # noqa: E402

import cost_models  # noqa: E402
from hpml_compile.cluster import host_link_spec, link_spec, load_cluster, overlap_efficiency  # noqa: E402
from hpml_compile.costgraph import CostGraph  # noqa: E402
from hpml_compile.errors import InfeasibleError  # noqa: E402
from hpml_compile.ir import Cluster  # noqa: E402
from hpml_compile.plan import Plan, Schedule  # noqa: E402
from hpml_compile.simulate import EventKind, loss_agreement_ms, simulate  # noqa: E402
from hpml_compile.stagecost import (BUCKET_BYTES, FIRST_BUCKET_BYTES, overlapped_ms,  # noqa: E402
                                    transfer_ms)
from hpml_compile.solve import solve  # noqa: E402
from hpml_compile.solve.baselines import cut_points  # noqa: E402
from hpml_compile.solve.candidates import Chain  # noqa: E402
from hpml_compile.solve.mixed import build_plan  # noqa: E402
from hpml_compile.solve.uneven import improve  # noqa: E402

HERE = Path(__file__).parent
# (zoo name, batch): gpt2-xl at batch 32 is the reference pair (hetero-4: 919.5 ms against 799.0 ms)
MODELS = [("gpt2-xl", 32), ("gpt2-small", 32), ("resnet50", 64), ("llama-7b", 8), ("resnet50", 256), ("gpt2-small", 256)]
CLUSTERS = ["hetero-4", "hetero-cpu", str(HERE / "mix3-8.json")]


def parts(plan: Plan, graph: CostGraph) -> dict[str, float]:
    """Where a plan's simulated step goes: ``pipeline`` (0 to the end of the last backward: compute, bubble,
    replicas waiting for the slowest), ``sync`` (gradient and tied all-reduces past it) and ``optimizer``."""
    r = simulate(plan, graph)
    compute = (EventKind.FORWARD, EventKind.BACKWARD, EventKind.RECOMPUTE)
    pipe = max(b.end_ms for b in r.intervals if b.kind in compute)
    return {"pipeline": pipe, "sync": r.step_without_optimizer_ms - pipe,
            "optimizer": r.step_ms - r.step_without_optimizer_ms}


def _exposed_gather(cluster: Cluster, devices: Any, ms: float) -> float:
    """What of a ZeRO >= 1 stage's parameter all-gather a bound may charge regardless of its forward: all of it
    where the stage gathers after its optimizer step (a group with a CPU), none where the runtime prefetches it
    under the next forward (GPU groups; the simulator charges what that forward leaves
    exposed: :func:`charged_bound` adds a row for that, with the forward as the linear program has it)."""
    return 0.0 if overlap_efficiency(cluster, list(devices)) > 0 else ms


def one_stage_floor(graph: CostGraph, cluster: Cluster) -> float:
    """A lower bound on the simulated step of any one-stage plan (every device a replica of the whole model,
    ZeRO 0 to 3; no offload, compression or local SGD), over every subset of the devices.

    Such a plan's step is at least its forward and backward spread over its devices in proportion to their
    speed (``1 / sum 1 / W_i``), plus what follows the last backward. Under ZeRO-0: the last gradient bucket's
    all-reduce, which starts when the backward ends (:func:`hpml_compile.stagecost.overlapped_ms` with the
    rest hidden), and every replica stepping every parameter at the pace of the slowest kind (``max O_k``,
    the simulator's rule for a mixed stage). Under ZeRO-1 to 3: the last bucket of the gradients'
    reduce-scatter (a group with a CPU: all of it), then the shards' step (``max O_k / d``), and the parameters'
    all-gather where no forward hides it (a group with a CPU). Links: the fastest choice of the stage's first
    device, whose slowest link the simulator prices the group's collectives on.
    """
    everything = graph.total("param_bytes")
    devs = list(cluster.devices)
    best = float("inf")
    for mask in range(1, 2 ** len(devs)):
        sub = [d for i, d in enumerate(devs) if mask >> i & 1]
        compute = 1.0 / sum(1.0 / graph.total("", kind=d.kind) for d in sub)
        step = max(graph.optimizer_ms_per_byte(d.kind) for d in sub) * everything
        flat = max(graph.optimizer_ms_per_byte(d.kind, True) for d in sub) * everything  # a ZeRO shard's step
        if len(sub) > 1:
            link = max((min((link_spec(cluster, a.name, b.name) for b in sub if b is not a), key=lambda x: x.gbps)
                        for a in sub), key=lambda x: x.gbps)
            last = overlapped_ms(cost_models.allreduce_ms, everything, link, len(sub), float("inf"))
            names = [d.name for d in sub]
            gather = _exposed_gather(cluster, names, transfer_ms(cost_models.all_gather_ms, everything, link, len(sub)))
            scatter = overlapped_ms(cost_models.reduce_scatter_ms, everything, link, len(sub), float("inf")) \
                if overlap_efficiency(cluster, names) > 0 else transfer_ms(cost_models.reduce_scatter_ms, everything,
                                                                           link, len(sub))
            step = min(last + step, scatter + gather + flat / len(sub))
        best = min(best, compute + step)
    return best


# ---------------------------------------------------------------------------------------------------------------
# A bound that counts what the simulator charges


def _row_factor(alphas: list[float], rows: int) -> float:
    """The least ``max_i r_i a_i`` over the rows of one microbatch split between replicas whose per-row times
    are ``a_i`` times a reference: integer rows, at least one each, summing to ``rows`` (uneven rows,
    :func:`hpml_compile.stagecost.choose_rows`), or the equal split ``rows / d`` each, a fraction where it does
    not divide, at the slowest replica's pace (a stage without rows: the simulator's ``even_rows``).

    >>> _row_factor([1.0, 1.0, 2.0], 4)  # even: 4/3 rows at pace 2; uneven: rows 2, 1, 1 at most 2
    2.0
    >>> _row_factor([1.0, 1.0], 3)  # even: 1.5 rows each
    1.5
    """
    even = rows / len(alphas) * max(alphas)
    lo = max(alphas)  # every replica holds a row
    candidates = sorted({r * a for a in alphas for r in range(1, rows + 1) if r * a >= lo})
    uneven = next(t for t in candidates if sum(int(t / a + 1e-9) for a in alphas) >= rows)
    return min(even, uneven)


def _row_classes(alpha_f: list[float], alpha_b: list[float], rows: int) -> list[tuple[float, float, tuple[float, ...]]]:
    """Every split of a microbatch's ``rows`` among replicas with per-row paces ``alpha_f`` (forward) and
    ``alpha_b`` (backward), as classes ``(F, B, least)``: each split lies in a class whose forward and backward
    factors (as :func:`_row_factor`'s, ``max_i r_i a_i``) are at least ``F`` and ``B`` and whose replica ``i``
    holds at least ``least[i]`` rows, so that a bound may charge the rows' activations to each replica's own
    memory (a T4 beside an A100 can hold only so many of gpt2-xl's rows, and the A100 must then take the rest).

    A split's forward factor is one of the values ``r a_i``; at that value ``F`` every replica holds at most
    ``floor(F / a_i)`` rows, so replica ``i`` at least what the others cannot hold. Values giving the same
    least rows make one class with the smallest of them. The even split (``rows / d`` each, a fraction where
    it does not divide, at the slowest pace) is a class of its own.

    >>> [(f, b, least) for f, b, least in _row_classes([1.0, 2.0], [1.0, 2.0], 3)]  # rows 2, 1; 1, 2; 1.5 each
    [(2.0, 2.0, (2, 1)), (4.0, 2.0, (1, 1)), (3.0, 3.0, (1.5, 1.5))]
    """
    d, lo = len(alpha_f), max(alpha_f)
    out: dict[tuple[int, ...], float] = {}
    for f in sorted({r * a for a in alpha_f for r in range(1, rows + 1) if r * a >= lo}):
        most = [int(f / a + 1e-9) for a in alpha_f]
        if sum(most) < rows:
            continue
        least = tuple(max(1, rows - (sum(most) - mine)) for mine in most)
        out.setdefault(least, f)
    back = _row_factor(alpha_b, rows)
    classes: list[tuple[float, float, tuple[float, ...]]] = [
        (f, max(back, max(r * a for r, a in zip(least, alpha_b))), least) for least, f in out.items()]
    classes.append((rows / d * lo, rows / d * max(alpha_b), (rows / d,) * d))
    return classes


def _best_link(cluster: Cluster, names: list[str]) -> cost_models.LinkSpec | None:
    """The fastest link the simulator could price a collective of ``names`` on: it takes the slowest link from
    the group's first device, so the best first device's (None for one device)."""
    if len(names) < 2:
        return None
    return max((min((link_spec(cluster, a, b) for b in names if b != a), key=lambda x: x.gbps) for a in names),
               key=lambda x: x.gbps)


def _slope(fn: Callable[..., float], replicas: int, link: cost_models.LinkSpec | None) -> float:
    """ms per byte of a collective affine in its bytes (its latency left out: ``fn(P) >= slope * P``)."""
    if link is None or replicas < 2:
        return 0.0
    return (transfer_ms(fn, 2.0 * 2**30, link, replicas) - transfer_ms(fn, 2.0**30, link, replicas)) / 2**30


#: Most linear programs :func:`charged_bound` solves to refine one by the replicas' row classes.
MAX_CLASS_LPS = 256


def charged_bound(graph: CostGraph, cluster: Cluster, *, detail: bool = False) -> Any:
    """A lower bound on the simulated step of every plan of the solvers' space (stages of any devices and kinds,
    rows even or uneven, GPipe or 1F1B, ZeRO 0-3, recompute, offload, swap, ``M`` dividing the batch, float32;
    no compression, local SGD or hierarchical all-reduce), which charges what the simulator charges and the
    compute bound does not. The compute bound spreads every node's fixed part over the devices as if it
    shrank with the rows, lets a V100 step the optimizer beside an A100 at its own pace and moves gradients for
    free; the simulator does none of that, and a goal set against the compute bound may be out of reach of
    every plan. Where this bound is above the goal, that is proved (under the cost model).

    For every way to deal the devices into ``S`` groups (by kind counts, unordered; devices may stay idle) and
    every ``M`` leaving each replica a row, a linear program over how much of each node each stage holds
    (``x_{n,s}``, fractions; order and contiguity relaxed but for the tied parameter below, so it is below
    every plan of that shape) finds the least step that these inequalities allow; the bound is the least over
    all shapes (one stage first, a quick bound and branch and bound skipping most):

    - a stage's forward (backward) per microbatch is at least three expressions linear in ``x``: the nodes'
      fixed parts (the least over the group's kinds: charged once per microbatch per replica) plus their
      per-row parts on a reference kind times ``R`` = the least ``max_i r_i a_i`` over the ways to split a
      microbatch's ``B / M`` rows (integer rows, one at least, or the equal split at the slowest kind's pace:
      :func:`_row_factor`) with ``a_i`` the least per-row ratio of replica ``i``'s kind over all nodes; the
      same with the ratios of the heaviest node type for it and one row on the fastest kind for the others;
      and the replicas' times weighted by ``mu_i ~ 1 / ratio`` (a weighted mean is below their max);
    - each stage holds at least one whole node;
    - the pipeline, ``t_s = f_s + b_s``, for every stage ``k``:
      ``step >= sum_s t_s + (M - 1) b_k + max(0, M - S) f_k`` (microbatch 1 goes forward through every stage
      and back; stage ``k`` runs its ``M`` backwards in between, and its forwards but for the at most
      ``S - 1`` warm-up forwards that 1F1B may run while it waits; GPipe gives more) and ``step >= M t_k``;
    - then the syncs, the tied all-reduce and the optimizer step, one after the other as the simulator runs
      them. A stage on one device steps ``o P_s`` (``o``: its kind's ms per parameter byte). A replicated
      stage branches on ZeRO-0 (its ring all-reduce ``>= slope * P_s`` from its last backward's start, each
      bucket launched when ready, and ``o P_s`` at its slowest kind's pace; any offload copies after its last
      backward) or ZeRO >= 1 (from its last backward's end: the parameters' all-gather, ``o P_s / d``; ZeRO-3
      pays more of both; on a group of GPUs, where the runtime prefetches the gather under the next forward, only
      what one microbatch's forward over ``d`` cannot hide, ``max(0, g P_s - f_k / d)``, as
      :func:`hpml_compile.stagecost.prefetched_gather_ms` charges at least), each with and without the Adam state offloaded (two copies of what is stepped over
      the fastest host link of the group). Memory as :func:`hpml_compile.stagecost.memory_parts` counts it:
      parameters and gradients whole under every ZeRO stage, the Adam state ``2 P_s`` (ZeRO-0) or
      ``2 P_s / d`` unless offloaded, at least one row's activations, within the smallest memory of the group
      (one device: offload costs ``>= 2 h (P - room)``, linear, where ``room`` fits without it);
    - the largest parameter used by several nodes (GPT-2's tied embedding): either its all-reduce between two
      stages (over at least 2 devices on the fastest link between two groups), or one stage holds every node
      between its users, and if that stage is replicated under ZeRO-0 its last gradient bucket's all-reduce
      starts when its backward ends (the least over the bytes it may hold);
    - one stage (``S = 1``) holds the whole model, so its tail is the one-stage floor's, exact: the last
      bucket's all-reduce and ``o P`` (ZeRO-0), or the gather and ``o P / d`` (ZeRO >= 1), with the offload
      copies where only offload fits;
    - and the loss agreement between the syncs and the steps (:func:`hpml_compile.simulate.loss_agreement_ms`),
      which depends only on the devices the shape uses, so it is added to each shape's least step (not to a
      one-stage shape with a CPU in its group, whose agreement may ride its sync:
      :func:`hpml_compile.simulate.agreement_rides`).

    Args:
        graph: the cost graph.
        cluster: the devices.
        detail: also return the shape that attains the bound.

    Returns:
        The bound in ms (with ``detail``: ``(bound, {"groups": ..., "microbatches": ...})``).
    """
    import numpy as np
    from scipy.optimize import linprog

    batch, kinds_all = graph.batch_size, sorted({d.kind for d in cluster.devices})
    ref = min(kinds_all, key=lambda k: graph.total("", kind=k))
    # node data, identical nodes merged (the relaxation is symmetric in them, so nothing is lost)
    merged: dict[tuple, int] = {}

    def key_of(n: str) -> tuple:
        rec = graph.node(n)
        return (rec.param_bytes, rec.activation_bytes) + tuple(v for k in kinds_all
                                                              for v in (*rec.cost[k], *rec.fixed_at(k)))

    for n in graph.order:
        merged[key_of(n)] = merged.get(key_of(n), 0) + 1
    types = list(merged)
    counts = [merged[t] for t in types]

    def part(t: tuple, k: str) -> tuple[float, float, float, float]:
        i = 2 + 4 * kinds_all.index(k)
        f, b, ff, bf = t[i:i + 4]
        return ff, bf, (f - ff) / batch, (b - bf) / batch  # fixed fwd, fixed bwd, per-row fwd, per-row bwd

    alpha_f, alpha_b = {}, {}
    for k in kinds_all:
        rf = [part(t, k)[2] / part(t, ref)[2] for t in types if part(t, ref)[2] > 0]
        rb = [part(t, k)[3] / part(t, ref)[3] for t in types if part(t, ref)[3] > 0]
        alpha_f[k], alpha_b[k] = min(rf, default=1.0), min(rb, default=1.0)
    heavy = max(types, key=lambda t: merged[t] * (part(t, ref)[2] + part(t, ref)[3]))
    ratio = {k: (part(heavy, k)[2] + part(heavy, k)[3]) / max(1e-12, part(heavy, ref)[2] + part(heavy, ref)[3])
             for k in kinds_all}
    params = [t[0] for t in types]
    acts = [t[1] / batch for t in types]  # one row's activations: every replica holds at least one row's
    total_params = graph.total("param_bytes")
    # the largest parameter used by several nodes (tied embeddings): the span of its users in the order, and
    # how many nodes of each type lie in it (a stage that holds both users holds all of them)
    users: dict[str, list[int]] = {}
    for i, n in enumerate(graph.order):
        for name in graph.node(n).params:
            users.setdefault(name, []).append(i)
    shared = [(graph.param_sizes.get(p, 0), min(u), max(u)) for p, u in users.items() if len(set(u)) > 1]
    tied_bytes, lo_pos, hi_pos = max(shared, default=(0, 0, -1))
    inside = [0] * len(types)
    for i, n in enumerate(graph.order):
        if lo_pos <= i <= hi_pos:
            inside[types.index(key_of(n))] += 1

    span_params = sum(graph.node(n).param_bytes for n in graph.order[lo_pos:hi_pos + 1])

    def last_bucket_least(link: cost_models.LinkSpec | None, d: int) -> float:
        """The least last-bucket all-reduce (:func:`hpml_compile.stagecost.overlapped_ms` past the backward)
        of a stage whose parameter bytes are between ``span_params`` and every parameter: the last bucket grows
        with the bytes but for where a new bucket starts, just past a multiple of the bucket size."""
        lo, hi = float(span_params), float(max(total_params, span_params))
        least = overlapped_ms(cost_models.allreduce_ms, lo, link, d, float("inf"))
        first = float(FIRST_BUCKET_BYTES)
        k = math.floor(max(0.0, lo - first) / BUCKET_BYTES) + 1  # the next bucket boundary above lo
        if lo > 0 and first + k * BUCKET_BYTES + 1 <= hi:
            least = min(least, overlapped_ms(cost_models.allreduce_ms, first + k * BUCKET_BYTES + 1, link, d,
                                             float("inf")))
        return least

    by_kind: dict[str, list[str]] = {}
    for d in cluster.devices:
        by_kind.setdefault(d.kind, []).append(d.name)
    kinds = sorted(by_kind)
    avail = tuple(len(by_kind[k]) for k in kinds)

    def names_of(groups: tuple[tuple[int, ...], ...]) -> list[list[str]]:
        used = [0] * len(kinds)
        out = []
        for g in groups:
            names = []
            for j, c in enumerate(g):
                names += by_kind[kinds[j]][used[j]:used[j] + c]
                used[j] += c
            out.append(names)
        return out

    vectors = [v for v in itertools.product(*(range(a + 1) for a in avail)) if sum(v)]

    def groupings(left: tuple[int, ...], start: int) -> Iterator[tuple[tuple[int, ...], ...]]:
        for i in range(start, len(vectors)):
            v = vectors[i]
            if all(a <= b for a, b in zip(v, left)):
                rest = tuple(b - a for a, b in zip(v, left))
                yield (v,)
                for more in groupings(rest, i):
                    yield (v, *more)

    nt = len(types)
    a_eq = None
    best: tuple[float, Any] = (float("inf"), None)
    shapes = sorted(groupings(avail, 0), key=len)  # one stage first: its bound is the tightest, and prunes most
    for groups in shapes:
        s_count = len(groups)
        members = names_of(groups)
        sizes = [len(m) for m in members]
        gk = [[cluster.device(x).kind for x in m] for m in members]
        opt = [max(graph.optimizer_ms_per_byte(k) for k in set(ks)) for ks in gk]
        opt_flat = [max(graph.optimizer_ms_per_byte(k, True) for k in set(ks)) for ks in gk]  # a ZeRO shard's
        links = [_best_link(cluster, m) for m in members]
        # the same on every plan of them; a one-stage plan with a CPU in its group may carry it on its sync's
        # meeting (hpml_compile.simulate.agreement_rides): none charged there
        rides = s_count == 1 and any(cluster.device(x).is_cpu for x in members[0])
        agree = 0.0 if rides else loss_agreement_ms(cluster, [x for names in members for x in names])
        ar = [_slope(cost_models.allreduce_ms, d, ln) for d, ln in zip(sizes, links)]
        rs = [_slope(cost_models.reduce_scatter_ms, d, ln) for d, ln in zip(sizes, links)]
        ag_all = [_slope(cost_models.all_gather_ms, d, ln) for d, ln in zip(sizes, links)]
        ag = [_exposed_gather(cluster, mm, a) for mm, a in zip(members, ag_all)]  # 0 where prefetched (GPUs)
        hide = [overlap_efficiency(cluster, mm) for mm in members]  # of the backward a bucketed sync may hide
        mem = [float(min(cluster.device(x).memory_bytes for x in m)) for m in members]
        # offload copies: ms per byte over the fastest host link of the group (a CPU's: none to cross)
        host = [0.0 if any(cluster.device(x).is_cpu for x in mm) else min(
            _slope(lambda b, n, ln: cost_models.p2p_ms(b, ln), 2, host_link_spec(cluster.device(x))) for x in mm)
            for mm in members]
        tied = 0.0
        if s_count > 1 and tied_bytes:
            cross = max((link_spec(cluster, a, b) for i, m in enumerate(members) for a in m
                         for j, m2 in enumerate(members) if j != i for b in m2), key=lambda x: x.gbps)
            tied = transfer_ms(cost_models.allreduce_ms, tied_bytes, cross, 2)
        nx = nt * s_count  # x[s * nt + j]; then Z, O, then per stage: offload copies, forward, backward (ms)
        iz, io = nx, nx + 1
        jf, jb = nx + 2 + s_count, nx + 2 + 2 * s_count
        it = nx + 2 + 3 * s_count  # the tied parameters' all-reduce (ms)
        nv = it + 1
        dev_mem = [[float(cluster.device(x).memory_bytes) for x in mm] for mm in members]
        # a second bound on each stage's time, exact in the per-node kind ratios: the replicas' times weighted
        # by mu_i ~ 1 / (the kind's ratio on the heaviest node type), a weighted mean being below their max
        mu = []
        for ks in gk:
            inv = [1.0 / ratio[k] for k in ks]
            mu.append([v / sum(inv) for v in inv])
        a_eq = np.zeros((nt, nv))
        for j in range(nt):
            for s in range(s_count):
                a_eq[j, s * nt + j] = 1.0
        cost = np.zeros(nv)
        cost[iz] = 1.0
        for m in (m for m in range(1, batch + 1) if batch % m == 0 and batch // m >= max(sizes)):
            rows = batch // m
            rf = [_row_factor([alpha_f[k] for k in ks], rows) for ks in gk]
            rb = [_row_factor([alpha_b[k] for k in ks], rows) for ks in gk]
            # per stage, per node type: forward and backward of one microbatch on it
            af = [[min(part(t, k)[0] for k in set(ks)) + rf[s] * part(t, ref)[2] for t in types]
                  for s, ks in enumerate(gk)]
            ab = [[min(part(t, k)[1] for k in set(ks)) + rb[s] * part(t, ref)[3] for t in types]
                  for s, ks in enumerate(gk)]
            # a quick bound before any linear program: every node on its cheapest stage, and the stages' work
            # at least M / S of that on the busiest
            cheap = sum(n * min(af[s][j] + ab[s][j] for s in range(s_count)) for j, n in enumerate(counts))
            if max(1.0, m / s_count) * cheap >= best[0]:
                continue
            base_ub: list[np.ndarray] = []
            base_b: list[float] = []

            def weighted(s: int, t: tuple, which: int) -> float:
                """mu-weighted time of node type ``t`` in stage ``s`` (``which``: 0 forward, 1 backward)."""
                ks, w, d = gk[s], mu[s], len(gk[s])
                fixed = sum(wi * part(t, k)[which] for wi, k in zip(w, ks))
                per = [wi * part(t, k)[2 + which] for wi, k in zip(w, ks)]
                uneven = sum(per) + (rows - d) * min(per) if rows >= d else float("inf")
                return fixed + min(uneven, rows / d * sum(per))

            # a third: the heaviest node type's rows rounded as the whole stage's are (its kind ratios), every other
            # node at least one row on the group's fastest kind for it
            h = types.index(heavy)
            third = []
            for which in (0, 1):
                per_stage_vals = []
                for s, ks in enumerate(gk):
                    r_h = _row_factor([part(heavy, k)[2 + which] / max(1e-12, part(heavy, ref)[2 + which])
                                       for k in ks], rows)
                    per_stage_vals.append([
                        min(part(t, k)[which] for k in set(ks))
                        + (r_h * part(heavy, ref)[2 + which] if j == h else min(part(t, k)[2 + which] for k in ks))
                        for j, t in enumerate(types)])
                third.append(per_stage_vals)
            for s in range(s_count):  # a stage holds at least one whole node of the graph
                r = np.zeros(nv)
                r[s * nt:(s + 1) * nt] = -1.0
                base_ub.append(r)
                base_b.append(-1.0)
                for which, (var, first_bound) in enumerate(((jf, af), (jb, ab))):
                    for vals in (first_bound[s], [weighted(s, t, which) for t in types], third[which][s]):
                        r = np.zeros(nv)
                        r[s * nt:(s + 1) * nt] = vals
                        r[var + s] = -1.0
                        base_ub.append(r)
                        base_b.append(0.0)

            def row(coef: dict[int, float], const: float, into_a: list, into_b: list) -> None:
                """``sum coef * vars <= -const`` (``const``: what is added to the right side of ``Z >= ...``)."""
                r = np.zeros(nv)
                for i, v in coef.items():
                    r[i] += v
                into_a.append(r)
                into_b.append(-const)

            def lin(vals: list[float], s: int, scale: float, into: dict[int, float]) -> None:
                for j in range(nt):
                    into[s * nt + j] = into.get(s * nt + j, 0.0) + scale * vals[j]

            def tv(var: int, s: int, scale: float, into: dict[int, float]) -> None:
                into[var + s] = into.get(var + s, 0.0) + scale

            def last_backward(k: int, *, start: bool = False) -> list[dict[int, float]]:
                """Two lower bounds on when stage ``k``'s last backward ends (``start``: begins), each a row's
                coefficients: the first microbatch forward through the stages before it, then its ``M``
                forwards and ``M`` backwards (``M - 1`` before the last begins); or that, its ``M`` forwards, then
                the last microbatch forward and back through the stages after it, then its own last backward
                (the simulator runs a stage's microbatches one at a time, each when its input is there)."""
                serial: dict[int, float] = {}
                for s in range(k):
                    tv(jf, s, 1.0, serial)
                back = dict(serial)
                tv(jf, k, m, serial)
                tv(jb, k, m - 1 if start else m, serial)
                tv(jf, k, m, back)
                for s in range(k + 1, s_count):
                    tv(jf, s, 1.0, back)
                    tv(jb, s, 1.0, back)
                if not start:
                    tv(jb, k, 1.0, back)
                return [serial, back]

            for k in range(s_count):
                # the pipeline: sum_s t_s + (M-1) b_k + max(0, M-S) f_k, then tied, then the step O
                c: dict[int, float] = {}
                for s in range(s_count):
                    tv(jf, s, 1.0, c)
                    tv(jb, s, 1.0, c)
                tv(jb, k, m - 1, c)
                tv(jf, k, max(0, m - s_count), c)
                c[iz], c[io] = -1.0, 1.0
                c[it] = 1.0
                row(c, 0.0, base_ub, base_b)
                c = {}
                tv(jf, k, m, c)
                tv(jb, k, m, c)
                c[iz], c[io] = -1.0, 1.0
                c[it] = 1.0
                row(c, 0.0, base_ub, base_b)
                if sizes[k] == 1:  # one device: its whole step after its compute and its offload copies
                    c = {io: -1.0}
                    lin(params, k, opt[k], c)
                    row(c, 0.0, base_ub, base_b)
                    for c in last_backward(k):
                        c[iz], c[io], c[nx + 2 + k] = -1.0, 1.0, 1.0
                        c[it] = 1.0
                        row(c, 0.0, base_ub, base_b)
                    # memory: parameters and gradients whole, the Adam state (2 P) unless offloaded, a row's
                    # activations; offloading costs 2 copies of P over the host link: copies >= 2 h (P - room)
                    # where room = (memory - activations) / 4 is what fits without offload
                    c = {}
                    lin(params, k, 2.0, c)
                    lin(acts, k, 1.0, c)
                    row(c, -mem[k], base_ub, base_b)
                    c = {nx + 2 + k: -1.0}
                    lin(params, k, 2 * host[k], c)
                    lin(acts, k, 2 * host[k] / 4, c)
                    row(c, -2 * host[k] * mem[k] / 4, base_ub, base_b)

            def options(k: int) -> list[tuple[list[dict[int, float]], list[float]]]:
                """For a replicated stage ``k``, each ZeRO choice's rows (coefficients, right sides): its step,
                its sync, its memory and its offload copies (the model of :func:`hpml_compile.stagecost.memory_parts`:
                parameters and gradients whole under every ZeRO stage, the Adam state ``2 P`` or ``2 P / d``
                unless offloaded, at least a row's activations)."""
                d, out, cp = sizes[k], [], nx + 2 + k
                for zero in (0, 1):  # ZeRO-3 holds and moves more than ZeRO-1/2: their rows bound it too
                    ca: list[dict[int, float]] = []  # each of the two with and without offload
                    cb: list[float] = []
                    c = {io: -1.0}  # the step: O >= o P (ZeRO-0) or o P / d
                    lin(params, k, opt[k] if zero == 0 else opt_flat[k] / d, c)
                    ca.append(c)
                    cb.append(0.0)
                    for c in last_backward(k, start=zero == 0):
                        c.update({iz: -1.0, cp: 1.0, it: 1.0})
                        if zero == 0:  # all-reduce from the last backward's start
                            lin(params, k, ar[k] + opt[k], c)
                        else:  # from the last backward's end: the parameters gathered once (ZeRO-3: more)
                            lin(params, k, ag[k] + opt_flat[k] / d, c)
                        ca.append(c)
                        cb.append(0.0)
                    if zero == 1:
                        # what one microbatch's forward / d leaves of a prefetched gather (GPUs;
                        # stagecost.prefetched_gather_ms: >= C - window), and the gradients' reduce-scatter, bucketed
                        # under at most the last backward / d (stagecost.overlapped_ms; a CPU group's: none of it)
                        for hidden, gather, scatter in ((1.0 / d, ag_all[k], 0.0), (0.0, ag[k], rs[k]),
                                                        (1.0 / d, ag_all[k], rs[k])):
                            if hidden and ag[k] == ag_all[k]:
                                continue  # not prefetched: the row above holds the whole gather
                            for c in last_backward(k):
                                c.update({iz: -1.0, cp: 1.0, it: 1.0})
                                tv(jf, k, -hidden, c)
                                tv(jb, k, -hide[k] / d if scatter else 0.0, c)
                                lin(params, k, scatter + gather + opt_flat[k] / d, c)
                                ca.append(c)
                                cb.append(0.0)
                    if zero == 0:  # and the offload copies start when the backward ends
                        for c in last_backward(k):
                            c.update({iz: -1.0, cp: 1.0, it: 1.0})
                            lin(params, k, opt[k], c)
                            ca.append(c)
                            cb.append(0.0)
                    state = 2.0 if zero == 0 else 2.0 / d  # Adam state per parameter byte on the device
                    moved = 1.0 if zero == 0 else 1.0 / d  # what an offloaded step copies each way
                    for offload in (False, True):  # memory: P + gradients + (Adam state unless offloaded) + a row
                        c = {}
                        lin(params, k, 2.0 if offload else 2.0 + state, c)
                        lin(acts, k, 1.0, c)
                        oa, ob = [*ca, c], [*cb, mem[k]]
                        if offload:  # two copies of the (sharded) state's parameters over the host link
                            c = {cp: -1.0}
                            lin(params, k, 2 * host[k] * moved, c)
                            oa.append(c)
                            ob.append(0.0)
                        out.append((oa, ob))
                return out

            replicated = [k for k in range(s_count) if sizes[k] > 1]
            per_stage = [options(k) for k in replicated]

            def solve_lp(extra_a: list[np.ndarray], extra_b: list[float]) -> float:
                res = linprog(cost, A_ub=np.array(base_ub + extra_a), b_ub=np.array(base_b + extra_b), A_eq=a_eq,
                              b_eq=np.array(counts, float), bounds=[(0, None)] * nv, method="highs")
                return float(res.fun) + agree if res.status == 0 else float("inf")

            def dense(c: dict[int, float]) -> np.ndarray:
                r = np.zeros(nv)
                for i, v in c.items():
                    r[i] += v
                return r

            def class_rows(k: int, cls: tuple[float, float, tuple[float, ...]]) -> tuple[list[np.ndarray], list[float]]:
                """Stage ``k``'s rows under one class of row splits (:func:`_row_classes`): its forward and
                backward at the class's factors, and each replica's parameters, gradients and at least its rows'
                activations within its own memory (the Adam state left out: it may be offloaded)."""
                f_factor, b_factor, least = cls
                out_a, out_b = [], []
                for var, factor, which in ((jf, f_factor, 0), (jb, b_factor, 1)):
                    c = {var + k: -1.0}
                    lin([min(part(t, kk)[which] for kk in set(gk[k])) + factor * part(t, ref)[2 + which]
                         for t in types], k, 1.0, c)
                    out_a.append(dense(c))
                    out_b.append(0.0)
                for held, room in zip(least, dev_mem[k]):
                    c = {}
                    lin(params, k, 2.0, c)
                    lin(acts, k, held, c)
                    out_a.append(dense(c))
                    out_b.append(room)
                return out_a, out_b

            classes = {k: _row_classes([alpha_f[x] for x in gk[k]], [alpha_b[x] for x in gk[k]], rows)
                       for k in range(s_count) if sizes[k] > 1}
            n_combos = math.prod(len(v) for v in classes.values())

            def solve_refined(extra_a: list[np.ndarray], extra_b: list[float]) -> float:
                """:func:`solve_lp`, then, where it would lower the bound, the least over every combination of the
                replicated stages' row classes (each only adds rows, so this is still below every plan of the
                shape; skipped past ``MAX_CLASS_LPS`` combinations, where the unrefined value stands)."""
                v = solve_lp(extra_a, extra_b)
                if v >= best[0] or not classes or n_combos > MAX_CLASS_LPS:
                    return v
                least = float("inf")
                for combo in itertools.product(*(classes[k] for k in sorted(classes))):
                    more = [class_rows(k, cls) for k, cls in zip(sorted(classes), combo)]
                    least = min(least, solve_lp([*extra_a, *(r for a, _ in more for r in a)],
                                                [*extra_b, *(b for _, bs in more for b in bs)]))
                return least

            if s_count == 1 and sizes[0] > 1:  # the whole model: the one-stage floor's exact tail
                link, d, act = links[0], sizes[0], sum(n * a for n, a in zip(counts, acts))
                last_bucket = overlapped_ms(cost_models.allreduce_ms, total_params, link, d, float("inf"))
                whole_gather = transfer_ms(cost_models.all_gather_ms, total_params, link, d)
                gather = _exposed_gather(cluster, members[0], whole_gather)
                tails = []
                # ZeRO >= 1 also reduce-scatters the gradients: bucketed, at most the last backward / d hides it,
                # never its last bucket (stagecost.overlapped_ms; a CPU group's runs whole after the backward)
                scatter = transfer_ms(cost_models.reduce_scatter_ms, total_params, link, d)
                last_scatter = overlapped_ms(cost_models.reduce_scatter_ms, total_params, link, d, float("inf")) \
                    if hide[0] > 0 else scatter
                for zero, sync, state, moved in ((0, last_bucket, 2.0, 1.0),
                                                 (1, gather + last_scatter, 2.0 / d, 1.0 / d)):
                    step = (opt[0] if zero == 0 else opt_flat[0]) * total_params * moved
                    if (2 + state) * total_params + act <= mem[0]:
                        tails.append((zero, sync + step))
                    elif 2 * total_params + act <= mem[0]:  # only with the Adam state offloaded: two copies
                        tails.append((zero, sync + step + 2 * host[0] * moved * total_params))
                for zero, tail in tails:
                    c = {iz: -1.0}
                    tv(jf, 0, m, c)
                    tv(jb, 0, m, c)
                    lp_a, lp_b = [dense(c)], [-tail]
                    if zero == 1:  # the scatter less what the last backward / d hides, and the prefetched gather
                        rest = tail - gather - last_scatter  # less what one microbatch's forward / d hides
                        for f_coef, extra in ((m, gather), (m - 1.0 / d, whole_gather)):
                            for b_coef, more in ((m, last_scatter), (m - hide[0] / d, scatter)):
                                c = {iz: -1.0}
                                tv(jf, 0, f_coef, c)
                                tv(jb, 0, b_coef, c)
                                lp_a.append(dense(c))
                                lp_b.append(-(rest + extra + more))
                    v = solve_refined(lp_a, lp_b)
                    if v < best[0]:
                        best = (v, {"groups": members, "microbatches": m})
                continue
            # the tied parameter: its all-reduce, or one stage holding every node between its users
            variants: list[tuple[list[np.ndarray], list[float]]] = [([], [])]
            if s_count > 1 and tied_bytes:
                variants = [([dense({it: -1.0})], [-tied])]
                for s in range(s_count):
                    rows_in = []
                    for j in range(nt):
                        if inside[j]:
                            rows_in.append(dense({s * nt + j: -1.0}))
                    variants.append((rows_in, [-float(inside[j]) for j in range(nt) if inside[j]]))
            # the ZeRO choices of the replicated stages, branch and bound: a choice's rows only add constraints
            if solve_lp([], []) >= best[0]:
                continue
            alive = [vi for vi, (va, vb) in enumerate(variants) if len(variants) == 1 or solve_lp(va, vb) < best[0]]
            for vi, picks in itertools.product(alive, itertools.product(*(range(len(o)) for o in per_stage))):
                va, vb = variants[vi]
                choice = [per_stage[i][p] for i, p in enumerate(picks)]
                extra_a = [*va, *(dense(c) for ca, _ in choice for c in ca)]
                extra_b = [*vb, *(b for _, cb in choice for b in cb)]
                holder = vi - 1  # the stage that holds every user of the tied parameter (-1: none)
                if holder >= 0 and holder in replicated and picks[replicated.index(holder)] < 2:
                    # its ZeRO-0 all-reduce: the last bucket starts when the backward ends (its bytes known to
                    # within the span's parameters and the whole model's)
                    for c in last_backward(holder):
                        c.update({iz: -1.0, it: 1.0, nx + 2 + holder: 1.0})
                        lin(params, holder, opt[holder], c)
                        extra_a.append(dense(c))
                        extra_b.append(-last_bucket_least(links[holder], sizes[holder]))
                v = solve_refined(extra_a, extra_b)
                if v < best[0]:
                    best = (v, {"groups": members, "microbatches": m})
    # the LP's optimum is exact up to the solver's tolerance: stay on the safe side of it
    bound = best[0] * (1 - 1e-6)
    return (bound, best[1]) if detail else bound


def two_stage_best(graph: CostGraph, cluster: Cluster) -> tuple[Plan | None, int]:
    """The fastest two-stage plan by exhaustion: every ordered split of the devices into two groups (of any
    kinds), every boundary where a stage may end, every microbatch count leaving a row per replica, each
    stage with the first memory configuration that fits (:func:`hpml_compile.solve.mixed.build_plan`: ZeRO 0-2,
    recompute; rows by :func:`hpml_compile.stagecost.choose_rows`).

    Returns:
        The fastest plan (None if none fits) and how many plans fitted and were simulated.
    """
    points = cut_points(Chain.of(graph))
    names = [d.name for d in cluster.devices]
    batch = graph.batch_size
    best: tuple[float, Plan | None] = (float("inf"), None)
    fitted = 0
    for mask in range(1, 2 ** len(names) - 1):
        first = [x for i, x in enumerate(names) if mask >> i & 1]
        second = [x for x in names if x not in first]
        for m in (m for m in range(1, min(batch, 64) + 1) if batch % m == 0 and batch // m >= max(len(first),
                                                                                                    len(second))):
            for cut in points[1:-1]:
                plan = build_plan(graph, cluster, [first, second], [0, cut, len(graph.order)], m, Schedule.ONE_F_ONE_B,
                              "float32", "two-stage")
                if plan is not None:
                    fitted += 1
                    t = simulate(plan, graph).step_ms
                    if t < best[0]:
                        best = (t, plan)
    return best[1], fitted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="gpt2-xl only")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP and uneven-search time limit per pair")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "uneven.json")
    ap.add_argument("--two-stage", action="store_true",
                    help="only: every two-stage plan of gpt2-xl (batch 32) on hetero-4, the fastest (~1-2 min)")
    args = ap.parse_args()
    if args.two_stage:
        c4 = load_cluster("hetero-4")
        g = graph_of("gpt2-xl", 32, sorted({d.kind for d in c4.devices}))
        t0 = time.perf_counter()
        plan, fitted = two_stage_best(g, c4)
        shape = " | ".join(",".join(st.devices) + (f" rows {list(st.rows)}" if st.rows else "") for st in plan.stages) \
            if plan else "none fits"
        print(f"gpt2-xl (32) on hetero-4, every two-stage plan: {fitted} fit; the fastest "
              f"{simulate(plan, g).step_ms if plan else float('nan'):.5g} ms, M={plan.microbatches if plan else 0}: "
              f"{shape} ({time.perf_counter() - t0:.0f} s)")
        return
    t_start = time.time()
    peers, notes = load_peers()
    clusters = {load_cluster(c).name: load_cluster(c) for c in CLUSTERS}
    kinds = sorted({d.kind for c in clusters.values() for d in c.devices})
    head = (f"{'model':11s} {'cluster':11s} {'ilp ms':>9s} {'uneven ms':>10s} {'won':>15s} "
            + "".join(f"{p:>11s}" for p in peers)
            + f" {'bound ms':>9s} {'target':>8s} {'1-stage':>8s} {'closed':>7s} {'fixed':>8s} {'closed':>7s}"
            + f" {'charged':>8s} {'closed':>7s}"
            + f"  {'pipe+sync+opt':>20s}  uneven plan")
    print(head + "\n" + "-" * len(head))
    rows: list[dict[str, Any]] = []
    for name, batch in (MODELS[:1] if args.quick else MODELS):
        graph = graph_of(name, batch, kinds)
        for cname, cluster in clusters.items():
            row: dict[str, Any] = {"model": name, "batch": batch, "cluster": cname}
            t0 = time.perf_counter()
            try:
                base = solve(graph, cluster, solver="ilp", time_limit_s=args.time_limit)
            except InfeasibleError as e:
                print(f"{name:11s} {cname:11s} infeasible for every planner: {str(e).splitlines()[0][:90]}")
                rows.append({**row, "infeasible": str(e).splitlines()[0]})
                continue
            row["ilp_seconds"] = round(time.perf_counter() - t0, 2)
            t0 = time.perf_counter()
            got = improve(graph, cluster, base, time_limit_s=args.time_limit)
            row["uneven_seconds"] = round(time.perf_counter() - t0, 2)
            bound, fixed = compute_bound(graph, cluster), fixed_bound(graph, cluster)
            t0 = time.perf_counter()
            charged, shape_at = charged_bound(graph, cluster, detail=True)
            row["charged_seconds"] = round(time.perf_counter() - t0, 2)
            ilp, unev = base.predicted.step_ms, got.plan.predicted.step_ms
            split, floor = parts(got.plan, graph), one_stage_floor(graph, cluster)
            row.update(ilp_ms=ilp, uneven_ms=unev, won=got.chosen, candidates=got.tried, bound_ms=bound,
                       target_ms=(ilp + bound) / 2, one_stage_floor_ms=floor,
                       closed=(ilp - unev) / (ilp - bound) if ilp > bound else None, fixed_bound_ms=fixed,
                       closed_fixed=(ilp - unev) / (ilp - fixed) if ilp > fixed else None,
                       charged_bound_ms=charged, charged_at=shape_at,
                       closed_charged=(ilp - unev) / (ilp - charged) if ilp > charged else None,
                       target_below_charged=(ilp + bound) / 2 < charged,
                       ilp_parts=parts(base, graph), uneven_parts=split,
                       plan=[{"devices": list(s.devices), "rows": list(s.rows), "zero": int(s.zero),
                              "recompute": s.recompute, "offload_optimizer": s.offload_optimizer}
                             for s in got.plan.stages],
                       microbatches=got.plan.microbatches)
            for p, fn in peers.items():
                try:
                    row[p] = best_peer_plan(graph, cluster, p, fn)[0].predicted.step_ms
                except InfeasibleError:
                    row[p] = None
            rows.append(row)
            shape = " | ".join(f"{','.join(s.devices)}" + (f" rows {list(s.rows)}" if s.rows else "")
                               + (f" ZeRO-{int(s.zero)}" if s.zero else "") + (" offload" if s.offload_optimizer else "")
                               for s in got.plan.stages)
            print(f"{name:11s} {cname:11s} {ilp:9.5g} {unev:10.5g} {got.chosen:>15s} "
                  + "".join(f"{row[p]:11.5g}" if row[p] else f"{'-':>11s}" for p in peers)
                  + f" {bound:9.5g} {row['target_ms']:8.5g} {floor:8.5g} "
                  + f"{row['closed'] if row['closed'] is not None else 0:7.2f} {fixed:8.5g} "
                  + f"{row['closed_fixed'] if row['closed_fixed'] is not None else 0:7.2f} "
                  + f"{charged:8.5g} {row['closed_charged'] if row['closed_charged'] is not None else 1:7.2f}  "
                  + f"{'+'.join(f'{split[k]:.4g}' for k in ('pipeline', 'sync', 'optimizer')):>20s}  "
                  + f"M={got.plan.microbatches}: {shape}", flush=True)
    write_result(args.out, t_start, {
        "benchmark": "plan_quality/uneven", "models": MODELS[:1] if args.quick else MODELS, "clusters": list(clusters),
        "time_limit_s": args.time_limit, "peers": list(peers), "notes": notes, "rows": rows})


if __name__ == "__main__":
    main()
