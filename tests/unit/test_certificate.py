"""What a user is told about a plan: one gap (the plan returned against a sound lower bound on every plan's
simulated step), the costs it assumes, and one answer whichever command plans it (``plan``, ``plan --compare``,
``show``'s one more device)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

import cost_models
from hpml_compile import driver
from hpml_compile.assumptions import assumptions, format_assumptions
from hpml_compile.certify import certify, fixed_bound
from hpml_compile.cli.plan import add_parsers, compare
from hpml_compile.costgraph import build
from hpml_compile.explain import base_solver, one_more_device
from hpml_compile.ir import Certificate, Cluster, Device
from hpml_compile.plan import Plan, Schedule, Stage, load_plan, save_plan
from hpml_compile.schema import write_json_atomic
from hpml_compile.simulate import simulate
from hpml_compile.solve import solve
from hpml_compile.testing import chain_profile, cluster_of

COSTS = [{"fast": (1.0, 2.0), "slow": (3.0, 6.0)}] * 4


@pytest.fixture
def mixed() -> tuple:
    """A profile and a cluster of one fast and two slow devices, where the uneven-rows search beats the
    solver's own plan (so a path that skips it gives another figure)."""
    return chain_profile(COSTS, param_bytes=1000), cluster_of(["fast", "slow", "slow"])


def test_the_certificate_is_of_the_plan_returned_and_its_bound_holds_for_every_plan(mixed) -> None:
    prof, c = mixed
    got = driver.plan(prof, c, driver.Options(solver="dp", microbatches=4))
    assert "+uneven:" in got.solver.name  # the returned plan is not the solver's
    cert = got.certificate
    assert cert is not None and cert.step_ms == got.predicted.step_ms and cert.bound_ms is not None
    assert cert.within == pytest.approx(got.predicted.step_ms / cert.bound_ms - 1)
    # the bound is below the step of every plan the solvers make, on every microbatch count
    g = build(prof)
    for solver in ("dp", "ilp", "uniform", "params", "time"):
        for m in (1, 2, 4, 8):
            p = solve(g, c, solver=solver, microbatches=m)
            assert simulate(p, g).step_ms >= cert.bound_ms * (1 - 1e-9)
    assert cert.text.startswith(f"within {cert.within:.1%} of the best plan under the cost model")


def test_no_certificate_where_no_bound_holds(mixed) -> None:
    prof, c = mixed
    g = build(prof)
    p = solve(g, c, solver="dp", microbatches=2)
    assert certify(replace(p, predicted=replace(p.predicted, step_ms=0.0)), g).text.startswith("no certificate")
    below = replace(p, predicted=replace(p.predicted, step_ms=fixed_bound(g, c) / 2))  # a step no plan can take
    cert = certify(below, g)
    assert cert.within is None and "above the step" in cert.text
    assert Certificate(5.0, None, "why").to_dict()["within"] is None


def test_plan_json_carries_the_certificate_and_assumptions_and_old_plans_still_load(mixed, tmp_path: Path) -> None:
    prof, c = mixed
    got = driver.plan(prof, c, driver.Options(solver="dp", microbatches=4))
    path = save_plan(got, tmp_path / "plan.json")
    d = json.loads(path.read_text())
    assert d["schema_version"] == 3 and d["certificate"]["within"] == pytest.approx(got.certificate.within)
    back = load_plan(path)
    assert back.certificate == got.certificate and back.assumptions == got.assumptions
    old = {k: v for k, v in d.items() if k not in ("certificate", "assumptions")} | {"schema_version": 1}
    plan1 = Plan.from_dict(old)
    assert plan1.certificate is None and plan1.assumptions == ()
    bad = d | {"assumptions": [{"name": "x", "value": "1"}]}
    with pytest.raises(Exception, match="assumptions"):
        Plan.from_dict(bad)


