"""A step retried after a communication failure while ZeRO-1/2's prefetched parameter gathers are in flight.

Two gloo ranks hold one stage of SkipNet, replicated twice, ZeRO-1 or ZeRO-2 with the buckets forced on
(``overlap=True``, as on GPU groups): after each optimizer step every bucket's parameter all-gather is launched
asynchronously and waited by the next forward's pre-hooks (:meth:`hpml_compile.runtime.sync.zero.FlatShard.all_gather`).
Step 1 (from 0), the step right after step 0 whose gathers are in flight, fails once on rank 0 with a transient
error; both ranks drop the failed groups' pending gathers (:meth:`~hpml_compile.runtime.sync.zero.FlatShard.forget`),
re-form the process group (:meth:`hpml_compile.runtime.execute.session.Session.reopen`) and retry the step, which
gathers the parameters again before its forward. Three failures, each under ZeRO-1 and ZeRO-2:

- ``collective``: ``CommFault(1, 0, COLLECTIVE)``, rank 0's first collective of the step: its first bucket's
  reduce-scatter, launched by a gradient hook in the last backward (the forward has waited the gathers); rank 1
  fails when rank 0 tears the group down under its reduce-scatter;
- ``before``: rank 0 fails as its forward starts, before any pre-hook has waited a gather, with every one of
  step 0's gathers still in flight: rank 1 is held 1 s in step 0's optimizer step (a step pre-hook), so rank 0's
  gathers cannot have finished (they need rank 1's pieces). With two ranks a replicated stage has no receive
  before its forward, where a pipeline stage's first failure would be, so the failure is an
  :class:`~hpml_compile.runtime.sync.comm.InjectedFault` raised by a forward pre-hook put before the shard's own.
  Tearing the group down waits for the dropped gathers, which finish once rank 1 launches its side;
- ``lost``: as ``before``, but rank 1 launches its side only once rank 0 has left the failed group (its session's
  generation moved on), so rank 0's gathers of step 0 never finish: they end at the group's time-out (the
  session's, 5 s here) and the retry's own gather is all that brings rank 0 the other shard; rank 1's gathers of
  step 0 are lost with the group too. While the stage's groups had torch's default time-out for a new group
  (30 minutes), not the session's, rank 0 stayed in the teardown until rank 1 stopped waiting (20 s here) and
  launched its side, which then finished both ranks' gathers: the check on rank 1's forwards below failed.

Each rank checks:

- (a) no stale read: every forward of step 1 (each attempt, microbatch and called module past the shard's
  waiters) read the parameters of the one-process reference after step 0, not those before it (which differ);
  which attempts got that far says where each rank failed;
- (b) the losses of every step and the parameters at the end are the reference's (SGD with momentum, the
  overlap test's tolerance), so the retry neither lost the gathered shards nor stepped twice;
- (c) the step was retried once, on a new generation; no handle of a dropped gather is kept (a kept one holds
  its gloo context, whose sockets then keep the peer's pending collective from failing: found while writing this
  test), the retried step owes no re-gather, leaves one gather per bucket in flight and ``Pipeline.settle`` none;
  rank 0 failed with every gather in flight (``before``, ``lost``) and left the failed group at the session's
  time-out (``lost``); a hung rank fails the test at :func:`~hpml_compile.runtime.job.spawn.spawn_ranks`'
  deadline (the ranks are terminated).

``spawn_ranks`` initialises a group the ranks did not make, which a pipeline cannot re-form, so each case runs
under a :class:`~hpml_compile.runtime.execute.session.Session` of its own (a ``file://`` store: no port).
"""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hpml_compile
from hpml_compile.codegen import load_build
from hpml_compile.testing import replicated_skipnet_builds, seeded_skipnet, skipnet_batches, skipnet_loss
from hpml_compile.runtime import CommFault, CommOp, Pipeline, spawn_ranks
from hpml_compile.runtime.sync.comm import InjectedFault
from hpml_compile.runtime.execute.session import RetryPolicy, Session
from hpml_compile.runtime.sync.zero import FlatShard

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # ~25 s on 2 cores: six failed-and-retried cases

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
FAIL_AT = 1  # the step after step 0, whose gathers are in flight when it starts
MICRO = 2
ROWS = 8  # 2 microbatches of 4 rows, 2 rows per replica
TOL = 1e-5  # tests/dist/test_overlap_dist.py's
BUCKET_MB = 393 * 4 / 2**20  # SkipNet's 2004 parameters in several buckets (each ~196 floats of a shard)
HOLD_S = 1.0  # rank 1's optimizer step of step 0 in the "before" cases: rank 0's gathers wait for its pieces
LOST_TIMEOUT_S = 5.0  # the groups' time-out in the "lost" cases: rank 0's gathers of step 0 give up after it
LOST_CAP_S = 20.0  # ... and rank 1 launches its side only once rank 0 has left the failed group, or after this
CASES = [("1", "collective"), ("2", "collective"), ("1", "before"), ("2", "before"), ("1", "lost"), ("2", "lost")]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _reference() -> tuple[list[float], list[dict[str, list[float]]]]:
    """The losses, and the parameters before every step and after the last, of the model in one process."""
    model = seeded_skipnet()
    opt = _optimizer(model.parameters())
    losses, params = [], []
    for x, y in skipnet_batches(STEPS, ROWS):
        params.append({n: p.detach().flatten().tolist() for n, p in model.named_parameters()})
        opt.zero_grad()
        loss = skipnet_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    params.append({n: p.detach().flatten().tolist() for n, p in model.named_parameters()})
    return losses, params


