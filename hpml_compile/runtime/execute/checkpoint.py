"""Checkpoints that survive a crash, load under another plan, never run code and notice damage.

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

Trust: loading never unpickles anything from the folder. DCP's own index
(``.metadata``) is a pickle, so it is neither written nor read: the index is
JSON (``index.json``, see :mod:`.safe_dcp`, which says why a digest of the
pickle would not do) and tensors are read with ``torch.load(weights_only=True)``.
Only tensors are saved (non-tensor items are refused by name). A checkpoint of
an older version (no ``index.json``) is refused, not unpickled.

Damage: ``meta.json`` holds the size and sha256 of every other file of the
checkpoint; :func:`load_checkpoint` checks them first and names the damage
(a missing file, a truncated ``.distcp``, a digest mismatch). :func:`latest`
and :func:`resume_from` skip a damaged checkpoint for the newest intact one
and say so. The digests guard against damage, not against an attacker (who
can recompute them): the JSON index is what keeps a crafted checkpoint from
running code.

Loss scale: an fp16 run's :class:`~.scaler.LossScaler` state (the same on
every rank: the ranks agree on every overflow) is one float64 tensor,
``amp.scaler``; a resumed run goes on with the scale it had.

RNG: each rank saves its Python ``random``, NumPy, torch CPU and (when there
is one) CUDA generator states as tensors (``rng.rank<r>.*``), and loading
restores this rank's, so a model with dropout continues as an uninterrupted
run would. ``meta.json`` (format 2)::

    {"format": 2, "step": 10, "world_size": 2,
     "files": {"index.json": {"bytes": 812, "sha256": "..."}, "__0_0.distcp": {...}},
     ...extra (plan hash, loss, ...)}

Error feedback: a compressed stage's error (Top-K's, PowerSGD's) and
PowerSGD's step count and warm-start factors are saved per rank
(``comm.error.r<replica>of<d>.<parameter name>``, ``comm.powersgd<R>.<layout>.*``,
:class:`~.feedback.Feedback` says what and why), so that a resumed run goes
on with the error it had. Keyed by parameter name, the error loads under a
plan that moves the parameter to another stage; what a new plan cannot use
(it does not compress that stage; PowerSGD's factors of another stage
layout) is dropped and the ``log`` of :func:`load_checkpoint` says so.

Local SGD: its replicas differ between two averages, so a rank of a local
SGD stage also writes its entries under per-replica keys
(``comm.replica.r<replica>of<d>.model.<name>``, ...) and reads its own copy
back under the same replica count; elsewhere the ranks start from the saved
replicas' average, and the ``log`` says so (:mod:`.feedback` says why).

Optimizer state goes through ``torch.distributed.checkpoint.state_dict``
(``get_optimizer_state_dict``/``set_optimizer_state_dict``), which maps it to
parameter names; hyper-parameters (``param_groups``) are not saved: the
optimizer a rank builds for the new plan supplies them.

DCP is imported where a checkpoint is written, read or checked, not with
this module: it imports DTensor and FSDP, about a second of CPU on a small
machine, which a process that imports this module and never checkpoints (the
``run`` launcher, through the worker module) should not pay.

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

import contextlib
import functools
import hashlib
import inspect
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ...errors import CheckpointError, IndexFormatError
from ...schema import write_json_atomic
from ..sync.feedback import FEEDBACK_PREFIX, CommState, Feedback, Replica, merge_replicas, parse_error_key, replica_reads
from .scaler import LossScaler
from ..sync.zero import full_optimizer_state, load_full_optimizer_state, optimizer_templates, shards_of

if TYPE_CHECKING:  # DCP itself is imported on first use (see the module docstring)
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = ["CheckpointError", "FORMAT", "save_checkpoint", "load_checkpoint", "latest", "list_checkpoints",
           "damage", "resume_from", "seed_rngs"]

FORMAT = 2  # meta.json's "format": 1 was DCP's pickled .metadata, refused since
_STEP_DIR = re.compile(r"^step_(\d+)$")
_META = "meta.json"
_RESERVED = {"format", "step", "world_size", "files"}
_SCALER = "amp.scaler"  # [scale, growth tracker, skipped steps] of the fp16 loss scaler


@functools.cache
def _opts() -> StateDictOptions:
    """The options of every ``torch.distributed.checkpoint.state_dict`` call: names this rank lacks are no error."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=False)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every name of a tied parameter -> all its names (``wte.weight`` and ``lm_head.weight``)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {n: names for names in by_id.values() if len(names) > 1 for n in names}


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, gather: bool = True
                     ) -> dict[str, dict[str, Any]]:
    """The optimizer state by parameter name: DCP's mapping, or ZeRO shards made whole (:mod:`.zero`)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if shards_of(optimizer):
        return full_optimizer_state(model, optimizer, gather=gather)
    return get_optimizer_state_dict(model, optimizer, options=_opts())["state"]


def _flat(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, gather: bool = True
          ) -> dict[str, Any]:
    """The state this rank writes or reads, keyed by the original model's names.

    A tied parameter's optimizer state is keyed under *every* name of it: a
    stage that holds both uses (``wte`` and ``lm_head`` in one stage) knows
    one optimizer entry for them, a plan that puts them on two stages holds
    two parameters, each asking for its own name. Written under one name
    only, a checkpoint of the first plan resumed under the second left the
    last stage's copy with a fresh Adam state, and training diverged (seen
    by ``benchmarks/soak``).

    Under ZeRO the optimizer steps a flat shard; its state is gathered whole per parameter for saving
    (``gather``, a collective over the stage's replicas) and read back whole, each replica keeping its slice,
    so that the checkpoint stays the same for any plan.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state: dict[str, Any] = {f"model.{k}": v for k, v in get_model_state_dict(model, options=_opts()).items()}
    if optimizer is not None:
        aliases = _aliases(model)
        for name, per_param in _optimizer_state(model, optimizer, gather=gather).items():
            for key, value in per_param.items():
                tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                for alias in aliases.get(name, [name]):
                    state[f"optim.{alias}.{key}"] = tensor
    return state


def _gathering(*, changed: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a checkpoint function with the ZeRO-3 shards of its ``optimizer`` argument gathered
    (:mod:`.zero3`: parameters freed between uses), so that it saves or loads whole parameters by name, as
    under any plan; ``changed``: it writes them, and each replica's shard takes its part after."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            optimizer = sig.bind(*args, **kwargs).arguments.get("optimizer")
            with contextlib.ExitStack() as stack:
                for shard in shards_of(optimizer):
                    if hasattr(shard, "whole"):
                        stack.enter_context(shard.whole(changed=changed))
                return fn(*args, **kwargs)

        return run

    return wrap


def _optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[str]:
    """The names the optimizer's state dict uses for this rank's parameters (one per tied group)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if shards_of(optimizer):
        return set(optimizer_templates(model, optimizer))
    osd = get_optimizer_state_dict(model, optimizer, options=_opts())
    return {n for g in osd["param_groups"] for n in g["params"]}


def _rng_state(rank: int) -> dict[str, torch.Tensor]:
    """This process's generator states as tensors (no pickle), keyed ``rng.rank<r>.<generator>``."""
    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": torch.tensor([version, *words], dtype=torch.int64),
             "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
             "numpy": torch.tensor(np.asarray(keys, dtype=np.int64)),
             "numpy_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
             "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return {f"rng.rank{rank}.{k}": v for k, v in state.items()}


def seed_rngs(seed: int, rank: int) -> None:
    """Seed Python's, NumPy's and torch's generators (CPU and CUDA) for training on ``rank``.

    Called by every rank once its pipeline is built and before the first step,
    so that dropout draws the same masks in two runs of the same job (building
    and tracing the model may consume random numbers in ways that depend on
    the build). Each rank gets its own stream: ``seed * 1_000_003 + rank``.
    """
    value = (seed * 1_000_003 + rank) % 2**63
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)  # also every CUDA device's generator


def _set_rng_state(state: dict[str, torch.Tensor], rank: int) -> bool:
    """Restore the generators from what :func:`_rng_state` saved for ``rank``; False when it saved none."""
    mine = {k.removeprefix(f"rng.rank{rank}."): v for k, v in state.items() if k.startswith(f"rng.rank{rank}.")}
    if "torch" not in mine:
        return False
    py = mine["python"].tolist()
    has, gauss = mine["python_gauss"].tolist()
    random.setstate((int(py[0]), tuple(int(x) for x in py[1:]), gauss if has else None))
    pos, has_gauss = mine["numpy_pos"].tolist()
    np.random.set_state(("MT19937", mine["numpy"].numpy().astype(np.uint32), int(pos), int(has_gauss),
                         float(mine["numpy_gauss"].item())))
    torch.set_rng_state(mine["torch"])
    cuda = [mine[f"cuda{i}"] for i in range(len(mine)) if f"cuda{i}" in mine]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    return True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _digests(folder: Path) -> dict[str, dict[str, Any]]:
    return {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != _META}


def _read_meta(path: Path) -> dict[str, Any]:
    """``meta.json``, checked for what loading relies on.

    Raises:
        CheckpointError: missing, not JSON, of an older or unknown format, or without file digests.
    """
    from .safe_dcp import INDEX_FILE

    source = path / _META
    try:
        meta = json.loads(source.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"no complete checkpoint at {path}: expected a step_<N> folder with {_META} "
                              "(written by save_checkpoint)") from e
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{source} is not valid JSON ({e}): the checkpoint is damaged") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got {type(meta).__name__}: it is damaged")
    if "format" not in meta or not (path / INDEX_FILE).is_file():
        raise CheckpointError(f"{path} was written by an older version of hpml-compile: its index is a pickle "
                              "(.metadata) that cannot be loaded safely (unpickling runs whatever it holds); "
                              "start again without --resume, or resume from a checkpoint written by this version")
    if meta["format"] != FORMAT:
        raise CheckpointError(f"{source}: format {meta['format']!r} is not known (this version reads format "
                              f"{FORMAT}); was it written by a newer hpml-compile?")
    if not isinstance(meta.get("step"), int) or not isinstance(meta.get("world_size"), int):
        raise CheckpointError(f"{source}: step and world_size: expected integers, got {meta.get('step')!r} and "
                              f"{meta.get('world_size')!r}; it is damaged")
    files = meta.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, dict) and isinstance(v.get("bytes"), int)
                                              and isinstance(v.get("sha256"), str) for v in files.values()):
        raise CheckpointError(f"{source}: files: expected {{name: {{bytes, sha256}}}} for every file of the "
                              "checkpoint; it is damaged")
    return meta


