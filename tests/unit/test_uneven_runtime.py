"""Uneven data parallelism (``Stage.rows``), unit tier: replicas with their own rows are transparent in one process.

A stage whose replicas train on different rows of each microbatch (3:1, 1:2:5)
inside a 2-stage pipeline, next to a stage with one device, equal replicas
or another uneven split: the outputs, the loss and every parameter's gradient
equal the original model's, because each replica's loss counts by its rows
and each boundary reshards between the two row splits (activations forward,
their gradients backward). A batch that the plan's rows do not fit is refused
naming the rows and a batch size that would do.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_leaves

from hpml_compile import models
from hpml_compile.codegen import generate, load_build
from hpml_compile.codegen.comm import overlaps, split_ranges
from hpml_compile.testing import max_grad_diff, split_plan
from hpml_compile.errors import HpmlError, ModelError
from hpml_compile.plan import Schedule
from hpml_compile.runtime import merge_outputs, step_local
from hpml_compile.runtime.execute.executor import split_replicas
from hpml_compile.runtime.execute.pipeline import Pipeline
from hpml_compile.trace import trace
from hpml_compile.trainspec import check_batch_split, rank_rows, replica_rows

TOL = 1e-5

# (model, rows of each stage's replicas (() with one device: a single replica), microbatches, batch, schedule,
#  [stages that swap, stages that recompute])
CASES = {
    "1 -> 3:1": ("gpt-tiny", [(), (3, 1)], 2, 8, Schedule.GPIPE),
    "1:2:5 -> 3:1": ("gpt-tiny", [(1, 2, 5), (6, 2)], 2, 16, Schedule.ONE_F_ONE_B),
    "3:1 -> 1:2:5": ("mlp-tiny", [(6, 2), (1, 2, 5)], 2, 16, Schedule.GPIPE),
    "3:1 -> 1:3": ("mlp-tiny", [(3, 1), (1, 3)], 1, 4, Schedule.ONE_F_ONE_B),
    "1:2:5 -> even 2": ("mlp-tiny", [(1, 2, 5), (4, 4)], 1, 8, Schedule.GPIPE),
    "3:1 -> 1": ("gpt-tiny", [(3, 1), ()], 2, 8, Schedule.GPIPE),
    # swapped activations on the uneven stage, recompute on the next one
    "3:1 swap -> 1:2:1 recompute": ("gpt-tiny", [(3, 1), (1, 2, 1)], 2, 8, Schedule.ONE_F_ONE_B, (0,), (1,)),
}


def _plan(key: str, rows: list[tuple[int, ...]], m: int, b: int, schedule: Schedule, swap: tuple[int, ...] = (),
          recompute: tuple[int, ...] = ()) -> tuple:
    loaded = models.load(key, batch_size=b)
    gm = trace(loaded.module, loaded.example_inputs)
    reps = [len(r) or 1 for r in rows]
    uneven = [r if len(set(r)) > 1 else () for r in rows]  # an equal split is written as no rows
    plan = split_plan(gm, key, len(rows), microbatches=m, replicas=reps, rows=uneven, schedule=schedule, swap=swap,
                      recompute=recompute)
    return loaded, gm, plan


@pytest.mark.parametrize("case", list(CASES))
def test_uneven_replicas_are_transparent_in_one_process(case: str, tmp_path: Path) -> None:
    loaded, gm, plan = _plan(*CASES[case])
    assert any(st.rows for st in plan.stages)
    model, ref = copy.deepcopy(loaded.module), copy.deepcopy(loaded.module)
    generate(gm, plan, tmp_path)
    build = load_build(tmp_path, model, graph_module=gm)
    result = step_local(build, loaded.example_inputs, loaded.example_targets, loaded.loss_fn)
    out = ref(*loaded.example_inputs)
    loss = loaded.loss_fn(out, loaded.example_targets)
    loss.backward()
    assert result.loss is not None and abs(result.loss.item() - loss.item()) < TOL
    ours = merge_outputs([o for _, _, o in sorted(result.outputs, key=lambda t: t[:2])])
    for a, b in zip(tree_leaves(ours), tree_leaves(out)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=TOL), (a - b).abs().max()
    assert max_grad_diff(model, ref) < TOL
    assert (result.swap_bytes > 0) == any(st.swap for st in plan.stages)
    # each replica of the last stage ran its own rows of each microbatch
    last = plan.stages[-1]
    sizes = {r: tree_leaves(o)[0].shape[0] for _, r, o in result.outputs}
    per_row = tree_leaves(out)[0].shape[0] // loaded.example_inputs[0].shape[0]
    want = last.rows or (sum(plan.stages[0].rows) // len(last.devices),) * len(last.devices)
    assert [sizes[r] // per_row for r in range(len(last.devices))] == list(want)


def test_pipeline_trains_evaluates_and_refuses_a_batch_the_rows_do_not_fit(tmp_path: Path) -> None:
    loaded, gm, plan = _plan(*CASES["1 -> 3:1"])
    model, ref = copy.deepcopy(loaded.module), copy.deepcopy(loaded.module)
    generate(gm, plan, tmp_path)
    pipe = Pipeline(load_build(tmp_path, model, graph_module=gm), model,
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), run_dir=None, tensorboard=False)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = loaded.example_inputs, loaded.example_targets
    for _ in range(3):  # AdamW normalises the gradient: a wrong weighting would still move, so compare the losses
        loss = pipe.step(x, y, loaded.loss_fn)
        opt.zero_grad()
        want = loaded.loss_fn(ref(*x), y)
        want.backward()
        opt.step()
        assert abs(float(loss) - want.item()) < 1e-4
    with torch.no_grad():
        assert torch.allclose(pipe.eval_forward(x), ref(*x), atol=1e-4)
        assert abs(pipe.eval_loss(x, y, loaded.loss_fn) - loaded.loss_fn(ref(*x), y).item()) < 1e-4
    rows, _, _ = pipe.rows_role()
    assert rows == list(range(8))  # one process runs the whole batch
    with pytest.raises(HpmlError, match="rows"):
        pipe.step(tuple(t[:6] for t in x), y[:6], loaded.loss_fn)


def test_rows_of_a_batch_per_replica() -> None:
    assert replica_rows((1, 2, 5), 8) == [1, 2, 5] and replica_rows(2, 8) == [4, 4]
    assert [rank_rows(16, 2, (1, 2, 5), r) for r in range(3)] == [
        [0, 8], [1, 2, 9, 10], [3, 4, 5, 6, 7, 11, 12, 13, 14, 15]]
    assert sorted(i for r in range(2) for i in rank_rows(8, 2, (3, 1), r)) == list(range(8))
    check_batch_split(16, 2, [(1, 2, 5), 2, (6, 2)])
    with pytest.raises(ModelError, match=r"rows \[3, 1\].*use batch_size 8"):
        check_batch_split(12, 2, [1, (3, 1)])
    with pytest.raises(ModelError, match="different microbatches"):
        check_batch_split(8, 2, [(3, 1), (1, 2)])
    with pytest.raises(ModelError, match="cannot split equally"):
        check_batch_split(8, 1, [(3, 5), 3])
    with pytest.raises(ModelError, match=r"\[3, 1\]"):
        rank_rows(6, 2, (3, 1), 0)
    parts = split_replicas((torch.arange(8), "x"), (1, 2, 5))
    assert [p[0].tolist() for p in parts] == [[0], [1, 2], [3, 4, 5, 6, 7]] and parts[2][1] == "x"
    with pytest.raises(HpmlError, match=r"\[3, 1\]"):
        split_replicas(torch.zeros(5), (3, 1))
    # a replica's rows against the other side's split: what it sends to (or receives from) each peer
    assert overlaps((1, 3), split_ranges([3, 1])) == [(0, 0, 2)]
    assert overlaps((3, 8), split_ranges([6, 2])) == [(0, 0, 3), (1, 3, 2)]


def test_build_refuses_rows_that_do_not_fit_the_traced_batch(tmp_path: Path) -> None:
    loaded, gm, _ = _plan(*CASES["1 -> 3:1"])
    plan = split_plan(gm, "gpt-tiny", 2, microbatches=2, rows=[(), (2, 1)])  # microbatches of 4 rows, not 3
    with pytest.raises(HpmlError, match=r"rows \[2, 1\].*4 rows"):
        generate(gm, plan, tmp_path)
