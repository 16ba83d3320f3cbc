"""Plan IR: JSON round trip, schema errors, validate_plan rules."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hpml_compile.errors import SchemaError
from hpml_compile.ir import Cluster, Device
from hpml_compile.plan import (Plan, PlanError, PlanPrediction, Schedule, SolverInfo, SolverStatus, Stage,
                               StagePrediction, ZeroStage, load_plan, save_plan, validate_plan)
from hpml_compile.testing import dag_profile

GiB = 2**30


def _profile(**kw):
    # n0 -> n1 -> n2 -> n3, with a skip edge n0 -> n3
    return dag_profile([(1.0, 2.0)] * 4, [[], [0], [1], [2, 0]], **kw)


def _cluster(gib: float = 8.0) -> Cluster:
    return Cluster(devices=(Device("d0", "cpu", gib), Device("d1", "cpu", gib), Device("d2", "cpu", gib)), name="t")


def _plan(stages, cluster=None, m=4, schedule=Schedule.ONE_F_ONE_B) -> Plan:
    return Plan("toy", cluster or _cluster(), schedule, m, tuple(stages),
                PlanPrediction(12.5, 1, 0.25), SolverInfo("dp", SolverStatus.OPTIMAL, 0.0, 0.1))


def _good() -> Plan:
    # stage 1 offloads its optimizer, so it runs on GPUs (a CPU's host memory is its own)
    gpus = Cluster(devices=(Device("d0", "cpu", 8.0), Device("d1", "A100-80GB", 8.0), Device("d2", "A100-80GB", 8.0)),
                   name="t")
    return _plan([Stage(0, ("d0",), ("n0", "n1"), ZeroStage.NONE, True, ("n1",), False, StagePrediction(1, 2, 3, 0.4)),
                  Stage(1, ("d1", "d2"), ("n2", "n3"), ZeroStage.OS_G, False, (), True)], cluster=gpus)


def test_round_trip(tmp_path) -> None:
    p = _good()
    path = save_plan(p, tmp_path / "plan.json")
    assert load_plan(path) == p
    d = json.loads(path.read_text())
    assert d["schedule"] == "1f1b" and d["stages"][1]["zero"] == 2 and d["solver"]["status"] == "optimal"
    assert d["stages"][0]["predicted"]["bubble"] == 0.4 and "bubble" not in d["stages"][1]["predicted"]
    assert set(d) >= {"schema_version", "model", "cluster", "microbatches", "stages", "predicted", "solver"}


@pytest.mark.parametrize("path,value,field", [
    (("schedule",), "zigzag", "schedule"),
    (("stages", 0, "zero"), 7, "stages[0].zero"),
    (("stages", 1, "devices"), [], "stages[1].devices"),
    (("predicted", "bubble"), "big", "predicted.bubble"),
    (("stages", 0, "predicted", "bubble"), 1.5, "stages[0].predicted.bubble"),
    (("cluster", "devices", 0, "memory_gib"), -1, "cluster.devices[0].memory_gib"),
    (("microbatches",), 0, "microbatches"),
])
def test_schema_errors_name_field(path, value, field) -> None:
    d = _good().to_dict()
    cur = d
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    with pytest.raises(SchemaError) as e:
        Plan.from_dict(d, source="plan.json")
    assert e.value.field == field


def test_missing_field_and_version() -> None:
    d = _good().to_dict()
    del d["solver"]
    with pytest.raises(SchemaError, match="solver"):
        Plan.from_dict(d)
    d = _good().to_dict()
    d["schema_version"] = 99
    with pytest.raises(SchemaError, match="schema_version"):
        Plan.from_dict(d)


def test_valid_plan_passes() -> None:
    plan = _good()
    assert validate_plan(plan, _profile()) is None  # raises PlanError on any broken rule
    assert sorted(n for st in plan.stages for n in st.nodes) == sorted(n.name for n in _profile().nodes)


def test_node_twice() -> None:
    p = _plan([Stage(0, ("d0",), ("n0", "n1")), Stage(1, ("d1",), ("n1", "n2", "n3"))])
    with pytest.raises(PlanError, match="n1.*exactly one"):
        validate_plan(p, _profile())


def test_node_missing() -> None:
    p = _plan([Stage(0, ("d0",), ("n0", "n1")), Stage(1, ("d1",), ("n2",))])
    with pytest.raises(PlanError, match="n3"):
        validate_plan(p, _profile())


def test_unknown_node() -> None:
    p = _plan([Stage(0, ("d0",), ("n0", "n1", "n2", "n3", "ghost"))])
    with pytest.raises(PlanError, match="ghost"):
        validate_plan(p, _profile())


def test_backward_edge() -> None:
    # n0 feeds n3 (skip edge): n0 after n3 is a backward edge
    p = _plan([Stage(0, ("d0",), ("n1", "n2", "n3")), Stage(1, ("d1",), ("n0",))])
    with pytest.raises(PlanError, match="back to stage"):
        validate_plan(p, _profile())


def test_device_twice_and_unknown() -> None:
    p = _plan([Stage(0, ("d0",), ("n0", "n1")), Stage(1, ("d0",), ("n2", "n3"))])
    with pytest.raises(PlanError, match="d0 is used by stage 0 and stage 1"):
        validate_plan(p, _profile())
    p = _plan([Stage(0, ("d0",), ("n0", "n1")), Stage(1, ("gpu9",), ("n2", "n3"))])
    with pytest.raises(PlanError, match="gpu9"):
        validate_plan(p, _profile())


def test_swap_outside_stage() -> None:
    p = _plan([Stage(0, ("d0",), ("n0", "n1"), swap=("n3",)), Stage(1, ("d1",), ("n2", "n3"))])
    with pytest.raises(PlanError, match="swaps 'n3'"):
        validate_plan(p, _profile())


def test_offload_on_cpu_refused() -> None:
    p = _plan([Stage(0, ("d0",), ("n0", "n1")), Stage(1, ("d1", "d2"), ("n2", "n3"), ZeroStage.OS, offload_optimizer=True)])
    with pytest.raises(PlanError, match=r"stage 1 offloads its optimizer.*CPU device d1.*set offload_optimizer to false"):
        validate_plan(p, _profile())


def test_memory_over_budget() -> None:
    prof = _profile(param_bytes=GiB)  # 1 GiB params per node: 2 nodes need 2 * (1 + 1 + 2) = 8 GiB + acts
    small = Cluster(devices=(Device("d0", "cpu", 4.0), Device("d1", "cpu", 4.0)), name="small")
    p = _plan([Stage(0, ("d0",), ("n0", "n1")), Stage(1, ("d1",), ("n2", "n3"))], cluster=small)
    with pytest.raises(PlanError, match=r"needs 8\.00 GiB on d0.*over by 4\.00 GiB"):
        validate_plan(p, prof)
    # ZeRO-2 over two devices shards only Adam's state at the peak (gradients accumulate whole over the
    # microbatches): 4 GiB of params need 4 + 4 + 8 / 2 = 12 GiB per device
    two = _plan([Stage(0, ("d0", "d1"), ("n0", "n1", "n2", "n3"), ZeroStage.OS_G)], cluster=small)
    with pytest.raises(PlanError, match="needs 12.00 GiB on d0"):
        validate_plan(two, prof)
    validate_plan(two, _profile(param_bytes=GiB // 4))  # 1 GiB of params: 1 + 1 + 2 / 2 = 3 GiB fits
    # ZeRO-3 holds its shard and gathers the whole stage for its compute: 1 + 1/2 + 1 + 2 / 2 = 3.5 GiB fits,
    # and with 1.25 GiB of params 1.875 + 1.25 + 1.25 = 4.375 GiB does not (ZeRO-2 would need 3.75 GiB)
    three = _plan([Stage(0, ("d0", "d1"), ("n0", "n1", "n2", "n3"), ZeroStage.OS_G_P)], cluster=small)
    validate_plan(three, _profile(param_bytes=GiB // 4))
    with pytest.raises(PlanError, match=r"needs 4\.38 GiB on d0"):
        validate_plan(three, _profile(param_bytes=5 * GiB // 16))
    validate_plan(replace(two, stages=(replace(two.stages[0], zero=ZeroStage.OS_G),)), _profile(param_bytes=5 * GiB // 16))


def test_zero3_with_offload_refused() -> None:
    p = _plan([Stage(0, ("d0",), ("n0", "n1")), Stage(1, ("d1", "d2"), ("n2", "n3"), ZeroStage.OS_G_P,
                                                     offload_optimizer=True)])
    with pytest.raises(PlanError, match="ZeRO-3 with optimizer offload, which the runtime does not combine"):
        validate_plan(p, _profile())


def test_plan_cli_writes_valid_plan_and_compares(tmp_path, capsys) -> None:
    import argparse

    from hpml_compile.errors import HpmlError
    from hpml_compile.cli.plan import add_parsers
    from hpml_compile.schema import write_json_atomic

    prof = _profile(batch_size=16)
    write_json_atomic(prof.to_dict(), tmp_path / "profile.json")
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers(dest="command"))
    out = tmp_path / "plan.json"
    args = parser.parse_args(["plan", str(tmp_path / "profile.json"), "--cluster", "local-cpu-2",
                              "--solver", "dp", "--microbatches", "4", "-o", str(out)])
    assert args.run(args) == 0
    plan = load_plan(out)
    validate_plan(plan, prof)
    assert plan.microbatches == 4 and plan.solver.name == "dp"
    args = parser.parse_args(["plan", str(tmp_path / "profile.json"), "--cluster", "local-cpu-2", "--compare",
                              "--microbatches", "2"])
    assert args.run(args) == 0
    table = capsys.readouterr().out
    for name in ("portfolio", "dp", "uniform", "params", "time"):
        assert f"\n{name} " in table
    assert "1.00x" in table  # the portfolio against itself
    with pytest.raises(HpmlError, match="-o/--output"):
        args = parser.parse_args(["plan", str(tmp_path / "profile.json"), "--cluster", "local-cpu-2"])
        args.run(args)


def test_uneven_rows_round_trip_and_checked(tmp_path) -> None:
    p = _plan([Stage(0, ("d0",), ("n0", "n1")), Stage(1, ("d1", "d2"), ("n2", "n3"), rows=(3, 1))])
    path = save_plan(p, tmp_path / "plan.json")
    d = json.loads(path.read_text())
    assert d["stages"][1]["rows"] == [3, 1] and "rows" not in d["stages"][0]  # an even split writes nothing
    assert load_plan(path).stages[1].rows == (3, 1)
    d["stages"][1]["rows"] = [3, 1, 2]
    with pytest.raises(SchemaError, match=r"stages\[1\]\.rows"):
        Plan.from_dict(d)
    d["stages"][1]["rows"] = [3, 0]
    with pytest.raises(SchemaError, match=r"stages\[1\]\.rows"):
        Plan.from_dict(d)
