"""A training job in the user's own file: model, data, loss, optimizer, schedule (:class:`TrainSpec`).

``hpml-compile compile path/to/train.py:NAME`` and ``hpml_compile.compile(spec)``
take a ``TrainSpec``; ``NAME`` is one or a function returning one (called with
those of ``batch_size``, ``seq_len``, ``device`` it accepts, like a model
factory). What it holds is checked here, once, with errors that name the field
and what would be right, so that a bad spec fails at ``compile`` rather than in
every rank of a run.

An item of ``dataset`` is ``(inputs, target)``: inputs a tensor or a tuple of
tensors (the model's positional inputs), target whatever ``loss_fn`` takes
second. Or it is a dict of named tensors, as a tokenizer or feature extractor
gives (``input_ids``, ``attention_mask``, ``pixel_values``, ``labels``...): the
keys that name parameters of the model's ``forward`` are its inputs, passed by
keyword, and ``label_key`` is the target; with no ``loss_fn`` the labels go to
the model too and its own ``output.loss`` is trained (a ``transformers`` model). A batch is ``collate_fn`` of ``batch_size`` items (default: torch's
``default_collate``), again ``(inputs, target)``. The example inputs that
tracing and profiling use are the dataset's first ``batch_size`` items, in
order (:func:`first_batch`); the build is made for exactly that batch shape,
so every training batch has ``batch_size`` rows (an epoch's last, partial
batch is dropped).

Example:
    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> data = TensorDataset(torch.randn(10, 3), torch.randn(10, 1))
    >>> spec = TrainSpec(torch.nn.Linear(3, 1), data, torch.nn.functional.mse_loss, batch_size=4)
    >>> inputs, target = first_batch(spec)
    >>> [tuple(x.shape) for x in inputs], tuple(target.shape), batches_per_epoch(spec)
    ([(4, 3)], (4, 1), 2)
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, IterableDataset, default_collate

from .errors import ModelError

__all__ = ["TrainSpec", "Batch", "first_batch", "collate", "batches_per_epoch", "is_iterable", "check_item",
           "Split", "split_of", "replica_rows", "rank_rows", "check_batch_split", "model_loss", "input_names", "batch_input_names"]

Batch = tuple[tuple[Tensor, ...], Any]  # (positional inputs, target)

_ITEM = ("an item (inputs, target): inputs a Tensor or a tuple of Tensors, e.g. `return x, y`; or a dict of "
         "named tensors, e.g. {'input_ids': ..., 'labels': ...}")


def model_loss(output: Any, target: Any = None) -> Tensor:
    """The loss the model computed itself (``output.loss``, as a ``transformers`` model does when given labels).

    Raises:
        ModelError: the output carries no loss.
    """
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, Tensor):
        raise ModelError(f"TrainSpec has no loss_fn, so the model's own loss is trained, but its output "
                         f"({type(output).__name__}) carries no .loss: put the labels in the batch (a 'labels' key "
                         "the model's forward takes), or give TrainSpec a loss_fn(output, target)")
    return loss


def _signature(module: nn.Module) -> list[str]:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def input_names(spec: "TrainSpec", keys: Iterable[str]) -> tuple[str, ...]:
    """The keys of a dict batch that go to the model, in the order of its ``forward`` parameters.

    The label key goes to the model when the spec has no ``loss_fn`` (the model computes its loss from
    it) and is the target otherwise.

    Raises:
        ModelError: no key names a parameter of ``forward``.
    """
    params = _signature(spec.module)
    present = set(keys)
    drop = set() if spec.own_loss else {spec.label_key}
    names = tuple(p for p in params if p in present and p not in drop)
    if not names:
        raise ModelError(f"TrainSpec.dataset: a batch has keys {sorted(present)}, none of which is a parameter of "
                         f"{type(spec.module).__name__}.forward ({', '.join(params) or 'none found'}); name the "
                         "keys after forward's parameters")
    if spec.own_loss and spec.label_key not in names:
        raise ModelError(f"TrainSpec has no loss_fn, so the model's own loss is trained, but the batch has no "
                         f"{spec.label_key!r} that {type(spec.module).__name__}.forward takes: add it to the "
                         "items, or give TrainSpec a loss_fn")
    return names


def _callable_or_none(name: str, value: Any, example: str) -> None:
    if value is not None and not callable(value):
        raise ModelError(f"TrainSpec.{name} must be None or a callable ({example}), got {type(value).__name__}")


def _check_dataset(name: str, value: Any) -> None:
    mapped = hasattr(value, "__getitem__") and hasattr(value, "__len__")
    if not (isinstance(value, (Dataset, IterableDataset)) or mapped):
        raise ModelError(f"TrainSpec.{name} must be a torch.utils.data.Dataset (map-style: __getitem__ and "
                         f"__len__) or an IterableDataset, got {type(value).__name__}")


@dataclass(frozen=True)
class TrainSpec:
    """What to train and on what: the form ``path/to/train.py:NAME`` and ``hpml_compile.compile`` take.

    Attributes:
        module: the model.
        dataset: a map-style ``Dataset`` (shuffled per epoch from ``seed``) or an ``IterableDataset``
            (read in its own order); items ``(inputs, target)``.
        loss_fn: ``(output, target) -> loss``, a mean over the rows it is given (None: the model's own
            ``output.loss``, computed from the batch's ``label_key``, as ``transformers.Trainer`` does).
        batch_size: rows per training step (the build's batch; it must split into the plan's
            microbatches and each stage's replicas).
        optimizer: a factory over parameters, e.g. ``lambda ps: torch.optim.AdamW(ps, lr=3e-4)``
            (None: AdamW at ``hpml-compile run --lr``).
        lr_scheduler: a factory over the optimizer, e.g. ``lambda o: torch.optim.lr_scheduler.StepLR(o, 10)``;
            stepped once per training step.
        val_dataset: items like ``dataset``'s, for the validation loss (``run --val-every K``).
        collate_fn: ``list of items -> (inputs, target)`` (None: torch's ``default_collate``).
        seed: the seed of the per-epoch shuffle.
        weights: the weights to train from, as ``save_pretrained`` wrote them (a folder, sharded or not) or a
            ``.safetensors`` file: each rank of ``hpml-compile run`` reads only its own stage's tensors, by name.
        label_key: in a dict batch, the key of the target (or, with no ``loss_fn``, of the labels the model
            takes); the batch's other keys that name ``forward`` parameters are the model's inputs.

    Raises:
        ModelError: a field of the wrong type (named, with what is expected).
    """

    module: nn.Module
    dataset: Any
    loss_fn: Callable[[Any, Any], Tensor] | None = None
    batch_size: int = 8
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    val_dataset: Any = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    seed: int = 0
    label_key: str = "labels"
    weights: str | os.PathLike[str] | None = None

    @property
    def own_loss(self) -> bool:
        """Whether the model's own ``output.loss`` is trained (no ``loss_fn`` was given)."""
        return self.loss_fn is model_loss

    def __post_init__(self) -> None:
        if self.loss_fn is None:
            object.__setattr__(self, "loss_fn", model_loss)
        if not isinstance(self.module, nn.Module):
            raise ModelError(f"TrainSpec.module must be a torch.nn.Module, got {type(self.module).__name__}")
        _check_dataset("dataset", self.dataset)
        if self.val_dataset is not None:
            _check_dataset("val_dataset", self.val_dataset)
        if not callable(self.loss_fn):
            raise ModelError(f"TrainSpec.loss_fn must be a callable (output, target) -> loss, e.g. "
                             f"torch.nn.functional.cross_entropy, got {type(self.loss_fn).__name__}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ModelError(f"TrainSpec.batch_size must be a whole number, 1 or more, got {self.batch_size!r}")
        _callable_or_none("optimizer", self.optimizer, "parameters -> optimizer, e.g. "
                          "lambda ps: torch.optim.AdamW(ps, lr=1e-3)")
        _callable_or_none("lr_scheduler", self.lr_scheduler, "optimizer -> scheduler, e.g. "
                          "lambda o: torch.optim.lr_scheduler.StepLR(o, 100)")
        _callable_or_none("collate_fn", self.collate_fn, "list of items -> (inputs, target)")
        if self.weights is not None and not isinstance(self.weights, (str, os.PathLike)):
            raise ModelError(f"TrainSpec.weights must be a path (a save_pretrained folder or a .safetensors file), "
                             f"got {type(self.weights).__name__}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ModelError(f"TrainSpec.seed must be an int, got {self.seed!r}")
        if not is_iterable(self.dataset) and len(self.dataset) < self.batch_size:
            raise ModelError(f"TrainSpec.dataset has {len(self.dataset)} items, fewer than batch_size "
                             f"{self.batch_size}: not one full batch; use a smaller batch_size or more data")


def is_iterable(dataset: Any) -> bool:
    """Whether ``dataset`` is read as a stream (an ``IterableDataset``) rather than by index."""
    return isinstance(dataset, IterableDataset)


def check_item(item: Any, where: str = "TrainSpec.dataset") -> None:
    """Refuse an item that is not ``(inputs, target)`` with tensor inputs.

    Raises:
        ModelError: naming what the item is and what is expected.
    """
    if isinstance(item, Mapping):
        bad = [k for k, v in item.items() if not isinstance(v, (Tensor, int, float, list, tuple))]
        if bad or not item:
            raise ModelError(f"{where}: an item is a dict with {'no keys' if not item else f'non-tensor values at {bad}'}"
                             f"; expected {_ITEM}")
        return
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        got = f"a {type(item).__name__}" + (f" of {len(item)}" if isinstance(item, (tuple, list)) else "")
        raise ModelError(f"{where}: an item is {got}; expected {_ITEM}")
    inputs = item[0]
    ok = isinstance(inputs, Tensor) or (isinstance(inputs, (tuple, list)) and len(inputs) > 0
                                        and all(isinstance(x, Tensor) for x in inputs))
    if not ok:
        raise ModelError(f"{where}: an item's inputs are a {type(inputs).__name__}; expected {_ITEM}")


def collate(spec: TrainSpec, items: Sequence[Any], where: str = "TrainSpec.dataset") -> Batch:
    """``collate_fn`` (or ``default_collate``) of ``items``, as ``(inputs tuple, target)``.

    Raises:
        ModelError: the collated batch is not ``(inputs, target)`` with tensor inputs.
    """
    if items:
        check_item(items[0], where)
    fn = spec.collate_fn or default_collate
    try:
        batch = fn(list(items))
    except Exception as e:
        raise ModelError(f"{where}: collating {len(items)} items failed ({type(e).__name__}: {e}); give "
                         "TrainSpec a collate_fn(items) -> (inputs, target)") from e
    if isinstance(batch, Mapping):  # named tensors: the model's inputs by its forward's parameters
        names = input_names(spec, batch.keys())
        target = None if spec.own_loss else batch.get(spec.label_key)
        return tuple(batch[n] for n in names), target
    check_item(batch, f"{where} (a collated batch)")
    inputs, target = batch
    return ((inputs,) if isinstance(inputs, Tensor) else tuple(inputs)), target


def first_batch(spec: TrainSpec) -> Batch:
    """The first ``batch_size`` items of the dataset, in order, collated: the example batch of the build.

    Raises:
        ModelError: an item or batch of the wrong form, or an iterable dataset with less than one batch.
    """
    if is_iterable(spec.dataset):
        items: list[Any] = []
        for item in spec.dataset:
            items.append(item)
            if len(items) == spec.batch_size:
                break
        if len(items) < spec.batch_size:
            raise ModelError(f"TrainSpec.dataset yields {len(items)} items, fewer than batch_size "
                             f"{spec.batch_size}: not one full batch")
    else:
        items = [spec.dataset[i] for i in range(spec.batch_size)]
    return collate(spec, items)


def batch_input_names(spec: TrainSpec) -> tuple[str, ...]:
    """The names the model takes a dict batch's inputs under (:func:`input_names`); ``()`` for tuple items."""
    item = next(iter(spec.dataset)) if is_iterable(spec.dataset) else spec.dataset[0]
    if not isinstance(item, Mapping):
        return ()
    fn = spec.collate_fn or default_collate
    try:
        batch = fn([item])
    except Exception as e:
        raise ModelError(f"TrainSpec.dataset: collating an item failed ({type(e).__name__}: {e}); give TrainSpec "
                         "a collate_fn(items) -> dict of tensors") from e
    return input_names(spec, batch.keys()) if isinstance(batch, Mapping) else ()


def batches_per_epoch(spec: TrainSpec, dataset: Any = None) -> int | None:
    """Full batches in one pass over ``dataset`` (default the training set); None for a stream without a length."""
    data = spec.dataset if dataset is None else dataset
    if is_iterable(data):
        try:
            return len(data) // spec.batch_size
        except TypeError:
            return None
    return len(data) // spec.batch_size


Split = int | tuple[int, ...]  # a stage's replicas: their count (equal rows), or each one's rows (Stage.rows)


def split_of(replicas: int, rows: Sequence[int] = ()) -> Split:
    """A stage's split: ``rows`` (the plan's rows of each replica per microbatch) if given, else the count."""
    return tuple(int(r) for r in rows) if rows else int(replicas)


def replica_rows(split: Split, microbatch_rows: int) -> list[int]:
    """Rows of a microbatch of ``microbatch_rows`` that each replica of a stage trains on.

    Example:
        >>> replica_rows(2, 8), replica_rows((3, 1), 4)
        ([4, 4], [3, 1])

    Raises:
        ModelError: the microbatch does not split so (an equal split that does not divide, or rows that do
            not add up to the microbatch).
    """
    if isinstance(split, int):
        if microbatch_rows % split:
            raise ModelError(f"a microbatch of {microbatch_rows} rows does not split equally among {split} "
                             f"replicas: use microbatches of a multiple of {split} rows")
        return [microbatch_rows // split] * split
    if sum(split) != microbatch_rows:
        raise ModelError(f"the plan gives its replicas rows {list(split)} of each microbatch ({sum(split)} rows), "
                         f"but a microbatch has {microbatch_rows}: use microbatches of {sum(split)} rows")
    return list(split)


def rank_rows(batch_size: int, microbatches: int, replicas: Split, replica: int) -> list[int]:
    """The rows of a batch that replica ``replica`` of a stage trains on.

    The executor splits a batch into ``microbatches`` equal microbatches and
    each microbatch among the stage's replicas: ``replicas`` equal parts when it
    is a count, or consecutive runs of the plan's rows when it is a tuple
    (``Stage.rows``, uneven data parallelism), so replica ``r`` takes part
    ``r`` of every microbatch, in microbatch order.

    Example:
        >>> rank_rows(8, 2, 2, 1)
        [2, 3, 6, 7]
        >>> rank_rows(8, 2, (3, 1), 0), rank_rows(8, 2, (3, 1), 1)
        ([0, 1, 2, 4, 5, 6], [3, 7])

    Raises:
        ModelError: the batch does not split so (see :func:`check_batch_split`).
    """
    check_batch_split(batch_size, microbatches, [replicas])
    mb = batch_size // microbatches
    per = replica_rows(replicas, mb)
    lo = sum(per[:replica])
    return [j * mb + lo + i for j in range(microbatches) for i in range(per[replica])]


def check_batch_split(batch_size: int, microbatches: int, replicas: Sequence[Split]) -> None:
    """Refuse a batch that does not split into ``microbatches`` equal microbatches, each among every stage's replicas.

    ``replicas`` holds each stage's split (:data:`Split`): a replica count
    (equal rows) or the plan's rows of each replica; a stage with rows fixes
    the microbatch's rows to their sum.

    Raises:
        ModelError: naming the batch, the plan's split and a batch size that would do.
    """
    fixed = sorted({sum(d) for d in replicas if not isinstance(d, int)})
    counts = [d if isinstance(d, int) else 1 for d in replicas]
    if len(fixed) > 1:
        raise ModelError(f"the plan's stages give their replicas rows that add up to different microbatches "
                         f"({', '.join(str(list(d)) for d in replicas if not isinstance(d, int))}): one microbatch "
                         "has one size; recompile the plan")
    lcm = 1
    for d in counts:
        lcm = lcm * d // _gcd(lcm, d)
    if fixed:
        mb = fixed[0]
        rows = [list(d) for d in replicas if not isinstance(d, int)][0]
        if any(mb % d for d in counts):
            raise ModelError(f"the plan gives a stage's replicas rows {rows} of each microbatch ({mb} rows), which "
                             f"another stage's replicas ({', '.join(map(str, counts))}) cannot split equally: "
                             "recompile the plan")
        if batch_size != mb * microbatches:
            raise ModelError(f"batch_size {batch_size} does not split into the plan's {microbatches} microbatches "
                             f"of {mb} rows (its replicas train on rows {rows} of each microbatch): use batch_size "
                             f"{mb * microbatches}, or recompile the plan for this batch size")
        return
    need = microbatches * lcm
    bad = batch_size % microbatches or any((batch_size // microbatches) % d for d in counts)
    if bad:
        raise ModelError(f"batch_size {batch_size} does not split into the plan's {microbatches} microbatches of "
                         f"equal rows, each split among a stage's replicas ({', '.join(map(str, replicas))}): use a "
                         f"batch_size that is a multiple of {need}, or recompile with --microbatches dividing it")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
