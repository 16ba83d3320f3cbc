"""The costs a plan uses that were not measured on this machine, each named with its value and its source.

A plan's prediction mixes measured costs (a profiled kind, a timed link) with
values read from a datasheet, measured on another machine, or set by
default. A user cannot tell one from the other in a step time, so
:func:`assumptions` lists the others; ``plan`` and ``explain`` print them,
and plan.json carries them (``assumptions``):

- the speed of each device kind the profile did not measure (the catalog's
  datasheet roofline, calibrated on a measured kind where there is one);
- the per-op host cost of a GPU kind predicted that way
  (``cost_models.EAGER_GPU_OP_MS``, measured on one H100 host);
- each link between two devices that the cluster does not name, priced at
  the catalog's default (``eth100`` between hosts, NVLink or PCIe inside one);
- the share of a replicated stage's last backward that hides its gradient
  all-reduce (``GPU_OVERLAP``, ``CPU_OVERLAP``);
- the optimizer step's memory passes when no kind measured it (the AdamW
  prior of a ``--meta`` profile);
- on CPU ranks, what the runtime probe of the host
  (:mod:`hpml_compile.profile.process`) measured between two ranks and the
  plan stretches to more: the loss agreement over more than two ranks, and the
  wait for the latest of more than two replicas; or, where the profile has no
  probe figures, that nothing is priced for the wait.
- under ZB-H1, the split of each backward into its input- and weight-gradient
  parts: measured per block by the profile (:mod:`hpml_compile.profile.split`),
  a stage's taken as the sum of its blocks'; where a kind was not measured,
  ``stagecost.WEIGHT_SHARE`` and no cost of the split's own.
- a tensor-parallel stage on CPU ranks whose link has no fit of gloo's
  all-reduce in a chain of compute (``tp_reduce``: the probe of an older
  profile did not time it): its layers' all-reduces are priced on the link's
  own fit.
- for stages that run compiled, what of their times was measured compiled and
  what derived (:mod:`hpml_compile.profile.compiled`): each kind of block
  timed compiled, alone, its ratio to eager applied to the blocks' eager
  times in sequence; the fixed parts fitted at a second batch or scaled; the
  compiled call overhead not priced; the blocks that fell back to eager; or,
  where the profile timed nothing compiled, that they are priced eager.

Example:
    >>> from hpml_compile.testing import chain_profile
    >>> from hpml_compile.plan import Plan, Schedule, Stage
    >>> from hpml_compile.ir import Cluster, Device
    >>> c = Cluster(devices=(Device("g0", "A100-80GB", 80, "h0"), Device("g1", "A100-80GB", 80, "h1")))
    >>> prof = chain_profile([{"A100-80GB": (1.0, 2.0)}])
    >>> p = Plan("toy", c, Schedule.ONE_F_ONE_B, 1, (Stage(0, ("g0", "g1"), ("n0",)),))
    >>> [a.name for a in assumptions(p, prof)]  # the toy profile measured nothing
    ['A100-80GB speed', 'per-op host cost on a GPU', 'link A100-80GB - A100-80GB between hosts', 'gradient all-reduce overlap on GPUs']
"""

from __future__ import annotations

import cost_models

from .cluster import CPU_OVERLAP, GPU_OVERLAP, link_spec
from .ir import Assumption, Cluster, Device, Profile, base_kind
from .plan import Plan, Schedule
from .stagecost import WEIGHT_SHARE

__all__ = ["assumptions", "format_assumptions"]


def assumptions(plan: Plan, prof: Profile, *, compiled: bool = False) -> tuple[Assumption, ...]:
    """The costs ``plan`` uses that were not measured on this machine (module docstring).

    Args:
        plan: the plan (its cluster and stages: only what it uses is listed).
        prof: the profile it was planned from, with every kind of the cluster costed (measured or predicted).
        compiled: the plan's stages run compiled (priced with the profile's compiled times where it has them).

    Returns:
        One assumption per cost, in the order of the module docstring.
    """
    used = [plan.cluster.device(d) for st in plan.stages for d in st.devices]
    return (*_speeds(used, prof), *_links(plan.cluster, used), *_overlaps(plan), *_optimizer(prof),
            *_replicated_steps(plan, prof), *_split(plan, prof), *_tensor_parallel(plan),
            *(_compiled(used, prof) if compiled else ()))


