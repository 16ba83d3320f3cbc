"""Test support: small models, hand-made plans, profiles and clusters, gloo ranks with a deadline.

Used by the tests, the examples in docstrings and the benchmarks; nothing here is needed to compile or run a
model, and no module of the package imports it (``tests/unit/test_layering.py``).

- a model with skip connections over several stages (:class:`SkipNet`), its batches and loss, hand-made
  plans (:func:`split_plan`), builds of it (:func:`replicated_skipnet_builds`), and diffs of gradients and
  buffers;
- small hand-made profiles, cost graphs and clusters (:func:`chain_graph`, :func:`cluster_of`, ...);
- :func:`spawn_ranks`, gloo ranks on this host with a deadline (:mod:`hpml_compile.runtime.job.spawn`).

Example:
    >>> import torch
    >>> from hpml_compile.trace import trace
    >>> net = SkipNet()
    >>> gm = trace(net, (torch.randn(8, 16),))
    >>> plan = split_plan(gm, "skipnet", 3, microbatches=2, recompute=(1,))
    >>> [len(s.nodes) for s in plan.stages], plan.stages[1].recompute
    ([9, 9, 9], True)
    >>> g = chain_graph([{"fast": (1.0, 2.0), "slow": (2.0, 4.0)}] * 3)
    >>> g.order, g.kinds
    (('n0', 'n1', 'n2'), ('fast', 'slow'))
    >>> [d.name for d in uniform_cluster(2).devices]
    ['d0', 'd1']
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from .cluster import load_cluster
from .costgraph import CostGraph, build
from .ir import Cluster, Device, Link, NodeCost, NodeOp, Profile, ProfileNode
from .memory import ZeroStage
from .plan import Plan, Schedule, Stage
from .runtime.job.spawn import spawn_ranks

__all__ = ["trained_plainly", "process_gone", "SkipNet", "skipnet_batch", "skipnet_batches", "skipnet_loss", "seeded_skipnet", "split_plan",
           "replicated_skipnet_builds", "skipnet_sgd", "trained_skipnet", "max_grad_diff", "max_buffer_diff",
           "last_node_of", "one_replicated_stage",
           "chain_profile", "chain_graph", "dag_profile", "uniform_cluster", "cluster_of", "spawn_ranks"]


class SkipNet(nn.Module):
    """Skip connections that jump over several stages, a size read early and used late, a tuple value.

    Args:
        width: features of the input and of every block.
        classes: logits per row.
    """

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(6))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.size(0)  # a Python int made at the start and used at the end: it must never cross a stage
        h0 = torch.tanh(self.inp(x))
        h1 = torch.tanh(self.blocks[0](h0))
        h2 = torch.tanh(self.blocks[1](h1))
        h3 = torch.tanh(self.blocks[2](h2)) + h0  # a skip over three blocks
        halves = torch.chunk(self.blocks[3](h3), 2, dim=1)  # a tuple of tensors
        h4 = torch.cat([halves[1], halves[0]], dim=1) + h1
        h5 = self.norm(torch.tanh(self.blocks[4](h4)))
        h6 = self.blocks[5](h5) + 0.5 * h0 + h2  # skips from the first blocks to the last
        return self.head(h6).reshape(rows, -1)


def skipnet_batch(rows: int = 8, width: int = 16, classes: int = 4, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A deterministic ``(inputs, class targets)`` batch for :class:`SkipNet`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g), torch.randint(0, classes, (rows,), generator=g)


def skipnet_batches(steps: int, rows: int = 8) -> list[tuple[Tensor, Tensor]]:
    """One :func:`skipnet_batch` per step, seeded by the step: a run's data, the same in every process."""
    return [skipnet_batch(rows=rows, seed=s) for s in range(steps)]


def seeded_skipnet(seed: int = 0) -> SkipNet:
    """A :class:`SkipNet` whose weights depend only on ``seed`` (the reference and every rank build it alike)."""
    torch.manual_seed(seed)
    return SkipNet()


