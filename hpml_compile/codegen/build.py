"""The build folder: load it by regenerating its code, and publish it without destroying anything.

A build folder holds ``plan.json``, ``profile.json``, ``graph.txt``,
``model.json`` (:mod:`hpml_compile.recipe`), one ``stage_<k>.py`` per stage
and ``manifest.json`` (:mod:`.manifest`). :func:`load_build` re-checks the
hashes of the data files, re-traces the user's model and checks its graph
against ``graph_sha256``, then regenerates every stage's source from
``plan.json`` and that graph with the very functions
:func:`hpml_compile.codegen.generate` used (:func:`.render.render`),
compiles *that* source and binds it to the model's weights. The stage file
on disk is only compared with it: a copy that differs was edited by hand
(or written by another version) and the build is refused, naming the file;
the file is never imported.

Trust boundary. What runs is code the user chose to run: their model file
and the factory it names (``MODEL`` on the command line, which the build
records in ``model.json``; the manifest covers that file and ``hpml-compile
run`` refuses a changed one), their own training script, and hpml-compile
itself. Everything else is data: every JSON file (``profile.json``,
``cluster.json``, ``plan.json``, ``manifest.json``, ``model.json``, run and
checkpoint metadata) is parsed and schema-checked, never executed or
unpickled; checkpoints hold tensors; the stage files are for people to read.
A build's code is regenerated at load time from its ``plan.json`` and the
user's model, so a build folder from someone else can choose a placement,
never the code that runs -- except through ``model.json``, which names the
model file to import: read it as you would any script before you run it.

Publishing (:func:`publish_build`): a build goes to a new folder, or
replaces an earlier build (recognised by its manifest: :func:`build_files`),
through :func:`hpml_compile.publish.publish_dir`, so a folder with a user's
files is refused with its path and nothing is deleted.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> d = Path(tempfile.mkdtemp())
    >>> build_files(d) is None  # an empty folder: no manifest, no build
    True
    >>> check_build_dir(d / "new")  # a path that does not exist yet is fine
"""

from __future__ import annotations

import os
import re
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch.utils._pytree import tree_unflatten

from ..errors import BuildMismatchError, HpmlError, OutputError
from ..plan import Plan, load_plan
from ..publish import check_output_dir, publish_dir
from ..recipe import RECIPE_FILE
from ..schedule import RankActions, deferral, lower, parse_actions, rank_layout
from ..schedule_check import validate as validate_actions
from ..schema import write_json_atomic
from ..trace import trace
from .constants import CONSTANTS_FILE, read_constants
from .emit import class_name
from .manifest import (MANIFEST_FILE, MANIFEST_SCHEMA, MANIFEST_VERSION, InputSpec, Manifest, file_hashes,
                       input_specs, leaf_modules, read_manifest, sha256)
from .partition import canonical_text
from .render import render
from .stage import StageModule
from .tensor_parallel import replica_plan

__all__ = ["MANIFEST_VERSION", "MANIFEST_SCHEMA", "InputSpec", "Manifest", "Build", "sha256", "write_files",
           "load_build", "bind_build", "rank_actions", "input_specs", "leaf_modules", "file_hashes", "build_files",
           "check_build_dir", "publish_build", "CODEGEN_FILES"]

_STAGE_FILE = re.compile(r"^stage_\d+\.py$")
# Every name codegen may write into a build folder besides the stage files (the optional ones included), and
# __pycache__, which importing stage files from disk (as builds did before they were regenerated) left there.
CODEGEN_FILES = frozenset({MANIFEST_FILE, RECIPE_FILE, "plan.json", "profile.json", "graph.txt", "lowering.json",
                           CONSTANTS_FILE, "__pycache__"})
_WHAT = "build folder"


@dataclass(frozen=True, slots=True, eq=False)
class Build:
    """A loaded build: the plan, the manifest and one module per stage, bound to a model's weights.

    Attributes:
        out_dir: the build folder.
        plan: the plan it carries out.
        manifest: its manifest.
        stages: ``stages[k]`` runs stage ``k`` (``forward``; ``COLLECTIVES``: the parameters of each collective token).
        actions: each rank's action list, validated (:mod:`hpml_compile.schedule`).
        sources: ``sources[k]`` is the Python that ``stages[k]`` was compiled from (regenerated, not read).
        out_spec: how the last stage's flat outputs make the model's own output (a pytree spec; None: as they
            are), see :func:`hpml_compile.trace.output_structure`.
    """

    out_dir: Path
    plan: Plan
    manifest: Manifest
    stages: tuple[StageModule, ...]
    actions: tuple[RankActions, ...] = ()
    sources: tuple[str, ...] = ()
    out_spec: Any = None

    def model_output(self, flat: Any) -> Any:
        """The model's own output (tensor, tuple, dict, ``ModelOutput``) from the last stage's return value."""
        return flat if self.out_spec is None else tree_unflatten(list(flat), self.out_spec)

    def source(self, stage: int) -> str:
        """The Python a stage runs (the same text as its ``stage_<k>.py``, which load_build compared)."""
        if self.sources:
            return self.sources[stage]
        return (self.out_dir / self.manifest.stages[stage]["file"]).read_text()


