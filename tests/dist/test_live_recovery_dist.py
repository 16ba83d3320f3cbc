"""A lost replica without a restart: the survivors go on in the same processes and the failed step runs again.

Gloo ranks of a live session (heartbeats in the job's store,
:mod:`hpml_compile.runtime.execute.members`) train ``mlp-tiny``; one replica
of a replicated stage kills itself (SIGKILL) in its first forward of step
``KILL_AT``, mid-step. The survivors' communication fails, they agree who is
left, open the next generation of the group on themselves, take the lost
replica's rows and run the failed step again from its start. Checked: each
survivor trains every step in the process it started in (no step lost, none
run twice); the world shrank at ``KILL_AT``; the rows of the stage that lost
a replica were re-split over those left; and every loss and the parameters
after the run equal the original model's trained in this process on the same
batches (the gradient is the exact batch mean whatever the rows, so an
uninterrupted run that switched to the survivors' rows at ``KILL_AT`` computes
the same values, up to the order of its sums). No process is left behind.

The same with a TrainSpec, whose ranks load only their rows of each batch:
the survivors read the failed batch again with their new rows (the lost
replica's share included), so every sample of it is trained once, and the
losses equal a plain loop's over the same global batches. And a stage that
loses its only replica stops every survivor with the restart named.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torch import nn
from torch.utils.data import TensorDataset

from hpml_compile import models
from hpml_compile.codegen import generate, load_build
from hpml_compile.runtime import spawn_ranks
from hpml_compile.runtime.execute.data import global_batch
from hpml_compile.runtime.execute.pipeline import Pipeline
from hpml_compile.runtime.execute.session import RetryPolicy, Session
from hpml_compile.runtime.execute.trainer import Trainer
from hpml_compile.testing import process_gone, split_plan, trained_plainly
from hpml_compile.trace import trace
from hpml_compile.trainspec import TrainSpec

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(600)]
STEPS, KILL_AT, BATCH, MICRO = 6, 3, 24, 2
TOL = {"rel": 1e-5, "abs": 1e-6}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(STEPS)]


def _optimizer(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=1e-2)


def _rank(rank: int, world: int, build: str, out: str, victim: int) -> None:
    dist.destroy_process_group()  # spawn_ranks' group is not a session's: a live one opens its own
    Path(out, f"pid{rank}").write_text(str(os.getpid()))
    loaded = models.load("mlp-tiny", batch_size=BATCH)
    log = Path(out, f"log{rank}.txt")
    session = Session(f"file://{out}/store", rank=rank, world_size=world, live=True,
                      policy=RetryPolicy(attempts=3, backoff_s=0.1, rejoin_timeout_s=60.0, timeout_s=60.0))
    pipe = Pipeline(load_build(build, loaded.module), loaded.module, optimizer=_optimizer, session=session,
                    log=lambda line: log.open("a").write(line + "\n"))
    stage = pipe.stages[pipe.stage_index]

    def die(_m: Any, _a: Any) -> None:
        if rank == victim and pipe.steps_done == KILL_AT:  # mid-step: the others are in this step too
            os.kill(os.getpid(), signal.SIGKILL)

    stage.register_forward_pre_hook(die)
    steps = []
    for x, y in _batches():
        loss = float(pipe.step((x,), y, loaded.loss_fn))
        steps.append({"loss": loss, "pid": os.getpid(), "world": pipe.world_size, "rank": pipe.rank,
                      "rows": [list(st.rows) for st in pipe.plan.stages],
                      "devices": [list(st.devices) for st in pipe.plan.stages]})
    mine = {id(p) for p in pipe.parameters()}
    final = {n: p.detach().flatten().tolist() for n, p in loaded.module.named_parameters() if id(p) in mine}
    pipe.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"steps": steps, "final": final}))


def _reference() -> tuple[list[float], dict[str, list[float]]]:
    """The original model trained here on the same batches: every loss and the parameters after the run."""
    loaded = models.load("mlp-tiny", batch_size=BATCH)
    return trained_plainly(loaded.module, loaded.loss_fn, _optimizer(loaded.module.parameters()), _batches())


@pytest.mark.parametrize(("replicas", "victim", "lost_stage"), [([3], 1, 0), ([1, 2], 1, 1)],
                         ids=["1-stage-x-3-replicas", "2-stages-replicated-second"])
def test_a_lost_replica_is_replaced_in_place_and_the_run_equals_the_original(
        tmp_path: Path, replicas: list[int], victim: int, lost_stage: int) -> None:
    loaded = models.load("mlp-tiny", batch_size=BATCH)
    gm = trace(loaded.module, loaded.example_inputs)
    build = tmp_path / "build"
    generate(gm, split_plan(gm, "mlp-tiny", len(replicas), microbatches=MICRO, replicas=replicas), build)
    world = sum(replicas)
    spawn_ranks(_rank, world, tmp_path, str(build), str(tmp_path), victim, timeout_s=300, may_die={victim})
    pids = {r: int(Path(tmp_path, f"pid{r}").read_text()) for r in range(world)}
    assert not Path(tmp_path, f"rank{victim}.json").exists(), "the victim was to die"
    want_losses, want_final = _reference()
    survivors = [r for r in range(world) if r != victim]
    rows_left = BATCH // MICRO // (replicas[lost_stage] - 1)
    for r in survivors:
        report = json.loads(Path(tmp_path, f"rank{r}.json").read_text())
        steps = report["steps"]
        log = Path(tmp_path, f"log{r}.txt").read_text()
        assert len(steps) == STEPS and {s["pid"] for s in steps} == {pids[r]}, (r, steps)  # same process throughout
        assert [s["world"] for s in steps] == [world] * KILL_AT + [world - 1] * (STEPS - KILL_AT), (r, steps, log)
        assert f"ranks [{victim}] of the job died; going on without them" in log and "the step runs again" in log
        after = steps[KILL_AT]
        assert len(after["devices"][lost_stage]) == replicas[lost_stage] - 1
        assert f"cpu{victim}" not in after["devices"][lost_stage]
        assert after["rows"][lost_stage] == [rows_left] * (replicas[lost_stage] - 1), after
        assert after["rank"] == (r if r < victim else r - 1), after  # renumbered in order
        for step, s in enumerate(steps):  # the failed step computed once more, on the survivors: nothing skipped
            assert s["loss"] == pytest.approx(want_losses[step], **TOL), (r, step, s["loss"], want_losses)
        assert report["final"], r
        for name, values in report["final"].items():
            assert values == pytest.approx(want_final[name], **TOL), (r, name)
    assert all(process_gone(pid) for pid in pids.values()), "a rank outlived the run"


def test_a_stage_that_loses_its_only_replica_stops_with_the_restart_named(tmp_path: Path) -> None:
    loaded = models.load("mlp-tiny", batch_size=BATCH)
    gm = trace(loaded.module, loaded.example_inputs)
    build = tmp_path / "build"
    generate(gm, split_plan(gm, "mlp-tiny", 2, microbatches=MICRO, replicas=[1, 2]), build)
    with pytest.raises(Exception, match="stage 0 lost its only replica \\(cpu0\\): its parameters are gone, so the "
                                        "job must restart from the last checkpoint"):
        spawn_ranks(_rank, 3, tmp_path, str(build), str(tmp_path), 0, timeout_s=300, may_die={0})
    pids = [int(Path(tmp_path, f"pid{r}").read_text()) for r in range(3)]
    assert all(process_gone(pid) for pid in pids), "a rank outlived the run"


# -- a TrainSpec's data path: each rank loads only its rows, and reads the failed batch again with its new rows ---

ITEMS, SEED = 96, 3


def _spec() -> TrainSpec:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    x = torch.randn(ITEMS, 6, generator=torch.Generator().manual_seed(1))
    return TrainSpec(net, TensorDataset(x, x[:, :3].argmax(1)), nn.functional.cross_entropy, batch_size=BATCH,
                     seed=SEED, optimizer=_optimizer)


def _spec_rank(rank: int, world: int, build: str, out: str, victim: int) -> None:
    dist.destroy_process_group()
    Path(out, f"pid{rank}").write_text(str(os.getpid()))
    spec = _spec()
    session = Session(f"file://{out}/store", rank=rank, world_size=world, live=True,
                      policy=RetryPolicy(attempts=3, rejoin_timeout_s=60.0, timeout_s=60.0))
    log = Path(out, f"log{rank}.txt")
    pipe = Pipeline(load_build(build, spec.module), spec.module, optimizer=spec.optimizer, session=session,
                    log=lambda line: log.open("a").write(line + "\n"))
    trainer = pipe.trainer = Trainer(pipe, spec)

    def die(_m: Any, _a: Any) -> None:
        if rank == victim and pipe.steps_done == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)

    pipe.stages[pipe.stage_index].register_forward_pre_hook(die)
    losses, rows = [], []
    for _ in range(STEPS):
        losses.append(float(trainer.step()))
        rows.append(len(trainer.rows))
    pipe.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"losses": losses, "rows": rows}))


@pytest.mark.parametrize("replicas", [[3], [1, 2]], ids=["1-stage-x-3-replicas", "2-stages-replicated-second"])
def test_a_trainspec_rank_reads_the_failed_batch_again_with_the_lost_replicas_rows(
        tmp_path: Path, replicas: list[int]) -> None:
    spec = _spec()
    gm = trace(spec.module, (spec.dataset.tensors[0][:BATCH],))
    generate(gm, split_plan(gm, "mlp", len(replicas), microbatches=MICRO, replicas=replicas), tmp_path / "b")
    world, victim = sum(replicas), 1
    spawn_ranks(_spec_rank, world, tmp_path, str(tmp_path / "b"), str(tmp_path), victim, timeout_s=300,
                may_die={victim})
    assert spec.optimizer is not None
    (x, y) = spec.dataset.tensors  # a plain loop over the same global batches
    want, _ = trained_plainly(spec.module, spec.loss_fn, spec.optimizer(spec.module.parameters()),
                              ((x[i], y[i]) for i in (global_batch(ITEMS, BATCH, SEED, s) for s in range(STEPS))))
    lost = len(replicas) - 1  # the stage that loses a replica: the last
    for r in (r for r in range(world) if r != victim):
        report = json.loads(Path(tmp_path, f"rank{r}.json").read_text())
        assert report["losses"] == pytest.approx(want, **TOL), (r, report["losses"], want)
        if r >= sum(replicas[:lost]):  # a replica left of that stage loads the lost one's rows from the failed step
            n = replicas[lost]
            assert report["rows"] == [BATCH // n] * KILL_AT + [BATCH // (n - 1)] * (STEPS - KILL_AT), (r, report)
    pids = [int(Path(tmp_path, f"pid{r}").read_text()) for r in range(world)]
    assert all(process_gone(pid) for pid in pids), "a rank outlived the run"