def skipnet_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of :class:`SkipNet` logits."""
    return F.cross_entropy(logits, targets)


def skipnet_sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of the retry tests: SGD with momentum, whose state a step applied twice would show."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def trained_skipnet(steps: int, rows: int = 8) -> tuple[list[float], dict[str, list[float]]]:
    """The one-process run the distributed tests compare with: :func:`seeded_skipnet` trained by
    :func:`skipnet_sgd` on :func:`skipnet_batches`; the loss of each step and the final parameters (flat lists)."""
    model = seeded_skipnet()
    opt = skipnet_sgd(model.parameters())
    losses = []
    for x, y in skipnet_batches(steps, rows):
        opt.zero_grad()
        loss = skipnet_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}


def trained_plainly(model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], opt: torch.optim.Optimizer,
                    batches: Iterable[tuple[Tensor, Tensor]]) -> tuple[list[float], dict[str, list[float]]]:
    """``model`` trained in this process by ``opt`` on ``batches``, one step a batch (the reference a distributed
    run is compared with): the loss of each step and the final parameters (flat lists)."""
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}


def process_gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` has exited, waiting up to ``within_s`` for it."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def one_replicated_stage(build_dir: str | Path, out_dir: str | Path) -> Path:
    """The model of a ``compile``d build as one stage replicated on every device of its cluster, built into
    ``out_dir`` (:func:`hpml_compile.driver.rebuild`: a build ``hpml-compile run`` runs); the batch must divide
    by the devices. Plain data parallelism: no ZeRO shards, compression, swap, offload or tensor parallelism
    (whatever the compiled plan's first stage had), so that a lost replica can be answered in place.

    Returns:
        ``out_dir``.
    """
    from dataclasses import replace

    from . import driver
    from .plan import Stage, load_plan
    from .profile import load_profile

    plan = load_plan(Path(build_dir) / "plan.json")
    one = Stage(0, tuple(d.name for d in plan.cluster.devices), tuple(n for st in plan.stages for n in st.nodes),
                recompute=plan.stages[0].recompute)
    driver.rebuild(build_dir, replace(plan, stages=(one,)), load_profile(Path(build_dir) / "profile.json"), out_dir)
    return Path(out_dir)


def replicated_skipnet_builds(root: str | Path, zeros: Sequence[int], *, microbatches: int, rows: int = 8
                               ) -> dict[str, str]:
    """Builds of :class:`SkipNet` as one stage replicated on 2 ranks, one per ZeRO stage in ``zeros``, under
    ``root/zero<z>``: ``{str(z): folder}``."""
    from .codegen import generate
    from .trace import trace

    gm = trace(SkipNet(), skipnet_batch(rows=rows)[:1])
    out = {}
    for z in zeros:
        out[str(z)] = str(Path(root) / f"zero{z}")
        generate(gm, split_plan(gm, "skipnet", 1, microbatches=microbatches, replicas=[2], zero=z), out[str(z)])
    return out


def _executes(n: fx.Node) -> bool:
    return n.op not in ("placeholder", "get_attr", "output")


def split_plan(gm: fx.GraphModule, model: str, stages: int, *, microbatches: int = 1,
               replicas: Sequence[int] | None = None, after: Sequence[str] | None = None,
               swap: Iterable[int] = (), recompute: Iterable[int] = (), zero: ZeroStage | int = 0,
               schedule: Schedule = Schedule.GPIPE, rows: Sequence[Sequence[int]] | None = None,
               chunks: int = 1) -> Plan:
    """A plan cutting the graph's node order into ``stages`` contiguous ranges, on ``local-cpu-N``.

    Args:
        gm: the traced graph.
        model: the model's name.
        stages: how many stages.
        microbatches: ``M``.
        replicas: devices per stage (default one each).
        after: cut right after these nodes (``stages - 1`` names); default: equal numbers of executing nodes.
        swap: stages whose every node swaps its saved activations.
        recompute: stages that recompute.
        zero: ZeRO stage of the replicated stages.
        schedule: the schedule written into the plan.
        rows: per stage, each replica's rows of a microbatch (``Stage.rows``; ``()``: an equal split); given
            alone, it sets the replica counts too.
        chunks: interleaved 1F1B's ``v`` (with ``schedule`` interleaved): ``stages`` is then ``S * v``, and
            ``replicas`` and ``rows`` are given per device group (``S`` entries); stage ``k`` runs on group
            ``k % S``'s devices.

    Returns:
        The plan.
    """
    nodes = list(gm.graph.nodes)
    names = [n.name for n in nodes]
    if after is not None:
        cuts = [0, *(names.index(a) + 1 for a in after), len(nodes)]
    else:
        body = [i for i, n in enumerate(nodes) if _executes(n)]
        cuts = [0, *(body[round(i * len(body) / stages)] for i in range(1, stages)), len(nodes)]
    groups = stages // chunks
    per = [tuple(r) for r in rows] if rows is not None else [()] * groups
    reps = list(replicas or [len(r) or 1 for r in per])
    devices, k = [], 0
    for d in reps:
        devices.append(tuple(f"cpu{k + i}" for i in range(d)))
        k += d
    per = [per[i % groups] for i in range(stages)]  # interleaved: stage i on group i % groups's devices
    reps = [reps[i % groups] for i in range(stages)]
    devices = [devices[i % groups] for i in range(stages)]
    swap, recompute = set(swap), set(recompute)
    out = []
    for i in range(stages):
        part = tuple(names[cuts[i]:cuts[i + 1]])
        out.append(Stage(i, devices[i], part, zero=ZeroStage(zero) if reps[i] > 1 else ZeroStage.NONE,
                         recompute=i in recompute, swap=part if i in swap else (), rows=per[i]))
    return Plan(model, load_cluster(f"local-cpu-{k}"), schedule, microbatches, tuple(out), chunks=chunks)


def last_node_of(gm: fx.GraphModule, block: str) -> str:
    """The last node (in graph order) of module ``block`` (e.g. ``model.layers.0``): a cut right after it.

    Raises:
        AssertionError: if no node belongs to the block.
    """
    from .trace import node_info

    inside = [n.name for n in gm.graph.nodes
              if n.op != "placeholder" and (node_info(n).scope == block or node_info(n).scope.startswith(block + "."))]
    if not inside:
        raise AssertionError(f"no node of the graph belongs to {block!r}")
    return inside[-1]


def max_grad_diff(model: nn.Module, reference: nn.Module, names: Iterable[str] | None = None) -> float:
    """Largest absolute difference between the two models' gradients (all parameters, or ``names``).

    Raises:
        AssertionError: if a parameter has a gradient in one model and none in the other.
    """
    ours, ref = dict(model.named_parameters()), dict(reference.named_parameters())
    worst = 0.0
    for name in (names if names is not None else ref):
        a, b = ours[name].grad, ref[name].grad
        if (a is None) != (b is None):
            raise AssertionError(f"{name}: gradient {'missing' if a is None else 'unexpected'} in the compiled run")
        if a is not None and b is not None:
            worst = max(worst, (a - b).abs().max().item())
    return worst


def max_buffer_diff(model: nn.Module, reference: nn.Module) -> float:
    """Largest absolute difference between the two models' buffers."""
    worst = 0.0
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()):
        worst = max(worst, (a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
    return worst

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
