"""ZB-H1's backward split as the profile measures it, and the simulator prices it with.

The profile times each block's backward whole and as ZB-H1 runs it (input-gradient part, then weight-gradient
part); the simulator takes each stage's weight-gradient share and the split's own cost from those figures, and
the plan's assumptions say whether they were measured.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hpml_compile.assumptions import assumptions
from hpml_compile.costgraph import build
from hpml_compile.plan import Schedule
from hpml_compile.profile import profile
from hpml_compile.simulate import stage_costs
from hpml_compile.stagecost import WEIGHT_SHARE
from hpml_compile.testing import split_plan
from hpml_compile.trace import trace


@pytest.fixture(scope="module")
def measured() -> tuple[torch.fx.GraphModule, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(128, 128), torch.nn.ReLU())])
    x = torch.randn(16, 128)
    return trace(model, (x,)), profile(model, (x,), repeats=3, micro_batch=4)


def test_each_block_gets_a_measured_split_and_a_layer_without_weights_none_of_it(measured) -> None:
    _, prof = measured
    facts = prof.devices["cpu"]["split"]
    assert facts["rows"] == 4
    blocks = {name: (share, extra) for name, share, extra in facts["blocks"]}
    linears = [blocks[n.name] for n in prof.nodes if n.params]
    relus = [blocks[n.name] for n in prof.nodes if n.name in blocks and not n.params]
    assert len(linears) == 3 and len(relus) == 3
    # a ReLU's weight-gradient part has nothing to compute; a Linear's computes its weight's gradient
    assert max(s for s, _ in relus) < min(s for s, _ in linears)
    assert all(0 < s < 1 for s, _ in linears) and all(x >= 0 for _, x in blocks.values())


def _with_split(prof, share: float, extra: float):
    """The profile with every block's measured split replaced by ``share`` and ``extra``."""
    cpu = dict(prof.devices["cpu"])
    cpu["split"] = {**cpu["split"], "blocks": [[b[0], share, extra] for b in cpu["split"]["blocks"]]}
    return dataclasses.replace(prof, devices={**prof.devices, "cpu": cpu})


def test_the_simulator_prices_zb_h1_with_the_measured_share_and_the_splits_own_cost(measured) -> None:
    gm, prof = measured
    plan = split_plan(gm, "toy", 2, microbatches=4, schedule=Schedule.ZB_H1)
    unmeasured = dataclasses.replace(prof, devices={**prof.devices, "cpu": {
        k: v for k, v in prof.devices["cpu"].items() if k != "split"}})
    assumed = stage_costs(plan, build(unmeasured))
    for st in assumed:
        assert st.weight_ms == pytest.approx(WEIGHT_SHARE * st.bwd_ms)
    share, extra = 0.8, 0.5
    priced = stage_costs(plan, build(_with_split(prof, share, extra)))
    for st, base, stage in zip(priced, assumed, plan.stages):
        blocks = sum(1 for b in prof.devices["cpu"]["split"]["blocks"] if b[0] in stage.nodes)
        assert blocks > 0
        # the split's own cost adds to the backward; the weight part is the share of all of it
        assert st.bwd_ms == pytest.approx(base.bwd_ms + extra * blocks)
        assert st.weight_ms == pytest.approx(share * st.bwd_ms)
    assert sum(st.weight_ms for st in priced) > sum(st.weight_ms for st in assumed)


def test_the_plan_says_whether_the_split_was_measured(measured) -> None:
    gm, prof = measured
    plan = split_plan(gm, "toy", 2, microbatches=4, schedule=Schedule.ZB_H1)
    said = {a.name: a.source for a in assumptions(plan, prof)}
    assert said["backward split (zb-h1)"].startswith("measured per block at 4 rows")
    bare = dataclasses.replace(prof, devices={**prof.devices, "cpu": {
        k: v for k, v in prof.devices["cpu"].items() if k != "split"}})
    said = {a.name: a.source for a in assumptions(plan, bare)}
    assert said["backward split (zb-h1)"].startswith("assumed")


def test_the_path_bound_takes_each_nodes_measured_share_and_holds_for_the_plan(measured) -> None:
    """The certificate's path back charges each node's measured input-gradient part: less of it the larger the
    weight share, and never more than the ZB-H1 plan priced with the same figures takes."""
    from hpml_compile.certify import row_bound
    from hpml_compile.simulate import annotate

    gm, prof = measured
    plan = split_plan(gm, "toy", 2, microbatches=4, schedule=Schedule.ZB_H1)
    small, large = build(_with_split(prof, 0.1, 0.0)), build(_with_split(prof, 0.9, 0.0))
    assert row_bound(large, plan.cluster, split=True) < row_bound(small, plan.cluster, split=True)
    for graph in (small, large):
        priced, _ = annotate(plan, graph)
        assert row_bound(graph, plan.cluster, split=True) <= priced.predicted.step_ms
