"""Pass 1, trace: an ``nn.Module`` and example inputs -> an fx GraphModule with shapes.

Two front ends, both giving a ``torch.fx.GraphModule``:

* ``fx``: ``torch.fx.symbolic_trace`` through a tracer with a leaf-module
  policy (torch.nn modules and whatever the user names stay opaque nodes).
  Readable graphs whose call_module nodes keep the model's own names.
* ``export``: ``torch.export.export(strict=False)``, for models plain fx
  cannot trace (transformers 5.x models, say); its graph holds aten ops.

``auto`` tries fx and falls back to export. Shapes, dtypes and sizes are then
propagated on fake tensors (``FakeTensorProp``), so no activation is ever
allocated; a model built on the ``meta`` device has no weights either, which
is how a 70B config traces on a laptop.

Every node ends with ``node.meta["hpml"]``, a :class:`NodeInfo`.

Example:
    >>> import torch
    >>> gm = trace(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), (torch.randn(2, 4),))
    >>> [(n.name, n.meta["hpml"].shape) for n in gm.graph.nodes]
    [('input_1', (2, 4)), ('_0', (2, 3)), ('_1', (2, 3)), ('output', (2, 3))]
"""

from __future__ import annotations

import linecache
import logging
import re
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils._pytree import tree_leaves, tree_map, tree_unflatten

from .errors import TraceError
from .ir import FrontEnd

__all__ = ["NodeInfo", "trace", "node_info", "tensor_bytes", "buffers_restored", "fixed_shapes", "output_structure",
           "repeated_blocks"]

_LOG = logging.getLogger("hpml_compile")


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """Static facts about one traced node.

    Attributes:
        shape: shape of the output when it is a single tensor, else None.
        dtype: dtype name of that tensor, else None.
        output_bytes: bytes of every tensor in the output (tuples included).
        tensor_output: True when the output is a tensor or a tuple of tensors
            (only such values may cross a pipeline stage boundary).
        scope: qualified name of the innermost module the node belongs to
            ("" for the top level), e.g. ``layers.3.attn``.
    """

    shape: tuple[int, ...] | None
    dtype: str | None
    output_bytes: int
    tensor_output: bool
    scope: str


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor found in a (nested) value."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def node_info(node: fx.Node) -> NodeInfo:
    """The :class:`NodeInfo` that :func:`trace` stored on ``node``."""
    try:
        return node.meta["hpml"]
    except KeyError:
        raise TraceError(f"node {node.format_node()} has no shape information: "
                         "pass the graph through hpml_compile.trace() first") from None


