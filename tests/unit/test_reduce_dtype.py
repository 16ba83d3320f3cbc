"""The reduce dtype of a plan (``--reduce-dtype``): recorded, priced on its bytes, refused where it means nothing or
is unsafe, and cast around the collective by the runtime's buffers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import cost_models
from hpml_compile.cli.plan import precision_text
from hpml_compile.driver import Options
from hpml_compile.errors import OptionError, PlanError, SchemaError
from hpml_compile.explain import summary
from hpml_compile.ir import Cluster, Device, Precision
from hpml_compile.plan import Plan, Schedule, Stage, check_comm, with_comm
from hpml_compile.runtime.sync.reducecast import down, reduce_dtype
from hpml_compile.simulate import simulate
from hpml_compile.solve import solve
from hpml_compile.stagecost import copy_ms, sync_ms, transfer_ms
from hpml_compile.testing import chain_graph

P = 64e6  # 16M fp32 gradients
NO_LATENCY = cost_models.LinkSpec("wire", gbps=1.0, latency_us=0.0, source="test")
LATENCY = cost_models.LinkSpec("wire", gbps=1.0, latency_us=100.0, source="test")


def _plan(replicas: int = 2, zero: int = 0, **kw: object) -> Plan:
    c = Cluster(devices=tuple(Device(f"cpu{i}", "cpu", 4.0) for i in range(replicas + 1)), name="c")
    stages = (Stage(0, tuple(f"cpu{i}" for i in range(replicas)), ("n0", "n1"), zero=zero),
              Stage(1, (f"cpu{replicas}",), ("n2", "n3")))
    return Plan("toy", c, Schedule.ONE_F_ONE_B, 2, stages, **kw)  # type: ignore[arg-type]


def test_the_priced_sync_halves_its_bandwidth_part() -> None:
    half = sync_ms(P, 2, 0, False, NO_LATENCY, NO_LATENCY, wire=0.5)
    assert half == pytest.approx(sync_ms(P, 2, 0, False, NO_LATENCY, NO_LATENCY) / 2)
    # with latency: the bandwidth part halves, the latencies (the ring's, the members' meeting) stay
    full, half = (sync_ms(P, 2, 0, False, LATENCY, LATENCY, wire=w) for w in (1.0, 0.5))
    latency = sync_ms(1.0, 2, 0, False, LATENCY, LATENCY)
    assert half - latency == pytest.approx((full - latency) / 2, rel=1e-6)
    # ZeRO-1: the gradients' reduce-scatter halves, the fp32 parameters' all-gather does not
    rs = transfer_ms(cost_models.reduce_scatter_ms, P, NO_LATENCY, 2)
    assert sync_ms(P, 2, 1, False, NO_LATENCY, NO_LATENCY, wire=0.5) == pytest.approx(
        sync_ms(P, 2, 1, False, NO_LATENCY, NO_LATENCY) - rs / 2)
    # bucketed during the backward: what stays exposed is less too
    kw = {"bwd_ms": 10.0, "overlap": 1.0}
    assert sync_ms(P, 2, 0, False, NO_LATENCY, NO_LATENCY, wire=0.5, **kw) < \
        sync_ms(P, 2, 0, False, NO_LATENCY, NO_LATENCY, **kw) - 30.0
    # the casts to the reduce dtype and back are memory traffic: read P, write P / 2, and back
    assert copy_ms(P, 2, 1e7, 0, wire=0.5) == pytest.approx(2 * 1.5 * P / 1e7)
    assert copy_ms(P, 2, 1e7, 0) == 0.0 and copy_ms(P, 1, 1e7, 0, wire=0.5) == 0.0


def test_the_simulator_and_the_solver_price_the_plans_reduce_dtype() -> None:
    g = chain_graph([{"cpu": (1.0, 2.0)}] * 4, param_bytes=50_000_000, batch_size=8)
    fp32 = _plan()
    bf16 = replace(fp32, reduce_dtype="bf16")
    a, b = simulate(fp32, g).stages[0], simulate(bf16, g).stages[0]
    assert b.sync_ms - b.sync_copy_ms < a.sync_ms - a.sync_copy_ms  # the collective: half the bytes
    assert b.sync_copy_ms > a.sync_copy_ms  # the casts
    assert simulate(bf16, g).stages[1].sync_ms == simulate(fp32, g).stages[1].sync_ms  # one device: nothing
    assert "fp32, gradients reduced in bfloat16;" in summary(bf16, g, simulate(bf16, g))  # show's words
    c = Cluster(devices=tuple(Device(f"cpu{i}", "cpu", 4.0) for i in range(2)), name="c")
    plan = solve(g, c, solver="dp", microbatches=2, reduce_dtype="bf16")
    assert plan.reduce_dtype is Precision.BF16
    assert simulate(plan, g).step_ms == pytest.approx(plan.predicted.step_ms)


def test_recorded_only_when_set_round_trips_and_is_shown() -> None:
    plain = _plan()
    assert "reduce_dtype" not in plain.to_dict() and plain.reduce_dtype is Precision.FP32
    p = with_comm(plain, reduce_dtype="bf16")
    assert p.to_dict()["reduce_dtype"] == "bf16" and Plan.from_dict(p.to_dict()) == p
    assert precision_text(p) == "fp32, gradients reduced in bf16" and precision_text(plain) == "fp32"
    bad = p.to_dict()
    bad["reduce_dtype"] = "int8"
    with pytest.raises(SchemaError, match="reduce_dtype"):
        Plan.from_dict(bad)
    assert with_comm(p, sync_every=1).reduce_dtype is Precision.BF16  # kept unless asked otherwise


def test_refused_where_it_means_nothing_or_is_unsafe() -> None:
    with pytest.raises(OptionError, match="no replicated stage"):
        with_comm(_plan(replicas=1), reduce_dtype="bf16")
    with pytest.raises(PlanError, match="without loss scaling"):
        with_comm(_plan(), reduce_dtype="fp16")
    assert with_comm(_plan(precision="fp16"), reduce_dtype="fp16").reduce_dtype is Precision.FP16
    with pytest.raises(PlanError, match="compresses its gradients"):
        with_comm(_plan(), compress="topk:0.1", reduce_dtype="bf16")
    with pytest.raises(PlanError, match="local SGD"):
        check_comm(replace(_plan(), sync_every=4, reduce_dtype="bf16"))
    with pytest.raises(OptionError, match="is not a precision"):
        with_comm(_plan(), reduce_dtype="int8")
    with pytest.raises(OptionError, match="choose one"):
        Options(reduce_dtype="bf16", allow_compress="topk:0.1")
    with pytest.raises(OptionError, match="choose one"):
        Options(reduce_dtype="bf16", sync_every=4)
    assert Options(reduce_dtype="fp32", sync_every=4).reduce_dtype is Precision.FP32


def test_what_is_cast() -> None:
    assert reduce_dtype("bf16", torch.float32) is torch.bfloat16 and reduce_dtype("fp32", torch.float32) is None
    assert reduce_dtype("bf16", torch.bfloat16) is None and reduce_dtype("bf16", torch.int64) is None
    x = torch.tensor([1.0, 1.0 + 2 ** -10, 3.0])
    assert down(x, None) is x and down(x, torch.bfloat16).tolist() == [1.0, 1.0, 3.0]


def test_plan_cli_records_it_and_refuses_fp16_before_solving(tmp_path, capsys) -> None:
    import argparse

    from hpml_compile.cli.plan import add_parsers
    from hpml_compile.plan import load_plan
    from hpml_compile.schema import write_json_atomic
    from hpml_compile.testing import dag_profile

    write_json_atomic(dag_profile([(1.0, 2.0)] * 4, [[], [0], [1], [2]], batch_size=16).to_dict(),
                      tmp_path / "profile.json")
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers(dest="command"))
    base = ["plan", str(tmp_path / "profile.json"), "--cluster", "local-cpu-2", "--solver", "dp",
            "--microbatches", "4", "-o", str(tmp_path / "plan.json")]
    args = parser.parse_args([*base, "--reduce-dtype", "bf16"])
    assert args.run(args) == 0
    plan = load_plan(tmp_path / "plan.json")
    assert plan.reduce_dtype is Precision.BF16 and any(st.replicas > 1 for st in plan.stages)
    assert "gradients reduced in bf16" in capsys.readouterr().out
    args = parser.parse_args([*base, "--reduce-dtype", "fp16"])
    with pytest.raises(PlanError, match="without loss scaling"):
        args.run(args)
    assert "dp:" not in capsys.readouterr().err  # refused before the solver ran
