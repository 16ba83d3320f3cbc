"""Base classes of the generated stage modules: weights bound from the user's model by name.

A generated ``stage_<k>.py`` defines ``class Stage<k>(StageModule)`` (and a
``RegionModule`` per recompute or swap region) with its ``forward`` written
out as Python. Its class attributes name what it needs from the model:
``TARGETS`` are the qualified names of the submodules, parameters and
buffers its graph uses. ``StageModule(model)`` binds those very objects (no
copy, no pickle), so in one process the stages share the model's weights and
its ``.grad`` fields, and a tied parameter used by two stages is one tensor.

Example:
    >>> import torch
    >>> class Head(RegionModule):
    ...     TARGETS = ("0",)
    ...     def forward(self, x):
    ...         return getattr(self, "0")(x)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    >>> head = Head(model)
    >>> head(torch.ones(1, 3)).shape, getattr(head, "0") is model[0]
    (torch.Size([1, 2]), True)
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import nn

from .ops import Comm, DetachedComm, SwapStats, TensorSpec

__all__ = ["bind", "RegionModule", "StageModule"]


def _lookup(model: nn.Module, target: str) -> Any:
    obj: Any = model
    for part in target.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"the model has no attribute {target!r} (missing {part!r}): the build was "
                                 f"generated for a model with different module names")
        obj = getattr(obj, part)
    return obj


def bind(owner: nn.Module, model: nn.Module, target: str,
         constants: Mapping[str, torch.Tensor] | None = None) -> None:
    """Make ``owner.<target>`` the model's object of that qualified name (like fx.GraphModule's copy, without copying).

    Args:
        owner: the stage or region module.
        model: the user's model (or a GraphModule traced from it).
        target: a qualified name, e.g. ``layers.0.attn`` or ``lm_head.weight``.
        constants: tensors the build carries (:mod:`.constants`), for targets that are not the model's.

    Raises:
        AttributeError: if neither the model nor ``constants`` has it.
        TypeError: if it is neither a module nor a tensor.
    """
    obj = constants[target] if constants and target in constants else _lookup(model, target)
    *path, leaf = target.split(".")
    here: nn.Module = owner
    for part in path:
        if not hasattr(here, part):
            # an empty container keeps fx's `getattr(self.layers, "0")` paths
            _add_fast(here, part, nn.Module())
        here = getattr(here, part)
    if isinstance(obj, nn.Module):
        _add_fast(here, leaf, obj)
    elif isinstance(obj, nn.Parameter):
        here.register_parameter(leaf, obj)
    elif isinstance(obj, torch.Tensor):
        here.register_buffer(leaf, obj)
    else:
        raise TypeError(f"model attribute {target!r} is a {type(obj).__name__}, not a module or tensor")


def _add_fast(owner: nn.Module, name: str, module: nn.Module) -> None:
    """``owner.add_module(name, module)``, and where ``owner`` is ours (a stage, a region or a container that
    :func:`bind` made), ``module`` also in its instance dict.

    Why: the generated forward reads every submodule it calls by attribute (``getattr(self, "3")``), and a
    module's ``_modules`` are reached only through ``nn.Module.__getattr__``, a Python call each time: on a
    model of many small ops (a 100-layer MLP of width 16) that was 5% of a step. An instance-dict entry is
    found by the interpreter without the call. It stays right: ``nn.Module.__setattr__`` drops the entry when
    a module is assigned to the name, and nothing rebinds a stage's submodules otherwise. The user's own
    modules are left as they are.
    """
    owner.add_module(name, module)
    if type(owner) is nn.Module or isinstance(owner, RegionModule):
        owner.__dict__[name] = module


class RegionModule(nn.Module):
    """A piece of a stage run under recompute or swap: its own forward over the model's weights."""

    TARGETS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: nn.Module, constants: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        for target in self.TARGETS:
            bind(self, model, target, constants)
        self.hpml_tp: Any = None  # a tensor-parallel stage's group (the runtime sets it)


class StageModule(RegionModule):
    """One pipeline stage: takes what its RECV tokens received, computes, leaves what its SEND tokens send.

    Class attributes (written by codegen):
        INDEX: the stage's position in the pipeline.
        INPUTS: the model inputs (placeholder names) this stage reads.
        TARGETS: qualified names bound from the model.
        REGIONS: attribute name -> RegionModule class, for recompute/swap regions.
        RECV: ``(shape, dtype, batch dim)`` of each tensor received from the previous stage per microbatch (at
            the first replica's rows), which its ``kRECVp:j`` tokens receive and its ``ops.recv`` takes;
            empty where it receives nothing.
        COLLECTIVES: each collective token of the stage's action lists -> the qualified names of the
            parameters it moves, in the order flattened on every rank.

    Instance attributes:
        hpml_comm: the communicator (an executor sets it).
        hpml_swap: swap counters.
    """

    INDEX: ClassVar[int] = 0
    INPUTS: ClassVar[tuple[str, ...]] = ()
    REGIONS: ClassVar[Mapping[str, type[RegionModule]]] = {}
    RECV: ClassVar[tuple[TensorSpec, ...]] = ()
    COLLECTIVES: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    TP: ClassVar[int] = 1  # the tensor-parallel degree the code is one rank's shard of
    TP_SHARDS: ClassVar[tuple[tuple[str, int], ...]] = ()  # (parameter, dimension) a rank holds a slice of

    def __init__(self, model: nn.Module, constants: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__(model, constants)
        for name, cls in self.REGIONS.items():
            _add_fast(self, name, cls(model, constants))
        self.hpml_comm: Comm = DetachedComm()
        self.hpml_swap = SwapStats()

    def params(self, *names: str) -> list[nn.Parameter]:
        """The bound parameters of these qualified names (here or in a region), in this order.

        Each list of names is resolved once to the parameter tables of the modules holding them (the generated
        sync asks every step: resolving a hundred dotted names cost 1.6 ms a step, benchmarks/ddp_compare, and
        a Python loop over the names still 50 us on the small-op MLP); the parameters themselves are read from
        those tables each time, so one re-registered under a name is the one returned.
        """
        tables = self.__dict__.setdefault("_hpml_tables", {})
        where = tables.get(names)
        if where is None:
            where = tables[names] = [(module._parameters, leaf) for module, leaf in map(self._where, names)]
        out = [table.get(leaf) for table, leaf in where]
        for p in out:
            if p is None:  # no longer there: resolved again
                del tables[names]
                return [self._param(n) for n in names]
        return out  # type: ignore[return-value]

    def _where(self, name: str) -> tuple[nn.Module, str]:
        path, _, leaf = name.rpartition(".")
        for owner in (self, *(getattr(self, r) for r in self.REGIONS)):
            try:
                module = owner.get_submodule(path) if path else owner
            except AttributeError:
                continue
            if isinstance(module._parameters.get(leaf), nn.Parameter):
                return module, leaf
        raise AttributeError(f"stage {self.INDEX} binds no parameter {name!r}")

    def _param(self, name: str) -> nn.Parameter:
        module, leaf = self._where(name)
        return module._parameters[leaf]  # type: ignore[return-value]
