"""Runtime, unit tier: no process group. Pipelines in one process, the launcher's checks, errors, the recipe."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import pytest
import torch

from hpml_compile import models
from hpml_compile.cli import main
from hpml_compile.cluster import load_cluster
from hpml_compile.codegen import generate
from hpml_compile.testing import SkipNet, skipnet_batch, skipnet_loss, split_plan
from hpml_compile.errors import BuildMismatchError, HpmlError
from hpml_compile.plan import Plan, Schedule, Stage
from hpml_compile.runtime import Pipeline, compile
from hpml_compile.runtime.sync.comm import CommFault, InjectedFault, CommOp, is_transient, pair_backend, rank_devices
from hpml_compile.runtime.execute.gather import tensor_owners
from hpml_compile.runtime.job.launcher import (RANK_ENTRY, LaunchError, LaunchSpec, check_port, check_world, explain_failure,
                                         torchrun_args)
from hpml_compile.recipe import ModelRecipe, absolute_model_spec, read_recipe
from hpml_compile.runtime.execute.session import RetryPolicy
from hpml_compile.runtime.job.options import Faults, OptimizerName, RunOptions, parse_fault
from hpml_compile.runtime.job.worker import threads_per_rank
from hpml_compile.runtime.observe.runfolder import RunFolder
from hpml_compile.trace import trace


def _gpt_build(tmp: Path, stages: int = 2, microbatches: int = 2,
               recipe: ModelRecipe | None = None) -> tuple[Path, models.LoadedModel]:
    loaded = models.load("gpt-tiny", batch_size=4, seq_len=16)
    gm = trace(loaded.module, loaded.example_inputs)
    generate(gm, split_plan(gm, "gpt-tiny", stages, microbatches=microbatches), tmp / "build", recipe=recipe)
    return tmp / "build", loaded


def test_local_pipeline_trains_like_the_model_and_gathers_it(tmp_path: Path) -> None:
    build, loaded = _gpt_build(tmp_path)
    ref = models.load("gpt-tiny", batch_size=4, seq_len=16).module
    pipe = Pipeline.from_build(build, loaded.module, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = loaded.example_inputs, loaded.example_targets
    for _ in range(3):
        ref_opt.zero_grad()
        want = loaded.loss_fn(ref(*x), y)
        want.backward()
        ref_opt.step()
        assert pipe.step(x, y, loaded.loss_fn).item() == pytest.approx(want.item(), abs=1e-5)
    state = pipe.state_dict()
    assert sorted(state) == sorted(ref.state_dict())
    assert max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items()) < 1e-5
    ref.eval()
    got = pipe.eval_forward(x[0])
    assert (got - ref(*x)).abs().max().item() < 1e-4
    assert len(pipe.metrics) == 3 * 2 and {m.stage for m in pipe.metrics} == {0, 1}


def test_a_batch_twice_the_build_accumulates_gradients(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = SkipNet()
    x, y = skipnet_batch(rows=8)
    gm = trace(net, (x,))
    generate(gm, split_plan(gm, "skipnet", 3, microbatches=2, schedule=Schedule.ONE_F_ONE_B), tmp_path / "b")
    pipe = Pipeline.from_build(tmp_path / "b", net)
    big_x, big_y = skipnet_batch(rows=16, seed=3)
    loss = pipe.step((big_x,), big_y, skipnet_loss)
    assert pipe.metrics[-1].microbatches == 4
    torch.manual_seed(0)
    ref = SkipNet()
    want = skipnet_loss(ref(big_x), big_y)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-6)
    grads = dict(ref.named_parameters())
    for name, p in net.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-6), name


def test_a_batch_that_does_not_split_says_what_fits(tmp_path: Path) -> None:
    build, loaded = _gpt_build(tmp_path)
    pipe = Pipeline.from_build(build, loaded.module)
    x = loaded.example_inputs[0][:3]
    with pytest.raises(HpmlError, match="multiple of 2 rows"):
        pipe.step((x,), x, loaded.loss_fn)


def test_tied_weights_have_one_owner(tmp_path: Path) -> None:
    build_dir, loaded = _gpt_build(tmp_path)
    build = Pipeline.from_build(build_dir, loaded.module).build
    owners = tensor_owners(loaded.module, build)
    assert owners["wte.weight"][0] == owners["lm_head.weight"][0] == 0  # stage 0 binds the embedding
    assert owners["norm.weight"][0] == 1


def test_compile_api_in_one_process(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
    pipe = compile(model, (x,), cluster="local-cpu-2", microbatches=2, solver="uniform", profile_repeats=1,
                   out_dir=tmp_path / "b", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    losses = [pipe.step(x, y, torch.nn.functional.cross_entropy).item() for _ in range(5)]
    assert losses[-1] < losses[0]
    assert (tmp_path / "b" / "manifest.json").is_file() and pipe.world_size == 1


def test_backend_per_pair_and_devices_of_a_mixed_cluster() -> None:
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert pair_backend(gpu0, gpu1).value == "nccl"
    assert pair_backend(gpu0, cpu).value == pair_backend(cpu, cpu).value == "gloo"
    c = load_cluster("hetero-cpu")  # gpu0 (A100-40GB), gpu1 (T4), cpu0
    plan = Plan("m", c, Schedule.GPIPE, 1, (Stage(0, ("gpu0",), ()), Stage(1, ("gpu1",), ()),
                                            Stage(2, ("cpu0",), ())))
    assert [str(d) for d in rank_devices(plan)] == ["cuda:0", "cuda:1", "cpu"]
    assert [str(d) for d in rank_devices(plan, local_gpu_count=1)] == ["cuda:0", "cuda:0", "cpu"]


def test_transient_errors_are_told_from_bugs() -> None:
    assert is_transient(InjectedFault("x")) and is_transient(ConnectionResetError())
    assert is_transient(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"))
    assert is_transient(RuntimeError("Application timeout caused pair closure"))
    assert not is_transient(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_transient(HpmlError("a bad batch"))
    assert RetryPolicy(attempts=4, backoff_s=0.1).delay(3) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    assert CommFault(2, 1).op is CommOp.RECV


def test_torchrun_command_lines() -> None:
    one = torchrun_args(LaunchSpec(Path("b"), Path("r"), 2))
    assert one[:3] == ["--standalone", "--nnodes=1", "--nproc-per-node=2"]
    assert one[-3:] == [str(RANK_ENTRY), "b", "r"] and RANK_ENTRY.is_file()  # the options are r/run.json
    static = torchrun_args(LaunchSpec(Path("b"), Path("r"), 1, nnodes=2, node_rank=0, rdzv_endpoint="h:29400"))
    assert "--rdzv-backend=static" in static and "--node-rank=0" in static and "--rdzv-endpoint=h:29400" in static
    dyn = torchrun_args(LaunchSpec(Path("b"), Path("r"), 4, nnodes=2, rdzv_endpoint="h:29400", rdzv_id="job"))
    assert "--rdzv-backend=c10d" in dyn and "--rdzv-id=job" in dyn
    with pytest.raises(LaunchError, match="--rdzv-endpoint"):
        torchrun_args(LaunchSpec(Path("b"), Path("r"), 1, nnodes=2))
    assert threads_per_rank(2, cores=2) == 1 and threads_per_rank(3, cores=2) == 1 and threads_per_rank(1, 8) == 8


def test_world_and_port_checks_say_what_to_do(tmp_path: Path) -> None:
    build, _ = _gpt_build(tmp_path)
    from hpml_compile.plan import load_plan

    plan = load_plan(build / "plan.json")
    check_world(plan, 2, 1)
    with pytest.raises(LaunchError, match=r"runs on 2 devices .* = 3 ranks: use --nproc 2"):
        check_world(plan, 3, 1)
    with pytest.raises(LaunchError, match="nnodes x nproc = 2"):
        check_world(plan, 2, 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=rf"port {port} on 127.0.0.1 is already in use.*--rdzv-endpoint"):
            check_port(f"127.0.0.1:{port}")


def test_failure_report_names_the_first_rank(tmp_path: Path) -> None:
    for rank, t, msg in ((0, 2.0, "Connection closed by peer"), (1, 1.0, "CUDA out of memory")):
        RunFolder(tmp_path).error(rank).parent.mkdir(parents=True, exist_ok=True)
        RunFolder(tmp_path).error(rank).write_text(json.dumps({"rank": rank, "time": t, "message": msg}))
    text = explain_failure(tmp_path, {0: (1, ""), 1: (1, ""), 2: (-9, "Signal 9 (SIGKILL) received by PID 7")})
    lines = text.splitlines()
    assert lines[0] == "rank 1 failed first: CUDA out of memory"
    assert "then rank 0: Connection closed by peer" in lines[1]
    assert "rank 2: exited before it could report (Signal 9" in lines[2]


def test_recipe_round_trip_and_absence(tmp_path: Path) -> None:
    r = ModelRecipe(absolute_model_spec("m.py:make"), 4, None, 1, ("Block",), "fx", 2)
    build, _ = _gpt_build(tmp_path, recipe=r)
    assert read_recipe(build) == r and Path(r.model.rpartition(":")[0]).is_absolute()
    assert absolute_model_spec("hf:gpt2?n_layer=2") == "hf:gpt2?n_layer=2"
    with pytest.raises(BuildMismatchError, match="no model recipe"):
        read_recipe(tmp_path / "elsewhere")


def test_worker_arguments() -> None:
    o = RunOptions(faults=Faults(comm=(parse_fault("3:1:collective"),)), optimizer=OptimizerName.SGD)
    assert o.faults.comm == (CommFault(2, 1, CommOp.COLLECTIVE),) and o.optimizer.value == "sgd"
    assert RunOptions.from_dict(json.loads(json.dumps(o.to_dict()))) == o  # run.json round-trips
    with pytest.raises(argparse.ArgumentTypeError, match="STEP:RANK"):
        parse_fault("3-1")
    with pytest.raises(HpmlError, match="unknown run options"):
        RunOptions.from_dict({"steps": 3, "stepz": 4})


def test_run_refuses_a_mismatched_world_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build, _ = _gpt_build(tmp_path, recipe=ModelRecipe("gpt-tiny", 4, 16))
    assert main(["run", str(build), "--nproc", "3", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "runs on 2 devices" in err and "use --nproc 2" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    assert main(["run", str(tmp_path)]) == 2 and "not a build folder" in capsys.readouterr().err
    (tmp_path / "build" / "model.json").unlink()
    assert main(["run", str(build)]) == 2 and "no model recipe" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nothing")]) == 2 and "no such folder" in capsys.readouterr().err
