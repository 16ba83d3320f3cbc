"""Lowering analyses: which stage runs each node, what crosses each boundary, which collectives run.

Three small steps, each a function of the traced graph and the plan:

- :func:`place`: every fx node in exactly the stage the plan says (a plan for
  another model is refused, naming the nodes that do not match);
- :func:`microbatch_values`: the value of every node at microbatch size
  (fake tensors: nothing is computed), for the shapes that boundaries carry;
- :func:`plan_actions`: per stage, the values received and sent (a boundary
  ``k -> k+1`` carries every tensor live across it, so a skip connection over
  several stages is relayed), the non-tensor values recomputed in the
  consumer (only tensors cross), the recompute/swap regions and the gradient
  collectives of replicated stages and of parameters shared between stages.

:func:`canonical_text` is the model graph as text, hashed into the manifest.

Example:
    >>> import torch
    >>> from hpml_compile.trace import trace
    >>> from hpml_compile.plan import Plan, Stage
    >>> from hpml_compile.cluster import load_cluster
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> gm = trace(m, (torch.randn(2, 4),))
    >>> [n.name for n in gm.graph.nodes]
    ['input_1', '_0', '_1', '_2', 'output']
    >>> st = (Stage(0, ("cpu0",), ("input_1", "_0", "_1")), Stage(1, ("cpu1",), ("_2", "output")))
    >>> plan = Plan("seq", load_cluster("local-cpu-2"), "gpipe", 2, st)
    >>> acts = plan_actions(gm, plan, place(gm, plan), microbatch_values(gm, 1))
    >>> acts[0].send, acts[1].tokens()
    (Transfer(src=0, dst=1, values=('_1',)), ['0RECV1'])
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import _get_qualified_name
from torch.utils._pytree import tree_flatten

from ..errors import BuildMismatchError, HpmlError
from ..ir import FrontEnd
from ..memory import ZeroStage
from ..plan import Plan, node_stages
from ..schedule import SyncImpl, sync_impl
from ..trace import buffers_restored, fixed_shapes
from .actions import GradSync, StageActions, SyncKind, Transfer

__all__ = ["GUARD_TARGETS", "canonical_text", "place", "microbatch_values", "is_tensorlike", "plan_actions",
           "specs_of", "trace_rows", "batch_dims"]

# torch.export adds a module that checks the example inputs' exact shapes; a
# pipeline feeds microbatches, and the manifest's graph hash already pins the graph.
GUARD_TARGETS = frozenset({"_guards_fn"})
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _fmt(value: Any) -> str:
    if isinstance(value, fx.Node):
        return f"%{value.name}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_fmt(v) for v in value)
        return f"({inner},)" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_fmt(v)}" for k, v in value.items()) + "}"
    return _ADDRESS.sub("", repr(value))


def _target(node: fx.Node) -> str:
    if node.op == "call_function":
        return _get_qualified_name(node.target) if callable(node.target) else str(node.target)
    return str(node.target)


def canonical_text(gm: fx.GraphModule) -> str:
    """The graph as stable text: one line per node with its op, target, arguments, shape and dtype.

    Two traces of the same model give the same text in any process; a model
    with another structure or other sizes gives another text.
    """
    lines = []
    for n in gm.graph.nodes:
        info = n.meta.get("hpml")
        shape = f"{list(info.shape)} {info.dtype}" if info is not None and info.shape is not None else \
            f"bytes={info.output_bytes}" if info is not None else "?"
        lines.append(f"{n.name} = {n.op}[{_target(n)}]({_fmt(n.args)}, {_fmt(n.kwargs)}) -> {shape}")
    return "\n".join(lines) + "\n"


def _executes(node: fx.Node) -> bool:
    """Nodes that run in their stage; placeholders and attribute reads are duplicated where used instead."""
    if node.op in ("placeholder", "get_attr"):
        return False
    return not (node.op == "call_module" and node.target in GUARD_TARGETS)


def place(gm: fx.GraphModule, plan: Plan) -> dict[str, int]:
    """The stage of every node of ``gm``, exactly as the plan says.

    Args:
        gm: the traced graph.
        plan: the plan.

    Returns:
        node name -> stage index.

    Raises:
        BuildMismatchError: if the plan names nodes the graph lacks or misses
            nodes it has (a plan made for another model), or puts the output
            anywhere but the last stage.
        HpmlError: if a node reads a value from a later stage.
    """
    where = node_stages(plan)  # PlanError (an HpmlError) for a node placed twice
    names = [n.name for n in gm.graph.nodes]
    extra = [n for n in where if n not in set(names)]
    missing = [n for n in names if n not in where]
    if extra or missing:
        raise BuildMismatchError(
            f"plan.json (model {plan.model!r}) does not fit this graph ({len(names)} nodes): it places "
            f"{len(extra)} node(s) the graph lacks {extra[:5]} and leaves {len(missing)} of its nodes unplaced "
            f"{missing[:5]}; the plan was made for another model or another trace. Re-plan from this "
            "model's profile (hpml-compile compile MODEL ...)")
    for n in gm.graph.nodes:
        for u in n.all_input_nodes:
            if where[u.name] > where[n.name]:
                raise HpmlError(f"plan: node {n.format_node()} in stage {where[n.name]} reads {u.name} from "
                                f"the later stage {where[u.name]}; a producer must be in the same or an "
                                "earlier stage")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if where[out.name] != len(plan.stages) - 1:
        raise BuildMismatchError(f"plan.json puts the graph output in stage {where[out.name]}, but the last "
                                 f"stage is {len(plan.stages) - 1}: the model's outputs must be produced by "
                                 "the last stage")
    return where


def _is_static(gm: fx.GraphModule) -> bool:
    return fixed_shapes(gm)


class _Values(fx.Interpreter):
    """Runs the graph on fake tensors and keeps every node's value (the graph's meta is left alone)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            out = super().run_node(n)
        except Exception as exc:
            raise HpmlError(f"shapes at microbatch size: node {n.format_node()} failed: {type(exc).__name__}: "
                            f"{exc}. The graph may have the batch size built in; trace it with one "
                            "microbatch as example input") from exc
        self.values[n.name] = out
        return out


