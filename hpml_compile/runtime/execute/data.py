"""A rank's share of a TrainSpec's data: its own rows of every batch, and the position to resume from.

The order of the data is global and does not depend on the plan: step ``s``
(counting from 0 over the whole run) trains on global batch ``s``; for a
map-style dataset of ``N`` items and batch ``B`` there are ``N // B`` batches an
epoch (the last partial one dropped), batch ``s`` is batch ``s mod (N // B)`` of
epoch ``s div (N // B)``, and an epoch's order is ``torch.randperm(N)`` from a
generator seeded with ``(seed, epoch)`` (:func:`epoch_order`). A stream
(``IterableDataset``) is read in its own order, ``B`` items a batch, and read
again from its start at its end.

Data moves only where it is needed: a rank loads the rows its stage replica
trains on (:func:`hpml_compile.trainspec.rank_rows`) and only when it needs
them: inputs where its stage reads a model input (the first stage), targets on
the last stage; other ranks load nothing and only count batches. A stream has
no index, so a rank that needs rows reads each batch whole and keeps its own.
A rank's rows may change between two batches (the closed loop moving rows off
a slowed replica without a restart, :meth:`RankData.set_rows`): the position
is the global batch number, so the next batch is the same whatever the rows,
and only which of its rows this rank loads changes.

Position: loading goes through torchdata's ``StatefulDataLoader``, whose
``state_dict`` says where it stands; the batch sampler here keeps its position
as the *global* batch number, so a state saved by any rank under one plan
restores on every rank of another plan (each then takes its own rows of the
next batch). The state is plain JSON (ints, bools, None), checked so by
:func:`check_json`, and is kept in the checkpoint's ``meta.json``, never
pickled.

Example:
    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> from hpml_compile.trainspec import TrainSpec
    >>> spec = TrainSpec(torch.nn.Linear(2, 1), TensorDataset(torch.arange(16.).view(8, 2), torch.zeros(8, 1)),
    ...                  torch.nn.functional.mse_loss, batch_size=4, seed=1)
    >>> data = RankData(spec, rows=[0, 1], inputs=True, targets=False)
    >>> b = data.next()
    >>> b.indices == global_batch(8, 4, 1, 0), b.inputs[0].shape[0], b.target is None
    (True, 2, True)
    >>> state = data.state_dict(); again = RankData(spec, rows=[0, 1], inputs=True, targets=False)
    >>> again.load_state_dict(state); again.next().indices == data.next().indices
    True
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

from ...errors import CheckpointError, HpmlError, ModelError
from ...trainspec import TrainSpec, collate, is_iterable

__all__ = ["epoch_order", "global_batch", "RankBatch", "RankData", "val_batches", "check_json", "DATA_STATE_VERSION"]

DATA_STATE_VERSION = 1


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # torchdata 0.11 calls the deprecated torch.set_vital on every new iterator; nothing for a user to act on
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        yield


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order of a map-style dataset of ``n`` items in ``epoch``: a permutation from ``(seed, epoch)``."""
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def global_batch(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The dataset indices of global batch ``step`` (0-based over the whole run), in row order."""
    per_epoch = n // batch_size
    epoch, i = divmod(step, per_epoch)
    return epoch_order(n, seed, epoch)[i * batch_size:(i + 1) * batch_size]


class _RankBatches:
    """Batch sampler: this rank's dataset indices of global batch 0, 1, 2, ... for ever (position = next batch)."""

    def __init__(self, n: int, batch_size: int, seed: int, rows: list[int]) -> None:
        self.n, self.batch_size, self.seed, self.rows = n, batch_size, seed, rows
        self.batch = 0
        self._cached: tuple[int, list[int]] | None = None

    def indices(self, step: int) -> list[int]:
        per_epoch = self.n // self.batch_size
        epoch, i = divmod(step, per_epoch)
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, epoch_order(self.n, self.seed, epoch))
        return self._cached[1][i * self.batch_size:(i + 1) * self.batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            b = self.batch
            self.batch = b + 1  # before the yield: a state taken after a batch points past it
            whole = self.indices(b)
            yield [whole[r] for r in self.rows]

    def state_dict(self) -> dict[str, int]:
        return {"batch": self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch = int(state["batch"])


@dataclass
class RankBatch:
    """What one rank trains on in one step.

    Attributes:
        step: the global batch number (0-based over the whole run).
        indices: the dataset indices of the whole global batch, in row order (None for a stream).
        inputs: this rank's rows of the inputs, or None where its stage reads no model input.
        target: this rank's rows of the target, or None off the last stage.
    """

    step: int
    indices: list[int] | None
    inputs: tuple[Tensor, ...] | None
    target: Any


def check_json(state: Any, what: str) -> Any:
    """Return ``state`` after checking that it survives JSON unchanged (the checkpoint keeps it as JSON).

    Raises:
        CheckpointError: naming ``what`` and the first value that is not plain JSON.
    """
    try:
        text = json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not plain JSON ({e}); checkpoints keep it as JSON so that loading "
                              "never unpickles: give it a state_dict of numbers, strings, lists and dicts") from e
    if json.loads(text) != state:
        raise CheckpointError(f"{what} changes when written as JSON (tuples or non-string keys?); give it a "
                              "state_dict of numbers, strings, lists and string-keyed dicts")
    return state


class RankData:
    """This rank's rows of every training batch, through a ``StatefulDataLoader`` (see the module docstring).

    Args:
        spec: the training spec.
        rows: the rows of each batch this rank trains on (:func:`~hpml_compile.trainspec.rank_rows`).
        inputs: whether this rank needs the inputs of its rows.
        targets: whether it needs their targets.
    """

    def __init__(self, spec: TrainSpec, rows: list[int], *, inputs: bool, targets: bool) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader  # torchdata: only where data is read

        self.spec, self.rows, self.need_inputs, self.need_targets = spec, rows, inputs, targets
        self.stream = is_iterable(spec.dataset)
        self.batch = 0
        self.epoch = 0
        self._sampler: _RankBatches | None = None
        self._loader: Any = None
        self._it: Iterator[Any] | None = None
        if not (inputs or targets):
            return  # a middle stage: loads nothing, counts batches
        with _quiet():
            if self.stream:
                self._loader = StatefulDataLoader(spec.dataset, batch_size=spec.batch_size, drop_last=True,
                                                  collate_fn=list)
            else:
                self._sampler = _RankBatches(len(spec.dataset), spec.batch_size, spec.seed, rows)
                self._loader = StatefulDataLoader(spec.dataset, batch_sampler=self._sampler,
                                                  collate_fn=lambda items: collate(spec, items))

    def set_rows(self, rows: list[int]) -> None:
        """Load ``rows`` of every batch from the next one on (the plan moved rows between replicas in place);
        the position does not change."""
        self.rows = rows
        if self._sampler is not None:
            self._sampler.rows = rows
            self._sampler.batch = self.batch
            self._it = None  # a new iterator from the position: nothing fetched under the old rows is served

    def again(self, step: int) -> RankBatch:
        """Global batch ``step`` once more, this rank's current rows of it (a step run again after the rows moved:
        the replicas left after a lost one share its rows); the position afterwards is as before.

        Raises:
            HpmlError: the dataset is a stream (an ``IterableDataset``), whose items cannot be read again.
        """
        if self.stream and self._loader is not None:
            raise HpmlError("the training data is a stream (an IterableDataset): a batch cannot be read again "
                            "with other rows, so a step that failed with a lost rank cannot run again in place")
        after, self.batch = self.batch, step
        if self._sampler is not None:
            self._sampler.batch, self._it = step, None
        try:
            return self.next()
        finally:
            self.batch = after
            if self._sampler is not None:
                self._sampler.batch, self._it = after, None

    def _next_stream(self) -> Any:
        for _ in range(2):
            if self._it is None:
                with _quiet():
                    self._it = iter(self._loader)
            try:
                items = next(self._it)
                return collate(self.spec, [items[r] for r in self.rows])
            except StopIteration:
                if self.batch == 0 and self.epoch == 0:
                    break
                self.epoch += 1
                self._it = None
        raise ModelError(f"TrainSpec.dataset (an IterableDataset) yields no full batch of {self.spec.batch_size}")

    def next(self) -> RankBatch:
        """The next batch's rows for this rank (None where it needs nothing)."""
        b = self.batch
        indices = None if self.stream else global_batch(len(self.spec.dataset), self.spec.batch_size,
                                                         self.spec.seed, b)
        got: Any = None
        if self._loader is not None:
            if self.stream:
                got = self._next_stream()
            else:
                if self._it is None:
                    with _quiet():
                        self._it = iter(self._loader)
                got = next(self._it)
        self.batch = b + 1
        inputs = got[0] if got is not None and self.need_inputs else None
        target = got[1] if got is not None and self.need_targets else None
        return RankBatch(b, indices, inputs, target)

    def state_dict(self) -> dict[str, Any]:
        """The position as plain JSON: the next global batch, the stream's epoch, the loader's own state."""
        loader = self._loader.state_dict() if self._loader is not None else None
        return check_json({"version": DATA_STATE_VERSION, "batch": self.batch, "epoch": self.epoch,
                           "loader": loader}, "the data loader's state")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the position of a :meth:`state_dict` taken on any rank under any plan.

        Raises:
            CheckpointError: a state of another version or form.
        """
        if not isinstance(state, dict) or state.get("version") != DATA_STATE_VERSION or "batch" not in state:
            raise CheckpointError(f"data position {str(state)[:80]!r} is not a version {DATA_STATE_VERSION} "
                                  "state of hpml_compile.runtime.execute.data.RankData")
        self.batch, self.epoch = int(state["batch"]), int(state.get("epoch", 0))
        self._it = None
        if self._loader is None:
            return
        if state.get("loader") is not None and (self.stream or self._sampler is not None):
            self._loader.load_state_dict(state["loader"])
        if self._sampler is not None:
            self._sampler.batch = self.batch  # the global position is the truth; the loader's agrees


def val_batches(spec: TrainSpec, rows: list[int], *, inputs: bool, targets: bool) -> Iterator[RankBatch]:
    """This rank's rows of every full batch of ``spec.val_dataset``, in order (no shuffle)."""
    data = spec.val_dataset
    if data is None:
        return
    where = "TrainSpec.val_dataset"
    if is_iterable(data):
        items: list[Any] = []
        b = 0
        for item in data:
            items.append(item)
            if len(items) == spec.batch_size:
                got = collate(spec, [items[r] for r in rows], where) if inputs or targets else None
                yield RankBatch(b, None, got[0] if got and inputs else None, got[1] if got and targets else None)
                items, b = [], b + 1
        return
    for b in range(len(data) // spec.batch_size):
        whole = range(b * spec.batch_size, (b + 1) * spec.batch_size)
        got = collate(spec, [data[whole[r]] for r in rows], where) if inputs or targets else None
        yield RankBatch(b, list(whole), got[0] if got and inputs else None, got[1] if got and targets else None)