def test_assumptions_name_every_cost_not_measured_here() -> None:
    """Catalog GPUs in hosts of one, no links named: their speed, the per-op cost, the eth100 default between
    hosts, NVLink inside one, the overlap constant and the optimizer prior are each named with a source."""
    prof = replace(chain_profile([{"A100-80GB": (1.0, 2.0)}] * 2, param_bytes=2**20), optimizer="adamw",
                   parameters={"w": 2**20})
    devs = tuple(Device(f"g{i}", "A100-80GB", 80, f"h{i // 2}") for i in range(4))
    c = Cluster(devices=devs, name="two-hosts")
    p = Plan("toy", c, Schedule.ONE_F_ONE_B, 1, (Stage(0, tuple(d.name for d in devs), ("n0", "n1")),))
    named = {a.name: a for a in assumptions(p, prof)}
    assert "A100-80GB speed" in named and "19.5 TFLOP/s peak in float32" in named["A100-80GB speed"].value
    assert named["per-op host cost on a GPU"].value == f"{cost_models.EAGER_GPU_OP_MS * 1e3:.0f} us an op"
    assert named["link A100-80GB - A100-80GB between hosts"].value.startswith("eth100")
    assert named["link A100-80GB - A100-80GB on one host"].value.startswith("nvlink")
    assert "gradient all-reduce overlap on GPUs" in named
    assert "optimizer step (adamw)" in named
    assert all(a.source for a in named.values())
    text = format_assumptions(tuple(named.values()))
    assert text.startswith("assumed (not measured on this machine):") and "A100-80GB speed" in text
    # a link the cluster names is measured or chosen for those devices: not an assumption
    from hpml_compile.ir import Link
    linked = replace(c, links=tuple(Link(a.name, b.name, 25.0, 5.0) for i, a in enumerate(devs)
                                    for b in devs[i + 1:]))
    assert not any(a.name.startswith("link") for a in assumptions(replace(p, cluster=linked), prof))


def test_plan_compare_and_one_more_device_give_the_figure_plan_gives(mixed, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    prof, c = mixed
    opts = driver.Options(solver="dp", microbatches=4)
    planned = driver.plan(prof, c, opts)
    rows = {name: p for name, p, _ in compare(prof, c, opts)}
    assert rows["dp"].predicted.step_ms == pytest.approx(planned.predicted.step_ms)
    assert rows["dp"].solver.name.split(":")[0] == planned.solver.name.split(":")[0]
    assert rows["dp"].certificate == planned.certificate
    # the solver alone gives another figure: the shared path is what makes them agree
    assert solve(build(prof), c, solver="dp", microbatches=4).predicted.step_ms > planned.predicted.step_ms
    # show's one more device: the plan driver.plan gives on the bigger cluster
    small = driver.plan(prof, cluster_of(["fast", "slow"]), opts)
    what = one_more_device(small, simulate(small, build(prof)),
                           lambda bigger: driver.plan(prof, bigger, replace(opts, solver=base_solver(small))))
    direct = driver.plan(prof, Cluster(devices=(*small.cluster.devices, what.device), name="x"), opts)
    assert what.plan is not None and what.plan.predicted.step_ms == pytest.approx(direct.predicted.step_ms)
    # the CLI prints the same certificate for plan and --compare
    write_json_atomic(prof.to_dict(), tmp_path / "profile.json")
    write_json_atomic(c.to_dict(), tmp_path / "cluster.json")
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers(dest="command"))
    base = ["plan", str(tmp_path / "profile.json"), "--cluster", str(tmp_path / "cluster.json"),
            "--solver", "dp", "--microbatches", "4"]
    args = parser.parse_args([*base, "-o", str(tmp_path / "plan.json")])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert planned.certificate.text in out and "assumed" in out
    args = parser.parse_args([*base, "--compare"])
    assert args.run(args) == 0
    table = capsys.readouterr().out
    dp_line = next(line for line in table.splitlines() if line.startswith("dp "))
    assert f"{planned.predicted.step_ms:.4g}" in dp_line and f"{planned.certificate.within:.1%}" in dp_line
