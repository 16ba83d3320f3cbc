"""The bound of benchmarks/plan_quality/uneven.py that charges what the simulator charges (``charged_bound``):
no plan simulates below it, it is above the compute bound where the simulator charges fixed parts, memory or
syncs, and the best one-stage plan meets it where that plan has nothing else to pay."""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from hpml_compile.cluster import load_cluster
from hpml_compile.costgraph import CostGraph, build
from hpml_compile.errors import PlanError
from hpml_compile.ir import NodeCost, Profile
from hpml_compile.memory import ZeroStage
from hpml_compile.plan import Schedule, validate_plan
from hpml_compile.simulate import loss_agreement_ms, simulate
from hpml_compile.solve import solve
from hpml_compile.solve.baselines import cut_points
from hpml_compile.solve.candidates import Chain
from hpml_compile.solve.mixed import CONFIGS, build_plan
from hpml_compile.testing import chain_profile, cluster_of
from hpml_compile.solve.uneven import improve

UNEVEN = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_quality" / "uneven.py"
A100, V100 = "A100-80GB", "V100-32GB"


@pytest.fixture(scope="module")
def ub() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plan_quality_uneven", UNEVEN)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: kind -> (time per row against the first kind's, Adam step ms over the model): hetero-4's and hetero-cpu's
HETERO_4 = {A100: (1.0, 3.0), V100: (1.3, 7.0)}
HETERO_CPU = {"A100-40GB": (1.0, 3.0), "T4": (2.5, 6.0), "cpu": (20.0, 40.0)}


def toy_profile(batch: int, param_bytes: int, fixed: float, kinds: dict[str, tuple[float, float]] | None = None,
                activation_bytes: int = 2**26) -> Profile:
    """Four nodes, each with a fixed part per microbatch, parameters and ``activation_bytes`` (the whole batch's),
    on the devices of ``kinds`` (default: an A100 and a V100, 1.3x slower per row, whose Adam step takes 2.3x as
    long)."""
    kinds = kinds or HETERO_4
    full = [(4.0, 8.0), (2.0, 4.0), (6.0, 12.0), (1.0, 2.0)]
    prof = chain_profile(full, kind=next(iter(kinds)), param_bytes=param_bytes, activation_bytes=activation_bytes,
                         batch_size=batch)
    nodes = tuple(replace(n, cost={k: NodeCost(pace * f, pace * b, False, fwd_fixed_ms=fixed, bwd_fixed_ms=fixed)
                                   for k, (pace, _) in kinds.items()})
                  for n, (f, b) in zip(prof.nodes, full))
    return replace(prof, nodes=nodes, optimizer_ms={k: step for k, (_, step) in kinds.items()})


# The schedules the bound is stated for (``charged_bound``'s docstring): its pipeline inequality charges each
# stage its whole backward on the first microbatch's way back, which ZB-H1's deferred weight parts need not pay.
BOUNDED = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)


def toy(batch: int, param_bytes: int, fixed: float) -> CostGraph:
    return build(toy_profile(batch, param_bytes, fixed))


def every_plan_of_two_stages(graph: CostGraph, cluster, profile: Profile | None = None  # type: ignore[no-untyped-def]
                             ) -> list[float]:
    """The simulated step of every plan of one or two stages over any devices (idle ones too), every boundary,
    every microbatch count, GPipe and 1F1B, each stage the first fitting configuration of each tail of CONFIGS;
    with ``profile``, also each such plan with every stage's Adam state offloaded, and with its replicated
    stages under ZeRO-3, where the plan still fits (``validate_plan``)."""
    names = [d.name for d in cluster.devices]
    points = cut_points(Chain.of(graph))
    n = len(graph.order)
    out = []
    for assign in itertools.product(range(3), repeat=len(names)):  # 0 idle, 1 first stage, 2 second stage
        first = [x for x, a in zip(names, assign) if a == 1]
        second = [x for x, a in zip(names, assign) if a == 2]
        if not first or (not second and 2 in assign):
            continue
        shapes = [([first], [0, n])] if not second else [([first, second], [0, p, n]) for p in points[1:-1]]
        for (groups, cuts), m, sched, i in itertools.product(shapes, (1, 2, 4), BOUNDED, range(0, len(CONFIGS), 2)):
            if graph.batch_size // m < max(len(g) for g in groups):
                continue
            plan = build_plan(graph, cluster, groups, cuts, m, sched, "float32", "every", CONFIGS[i:])
            if plan is None:
                continue
            out.append(simulate(plan, graph).step_ms)
            if profile is None:
                continue
            for stages in ([replace(st, offload_optimizer=True) for st in plan.stages],
                           [replace(st, zero=ZeroStage.OS_G_P) if len(st.devices) > 1 else st for st in plan.stages]):
                try:  # a schedule or a memory budget the variant does not meet: not a plan
                    other = replace(plan, stages=tuple(stages))
                    validate_plan(other, profile)
                except PlanError:
                    continue
                out.append(simulate(other, graph).step_ms)
    return out


