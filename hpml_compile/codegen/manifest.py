"""What ``manifest.json`` records about a build, and how it is read back.

The manifest is data, like every JSON file of a build: it records the sha256
of the model graph (its canonical text, also written as ``graph.txt``) and of
every file written beside it (``model.json`` included), the model inputs at
trace and at microbatch size, the collectives of the build, and each rank's
action list (:mod:`hpml_compile.schedule`), which the executor interprets
after :func:`hpml_compile.codegen.build.rank_actions` validated it. It never
names code to run: :func:`hpml_compile.codegen.load_build` regenerates the
stages' code from ``plan.json`` and the model and only compares the stage
files with it. The hashes are there so that a changed file is noticed and
named, not as a seal (anyone can recompute a sha256).

Example:
    >>> spec = InputSpec("idx", (2, 32), "int64")
    >>> InputSpec.from_dict(spec.to_dict()) == spec
    True
    >>> sha256("")[:12]
    'e3b0c44298fc'
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from ..errors import BuildMismatchError
from ..ir import FrontEnd, Precision
from ..schema import check_version, read_json, validate
from .actions import GradSync
from .partition import GUARD_TARGETS

__all__ = ["MANIFEST_FILE", "MANIFEST_VERSION", "MANIFEST_SCHEMA", "InputSpec", "Manifest", "sha256", "file_hashes",
           "input_specs", "leaf_modules", "read_manifest"]

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 2  # 2: collective tokens name their implementation (``ALLREDUCE.shm(0,1)``)
_READS = (1, MANIFEST_VERSION)  # a version-1 build loads where it has no collective (its tokens are the same)

_INPUT = {"type": "object", "required": ["name", "shape", "dtype"], "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "dtype": {"type": "string"}}}
MANIFEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "model", "graph_sha256", "front_end", "trace_inputs", "inputs",
                 "microbatches", "stages", "collectives", "files"],
    "additionalProperties": False,  # an unknown field is named, never silently ignored
    "properties": {
        "schema_version": {"type": "integer"},
        "model": {"type": "string"},
        "graph_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        "front_end": {"enum": [FrontEnd.FX.value, FrontEnd.EXPORT.value]},
        "leaf_modules": {"type": "array", "items": {"type": "string"}},
        "trace_inputs": {"type": "array", "items": _INPUT},
        "inputs": {"type": "array", "items": _INPUT},
        # optional: the names the model takes its inputs under, by keyword (none: positional)
        "keywords": {"type": "array", "items": {"type": "string"}},
        "microbatches": {"type": "integer", "minimum": 1},
        # optional: builds written before mixed precision are fp32
        "precision": {"enum": [p.value for p in Precision]},
        "stages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["index", "file", "class", "actions"], "additionalProperties": False,
            "properties": {
                "index": {"type": "integer", "minimum": 0}, "file": {"type": "string"},
                "class": {"type": "string"}, "actions": {"type": "array", "items": {"type": "string"}}}}},
        "collectives": {"type": "array", "items": {"type": "string"}},
        # optional: builds written before the schedule was lowered into the build have none
        "ranks": {"type": "array", "items": {
            "type": "object", "required": ["stage", "replica", "actions"], "additionalProperties": False,
            "properties": {
                "stage": {"type": "integer", "minimum": 0}, "replica": {"type": "integer", "minimum": 0},
                "actions": {"type": "array", "items": {"type": "string"}}}}},
        "files": {"type": "object", "additionalProperties": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
    },
}


def sha256(data: bytes | str) -> str:
    """Hex sha256 of bytes or of UTF-8 text."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


