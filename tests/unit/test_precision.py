"""Mixed precision in one process: the option, the files that record it, the profile, codegen and the runtime.

The 2-rank checks (a bf16 pipeline against the bf16-autocast eager model over 20 steps, an fp16 overflow on
one stage skipping every stage) are in tests/dist/test_precision_dist.py.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hpml_compile import driver, models
from hpml_compile.cli import main
from hpml_compile.cluster import load_cluster
from hpml_compile.codegen import generate, load_build
from hpml_compile.testing import split_plan
from hpml_compile.errors import HpmlError, OptionError, PlanError, SchemaError
from hpml_compile.ir import Precision, Profile
from hpml_compile.plan import Plan, load_plan, save_plan, validate_plan
from hpml_compile.profile import load_profile, profile
from hpml_compile.runtime import Pipeline
from hpml_compile.runtime.execute.checkpoint import latest, load_checkpoint, save_checkpoint
from hpml_compile.runtime.execute.scaler import LossScaler
from hpml_compile.trace import trace


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


# -- the option ------------------------------------------------------------------------------------------------
def test_a_bad_precision_is_refused_by_name_everywhere() -> None:
    for make in (lambda: Precision.parse("fp8"), lambda: driver.Options(precision="fp8")):
        with pytest.raises(OptionError, match=r"'fp8' is not a precision; use one of fp32, bf16, fp16"):
            make()
    from hpml_compile import compile as api_compile
    with pytest.raises(OptionError, match="fp8"):  # before anything is traced or profiled
        api_compile(_mlp(), _data()[:1], cluster="local-cpu-2", precision="fp8")


@pytest.mark.parametrize("argv", [["profile", "mlp-tiny"], ["plan", "p.json", "--cluster", "local-cpu-2"],
                                  ["compile", "mlp-tiny", "--cluster", "local-cpu-2", "-o", "b"], ["run", "b"]])
def test_the_cli_refuses_a_bad_precision(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--precision", "fp8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--precision: invalid choice: 'fp8' (choose from 'fp32', 'bf16', 'fp16')" in err


def test_files_written_before_precision_are_fp32_and_a_bad_value_names_the_field(tmp_path: Path) -> None:
    gm = trace(_mlp().to("meta"), (torch.randn(8, 16, device="meta"),))
    prof = profile(gm, (torch.randn(8, 16, device="meta"),), device_kinds=("A100-80GB",), progress=False)
    d = prof.to_dict()
    assert d["precision"] == "fp32"
    del d["precision"]
    assert Profile.from_dict(d).precision is Precision.FP32
    with pytest.raises(SchemaError, match=r"precision.*'fp32', 'bf16', 'fp16'"):
        Profile.from_dict({**d, "precision": "fp8"})
    plan = replace(split_plan(gm, "mlp", 2), precision="bf16")
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back.precision is Precision.BF16
    old = plan.to_dict()
    del old["precision"]
    assert Plan.from_dict(old).precision is Precision.FP32
    with pytest.raises(SchemaError, match="precision"):
        Plan.from_dict({**old, "precision": "half"})


# -- the profile and the cost and memory models ----------------------------------------------------------------
def test_profile_under_bf16_records_it_times_under_autocast_and_sizes_the_compute_dtype(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    assert main(["profile", "mlp-tiny", "--batch-size", "4", "--repeats", "1", "--warmup", "0",
                 "--device-kinds", "cpu,A100-80GB", "--precision", "bf16", "--no-measure-links", "-q", "-o", str(out)]) == 0
    bf = load_profile(out)
    assert bf.precision is Precision.BF16 and bf.dtype == "float32"  # autocast; the master weights stay fp32
    assert bf.devices["cpu"]["measured"] and all(n.cost["cpu"].measured for n in bf.nodes)
    loaded = models.load("mlp-tiny", batch_size=4, device="meta")
    fp = profile(loaded.module, loaded.example_inputs, device_kinds=("A100-80GB",), progress=False)
    by = {n.name: n for n in fp.nodes}
    for n in bf.nodes:  # a floating output crosses a boundary in bf16: half the bytes
        if n.tensor_output and n.output_dtype == "float32":
            assert n.output_bytes * 2 == by[n.name].output_bytes, n.name
    lins = [n for n in bf.nodes if n.op_kind == "matmul" and any(p.endswith("weight") for p in n.params)]
    assert lins
    for lin in lins:  # fp32: a Linear saves its input; under autocast the bf16 input and the bf16 weight copy
        weight = next(bf.parameters[p] for p in lin.params if p.endswith("weight"))
        assert lin.activation_bytes == by[lin.name].activation_bytes // 2 + weight // 2, lin.name
    # the A100 is priced at its bf16 peak (312 TFLOP/s, 16x its fp32 one): big matmuls are predicted faster
    big = models.load("mlp", batch_size=4096, device="meta")
    t = {prec: profile(big.module, big.example_inputs, device_kinds=("A100-80GB",), progress=False,
                       precision=prec) for prec in ("fp32", "bf16")}
    mm = [n.name for n in t["fp32"].nodes if n.op_kind == "matmul"]
    t_fp, t_bf = (sum(t[p].node(x).cost["A100-80GB"].fwd_ms for x in mm) for p in ("fp32", "bf16"))
    assert t_bf < 0.5 * t_fp, (t_bf, t_fp)


def test_plan_takes_the_profiles_precision_and_refuses_another(tmp_path: Path) -> None:
    gm = trace(_mlp(), _data()[:1])
    prof = profile(gm, _data()[:1], repeats=1, warmup=0, progress=False, precision="bf16", threads=1)
    cluster = load_cluster("local-cpu-2")
    p = driver.plan(prof, cluster, driver.Options(solver="uniform", microbatches=2))
    assert p.precision is Precision.BF16
    assert load_plan(save_plan(p, tmp_path / "plan.json")).precision is Precision.BF16
    with pytest.raises(OptionError, match=r"--precision fp32: the profile of .* was timed in bf16"):
        driver.plan(prof, cluster, driver.Options(solver="uniform", precision="fp32"))
    with pytest.raises(PlanError, match="trains in fp16 but the profile .* was timed in bf16"):
        validate_plan(replace(p, precision="fp16"), prof)


def test_stagecost_counts_fp32_master_weights_and_the_bf16_casts() -> None:
    from hpml_compile.stagecost import memory_parts

    loaded = models.load("gpt-tiny", batch_size=32, seq_len=32, device="meta")
    fp = profile(loaded.module, loaded.example_inputs, device_kinds=("A100-80GB",), progress=False)
    bf = profile(loaded.module, loaded.example_inputs, device_kinds=("A100-80GB",), progress=False,
                 precision="bf16")
    params = sum(n.param_bytes for n in bf.nodes)
    assert params == sum(n.param_bytes for n in fp.nodes)  # fp32 master weights, in both
    m = {name: memory_parts(param_bytes=params, activation_bytes=sum(n.activation_bytes for n in p.nodes),
                            input_bytes=0, dtype_bytes=4, replicas=1, zero=0, microbatches=1)
         for name, p in (("fp32", fp), ("bf16", bf))}
    assert m["bf16"].static == m["fp32"].static == params * 4  # weights + grads + two Adam moments, fp32
    # activations in bf16 (at this batch they outweigh the bf16 weight copies autocast keeps for backward)
    assert m["bf16"].stored < 0.75 * m["fp32"].stored


def test_each_microbatch_in_flight_holds_its_own_weight_copies() -> None:
    from hpml_compile.stagecost import device_memory

    # 400 B of fp32 weights: a bf16 copy of 200 B per microbatch in flight; the profile counted it once per
    # batch, which the model's activations divide among M * d = 4 slices (50 B each): 150 B more per slice
    kw = dict(param_bytes=400, activation_bytes=800, input_bytes=40, dtype_bytes=4, replicas=2, zero=1,
              microbatches=2, in_flight=2)
    plain, bf = device_memory(**kw), device_memory(**kw, compute_bytes=2)  # type: ignore[arg-type]
    assert bf.stored_per_microbatch - plain.stored_per_microbatch == 150 and bf.total - plain.total == 300
    rc = device_memory(**kw, recompute=True, compute_bytes=2)  # type: ignore[arg-type]
    assert rc.working - device_memory(**kw, recompute=True).working == 150  # only the recomputed one's
    assert device_memory(**kw, compute_bytes=4).total == plain.total  # no cast to a dtype as wide


# -- codegen and the runtime in one process ----------------------------------------------------------------------
def _build(tmp_path: Path, precision: str, replicas: list[int] | None = None) -> Path:
    gm = trace(_mlp(), _data()[:1])
    out = tmp_path / f"build-{precision}"
    generate(gm, replace(split_plan(gm, "mlp", 2, microbatches=2, replicas=replicas), precision=precision), out)
    return out


def test_bf16_build_records_it_and_sends_bf16(tmp_path: Path) -> None:
    out = _build(tmp_path, "bf16")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == "bf16"
    stage1 = (out / "stage_1.py").read_text()
    assert "torch.bfloat16, None)" in stage1 and "Precision: bf16" in stage1
    manifest["precision"] = "fp32"  # a manifest edited by hand is refused
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(HpmlError):
        load_build(out, _mlp())


@pytest.mark.parametrize("replicas", [None, [2, 1]])
def test_bf16_pipeline_in_one_process_matches_autocast_eager(tmp_path: Path, replicas: list[int] | None) -> None:
    x, y = _data()
    model, ref = _mlp(), _mlp()
    pipe = Pipeline.from_build(_build(tmp_path, "bf16", replicas), model,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    loss_fn = torch.nn.functional.mse_loss
    for step in range(5):
        got = pipe.step((x,), y, loss_fn).item()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = loss_fn(ref(x), y)
        want.backward()
        if step == 0:  # gradients of the first step, before the runs part: within bf16 rounding
            for (name, a), b in zip(model.named_parameters(), ref.parameters()):
                assert a.grad is not None and a.grad.dtype == torch.float32, name
                assert torch.allclose(a.grad, b.grad, rtol=2e-2, atol=2e-3), name
        opt.step()
        assert abs(got - want.item()) <= 1e-2 * want.item(), (step, got, want.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_fp16_overflow_skips_the_step_and_halves_the_scale_in_one_process(tmp_path: Path) -> None:
    x, y = _data()
    model = _mlp()
    pipe = Pipeline.from_build(_build(tmp_path, "fp16"), model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                               scaler=LossScaler(init_scale=2.0**40))  # 2^40 x any gradient overflows fp16
    before = copy.deepcopy(model.state_dict())
    pipe.step((x,), y, torch.nn.functional.mse_loss)
    assert pipe.scaler.last_skipped and pipe.scaler.scale == 2.0**39 and pipe.scaler.skipped == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    pipe.scaler.scale = 256.0
    pipe.step((x,), y, torch.nn.functional.mse_loss)
    assert not pipe.scaler.last_skipped
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_loss_scaler_is_for_fp16_builds_only(tmp_path: Path) -> None:
    with pytest.raises(HpmlError, match="loss scaling is for fp16 builds only"):
        Pipeline.from_build(_build(tmp_path, "bf16"), _mlp(), scaler=LossScaler())
    assert Pipeline.from_build(_build(tmp_path, "fp16"), _mlp()).scaler is not None
    with pytest.raises(HpmlError, match="init_scale"):
        LossScaler(init_scale=float("inf"))


def test_the_loss_scale_is_checkpointed(tmp_path: Path) -> None:
    s = LossScaler(init_scale=64.0, growth_interval=3)
    s.update(found_inf=True)
    s.update(found_inf=False)
    m = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path, 1, m, scaler=s)
    back = LossScaler()
    load_checkpoint(latest(tmp_path), m, scaler=back)
    assert (back.scale, back.growth_tracker, back.skipped) == (32.0, 1, 1)
    save_checkpoint(tmp_path, 2, m)  # a bf16 run's checkpoint has no scale: a fresh scaler keeps its own
    fresh = LossScaler(init_scale=8.0)
    load_checkpoint(latest(tmp_path), m, scaler=fresh)
    assert fresh.scale == 8.0


def test_run_refuses_a_precision_other_than_the_builds(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from hpml_compile.recipe import ModelRecipe
    from hpml_compile.runtime.job import launcher

    monkeypatch.setattr(launcher, "launch", lambda spec: pytest.fail("run started ranks"))
    loaded = models.load("mlp-tiny", batch_size=4)
    gm = trace(loaded.module, loaded.example_inputs)
    out = tmp_path / "build"
    generate(gm, replace(split_plan(gm, "mlp-tiny", 2, microbatches=2), precision="bf16"), out,
             recipe=ModelRecipe("mlp-tiny", 4, None))
    rc = main(["run", str(out), "--precision", "fp32"])
    err = capsys.readouterr().err
    assert rc == 2 and "--precision fp32: " in err and "was compiled for bf16" in err, err
