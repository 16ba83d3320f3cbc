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
from torch.utils._pytree import tree_leaves, tree_map

from .errors import TraceError
from .ir import FrontEnd

__all__ = ["NodeInfo", "trace", "node_info", "tensor_bytes", "buffers_restored"]


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


def _blame_module(exc: BaseException, model: torch.nn.Module) -> str:
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
        hint = (f"mark it as a leaf so it runs as one opaque node: leaf_modules=[{type(module).__name__}] "
                f"(CLI: --leaf {type(module).__name__}), or use the export front end"
                if qualname else
                "rewrite the control flow without Python branching on tensor values "
                "(torch.where), or use the export front end")
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


def _trace_export(model: torch.nn.Module, inputs: tuple[Any, ...]) -> fx.GraphModule:
    try:
        ep = torch.export.export(model, inputs, strict=False)
    except Exception as exc:
        raise TraceError(f"torch.export could not trace {type(model).__name__}: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    return gm


_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def _scope(node: fx.Node) -> str:
    """Qualified module path of a node: its call_module target or its innermost nn_module_stack entry."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
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
) -> fx.GraphModule:
    """Trace ``model`` into a GraphModule whose nodes carry shape, dtype and size metadata.

    Args:
        model: the module to trace; may live on the ``meta`` device.
        example_inputs: positional inputs (a tensor or a tuple of them) on the
            model's device; only their shapes and dtypes are used.
        leaf_modules: module classes, class names or qualified names to keep
            as single opaque nodes (torch.nn's own modules always are).
        front_end: ``fx``, ``export`` or ``auto`` (fx, then export on failure).

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
    gm: fx.GraphModule
    if fe is FrontEnd.EXPORT:
        gm, used = _trace_export(model, inputs), FrontEnd.EXPORT
    else:
        try:
            gm, used = _trace_fx(model, leaf_modules), FrontEnd.FX
        except TraceError as fx_err:
            if fe is FrontEnd.FX:
                raise
            try:
                gm, used = _trace_export(model, inputs), FrontEnd.EXPORT
            except TraceError as ex_err:
                raise TraceError(f"{fx_err}\nThe export front end failed too: {ex_err}") from fx_err
    with buffers_restored(gm):
        _propagate(gm, inputs)
    _annotate(gm)
    gm.meta["hpml_front_end"] = used
    return gm