@dataclass(frozen=True, slots=True)
class InputSpec:
    """A model input: placeholder name, shape, dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "InputSpec":
        return cls(d["name"], tuple(d["shape"]), d["dtype"])


@dataclass(frozen=True, slots=True)
class Manifest:
    """What manifest.json holds (see the module docstring)."""

    model: str
    graph_sha256: str
    front_end: FrontEnd
    leaf_modules: tuple[str, ...]
    trace_inputs: tuple[InputSpec, ...]
    inputs: tuple[InputSpec, ...]
    microbatches: int
    stages: tuple[dict[str, Any], ...]
    collectives: tuple[str, ...]
    files: dict[str, str]
    ranks: tuple[dict[str, Any], ...] = ()
    precision: Precision = Precision.FP32
    keywords: tuple[str, ...] = ()
    schema_version: int = MANIFEST_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision(self.precision))

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "model": self.model, "graph_sha256": self.graph_sha256,
                "front_end": self.front_end.value, "leaf_modules": list(self.leaf_modules),
                "trace_inputs": [i.to_dict() for i in self.trace_inputs],
                "inputs": [i.to_dict() for i in self.inputs], "microbatches": self.microbatches,
                **({"keywords": list(self.keywords)} if self.keywords else {}),
                "precision": self.precision.value,
                "stages": [dict(s) for s in self.stages], "collectives": list(self.collectives),
                "files": dict(self.files), **({"ranks": [dict(r) for r in self.ranks]} if self.ranks else {})}

    @classmethod
    def from_dict(cls, d: Any, source: str = "manifest.json") -> "Manifest":
        """Build from parsed JSON, checking the schema first (raises SchemaError naming the field)."""
        validate(d, MANIFEST_SCHEMA, source)
        check_version(d, _READS, source)
        if d["schema_version"] == 1 and d["collectives"]:
            raise BuildMismatchError(f"{source}: a build of manifest version 1, whose collective tokens "
                                     f"({', '.join(d['collectives'][:2])}) do not name the implementation that "
                                     "runs them; this hpml-compile runs version-2 builds (e.g. "
                                     "ALLREDUCE.shm(0,1)): regenerate the build with `hpml-compile compile`")
        return cls(d["model"], d["graph_sha256"], FrontEnd(d["front_end"]), tuple(d.get("leaf_modules", ())),
                   tuple(InputSpec.from_dict(i) for i in d["trace_inputs"]),
                   tuple(InputSpec.from_dict(i) for i in d["inputs"]), d["microbatches"],
                   tuple(d["stages"]), tuple(d["collectives"]), dict(d["files"]), tuple(d.get("ranks", ())),
                   Precision(d.get("precision", "fp32")), tuple(d.get("keywords", ())))

    def groups(self) -> list[tuple[int, ...]]:
        """The stage groups of the build's collectives, in the order every rank runs them."""
        return [GradSync.parse(t).stages for t in self.collectives]


def input_specs(gm: fx.GraphModule, rows: int | None = None) -> tuple[InputSpec, ...]:
    """The tensor placeholders of ``gm`` with their traced shapes (with ``rows`` rows if given)."""
    out = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            shape = tuple(int(s) for s in val.shape)
            if rows is not None and shape:
                shape = (rows, *shape[1:])
            out.append(InputSpec(n.name, shape, str(val.dtype).removeprefix("torch.")))
    return tuple(out)


def leaf_modules(gm: fx.GraphModule) -> tuple[str, ...]:
    """Modules the trace kept opaque beyond torch.nn's own (so that a re-trace does the same)."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module" and n.target not in GUARD_TARGETS:
            mod = gm.get_submodule(str(n.target))
            if not type(mod).__module__.startswith(("torch.nn", "torch.ao.nn")):
                out.append(str(n.target))
    return tuple(dict.fromkeys(out))


def file_hashes(files: Mapping[str, str | bytes], names: Sequence[str]) -> dict[str, str]:
    """sha256 of each named file's content."""
    return {n: sha256(files[n]) for n in names}


def read_manifest(out_dir: Path) -> Manifest:
    """Read and check a build folder's ``manifest.json``.

    Args:
        out_dir: the build folder.

    Returns:
        The manifest.

    Raises:
        BuildMismatchError: there is none (not a build folder, or its generation did not finish).
        SchemaError: it is malformed (naming the field).
    """
    path = out_dir / MANIFEST_FILE
    if not path.is_file():
        raise BuildMismatchError(f"{path}: no manifest; {out_dir} is not a build folder (or its generation "
                                 f"did not finish): run `hpml-compile compile ... -o {out_dir}`")
    return Manifest.from_dict(read_json(path), source=str(path))
