"""TrainSpec: the checks of its fields, items and batch split; loading it from a file; one rank's share of the data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

import hpml_compile
from hpml_compile.errors import CheckpointError, ModelError
from hpml_compile.models import load
from hpml_compile.runtime.execute.data import RankData, epoch_order, global_batch
from hpml_compile.trainspec import TrainSpec, check_batch_split, first_batch, rank_rows

F = torch.nn.functional


def _data(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, 0.5 * x.sum(1, keepdim=True))  # something to learn that holds on held-out rows


def _spec(**kw: object) -> TrainSpec:
    args: dict[str, object] = {"module": torch.nn.Linear(4, 1), "dataset": _data(), "loss_fn": F.mse_loss,
                               "batch_size": 4}
    args.update(kw)
    return TrainSpec(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("field,value,says", [
    ("module", "net", "TrainSpec.module must be a torch.nn.Module, got str"),
    ("dataset", 5, "TrainSpec.dataset must be a torch.utils.data.Dataset"),
    ("val_dataset", 5, "TrainSpec.val_dataset must be a torch.utils.data.Dataset"),
    ("loss_fn", "mse", "TrainSpec.loss_fn must be a callable"),
    ("batch_size", 0, "TrainSpec.batch_size must be a whole number, 1 or more, got 0"),
    ("batch_size", True, "got True"),
    ("batch_size", 4.0, "got 4.0"),
    ("batch_size", 25, "has 24 items, fewer than batch_size 25"),
    ("optimizer", "adamw", "TrainSpec.optimizer must be None or a callable"),
    ("lr_scheduler", 3, "TrainSpec.lr_scheduler must be None or a callable"),
    ("collate_fn", 3, "TrainSpec.collate_fn must be None or a callable"),
    ("seed", "0", "TrainSpec.seed must be an int"),
])
def test_a_bad_field_is_named(field: str, value: object, says: str) -> None:
    with pytest.raises(ModelError, match=None) as e:
        _spec(**{field: value})
    assert says in str(e.value)


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(self.n):
            yield torch.full((2,), float(i)), torch.tensor([float(i)])


@pytest.mark.parametrize("items,says", [
    ([torch.zeros(4)] * 8, "an item is a Tensor; expected an item (inputs, target)"),
    ([(torch.zeros(4), torch.zeros(1), torch.zeros(1))] * 8, "an item is a tuple of 3"),
    ([("text", torch.zeros(1))] * 8, "an item's inputs are a str"),
])
def test_an_item_that_is_not_inputs_and_target_is_refused(items: list, says: str) -> None:
    with pytest.raises(ModelError) as e:
        first_batch(_spec(dataset=items))
    assert says in str(e.value)


def test_first_batch_is_the_first_items_in_order_and_streams_work() -> None:
    data = _data()
    inputs, target = first_batch(_spec(dataset=data))
    assert torch.equal(inputs[0], data.tensors[0][:4]) and torch.equal(target, data.tensors[1][:4])
    (x,), y = first_batch(_spec(dataset=_Stream(10), module=torch.nn.Linear(2, 1)))
    assert x[:, 0].tolist() == [0, 1, 2, 3] and y.shape == (4, 1)
    with pytest.raises(ModelError, match="yields 3 items, fewer than batch_size 4"):
        first_batch(_spec(dataset=_Stream(3)))


def test_the_batch_must_split_into_microbatches_and_replicas() -> None:
    check_batch_split(8, 2, [2, 1])
    with pytest.raises(ModelError, match=r"batch_size 6 does not split into the plan's 2 microbatches .*2, 1\).*"
                                         r"multiple of 4"):
        check_batch_split(6, 2, [2, 1])
    with pytest.raises(ModelError, match="multiple of 3"):
        check_batch_split(4, 3, [1])
    rows = [rank_rows(8, 2, 2, r) for r in range(2)]
    assert rows == [[0, 1, 4, 5], [2, 3, 6, 7]]


SPEC_FILE = '''
import torch
from torch.utils.data import TensorDataset
from hpml_compile import TrainSpec

def make(batch_size=4):
    data = TensorDataset(torch.arange(40.).view(10, 4), torch.zeros(10, 1))
    return TrainSpec(torch.nn.Linear(4, 1), data, torch.nn.functional.mse_loss, batch_size=batch_size)

SPEC = make(2)
'''


def test_a_file_names_a_trainspec_or_a_function_returning_one(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text(SPEC_FILE)
    m = load(f"{path}:make")
    assert m.train is not None and m.batch_size == 4 and m.seq_len is None
    assert torch.equal(m.example_inputs[0], torch.arange(16.).view(4, 4))
    assert load(f"{path}:SPEC").batch_size == 2
    assert load(f"{path}:make", batch_size=6).example_inputs[0].shape == (6, 4)  # make() takes batch_size=
    with pytest.raises(ModelError, match="TrainSpec's batch_size is 2, but 6 was asked for"):
        load(f"{path}:SPEC", batch_size=6)


def test_compile_takes_a_trainspec_and_its_trainer_learns() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    spec = _spec(module=net, batch_size=8, val_dataset=_data(16),
                 optimizer=lambda ps: torch.optim.Adam(ps, lr=0.02))
    pipe = hpml_compile.compile(spec, cluster="local-cpu-2", microbatches=2, solver="dp", profile_repeats=1)
    first = pipe.trainer.validation_loss()
    losses = [pipe.trainer.step().item() for _ in range(30)]
    assert pipe.trainer.validation_loss() < 0.5 * first and sum(losses[-3:]) < 0.5 * sum(losses[:3])
    with pytest.raises(ModelError, match="needs example_inputs"):
        hpml_compile.compile(net)


def test_a_rank_takes_its_rows_and_any_plan_resumes_at_the_next_batch() -> None:
    spec = _spec(seed=3)  # 24 items, batch 4: 6 batches an epoch
    assert sorted(epoch_order(24, 3, 0)) == list(range(24)) and epoch_order(24, 3, 0) != epoch_order(24, 3, 1)
    halves = [RankData(spec, rank_rows(4, 1, 2, r), inputs=True, targets=True) for r in range(2)]
    for step in range(8):  # across the epoch boundary
        got = [h.next() for h in halves]
        whole = global_batch(24, 4, 3, step)
        assert got[0].indices == whole and got[1].indices == whole
        rows = torch.cat([g.inputs[0] for g in got])
        assert torch.equal(rows, spec.dataset.tensors[0][whole])
    state = json.loads(json.dumps(halves[0].state_dict()))  # kept as JSON in a checkpoint
    one = RankData(spec, list(range(4)), inputs=True, targets=False)  # another plan: one replica, all rows
    one.load_state_dict(state)
    b = one.next()
    assert b.step == 8 and b.indices == global_batch(24, 4, 3, 8) and b.target is None
    idle = RankData(spec, [0, 1], inputs=False, targets=False)  # a middle stage loads nothing
    idle.load_state_dict(state)
    assert idle.next().inputs is None and idle.batch == 9
    with pytest.raises(CheckpointError, match="is not a version 1 state"):
        one.load_state_dict({"batch": 3})


def test_save_load_resumes_the_same_run_and_evaluate_matches_validation(tmp_path: Path) -> None:
    from hpml_compile.runtime.execute.pipeline import Pipeline
    from hpml_compile.runtime.execute.trainer import Trainer

    def make() -> TrainSpec:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        return _spec(module=net, batch_size=8, val_dataset=_data(16), seed=2,
                     optimizer=lambda ps: torch.optim.Adam(ps, lr=0.02),
                     lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5))

    spec = make()
    pipe = hpml_compile.compile(spec, cluster="local-cpu-2", microbatches=2, solver="dp", profile_repeats=1,
                                out_dir=tmp_path / "build")
    for _ in range(5):
        pipe.trainer.step()
    pipe.save(tmp_path / "ck", extra={"note": "after 5"})
    want = [pipe.trainer.step().item() for _ in range(4)]  # across an epoch end (3 batches an epoch)
    val = TensorDataset(*spec.val_dataset.tensors)
    loader = [(val.tensors[0][i:i + 8], val.tensors[1][i:i + 8]) for i in (0, 8)]
    assert pipe.evaluate(loader) == pytest.approx(pipe.trainer.validation_loss(), rel=1e-6)

    again = make()  # a fresh process's model and pipeline, resumed
    pipe2 = Pipeline.from_build(tmp_path / "build", again.module, optimizer=again.optimizer)
    pipe2.trainer = Trainer(pipe2, again)
    assert pipe2.load(tmp_path / "ck") == {"note": "after 5", "step": 5}
    assert pipe2.optimizer.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5)  # the schedule went on
    got = [pipe2.trainer.step().item() for _ in range(4)]
    assert got == pytest.approx(want, rel=1e-6)
    with pytest.raises(CheckpointError, match="not plain JSON"):
        pipe.save(tmp_path / "ck2", extra={"t": torch.zeros(1)})


def test_run_data_options_are_checked_against_the_build(tmp_path: Path) -> None:
    import argparse

    from hpml_compile.cli.run import _data_options
    from hpml_compile.testing import split_plan
    from hpml_compile.errors import OptionError
    from hpml_compile.recipe import ModelRecipe
    from hpml_compile.trace import trace

    def args(**kw: object) -> argparse.Namespace:
        return argparse.Namespace(**{"epochs": None, "val_every": 0, "log_samples": False, "steps": None, **kw})

    zoo = ModelRecipe("gpt-tiny", 4)
    with pytest.raises(OptionError, match="--epochs 2: expected a build of a TrainSpec"):
        _data_options(args(epochs=2), zoo, None)
    plain = args()
    _data_options(plain, zoo, None)
    assert plain.steps == 20
    path = tmp_path / "train.py"
    path.write_text(SPEC_FILE)
    recipe = ModelRecipe(f"{path}:make", 4)
    gm = trace(torch.nn.Linear(4, 1), (torch.zeros(4, 4),))
    plan = split_plan(gm, "lin", 1, microbatches=2, replicas=[2])  # 4 rows: 2 microbatches x 2 replicas
    e = args(epochs=3)
    _data_options(e, recipe, plan)
    assert e.steps == 3 * (10 // 4)
    with pytest.raises(OptionError, match="either --epochs or --steps"):
        _data_options(args(epochs=3, steps=5), recipe, plan)
    with pytest.raises(OptionError, match="--val-every 5: expected a TrainSpec with a val_dataset"):
        _data_options(args(val_every=5), recipe, plan)
    with pytest.raises(ModelError, match="batch_size 4 does not split .* multiple of 8"):
        _data_options(args(), recipe, split_plan(gm, "lin", 1, microbatches=4, replicas=[2]))


def test_a_stream_is_read_in_order_each_rank_keeping_its_rows_and_resumes() -> None:
    spec = _spec(dataset=_Stream(10), module=torch.nn.Linear(2, 1))  # 2 full batches of 4 a pass
    mine = RankData(spec, [2, 3], inputs=True, targets=True)
    got = [mine.next() for _ in range(3)]  # the third starts the stream again
    assert [b.inputs[0][:, 0].tolist() for b in got] == [[2, 3], [6, 7], [2, 3]] and mine.epoch == 1
    state = json.loads(json.dumps(mine.state_dict()))
    other = RankData(spec, [0, 1, 2, 3], inputs=True, targets=False)  # another plan's rows
    other.load_state_dict(state)
    assert other.next().inputs[0][:, 0].tolist() == [4, 5, 6, 7] and other.batch == 4
