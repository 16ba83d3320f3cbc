"""Static per-node facts, computed on meta tensors: op kind, FLOPs, bytes.

Each node is replayed alone on ``meta`` tensors shaped like its traced inputs
(``node.meta["val"]``), with meta copies of the parameters it uses, so the
analysis allocates nothing and works for a 70B model. Per node:

* FLOPs of forward and backward from ``torch.utils.flop_counter`` (on meta,
  scaled-dot-product attention dispatches to kernels that have FLOP
  formulas; on CPU it would count 0);
* ``activation_bytes``: what autograd saves for backward
  (``saved_tensors_hooks``), parameters excluded; under mixed precision
  (``analyze(gm, "bf16")``) the node runs a second time on fake CPU tensors
  under ``torch.autocast`` (meta tensors bypass autocast, fake CPU ones do
  not), so the sizes are autocast's: activations in the compute dtype where
  autocast computes in it, and the compute-dtype copies of the weights that
  autocast makes and autograd keeps for the backward;
* ``mem_bytes``: bytes the forward reads (inputs, parameters) and writes
  (outputs), for the roofline;
* parameters used, with ``param_bytes`` counted on first use only, so a tied
  embedding / LM head is counted once.

Example:
    >>> import torch
    >>> from hpml_compile.trace import trace
    >>> gm = trace(torch.nn.Sequential(torch.nn.Linear(8, 4)), (torch.randn(2, 8),))
    >>> f = analyze(gm)["_0"]
    >>> f.flops, f.bwd_flops, f.param_bytes, f.activation_bytes, f.op_kind
    (128, 256, 144, 64, 'matmul')
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate, map_arg
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from cost_models import OpKind

from ..ir import Precision
from ..precision import autocast
from ..trace import node_info, tensor_bytes

__all__ = ["NodeFacts", "analyze", "op_kind", "is_inplace", "Segment", "segments"]


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """Static facts of one node (see the module docstring)."""

    op_kind: str
    flops: int
    bwd_flops: int
    activation_bytes: int
    mem_bytes: int
    param_bytes: int
    params: tuple[str, ...]


# Name fragments -> op kind; the first match wins, so specific names come first.
_KIND_TABLE: tuple[tuple[OpKind, tuple[str, ...]], ...] = (
    (OpKind.ATTENTION, ("scaled_dot_product", "attention", "flash")),
    (OpKind.CONV, ("conv",)),
    (OpKind.MATMUL, ("linear", "matmul", "addmm", "bmm", "baddbmm", "einsum", "mm")),
    (OpKind.NORM, ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "batch_norm", "batchnorm",
                   "group_norm", "groupnorm", "native_layer_norm")),
    (OpKind.SOFTMAX, ("softmax", "log_softmax", "cross_entropy", "nll_loss")),
    (OpKind.EMBEDDING, ("embedding",)),
    (OpKind.REDUCTION, ("sum", "mean", "pool", "max", "min", "amax", "norm", "var", "std")),
    (OpKind.VIEW, ("view", "reshape", "permute", "transpose", "getitem", "getattr", "size", "expand",
                   "unsqueeze", "squeeze", "flatten", "unflatten", "split", "chunk", "narrow", "select",
                   "slice", "alias", "detach", "unbind", "_unsafe_view", "t", "dim", "identity")),
    (OpKind.ACTIVATION, ("gelu", "silu", "tanh", "sigmoid", "softplus", "elu", "mish", "hardswish", "exp",
                         "erf", "swish")),
    (OpKind.ELEMENTWISE, ("relu", "dropout", "leakyrelu", "add", "mul", "sub", "div", "neg", "pow", "rsqrt",
                          "where", "cat", "stack", "contiguous", "clone", "masked_fill")),
)


# Device moves cannot run on meta ("cannot copy out of meta tensor"); they do no
# arithmetic and save nothing for backward, so there is nothing to count.
_DEVICE_MOVES = frozenset({"to", "_to_copy", "cpu", "cuda", "type_as"})


def _target_name(node: fx.Node, module: torch.nn.Module | None) -> str:
    if node.op == "call_module" and module is not None:
        return type(module).__name__.lower()
    if node.op == "call_method":
        return str(node.target).lower()
    target = node.target
    if isinstance(target, torch._ops.OpOverload):  # aten.to.dtype_layout -> "to"
        return target.overloadpacket.__name__.lower()
    name = getattr(target, "__name__", None) or str(target)
    # aten overloads print as "aten.linear.default": keep the op name
    parts = str(name).split(".")
    if len(parts) >= 2 and parts[-1] in ("default", "Tensor", "Scalar", "int", "dim", "self", "input"):
        parts = parts[:-1]
    return parts[-1].lower()


def op_kind(node: fx.Node, module: torch.nn.Module | None = None) -> OpKind:
    """Classify a node for the roofline (``module``: the submodule of a call_module node)."""
    if node.op in ("placeholder", "output", "get_attr"):
        return OpKind.VIEW
    name = _target_name(node, module)
    if "dropout" in name and (getattr(module, "p", None) == 0 or node.kwargs.get("p") == 0
                              or (module is not None and not module.training)):
        return OpKind.VIEW  # dropout(p=0) or in eval returns its input: no work
    for kind, fragments in _KIND_TABLE:
        for frag in fragments:
            if frag == name or (len(frag) > 3 and frag in name):
                return kind
    return OpKind.ELEMENTWISE if name and node.op != "call_module" else OpKind.OTHER


def is_inplace(node: fx.Node, module: torch.nn.Module | None) -> bool:
    """True when the node writes into one of its inputs (ReLU(inplace=True), x.add_(...))."""
    if module is not None and getattr(module, "inplace", False):
        return True
    if node.op == "call_method" and str(node.target).endswith("_") and not str(node.target).startswith("_"):
        return True
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable  # an exported graph's aten.add_, aten.copy_, aten.index_put_
    return bool(node.kwargs.get("inplace", False))


def _to_meta(val: Any) -> Any:
    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
        return v

    return map_aggregate(val, conv)


def _meta_param(p: torch.Tensor) -> torch.Tensor:
    t = torch.empty_like(p, device="meta")
    return t.requires_grad_(p.requires_grad and p.is_floating_point())


def _grad_leaves(args: Any) -> Any:
    """Float tensors become leaves that require grad (as activations do in training)."""

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().requires_grad_(True)
        return v

    return map_aggregate(args, conv)


def _count_bwd(outputs: Any, wrt: list[torch.Tensor]) -> int:
    outs = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = [t for t in wrt if t.requires_grad]
    if not outs or not wrt:
        return 0
    with FlopCounterMode(display=False) as counter:
        torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
    return int(counter.get_total_flops())


def _iter_used(gm: fx.GraphModule, node: fx.Node, canon: dict[int, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters a node touches directly, under their canonical names.

    A tied parameter has several names (``wte.weight``, ``lm_head.weight``);
    ``canon`` maps it to the first one, so every user lists the same name.
    """
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        for name, p in sub.named_parameters():
            yield canon.get(id(p), f"{node.target}.{name}"), p
    elif node.op == "get_attr":
        obj = _fetch(gm, str(node.target))
        if isinstance(obj, torch.nn.Parameter):
            yield canon.get(id(obj), str(node.target)), obj


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _run_one(gm: fx.GraphModule, node: fx.Node, inplace: bool) -> tuple[int, int, int, Any]:
    """Run one node on meta: (fwd flops, bwd flops, saved activation bytes, inputs)."""
    attr_tensors: list[torch.Tensor] = []  # parameters reached through get_attr nodes (export graphs)

    def meta_input(n: fx.Node) -> Any:
        val = _grad_leaves(_to_meta(n.meta.get("val")))
        if n.op == "get_attr":
            attr_tensors.extend(t for t in tree_leaves(val) if isinstance(t, torch.Tensor))
        return val

    args, kwargs = map_arg((node.args, node.kwargs), meta_input)
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    run_args, run_kwargs = (map_aggregate((args, kwargs), lambda v: v.clone() if isinstance(v, torch.Tensor)
                                          and v.requires_grad else v) if inplace else (args, kwargs))
    params: list[torch.Tensor] = []
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        state = {k: _meta_param(v) for k, v in sub.state_dict(keep_vars=True).items()}
        params = [t for t in state.values() if t.requires_grad]
        call = lambda: torch.func.functional_call(sub, state, tuple(run_args), dict(run_kwargs))  # noqa: E731
    elif node.op == "call_method":
        self_obj, *rest = run_args
        call = lambda: getattr(self_obj, str(node.target))(*rest, **run_kwargs)  # noqa: E731
    else:
        call = lambda: node.target(*run_args, **run_kwargs)  # type: ignore[operator]  # noqa: E731
    param_ids = {id(p) for p in params + attr_tensors}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in param_ids and id(t._base) not in param_ids:
            base = t._base if t._base is not None else t
            saved[id(base)] = base.numel() * base.element_size()
        return t

    with torch.enable_grad(), FlopCounterMode(display=False) as counter, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call()
    fwd = int(counter.get_total_flops())
    bwd = _count_bwd(out, leaves + params)
    return fwd, bwd, sum(saved.values()), (args, kwargs)