@contextmanager
def buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """Put every buffer back as it was on exit.

    Running a model in training mode updates buffers in place (BatchNorm's
    running statistics, ``num_batches_tracked``) -- even under FakeTensorMode,
    which writes through to a real buffer. Analysing a model must not change it.
    """
    saved = {name: b.detach().clone() for name, b in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in saved and not b.is_meta:
                    b.copy_(saved[name])


class _LeafTracer(fx.Tracer):
    """fx tracer whose leaves are torch.nn's modules plus the user's."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_names: frozenset[str]) -> None:
        super().__init__()
        self._leaf_types, self._leaf_names = leaf_types, leaf_names

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if qualname in self._leaf_names or type(m).__name__ in self._leaf_names:
            return True
        if self._leaf_types and isinstance(m, self._leaf_types):
            return True
        return super().is_leaf_module(m, qualname)


def _split_leaves(leaf_modules: Iterable[type | str]) -> tuple[tuple[type, ...], frozenset[str]]:
    types: list[type] = []
    names: set[str] = set()
    for leaf in leaf_modules:
        if isinstance(leaf, type) and issubclass(leaf, torch.nn.Module):
            types.append(leaf)
        elif isinstance(leaf, str):
            names.add(leaf)
        else:
            raise TraceError(f"leaf_modules entries must be nn.Module classes or names "
                             f"(class name or qualified module name), got {leaf!r}")
    return tuple(types), frozenset(names)


def _blame_module(exc: BaseException, model: torch.nn.Module, exported: bool = False) -> str:
    """Name the innermost module of ``model`` (and its source line) active when ``exc`` was raised."""
    owners = {id(m): (name, m) for name, m in model.named_modules()}
    blamed = ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        code = frame.f_code
        first_arg = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        owner = owners.get(id(first_arg))
        if owner is None or code.co_name != "forward":
            continue
        qualname, module = owner
        src = linecache.getline(frame.f_code.co_filename, lineno).strip()
        label = f"module '{qualname}' ({type(module).__name__})" if qualname else f"the top-level module ({type(module).__name__})"
        blamed = f"{label} at {frame.f_code.co_filename}:{lineno}: `{src}`"
        leaf = type(module).__name__
        hint = ((f"rewrite its branch on tensor values without Python control flow (torch.where, torch.cond), "
                 f"or trace with the fx front end keeping it as one opaque node: front_end='fx', "
                 f"leaf_modules=[{leaf}] (CLI: --front-end fx --leaf {leaf})"
                 if exported else
                 f"mark it as a leaf so it runs as one opaque node: leaf_modules=[{leaf}] "
                 f"(CLI: --leaf {leaf}), or use the export front end")
                if qualname else
                "rewrite the control flow without Python branching on tensor values (torch.where)"
                + ("" if exported else ", or use the export front end"))
        blamed += f"; {hint}"
    return blamed


def _trace_fx(model: torch.nn.Module, leaf_modules: Sequence[type | str]) -> fx.GraphModule:
    tracer = _LeafTracer(*_split_leaves(leaf_modules))
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises many kinds; we re-raise with a location
        where = _blame_module(exc, model) or "no module of the model on the stack"
        raise TraceError(f"torch.fx could not trace {type(model).__name__}: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                         f"-- in {where}") from exc
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _cache_off(model: torch.nn.Module) -> None:
    """Training never reads a KV cache: turn ``config.use_cache`` off so that no cache object reaches the graph.

    Submodules may hold configs of their own (an encoder-decoder's decoder stack): each is turned off.
    """
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    found = [c for c in configs.values() if getattr(c, "use_cache", False) is True]
    for config in found:
        config.use_cache = False
    if found:
        _LOG.warning("hpml-compile: %s.config.use_cache set to False for training (a KV cache is for generation)",
                     type(model).__name__)


def _batch_dims(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dynamic_shapes`` giving every batched tensor input one symbolic first dimension (None: no batch to share).

    A tensor input is batched when its first dimension equals the first tensor input's; every other
    dimension (sequence, channels, image sizes) stays static.
    """
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim()]
    if not leaves or int(leaves[0].shape[0]) < 2:  # export specialises sizes 0 and 1: no symbol to keep
        return None
    rows = int(leaves[0].shape[0])
    batch = torch.export.Dim("batch", min=1)

    def spec(x: Any) -> Any:
        return {0: batch} if isinstance(x, torch.Tensor) and x.dim() and int(x.shape[0]) == rows else None

    if kwargs:
        return {k: tree_map(spec, v) for k, v in kwargs.items()}
    return tuple(tree_map(spec, a) for a in args)


def _export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """``torch.export`` with a symbolic batch where the model allows one, else with the traced shapes."""
    dims = _batch_dims(model, args, kwargs)
    if dims is None:
        return torch.export.export(model, args, kwargs or None, strict=False), False
    try:
        return torch.export.export(model, args, kwargs or None, dynamic_shapes=dims, strict=False), True
    except Exception as exc:  # a model that fixes its batch (a reshape to a constant): one graph per size
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    ep = torch.export.export(model, args, kwargs or None, strict=False)  # raises what stops any export
    _LOG.warning("hpml-compile: %s does not export with a symbolic batch (%s); its graph is fixed at the traced "
                 "shapes", type(model).__name__, why)
    return ep, False


def _owned(model: torch.nn.Module, target: str) -> bool:
    obj: Any = model
    for part in target.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return isinstance(obj, torch.Tensor)


def _trace_export(model: torch.nn.Module, inputs: tuple[Any, ...], names: Sequence[str] | None) -> fx.GraphModule:
    """Export ``model`` and flatten the result into a plain GraphModule (flat inputs, flat outputs).

    The model's output structure (a tensor, tuple, dict or ``ModelOutput``) is kept as
    ``gm.meta["hpml_out_spec"]`` (a pytree spec over the output node's flat values); tensors the graph
    reads that are not attributes of ``model`` (constants export lifted out of ``forward``) are kept as
    ``gm.meta["hpml_constants"]``, which a build carries as data.
    """
    _cache_off(model)
    seen: set[int] = set()
    own = []  # export merges inputs that are one tensor (labels = input_ids): one placeholder each, as at run time
    for x in inputs:
        own.append(x.clone() if isinstance(x, torch.Tensor) and id(x) in seen else x)
        seen.add(id(x))
    args, kwargs = ((), dict(zip(names, own))) if names else (tuple(own), {})
    try:
        ep, dynamic = _export(model, args, kwargs)
    except Exception as exc:
        raise TraceError(f"torch.export could not trace {type(model).__name__}: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
                         + (_blame_module(exc, model, exported=True) or "Try the fx front end, or mark the failing submodule "
                            "as a leaf (leaf_modules=[...])")) from exc
    gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    out_spec = gm.graph._codegen.pytree_info.out_spec if isinstance(gm.graph._codegen, fx.graph._PyTreeCodeGen) \
        else None
    gm.graph._codegen = fx.graph.CodeGen()  # flat placeholders in, the flat output tuple out
    if dynamic:  # the guards re-check the traced shapes; a graph that serves every row count drops them
        for n in [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
            gm.graph.erase_node(n)
    _attrs_at_first_use(gm)
    _sizes_at_use(gm)
    gm.recompile()
    gm.meta["hpml_out_spec"] = out_spec
    gm.meta["hpml_dynamic_batch"] = dynamic
    gm.meta["hpml_keywords"] = tuple(names or ())
    gm.meta["hpml_constants"] = {
        str(n.target): _attr(gm, str(n.target)) for n in gm.graph.nodes
        if n.op == "get_attr" and isinstance(_attr(gm, str(n.target)), torch.Tensor)
        and not _owned(model, str(n.target))}
    return gm


def _attrs_at_first_use(gm: fx.GraphModule) -> None:
    """Move each ``get_attr`` node to just before its first user, in that user's module scope.

    ``ExportedProgram.module()`` reads every parameter and buffer at the top of the graph, outside every
    module: in graph order they would all fall in the first block, and so on the first stage, whose rank
    would then hold the whole model. At their first use they go with the block that reads them (a tied
    weight with its first reader; later stages receive it as they receive any value).
    """
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and n.users]:
        first = min(node.users, key=position.__getitem__)
        if "nn_module_stack" not in node.meta and "nn_module_stack" in first.meta:
            node.meta["nn_module_stack"] = dict(first.meta["nn_module_stack"])
        first.prepend(node)


def _sizes_at_use(gm: fx.GraphModule) -> None:
    """Give each reader of an input's symbolic size (``sym_size.int(input_ids, 0)``, the batch) its own read.

    With a symbolic batch, export reads the batch size once at the top and every layer uses that
    integer; a value that is not a tensor cannot cross a stage boundary, so no stage could end between
    two layers. Read again just before each use (from the graph input, which every stage can read), the
    size no longer ties the layers together.
    """
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.sym_size.int
                 and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder" and len(n.users) > 1]:
        for user in list(node.users):
            with gm.graph.inserting_before(user):
                read = gm.graph.call_function(node.target, node.args, node.kwargs)
            read.meta = dict(node.meta)
            if "nn_module_stack" in user.meta:
                read.meta["nn_module_stack"] = dict(user.meta["nn_module_stack"])
            user.replace_input_with(node, read)
        gm.graph.erase_node(node)


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def repeated_blocks(model: torch.nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks: the items of each ``ModuleList``/``Sequential`` whose
    items (two or more) share one class (``GPT2Block``, ``LlamaDecoderLayer``, ``BertLayer``, ``ViTLayer``...).

    These are the natural cut points of a pipeline; :func:`hpml_compile.costgraph.block_key` makes each one a
    unit of the coarsened graph. Outermost lists first, in module order.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.ReLU(), torch.nn.ReLU()]))
        >>> repeated_blocks(net)
        ['1.0', '1.1']
    """
    out: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) or len(m) < 2:
            continue
        kinds = {type(c) for c in m.children()}
        if len(kinds) == 1 and not any(name.startswith(o.rpartition(".")[0] + ".") for o in out if "." in o):
            out.extend(f"{name}.{k}" if name else str(k) for k in range(len(m)))
    return out


def fixed_shapes(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` runs only at the shapes it was traced with (an export without a symbolic batch)."""
    return gm.meta.get("hpml_front_end") is FrontEnd.EXPORT and not gm.meta.get("hpml_dynamic_batch", False)