def _reads(pipe: Pipeline, session: Session, names: dict[int, str]) -> list[tuple[int, dict[str, list[float]]]]:
    """Hooks that record, per forward of step ``FAIL_AT`` of each module the stage calls, the attempt and what the
    module's parameters hold as it computes (registered after the shard's waiters: its buckets were waited)."""
    stage = pipe.stages[pipe.stage_index]
    seen: list[tuple[int, dict[str, list[float]]]] = []
    for target in stage.TARGETS:
        try:
            m = stage.get_submodule(target)
        except AttributeError:
            continue  # a parameter the stage reads directly: SkipNet's stage has none (LayerNorm is a module)
        ps = [p for p in m.parameters() if id(p) in names]
        if ps:
            m.register_forward_pre_hook(lambda _m, _a, ps=ps: seen.append(
                (session.retries, {names[id(p)]: p.detach().flatten().tolist() for p in ps}))
                if pipe.steps_done == FAIL_AT else None)
    return seen


def _case(rank: int, world: int, build: str, out: str, name: str, fault: str) -> dict[str, Any]:
    model = seeded_skipnet()
    session = Session(f"file://{out}/store-{name}", rank=rank, world_size=world,
                      policy=RetryPolicy(attempts=3, backoff_s=0.1, rejoin_timeout_s=60.0,
                                         timeout_s=LOST_TIMEOUT_S if fault == "lost" else 60.0))
    faults = [CommFault(FAIL_AT, 0, CommOp.COLLECTIVE, 0)] if fault == "collective" else []
    pipe = Pipeline(load_build(build, model), model, optimizer=_optimizer, session=session, faults=faults,
                    overlap=True, bucket_mb=BUCKET_MB, events=False)
    assert pipe.comm is not None and pipe.optimizer is not None and pipe.session is not None
    shard = pipe.sync.buffer if pipe.sync is not None else None
    assert isinstance(shard, FlatShard) and shard.prefetch and shard.buckets is not None
    stage = pipe.stages[pipe.stage_index]
    seen = _reads(pipe, session, {id(p): n for n, p in model.named_parameters()})
    in_flight: list[bool] = []  # each of step 0's gathers, unfinished when rank 0 failed
    left_group = Path(out, f"left-{name}")  # rank 0 has torn the failed group down ("lost")
    held: list[float] = []
    marker: list[threading.Thread] = []

    def fail_before(_m: nn.Module, _a: Any) -> None:
        if rank == 0 and pipe.steps_done == FAIL_AT and session.retries == 0:
            in_flight.extend(not h.work.is_completed() for h in shard._gathers.values())
            if fault == "lost":  # tell rank 1 once this rank has left the failed group (its generation moves on)
                marker.append(threading.Thread(target=_mark_when, args=(session, left_group), daemon=True))
                marker[0].start()
            raise InjectedFault(f"injected failure on rank 0 before step {FAIL_AT + 1}'s forward waited its gathers")

    def hold(_o: Any, _a: Any, _k: Any) -> None:
        if rank == 1 and pipe.steps_done == 0:
            t0 = time.monotonic()
            if fault == "lost":  # launch step 0's gathers only once rank 0 gave its own up with the failed group
                while not left_group.exists() and time.monotonic() < t0 + LOST_CAP_S:
                    time.sleep(0.02)
            else:
                time.sleep(HOLD_S)
            held.append(time.monotonic() - t0)

    if fault != "collective":
        stage.register_forward_pre_hook(fail_before, prepend=True)  # before the shard's waiter on the stage
        pipe.optimizer.register_step_pre_hook(hold)
    losses, dropped, after = [], [], {}
    for i, (x, y) in enumerate(skipnet_batches(STEPS, ROWS)):
        if i == FAIL_AT:
            # step 0's gathers, in flight as step FAIL_AT starts; weakly: a handle holds its gloo context (the
            # sockets), and a rank that kept one would keep its peer's pending collective from failing
            dropped = [weakref.ref(h) for h in shard._gathers.values()]
        losses.append(float(pipe.step((x,), y, skipnet_loss)))
        if i == FAIL_AT:
            gc.collect()
            after = {"owed": shard._owed, "pending": len(shard._gathers),
                     "kept": sum(r() is not None for r in dropped)}
    for t in marker:
        t.join(timeout=LOST_CAP_S)  # done already: the generation moved on in the retry
    pipe.settle()
    left = len(shard._gathers)
    mine = {id(p) for p in pipe.parameters()}
    final = {n: p.detach().flatten().tolist() for n, p in model.named_parameters() if id(p) in mine}
    report = {"losses": losses, "final": final, "seen": seen, "in_flight": in_flight, "dropped": len(dropped),
              "after": after, "left": left, "buckets": len(shard.buckets.members), "held": held,
              "left_group": left_group.exists(), "retries": [m.retries for m in pipe.metrics],
              "generation": session.generation, "package": hpml_compile.__file__}
    pipe.close()
    return report


