"""How a rank rebuilds the model of a build: ``model.json`` next to the stage files, covered by the manifest.

A build folder holds the plan and copies of the stage code, never weights
(files a user keeps are plain JSON, never pickle). ``hpml-compile run build/``
starts fresh processes, so each rank must build the same model again, from
the same seed, at the same batch and sequence length, and bind its stage to
it. Codegen writes that recipe as ``model.json`` with the build
(:func:`hpml_compile.codegen.generate` takes it) and records its sha256 in
``manifest.json``:

- ``model``: the MODEL string (a zoo name, ``hf:<type>?k=v``, or
  ``/abs/path/file.py:factory``, made absolute so a run from another folder works);
- ``batch_size``, ``seq_len``, ``seed``: passed to :func:`hpml_compile.models.load`;
- ``leaf_modules``, ``front_end``: how it was traced (load_build re-traces to
  check the graph hash);
- ``threads_per_rank``: torch threads each rank used when the plan was
  profiled (the runtime uses the same, so measured and predicted agree).

Why it is checked: ``model`` names the code that ``hpml-compile run``
imports and trains (a ``file.py:factory`` is executed), so :func:`read_recipe`
refuses a ``model.json`` that no longer matches the digest the manifest
recorded for it, naming the file, before any rank starts. The model it names
must then give the graph the build was made for (``graph_sha256``, checked by
:func:`hpml_compile.codegen.load_build` on every rank).

A build made by the Python API for a user's own ``nn.Module`` has no recipe:
each rank already holds the model (the user's script built it).

Example:
    >>> r = ModelRecipe("gpt-tiny", batch_size=4, seq_len=32, threads_per_rank=1)
    >>> ModelRecipe.from_dict(json.loads(recipe_text(r))) == r
    True
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import BuildMismatchError
from .schema import check_version, read_json, validate

__all__ = ["RECIPE_FILE", "RECIPE_VERSION", "RECIPE_SCHEMA", "ModelRecipe", "recipe_text", "read_recipe",
           "absolute_model_spec"]

RECIPE_FILE = "model.json"
RECIPE_VERSION = 1
RECIPE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "model", "batch_size", "seed"],
    "properties": {
        "schema_version": {"type": "integer"},
        "model": {"type": "string", "minLength": 1},
        "batch_size": {"type": "integer", "minimum": 1},
        "seq_len": {"type": ["integer", "null"], "minimum": 1},
        "seed": {"type": "integer"},
        "leaf_modules": {"type": "array", "items": {"type": "string"}},
        "front_end": {"enum": ["auto", "fx", "export"]},
        "threads_per_rank": {"type": ["integer", "null"], "minimum": 1},
    },
}


@dataclass(frozen=True, slots=True)
class ModelRecipe:
    """What a rank needs to rebuild the build's model (see the module docstring)."""

    model: str
    batch_size: int
    seq_len: int | None = None
    seed: int = 0
    leaf_modules: tuple[str, ...] = field(default=())
    front_end: str = "auto"
    threads_per_rank: int | None = None
    schema_version: int = RECIPE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "model": self.model, "batch_size": self.batch_size,
                "seq_len": self.seq_len, "seed": self.seed, "leaf_modules": list(self.leaf_modules),
                "front_end": self.front_end, "threads_per_rank": self.threads_per_rank}

    @classmethod
    def from_dict(cls, d: Any, source: str = RECIPE_FILE) -> "ModelRecipe":
        """Build from parsed JSON (raises SchemaError naming the bad field)."""
        validate(d, RECIPE_SCHEMA, source)
        check_version(d, RECIPE_VERSION, source)
        return cls(d["model"], d["batch_size"], d.get("seq_len"), d["seed"], tuple(d.get("leaf_modules", ())),
                   d.get("front_end", "auto"), d.get("threads_per_rank"))


def absolute_model_spec(model: str) -> str:
    """``file.py:factory`` with an absolute path (other specs unchanged), so a run from another folder works."""
    if model.startswith("hf:") or ":" not in model:
        return model
    path, _, factory = model.rpartition(":")
    return f"{Path(path).resolve()}:{factory}" if path.endswith(".py") else model


def recipe_text(recipe: ModelRecipe) -> str:
    """The text of ``model.json`` for ``recipe`` (what codegen writes and hashes into the manifest).

    Args:
        recipe: the recipe.

    Returns:
        Indented JSON with a final newline.
    """
    return json.dumps(recipe.to_dict(), indent=2) + "\n"


def read_recipe(build_dir: str | Path) -> ModelRecipe:
    """Read a build's ``model.json``, checked against the digest ``manifest.json`` recorded for it.

    Args:
        build_dir: the build folder.

    Returns:
        The recipe.

    Raises:
        BuildMismatchError: there is none (a build made by the Python API for a user's own model), or it is
            not the one codegen wrote with the build (changed, or absent from the manifest), naming the file.
        SchemaError: it or the manifest is malformed.
    """
    path = Path(build_dir) / RECIPE_FILE
    if not path.is_file():
        raise BuildMismatchError(
            f"{path}: no model recipe, so the ranks cannot rebuild the model. `hpml-compile run` runs builds "
            "made by `hpml-compile compile MODEL ...` (which writes it); a build of your own nn.Module runs "
            "from your script with hpml_compile.compile(...) / Pipeline.from_build(...)")
    recipe = ModelRecipe.from_dict(read_json(path), source=str(path))
    _check_digest(path, recipe)
    return recipe


def _check_digest(path: Path, recipe: ModelRecipe) -> None:
    """Refuse ``model.json`` unless ``manifest.json`` beside it records exactly its sha256."""
    manifest = path.parent / "manifest.json"
    fix = (f"regenerate the build with `hpml-compile compile {recipe.model} ... -o {path.parent}` (or restore "
           "the file)")
    data = read_json(manifest) if manifest.is_file() else None
    listed = data.get("files") if isinstance(data, dict) else None
    want = listed.get(RECIPE_FILE) if isinstance(listed, dict) else None
    if want is None:
        raise BuildMismatchError(
            f"{path}: not recorded in {manifest.name} beside it, so it was not written with this build. It names "
            f"the model that `hpml-compile run` imports and trains ({recipe.model!r}), so only the one codegen "
            f"wrote and hashed is used: {fix}")
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != want:
        raise BuildMismatchError(
            f"{path} was changed after the build was generated (sha256 {got[:12]}..., {manifest.name} says "
            f"{str(want)[:12]}...). It names the model that `hpml-compile run` imports and trains (now "
            f"{recipe.model!r}), so a changed one is refused: {fix}")