def trace_rows(gm: fx.GraphModule) -> int:
    """Rows (first dimension) of the graph's tensor inputs as traced."""
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim():
            return int(val.shape[0])
    raise HpmlError("the graph has no batched tensor input (a first dimension to split into microbatches)")


def microbatch_values(gm: fx.GraphModule, rows: int) -> dict[str, Any]:
    """Every node's value when the graph runs on ``rows`` rows (fake tensors: shapes only).

    The model's tensor inputs are batch-first. A graph from torch.export has
    its shapes fixed at trace time: it must have been traced at ``rows`` rows
    (one microbatch of one replica), and its traced values are used as they are.

    Args:
        gm: the traced graph.
        rows: rows of one replica's slice of one microbatch.

    Returns:
        node name -> value (fake tensors, ints, tuples).

    Raises:
        HpmlError: if a static graph was traced at another size, or the graph cannot execute at this one.
    """
    if _is_static(gm):
        if trace_rows(gm) != rows:
            raise HpmlError(f"this graph came from torch.export, which fixes every shape, and was traced with "
                            f"{trace_rows(gm)} rows, but each stage replica runs {rows} rows per microbatch: "
                            f"trace it with {rows} rows (batch / (microbatches x replicas))")
        return {n.name: n.meta.get("val") for n in gm.graph.nodes}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args: list[Any] = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim():
            with mode:
                args.append(torch.empty((rows, *val.shape[1:]), dtype=val.dtype))
        else:
            args.append(val)
    interp = _Values(gm)
    with buffers_restored(gm), mode:
        interp.run(*args)
    return interp.values


def batch_dims(small: Any, large: Any, name: str) -> tuple[int, ...]:
    """The batch dimension of each tensor of a value, from its shapes at two row counts (-1: none).

    Raises:
        HpmlError: if a tensor's shape changes in more than one dimension.
    """
    out = []
    for a, b in zip(tree_flatten(small)[0], tree_flatten(large)[0]):
        dims = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(dims) > 1 or a.dim() != b.dim():
            raise HpmlError(f"value {name}: shape {tuple(a.shape)} changes in more than one dimension with the "
                            f"batch ({tuple(b.shape)}); it cannot be split between stages of different replica "
                            "counts: give neighbouring stages the same number of replicas")
        out.append(dims[0] if dims else -1)
    return tuple(out)


