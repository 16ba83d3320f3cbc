"""How a rank rebuilds the model of a build: ``model.json`` next to the stage files.

A build folder holds the stage code and the plan but never weights (files a
user keeps are plain JSON, never pickle). ``hpml-compile run build/`` starts
fresh processes, so each rank must build the same model again, from the same
seed, at the same batch and sequence length, and bind its stage to it. The
compile command writes that recipe as ``model.json``:

- ``model``: the MODEL string (a zoo name, ``hf:<type>?k=v``, or
  ``/abs/path/file.py:factory``, made absolute so a run from another folder works);
- ``batch_size``, ``seq_len``, ``seed``: passed to :func:`hpml_compile.models.load`;
- ``leaf_modules``, ``front_end``: how it was traced (load_build re-traces to
  check the graph hash);
- ``threads_per_rank``: torch threads each rank used when the plan was
  profiled (the runtime uses the same, so measured and predicted agree).

A build made by the Python API for a user's own ``nn.Module`` has no recipe:
each rank already holds the model (the user's script built it).

Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> r = ModelRecipe("gpt-tiny", batch_size=4, seq_len=32, threads_per_rank=1)
    >>> _ = write_recipe(d, r)
    >>> read_recipe(d) == r
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import BuildMismatchError
from .schema import check_version, read_json, validate, write_json_atomic

__all__ = ["RECIPE_FILE", "RECIPE_VERSION", "RECIPE_SCHEMA", "ModelRecipe", "write_recipe", "read_recipe",
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


def write_recipe(build_dir: str | Path, recipe: ModelRecipe) -> Path:
    """Write ``model.json`` into a build folder (atomically)."""
    return write_json_atomic(recipe.to_dict(), Path(build_dir) / RECIPE_FILE)


def read_recipe(build_dir: str | Path) -> ModelRecipe:
    """Read a build's ``model.json``.

    Raises:
        BuildMismatchError: if there is none (a build made by the Python API for a user's own model).
        SchemaError: if it is malformed.
    """
    path = Path(build_dir) / RECIPE_FILE
    if not path.is_file():
        raise BuildMismatchError(
            f"{path}: no model recipe, so the ranks cannot rebuild the model. `hpml-compile run` runs builds "
            "made by `hpml-compile compile MODEL ...` (which writes it); a build of your own nn.Module runs "
            "from your script with hpml_compile.compile(...) / Pipeline.from_build(...)")
    return ModelRecipe.from_dict(read_json(path), source=str(path))
