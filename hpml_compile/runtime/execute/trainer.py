"""A TrainSpec's training loop on one rank: its rows of each batch, the schedule, validation, and their state.

What ``hpml-compile run`` does for a build of a :class:`~hpml_compile.TrainSpec`
(each rank, :mod:`.worker`): each step the rank takes its own rows of the
next global batch (:class:`.data.RankData`: inputs on the stages that read
model inputs, targets on the last stage, nothing elsewhere), the pipeline
trains on them (:meth:`.pipeline.Pipeline.step` with ``rank_batch``), and the
learning-rate scheduler steps once. Validation (when asked) runs the whole
``val_dataset`` in eval mode after the step's update, each rank again on its
own rows, and is recorded with that step (``val_loss`` in the per-step JSON
lines and TensorBoard).

State for a checkpoint (:meth:`Trainer.state_dict`, kept in ``meta.json`` as
JSON, never pickled): the scheduler's ``state_dict`` and the data position
(the next global batch, and the loader's own state). After a restart under any
plan the data resumes at the batch after the checkpointed step, and the
optimizer's learning rate is set back to the scheduler's last one (the
checkpoint keeps no optimizer hyper-parameters).

Example:
    >>> import torch, tempfile
    >>> from torch.utils.data import TensorDataset
    >>> from hpml_compile.trainspec import TrainSpec
    >>> from hpml_compile.codegen import generate
    >>> from hpml_compile.testing import split_plan
    >>> from hpml_compile.trace import trace
    >>> from .pipeline import Pipeline
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    >>> spec = TrainSpec(net, data, torch.nn.functional.mse_loss, batch_size=8, val_dataset=data,
    ...                  lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5))
    >>> gm = trace(net, (data[:8][0],))
    >>> _ = generate(gm, split_plan(gm, "seq", 2, microbatches=2), d := tempfile.mkdtemp())
    >>> pipe = Pipeline.from_build(d, net, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> t = Trainer(pipe, spec)
    >>> first = t.validation_loss()
    >>> _ = [t.step() for _ in range(8)]
    >>> t.validation_loss() < first, pipe.optimizer.param_groups[0]["lr"], t.state_dict(8)["data"]["batch"]
    (True, 0.00625, 8)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

from torch import Tensor

from ...errors import CheckpointError, HpmlError
from ...trainspec import TrainSpec, check_item
from .data import RankBatch, RankData, check_json, val_batches
from .pipeline import Pipeline

__all__ = ["Trainer", "samples_path", "save_pipeline", "load_pipeline", "evaluate_pipeline"]


def samples_path(run_dir: str | Path, rank: int) -> Path:
    """Where a first-stage rank logs the dataset indices of each step's rows (``--log-samples``)."""
    return Path(run_dir) / "samples" / f"rank{rank}.jsonl"


