"""The build folder: stage files, plan.json, profile.json, graph.txt and a manifest of hashes.

``manifest.json`` records the sha256 of the model graph (its canonical text,
also written as ``graph.txt``) and of every generated file, the model inputs
at trace and at microbatch size, the collectives of the build, and each
rank's action list (:mod:`hpml_compile.schedule`): what the executor runs.
:func:`load_build` re-checks every hash and refuses, naming the file, a stage
that was edited by hand or a model whose graph is not the one the build was
made for; then it validates the action lists (matched messages, no deadlock),
imports the stage files (they are the user's own build output, not data) and
binds each stage to the user's model's weights.

Example:
    >>> spec = InputSpec("idx", (2, 32), "int64")
    >>> InputSpec.from_dict(spec.to_dict()) == spec
    True
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.fx as fx

from ..errors import BuildMismatchError
from ..ir import FrontEnd
from ..plan import Plan, load_plan
from ..schedule import RankActions, lower, parse_actions
from ..schedule import validate as validate_actions
from ..schema import check_version, read_json, validate, write_json_atomic
from ..trace import trace
from .actions import GradSync
from .partition import GUARD_TARGETS, canonical_text
from .stage import StageModule

__all__ = ["MANIFEST_VERSION", "MANIFEST_SCHEMA", "InputSpec", "Manifest", "Build", "sha256", "write_files",
           "load_build", "rank_actions", "input_specs", "leaf_modules"]

MANIFEST_VERSION = 1
_STAGE_FILE = re.compile(r"^stage_\d+\.py$")

_INPUT = {"type": "object", "required": ["name", "shape", "dtype"], "properties": {
    "name": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "dtype": {"type": "string"}}}
MANIFEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "model", "graph_sha256", "front_end", "trace_inputs", "inputs",
                 "microbatches", "stages", "collectives", "files"],
    "properties": {
        "schema_version": {"type": "integer"},
        "model": {"type": "string"},
        "graph_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        "front_end": {"enum": [FrontEnd.FX.value, FrontEnd.EXPORT.value]},
        "leaf_modules": {"type": "array", "items": {"type": "string"}},
        "trace_inputs": {"type": "array", "items": _INPUT},
        "inputs": {"type": "array", "items": _INPUT},
        "microbatches": {"type": "integer", "minimum": 1},
        "stages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["index", "file", "class", "actions"], "properties": {
                "index": {"type": "integer", "minimum": 0}, "file": {"type": "string"},
                "class": {"type": "string"}, "actions": {"type": "array", "items": {"type": "string"}}}}},
        "collectives": {"type": "array", "items": {"type": "string"}},
        # optional: builds written before the schedule was lowered into the build have none
        "ranks": {"type": "array", "items": {
            "type": "object", "required": ["stage", "replica", "actions"], "properties": {
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
    schema_version: int = MANIFEST_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "model": self.model, "graph_sha256": self.graph_sha256,
                "front_end": self.front_end.value, "leaf_modules": list(self.leaf_modules),
                "trace_inputs": [i.to_dict() for i in self.trace_inputs],
                "inputs": [i.to_dict() for i in self.inputs], "microbatches": self.microbatches,
                "stages": [dict(s) for s in self.stages], "collectives": list(self.collectives),
                "files": dict(self.files), **({"ranks": [dict(r) for r in self.ranks]} if self.ranks else {})}

    @classmethod
    def from_dict(cls, d: Any, source: str = "manifest.json") -> "Manifest":
        """Build from parsed JSON, checking the schema first (raises SchemaError naming the field)."""
        validate(d, MANIFEST_SCHEMA, source)
        check_version(d, MANIFEST_VERSION, source)
        return cls(d["model"], d["graph_sha256"], FrontEnd(d["front_end"]), tuple(d.get("leaf_modules", ())),
                   tuple(InputSpec.from_dict(i) for i in d["trace_inputs"]),
                   tuple(InputSpec.from_dict(i) for i in d["inputs"]), d["microbatches"],
                   tuple(d["stages"]), tuple(d["collectives"]), dict(d["files"]), tuple(d.get("ranks", ())))

    def groups(self) -> list[tuple[int, ...]]:
        """The stage groups of the build's collectives, in the order every rank runs them."""
        return [GradSync.parse(t).stages for t in self.collectives]


