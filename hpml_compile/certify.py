"""A certificate for a plan: a sound lower bound on the simulated step of every plan, and how far the plan is from it.

The solver's own gap is measured on its proxy objective, over its own plan
space (stages of one kind, equal rows); the plan the driver returns is the
fastest under the simulator, perhaps from another space (uneven rows), so
that gap bounds nothing the user gets. What is printed instead is the plan's
simulated step against a lower bound on the simulated step of *every* plan
the planner can make (any stages, devices, kinds, rows, ZeRO, recompute,
offload, swap, microbatches): ``step <= (1 + X) * best``, "within X% of the
best plan under the cost model". The bounds charge only what the simulator
charges at least:

- :func:`compute_bound`: the step's compute (forward, backward, optimizer
  step) spread over every device in proportion to its speed;
- :func:`row_bound`: one row's forward and backward through the whole model;
- :func:`tight_bound`: the forward/backward phase, then the optimizer step
  (the ranks agree on the loss before any of them steps);
- :func:`fixed_bound`: each node's fixed part (a GPU's per-op cost) charged
  once per microbatch per replica, as the simulator does.

A plan with local SGD or an offloaded optimizer steps where (or when) the
phase bound does not assume, so its certificate uses the forward and backward
alone. The planner makes ZB-H1 plans too, whose path back runs each
backward's input-gradient part only (the weight-gradient part, each node's
measured share of the backward where the profile timed the split, else
:data:`hpml_compile.stagecost.WEIGHT_SHARE` of it, waits off the path), so the certificate's path terms (:func:`row_bound`,
:func:`fixed_bound` with ``split``) charge that part of each backward only:
no plan, of any schedule, beats the bound. Where no bound holds (a step of zero, a bound above the step) there is
no certificate, said as such rather than replaced by a proxy figure.

Example:
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> g = chain_graph([(1.0, 2.0)] * 4, batch_size=4)  # 12 ms of work, nothing fixed
    >>> compute_bound(g, uniform_cluster(4))
    3.0
    >>> Certificate(4.5, 3.0, "fixed-part bound").text
    'within 50.0% of the best plan under the cost model (every plan takes at least 3 ms: fixed-part bound)'
"""

from __future__ import annotations

import math

from .costgraph import CostGraph
from .ir import Certificate, Cluster
from .plan import Plan
from .stagecost import WEIGHT_SHARE

__all__ = ["Certificate", "certify", "compute_bound", "step_rate", "spread_bound", "row_bound", "optimizer_floor",
           "tight_bound", "fixed_bound", "tp_cap", "tp_limit"]


def certify(plan: Plan, graph: CostGraph) -> Certificate:
    """How far ``plan`` (simulated on ``graph``) can be from the best plan of its cluster under the cost model.

    Args:
        plan: the plan, with its simulated step.
        graph: the cost graph it was simulated on (every kind of its cluster costed).

    Returns:
        The certificate: the plan's step, the bound and its name; or no bound and why.
    """
    step = plan.predicted.step_ms
    if not step > 0:
        return Certificate(step, None, "the plan has no simulated step")
    whole = plan.sync_every == 1 and not any(st.offload_optimizer for st in plan.stages)
    bound = fixed_bound(graph, plan.cluster, optimizer=whole, split=True)  # over ZB-H1 plans too
    name = "fixed-part bound" if whole else "forward/backward bound (local SGD or an offloaded optimizer)"
    if not (bound > 0 and math.isfinite(bound)):
        return Certificate(step, None, "no positive lower bound on this graph")
    if bound > step * (1 + 1e-9):
        return Certificate(step, None, f"the bound ({bound:.4g} ms) is above the step: the cost model and the "
                                       "bound disagree")
    return Certificate(step, bound, name)


def compute_bound(graph: CostGraph, cluster: Cluster, optimizer: bool = True) -> float:
    """A lower bound on any plan's simulated step: the whole step's compute (forward, backward and optimizer
    step) spread over every device in proportion to its speed, no bubble, no communication, no replica
    repeating another's work.

    Device ``i`` doing a share ``f_i`` of the forward and backward and ``g_i`` of the optimizer step is busy
    ``f_i W_i + g_i O_i`` (``W_i``: forward + backward of the whole batch on one device of its kind, the
    simulator dividing time by ``M d`` with no loss; ``O_i``: the optimizer step over every parameter on that
    kind); the shares sum to at least 1 each, so no plan beats the least ``T`` with
    ``f_i W_i + g_i O_i <= T`` for every ``i`` (:func:`spread_bound`). Without optimizer times this is
    ``1 / sum_i 1 / W_i`` (``optimizer=False``: the forward and backward alone).
    """
    everything = graph.total("param_bytes") if optimizer else 0
    per_kind = {k: (graph.total("", kind=k), step_rate(graph, k) * everything)  # once per kind, not per device
                for k in {d.kind for d in cluster.devices}}
    return spread_bound([per_kind[d.kind] for d in cluster.devices])


