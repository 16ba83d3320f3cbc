"""hpml-compile: compile a PyTorch model for many devices.

The passes, each a function of the previous one's output::

    gm   = hpml_compile.trace(model, example_inputs)          # torch.fx graph with shapes
    prof = hpml_compile.profile(gm, example_inputs,           # per-node costs per device kind
                                device_kinds=["cpu", "A100-80GB"])
    hpml_compile.save_profile(prof, "profile.json")
    cg   = hpml_compile.build_costgraph(prof).coarsen()       # blocks for the solver

Example:
    >>> import torch, hpml_compile
    >>> m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
    >>> prof = hpml_compile.profile(m, (torch.randn(4, 16),), repeats=2, progress=False)
    >>> [n.name for n in prof.nodes]
    ['input_1', '_0', '_1', 'output']

``compile`` (the whole pipeline, from :mod:`hpml_compile.runtime`) is imported
on first use, not with the package: planning, showing or re-planning a model
never starts torch.distributed, and a process that only reads a plan stays
light.
"""

from importlib import metadata as _metadata

from .codegen import Build, generate, load_build
from .cluster import discover
from .costgraph import CostGraph
from .costgraph import build as build_costgraph
from .errors import (
    BuildMismatchError,
    HpmlError,
    InfeasibleError,
    ModelError,
    SchemaError,
    TraceError,
    UnknownDeviceError,
)
from .ir import Cluster, Device, FrontEnd, Link, NodeCost, Profile, ProfileNode
from .profile import load_profile, predict_kinds, profile, save_profile
from .trace import trace
from .trainspec import TrainSpec

__all__ = [
    "trace",
    "profile",
    "predict_kinds",
    "save_profile",
    "load_profile",
    "build_costgraph",
    "generate",
    "load_build",
    "compile",
    "TrainSpec",
    "Build",
    "CostGraph",
    "discover",
    "Profile",
    "ProfileNode",
    "NodeCost",
    "Cluster",
    "Device",
    "Link",
    "FrontEnd",
    "HpmlError",
    "SchemaError",
    "TraceError",
    "ModelError",
    "UnknownDeviceError",
    "InfeasibleError",
    "BuildMismatchError",
]
try:  # the installed distribution's version, the one `hpml-compile --version` prints
    __version__ = _metadata.version("hpml-compile")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# Public names that live in the runtime, resolved by __getattr__ on first use.
_LAZY = {"compile": "runtime"}


def __getattr__(name: str) -> object:
    """Import a runtime name on first use (PEP 562), so that ``import hpml_compile`` does not import the runtime.

    Args:
        name: the attribute asked for.

    Returns:
        The attribute, cached in the module afterwards.

    Raises:
        AttributeError: if the package has no such name.
    """
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazily imported ones included."""
    return sorted({*globals(), *_LAZY})