def damage(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with checkpoint ``path``, or None when every file is there with its size and digest.

    Args:
        path: a ``step_<N>`` folder.

    Returns:
        None for an intact checkpoint, else the first problem found, e.g.
        ``"__0_0.distcp is truncated (1200 of 2400 bytes)"``.
    """
    p = Path(path)
    try:
        meta = _read_meta(p)
    except CheckpointError as e:
        return str(e)
    for name, want in meta["files"].items():
        f = p / name
        if "/" in name or not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{name} is {'truncated' if size < want['bytes'] else 'longer than written'} " \
                   f"({size} of {want['bytes']} bytes)"
        if _sha256(f) != want["sha256"]:
            return f"{name} does not match its sha256 in {_META} (changed since it was written)"
    return None


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (``.tmp`` folders are not checkpoints)."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in r.iterdir() if (m := _STEP_DIR.match(p.name)) and
             (p / _META).is_file()]
    return [p for _, p in sorted(found)]


def _warn(line: str) -> None:
    warnings.warn(line, stacklevel=3)


def latest(root: str | os.PathLike[str], *, log: Callable[[str], None] | None = None) -> Path | None:
    """The newest intact checkpoint under ``root``, or None; a damaged newer one is skipped with a line saying why.

    Args:
        root: the checkpoint folder.
        log: where to say that a checkpoint was skipped (default: a Python warning).

    Returns:
        The ``step_<N>`` folder, or None when there is no intact checkpoint.
    """
    for path in reversed(list_checkpoints(root)):
        why = damage(path)
        if why is None:
            return path
        (log or _warn)(f"checkpoint {path} is damaged ({why}); trying the one before it")
    return None


def resume_from(root: str | os.PathLike[str], *, log: Callable[[str], None] | None = None) -> Path:
    """The checkpoint to resume from: :func:`latest`, or an error saying what ``root`` holds instead.

    Args:
        root: the checkpoint folder.
        log: where to say that a damaged checkpoint was skipped (default: a Python warning).

    Returns:
        The newest intact ``step_<N>`` folder.

    Raises:
        CheckpointError: no intact checkpoint in ``root``; the message says whether the folder is missing,
            empty, holds other things, or only damaged checkpoints.
    """
    found = latest(root, log=log)
    if found is not None:
        return found
    r = Path(root)
    if not r.exists():
        holds = "the folder does not exist (mistyped?)"
    elif not r.is_dir():
        holds = "it is a file, not a folder"
    elif not (entries := sorted(p.name for p in r.iterdir())):
        holds = "the folder is empty"
    elif done := list_checkpoints(r):
        holds = "every checkpoint in it is damaged: " + "; ".join(f"{p.name}: {damage(p)}" for p in done)
    else:
        holds = (f"it holds no step_<N> checkpoint, only {', '.join(entries[:5])}"
                 + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
                 + (" (a .tmp folder is an unfinished save)" if any(e.endswith(".tmp") for e in entries) else ""))
    raise CheckpointError(f"--resume: nothing to resume from in {r}: {holds}. Point --checkpoint-dir at the "
                          "folder the checkpoints were written to, or start without --resume")


def _unwrap(e: CheckpointException) -> BaseException:
    """The first rank's own error inside DCP's wrapper (our errors name the file; DCP's wrapper does not)."""
    for failure in e.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return e


@_gathering(changed=False)
def save_checkpoint(root: str | os.PathLike[str], step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *, extra: dict[str, Any] | None = None,
                    keep: int = 3, rng: bool = True, scaler: LossScaler | None = None,
                    feedback: Sequence[CommState] = ()) -> Path:
    """Write checkpoint ``step`` of the parameters and optimizer state this rank holds.

    Call on every rank (collective when a process group is initialised).

    Args:
        root: checkpoint folder (shared by all ranks).
        step: training step number (names the checkpoint).
        model: this rank's module; its parameter names must be the original model's.
        optimizer: its optimizer, or None.
        extra: JSON-serialisable facts to keep with it (plan hash, losses, ...).
        keep: how many complete checkpoints to keep (older ones are deleted).
        rng: also save this process's RNG states (Python, NumPy, torch CPU and CUDA).
        scaler: the fp16 loss scaler, saved as one float64 tensor ``amp.scaler`` (the same on every rank).
        feedback: this rank's error-feedback state, and its place among a local SGD stage's replicas
            (``Pipeline.feedback()``), saved per rank.

    Returns:
        The folder of the completed checkpoint.

    Raises:
        CheckpointError: ``extra`` uses a name the checkpoint keeps for itself, or a state item is not a tensor.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from .safe_dcp import JsonWriter

    clash = _RESERVED & set(extra or {})
    if clash:
        raise CheckpointError(f"save_checkpoint: extra may not use {sorted(clash)} (kept by the checkpoint "
                              f"itself in {_META}); rename them")
    r = Path(root)
    final, tmp = r / f"step_{step:08d}", r / f"step_{step:08d}.tmp"
    if _rank() == 0:
        r.mkdir(parents=True, exist_ok=True)
        for stale in r.glob("step_*.tmp"):  # the remains of a crash mid-write
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    entries = _flat(model, optimizer)
    state = {**entries, **(_rng_state(_rank()) if rng else {}),
             **({_SCALER: scaler.state_tensor()} if scaler is not None else {})}
    for fb in feedback:  # error feedback; a local SGD replica's own copy of every entry (they differ)
        state.update(fb.state(entries) if isinstance(fb, Replica) else fb.state())
    odd = next((k for k, v in state.items() if not isinstance(v, torch.Tensor)), None)
    if odd is not None:
        raise CheckpointError(f"save_checkpoint: {odd!r} is a {type(state[odd]).__name__}, not a tensor: only "
                              "tensors are saved, so that loading never unpickles objects; make it a tensor "
                              "(or keep it in extra, as JSON)")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state, storage_writer=JsonWriter(str(tmp)))
    except CheckpointException as e:
        inner = _unwrap(e)
        if isinstance(inner, IndexFormatError):
            raise CheckpointError(str(inner)) from inner
        raise
    _barrier()
    if _rank() == 0:
        write_json_atomic({"format": FORMAT, "step": step,
                           "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                           "files": _digests(tmp), **(extra or {})}, tmp / _META)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(r)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


@_gathering(changed=True)
def load_checkpoint(path: str | os.PathLike[str] | None, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *, rng: bool = True,
                    scaler: LossScaler | None = None, feedback: Sequence[CommState] = (),
                    log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load into this rank's module (and optimizer) the names it holds, from a checkpoint of any plan.

    Nothing in the folder is unpickled (see the module docstring); every file's digest is checked first.

    Args:
        path: a ``step_<N>`` folder (from :func:`latest` or :func:`resume_from`).
        model: this rank's module, parameters named as in the original model.
        optimizer: its optimizer, or None.
        rng: also restore this rank's RNG states, when the checkpoint holds them.
        scaler: the fp16 loss scaler to restore (kept as it is when the checkpoint holds none: one written
            by a bf16 or fp32 run).
        feedback: this rank's error-feedback state to restore, and its place among a local SGD stage's
            replicas (``Pipeline.feedback()``); what the checkpoint holds for it that this plan cannot use is
            dropped and said. Entries saved per local SGD replica are read from this rank's own replica
            where it has one in the checkpoint, else averaged over the saved replicas (and said).
        log: where that is said (default: a Python warning).

    Returns:
        The checkpoint's ``meta.json`` (``step``, ``world_size`` and the ``extra`` saved with it),
        without its file digests.

    Raises:
        CheckpointError: no checkpoint; one of an older version (never unpickled); a damaged one (the file
            and what is wrong named); or one that lacks a parameter this rank needs (named).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from .safe_dcp import JsonReader

    if path is None:
        raise CheckpointError("no complete checkpoint to load (None): expected a step_<N> folder with meta.json "
                              "(written by save_checkpoint)")
    p = Path(path)
    meta = _read_meta(p)
    why = damage(p)
    if why is not None:
        raise CheckpointError(f"checkpoint {p} is damaged: {why}; load an earlier one (latest() skips it)")
    files = set(meta["files"])
    try:
        stored = JsonReader(p, files).read_metadata().state_dict_metadata
    except IndexFormatError as e:
        raise CheckpointError(str(e)) from e
    state = _flat(model, optimizer, gather=False)  # the shapes to read into: what this rank holds now
    missing = sorted(k for k in state if k.startswith("model.") and k not in stored)
    if missing:
        raise CheckpointError(f"checkpoint {p} has no {missing[0][6:]}" + (f" (and {len(missing) - 1} more)"
                              if len(missing) > 1 else "") + "; was it written for another model?")
    wanted = {k: v for k, v in state.items() if k in stored}
    mine = f"rng.rank{_rank()}."
    if rng:
        wanted.update({k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in stored.items()
                       if k.startswith(mine) and isinstance(v, TensorStorageMetadata)})
    if scaler is not None and _SCALER in stored:
        wanted[_SCALER] = scaler.state_tensor()
    shapes = {k: (tuple(v.size), v.properties.dtype) for k, v in stored.items()
              if k.startswith(FEEDBACK_PREFIX) and isinstance(v, TensorStorageMetadata)}
    errors = [fb for fb in feedback if isinstance(fb, Feedback)]
    place = next((fb for fb in feedback if isinstance(fb, Replica)), None)
    copies = replica_reads(shapes, [k for k in wanted if k.startswith(("model.", "optim."))], place)
    for entry, keys in copies.items():  # a local SGD replica's copy instead of the one DCP kept by name
        del wanted[entry]
        wanted.update(keys)
    reads = [fb.wanted(shapes) for fb in errors]
    for r in reads:
        wanted.update(r)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(wanted, storage_reader=JsonReader(p, files))
    except CheckpointException as e:
        inner = _unwrap(e)
        raise CheckpointError(f"checkpoint {p} could not be read: {inner}") from inner
    merged, notes = merge_replicas({e: {k: wanted[k] for k in keys} for e, keys in copies.items()}, place)
    wanted.update(merged)
    for note in notes:
        (log or _warn)(f"rank {_rank()}: checkpoint {p.name}: {note}")
    set_model_state_dict(model, {k[6:]: v for k, v in wanted.items() if k.startswith("model.")}, options=_opts())
    if optimizer is not None:
        known = _optimizer_names(model, optimizer)
        held = {k[6:].rsplit(".", 1)[0] for k in state if k.startswith("optim.")}
        lacking = sorted(n for n in held & known if not any(k.startswith(f"optim.{n}.") for k in wanted))
        if lacking and any(k.startswith("optim.") for k in stored):
            raise CheckpointError(f"checkpoint {p} holds no optimizer state for {lacking[0]}"
                                  + (f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else "")
                                  + ": it would restart from zero while the rest goes on; was it written by an "
                                  "older version (tied parameters' state under one name)? Resume from a newer one")
        per: dict[str, dict[str, Any]] = {}
        for k, v in wanted.items():
            if k.startswith("optim."):
                name, key = k[6:].rsplit(".", 1)
                if name in known:  # a tied parameter's other names carry the same state
                    per.setdefault(name, {})[key] = v
        if shards_of(optimizer):
            load_full_optimizer_state(model, optimizer, per)
        else:
            osd = get_optimizer_state_dict(model, optimizer, options=_opts())
            osd["state"] = {**osd["state"], **per}
            set_optimizer_state_dict(model, optimizer, osd, options=_opts())
    if rng:
        _set_rng_state(wanted, _rank())
    if scaler is not None and _SCALER in wanted:
        scaler.load_state_tensor(wanted[_SCALER])
    _load_feedback(p, errors, reads, wanted, shapes, {k[6:] for k in state if k.startswith("model.")},
                   log or _warn)
    return {k: v for k, v in meta.items() if k != "files"}


def _load_feedback(path: Path, feedback: Sequence[Feedback], reads: list[dict[str, torch.Tensor]],
                   got: dict[str, Any], shapes: dict[str, Any], held: set[str], log: Callable[[str], None]) -> None:
    """Give each :class:`~.feedback.Feedback` what was read for it; say what was not carried as it was, and
    which of this rank's parameters had an error saved that this plan does not compress (dropped)."""
    for fb, r in zip(feedback, reads):
        for note in fb.load({k: got[k] for k in r}):
            log(f"rank {_rank()}: checkpoint {path.name}: {note}")
    covered = {n for fb in feedback for n in fb.names}
    dropped = sorted({parsed[2] for k in shapes if (parsed := parse_error_key(k)) is not None
                      and parsed[2] in held and parsed[2] not in covered})
    if dropped:
        log(f"rank {_rank()}: checkpoint {path.name}: the error feedback of {len(dropped)} parameter(s) of this rank "
            f"(e.g. {dropped[0]}) is dropped: this plan does not compress the gradients of the stage that holds "
            "them (what compression left unsent there is lost)")