def is_tensorlike(value: Any) -> bool:
    """A tensor, or a flat tuple/list of tensors: what may cross a stage boundary."""
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and bool(value) and all(isinstance(v, torch.Tensor) for v in value)


def _needs(gm: fx.GraphModule, owner: dict[str, int], values: dict[str, Any], stage: int,
           nodes: list[fx.Node]) -> tuple[list[str], list[str], set[str]]:
    """Placeholders read, non-tensor values to recompute, and tensors to receive, for one stage."""
    inputs: set[str] = set()
    remat: list[str] = []
    remote: set[str] = set()

    def use(u: fx.Node) -> None:
        if u.op == "placeholder":
            inputs.add(u.name)
        elif u.op == "get_attr" or owner[u.name] == stage or u.name in remat:
            return
        elif is_tensorlike(values.get(u.name)):
            remote.add(u.name)
        elif u.op in ("call_function", "call_method"):
            for w in u.all_input_nodes:  # recompute it here from what does cross
                use(w)
            remat.append(u.name)
        else:
            raise HpmlError(f"stage {stage} needs the non-tensor value of {u.format_node()} from stage "
                            f"{owner[u.name]}; only tensors may cross a stage and a module call cannot be "
                            "recomputed: move the cut so that this node is in the same stage as its users")

    for n in nodes:
        for u in n.all_input_nodes:
            use(u)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(inputs, key=order.__getitem__), remat, remote