def _saved_under_autocast(gm: fx.GraphModule, node: fx.Node, inplace: bool, precision: Precision,
                          dtypes: dict[str, torch.dtype]) -> tuple[int, torch.dtype | None]:
    """Bytes autograd saves for one node run under autocast (parameters excluded, their casts included), and the
    dtype of its output there (a single tensor's; None otherwise).

    ``dtypes`` holds the autocast output dtype of the nodes before, so that a node sees the inputs it gets
    under autocast (a matmul's output arrives in the compute dtype), not the traced fp32 ones.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        originals: set[int] = set()

        def fake(v: Any, dtype: torch.dtype | None = None, param: bool = False) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            t = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=dtype or v.dtype, device="cpu")
            if param:
                originals.add(id(t))
            return t.requires_grad_(True) if t.is_floating_point() else t

        def arg(n: fx.Node) -> Any:
            val = _to_meta(n.meta.get("val"))
            if isinstance(val, torch.Tensor):
                return fake(val, dtypes.get(n.name) if val.is_floating_point() else None, n.op == "get_attr")
            return map_aggregate(val, lambda v: fake(v, param=n.op == "get_attr"))

        args, kwargs = map_arg((node.args, node.kwargs), arg)
        if inplace:  # a leaf that requires grad cannot be written in place
            args, kwargs = map_aggregate((args, kwargs), lambda v: v.clone() if isinstance(v, torch.Tensor)
                                         and v.requires_grad else v)
        if node.op == "call_module":
            sub = gm.get_submodule(str(node.target))
            state = {k: fake(v, param=True) if v.requires_grad else fake(v).detach()
                     for k, v in sub.state_dict(keep_vars=True).items()}
            call = lambda: torch.func.functional_call(sub, state, tuple(args), dict(kwargs))  # noqa: E731
        elif node.op == "call_method":
            self_obj, *rest = args
            call = lambda: getattr(self_obj, str(node.target))(*rest, **kwargs)  # noqa: E731
        else:
            call = lambda: node.target(*args, **kwargs)  # type: ignore[operator]  # noqa: E731
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t._base if t._base is not None else t
            if id(base) not in originals:
                saved[id(base)] = base.numel() * base.element_size()
            return t

        with torch.enable_grad(), autocast("cpu", precision), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call()
    return sum(saved.values()), out.dtype if isinstance(out, torch.Tensor) else None


def analyze(gm: fx.GraphModule, precision: Precision | str = Precision.FP32) -> dict[str, NodeFacts]:
    """Static facts for every node of a traced GraphModule (see :func:`hpml_compile.trace`).

    Under a mixed ``precision`` the activation sizes are autocast's (see the module docstring).

    A node that cannot run on meta (an op without a meta kernel) gets zero
    FLOPs and a warning naming it; its sizes still come from the trace.
    """
    facts: dict[str, NodeFacts] = {}
    seen_params: set[int] = set()
    canon = {id(p): name for name, p in gm.named_parameters()}
    failed: list[str] = []
    prec = Precision(precision)
    dtypes: dict[str, torch.dtype] = {}  # node -> its output's dtype under autocast (mixed precision)
    for node in gm.graph.nodes:
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        used = list(_iter_used(gm, node, canon))
        param_bytes = 0
        for _, p in used:
            if id(p) not in seen_params:
                seen_params.add(id(p))
                param_bytes += p.numel() * p.element_size()
        fwd = bwd = act = 0
        in_bytes = sum(tensor_bytes(n.meta.get("val")) for n in node.all_input_nodes)
        if node.op in ("call_function", "call_method", "call_module") and \
                _target_name(node, module) not in _DEVICE_MOVES:
            try:
                fwd, bwd, act, _ = _run_one(gm, node, is_inplace(node, module))
                if prec.is_mixed:
                    try:
                        act, low = _saved_under_autocast(gm, node, is_inplace(node, module), prec, dtypes)
                        if low is not None:
                            dtypes[node.name] = low
                    except Exception:  # an op fake tensors cannot run: keep the fp32 count (an over-estimate)
                        pass
            except Exception as exc:  # an op without a meta kernel: keep going, say which
                failed.append(f"{node.name} ({type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''})")
        own_params = sum(p.numel() * p.element_size() for _, p in used) if node.op == "call_module" else 0
        kind = op_kind(node, module)
        mem = in_bytes + own_params + node_info(node).output_bytes if node.op != "get_attr" else 0
        if kind is OpKind.EMBEDDING:  # a lookup reads the rows it returns, not the whole table
            mem = sum(tensor_bytes(n.meta.get("val")) for n in node.all_input_nodes if n.op != "get_attr") \
                + 2 * node_info(node).output_bytes
        facts[node.name] = NodeFacts(
            op_kind=kind.value,
            flops=fwd,
            bwd_flops=bwd,
            activation_bytes=act,
            mem_bytes=mem,
            param_bytes=param_bytes,
            params=tuple(name for name, _ in used),
        )
    if failed:
        warnings.warn("no FLOP count for nodes that cannot run on the meta device: " + "; ".join(failed[:5])
                      + (f" and {len(failed) - 5} more" if len(failed) > 5 else ""), stacklevel=2)
    return facts


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous run of graph nodes that is timed as a unit: one repeated block, or a region between blocks.

    ``block`` is the module path of a repeated block (``"blocks.3"``), None for a region between blocks;
    ``signature`` is equal for two segments exactly when they run the same modules (relative to their
    block), the same ops, on the same shapes, wired the same way: such segments get one cost.
    """

    name: str
    nodes: tuple[str, ...]
    block: str | None
    signature: tuple[Any, ...]


