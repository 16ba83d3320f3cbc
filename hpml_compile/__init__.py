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
"""

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
from .runtime import compile
from .trace import trace

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
__version__ = "0.1.0"