def output_structure(gm: fx.GraphModule, flat: Any) -> Any:
    """The model's own output (tensor, tuple, dict, ``ModelOutput``) from the graph's flat output values."""
    spec = gm.meta.get("hpml_out_spec")
    return flat if spec is None else tree_unflatten(list(flat), spec)


_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def _scope(node: fx.Node) -> str:
    """Qualified module path of a node: its call_module target or its innermost nn_module_stack entry."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    if path.startswith("_empty_nn_module_stack"):  # export's placeholder for "no module": the top level
        return ""
    # torch.export writes paths like "L['self'].layers[3].attn" or "layers.3.attn"
    path = path.replace("L['self']", "").replace("L[\"self\"]", "")
    path = _INDEX.sub(r".\1", path).strip(".")
    return path


def _annotate(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        leaves = tree_leaves(val)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        single = val if isinstance(val, torch.Tensor) else None
        node.meta["hpml"] = NodeInfo(
            shape=tuple(int(s) for s in single.shape) if single is not None else None,
            dtype=str(single.dtype).removeprefix("torch.") if single is not None else None,
            output_bytes=tensor_bytes(val),
            tensor_output=bool(leaves) and len(tensors) == len(leaves),
            scope=_scope(node),
        )


class _LeafAwareFakeProp(FakeTensorProp):
    """FakeTensorProp that runs a leaf module for real when fake tensors cannot.

    A leaf module is often a leaf precisely because it branches on tensor
    values, which fake tensors refuse (DataDependentOutputException). Such a
    node runs once eagerly on random inputs of the right shapes; its output is
    turned back into fake tensors. This needs real weights: on a meta model
    the error names the node.
    """

    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            if n.op != "call_module":
                raise
            module = self.fetch_attr(str(n.target))
            if any(p.is_meta for p in module.parameters()):
                raise TraceError(f"node {n.format_node()}: leaf module '{n.target}' branches on tensor "
                                 "values, which a meta-device model cannot evaluate; trace it with real "
                                 "weights or make the branch tensor-free (torch.where)") from exc
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            with unset_fake_temporarily():
                real = tree_map(_materialize, (args, kwargs))
                out = module(*real[0], **real[1])
            fake = tree_map(lambda t: self._mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, out)
            n.meta["val"] = fake
            return fake


def _materialize(x: Any) -> Any:
    """A real tensor with the shape and dtype of a fake one (random floats, zero integers)."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return torch.randn(tuple(x.shape), dtype=x.dtype, device="cpu")
    return torch.zeros(tuple(x.shape), dtype=x.dtype, device="cpu")


