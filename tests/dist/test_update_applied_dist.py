"""A communication failure after the optimizer update: the update stands and the step is not run again.

Two gloo ranks hold one stage of SkipNet, replicated twice, ZeRO-1 or ZeRO-2, as the plan runs it on CPU ranks:
one reduce-scatter after the backward, the ranks' loss agreement, the optimizer step on each replica's shard,
then one blocking all-gather of the stepped shards (:meth:`hpml_compile.runtime.zero.FlatShard.all_gather`).
In step 1 (from 0) rank 0's all-gather fails (``CommFault(1, 0, COLLECTIVE, 1)``: its second collective of the
step; the first is the reduce-scatter); rank 1's fails with it when rank 0 tears the group down.

The update is in the shards by then. Before :class:`hpml_compile.errors.UpdateApplied`, the pipeline
retried the whole step: each replica ran it again on its own stepped shard beside the other shard's old values
(the gather that would have brought them had failed, and a non-prefetching shard owed none), and stepped a
second time on the same batch. Now the step ends there, the group is re-formed at the next step's number, and
the next step gathers the parameters first. The losses and the final parameters must equal the one-process run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpml_compile.codegen import generate, load_build
from hpml_compile.codegen.testing import SkipNet, seeded_skipnet, skipnet_batches, skipnet_loss, split_plan
from hpml_compile.runtime import CommFault, CommOp, Pipeline, spawn_ranks
from hpml_compile.runtime.session import RetryPolicy, Session
from hpml_compile.runtime.zero import FlatShard
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist]

STEPS = 4
FAIL_AT = 1
MICRO = 2
ROWS = 8
TOL = 1e-5


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _reference() -> tuple[list[float], dict[str, list[float]]]:
    model = seeded_skipnet()
    opt = _optimizer(model.parameters())
    losses = []
    for x, y in skipnet_batches(STEPS, ROWS):
        opt.zero_grad()
        loss = skipnet_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}


def _case(rank: int, world: int, build: str, out: str, name: str) -> dict[str, Any]:
    model = seeded_skipnet()
    session = Session(f"file://{out}/store-{name}", rank=rank, world_size=world,
                      policy=RetryPolicy(attempts=3, backoff_s=0.1, rejoin_timeout_s=60.0, timeout_s=60.0))
    lines: list[str] = []
    pipe = Pipeline(load_build(build, model), model, optimizer=_optimizer, session=session,
                    faults=[CommFault(FAIL_AT, 0, CommOp.COLLECTIVE, 1)], events=False, log=lines.append)
    assert pipe.comm is not None
    shard = pipe.comm.shards[pipe.stage_index]
    assert isinstance(shard, FlatShard) and not shard.prefetch  # CPU ranks: the blocking gather after the step
    losses, owed = [], []
    for x, y in skipnet_batches(STEPS, ROWS):
        losses.append(float(pipe.step((x,), y, skipnet_loss)))
        owed.append(shard._owed)
    mine = {id(p) for p in pipe.parameters()}
    final = {n: p.detach().flatten().tolist() for n, p in model.named_parameters() if id(p) in mine}
    report = {"losses": losses, "final": final, "owed": owed, "steps": pipe.steps_done, "lines": lines,
              "retries": [m.retries for m in pipe.metrics], "generation": session.generation}
    pipe.close()
    return report


def _train(rank: int, world: int, builds: dict[str, str], out: str) -> None:
    dist.destroy_process_group()  # spawn_ranks' group: not a session's, so it could not be re-formed
    report = {z: _case(rank, world, b, out, f"zero{z}") for z, b in builds.items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.init_process_group("gloo", init_method=f"file://{out}/store-end", rank=rank, world_size=world)


def test_a_gather_that_fails_after_the_update_keeps_it_and_the_next_step_gathers_first(tmp_path: Path) -> None:
    gm = trace(SkipNet(), skipnet_batches(STEPS, ROWS)[0][:1])
    builds = {}
    for z in (1, 2):
        builds[str(z)] = str(tmp_path / f"zero{z}")
        generate(gm, split_plan(gm, "skipnet", 1, microbatches=MICRO, replicas=[2], zero=z), builds[str(z)])
    spawn_ranks(_train, 2, tmp_path, builds, str(tmp_path), timeout_s=240)
    losses, params = _reference()
    for rank in range(2):
        for zero, row in json.loads((tmp_path / f"rank{rank}.json").read_text()).items():
            where = (rank, f"ZeRO-{zero}")
            # trained exactly as the original: step 1's update counted once, nothing read stale after it
            assert row["losses"] == pytest.approx(losses, abs=TOL), (where, row["losses"], losses)
            for name, got in row["final"].items():
                assert torch.allclose(torch.tensor(got), torch.tensor(params[name]), atol=TOL), (where, name)
            # the group re-formed once, no step run twice; the gather owed after step 1 only, paid by step 2
            assert row["steps"] == STEPS and row["generation"] == 1, (where, row)
            assert row["retries"] == [0] * STEPS, (where, row["retries"])
            assert row["owed"] == [False, True, False, False], (where, row["owed"])
            said = [ln for ln in row["lines"] if "after the optimizer update, which stands" in ln]
            assert len(said) == 1 and f"step {FAIL_AT + 1}:" in said[0], (where, row["lines"])