_DIGITS = re.compile(r"^\d+$")


def _block_path(scope: str) -> str | None:
    """The module path up to the first numbered child: ``"blocks.3.attn.c_attn"`` -> ``"blocks.3"``."""
    parts = scope.split(".") if scope else []
    for i, part in enumerate(parts):
        if _DIGITS.match(part):
            return ".".join(parts[:i + 1])
    return None


def _relative(target: str, block: str | None) -> str:
    if block and target == block:
        return ""
    return target[len(block) + 1:] if block and target.startswith(block + ".") else target


def _node_signature(gm: fx.GraphModule, node: fx.Node, block: str | None, where: dict[str, int]) -> tuple[Any, ...]:
    info = node_info(node)
    if node.op in ("call_module", "get_attr"):
        target = _relative(str(node.target), block)
    elif node.op == "call_method":
        target = str(node.target)
    else:
        target = getattr(node.target, "__qualname__", None) or str(node.target)
    extra: tuple[Any, ...] = ()
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        extra = (type(sub).__qualname__, tuple((n, tuple(p.shape), str(p.dtype)) for n, p in sub.named_parameters()))
    elif node.op == "get_attr":
        val = node.meta.get("val")
        extra = (tuple(val.shape),) if isinstance(val, torch.Tensor) else ()
    wires = tuple(where.get(a.name, -1) for a in node.all_input_nodes)  # inside: position; outside: -1
    consts = tuple(repr(a) for a in tree_leaves((node.args, node.kwargs)) if not isinstance(a, fx.Node))
    return (node.op, target, info.shape, info.dtype, extra, wires, consts)