# -- publishing -----------------------------------------------------------------------------------


def build_files(folder: Path) -> set[str] | None:
    """The names an earlier build wrote in ``folder`` (what may be replaced), or None when it holds no build.

    A build is recognised by a ``manifest.json`` that parses; its names are
    the files the manifest lists and :data:`CODEGEN_FILES`.

    Args:
        folder: an existing folder.

    Returns:
        The names, or None.
    """
    if not (folder / MANIFEST_FILE).is_file():
        return None
    try:
        manifest = read_manifest(folder)
    except HpmlError:
        return None
    return {*manifest.files, *(s["file"] for s in manifest.stages), *CODEGEN_FILES}


def check_build_dir(out_dir: str | os.PathLike[str]) -> None:
    """Refuse, before any work, a build folder that may not be written (see :func:`publish_build`).

    Args:
        out_dir: the folder a build is about to be published to.

    Raises:
        OutputError: it holds files that no build wrote, is a file, or its nearest existing parent cannot be
            written (the path is named).
    """
    out = Path(out_dir)
    check_output_dir(out, made_by=build_files, what=_WHAT)
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:  # a probe: os.access says yes to root even where nothing can be created (/proc)
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent))
    except OSError as e:
        raise OutputError(f"cannot write the {_WHAT} {out}: {parent} is not writable "
                          f"({e.strerror or type(e).__name__}); choose a folder you can write with -o") from None


