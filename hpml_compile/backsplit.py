"""A stage's backward in two parts, for ZB-H1: the input gradients now, the weight gradients later.

The runtime's executor runs these two parts (:mod:`hpml_compile.runtime.execute.executor`) and the profile
times them (:mod:`hpml_compile.profile.split`): both import this one module, which needs nothing of either.

Zero-bubble schedules (Qi et al., ICLR 2024) run a microbatch's backward as
``I`` (the gradients of what the stage received, which the previous stage
waits for) and, later, ``W`` (the gradients of the stage's parameters, which
nothing waits for). :func:`backward_input` and :func:`backward_weight` do so on
the autograd graph a generated stage's forward left, using
``torch.distributed.pipelining._backward.stage_backward_input`` for ``I``:
it computes the gradients of the stage's inputs only and remembers, at each
node where a parameter's path meets the inputs' (torch's "param groups"), the
gradient that arrived there.

That is torch's *private* API (``torch.distributed.pipelining._backward``,
what its ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble`` call):
it may change between torch releases, and this module is the one place that
imports it. ``W`` is ours, on the same groups: torch's ``stage_backward_weight``
computes with ``torch.autograd.grad`` and assigns ``.grad`` itself, which
skips the parameters' post-accumulate-grad hooks that the runtime's gradient
buckets and gradient-memory count listen to, so ours runs
``torch.autograd.backward`` from the same edges with ``inputs`` the group's
parameters: autograd accumulates, into ZeRO's flat buffer views too.

What a stage's inputs are: the values ``ops.recv`` received (each
``_Recv`` node hangs from a leaf "anchor" tensor; asking for the anchors'
gradients runs ``_Recv``'s backward, which sends the gradient owed to the
previous stage: ``I`` does, ``W`` never reaches it), or any other leaf that
takes a gradient and is no parameter of the stage.

A stage where the split does not hold runs its whole backward at one of the
two (correct, with no split): with no input that takes a gradient (the first
stage: the whole backward at ``W``, as torch does for its first stage), and
where a parameter's path reaches the stage's outputs without meeting its
inputs (a value sent on that depends on parameters only): ``W`` would run
the send's backward a second time, so the whole backward runs at ``I``. The
check walks the autograd graph once more per microbatch (Python, one visit
per node): the profile times that cost with the two parts of each block
(:mod:`hpml_compile.profile.split`), and the simulator adds it to the backward. A recomputed region (``ops.checkpoint``) runs its forward again
for each part that unpacks its saved tensors: twice, once for ``I`` and once
for ``W`` (the simulator prices it so).

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(3, 2)
    >>> x = torch.randn(4, 3, requires_grad=True)
    >>> part = backward_input([lin(x).sum()], list(lin.parameters()), [x])
    >>> x.grad is not None, lin.weight.grad is None
    (True, True)
    >>> backward_weight(part)
    >>> bool(torch.allclose(lin.weight.grad, x.detach().sum(0).expand(2, 3)))
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node

if TYPE_CHECKING:
    from .ir import Profile

__all__ = ["Deferred", "backward_input", "backward_weight", "stage_inputs", "node_split_costs"]


def _torch_backward() -> ModuleType:
    """``torch.distributed.pipelining._backward`` (private torch API: see the module docstring), on first use.

    Why not at the top: importing ``torch.distributed.pipelining`` imports ``torch._dynamo``, about 1.3 s of
    CPU on a 2-core VM, which every CLI start that imports the runtime (``run``'s launcher, ``report``) paid
    without ever splitting a backward.

    Returns:
        The module.
    """
    from torch.distributed.pipelining import _backward

    return _backward


@dataclass
class Deferred:
    """What ``I`` leaves for ``W`` of one microbatch.

    Attributes:
        groups: torch's parameter groups: their parameters' gradient accumulators, the nodes where their paths
            meet the inputs' (``intermediates``) and the gradients that arrived there (``grads``).
        whole: the roots of a backward that runs whole at ``W`` (no input takes a gradient); else empty.
        whole_grads: the gradients of ``whole`` (None: the roots are scalars or send tokens, as a stage's are).
    """

    groups: list[dict[str, Any]] = field(default_factory=list)
    whole: list[Tensor] = field(default_factory=list)
    whole_grads: list[Tensor] | None = None


def _is_send(node: Node) -> bool:
    """Whether ``node`` is the backward of a stage's send (``ops.send``'s autograd function says so with its
    ``SENDS`` flag: this module sits below the code generator and names no class of it)."""
    return bool(getattr(getattr(node, "_forward_cls", None), "SENDS", False))


def _nodes(roots: Sequence[Tensor]) -> list[Node]:
    """Every node of the graph below ``roots``, each once."""
    seen: dict[Node, None] = {}
    todo = [r.grad_fn for r in roots if r.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen[node] = None
        todo += [fn for fn, _ in node.next_functions if fn is not None and fn not in seen]
    return list(seen)


def stage_inputs(roots: Sequence[Tensor], params: Sequence[nn.Parameter]) -> list[Tensor]:
    """The leaves below ``roots`` that take a gradient and are no parameter: the anchors of the stage's
    ``ops.recv`` (their gradients run ``_Recv``'s backward), or values received otherwise; a send's anchor is
    not one (its gradient is the send's own backward, which receives)."""
    mine = {id(p) for p in params}
    out: dict[int, Tensor] = {}
    for node in _nodes(roots):
        if _is_send(node):
            continue
        for fn, _ in node.next_functions:
            leaf = getattr(fn, "variable", None) if fn is not None else None
            if leaf is not None and id(leaf) not in mine:
                out.setdefault(id(leaf), leaf)
    return list(out.values())


def _splits(roots: Sequence[Tensor], params: Sequence[nn.Parameter], inputs: Sequence[Tensor]) -> bool:
    """Whether every parameter's path meets the inputs' below every send (so ``W`` never runs a send again)."""
    tb = _torch_backward()
    acc = [a for a in (tb._get_grad_fn_or_grad_acc(p) for p in params if p.requires_grad) if a is not None]
    reverse = tb.construct_reverse_graph([r.grad_fn for r in roots if r.grad_fn is not None])
    used = {a for a in acc if a in reverse}  # before get_param_groups: its lookups add every node they ask for
    starts = [n for n in (tb._get_grad_fn_or_grad_acc(t) for t in inputs) if n is not None]
    groups = tb.get_param_groups(starts, acc, reverse)
    above: set[Node] = set()  # a send's node and every node a send's node lies below
    todo = [n for n in _nodes(roots) if _is_send(n)]
    while todo:
        node = todo.pop()
        if node not in above:
            above.add(node)
            todo += reverse.get(node, [])
    reached = {p for g in groups if g["intermediates"] for p in g["params"]}
    return used <= reached and not any(n in above for g in groups for n in g["intermediates"])


def backward_input(roots: Sequence[Tensor], params: Sequence[nn.Parameter],
                   inputs: Sequence[Tensor] | None = None, grads: Sequence[Tensor] | None = None) -> Deferred:
    """``I``: the gradients of the stage's inputs (what was received sends its gradient back on the way).

    Args:
        roots: the backward's roots: the stage's send tokens, or the last stage's loss.
        params: the stage's parameters (their gradients wait for :func:`backward_weight`).
        inputs: the stage's inputs (default: :func:`stage_inputs`).
        grads: the gradients of ``roots``, one each (None: the roots are scalars or send tokens); the profile
            passes them where it times a block's two parts (:mod:`hpml_compile.profile.split`).

    Returns:
        What :func:`backward_weight` needs.
    """
    keep = [i for i, r in enumerate(roots) if r.requires_grad]
    given = None if grads is None else [grads[i] for i in keep]
    roots = [roots[i] for i in keep]
    if not roots:
        return Deferred()
    found = stage_inputs(roots, params) if inputs is None else [t for t in inputs if t.requires_grad]
    if not found:
        return Deferred(whole=list(roots), whole_grads=given)
    if not _splits(roots, params, found):
        torch.autograd.backward(list(roots), given)
        return Deferred()
    # torch detaches the roots in place, which a view refuses: a view root is replaced by a copy
    outs = [r.clone() if r._is_view() else r for r in roots]
    _, groups = _torch_backward().stage_backward_input(outs, given, list(found), iter(params))
    return Deferred(groups=groups)


def backward_weight(part: Deferred) -> None:
    """``W``: accumulate the parameters' gradients from what :func:`backward_input` left (see the module docstring).

    Like torch's ``stage_backward_weight``, a group with several meeting points clamps each to the gradient it
    received in ``I``, so that a path between two of them is not counted twice.
    """
    if part.whole:
        torch.autograd.backward(part.whole, part.whole_grads)
        part.whole, part.whole_grads = [], None
        return
    for group in part.groups:
        nodes, got = group.pop("intermediates"), group.pop("grads", None)
        if not got:
            continue
        edges, grads = [], []
        for node, tup in zip(nodes, got):
            for i, g in enumerate(tup):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        handles = [node.register_prehook(lambda _, saved=tup: saved) for node, tup in zip(nodes, got)] \
            if len(nodes) > 1 else []
        try:
            if edges:
                weights = [acc.variable for acc in group["params"]]
                torch.autograd.backward(edges, grad_tensors=grads, inputs=weights)
        finally:
            for h in handles:
                h.remove()
    part.groups = []


def node_split_costs(profile: Profile) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Per fx node, for the cost graph (:mod:`hpml_compile.costgraph`), ``{kind: (weight_ms, extra_ms, extra_weight_ms)}`` from the profile's measured ZB-H1 split
    (``devices[kind]["split"]``, :func:`hpml_compile.profile.split.split_facts`): a block's weight share applied to
    each of its nodes' backward, its extra cost (and that cost's weight share) spread evenly over its nodes. A
    block runs from its first node to the next block's; the nodes before the first block (placeholders) get
    zeros."""
    out: dict[str, dict[str, tuple[float, float, float]]] = {}
    pos = {n.name: i for i, n in enumerate(profile.nodes)}
    for kind, facts in profile.devices.items():
        blocks = [b for b in (facts.get("split") or {}).get("blocks", []) if b[0] in pos]
        if kind not in profile.device_kinds or not blocks:
            continue
        for n in profile.nodes[:pos[blocks[0][0]]]:  # placeholders: no backward of their own
            out.setdefault(n.name, {})[kind] = (0.0, 0.0, 0.0)
        starts = [pos[b[0]] for b in blocks] + [len(profile.nodes)]
        for (_, share, extra), lo, hi in zip(blocks, starts, starts[1:]):
            for n in profile.nodes[lo:hi]:
                each = float(extra) / (hi - lo)
                out.setdefault(n.name, {})[kind] = (float(share) * n.cost[kind].bwd_ms, each, float(share) * each)
    return out