def step_rate(graph: CostGraph, kind: str) -> float:
    """The least optimizer-step ms per parameter byte on ``kind`` of any plan: of the parameters one by one, or of
    a ZeRO shard's flat tensor (:meth:`hpml_compile.costgraph.CostGraph.optimizer_ms_per_byte`)."""
    return min(graph.optimizer_ms_per_byte(kind, flat) for flat in (False, True))


def spread_bound(work: list[tuple[float, float]]) -> float:
    """The least ``T`` such that two divisible jobs fit on devices whose ``i``-th takes ``work[i] = (W_i, O_i)``
    for the whole of each: ``min T`` s.t. ``f_i W_i + g_i O_i <= T``, ``sum f = sum g = 1``, ``f, g >= 0``.

    For a given ``T`` the optimizer job goes first to the devices that lose the least of the other job per
    unit of it (smallest ``O_i / W_i``), each up to ``T / O_i``; ``T`` is feasible when what is left of
    every device still covers the forward and backward. Bisection on ``T`` (a linear program this small needs
    no solver).

    >>> spread_bound([(3.0, 1.0), (3.0, 1.0)])  # two equal devices: (3 + 1) / 2
    2.0
    >>> round(spread_bound([(2.0, 0.0), (6.0, 0.0)]), 6)  # no optimizer time: 1 / (1/2 + 1/6)
    1.5
    """
    def feasible(t: float) -> bool:
        left = 1.0  # optimizer share still to place
        covered = 0.0  # forward/backward share the devices' remaining time covers
        for w, o in sorted(work, key=lambda x: x[1] / x[0]):
            g = min(left, t / o) if o > 0 else left
            left -= g
            covered += max(0.0, t - g * o) / w
        return left <= 1e-12 and covered >= 1.0

    lo, hi = 0.0, min(w + o for w, o in work)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


def _back(split: bool, graph: CostGraph | None = None, node: str = "", kind: str = "") -> float:
    """The share of a backward on a microbatch's path back: all of it, or (ZB-H1) its input-gradient part's least:
    of ``node`` on ``kind`` where the profile measured its split (:mod:`hpml_compile.profile.split`; the split's
    own cost only adds to the path, so it is left out), else :data:`hpml_compile.stagecost.WEIGHT_SHARE`'s rest."""
    if not split:
        return 1.0
    if graph is not None:
        rec = graph.node(node)
        got, full = rec.split.get(kind), rec.cost[kind][1]
        if got is not None and full > 0:
            return 1.0 - min(1.0, got[0] / full)
    return 1.0 - WEIGHT_SHARE


def row_bound(graph: CostGraph, cluster: Cluster, split: bool = False) -> float:
    """A second lower bound: one row's forward and backward through the whole model, on the fastest kind.

    A row is split between devices only by tensor parallelism: a replica trains on whole rows, at least one
    per microbatch, and a group of ``t`` ranks divides a sharded node's per-row part by ``t``, at most
    :func:`tp_limit` (its fixed part every rank pays whole). A stage is a range of the graph's order that
    runs its nodes one after another, so every row goes forward through every node and back, in order: no
    step is shorter than that chain. A node run on ``r >= 1`` of the batch's ``B`` rows costs ``fixed +
    (full - fixed) r / B`` (the simulator's rule), at least its cost at ``r = 1``, divided as above; the
    collectives tensor parallelism adds only lengthen it. This bound binds where the batch is small against
    the device count: llama-7b at batch 8 on 16 devices, where :func:`compute_bound` is half of it.
    ``split``: over ZB-H1 plans too, whose path back holds each backward's input-gradient part only (module
    docstring).
    """
    cap = tp_cap(cluster)

    def path(n: str, kind: str) -> float:
        fwd, bwd = graph.cost_at(n, kind, 1.0 / (graph.batch_size * tp_limit(graph, n, cap)))
        return fwd + _back(split, graph, n, kind) * bwd

    return min(sum(path(n, kind) for n in graph.order) for kind in {d.kind for d in cluster.devices})


def tp_cap(cluster: Cluster) -> int:
    """The most devices of one kind on one host: no tensor-parallel group is larger."""
    counts: dict[tuple[str, str], int] = {}
    for d in cluster.devices:
        counts[d.host, d.kind] = counts.get((d.host, d.kind), 0) + 1
    return max(counts.values(), default=1)


def tp_limit(graph: CostGraph, node: str, cap: int) -> int:
    """The largest tensor-parallel degree that divides part of ``node`` on a cluster whose groups hold at most
    ``cap`` devices (1: none): dividing its whole per-row part by it under-counts every plan's time, so bounds
    stay sound."""
    return max((t for t in graph.node(node).shard if t <= cap), default=1)


def optimizer_floor(graph: CostGraph, cluster: Cluster) -> float:
    """The shortest optimizer step any plan can take: every parameter byte stepped once, spread over all devices
    at the fastest kind's rate (ZeRO sharding over every device). The runtime steps only after every stage has
    synchronised (the ranks agree that the step succeeded first), so this adds to the compute bounds."""
    rate = min(step_rate(graph, k) for k in {d.kind for d in cluster.devices})
    return rate * graph.total("param_bytes") / len(cluster.devices)