class Trainer:
    """One rank's loop over a TrainSpec's data (see the module docstring).

    Args:
        pipe: this rank's pipeline (its optimizer made already).
        spec: the training spec.
        run_dir: where ``samples/rank<r>.jsonl`` goes with ``log_samples``.
        log_samples: first-stage ranks log each step's global batch number and the dataset indices of their rows.

    Raises:
        ModelError: the batch does not split into the plan's microbatches and replicas.
        HpmlError: ``pipe`` joined a running job (:mod:`.join`): it trains with ``step()``.
    """

    def __init__(self, pipe: Pipeline, spec: TrainSpec, *, run_dir: str | Path | None = None,
                 log_samples: bool = False) -> None:
        if pipe.session is not None and getattr(pipe.session, "grant", None) is not None:
            raise HpmlError("a replica that joined a running job is fed with step() from its steps_done on: it is "
                            "not given a TrainSpec's data position and learning-rate schedule")
        self.pipe, self.spec = pipe, spec
        self.rows, self.needs_inputs, self.needs_targets = pipe.rows_role()
        self.data = RankData(spec, self.rows, inputs=self.needs_inputs, targets=self.needs_targets)
        self.scheduler = spec.lr_scheduler(pipe.optimizer) if spec.lr_scheduler and pipe.optimizer else None
        self._samples = None
        if log_samples and run_dir is not None and pipe.stage_index == 0 and pipe.session is not None:
            path = samples_path(run_dir, pipe.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._samples = path.open("a")

    def step(self, *, validate: bool = False) -> Tensor:
        """Train on the next batch (this rank's rows of it), step the scheduler; returns the batch loss.

        Args:
            validate: also measure the validation loss after the update (recorded with this step).
        """
        batch = self.data.next()
        if self._samples is not None and batch.indices is not None:
            self._samples.write(json.dumps({"batch": batch.step, "indices": [batch.indices[r] for r in self.rows]})
                                + "\n")
            self._samples.flush()
        check = self.validation_loss if validate and self.spec.val_dataset is not None else None
        if self.pipe.session is None:  # one process: every stage here takes the whole batch
            loss = self.pipe.step(batch.inputs or (), batch.target, self.spec.loss_fn, validate=check)
        else:
            loss = self.pipe.step((), None, self.spec.loss_fn, rank_batch=batch, validate=check)
        if self.scheduler is not None:
            self.scheduler.step()
        return loss

    def rows_moved(self) -> None:
        """Take this rank's new rows from the pipeline (after :meth:`.pipeline.Pipeline.move_rows`): from the
        next batch on the data loads them; the position stays."""
        self.rows = self.pipe.rows_role()[0]
        self.data.set_rows(self.rows)

    def batch_again(self, step: int) -> RankBatch:
        """Global batch ``step`` once more with this rank's rows now (a failed step run again after a lost rank's
        rows came here, :meth:`.pipeline.Pipeline.step`); the position stays. The samples log keeps the batch as
        first logged: the step trains the same samples, split otherwise."""
        return self.data.again(step)

    def validation_loss(self) -> float:
        """The mean loss over every full batch of ``val_dataset`` in eval mode (the same on every rank)."""
        losses = []
        for batch in val_batches(self.spec, self.rows, inputs=self.needs_inputs, targets=self.needs_targets):
            if self.pipe.session is None:
                losses.append(self.pipe.eval_loss(batch.inputs or (), batch.target, self.spec.loss_fn))
            else:
                losses.append(self.pipe.eval_loss((), None, self.spec.loss_fn, rank_batch=batch))
        return sum(losses) / len(losses) if losses else float("nan")

    def state_dict(self, step: int) -> dict[str, Any]:
        """What a checkpoint of ``step`` keeps for this loop, as JSON: the scheduler and the data position.

        Raises:
            CheckpointError: the position is not ``step`` (a bug), or the scheduler's state is not plain JSON.
        """
        if self.data.batch != step:
            raise CheckpointError(f"checkpoint of step {step}: the data stands at batch {self.data.batch}; "
                                  "they must agree for a resume to take the batch after the step")
        sched = check_json(self.scheduler.state_dict(), "the lr_scheduler's state") if self.scheduler else None
        return {"lr_scheduler": sched, "data": self.data.state_dict()}

    def load_state_dict(self, meta: dict[str, Any], where: str | Path = "the checkpoint") -> None:
        """Resume from a checkpoint's ``meta.json``: the data at the batch after its step, the schedule where it was.

        Raises:
            CheckpointError: the checkpoint holds no data position (written while training on an example
                batch) or one that is not its step, or no scheduler state where the spec has a scheduler.
        """
        step = int(meta["step"])
        state = meta.get("data")
        if state is None:
            raise CheckpointError(f"{where} holds no data position (it was written by a run on the example batch, "
                                  "not on a TrainSpec's dataset): start without --resume")
        self.data.load_state_dict(state)
        if self.data.batch != step:
            raise CheckpointError(f"{where}: its data position (batch {self.data.batch}) is not its step ({step})")
        if self.scheduler is not None:
            sched = meta.get("lr_scheduler")
            if sched is None:
                raise CheckpointError(f"{where} holds no lr_scheduler state, but the TrainSpec has an lr_scheduler")
            self.scheduler.load_state_dict(sched)
            for group, lr in zip(self.scheduler.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr  # the optimizer was made afresh with the initial rate

    def close(self) -> None:
        """Close the sample log."""
        if self._samples is not None:
            self._samples.close()
            self._samples = None


_USER = "user_extra"  # where save_pipeline keeps the caller's own facts in meta.json


def save_pipeline(pipe: Pipeline, root: str | Path, *, extra: dict[str, Any] | None = None,
                  keep: int = 3) -> Path:
    """:meth:`Pipeline.save`: a checkpoint of step ``pipe.steps_done`` with what ``hpml-compile run`` keeps.

    Parameters and optimizer state (by the original names: it loads under any plan), RNG states, and with a
    trainer (``compile(spec)``) the scheduler and the data position; ``extra`` (plain JSON) comes back from
    :func:`load_pipeline`. Call on every rank.

    Raises:
        CheckpointError: ``extra`` is not plain JSON.
    """
    from .checkpoint import save_checkpoint
    from .tensor_parallel import checkpoint_view

    step = pipe.steps_done
    facts: dict[str, Any] = {_USER: check_json(extra or {}, "save(extra=...)")}
    if pipe.trainer is not None:
        facts.update(pipe.trainer.state_dict(step))
    with checkpoint_view(pipe) as writes:  # tensor-parallel slices whole (stored once)
        if not writes:
            return Path(root) / f"step_{step:08d}"
        return save_checkpoint(root, step, pipe.local_module(), pipe.optimizer, extra=facts, keep=keep,
                               feedback=pipe.feedback())


def load_pipeline(pipe: Pipeline, root: str | Path, *, missing_ok: bool = False) -> dict[str, Any] | None:
    """:meth:`Pipeline.load`: resume from the latest intact checkpoint in ``root`` (or a ``step_<N>`` folder).

    Args:
        pipe: the pipeline.
        root: the checkpoint folder.
        missing_ok: return None when there is no checkpoint yet (a script's first start) instead of raising.

    Returns:
        The ``extra`` given to :func:`save_pipeline`, plus ``step``; None when there was nothing to load.

    Raises:
        CheckpointError: nothing intact to load (unless ``missing_ok``), or a checkpoint of another model.
    """
    from .checkpoint import latest, load_checkpoint, resume_from
    from .tensor_parallel import checkpoint_view

    path = Path(root)
    if missing_ok and not (path / "meta.json").is_file() and latest(path) is None:
        return None
    found = path if (path / "meta.json").is_file() else resume_from(path)
    with checkpoint_view(pipe):
        meta = load_checkpoint(found, pipe.local_module(), pipe.optimizer, feedback=pipe.feedback())
    pipe.steps_done = int(meta["step"])
    if pipe.trainer is not None:
        pipe.trainer.load_state_dict(meta, found)
    return {**meta.get(_USER, {}), "step": pipe.steps_done}


def evaluate_pipeline(pipe: Pipeline, loader: Iterable[Any], loss_fn: Callable[[Any, Any], Tensor] | None) -> float:
    """:meth:`Pipeline.evaluate`: the mean loss over ``loader``'s batches in eval mode, on every rank.

    Args:
        pipe: the pipeline.
        loader: batches ``(inputs, target)``, the whole batch on every rank (as :meth:`Pipeline.step` takes them).
        loss_fn: ``(output, target) -> loss``; None: the TrainSpec's, where ``compile`` was given one.

    Raises:
        HpmlError: no loss function; ModelError: a batch that is not ``(inputs, target)``.
    """
    fn = loss_fn or (pipe.trainer.spec.loss_fn if pipe.trainer is not None else None)
    if fn is None:
        raise HpmlError("evaluate(loader) needs loss_fn=(output, target) -> loss (or compile a TrainSpec)")
    losses = []
    for batch in loader:
        check_item(batch, "evaluate(loader)")
        inputs, target = batch
        losses.append(pipe.eval_loss(inputs, target, fn))
    return sum(losses) / len(losses) if losses else float("nan")
