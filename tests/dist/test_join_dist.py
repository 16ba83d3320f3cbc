"""A replica joins a running job at a step boundary: placed by the running ranks, given its stage's state by a peer.

Three gloo ranks of a live session train ``mlp-tiny`` as one stage of three replicas (or two stages, the
first of two replicas); rank 1, a replica, kills itself mid-step at ``KILL_AT``; the two left go on
(:mod:`hpml_compile.runtime.execute.members`). Two new processes then ask to join
(:mod:`hpml_compile.runtime.execute.join`): one without naming a device (it takes cpu1, the device the lost
replica had) and one naming cpu0, which a running rank holds. At boundary ``JOIN_AT`` the running ranks let the
first in and refuse the second by name; the stage's first replica sends its parameters and optimizer
state to the joiner, and the run ends on three replicas. Checked: every loss of every rank, and the parameters
after the run on every rank, the joiner's included, equal the original model's trained in this process on the
same batches (the gradient is the batch mean whatever the rows); each rank trains in the process it started in;
the refused process gets the reason; no process is left. And a joiner lost while it is let in (before the group
formed with it, or before its state came) leaves the others going on on two, as after any lost replica.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpml_compile import models
from hpml_compile.codegen import generate, load_build
from hpml_compile.runtime import spawn_ranks
from hpml_compile.runtime.execute.join import JoinRefused
from hpml_compile.runtime.execute.pipeline import Pipeline
from hpml_compile.runtime.execute.session import RetryPolicy, Session
from hpml_compile.testing import process_gone, split_plan, trained_plainly
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(600)]
STEPS, KILL_AT, JOIN_AT, BATCH, MICRO, VICTIM = 6, 2, 4, 24, 2, 1
JOINER, REFUSED = 3, 4  # spawned ranks that are not ranks of the job: they ask to join it
TOL = {"rel": 1e-5, "abs": 1e-6}
POLICY = RetryPolicy(attempts=3, backoff_s=0.1, rejoin_timeout_s=60.0, timeout_s=60.0)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(STEPS)]


def _optimizer(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=1e-2)


def _record(pipe: Pipeline, loss: float, step: int) -> dict[str, Any]:
    return {"step": step, "loss": loss, "pid": os.getpid(), "world": pipe.world_size,
            "rows": [list(st.rows) for st in pipe.plan.stages],
            "devices": [list(st.devices) for st in pipe.plan.stages]}


def _wait(what: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _die(*_: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _rank(rank: int, world: int, build: str, out: str, job: int, joiner_dies: str = "") -> None:
    dist.destroy_process_group()  # spawn_ranks' group is not a session's: a live one opens its own
    Path(out, f"pid{rank}").write_text(str(os.getpid()))
    loaded = models.load("mlp-tiny", batch_size=BATCH)
    log = Path(out, f"log{rank}.txt")
    kw: dict[str, Any] = {"optimizer": _optimizer,
                          "log": lambda line: log.open("a").write(f"{time.time():.2f} {line}\n")}
    # a joiner lost before the group formed is found gone once the group's formation times out (the group's
    # time-out: gloo waits for every rank's address that long)
    policy = replace(POLICY, rejoin_timeout_s=10.0, timeout_s=10.0) if joiner_dies == "before-group" else POLICY
    steps = []
    if rank >= JOINER:
        _wait(lambda: Path(out, "shrunk").exists())
        with torch.no_grad():  # whatever it starts from, the joiner trains from the peer's state
            for p in loaded.module.parameters():
                p.normal_()
        if joiner_dies and rank == JOINER:  # let in, then lost before the group formed or before its state came
            where = {"before-group": "session.Session.grow", "before-state": "pipeline.receive_state"}[joiner_dies]
            pytest.MonkeyPatch().setattr(f"hpml_compile.runtime.execute.{where}", _die)
        try:
            pipe = Pipeline.from_build(build, loaded.module, init_method=f"file://{out}/store", live=True,
                                       join=True if rank == JOINER else "cpu0", retry=policy, **kw)
        except JoinRefused as e:
            Path(out, f"rank{rank}.json").write_text(json.dumps({"refused": str(e)}))
            return
    else:
        session = Session(f"file://{out}/store", rank=rank, world_size=job, live=True, policy=policy)
        pipe = Pipeline(load_build(build, loaded.module), loaded.module, session=session, **kw)

        def die(_m: Any, _a: Any) -> None:
            if rank == VICTIM and pipe.steps_done == KILL_AT:  # mid-step: the others are in this step too
                os.kill(os.getpid(), signal.SIGKILL)

        pipe.stages[pipe.stage_index].register_forward_pre_hook(die)
    batches = _batches()
    while pipe.steps_done < STEPS:
        step = pipe.steps_done
        if rank < JOINER and step == JOIN_AT:  # both asks are in before this boundary: one decision takes them
            _wait(lambda: pipe.session is not None and pipe.session.joiners >= 2)
        x, y = batches[step]
        steps.append(_record(pipe, float(pipe.step((x,), y, loaded.loss_fn)), step))
        if rank == 0 and pipe.world_size == job - 1:
            Path(out, "shrunk").touch()
    mine = {id(p) for p in pipe.parameters()}
    final = {n: p.detach().flatten().tolist() for n, p in loaded.module.named_parameters() if id(p) in mine}
    pipe.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"steps": steps, "final": final}))


def _reference() -> tuple[list[float], dict[str, list[float]]]:
    """The original model trained here on the same batches: every loss and the parameters after the run."""
    loaded = models.load("mlp-tiny", batch_size=BATCH)
    return trained_plainly(loaded.module, loaded.loss_fn, _optimizer(loaded.module.parameters()), _batches())


@pytest.mark.parametrize(("replicas", "devices", "rows"), [
    ([3], [["cpu0", "cpu2", "cpu1"]], [[4, 4, 4]]),
    ([2, 1], [["cpu0", "cpu1"], ["cpu2"]], [[6, 6], []]),  # the joiner takes rank 1: stage 1's rank moves up
], ids=["1-stage-x-3-replicas", "2-stages-replicated-first"])
def test_a_new_process_joins_at_a_step_boundary_and_the_run_equals_the_original(
        tmp_path: Path, replicas: list[int], devices: list[list[str]], rows: list[list[int]]) -> None:
    loaded = models.load("mlp-tiny", batch_size=BATCH)
    gm = trace(loaded.module, loaded.example_inputs)
    build = tmp_path / "build"
    generate(gm, split_plan(gm, "mlp-tiny", len(replicas), microbatches=MICRO, replicas=replicas), build)
    spawn_ranks(_rank, 5, tmp_path, str(build), str(tmp_path), 3, timeout_s=400, may_die={VICTIM})
    pids = {r: int(Path(tmp_path, f"pid{r}").read_text()) for r in range(5)}
    assert not Path(tmp_path, f"rank{VICTIM}.json").exists(), "the victim was to die"
    refused = json.loads(Path(tmp_path, f"rank{REFUSED}.json").read_text())["refused"]
    assert "device cpu0 already runs a rank of the job" in refused, refused
    want_losses, want_final = _reference()
    worlds = [3] * KILL_AT + [2] * (JOIN_AT - KILL_AT) + [3] * (STEPS - JOIN_AT)
    for r in (0, 2, JOINER):
        report = json.loads(Path(tmp_path, f"rank{r}.json").read_text())
        steps = report["steps"]
        log = Path(tmp_path, f"log{r}.txt").read_text()
        first = JOIN_AT if r == JOINER else 0
        assert [s["step"] for s in steps] == list(range(first, STEPS)), (r, steps, log)
        assert {s["pid"] for s in steps} == {pids[r]}, (r, steps)  # the same process throughout
        assert [s["world"] for s in steps] == worlds[first:], (r, steps, log)
        after = steps[JOIN_AT - first]
        assert after["devices"] == devices and after["rows"] == rows, after
        assert ("joined at step" if r == JOINER else "of the job joined") in log, log
        for s in steps:  # every step on the same values as one process: the joiner took the peer's state
            assert s["loss"] == pytest.approx(want_losses[s["step"]], **TOL), (r, s, want_losses)
        assert report["final"], r
        for name, values in report["final"].items():
            assert values == pytest.approx(want_final[name], **TOL), (r, name)
    assert all(process_gone(pid) for pid in pids.values()), "a process outlived the run"


@pytest.mark.parametrize("when", ["before-group", "before-state"])
def test_a_joiner_lost_while_it_is_let_in_leaves_the_others_going_on(tmp_path: Path, when: str) -> None:
    loaded = models.load("mlp-tiny", batch_size=BATCH)
    gm = trace(loaded.module, loaded.example_inputs)
    build = tmp_path / "build"
    generate(gm, split_plan(gm, "mlp-tiny", 1, microbatches=MICRO, replicas=[3]), build)
    spawn_ranks(_rank, 5, tmp_path, str(build), str(tmp_path), 3, when, timeout_s=400, may_die={VICTIM, JOINER})
    pids = {r: int(Path(tmp_path, f"pid{r}").read_text()) for r in range(5)}
    assert not Path(tmp_path, f"rank{JOINER}.json").exists(), "the joiner was to die"
    want_losses, want_final = _reference()
    for r in (0, 2):
        report = json.loads(Path(tmp_path, f"rank{r}.json").read_text())
        log = Path(tmp_path, f"log{r}.txt").read_text()
        # let in, and lost before the group formed with it or before it had its state: the others go on
        # its job rank is 3 or 4: the two asks take their tickets in either order
        assert re.search(r"ranks \[[34]\] of the job died; going on without them", log), log
        assert [s["world"] for s in report["steps"]] == [3] * KILL_AT + [2] * (STEPS - KILL_AT), (r, log)
        assert {s["pid"] for s in report["steps"]} == {pids[r]}
        assert [s["loss"] for s in report["steps"]] == pytest.approx(want_losses, **TOL), r
        for name, values in report["final"].items():
            assert values == pytest.approx(want_final[name], **TOL), (r, name)
    assert all(process_gone(pid) for pid in pids.values()), "a process outlived the run"