def tight_bound(graph: CostGraph, cluster: Cluster, split: bool = False) -> float:
    """``max(compute_bound without the optimizer, row_bound) + optimizer_floor``, and never below
    :func:`compute_bound`: still no plan can beat it (the forward and backward, then the optimizer step, are
    phases one after the other: each term is a lower bound on its phase), and it is closer to what a plan can
    reach. The forward/backward term leaves the optimizer out so that it is not counted twice. ``split``: as
    :func:`row_bound`."""
    phases = max(compute_bound(graph, cluster, optimizer=False), row_bound(graph, cluster, split))
    return max(compute_bound(graph, cluster), phases + optimizer_floor(graph, cluster))


def fixed_bound(graph: CostGraph, cluster: Cluster, optimizer: bool = True, split: bool = False) -> float:
    """A lower bound that counts the fixed parts as the simulator does: once per microbatch per replica.

    :func:`compute_bound` spreads a node's fixed part (a GPU's per-op cost, ``cost_models.EAGER_GPU_OP_MS``)
    over the devices as if it shrank with the rows; it does not: a stage of ``d`` replicas at ``M``
    microbatches pays it ``M d`` times. Write ``x = M d`` for the stage holding node ``n`` (fixed part
    ``f_n``, per-row part ``w_n`` for the whole batch ``B``, both forward + backward on the fastest kind).
    Two phases' lower bounds hold for every plan of the solvers' space:

    - ``path``: one microbatch goes forward through every stage and back, its largest replica on at least
      ``B / x`` rows: ``sum_n f_n + w_n / x_n``;
    - ``busy``: the devices' work, ``sum_n x_n f_n + w_n``, spread over all ``D`` of them.

    The step is at least ``max(path, busy) >= l path + (1 - l) busy`` for every ``l`` in [0, 1], and at least
    the least of that over ``x_n`` in ``[1, B t_n]`` (every replica trains on at least one row per microbatch, as
    in :func:`row_bound`; ``t_n``: :func:`tp_limit`. Under tensor parallelism of ``t`` take ``x = M d t``:
    a node's path is ``f + (w_rep t + w_sh) / x >= f + w / x`` and the group's work ``x f + t w_rep + w_sh
    >= x f + w``, the same form), node by node: ``x_n = sqrt(l w_n D / ((1 - l) f_n))`` clamped. The best ``l`` is
    found by ternary search (the bound is concave in ``l``: a least of functions linear in it). ``l = 1``
    gives :func:`row_bound`, ``l = 0`` the forward and backward of :func:`compute_bound` on one kind, so on
    one kind it is at least both; the optimizer step follows (:func:`optimizer_floor`). Returned as the
    larger of that and :func:`tight_bound` (whose speed-weighted compute bound is tighter on mixed kinds).
    ``optimizer=False``: the forward and backward phases alone, no optimizer step added. ``split``: over ZB-H1
    plans too: the path charges ``f'_n + w'_n / x`` with each backward's input-gradient part only (module
    docstring), and ``x_n = sqrt(l w'_n D / ((1 - l) f_n))``.

    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> g = chain_graph([(1.0, 2.0)] * 4, batch_size=4)  # no fixed parts: the compute bound, 12 ms over 4
    >>> round(fixed_bound(g, uniform_cluster(4)), 6)
    3.0
    """
    kinds = {d.kind for d in cluster.devices}
    devices, batch, cap = len(cluster.devices), graph.batch_size, tp_cap(cluster)
    parts = []
    for n in graph.order:
        none = {k: graph.cost_at(n, k, 0.0) for k in kinds}  # (fwd, bwd): the fixed parts
        full = {k: graph.cost_at(n, k, 1.0) for k in kinds}
        back = {k: _back(split, graph, n, k) for k in kinds}
        f = min(sum(none[k]) for k in kinds)
        w = min(sum(full[k]) - sum(none[k]) for k in kinds)
        fp = min(none[k][0] + back[k] * none[k][1] for k in kinds)  # the path's (all of it, unless split)
        wp = min(full[k][0] - none[k][0] + back[k] * (full[k][1] - none[k][1]) for k in kinds)
        parts.append((f, w, fp, wp, batch * tp_limit(graph, n, cap)))

    def at(lam: float) -> float:
        total = 0.0
        for f, w, fp, wp, most in parts:
            x = math.sqrt(lam * wp * devices / ((1 - lam) * f)) if f > 0 and lam < 1 else (most if lam > 0 else 1.0)
            x = min(float(most), max(1.0, x))
            total += lam * (fp + wp / x) + (1 - lam) * (x * f + w) / devices
        return total

    lo, hi = 0.0, 1.0
    for _ in range(100):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        lo, hi = (a, hi) if at(a) < at(b) else (lo, b)
    phases = max(at(0.0), at(1.0), at((lo + hi) / 2))
    if not optimizer:  # the forward and backward alone (wherever and however the optimizer steps)
        return max(compute_bound(graph, cluster, optimizer=False), row_bound(graph, cluster, split), phases)
    return max(tight_bound(graph, cluster, split), phases + optimizer_floor(graph, cluster))
