"""A loss agreement that fails on one rank after reaching the other: the step commits once, on every rank.

The loss agreement (one all-reduce of the loss sum and the batch check, after every gradient sync and before any
optimizer step) is where a step commits. Its all-reduce can complete on one rank and fail on another, whose share
went out but whose answer did not come back. The first steps its optimizer and goes on; the second cannot tell
whether anyone agreed. Before, the second retried the step, the first re-formed the group one step later, and
the job stopped with "the ranks re-formed the group on different steps". Now the failing rank re-forms the group
at once and asks (:meth:`hpml_compile.runtime.execute.session.Session.reopen`): the others are a step ahead, so it takes
the same update with their agreed loss. When the agreement fails before a rank's share goes out, nobody can
commit, and every rank runs the step again.

Two gloo ranks, SkipNet, three plans: one stage replicated twice under ZeRO-0 and ZeRO-1 (whose parameter
all-gather after the optimizer step the ranks ahead fail in, and owe to the next step), and a 2-stage pipeline.
``CommFault(1, 1, AGREE, 1)``: rank 1's agreement of step 1 (from 0) fails after its all-reduce returned;
``CommFault(1, 1, AGREE, 0)``: before it. The losses and final parameters must equal the one-process run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpml_compile.codegen import generate, load_build
from hpml_compile.testing import (SkipNet, replicated_skipnet_builds, seeded_skipnet, skipnet_batch,
                                          skipnet_batches, skipnet_loss, skipnet_sgd, split_plan, trained_skipnet)
from hpml_compile.runtime import CommFault, CommOp, Pipeline, spawn_ranks
from hpml_compile.runtime.sync.comm import InjectedFault
from hpml_compile.runtime.execute.session import RetryPolicy, Session
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist]

STEPS, FAIL_AT, MICRO, ROWS, TOL = 4, 1, 2, 8, 1e-5  # steps, the failing step (from 0), microbatches, rows, tolerance
WHEN = {"after": 1, "before": 0}  # the AGREE occurrence that fails: after the all-reduce returned, or before it


def _builds(root: Path) -> dict[str, str]:
    out = {f"zero{z}": b for z, b in replicated_skipnet_builds(root, (0, 1), microbatches=MICRO, rows=ROWS).items()}
    gm = trace(SkipNet(), skipnet_batch(rows=ROWS)[:1])
    out["pipe"] = str(root / "pipe")
    generate(gm, split_plan(gm, "skipnet", 2, microbatches=MICRO), out["pipe"])
    return out


def _case(rank: int, world: int, build: str, out: str, name: str, index: int) -> dict[str, Any]:
    model = seeded_skipnet()
    session = Session(f"file://{out}/store-{name}", rank=rank, world_size=world,
                      policy=RetryPolicy(attempts=3, backoff_s=0.1, rejoin_timeout_s=60.0, timeout_s=60.0))
    lines: list[str] = []
    pipe = Pipeline(load_build(build, model), model, optimizer=skipnet_sgd, session=session,
                    faults=[CommFault(FAIL_AT, 1, CommOp.AGREE, index)], events=False, log=lines.append)
    losses = [float(pipe.step((x,), y, skipnet_loss)) for x, y in skipnet_batches(STEPS, ROWS)]
    mine = {id(p) for p in pipe.parameters()}
    final = {n: p.detach().flatten().tolist() for n, p in model.named_parameters() if id(p) in mine}
    report = {"losses": losses, "final": final, "steps": pipe.steps_done, "lines": lines,
              "retries": [m.retries for m in pipe.metrics], "generation": session.generation}
    pipe.close()
    return report


def _train(rank: int, world: int, builds: dict[str, str], out: str) -> None:
    dist.destroy_process_group()  # spawn_ranks' group: not a session's, so it could not be re-formed
    report = {f"{name}-{when}": _case(rank, world, b, out, f"{name}-{when}", index)
              for name, b in builds.items() for when, index in WHEN.items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def test_a_loss_agreement_that_fails_on_one_rank_commits_the_step_once_everywhere(tmp_path: Path) -> None:
    spawn_ranks(_train, 2, tmp_path, _builds(tmp_path), str(tmp_path), timeout_s=300)
    losses, params = trained_skipnet(STEPS, ROWS)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for case in reports[0]:
        for rank in range(2):
            row, where = reports[rank][case], (case, rank)
            # trained exactly as the original: step 1's update counted once on both ranks, the loss the batch's
            assert row["steps"] == STEPS and row["generation"] == 1, (where, row["steps"], row["generation"])
            assert row["losses"] == pytest.approx(losses, abs=TOL), (where, row["losses"], losses)
            for name, got in row["final"].items():
                assert torch.allclose(torch.tensor(got), torch.tensor(params[name]), atol=TOL), (where, name)
        ahead, behind = reports[0][case], reports[1][case]
        if case.endswith("-before"):  # nobody committed: both ran step 1 again, on the group rank 1 re-formed
            assert ahead["retries"] == behind["retries"] == [0, 1, 0, 0], (case, ahead["retries"], behind["retries"])
            continue
        # rank 1 took rank 0's update and ran nothing twice; it says so once
        assert behind["retries"] == [0] * STEPS, (case, behind["retries"])
        said = [ln for ln in behind["lines"] if "the other ranks had agreed" in ln]
        assert len(said) == 1 and f"step {FAIL_AT + 1}:" in said[0], (case, behind["lines"])
        # rank 0 had committed step 1: it failed in the next collective of the old group, the ZeRO-1 gather after its
        # optimizer step (the update stands) or step 2's first, which it ran again on the new group
        expected = [0] * STEPS if case.startswith("zero1") else [0, 0, 1, 0]
        assert ahead["retries"] == expected, (case, ahead["retries"], ahead["lines"])
        # ... at once: rank 1 let go of every reference to the old groups (the shared-memory mappings' too), so
        # their connections closed; a reference kept made rank 0 wait out the 60 s time-out instead
        assert not any("Timed out" in ln for ln in ahead["lines"]), (case, ahead["lines"])


def _validator(rank: int, when: str) -> Any:
    """A validation pass of one all-reduce over the ranks; rank 1's fails in step ``FAIL_AT``, ``before`` its
    all-reduce (so rank 0's fails too) or ``after`` it returned (rank 0's succeeded)."""
    calls = [0]

    def validate() -> float:
        step, calls[0] = calls[0], calls[0] + 1
        fail = rank == 1 and step == FAIL_AT
        if fail and when == "before":
            raise InjectedFault(f"injected validation failure on rank {rank} in step {step + 1}")
        t = torch.ones(1)
        dist.all_reduce(t)
        if fail:
            raise InjectedFault(f"injected validation failure on rank {rank} in step {step + 1}")
        return float(t)

    return validate


def _validated(rank: int, world: int, builds: dict[str, str], out: str) -> None:
    dist.destroy_process_group()
    report = {}
    for name in ("zero0", "zero1"):
        for when in WHEN:
            model = seeded_skipnet()
            session = Session(f"file://{out}/store-val-{name}-{when}", rank=rank, world_size=world,
                              policy=RetryPolicy(attempts=3, backoff_s=0.1, rejoin_timeout_s=60.0, timeout_s=60.0))
            lines: list[str] = []
            pipe = Pipeline(load_build(builds[name], model), model, optimizer=skipnet_sgd, session=session,
                            events=False, log=lines.append)
            check = _validator(rank, when)
            losses = [float(pipe.step((x,), y, skipnet_loss, validate=check)) for x, y in skipnet_batches(STEPS, ROWS)]
            report[f"{name}-{when}"] = {"losses": losses, "val": [m.val_loss for m in pipe.metrics],
                                        "retries": [m.retries for m in pipe.metrics], "lines": lines,
                                        "generation": session.generation, "steps": pipe.steps_done}
            pipe.close()
    Path(out, f"val{rank}.json").write_text(json.dumps(report))
    dist.init_process_group("gloo", init_method=f"file://{out}/store-val-end", rank=rank, world_size=world)


def test_a_validation_that_fails_after_the_update_keeps_it_and_training_goes_on(tmp_path: Path) -> None:
    """Before, a transient failure in the validation pass after the update stopped the job (CommFailure: resume
    from the last checkpoint). Now the update stands, the group is re-formed at the next step's number, the step
    has no validation loss on the ranks whose pass failed, and training goes on as the one-process run."""
    builds = replicated_skipnet_builds(tmp_path, (0, 1), microbatches=MICRO, rows=ROWS)
    spawn_ranks(_validated, 2, tmp_path, {f"zero{z}": b for z, b in builds.items()}, str(tmp_path), timeout_s=300)
    losses, _ = trained_skipnet(STEPS, ROWS)
    reports = [json.loads((tmp_path / f"val{rank}.json").read_text()) for rank in range(2)]
    for case in reports[0]:
        for rank in range(2):
            row, where = reports[rank][case], (case, rank)
            assert row["steps"] == STEPS and row["generation"] == 1, (where, row)
            assert row["losses"] == pytest.approx(losses, abs=TOL), (where, row["losses"], losses)
            failed = rank == 1 or case.endswith("-before")  # rank 0's pass fails with rank 1's only before it
            assert row["val"] == [2.0, None if failed else 2.0, 2.0, 2.0], (where, row["val"])
            said = [ln for ln in row["lines"] if "while measuring the validation loss after the update" in ln]
            assert len(said) == (1 if failed else 0), (where, row["lines"])
        # rank 0's pass succeeded after rank 1's: it failed in step 2's first collective and ran that step again
        expected = [0, 0, 1, 0] if case.endswith("-after") else [0] * STEPS
        assert reports[0][case]["retries"] == expected and reports[1][case]["retries"] == [0] * STEPS, case