def segments(gm: fx.GraphModule) -> list[Segment]:
    """Split a traced graph into contiguous segments: each repeated block (the nodes whose module path runs
    through a numbered child, ``layers.3``) and each run of nodes between blocks.

    Placeholders, ``get_attr`` nodes (copied into every segment that reads them) and the output are in no
    segment. Segments are in graph order, so timing them one after the other runs the model in order.

    Example:
        >>> import torch
        >>> from hpml_compile.trace import trace
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        >>> segs = segments(trace(m, (torch.randn(4, 8),)))
        >>> [s.block for s in segs], segs[0].signature == segs[1].signature, segs[1].signature == segs[2].signature
        (['0', '1', '2'], True, False)
    """
    runs: list[tuple[str | None, list[fx.Node]]] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        block = _block_path(node_info(node).scope)
        if runs and runs[-1][0] == block:
            runs[-1][1].append(node)
        else:
            runs.append((block, [node]))
    out, regions = [], 0
    for block, nodes in runs:
        where = {n.name: i for i, n in enumerate(nodes)}
        sig = tuple(_node_signature(gm, n, block, where) for n in nodes)
        if block is None:
            name, regions = f"region {regions}", regions + 1
        else:
            name = block if all(s.name != block for s in out) else f"{block} ({len(out)})"
        out.append(Segment(name, tuple(n.name for n in nodes), block, sig))
    return out
