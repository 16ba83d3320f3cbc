"""Rows moved between a stage's replicas while the job runs, unit tier: no new code, training stays exact.

The closed loop's in-place row move (:meth:`Pipeline.move_rows`, decided by
:mod:`hpml_compile.runtime.job.adapt`) keeps the stage code and gives the running
pipeline new rows per replica between two steps. In one process every
replica runs here, so the moves are checked against the original model step
by step: the loss and every parameter's gradient after each step, with the
rows changed before steps 2, 3 and 4 (even -> 3:1 -> 1:3 -> even again, on
code generated at an even split or at uneven rows). What the running code
cannot serve (a boundary generated without batch dimensions, a graph from
torch.export) is named by :func:`in_place_refusal`, the data loader of a
TrainSpec takes the new rows at the same global position, and ``report``
summarises only the steps run on the rows its plan.json holds.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from hpml_compile import models, profile
from hpml_compile.cluster import load_cluster
from hpml_compile.codegen import generate, load_build
from hpml_compile.testing import max_grad_diff, split_plan
from hpml_compile.errors import HpmlError
from hpml_compile.plan import Plan, PlanPrediction, Schedule, Stage, StagePrediction, save_plan
from hpml_compile.runtime.job.adapt import in_place_refusal, take_rows
from hpml_compile.runtime.execute.data import RankData, global_batch
from hpml_compile.runtime.observe.monitor import Monitor, StepMetrics
from hpml_compile.runtime.execute.pipeline import Pipeline
from hpml_compile.runtime.observe.summary import analyse
from hpml_compile.trace import trace
from hpml_compile.trainspec import TrainSpec

TOL = 1e-5

# (model, batch, microbatches, replicas per stage, rows the code is generated at, rows of each later step)
CASES = {
    "1 -> even 2, moved 3:1, 1:3, 2:2": ("gpt-tiny", 8, 2, [1, 2], [(), ()],
                                         [[(), (3, 1)], [(), (1, 3)], [(), (2, 2)]]),
    "3:1 -> 1:3, both moved": ("mlp-tiny", 4, 1, [2, 2], [(3, 1), (1, 3)],
                               [[(2, 2), (3, 1)], [(1, 3), (2, 2)], [(3, 1), (1, 3)]]),
}


def _with_rows(plan: Plan, rows: list[tuple[int, ...]]) -> Plan:
    return replace(plan, stages=tuple(replace(st, rows=r) for st, r in zip(plan.stages, rows)))


@pytest.mark.parametrize("case", list(CASES))
def test_rows_moved_between_steps_train_as_the_original_model(case: str, tmp_path: Path) -> None:
    key, batch, m, reps, made, moves = CASES[case]
    loaded = models.load(key, batch_size=batch)
    gm = trace(loaded.module, loaded.example_inputs)
    plan = split_plan(gm, key, len(reps), microbatches=m, replicas=reps, rows=made)
    model, ref = copy.deepcopy(loaded.module), copy.deepcopy(loaded.module)
    generate(gm, plan, tmp_path)
    pipe = Pipeline(load_build(tmp_path, model, graph_module=gm), model,
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05), run_dir=None, tensorboard=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    assert in_place_refusal(pipe.build.plan, pipe.plan, _with_rows(pipe.plan, moves[0])) is None
    x, y = loaded.example_inputs, loaded.example_targets
    for step, rows in enumerate([None, *moves]):
        if rows is not None:
            pipe.move_rows(_with_rows(pipe.plan, rows))
            assert [st.rows for st in pipe.plan.stages] == rows == [st.rows for st in pipe.build.plan.stages]
        loss = pipe.step(x, y, loaded.loss_fn)
        opt.zero_grad()
        want = loaded.loss_fn(ref(*x), y)
        want.backward()
        assert abs(float(loss) - want.item()) < TOL, (step, rows)
        assert max_grad_diff(model, ref) < TOL, (step, rows)  # the gradient is the batch mean's whatever the rows
        opt.step()
    with torch.no_grad():
        assert torch.allclose(pipe.eval_forward(x), ref(*x), atol=TOL)


def test_move_rows_refuses_more_than_rows(tmp_path: Path) -> None:
    loaded = models.load("mlp-tiny", batch_size=4)
    gm = trace(loaded.module, loaded.example_inputs)
    plan = split_plan(gm, "mlp-tiny", 2, replicas=[1, 2])
    generate(gm, plan, tmp_path)
    pipe = Pipeline(load_build(tmp_path, loaded.module, graph_module=gm), loaded.module, run_dir=None,
                    tensorboard=False)
    with pytest.raises(HpmlError, match=r"rows \[2, 1\] for 2 replicas do not split a microbatch of this build \(4"):
        pipe.move_rows(_with_rows(pipe.plan, [(), (2, 1)]))
    with pytest.raises(HpmlError, match="nothing else changed"):
        pipe.move_rows(replace(pipe.plan, microbatches=2))
    assert pipe.plan.stages[1].rows == ()  # a refused move changes nothing


def test_in_place_refusal_names_what_needs_new_code(tmp_path: Path) -> None:
    loaded = models.load("mlp-tiny", batch_size=8)
    gm = trace(loaded.module, loaded.example_inputs)
    even = split_plan(gm, "mlp-tiny", 3, replicas=[2, 2, 1])  # 0 -> 1: same count, both even: no batch dims
    assert "between stage 0 and stage 1 was generated without its batch dimensions" in in_place_refusal(
        even, even, _with_rows(even, [(), (3, 1), ()]))
    # stage 1 -> 2 reshards already (2 replicas -> 1): stage 2 alone... has one replica; stage 0 moved: refused
    assert in_place_refusal(even, even, _with_rows(even, [(3, 1), (), ()])) is not None
    uneven = split_plan(gm, "mlp-tiny", 3, replicas=[2, 2, 1], rows=[(), (3, 1), ()])  # generated with batch dims
    assert in_place_refusal(uneven, uneven, _with_rows(uneven, [(1, 3), (2, 2), ()])) is None
    assert in_place_refusal(uneven, uneven, uneven) is None  # nothing moved
    assert "torch.export" in in_place_refusal(uneven, uneven, _with_rows(uneven, [(), (1, 3), ()]), "export")


def test_rank_data_takes_new_rows_at_the_same_position() -> None:
    data = TensorDataset(torch.arange(32.).view(16, 2), torch.arange(16.).view(16, 1))
    spec = TrainSpec(torch.nn.Linear(2, 1), data, torch.nn.functional.mse_loss, batch_size=4, seed=3)
    loader = RankData(spec, rows=[0, 1], inputs=True, targets=True)
    first = loader.next()
    assert first.indices is not None and first.target.view(-1).tolist() == [float(i) for i in first.indices[:2]]
    loader.set_rows([1, 2, 3])
    second = loader.next()  # global batch 1, its rows 1..3
    want = global_batch(16, 4, 3, 1)
    assert second.step == 1 and second.indices == want
    assert second.target.view(-1).tolist() == [float(i) for i in want[1:]]
    assert loader.state_dict()["batch"] == 2


def test_report_summarises_the_steps_since_rows_moved_in_place(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    prof = profile(model, (torch.randn(8, 8),), name="toy", repeats=1, warmup=0, progress=False)
    names = tuple(n.name for n in prof.nodes)
    plan = Plan("toy", load_cluster("local-cpu-2"), Schedule.GPIPE, 2,
                (Stage(0, ("cpu0", "cpu1"), names, rows=(6, 2), predicted=StagePrediction(5.0, 10.0)),),
                PlanPrediction(40.0, 0, 0.0))
    run = tmp_path / "run"
    run.mkdir()
    save_plan(plan, run / "plan.json")
    for rank in (0, 1):
        mon = Monitor(run, rank, tensorboard=False)
        for step in range(8):  # rank 1 computes 3x before the move at step 4 (4 done), its even share after
            c = 30.0 * (3.0 if rank == 1 and step < 4 else 1.0)
            mon.record(StepMetrics(step=step, rank=rank, stage=0, replica=rank, device=f"cpu{rank}", microbatches=2,
                                   samples=16, step_ms=100.0, pipeline_ms=90.0, fwd_ms=c / 3, bwd_ms=2 * c / 3))
        mon.close()
    (run / "replans.jsonl").write_text(json.dumps({"step": 2, "switch": False}) + "\n"
                                       + json.dumps({"step": 4, "switch": True, "in_place": True}) + "\n")
    s = analyse(run, skip=1)
    assert s.steps == 4 and s.skipped == 1  # steps 5..8 ran on plan.json's rows; the first of them as warm-up
    assert s.stages[0].compute_ms == pytest.approx(30.0)  # not the 90 ms of the steps before the move
    (run / "replans.jsonl").write_text(json.dumps({"step": 4, "switch": False}) + "\n")
    assert analyse(run, skip=1).steps == 8  # no move: every step


def test_a_restart_takes_the_rows_moved_before_it(tmp_path: Path) -> None:
    """``take_rows``: what a rank restarted after a failure runs first (``rows_from`` in the segment's run options)."""
    loaded = models.load("mlp-tiny", batch_size=8)
    gm = trace(loaded.module, loaded.example_inputs)
    plan = split_plan(gm, "mlp-tiny", 2, replicas=[1, 2])  # stage 1 generated at an even split: rows may move

    def fresh(out: Path) -> Pipeline:
        generate(gm, plan, out)
        return Pipeline(load_build(out, loaded.module, graph_module=gm), loaded.module, run_dir=None,
                        tensorboard=False)

    pipe = fresh(tmp_path / "b")
    moved = replace(_with_rows(plan, [(), (6, 2)]), predicted=PlanPrediction(12.5, 0, 0.0))
    save_plan(moved, tmp_path / "plan.json")
    took = take_rows(pipe, tmp_path / "plan.json")
    assert [st.rows for st in took.stages] == [(), (6, 2)] == [st.rows for st in pipe.plan.stages]
    assert pipe.plan.predicted.step_ms == 12.5  # the predictions made for those rows come along
    assert in_place_refusal(plan, plan, took) is None and pipe.rows_role()[0] == list(range(8))
    # not this build's plan with other rows: named, nothing taken
    pipe = fresh(tmp_path / "c")
    save_plan(replace(moved, microbatches=2), tmp_path / "other.json")
    with pytest.raises(HpmlError, match="not the running build's plan with other rows"):
        take_rows(pipe, tmp_path / "other.json")
    assert pipe.plan.stages[1].rows == ()
    # rows the build's code cannot serve (stage 0 moved: its boundary was generated without batch dimensions)
    two = split_plan(gm, "mlp-tiny", 2, replicas=[2, 2])
    generate(gm, two, tmp_path / "d")
    pipe = Pipeline(load_build(tmp_path / "d", loaded.module, graph_module=gm), loaded.module, run_dir=None,
                    tensorboard=False)
    save_plan(_with_rows(two, [(6, 2), ()]), tmp_path / "refused.json")
    with pytest.raises(HpmlError, match="cannot run on this build's code: the boundary between stage 0 and stage 1"):
        take_rows(pipe, tmp_path / "refused.json")