def format_assumptions(items: tuple[Assumption, ...], limit: int = 8) -> str:
    """A short block for a person: one line per assumption (``limit`` at most, then how many more)."""
    if not items:
        return "assumed: nothing (every cost the plan uses was measured here)"
    lines = ["assumed (not measured on this machine):"]
    lines += [f"  {a.name}: {a.value} ({a.source})" for a in items[:limit]]
    if len(items) > limit:
        lines.append(f"  ... and {len(items) - limit} more in plan.json's assumptions")
    return "\n".join(lines)


def _speeds(used: list[Device], prof: Profile) -> list[Assumption]:
    out, gpu_predicted, op_ms = [], False, set()
    for kind in sorted({d.kind for d in used}):
        info = prof.devices.get(kind, {})
        if info.get("measured", False):
            continue
        try:
            spec = cost_models.get_device(base_kind(kind))
        except cost_models.UnknownDeviceKind:
            out.append(Assumption(f"{kind} speed", "as the profile gives it", "the profile; not measured here"))
            continue
        if spec.category is cost_models.DeviceCategory.GPU:
            gpu_predicted = True
            op_ms.add(info.get("op_ms"))
        dtype = prof.precision.dtype if prof.precision.is_mixed else prof.dtype  # what prices its nodes
        flops = spec.peak_flops.get(dtype, 0.0) / 1e12
        out.append(Assumption(f"{kind} speed", f"{flops:g} TFLOP/s peak in {dtype}, {spec.mem_bw / 1e9:.0f} GB/s "
                                               "memory",
                              f"{info.get('predicted_from', 'datasheet roofline')}; {spec.source or 'catalog'}"))
    if gpu_predicted and op_ms - {None}:  # the profile's predictions were given another per-op cost
        out.append(Assumption("per-op host cost on a GPU", ", ".join(f"{x * 1e3:g} us an op" for x in sorted(op_ms - {None})),
                              "given when the profile's GPU costs were predicted (compiled stages: fewer, fused "
                              "launches), not measured"))
    if gpu_predicted and None in op_ms:
        out.append(Assumption("per-op host cost on a GPU", f"{cost_models.EAGER_GPU_OP_MS * 1e3:.0f} us an op",
                              "cost_models.EAGER_GPU_OP_MS, measured on one H100 host, not on this machine"))
    return out


def _links(cluster: Cluster, used: list[Device]) -> list[Assumption]:
    """The catalog defaults the plan's devices talk over where the cluster names no link between them."""
    named = {frozenset((x.a, x.b)) for x in cluster.links}
    groups: dict[tuple[str, str], Device] = {}
    for d in used:
        groups.setdefault((d.host, d.kind), d)
    members: dict[tuple[str, str], list[str]] = {}
    for d in used:
        members.setdefault((d.host, d.kind), []).append(d.name)
    found: dict[tuple[str, str, bool], str] = {}
    keys = sorted(groups)
    for i, g in enumerate(keys):
        for h in keys[i:]:
            same = g[0] == h[0]
            pair = (*sorted((g[1], h[1])), same)
            if pair in found or not _unnamed(members[g], members[h], named):
                continue
            spec = link_spec(cluster, *_two(members[g], members[h]))
            hosts = cluster.host(g[0]) is not None and (cluster.host(h[0]) is not None or same)
            found[pair] = (f"{spec.name}, {spec.gbps:g} GB/s, {spec.latency_us:g} us",  # type: ignore[index]
                           "from the cluster's hosts (fabric, network cards), catalog speeds" if hosts and
                           spec.source.endswith("(cluster.json hosts)") or (hosts and same and cluster.host(g[0]).fabric)
                           else "the catalog's default: the cluster names no link between these devices")
    return [Assumption(f"link {a} - {b} {'on one host' if same else 'between hosts'}", value, source)
            for (a, b, same), (value, source) in sorted(found.items())]


