"""Small hand-made profiles, cost graphs and clusters for examples, tests and benchmarks.

Example:
    >>> g = chain_graph([{"fast": (1.0, 2.0), "slow": (2.0, 4.0)}] * 3)
    >>> g.order, g.kinds
    (('n0', 'n1', 'n2'), ('fast', 'slow'))
    >>> [d.name for d in uniform_cluster(2).devices]
    ['d0', 'd1']
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..costgraph import CostGraph, build
from ..ir import Cluster, Device, Link, NodeCost, NodeOp, Profile, ProfileNode

__all__ = ["chain_profile", "chain_graph", "dag_profile", "uniform_cluster", "cluster_of"]

Cost = tuple[float, float] | Mapping[str, tuple[float, float]]


def _cost(c: Cost, kind: str) -> dict[str, NodeCost]:
    per = c if isinstance(c, Mapping) else {kind: c}
    return {k: NodeCost(float(f), float(b), False) for k, (f, b) in per.items()}


def dag_profile(costs: Sequence[Cost], inputs: Sequence[Sequence[int]], *, kind: str = "cpu",
                param_bytes: int | Sequence[int] = 0, activation_bytes: int | Sequence[int] = 0,
                output_bytes: int = 0, batch_size: int = 1024, model: str = "toy") -> Profile:
    """A profile of nodes ``n0..`` where node ``i`` reads the nodes ``inputs[i]`` (all ``< i``).

    Args:
        costs: per node, ``(fwd_ms, bwd_ms)`` on ``kind`` or ``{kind: (fwd_ms, bwd_ms)}``.
        inputs: per node, the indices of the nodes it reads.
        kind: device kind for plain tuples.
        param_bytes: per node (or one value for all).
        activation_bytes: per node (or one value for all).
        output_bytes: every node's output size.
        batch_size: the profile's batch size.
        model: model name.

    Returns:
        The profile.
    """
    n = len(costs)
    pb = [param_bytes] * n if isinstance(param_bytes, int) else list(param_bytes)
    ab = [activation_bytes] * n if isinstance(activation_bytes, int) else list(activation_bytes)
    nodes = tuple(
        ProfileNode(name=f"n{i}", op=NodeOp.CALL_MODULE, target=f"n{i}", inputs=tuple(f"n{j}" for j in inputs[i]),
                    scope=f"layers.{i}", param_bytes=pb[i], activation_bytes=ab[i], output_bytes=output_bytes,
                    cost=_cost(costs[i], kind))
        for i in range(n))
    return Profile(model=model, batch_size=batch_size, dtype="float32", nodes=nodes)


def chain_profile(costs: Sequence[Cost], **kw: object) -> Profile:
    """A chain ``n0 -> n1 -> ...``; keywords as :func:`dag_profile`."""
    return dag_profile(costs, [[i - 1] if i else [] for i in range(len(costs))], **kw)  # type: ignore[arg-type]


def chain_graph(costs: Sequence[Cost], **kw: object) -> CostGraph:
    """The cost graph of :func:`chain_profile` (one graph node per fx node)."""
    return build(chain_profile(costs, **kw))


def cluster_of(kinds: Sequence[str], *, memory_gib: float = 1024.0, free_links: bool = True,
               name: str = "toy") -> Cluster:
    """Devices ``d0..`` of the given kinds on one host.

    Args:
        kinds: one kind per device.
        memory_gib: memory of every device.
        free_links: add explicit links so fast that communication costs nothing.
        name: cluster name.

    Returns:
        The cluster.
    """
    devs = tuple(Device(f"d{i}", k, memory_gib) for i, k in enumerate(kinds))
    links = tuple(Link(a.name, b.name, 1e15, 0.0) for i, a in enumerate(devs) for b in devs[i + 1:]) \
        if free_links else ()
    return Cluster(devices=devs, links=links, name=name)


def uniform_cluster(n: int, kind: str = "cpu", **kw: object) -> Cluster:
    """``n`` devices of one kind; keywords as :func:`cluster_of`."""
    return cluster_of([kind] * n, **kw)  # type: ignore[arg-type]
