"""Checkpoints that survive a crash and load under another plan.

Storage is torch.distributed.checkpoint (DCP): every rank writes the tensors it
holds, keyed by the *original* model's parameter names (``layers.3.attn.q_proj.weight``)
and, for the optimizer, ``optim.<param name>.<state key>``. Because nothing is
keyed by stage or rank, a checkpoint written by a 3-stage plan loads into a
2-stage plan (or one process): each rank asks DCP for the names it holds now,
and DCP reads them wherever they were written (resharding by name).

Atomicity, which DCP itself does not give: a checkpoint is written into
``step_<N>.tmp/``; only when every rank has finished (DCP's final collective)
does rank 0 write ``meta.json`` and rename the folder to ``step_<N>/`` (rename is
atomic on POSIX) and then point ``latest`` at it. A crash mid-write leaves a
``.tmp`` folder that :func:`latest` ignores and the next save removes, so the
previous checkpoint stays whole. The last ``keep`` checkpoints are kept.

Optimizer state goes through ``torch.distributed.checkpoint.state_dict``
(``get_optimizer_state_dict``/``set_optimizer_state_dict``), which maps it to
parameter names; hyper-parameters (``param_groups``) are not saved: the
optimizer a rank builds for the new plan supplies them.

Example:
    >>> import tempfile, torch
    >>> m = torch.nn.Linear(2, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)
    >>> root = tempfile.mkdtemp()
    >>> path = save_checkpoint(root, 10, m, opt, extra={"loss": 1.5})
    >>> m2 = torch.nn.Linear(2, 2); opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    >>> load_checkpoint(latest(root), m2, opt2)["step"]
    10
    >>> torch.equal(m.weight, m2.weight)
    True
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..errors import CheckpointError
from ..schema import write_json_atomic

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest", "list_checkpoints"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
_OPTS = StateDictOptions(strict=False)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _flat(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    state: dict[str, Any] = {f"model.{k}": v for k, v in get_model_state_dict(model, options=_OPTS).items()}
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer, options=_OPTS)
        for name, per_param in osd["state"].items():
            for key, value in per_param.items():
                state[f"optim.{name}.{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return state


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (``.tmp`` folders are not checkpoints)."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in r.iterdir() if (m := _STEP_DIR.match(p.name)) and
             (p / "meta.json").is_file()]
    return [p for _, p in sorted(found)]


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    done = list_checkpoints(root)
    return done[-1] if done else None


def save_checkpoint(root: str | os.PathLike[str], step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *, extra: dict[str, Any] | None = None,
                    keep: int = 3) -> Path:
    """Write checkpoint ``step`` of the parameters and optimizer state this rank holds.

    Call on every rank (collective when a process group is initialised).

    Args:
        root: checkpoint folder (shared by all ranks).
        step: training step number (names the checkpoint).
        model: this rank's module; its parameter names must be the original model's.
        optimizer: its optimizer, or None.
        extra: JSON-serialisable facts to keep with it (plan hash, losses, ...).
        keep: how many complete checkpoints to keep (older ones are deleted).

    Returns:
        The folder of the completed checkpoint.
    """
    r = Path(root)
    final, tmp = r / f"step_{step:08d}", r / f"step_{step:08d}.tmp"
    if _rank() == 0:
        r.mkdir(parents=True, exist_ok=True)
        for stale in r.glob("step_*.tmp"):  # the remains of a crash mid-write
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(_flat(model, optimizer), checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        write_json_atomic({"step": step, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                           **(extra or {})}, tmp / "meta.json")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(r)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str | os.PathLike[str] | None, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load into this rank's module (and optimizer) the names it holds, from a checkpoint of any plan.

    Returns:
        The checkpoint's ``meta.json`` (``step``, ``world_size`` and the ``extra`` saved with it).

    Raises:
        CheckpointError: no checkpoint, or it lacks a parameter this rank needs (named).
    """
    if path is None or not (Path(path) / "meta.json").is_file():
        raise CheckpointError(f"no complete checkpoint at {path}: expected a step_<N> folder with meta.json "
                              "(written by save_checkpoint)")
    p = Path(path)
    meta = json.loads((p / "meta.json").read_text())
    state = _flat(model, optimizer)  # the shapes to read into: what this rank holds now
    stored = dcp.FileSystemReader(str(p)).read_metadata().state_dict_metadata
    missing = sorted(k for k in state if k.startswith("model.") and k not in stored)
    if missing:
        raise CheckpointError(f"checkpoint {p} has no {missing[0][6:]}" + (f" (and {len(missing) - 1} more)"
                              if len(missing) > 1 else "") + "; was it written for another model?")
    wanted = {k: v for k, v in state.items() if k in stored}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(wanted, checkpoint_id=str(p))
    set_model_state_dict(model, {k[6:]: v for k, v in wanted.items() if k.startswith("model.")}, options=_OPTS)
    if optimizer is not None:
        per: dict[str, dict[str, Any]] = {}
        for k, v in wanted.items():
            if k.startswith("optim."):
                name, key = k[6:].rsplit(".", 1)
                per.setdefault(name, {})[key] = v
        osd = get_optimizer_state_dict(model, optimizer, options=_OPTS)
        osd["state"] = {**osd["state"], **per}
        set_optimizer_state_dict(model, optimizer, osd, options=_OPTS)
    return meta