@dataclass(frozen=True, slots=True, eq=False)
class Build:
    """A loaded build: the plan, the manifest and one module per stage, bound to a model's weights.

    Attributes:
        out_dir: the build folder.
        plan: the plan it carries out.
        manifest: its manifest.
        stages: ``stages[k]`` runs stage ``k`` (``forward``, ``sync_grads``, ``after_step``).
        actions: each rank's action list, validated (:mod:`hpml_compile.schedule`).
    """

    out_dir: Path
    plan: Plan
    manifest: Manifest
    stages: tuple[StageModule, ...]
    actions: tuple[RankActions, ...] = ()

    def source(self, stage: int) -> str:
        """The generated Python of a stage."""
        return (self.out_dir / self.manifest.stages[stage]["file"]).read_text()


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


def write_files(out_dir: Path, files: dict[str, str | bytes], manifest: Manifest) -> None:
    """Write the generated files, then the manifest (last, so that a half-written build does not load)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "manifest.json").unlink(missing_ok=True)
    for old in out_dir.iterdir():  # stage files of an earlier build with more stages would only confuse
        if _STAGE_FILE.match(old.name) and old.name not in files:
            old.unlink()
    for name, data in files.items():
        path = out_dir / name
        if isinstance(data, str):
            path.write_text(data)
        else:
            path.write_bytes(data)
    write_json_atomic(manifest.to_dict(), out_dir / "manifest.json")


def _read_manifest(out_dir: Path) -> Manifest:
    path = out_dir / "manifest.json"
    if not path.is_file():
        raise BuildMismatchError(f"{path}: no manifest; {out_dir} is not a build folder (or its generation "
                                 "did not finish): run `hpml-compile compile ... -o {out_dir}`")
    return Manifest.from_dict(read_json(path), source=str(path))


def _check_files(out_dir: Path, manifest: Manifest) -> None:
    for name, want in manifest.files.items():
        path = out_dir / name
        if not path.is_file():
            raise BuildMismatchError(f"{path}: listed in manifest.json but missing; regenerate the build")
        got = sha256(path.read_bytes())
        if got != want:
            raise BuildMismatchError(
                f"{path} was changed after it was generated (sha256 {got[:12]}..., manifest.json says "
                f"{want[:12]}...): hand-edited build files are refused. Regenerate the build with "
                "`hpml-compile compile`, or restore the file")


def _retrace(model: torch.nn.Module, manifest: Manifest) -> fx.GraphModule:
    inputs = [torch.zeros(i.shape, dtype=getattr(torch, i.dtype)) for i in manifest.trace_inputs]
    return trace(model, tuple(inputs), leaf_modules=manifest.leaf_modules, front_end=manifest.front_end)


def _check_graph(out_dir: Path, manifest: Manifest, gm: fx.GraphModule) -> None:
    text = canonical_text(gm)
    got = sha256(text)
    if got == manifest.graph_sha256:
        return
    stored = (out_dir / "graph.txt").read_text().splitlines() if (out_dir / "graph.txt").is_file() else []
    mine = text.splitlines()
    first = next((i for i, (a, b) in enumerate(zip(stored, mine)) if a != b), min(len(stored), len(mine)))
    theirs = stored[first] if first < len(stored) else "<end>"
    ours = mine[first] if first < len(mine) else "<end>"
    diff = f"first difference at graph line {first + 1}: the build has `{theirs}`, this model has `{ours}`" \
        if stored else "graph.txt is missing"
    raise BuildMismatchError(
        f"{out_dir / 'manifest.json'}: this model's graph (sha256 {got[:12]}...) is not the one the build was "
        f"generated for (model {manifest.model!r}, sha256 {manifest.graph_sha256[:12]}...); {diff}. "
        "The build (and its plan.json) belongs to another model: compile this model instead")


def _import_stage(path: Path, class_name: str, digest: str) -> type[StageModule]:
    spec = importlib.util.spec_from_file_location(f"hpml_build_{digest[:16]}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, StageModule)):
        raise BuildMismatchError(f"{path}: defines no StageModule named {class_name}; regenerate the build")
    return cls


def load_build(out_dir: str | Path, model: torch.nn.Module, *,
               graph_module: fx.GraphModule | None = None) -> Build:
    """Load a build folder and bind its stages to ``model``'s weights.

    Args:
        out_dir: the folder :func:`hpml_compile.codegen.generate` wrote.
        model: the user's model (weights, buffers and submodules are taken
            from it by name, never from files).
        graph_module: ``model`` already traced the way the build was (skips
            the re-trace that checks the model graph).

    Returns:
        The build, one stage module per stage.

    Raises:
        BuildMismatchError: naming the file: a stage file, plan.json or
            profile.json changed since generation, a file missing, or a model
            whose graph differs from the build's (a build for another model).
        SchemaError: a malformed manifest.json or plan.json.
    """
    out = Path(out_dir)
    manifest = _read_manifest(out)
    _check_files(out, manifest)
    _check_graph(out, manifest, graph_module if graph_module is not None else _retrace(model, manifest))
    plan = load_plan(out / "plan.json")
    actions = rank_actions(manifest, plan)
    stages = []
    for entry in manifest.stages:
        path = out / entry["file"]
        cls = _import_stage(path, entry["class"], manifest.files[entry["file"]])
        stages.append(cls(model))
    return Build(out, plan, manifest, tuple(stages), tuple(actions))


def rank_actions(manifest: Manifest, plan: Plan) -> list[RankActions]:
    """Each rank's action list from the manifest, validated before anything runs.

    A build written before the schedule was lowered into the manifest has no
    ``ranks``: its lists are lowered here from plan.json (schedule,
    microbatches, replicas) and the boundary and collective tokens of the
    manifest's stages, as codegen would lower them now.

    Args:
        manifest: the build's manifest.
        plan: its plan.

    Returns:
        One tuple of actions per rank.

    Raises:
        BuildMismatchError: the lists do not fit the plan's ranks, or a token does not parse.
        ScheduleError: an unmatched send or receive, a rank waiting on itself, an order that deadlocks.
    """
    replicas = [len(st.devices) for st in plan.stages]
    if manifest.ranks:
        layout = [(k, i) for k, d in enumerate(replicas) for i in range(d)]
        got = [(r["stage"], r["replica"]) for r in manifest.ranks]
        if got != layout:
            raise BuildMismatchError(f"manifest.json: the action lists are for ranks (stage, replica) {got}, but "
                                     f"plan.json places {layout}: regenerate the build with `hpml-compile compile`")
        try:
            ranks = parse_actions([r["actions"] for r in manifest.ranks])
        except ValueError as e:
            raise BuildMismatchError(f"manifest.json: {e}; regenerate the build") from None
    else:
        tokens = [list(entry["actions"]) for entry in manifest.stages]
        ranks = lower(plan.schedule, plan.microbatches, replicas,
                      sends=[f"{k}SEND{k + 1}" in t for k, t in enumerate(tokens)],
                      grad_sync=[[x for x in t if x.startswith(("ALLREDUCE", "REDUCESCATTER"))] for t in tokens],
                      after_step=[[x for x in t if x.startswith("ALLGATHER")] for t in tokens])
    validate_actions(ranks, replicas)
    return ranks


def file_hashes(files: dict[str, str | bytes], names: Sequence[str]) -> dict[str, str]:
    """sha256 of each named file's content."""
    return {n: sha256(files[n]) for n in names}
