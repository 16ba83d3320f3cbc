"""ZB-H1, unit tier: its lowering keeps 1F1B's peak, the validator knows its parts, and it is transparent in one process.

Transparency: the build's outputs, loss and every gradient after one step, and the parameters after three
SGD steps, equal the original model's (float32, 1e-5), for gpt-tiny (its embedding is tied to the head
across the first and last stage) and the skip network (a value skipping a stage), on 2 and 3 stages, and
with every stage recomputing.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_leaves

from hpml_compile import models
from hpml_compile.codegen import generate, load_build
from hpml_compile.errors import ScheduleError
from hpml_compile.plan import Schedule
from hpml_compile.runtime import merge_outputs, step_local
from hpml_compile.backsplit import backward_input, backward_weight
from hpml_compile.schedule import ActionKind, Action, lower, op_order
from hpml_compile.schedule_check import validate
from hpml_compile.testing import SkipNet, max_grad_diff, skipnet_batch, skipnet_loss, split_plan
from hpml_compile.trace import trace

TOL = 1e-5


def _held(schedule: Schedule, stage: int, stages: int, m: int) -> int:
    """The most microbatches whose activations the stage holds (forward done, last backward part not)."""
    last = ActionKind.BACKWARD if schedule is not Schedule.ZB_H1 else ActionKind.BACKWARD_WEIGHT
    held = peak = 0
    for kind, _ in op_order(schedule, stage, stages, m):
        held += (kind is ActionKind.FORWARD) - (kind is last)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("stages, m", [(2, 2), (3, 8), (4, 4), (4, 2), (5, 16)])
def test_zb_h1_holds_1f1b_peak_and_validates(stages: int, m: int) -> None:
    one = max(_held(Schedule.ONE_F_ONE_B, i, stages, m) for i in range(stages))
    assert [_held(Schedule.ZB_H1, i, stages, m) for i in range(stages)] == [min(stages, m)] * stages
    assert one == min(stages, m)
    validate(lower(Schedule.ZB_H1, m, [1] * stages), [1] * stages)
    validate(lower(Schedule.ZB_H1, m, [2, *[1] * (stages - 1)]), [2, *[1] * (stages - 1)])
    # the last stage holds back the most weight parts: all but its last S - 1 run after its last I
    last = [k for k, _ in op_order(Schedule.ZB_H1, stages - 1, stages, m)]
    assert last[-min(stages - 1, m):] == [ActionKind.BACKWARD_WEIGHT] * min(stages - 1, m)


def test_the_validator_names_a_weight_part_out_of_place() -> None:
    ranks = [list(r) for r in lower(Schedule.ZB_H1, 2, [1, 1])]
    w = next(i for i, a in enumerate(ranks[1]) if a.kind is ActionKind.BACKWARD_WEIGHT)
    early = [ranks[1][w], *ranks[1][:w], *ranks[1][w + 1:]]
    with pytest.raises(ScheduleError, match="1W0 comes before its input-gradient part 1I0"):
        validate([tuple(ranks[0]), tuple(early)], [1, 1])
    both = [*ranks[1][:-2], Action(ActionKind.BACKWARD, (1,), 0), *ranks[1][-2:]]
    with pytest.raises(ScheduleError, match="microbatch 0 has 1 forward"):
        validate([tuple(ranks[0]), tuple(both)], [1, 1])
    assert str(Action.parse("3W7")) == "3W7" and Action.parse("0I1").kind is ActionKind.BACKWARD_INPUT


def test_the_split_leaves_weights_to_w() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    ref = copy.deepcopy(net)
    x = torch.randn(3, 4, requires_grad=True)
    part = backward_input([net(x).sum()], list(net.parameters()), [x])
    assert all(p.grad is None for p in net.parameters()) and x.grad is not None
    backward_weight(part)
    xr = x.detach().clone().requires_grad_()
    ref(xr).sum().backward()
    assert torch.allclose(x.grad, xr.grad) and max_grad_diff(net, ref) < 1e-7


def _case(key: str) -> tuple[torch.nn.Module, tuple, torch.Tensor, object]:
    if key == "skipnet":
        torch.manual_seed(0)
        x, y = skipnet_batch()
        return SkipNet(), (x,), y, skipnet_loss
    loaded = models.load(key, batch_size=8, seq_len=16, seed=0)
    return loaded.module, loaded.example_inputs, loaded.example_targets, loaded.loss_fn


@pytest.mark.parametrize("key, stages, m, recompute", [("gpt-tiny", 2, 2, ()), ("gpt-tiny", 3, 4, ()),
                                                      ("skipnet", 3, 2, ()), ("gpt-tiny", 3, 2, (0, 1, 2))])
def test_zb_h1_is_transparent_in_one_process(key: str, stages: int, m: int, recompute: tuple[int, ...],
                                             tmp_path: Path) -> None:
    net, inputs, targets, loss_fn = _case(key)
    gm = trace(net, inputs)
    generate(gm, split_plan(gm, key, stages, microbatches=m, schedule=Schedule.ZB_H1, recompute=recompute), tmp_path)
    model, ref = copy.deepcopy(net), copy.deepcopy(net)
    build = load_build(tmp_path, model, graph_module=gm)
    assert any(a.kind is ActionKind.BACKWARD_WEIGHT for a in build.actions[-1])
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        result = step_local(build, inputs, targets, loss_fn)
        out = ref(*inputs)
        loss = loss_fn(out, targets)
        loss.backward()
        assert torch.allclose(result.loss, loss, atol=TOL), (step, result.loss, loss)
        ours = merge_outputs([o for _, _, o in sorted(result.outputs, key=lambda t: t[:2])])
        for a, b in zip(tree_leaves(ours), tree_leaves(out)):
            assert torch.allclose(a, b, atol=TOL), (step, (a - b).abs().max())
        assert max_grad_diff(model, ref) < TOL, step
        opt.step()
        ref_opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    assert diff < TOL


def test_what_zb_h1_does_not_run_yet_is_refused_by_name(tmp_path: Path) -> None:
    from hpml_compile.errors import OptionError, PlanError
    from hpml_compile.runtime import Pipeline

    net, inputs, _, _ = _case("gpt-tiny")
    gm = trace(net, inputs)
    with pytest.raises(PlanError, match="zb-h1: stage 1 uses swap"):
        split_plan(gm, "gpt-tiny", 2, microbatches=2, schedule=Schedule.ZB_H1, swap=(1,))
    with pytest.raises(PlanError, match="stage 0 uses ZeRO-3"):
        split_plan(gm, "gpt-tiny", 2, microbatches=2, schedule=Schedule.ZB_H1, replicas=[2, 1], zero=3)
    generate(gm, split_plan(gm, "gpt-tiny", 2, microbatches=2, schedule=Schedule.ZB_H1), tmp_path)
    with pytest.raises(OptionError, match="compile_stages=on: schedule zb-h1"):
        Pipeline.from_build(tmp_path, copy.deepcopy(net), compile_stages="on")


def test_auto_takes_zb_h1_where_it_simulates_faster_and_says_so() -> None:
    from hpml_compile import driver
    from hpml_compile.costgraph import build
    from hpml_compile.plan import Plan, Stage
    from hpml_compile.simulate import annotate
    from hpml_compile.testing import chain_profile, uniform_cluster

    prof = chain_profile([(4.0, 8.0)] * 4)
    graph = build(prof)
    stages = tuple(Stage(i, (f"d{i}",), (f"n{i}",)) for i in range(4))
    one = annotate(Plan("toy", uniform_cluster(4), Schedule.ONE_F_ONE_B, 4, stages), graph)[0]
    lines: list[str] = []
    got = driver.faster_schedule(one, graph, prof, lines.append)
    assert got.schedule is Schedule.ZB_H1 and [st.devices for st in got.stages] == [st.devices for st in one.stages]
    assert got.predicted.step_ms < one.predicted.step_ms and got.predicted.bubble < one.predicted.bubble
    assert lines[-1].startswith("schedule: zb-h1")
    swapped = annotate(Plan("toy", uniform_cluster(4), Schedule.ONE_F_ONE_B, 4,
                            (Stage(0, ("d0",), ("n0",), swap=("n0",)), *stages[1:])), graph)[0]
    assert driver.faster_schedule(swapped, graph, prof, lines.append) is swapped
    assert "stage 0 uses swap" in lines[-1]
    assert driver.Options(schedule="auto").choose_schedule and driver.Options(schedule="auto").schedule is None
