"""Plain-text tables that explain a profile or a cost graph to a person.

Example:
    >>> from hpml_compile.ir import Profile, ProfileNode, NodeOp, NodeCost
    >>> p = Profile(model="toy", batch_size=2, dtype="float32", nodes=(
    ...     ProfileNode("x", NodeOp.PLACEHOLDER, "x", cost={"cpu": NodeCost(0, 0, True)}),
    ...     ProfileNode("fc", NodeOp.CALL_MODULE, "fc", ("x",), op_kind="matmul", flops=10**9, param_bytes=4096,
    ...                 cost={"cpu": NodeCost(3.0, 6.0, True)})))
    >>> print(profile_summary(p).splitlines()[0])
    toy: 2 nodes (fx), batch 2, float32, 1.0 K parameters, 1.00 GFLOP forward
"""

from __future__ import annotations

from .costgraph import CostGraph
from .ir import Profile

__all__ = ["profile_summary", "blocks_summary", "host_summary", "human_bytes", "human_count"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return str(int(n))


def host_summary(p: Profile, kind: str = "cpu") -> str | None:
    """One line on the machine a profile measured ``kind`` on: CPU model, caches, CPUs, threads, stream rates.

    CPU times hold on the CPU model they were measured on (a profile from an AMD EPYC predicted an
    Intel Xeon's steps 23-27% short), so a prediction is shown with where its costs came from. None when
    ``kind`` was not measured, or the profile predates these facts.

    Example:
        >>> from hpml_compile.ir import Profile
        >>> p = Profile(model="toy", batch_size=2, dtype="float32", nodes=(), threads=1, devices={"cpu": {
        ...     "measured": True, "cpu_model": "AMD EPYC", "cache_bytes": {"L2": 524288, "L3": 33554432},
        ...     "cpus": 2, "stream_gbps": 24.0, "host_stream_gbps": 33.5}})
        >>> for part in host_summary(p).split("; "):
        ...     print(part)
        profiled on AMD EPYC (L2 512.0 KiB, L3 32.0 MiB), 2 CPUs, 1 torch thread(s)
        memory stream 24.0 GB/s one thread, 33.5 GB/s the host
    """
    info = p.devices.get(kind, {})
    if not info.get("measured") or "cpu_model" not in info:
        return None
    caches = ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(info.get("cache_bytes", {}).items()))
    out = f"profiled on {info['cpu_model']}" + (f" ({caches})" if caches else "") + f", {info.get('cpus', '?')} CPUs"
    if p.threads:
        out += f", {p.threads} torch thread(s)"
    if "stream_gbps" in info:
        out += f"; memory stream {info['stream_gbps']:.1f} GB/s one thread"
        if "host_stream_gbps" in info:
            out += f", {info['host_stream_gbps']:.1f} GB/s the host"
    return out


def profile_summary(p: Profile, top: int = 5) -> str:
    """Totals per device kind, whole-model checks, and the costliest nodes."""
    params = sum(n.param_bytes for n in p.nodes) / (4 if p.dtype == "float32" else 2)
    flops = sum(n.flops for n in p.nodes)
    seq = f", seq {p.seq_len}" if p.seq_len else ""
    lines = [f"{p.model}: {len(p.nodes)} nodes ({p.front_end.value}), batch {p.batch_size}{seq}, {p.dtype}, "
             f"{human_count(params)} parameters, {flops / 1e9:.2f} GFLOP forward",
             f"  {'device kind':14s} {'fwd ms':>10s} {'bwd ms':>10s}  source"]
    host = host_summary(p)
    for kind in p.device_kinds:
        t = p.total(kind)
        if kind in p.totals:
            w = p.totals[kind]
            src = f"measured per node ({p.backward_timing.value}); whole model {w.fwd_ms:.1f} / {w.bwd_ms:.1f} ms"
        else:
            src = "predicted (" + str(p.devices.get(kind, {}).get("predicted_from", "cost_models")) + ")"
        lines.append(f"  {kind:14s} {t.fwd_ms:10.2f} {t.bwd_ms:10.2f}  {src}")
    if host:
        lines.append(f"  {host}")
    note = p.devices.get("cpu", {}).get("scale_note")
    if note:
        lines.append(f"  note: {note}")
    kind = next((k for k in p.device_kinds if k in p.totals), p.device_kinds[0] if p.device_kinds else None)
    if kind:
        ranked = sorted(p.nodes, key=lambda n: -(n.cost[kind].fwd_ms + n.cost[kind].bwd_ms))[:top]
        lines.append(f"  costliest nodes on {kind}:")
        for n in ranked:
            c = n.cost[kind]
            lines.append(f"    {n.name:28s} {n.op_kind:11s} fwd {c.fwd_ms:8.2f} ms  bwd {c.bwd_ms:8.2f} ms  "
                         f"saved {human_bytes(n.activation_bytes)}")
    return "\n".join(lines)


def blocks_summary(cg: CostGraph, limit: int = 24) -> str:
    """One line per block of a (coarsened) cost graph: time per kind, parameters, activations."""
    kinds = cg.kinds
    head = f"  {'block':16s} {'nodes':>5s} " + " ".join(f"{k + ' ms':>14s}" for k in kinds) + \
        f" {'params':>10s} {'saved act':>10s} {'out':>10s}"
    lines = [head]
    shown = cg.order if len(cg.order) <= limit else cg.order[: limit - 1]
    for name in shown:
        a = cg.node(name)
        times = " ".join(f"{sum(a.cost[k]):14.2f}" for k in kinds)
        lines.append(f"  {name[:16]:16s} {len(a.members):5d} {times} {human_bytes(a.param_bytes):>10s} "
                     f"{human_bytes(a.activation_bytes):>10s} {human_bytes(a.output_bytes):>10s}")
    if len(shown) < len(cg.order):
        lines.append(f"  ... {len(cg.order) - len(shown)} more blocks")
    lines.append(f"  {len(cg.order)} blocks, acyclic: edges only run forward in this order")
    return "\n".join(lines)