def _two(a: list[str], b: list[str]) -> tuple[str, str]:
    """Two different devices, one of each list (the lists may be one group)."""
    return (a[0], a[1]) if a is b or a == b else (a[0], b[0])


def _unnamed(a: list[str], b: list[str], named: set[frozenset[str]]) -> bool:
    """Whether some pair of different devices of ``a`` and ``b`` has no link of its own in the cluster."""
    if a == b and len(a) < 2:
        return False
    if not named:
        return True
    return any(x != y and frozenset((x, y)) not in named for x in a for y in b)


def _overlaps(plan: Plan) -> list[Assumption]:
    replicated = [st for st in plan.stages if len(st.devices) > 1]
    cpu = any(plan.cluster.device(d).is_cpu for st in replicated for d in st.devices)
    gpu = any(not plan.cluster.device(d).is_cpu for st in replicated for d in st.devices)
    out = []
    if gpu:
        out.append(Assumption("gradient all-reduce overlap on GPUs", f"{GPU_OVERLAP:g} of the last backward",
                              "hpml_compile.cluster.GPU_OVERLAP: NCCL on its own stream, the documented default "
                              "(Li et al., VLDB 2020); not measured here"))
    if cpu:
        out.append(Assumption("gradient all-reduce overlap on CPUs", f"{CPU_OVERLAP:g} of the last backward",
                              "hpml_compile.cluster.CPU_OVERLAP: set from runs on one 2-core machine, where gloo "
                              "shares the cores the backward runs on; not measured on this one"))
    return out


def _optimizer(prof: Profile) -> list[Assumption]:
    if not prof.optimizer or not prof.parameters:
        return []
    measured = [k for k, ms in prof.optimizer_ms.items() if ms > 0 and prof.devices.get(k, {}).get("measured")]
    if measured:
        return []
    return [Assumption(f"optimizer step ({prof.optimizer})", "12 memory passes over the parameter bytes",
                       "a prior count of what the optimizer reads and writes, not a measurement: no kind of "
                       "the profile timed it (a --meta profile times nothing)")]


def _replicated_steps(plan: Plan, prof: Profile) -> list[Assumption]:
    """The probe's two-rank figures where the plan uses them beyond two ranks, or their absence."""
    cpus = [plan.cluster.device(d) for st in plan.stages for d in st.devices]
    if len(cpus) < 2 or not all(d.is_cpu for d in cpus):
        return []
    probe = [prof.devices.get(d.kind, prof.devices.get(base_kind(d.kind), {})).get("process") or {} for d in cpus]
    widest = max(st.replicas for st in plan.stages)
    if not all("skew_ms" in x for x in probe):
        return [Assumption("replicas' wait at the gradient sync", "0 ms (not priced)",
                           "the profile has no runtime probe of this host (hpml_compile.profile.process)")] \
            if widest > 1 else []
    out = []
    if len(cpus) > 2:
        out.append(Assumption("loss agreement over more than two CPU ranks", f"ceil(log2 {len(cpus)}) rounds of "
                              "the two-rank figure", "measured between two ranks of this host; more ranks not "
                              "measured (hpml_compile.stagecost.measured_agree_ms)"))
    if widest > 2:
        out.append(Assumption(f"wait for the latest of {widest} CPU replicas", "the two-rank skew times the "
                              "expected maximum of normal draws", "measured between two ranks of this host; more "
                              "replicas not measured (hpml_compile.stagecost.skew_wait_ms)"))
    return out
