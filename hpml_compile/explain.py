"""Explain a plan in words: its cost graph split at the stages, the bottleneck, memory slack, one more device.

:func:`summary` is the text ``hpml-compile show`` prints and the demo prints
after compiling; :func:`plan_costgraph` is the cost graph both of them (and
the pictures of :mod:`hpml_compile.viz`) simulate a saved plan on. They are
library functions, not a command, so they live here rather than in
:mod:`hpml_compile.cli`; they are not in :mod:`hpml_compile.viz` because they
draw nothing (text and a re-solve, no matplotlib or graphviz), and viz.py is
long enough.

Example:
    >>> from hpml_compile.testing import chain_graph, uniform_cluster
    >>> from hpml_compile.plan import Plan, Stage, Schedule
    >>> from hpml_compile.simulate import simulate
    >>> g = chain_graph([(2.0, 4.0), (2.0, 4.0)], kind="cpu", output_bytes=2**20)
    >>> st = (Stage(0, ("d0",), ("n0",)), Stage(1, ("d1",), ("n1",)))
    >>> plan = Plan("toy", uniform_cluster(2), Schedule.ONE_F_ONE_B, 2, st)
    >>> summary(plan, g, simulate(plan, g)).splitlines()[3]
    'stages (times per microbatch):'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .costgraph import CostGraph, build
from .errors import HpmlError
from .ir import Cluster, Device, Precision, Profile
from .memory import GiB
from .plan import Plan, Stage
from .simulate import SimResult, agreement_rides, bookkeeping_ms, boundary_copies, crowded_devices, loss_agreement_ms
from .solve import SolverName
from .cluster import hierarchy
from .plan import AllReduce
from .assumptions import format_assumptions
from .report import human_bytes
from .stagecost import level_bytes
from .viz import allreduce_label, chunk_text, device_names, device_order

__all__ = ["plan_costgraph", "WhatIf", "one_more_device", "base_solver", "summary", "tp_lines"]


def plan_costgraph(plan: Plan, profile: Profile) -> CostGraph:
    """The profile's coarsened cost graph, with any block that spans stages split at the stage boundary.

    Args:
        plan: the plan.
        profile: the profile it was made for.

    Returns:
        A cost graph each of whose nodes lies in one stage (what the simulator and the picture need).

    Raises:
        HpmlError: if the plan's nodes are not exactly the profile's.
    """
    where = {n: st.index for st in plan.stages for n in st.nodes}
    names = [n.name for n in profile.nodes]
    missing, extra = [n for n in names if n not in where], sorted(set(where) - set(names))
    if missing or extra:
        raise HpmlError(f"show: the plan does not match the profile of {profile.model}: "
                        f"{len(missing)} profile nodes in no stage (e.g. {missing[:3]}), {len(extra)} plan nodes "
                        f"not in the profile (e.g. {extra[:3]}); pass the profile the plan was made for")
    fine = build(profile)
    coarse = fine.coarsen()
    groups: list[list[str]] = []
    keys: list[str] = []
    for v in coarse.order:
        members = list(coarse.node(v).members)
        start = len(groups)
        for m in members:  # split a block where the stage changes
            if len(groups) > start and where[groups[-1][-1]] == where[m]:
                groups[-1].append(m)
            else:
                groups.append([m])
                keys.append(v)
    return coarse if len(groups) == len(coarse.order) else fine.merge(groups, keys)


@dataclass(frozen=True, slots=True)
class WhatIf:
    """The plan re-solved with one more device.

    Attributes:
        device: the device added.
        plan: the new plan, or None when the re-solve failed.
        note: why it failed, or empty.
    """

    device: Device
    plan: Plan | None
    note: str = ""


def _new_name(cluster: Cluster, like: str) -> str:
    stem = re.sub(r"\d+$", "", like) or "dev"
    used = {d.name for d in cluster.devices}
    i = len(cluster.devices)
    while f"{stem}{i}" in used:
        i += 1
    return f"{stem}{i}"


def one_more_device(plan: Plan, result: SimResult, plan_on: Callable[[Cluster], Plan]) -> WhatIf:
    """``plan``'s cluster with one more device of its bottleneck stage's kind (same host, same memory),
    planned by ``plan_on``.

    ``plan_on`` is the caller's way to plan (``show`` passes :func:`hpml_compile.driver.plan` with the plan's
    solver, schedule and microbatch count), so the new plan goes through every step a plan does (uneven rows,
    the cores rule, the checks) and its figure is the one ``plan`` would print for that cluster: the
    difference is the device's alone.

    Args:
        plan: the plan.
        result: its simulation (for the bottleneck).
        plan_on: plans the model on a cluster.

    Returns:
        The added device and the new plan (or why there is none).
    """
    like = plan.cluster.device(plan.stages[result.bottleneck_stage].devices[0])
    dev = Device(_new_name(plan.cluster, like.name), like.kind, like.memory_gib, like.host)
    bigger = Cluster(devices=(*plan.cluster.devices, dev), links=plan.cluster.links,
                     name=f"{plan.cluster.name}+1x{like.kind}", hosts=plan.cluster.hosts)
    try:
        new = plan_on(bigger)
    except HpmlError as e:  # nothing fits, or the profile does not serve the bigger cluster: said, not raised
        return WhatIf(dev, None, str(e).splitlines()[0])
    return WhatIf(dev, new)


def base_solver(plan: Plan) -> str:
    """The solver that made ``plan`` (``portfolio+uneven:merge`` was made by ``portfolio``, as was a plan that
    names it ``ilp``); ``portfolio`` for one the package does not know."""
    try:
        return SolverName(plan.solver.name.split("+")[0]).value
    except ValueError:
        return SolverName.PORTFOLIO.value


def _precision(plan: Plan) -> str:
    p = plan.precision
    wire = "" if plan.reduce_dtype is Precision.FP32 else f", gradients reduced in {plan.reduce_dtype.dtype}"
    if not p.is_mixed:
        return "fp32" + wire
    return (f"{p.value} (autocast to {p.dtype}, fp32 master weights and optimizer state, boundaries in {p.dtype}"
            + (", loss scaling" if p.value == "fp16" else "") + wire + ")")


def _level_text(plan: Plan, st: Stage, graph: CostGraph, blocks: list[str]) -> str:
    """Bytes one device sends per step at each level of a hierarchical all-reduce, against the flat ring."""
    nbytes = sum(graph.node(v).param_bytes for v in blocks)
    lv = level_bytes(nbytes, len(st.devices), hierarchy(plan.cluster, st.devices))
    flat = level_bytes(nbytes, len(st.devices), None)["flat"]
    return (f"{human_bytes(lv['inter'])} between hosts + {human_bytes(lv['intra'])} inside per device and step "
            f"(flat ring: {human_bytes(flat)}, its slowest link between hosts)")


def _host_sharing(plan: Plan, graph: CostGraph, result: SimResult) -> list[str]:
    """Where CPU ranks of one host slow each other (:mod:`hpml_compile.simulate`): the stages whose microbatches
    take longer than alone, and the hosts with more ranks than cores."""
    slowed = [(st.index, x) for st, x in zip(plan.stages, result.contention) if x > 1.01]
    if not slowed:
        return []
    ranks: dict[str, list[str]] = {}
    for st in plan.stages:
        for d in st.devices:
            dev = plan.cluster.device(d)
            if dev.is_cpu:
                ranks.setdefault(dev.host, []).append(dev.kind)
    crowded = [f"{host} runs {len(kinds)} ranks on {cores} cores" for host, kinds in ranks.items()
               for cores in [graph.host_cores(kinds[0])] if cores and len(kinds) > cores]
    measured = [f"{kind}'s blocks ran x{c[0]:.2f} forward, x{c[1]:.2f} backward with {c[2]} processes at once"
                for kind in dict.fromkeys(k for kinds in ranks.values() for k in kinds)
                for c in [graph.corun(kind)] if c]
    return ["  sharing a host: " + ", ".join(f"stage {i} x{x:.2f}" for i, x in slowed)
            + " as long per microbatch as alone (CPU ranks of a host share its memory bandwidth"
            + (f", and its cores: {'; '.join(crowded)}" if crowded else "")
            + (f"; measured by the profile: {'; '.join(measured)}" if measured else "") + ")"]


def _shared_memory(plan: Plan, st: Stage) -> str:
    """What of this stage's gradient sync the runtime runs through shared memory (``runtime.sync.shm``), as an option
    of its line: between CPU devices of one host, the flat all-reduce (ZeRO-0), the reduce-scatter and the
    parameter all-gather (ZeRO-1/2), the reduce-scatter (ZeRO-3, which gathers through gloo)."""
    devs = [plan.cluster.device(d) for d in st.devices]
    if (len(devs) < 2 or st.compress or st.allreduce is not AllReduce.FLAT or not all(d.is_cpu for d in devs)
            or len({d.host for d in devs}) > 1):
        return ""
    what = {0: "all-reduce", 1: "reduce-scatter and all-gather", 2: "reduce-scatter and all-gather",
            3: "reduce-scatter"}[int(st.zero)]
    return f", {what} through the host's shared memory"


def _idle_cpus(plan: Plan, graph: CostGraph) -> list[str]:
    """The CPU devices no stage uses on hosts with more CPU devices than cores (:func:`hpml_compile.simulate.
    crowded_devices`): what the driver leaves idle on purpose (:func:`hpml_compile.driver.within_cores`), said so
    that ``show`` explains them."""
    used = {d for st in plan.stages for d in st.devices}
    out = []
    for host in dict.fromkeys(plan.cluster.device(n).host for n in crowded_devices(plan.cluster, graph)):
        names = [d.name for d in plan.cluster.devices if d.is_cpu and d.host == host]
        idle = [n for n in names if n not in used]
        cores = graph.host_cores(plan.cluster.device(names[0]).kind)
        if idle:
            out.append(f"  idle: {', '.join(idle)} (no stage uses them; {host} has {cores} cores for {len(names)} "
                       "CPU devices, and ranks beyond its cores would share them; --every-device gives every "
                       "device work)")
    return out


def tp_lines(plan: Plan, graph: CostGraph, most: int = 6) -> list[str]:
    """What the plan's tensor-parallel stages shard and what they keep whole, and why (empty: no stage has
    ``tp > 1``).

    Args:
        plan: the plan.
        graph: its cost graph (its :attr:`~hpml_compile.costgraph.CostGraph.tensor_parallel`).
        most: the most layers named per kind of line.

    Returns:
        Lines of text.
    """
    tp = graph.tensor_parallel
    stages = [st for st in plan.stages if st.tp > 1]
    if not stages:
        return []
    out = []
    for st in stages:
        members = set(st.nodes)
        units = [u for u in tp.units if members.intersection(u.nodes)]
        kinds = {k: sum(1 for u in units if u.kind == k and u.max_tp >= st.tp) for k in dict.fromkeys(u.kind for u in units)}
        whole = [u for u in units if u.max_tp < st.tp]
        out.append(f"  tensor parallel, stage {st.index} (tp {st.tp}, groups {', '.join(map(device_names, st.tp_groups()[:2]))}"
                   f"{', ...' if st.replicas > 2 else ''}): sharded "
                   + ", ".join(f"{n} {k}" for k, n in kinds.items() if n) + "; two all-reduces per attention and MLP "
                   "unit per pass (one forward, one backward), the embedding's output all-reduced and the LM head's "
                   "logits all-gathered; norms and residuals replicated")
        for u in whole[:most]:
            out.append(f"    kept whole at tp {st.tp}: {u.scope} ({u.kind}): its split sizes allow at most tp {u.max_tp}")
    for a, b in zip(plan.stages, plan.stages[1:]):
        if a.tp == b.tp:
            continue
        fwd, bwd = boundary_copies(a.tp, b.tp)
        how = (f"forward from {b.tp} of the {a.tp} places of each group of stage {a.index}, the gradient back to "
               f"every place ({bwd} copies from each rank of stage {b.index})") if a.tp > b.tp else (
               f"forward to every place of stage {b.index}'s groups ({fwd} copies from each rank of stage {a.index}), "
               f"the gradient back from {a.tp} of its {b.tp} places")
        out.append(f"  tensor parallel, boundary {a.index} -> {b.index} (tp {a.tp} -> {b.tp}): whole tensors, {how}")
    for scope, why in tp.unmatched[:most]:
        out.append(f"  tensor parallel: {scope} keeps tp 1: {why}")
    if len(tp.unmatched) > most:
        out.append(f"  tensor parallel: {len(tp.unmatched) - most} more layers keep tp 1")
    return out


def summary(plan: Plan, graph: CostGraph, result: SimResult, what_if: WhatIf | None = None) -> str:
    """A text explanation of the plan: stages, the bottleneck and why, memory slack, one more device.

    Args:
        plan: the plan.
        graph: its cost graph.
        result: its simulation.
        what_if: the re-solve with one more device, if done.

    Returns:
        Lines of text.
    """
    so, m = plan.solver, plan.microbatches
    lines = [f"{plan.model} on {plan.cluster.name} ({len(plan.cluster.devices)} devices): {len(plan.stages)} "
             f"stages, {m} microbatches, {plan.schedule.value}"
             + (f" ({plan.chunks} chunks on each of {len(plan.stages) // plan.chunks} device groups: stage k runs on "
                f"stage k % {len(plan.stages) // plan.chunks}'s devices)" if plan.chunks > 1 else "")
             + f", {_precision(plan)}; solver {so.name} "
             f"{so.status.value} in {so.seconds:.2f} s",
             (plan.certificate.text if plan.certificate is not None else "no certificate (the plan carries none)"),
             f"predicted step {result.step_ms:.4g} ms, bubble {result.bubble:.1%} (idle share of the pipeline)",
             "stages (times per microbatch):"]
    for st, c in zip(plan.stages, result.stages):
        kinds = [plan.cluster.device(d).kind for d in st.devices]
        opts = "".join([f", tensor parallel {st.tp} x {st.replicas} replicas" if st.tp > 1 else "",
                        f", ZeRO-{int(st.zero)}" if st.zero else "", ", recompute" if st.recompute else "",
                        f", swap {len(st.swap)} nodes" if st.swap else "",
                        ", optimizer offload" if st.offload_optimizer else "",
                        f", gradients {st.compress}" if st.compress else "",
                        f", holds back at most {st.max_deferred} of ZB-H1's {st.index} weight-gradient parts "
                        "(its memory)" if st.max_deferred is not None else "",
                        f", local SGD every {plan.sync_every} steps after {plan.sync_warmup}"
                        if plan.sync_every > 1 and len(st.devices) > 1 else "",
                        _shared_memory(plan, st),
                        f", {chunk_text(plan, st)}" if plan.chunks > 1 else ""])
        members = set(st.nodes)
        blocks = [v for v in graph.order if members.intersection(graph.node(v).members)]
        if st.allreduce is AllReduce.HIERARCHICAL:
            opts += f", {allreduce_label(plan, st)}: {_level_text(plan, st, graph, blocks)}"
        span = f"{blocks[0]} .. {blocks[-1]}" if len(blocks) > 1 else (blocks[0] if blocks else "-")
        send = sum(ms for _, ms in c.sends)
        kind_text = " + ".join(f"{kinds.count(k)} x {k}" for k in dict.fromkeys(kinds))
        lines.append(f"  stage {st.index}: {device_names(st.devices)}: {kind_text}{opts}; "
                     f"{len(blocks)} blocks {span}; fwd {c.fwd_ms:.3g} + bwd {c.bwd_ms + c.recompute_ms:.3g} ms"
                     + (f", send {send:.3g} ms" if send else "") + (f", sync {c.sync_ms:.3g} ms" if c.sync_ms else "")
                     + (f", parameter all-gather {c.gather_ms:.3g} ms after the optimizer step" if c.gather_ms else ""))
        if st.rows:  # uneven data parallelism: each replica's rows and its own time per microbatch
            own = c.replica_ms or ((c.fwd_ms, c.bwd_ms),) * len(st.devices)
            lines.append("    uneven rows per microbatch: " + ", ".join(
                f"{d} {r} ({f + b:.3g} ms)" for d, r, (f, b) in zip(st.devices, st.rows, own)))
    for stages, ms in result.tied_ms:  # the gradients of parameters shared by several stages
        devs = [d for k in stages for d in plan.stages[k].devices]
        hier = hierarchy(plan.cluster, devs) if plan.tied_allreduce is AllReduce.HIERARCHICAL else None
        how = f"hierarchical all-reduce ({len(hier.hosts)} hosts x {hier.per_host})" if hier else "flat all-reduce"
        lines.append(f"  tied parameters of stages {', '.join(map(str, stages))}: {how} over {len(devs)} devices, "
                     f"{ms:.3g} ms")
    if result.agree_ms > 0:  # the runtime's loss all-reduce (with the batch check) before any optimizer step
        devs = list(dict.fromkeys(d for st in plan.stages for d in st.devices))  # interleaved: chunks share them
        ranks = len(devs)
        measured = loss_agreement_ms(plan.cluster, devs, graph) != loss_agreement_ms(plan.cluster, devs)
        lines.append(f"  loss agreement: one 32-byte all-reduce over the {ranks} ranks before the optimizer steps, "
                     f"{result.agree_ms:.3g} ms" + (" (as two ranks of this host measured it)" if measured else ""))
    elif agreement_rides(plan) and any(c.sync_ms > 0 for c in result.stages):
        lines.append("  loss agreement: its 32 bytes ride the gradient sync, summed with the gradients as one float64 "
                     "all-reduce (the ranks meet once a step)" if any(c.ride_in_ms > 0 for c in result.stages) else
                     "  loss agreement: its 32 bytes ride the gradient sync's meeting (the ranks meet once a step)")
    for k, wait in enumerate(result.skew_ms):  # replicas reach the sync apart: the step waits for the latest
        if wait > 0:
            lines.append(f"  stage {k} waits {wait:.3g} ms a step for its latest replica before its gradient sync, and "
                         "meets it there (two ranks' skew and meeting as measured on this host, beyond the link's "
                         "latency)")
    keep = bookkeeping_ms(plan, graph, result.stages)
    if keep > 0:  # what Pipeline.step does besides the parts above, as the host probe measured it
        lines.append(f"  runtime bookkeeping: {keep:.2g} ms a step (the batch check, host sampling and memory counting "
                     "around the executor, and its own work between the parts it times; measured on this host)")
    lines += tp_lines(plan, graph)
    lines += _host_sharing(plan, graph, result)
    lines += _idle_cpus(plan, graph)
    b = result.bottleneck_stage
    bc = result.stages[b]
    mean = sum(c.compute_ms for c in result.stages) / len(result.stages)
    bst = plan.stages[b]
    pipe = (m - 1) * bc.compute_ms
    lines.append(f"bottleneck: stage {b} on {device_names(bst.devices)} "
                 f"({plan.cluster.device(bst.devices[0]).kind}): {bc.compute_ms:.3g} ms of compute per microbatch"
                 f"{' (with recompute)' if bst.recompute else ''}, {bc.compute_ms / mean - 1:+.0%} against the "
                 f"mean stage; in steady state every stage waits for it: (M-1) x {bc.compute_ms:.3g} = "
                 f"{pipe:.4g} ms of the {result.step_ms:.4g} ms step")
    lines += _memory_lines(plan, result)
    if what_if is not None:
        lines.append(_what_if_line(what_if, result))
    lines.append(format_assumptions(plan.assumptions) if plan.assumptions else
                 "assumed: not recorded in this plan (plan it again to list the costs not measured here)")
    return "\n".join(lines)


def _memory_lines(plan: Plan, result: SimResult) -> list[str]:
    """:func:`summary`'s memory lines: each device's (or, on a large cluster, each stage's) peak against its
    capacity."""
    lines = ["memory (peak per device, against capacity):"]
    stage_of: dict[str, int] = {}
    for st in plan.stages:
        for name in st.devices:
            stage_of.setdefault(name, st.index)  # interleaved 1F1B: a device's first chunk names its group
    groups: list[list[str]] = [[d] for d in device_order(plan)]
    if len(plan.cluster.devices) > 16:  # a stage's replicas hold the same bytes: one line per stage
        groups = [list(st.devices) for st in plan.stages[:len(plan.stages) // plan.chunks]]
        unused = [d.name for d in plan.cluster.devices if d.name not in stage_of]
        groups += [[d for d in unused if plan.cluster.device(d).kind == k]
                   for k in dict.fromkeys(plan.cluster.device(d).kind for d in unused)]
    for names in groups:
        d = plan.cluster.device(names[0])
        peak = result.peak.get(names[0], 0)
        slack = d.memory_bytes - peak
        first = stage_of.get(names[0])
        where = "unused" if first is None else f"stage {first}" if plan.chunks == 1 else \
            "stages " + ",".join(map(str, range(first, len(plan.stages), len(plan.stages) // plan.chunks)))
        each = " each" if len(names) > 1 else ""
        lines.append(f"  {device_names(names):20s} {d.kind:12s} {where:9s} peak {peak / GiB:8.2f} GiB of "
                     f"{d.memory_gib:7.1f} GiB{each}  slack {slack / GiB:8.2f} GiB ({slack / d.memory_bytes:.0%})")
    return lines


def _what_if_line(what_if: WhatIf, result: SimResult) -> str:
    """:func:`summary`'s line on one more device: the plan that would use it, or why none would."""
    extra = what_if.device
    head = f"one more device: + {extra.name} ({extra.kind}, {extra.memory_gib:g} GiB, host {extra.host})"
    if what_if.plan is None:
        return f"{head}: no plan ({what_if.note})"
    new = what_if.plan
    delta = new.predicted.step_ms / result.step_ms - 1 if result.step_ms else 0.0
    used = len({d for s in new.stages for d in s.devices})
    why = "" if delta < -1e-9 else f"; no better plan uses it ({used} of {len(new.cluster.devices)} devices used)"
    return (f"{head}: predicted step {new.predicted.step_ms:.4g} ms ({delta:+.1%}), "
            f"{len(new.stages)} stages, degrees {[len(s.devices) for s in new.stages]}, bottleneck "
            f"stage {new.predicted.bottleneck_stage}, bubble {new.predicted.bubble:.1%} "
            f"({new.solver.name} {new.solver.status.value}, same schedule and microbatches){why}")
