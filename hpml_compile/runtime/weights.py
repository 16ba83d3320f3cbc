"""Each rank loads its own stage's weights by name from the user's saved weights (safetensors).

``TrainSpec(weights=...)`` names what ``save_pretrained`` wrote (a folder holding ``model.safetensors``
or a sharded ``model.safetensors.index.json``) or a ``.safetensors`` file. After a rank has bound its
stages, each parameter and buffer they hold is read by its qualified name, and only those tensors are
read (``safetensors.safe_open`` maps the file and reads the tensors asked for). Safetensors holds only
tensors: reading it runs no code. A tensor the file lacks is kept as the model made it when the model
ties it to one the file has (``lm_head.weight`` to the input embedding), and is an error otherwise.

Example:
    >>> import tempfile, torch
    >>> from safetensors.torch import save_file
    >>> path = tempfile.mkdtemp() + "/w.safetensors"
    >>> save_file({"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, path)
    >>> lin = torch.nn.Linear(2, 2)
    >>> load_stage_weights(lin, [lin], path)
    2
    >>> bool((lin.weight == 1).all())
    True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from torch import nn

from ..errors import ModelError

__all__ = ["weight_files", "load_stage_weights"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def weight_files(path: str | Path) -> dict[str, Path]:
    """Qualified tensor name -> the safetensors file holding it, for a file, a folder or a sharded folder.

    Raises:
        ModelError: nothing readable at ``path``.
    """
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".safetensors":
        files = [p]
    elif (p / _INDEX).is_file():
        weight_map = json.loads((p / _INDEX).read_text())["weight_map"]
        return {name: p / file for name, file in weight_map.items()}
    elif (p / _SINGLE).is_file():
        files = [p / _SINGLE]
    else:
        raise ModelError(f"TrainSpec.weights={str(path)!r}: no {_SINGLE}, {_INDEX} or .safetensors file there; "
                         "give the folder save_pretrained wrote or a .safetensors file")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            out.update({name: f for name in handle.keys()})
    return out


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """id(tensor) -> every qualified name the model holds it under (a tied weight has several)."""
    out: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        out.setdefault(id(t), []).append(name)
    return out


def load_stage_weights(model: nn.Module, stages: Iterable[nn.Module], path: str | Path) -> int:
    """Copy into each stage's parameters and buffers the saved tensors of the same qualified names.

    Args:
        model: the user's model the stages were bound to (it tells which names are one tied tensor).
        stages: this rank's stage modules (their names are the model's).
        path: a ``save_pretrained`` folder or a ``.safetensors`` file.

    Returns:
        How many tensors were read.

    Raises:
        ModelError: a parameter the stages hold that the file lacks under every name the model gives it, or
            a tensor of another shape.
    """
    where = weight_files(path)
    names = _aliases(model)
    done: set[int] = set()
    lost: list[str] = []
    for stage in stages:
        for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
            if id(t) in done:
                continue
            saved_as = next((n for n in [name, *names.get(id(t), [])] if n in where), None)
            if saved_as is None:
                if isinstance(t, nn.Parameter):
                    lost.append(name)
                continue  # a buffer the model makes itself (rotary inv_freq, a causal mask) is not saved
            with safe_open(str(where[saved_as]), framework="pt") as handle:
                saved = handle.get_tensor(saved_as)
            if tuple(saved.shape) != tuple(t.shape):
                raise ModelError(f"TrainSpec.weights: {saved_as} is {tuple(saved.shape)} in {where[saved_as]}, but "
                                 f"the model has {tuple(t.shape)}: the weights belong to another configuration")
            with torch.no_grad():
                t.copy_(saved)
            done.add(id(t))
    if lost:
        raise ModelError(f"TrainSpec.weights: {len(lost)} parameter(s) of the model are not in {path} "
                         f"({', '.join(lost[:4])}{', ...' if len(lost) > 4 else ''}): the weights belong to "
                         "another model")
    return len(done)