# the third: 8 GiB of parameters a node, so that a V100 holds no node's Adam state (memory binds, offload/ZeRO).
# A GPU group's ZeRO >= 1 parameter all-gather is prefetched under the next forward: the bound charges
# only what one microbatch's forward over d leaves of it (charging it whole let a plan beat the
# bound on plan_quality's gpt2-small on hetero-cpu; charging nothing loosened the slack to 1.31, 1.41 and 1.75).
# hetero-4: 2 x A100 (NVLink), 2 x V100 (NVLink), PCIe between the kinds. hetero-cpu: an A100, a T4 and the host's
# CPU, whose groups sync after the backward, whole (the reduce-scatter and the pipeline before and
# after a stage are charged too); 2 GiB a node there, so that the T4 holds the parameters and gradients of at most
# three nodes and an Adam state of none.
@pytest.mark.parametrize("cluster,batch,param_bytes,fixed,slack", [
    ("hetero-4", 8, 2**27, 0.5, 1.3), ("hetero-4", 4, 2**29, 0.0, 1.3), ("hetero-4", 8, 2**33, 0.5, 1.6),
    ("hetero-cpu", 8, 2**27, 0.5, 1.3), ("hetero-cpu", 4, 2**31, 0.5, 1.6)])
def test_no_plan_simulates_below_the_charged_bound(ub: ModuleType, cluster: str, batch: int, param_bytes: int,
                                                   fixed: float, slack: float) -> None:
    c = load_cluster(cluster)
    prof = toy_profile(batch, param_bytes, fixed, HETERO_4 if cluster == "hetero-4" else HETERO_CPU)
    g = build(prof)
    bound = ub.charged_bound(g, c)
    steps = every_plan_of_two_stages(g, c, prof)
    base = solve(g, c, solver="ilp")
    steps += [base.predicted.step_ms, improve(g, c, base).plan.predicted.step_ms,
              solve(g, c, solver="dp").predicted.step_ms]
    assert len(steps) > 100 and min(steps) >= bound * (1 - 1e-9), (bound, min(steps))
    assert min(steps) < slack * bound  # and not far below the best plan: not a vacuous bound


def test_the_bound_charges_each_replica_the_rows_it_must_hold(ub: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """An A100 and a V100 of 16 GiB each, 4 GiB of activations a row: the rows one replica cannot hold beside its
    parameters and gradients the other must take, at its own pace (e.g. gpt2-xl on hetero-cpu, whose T4
    holds 5 of its rows). Charging that (the row classes) lifts the bound, and still no plan is below it."""
    c = cluster_of([A100, V100], memory_gib=16, free_links=False)
    prof = toy_profile(8, 2**27, 0.9, HETERO_4, activation_bytes=2**33)
    g = build(prof)
    bound = ub.charged_bound(g, c)
    monkeypatch.setattr(ub, "MAX_CLASS_LPS", 0)  # the row classes off: every replica charged one row
    loose = ub.charged_bound(g, c)
    steps = every_plan_of_two_stages(g, c, prof)
    assert len(steps) > 100 and loose < bound <= min(steps) * (1 + 1e-9), (loose, bound, min(steps))


def test_the_charged_bound_counts_the_fixed_parts_and_the_rounded_rows(ub: ModuleType) -> None:
    """Nothing to sync or step (no parameters): two A100s and a V100 share 8 rows. The compute bound spreads
    every node's fixed part over the devices as if it shrank with the rows (14.08 ms); the simulator charges it
    once per microbatch per replica and rounds rows to whole ones, and so does the charged bound, which the best
    plan (one stage of all three at M = 1, rows 3, 3, 2) then meets exactly: 17.125 ms, and the loss agreement."""
    import sys

    sys.path.insert(0, str(UNEVEN.parent))
    from main import compute_bound

    c = cluster_of([A100, A100, V100], memory_gib=32, free_links=False)
    g = toy(8, 0, 0.5)
    bound, at = ub.charged_bound(g, c, detail=True)
    assert bound > 1.2 * compute_bound(g, c)
    agree = loss_agreement_ms(c, ["d0", "d1", "d2"])  # the three ranks' loss agreement, after the compute
    assert agree > 0 and min(every_plan_of_two_stages(g, c)) == pytest.approx(bound, rel=1e-5) == pytest.approx(
        17.125 + agree)
    assert at == {"groups": [["d0", "d1", "d2"]], "microbatches": 1}


def test_row_classes_cover_every_split(ub: ModuleType) -> None:
    """Every integer split of a microbatch's rows lies in a class whose factors and least rows are at most its
    own (so the bound that charges a class is below every plan whose split lies in it)."""
    for alphas, rows in (([1.0, 2.0], 3), ([1.0, 1.3, 2.5], 7), ([1.0, 1.0, 3.0], 6)):
        classes = ub._row_classes(alphas, alphas, rows)
        for split in itertools.product(range(1, rows + 1), repeat=len(alphas)):
            if sum(split) != rows:
                continue
            factor = max(r * a for r, a in zip(split, alphas))
            assert any(f <= factor + 1e-12 and b <= factor + 1e-12 and all(lo <= r for lo, r in zip(least, split))
                       for f, b, least in classes), (alphas, split)


def test_rows_are_rounded_as_a_stage_can_split_them(ub: ModuleType) -> None:
    assert ub._row_factor([1.0, 1.0, 2.0], 4) == 2.0  # rows 2, 1, 1 (uneven) or 4/3 each at pace 2 (even)
    assert ub._row_factor([1.0, 1.0], 3) == 1.5  # the even split may be a fraction
    assert ub._row_factor([1.0, 1.3, 1.3], 7) == 3.0  # rows 3, 2, 2 (max(3, 2.6)); even: 7/3 at 1.3 is more