def _split(plan: Plan, prof: Profile) -> list[Assumption]:
    """ZB-H1's split of each backward: measured per block by the profile (the stage's the sum of its blocks'), or
    where a kind the plan uses was not measured, :data:`hpml_compile.stagecost.WEIGHT_SHARE` and no cost of its
    own."""
    if plan.schedule is not Schedule.ZB_H1:
        return []
    kinds = sorted({plan.cluster.device(d).kind for st in plan.stages for d in st.devices})
    facts = [(prof.devices.get(k) or {}).get("split") or {} for k in kinds]
    if kinds and all(f.get("blocks") for f in facts):
        shares = [b[1] for f in facts for b in f["blocks"]]
        extra = max(sum(b[2] for b in f["blocks"]) for f in facts)
        return [Assumption("backward split (zb-h1)",
                           f"weight-gradient part {min(shares):.2f}-{max(shares):.2f} of a block's backward, the "
                           f"split's own cost {extra:.3g} ms per microbatch over the whole model",
                           f"measured per block at {facts[0].get('rows')} rows, each block alone "
                           "(hpml_compile.profile.split); a stage's is the sum of its blocks'")]
    return [Assumption("backward split (zb-h1)",
                       f"weight-gradient part = {WEIGHT_SHARE:g} of each backward's compute, input-gradient part the "
                       "rest with the tensor-parallel collectives; the split's own cost not priced",
                       "assumed: the profile did not time the split on "
                       + ", ".join(k for k, f in zip(kinds, facts) if not f.get("blocks")))]


def _tensor_parallel(plan: Plan) -> list[Assumption]:
    """The link's own fit where it prices the layers' all-reduces of a CPU stage with ``tp > 1``."""
    for st in plan.stages:
        group = st.tp_groups()[0] if st.tp > 1 else ()
        if not group or not all(plan.cluster.device(d).is_cpu for d in group):
            continue
        spec = link_spec(plan.cluster, group[0], group[1])
        if not any(op == "tp_reduce" for op, _, _ in spec.collectives):
            return [Assumption("tensor-parallel all-reduce on CPU ranks",
                               f"the link's own fit, {spec.gbps:g} GB/s, {spec.latency_us:g} us",
                               "gloo's all-reduce in a chain of compute, as a layer runs it, was not timed on this host "
                               "(hpml_compile.profile.links.TP_REDUCE): the link's fit of transfers in a loop")]
    return []


def _compiled(used: list[Device], prof: Profile) -> list[Assumption]:
    """What of a compiled stage's time was measured compiled and what derived, per measured kind the plan uses."""
    out = []
    for kind in sorted({d.kind for d in used}):
        info = prof.devices.get(kind, prof.devices.get(base_kind(kind), {}))
        if not info.get("measured"):
            continue  # a predicted kind: its speed is listed above
        facts = info.get("compiled")
        if not facts:
            out.append(Assumption(f"compiled stages on {kind}", "priced at their eager times",
                                  "the profile timed no block compiled (profile(compiled=True) times them)"))
            continue
        rows = facts.get("rows", [])
        out.append(Assumption(
            f"compiled stages on {kind}",
            f"{facts.get('distinct', 0)} kind(s) of block timed compiled (of {facts.get('blocks', 0)} blocks); each "
            "block's eager time in sequence times its compiled/eager ratio",
            "measured here: each kind of block compiled by torch.compile (inductor) and timed alone against its eager "
            "run; derived: the ratio applied to the blocks timed in sequence, identical blocks given their first's"))
        out.append(Assumption(
            f"compiled fixed parts on {kind}",
            f"fitted at {rows[1]} and {rows[0]} rows" if len(rows) > 1 else "the eager fixed parts times the ratio",
            "measured compiled at both batches" if len(rows) > 1 else "derived: no second batch timed compiled"))
        out.append(Assumption(
            f"compiled call overhead on {kind}",
            f"{facts.get('call_fwd_ms', 0.0) * 1e3:.0f} us forward, {facts.get('call_bwd_ms', 0.0) * 1e3:.0f} us "
            "backward per microbatch: not priced",
            "measured on a trivial compiled function and taken off each block; a stage pays it once per graph"))
        for name, why in sorted(facts.get("fallbacks", {}).items()):
            out.append(Assumption(f"block {name} on {kind}", "priced at its eager times",
                                  f"torch.compile failed on it when profiling: {why}"))
    return out