def _propagate(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> None:
    """Shapes on fake tensors: no activation memory, no weights needed."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    prop = _LeafAwareFakeProp(gm, mode)
    try:
        prop.propagate(*fake_inputs)
    except Exception as exc:
        # Interpreter notes the failing node in the message; keep it and say what to do.
        raise TraceError(f"shape propagation failed: {type(exc).__name__}: {exc}. "
                         "Check that the example inputs have the shapes and dtypes the model expects") from exc


def trace(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor,
    *,
    leaf_modules: Sequence[type | str] = (),
    front_end: FrontEnd | str = FrontEnd.AUTO,
    input_names: Sequence[str] | None = None,
) -> fx.GraphModule:
    """Trace ``model`` into a GraphModule whose nodes carry shape, dtype and size metadata.

    The export front end keeps the batch (the first dimension of every input
    that has the first input's rows) symbolic, so one graph runs at every row
    count a microbatch or a replica gets; its graph takes the inputs' tensors
    flat and returns the output's tensors flat (:func:`output_structure`
    rebuilds what the model returns).

    Args:
        model: the module to trace; may live on the ``meta`` device.
        example_inputs: the inputs (a tensor or a tuple of them) on the
            model's device; only their shapes and dtypes are used.
        leaf_modules: module classes, class names or qualified names to keep
            as single opaque nodes (torch.nn's own modules always are).
        front_end: ``fx``, ``export`` or ``auto`` (fx, then export on failure).
        input_names: pass the inputs by keyword under these names (``input_ids``,
            ``attention_mask``, ``labels``...); keyword inputs use the export front end.

    Returns:
        A GraphModule; each node has ``meta["hpml"]`` (:class:`NodeInfo`) and
        ``meta["val"]`` (a fake tensor), and the module has ``meta["hpml_front_end"]``.

    Raises:
        TraceError: naming the module and source line that could not be traced,
            with the leaf module to mark or the front end to try.
    """
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"trace() needs an nn.Module, got {type(model).__name__}")
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    fe = FrontEnd(front_end)
    names = tuple(input_names or ())
    if names and len(names) != len(inputs):
        raise TraceError(f"trace(): {len(names)} input names {list(names)} for {len(inputs)} inputs; give one "
                         "name per input")
    if names and fe is FrontEnd.FX:
        raise TraceError("trace(): keyword inputs need the export front end (front_end='export' or 'auto')")
    gm: fx.GraphModule
    if fe is FrontEnd.EXPORT or names:
        gm, used = _trace_export(model, inputs, names), FrontEnd.EXPORT
    else:
        try:
            gm, used = _trace_fx(model, leaf_modules), FrontEnd.FX
        except TraceError as fx_err:
            if fe is FrontEnd.FX:
                raise
            try:
                gm, used = _trace_export(model, inputs, names), FrontEnd.EXPORT
            except TraceError as ex_err:
                raise TraceError(f"{fx_err}\nThe export front end failed too: {ex_err}") from fx_err
    with buffers_restored(gm):
        _propagate(gm, inputs)
    _annotate(gm)
    gm.meta["hpml_front_end"] = used
    return gm