def write_files(out_dir: Path, files: Mapping[str, str | bytes], manifest: Manifest) -> None:
    """Write the generated files into a new, empty folder, then the manifest (last: a half-written build does not load).

    Args:
        out_dir: the folder (:func:`publish_build` gives a hidden one that is renamed into place).
        files: name -> content.
        manifest: the manifest listing them.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = out_dir / name
        if isinstance(data, str):
            path.write_text(data)
        else:
            path.write_bytes(data)
    write_json_atomic(manifest.to_dict(), out_dir / MANIFEST_FILE)


def publish_build(out_dir: str | os.PathLike[str], files: Mapping[str, str | bytes], manifest: Manifest) -> Path:
    """Publish a build folder whole: written aside, renamed into place, replacing only an earlier build.

    Args:
        out_dir: the build folder: new, empty, or holding an earlier build (nothing else).
        files: name -> content.
        manifest: the manifest listing them.

    Returns:
        ``out_dir``.

    Raises:
        OutputError: ``out_dir`` holds something no build wrote (nothing is written or deleted), is a file,
            or cannot be written.
    """
    out = Path(out_dir)
    publish_dir(out, lambda tmp: write_files(tmp, files, manifest), made_by=build_files, what=_WHAT)
    return out


# -- loading --------------------------------------------------------------------------------------


def _check_files(out_dir: Path, manifest: Manifest) -> None:
    """The data files the manifest lists: present and unchanged (the stage files are compared as source)."""
    for name, want in manifest.files.items():
        if _STAGE_FILE.match(name):
            continue
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
    return trace(model, tuple(inputs), leaf_modules=manifest.leaf_modules, front_end=manifest.front_end,
                 input_names=manifest.keywords or None)


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


def _check_manifest(out_dir: Path, manifest: Manifest, fresh: Manifest) -> None:
    """What the manifest says of the stages is what plan.json and the model give now."""
    mine, theirs = fresh.to_dict(), manifest.to_dict()
    for key in ("model", "front_end", "leaf_modules", "trace_inputs", "inputs", "microbatches", "precision", "stages",
                "collectives"):
        if mine[key] != theirs[key]:
            raise BuildMismatchError(
                f"{out_dir / MANIFEST_FILE}: its {key!r} is {theirs[key]!r}, but plan.json and this model give "
                f"{mine[key]!r}: the manifest was edited or belongs to another build. Regenerate the build with "
                "`hpml-compile compile`")


def _check_stage_files(out_dir: Path, files: Mapping[str, str | bytes], manifest: Manifest) -> None:
    """Each stage file on disk is the source regenerated now (it is for reading; a differing copy is refused)."""
    for entry in manifest.stages:
        name = entry["file"]
        path = out_dir / name
        if not path.is_file():
            raise BuildMismatchError(f"{path}: listed in manifest.json but missing; regenerate the build")
        disk, ours = path.read_bytes().decode("utf-8", "replace"), files[name]
        if disk == ours:
            continue
        a, b = disk.splitlines(), ours.splitlines()
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        here = a[k].strip() if k < len(a) else "<end>"
        there = b[k].strip() if k < len(b) else "<end>"
        raise BuildMismatchError(
            f"{path} was edited by hand: it is for reading; the build runs the code regenerated from plan.json "
            f"and the model, which differs at line {k + 1} (the file has `{here[:80]}`, the regenerated code "
            f"`{there[:80]}`). Regenerate the build with `hpml-compile compile` (or restore the file); to change "
            "what a stage runs, change the model or the plan")


def _compile_stage(path: Path, source: str, name: str) -> type[StageModule]:
    """Compile regenerated source as a module of its own; its classes carry ``path`` for tracebacks."""
    module = types.ModuleType(f"hpml_build_{sha256(source)[:16]}_{path.stem}")
    module.__file__ = str(path)  # tracebacks show the file's lines, which are this very text (compared above)
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 -- codegen's own output, just rendered
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, StageModule)):
        raise HpmlError(f"the code regenerated for {path.name} defines no StageModule named {name}; this is a bug "
                        "in hpml_compile.codegen")
    return cls


def bind_build(out_dir: Path, plan: Plan, manifest: Manifest, files: Mapping[str, str | bytes],
               model: torch.nn.Module, out_spec: Any = None) -> Build:
    """Compile the stages' regenerated source and bind each to ``model``'s weights.

    Args:
        out_dir: the build folder (for file names in messages and tracebacks).
        plan: the build's plan.
        manifest: its manifest (the action lists are validated here).
        files: the files :func:`.render.render` gave for ``plan`` (never read from ``out_dir``).
        model: the user's model (or the graph traced from it).
        out_spec: the model's output structure over the last stage's flat outputs (export graphs).

    Returns:
        The build.

    Raises:
        BuildMismatchError, ScheduleError: the action lists do not fit the plan (see :func:`rank_actions`).
    """
    actions = rank_actions(manifest, replica_plan(plan))  # a tp stage's groups run one plan per place
    sources = tuple(str(files[f"stage_{k}.py"]) for k in range(len(plan.stages)))
    classes = [_compile_stage(out_dir / f"stage_{k}.py", src, class_name(k)) for k, src in enumerate(sources)]
    carried = out_dir / CONSTANTS_FILE  # hash-checked with the other data files (_check_files)
    constants = read_constants(carried.read_bytes()) if CONSTANTS_FILE in manifest.files else None
    return Build(out_dir, plan, manifest, tuple(cls(model, constants) for cls in classes), tuple(actions), sources,
                 out_spec)


def load_build(out_dir: str | Path, model: torch.nn.Module, *,
               graph_module: fx.GraphModule | None = None) -> Build:
    """Load a build folder: regenerate its stages' code from plan.json and ``model``, and bind it to the weights.

    Args:
        out_dir: the folder :func:`hpml_compile.codegen.generate` wrote.
        model: the user's model (weights, buffers and submodules are taken
            from it by name, never from files).
        graph_module: ``model`` already traced the way the build was (skips
            the re-trace that checks the model graph).

    Returns:
        The build, one stage module per stage, compiled from the regenerated source.

    Raises:
        BuildMismatchError: naming the file: a stage file that differs from the code regenerated from
            plan.json (edited by hand), plan.json, profile.json or model.json changed since generation, a file
            missing, or a model whose graph differs from the build's (a build for another model).
        SchemaError: a malformed manifest.json or plan.json.
    """
    out = Path(out_dir)
    manifest = read_manifest(out)
    _check_files(out, manifest)                                     # the data files are the ones generated
    gm = graph_module if graph_module is not None else _retrace(model, manifest)
    _check_graph(out, manifest, gm)                                 # the model is the one the build is for
    plan = load_plan(out / "plan.json")
    files, fresh = render(gm, plan)                                 # the code that runs, regenerated
    _check_manifest(out, manifest, fresh)
    _check_stage_files(out, files, manifest)                        # the copies for reading say the same
    return bind_build(out, plan, manifest, files, model, gm.meta.get("hpml_out_spec"))


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
        layout = rank_layout(plan)  # interleaved: each rank's first stage
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
                      after_step=[[x for x in t if x.startswith("ALLGATHER")] for t in tokens], defer=deferral(plan),
                      chunks=plan.chunks)
    validate_actions(ranks, replicas, deferral(plan), chunks=plan.chunks)
    return ranks