def _mark_when(session: Session, path: Path) -> None:
    """Create ``path`` once ``session`` has torn its failed group down (its generation moved on), or give up."""
    deadline = time.monotonic() + LOST_CAP_S
    while session.generation == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if session.generation > 0:
        path.touch()


def _train(rank: int, world: int, builds: dict[str, str], out: str) -> None:
    dist.destroy_process_group()  # spawn_ranks' group: not a session's, so a failed step could not re-form it
    report = {f"{z}-{f}": _case(rank, world, builds[z], out, f"{z}-{f}", f) for z, f in CASES}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def test_a_step_retried_with_prefetched_zero_gathers_in_flight_regathers_and_trains_as_the_original(
        tmp_path: Path) -> None:
    builds = replicated_skipnet_builds(tmp_path, (1, 2), microbatches=MICRO, rows=ROWS)
    spawn_ranks(_train, 2, tmp_path, builds, str(tmp_path), timeout_s=240)
    losses, params = _reference()
    stale, fresh = params[FAIL_AT - 1], params[FAIL_AT]  # before step 0; after it (what step 1 must read)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for key, row in report.items():
            where = (rank, key)
            assert Path(row["package"]).resolve().is_relative_to(ROOT), (where, row["package"])
            # (a) every forward of the failed step and of its retry read step 0's result, never the values before
            # the attempts whose forward got past the waiters: rank 0 failed before (its gathers dropped), and rank 1
            # too where its gathers were lost with the failed group; in "before" they may have finished first
            attempts = sorted({a for a, _ in row["seen"]})
            want = {"collective": [[0, 1]], "before": [[1]] if rank == 0 else [[0, 1], [1]], "lost": [[1]]}
            assert attempts in want[key.split("-")[1]], (where, attempts)
            for _, read in row["seen"]:
                for name, got in read.items():
                    assert torch.allclose(torch.tensor(got), torch.tensor(fresh[name]), atol=TOL), (where, name)
                    assert not torch.allclose(torch.tensor(got), torch.tensor(stale[name]), atol=TOL), (where, name)
            # (b) the one-process run's losses and final parameters
            assert row["losses"] == pytest.approx(losses, abs=TOL), (where, row["losses"])
            for name, got in row["final"].items():
                assert torch.allclose(torch.tensor(got), torch.tensor(params[-1][name]), atol=TOL), (where, name)
            # (c) retried once, on a new group; nothing of the failed groups left running or owed
            assert row["retries"] == [0, 1, 0, 0] and row["generation"] == 1, (where, row["retries"])
            assert row["buckets"] > 2 and row["dropped"] == row["buckets"], (where, row)
            assert row["after"] == {"owed": False, "pending": row["buckets"], "kept": 0}, (where, row["after"])
            assert row["left"] == 0, where
            if not key.endswith("collective") and rank == 0:  # the failure came with every gather of step 0 in flight
                assert row["in_flight"] == [True] * row["buckets"], (where, row["in_flight"])
            if key.endswith("lost") and rank == 1:  # rank 0 left the failed group at the session's time-out, its
                # gathers unanswered, not at torch's default one for a new group (30 minutes: LOST_CAP_S here)
                assert row["left_group"] and row["held"][0] < LOST_CAP_S - 5, (where, row["held"])