def _stage_params(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[int, str]:
    """id(parameter) -> the name this stage binds it under."""
    out: dict[int, str] = {}
    for n in nodes:
        if n.op == "call_module":
            for name, p in gm.get_submodule(str(n.target)).named_parameters():
                out.setdefault(id(p), f"{n.target}.{name}")
        elif n.op == "get_attr":
            obj = _attr(gm, str(n.target))
            if isinstance(obj, torch.nn.Parameter):
                out.setdefault(id(obj), str(n.target))
    return out


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _check_buffers(gm: fx.GraphModule, per_stage: list[list[fx.Node]]) -> None:
    """A normalisation layer's running statistics must live on exactly one stage."""
    seen: dict[int, tuple[int, str]] = {}
    for k, nodes in enumerate(per_stage):
        for n in nodes:
            if n.op != "call_module":
                continue
            mod = gm.get_submodule(str(n.target))
            if not isinstance(mod, torch.nn.modules.batchnorm._NormBase):
                continue
            first = seen.setdefault(id(mod), (k, str(n.target)))
            if first[0] != k:
                raise HpmlError(f"module {n.target} ({type(mod).__name__}) runs in stage {first[0]} and stage {k}; "
                                "its running statistics must live on one stage: put all its calls in one stage")


def _syncs(plan: Plan, params: list[dict[int, str]], canon: dict[int, str]) -> tuple[list[GradSync], list[GradSync]]:
    """Gradient collectives: one per group of stages sharing parameters, in one global order, each naming the
    implementation the plan gives it (:func:`hpml_compile.schedule.sync_impl`)."""
    users: dict[int, list[int]] = {}
    for k, ps in enumerate(params):
        for pid in ps:
            users.setdefault(pid, []).append(k)
    buckets: dict[tuple[SyncKind, tuple[int, ...]], list[int]] = {}
    for pid, stages in users.items():
        if len(stages) > 1:  # a tied parameter: one value, gradients summed over every stage using it
            buckets.setdefault((SyncKind.ALL_REDUCE, tuple(stages)), []).append(pid)
            continue
        st = plan.stages[stages[0]]
        if len(st.devices) == 1:
            continue
        # ZeRO-1/2: reduce-scatter into this replica's shard, step it, all-gather (runtime.sync.zero.FlatShard);
        # ZeRO-3: the same collectives, the all-gather after the step left to the next forward (runtime.sync.zero3)
        kind = SyncKind.REDUCE_SCATTER if st.zero >= ZeroStage.OS else SyncKind.ALL_REDUCE
        buckets.setdefault((kind, tuple(stages)), []).append(pid)
    order = {pid: i for i, pid in enumerate(canon)}
    grad, after = [], []
    for (kind, stages), pids in sorted(buckets.items(), key=lambda kv: (kv[0][1], kv[0][0].value)):
        names = tuple(canon[p] for p in sorted(pids, key=order.__getitem__))
        impl = sync_impl(plan, stages).value  # which implementation runs them: named in their tokens
        grad.append(GradSync(kind, stages, names, impl))
        if kind is SyncKind.REDUCE_SCATTER:
            after.append(GradSync(SyncKind.ALL_GATHER, stages, names, impl))
        elif impl == SyncImpl.LOCAL.value:  # local SGD: the replicas' parameters averaged after the step (every H)
            after.append(GradSync(kind, stages, names, impl))
    return grad, after


def plan_actions(gm: fx.GraphModule, plan: Plan, owner: dict[str, int],
                 values: dict[str, Any]) -> list[StageActions]:
    """Lower a plan to explicit per-stage actions.

    Args:
        gm: the traced graph.
        plan: the plan.
        owner: node name -> stage, from :func:`place`.
        values: node values at microbatch size, from :func:`microbatch_values`.

    Returns:
        One :class:`StageActions` per stage.

    Raises:
        HpmlError: if a non-tensor value would have to cross and cannot be
            recomputed, or a normalisation layer runs in two stages.
    """
    s_count = len(plan.stages)
    per_stage: list[list[fx.Node]] = [[] for _ in range(s_count)]
    for n in gm.graph.nodes:
        if _executes(n):
            per_stage[owner[n.name]].append(n)
    _check_buffers(gm, per_stage)
    needs = [_needs(gm, owner, values, k, per_stage[k]) for k in range(s_count)]
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    # Boundary k -> k+1 carries every tensor made in stages <= k that some stage > k receives.
    live: list[list[str]] = [[] for _ in range(s_count)]
    for k in range(1, s_count):
        wanted = {u for r in range(k, s_count) for u in needs[r][2] if owner[u] < k}
        live[k] = sorted(wanted, key=order.__getitem__)
    canon = {id(p): name for name, p in gm.named_parameters()}
    stage_nodes = [per_stage[k] + [u for u in gm.graph.nodes if u.op == "get_attr" and any(
        u in n.all_input_nodes for n in per_stage[k])] for k in range(s_count)]
    params = [_stage_params(gm, stage_nodes[k]) for k in range(s_count)]
    grad, after = _syncs(plan, params, canon)
    out = []
    for k, st in enumerate(plan.stages):
        inputs, remat, _ = needs[k]
        names = [n.name for n in per_stage[k]]
        swapped = set(st.swap)
        runs: list[list[str]] = []
        last = -2
        for i, name in enumerate(names):
            if name not in swapped or per_stage[k][i].op == "output":
                continue
            if i == last + 1:
                runs[-1].append(name)
            else:
                runs.append([name])
            last = i
        local = tuple((canon[pid], name) for pid, name in params[k].items() if pid in canon)
        out.append(StageActions(
            index=k, nodes=tuple(names), inputs=tuple(inputs), remat=tuple(remat),
            recv=Transfer(k - 1, k, tuple(live[k])) if k and live[k] else None,
            send=Transfer(k, k + 1, tuple(live[k + 1])) if k + 1 < s_count and live[k + 1] else None,
            recompute=st.recompute, swap=tuple(tuple(r) for r in runs),
            grad_sync=tuple(g for g in grad if k in g.stages),
            after_step=tuple(g for g in after if k in g.stages), local_params=local))
    return out


def specs_of(value: Any, dims: tuple[int, ...] | None = None) -> list[tuple[tuple[int, ...], torch.dtype, int | None]]:
    """``(shape, dtype, batch dim)`` of each tensor in a boundary value (a tensor or a flat tuple of them).

    ``dims`` (from :func:`batch_dims`) is given only where the two sides of a
    boundary have different replica counts; elsewhere the batch dim is None.
    """
    leaves, _ = tree_flatten(value)
    return [(tuple(int(s) for s in t.shape), t.dtype, None if dims is None or dims[i] < 0 else dims[i])
            for i, t in enumerate(leaves)]
