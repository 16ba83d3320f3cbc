"""A failed step of a hierarchical plan is retried on new sub-groups, at once, and trains as the original.

SkipNet on one stage of four CPU ranks that the plan puts two on each of two hosts (``hostA``, ``hostB``), under
``allreduce: hierarchical``: ZeRO-0 (the gradients reduce-scattered in each host, all-reduced between hosts,
gathered in each host) and ZeRO-1 (the optimizer sharded over each host's two ranks, :mod:`hpml_compile.runtime.sync.zero`).
Rank 0's first collective of step 1 fails once (an injected transient error); every rank drops the failed groups,
re-forms the process group (:meth:`hpml_compile.runtime.execute.session.Session.reopen`) and retries the step.

Why: ``Pipeline._drop_groups`` once let go of the communicator's groups, its pairs and its shared
mappings, not of the hierarchical sub-groups, which the communicator (``comm.hierarchy``) and a hierarchical ZeRO-1
shard (``FlatShard.hier``) still held after the re-forming. A held gloo group keeps its sockets open, so a peer
blocked on it is not released until its time-out, and the shard kept running its collectives on the failed
sub-groups. Each rank checks that the step was retried once on a new generation, well before the groups' time-out
(60 s here), that the shard runs on the new communicator's sub-groups, and that the losses and parameters are the
one-process model's.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpml_compile.codegen import generate, load_build
from hpml_compile.testing import (seeded_skipnet, skipnet_batches, skipnet_loss, skipnet_sgd, split_plan,
                                          trained_skipnet)
from hpml_compile.ir import Cluster, Device
from hpml_compile.plan import AllReduce
from hpml_compile.runtime import CommFault, CommOp, Pipeline, spawn_ranks
from hpml_compile.runtime.execute.session import RetryPolicy, Session
from hpml_compile.runtime.sync.zero import FlatShard
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # four gloo ranks on 2 cores, two failed-and-retried runs

STEPS, FAIL_AT, ROWS, TOL, TIMEOUT_S = 3, 1, 8, 1e-5, 60.0
ZEROS = (0, 1)


def _case(rank: int, world: int, build: str, out: str, name: str) -> dict[str, Any]:
    model = seeded_skipnet()
    session = Session(f"file://{out}/store-{name}", rank=rank, world_size=world,
                      policy=RetryPolicy(attempts=3, backoff_s=0.1, rejoin_timeout_s=TIMEOUT_S, timeout_s=TIMEOUT_S))
    pipe = Pipeline(load_build(build, model), model, optimizer=skipnet_sgd, session=session,
                    faults=[CommFault(FAIL_AT, 0, CommOp.COLLECTIVE, 0)], events=False)
    assert pipe.comm is not None and sorted(pipe.comm.hierarchy) == [(0,)]
    losses, seconds = [], []
    for x, y in skipnet_batches(STEPS, ROWS):
        t0 = time.monotonic()
        losses.append(float(pipe.step((x,), y, skipnet_loss)))
        seconds.append(time.monotonic() - t0)
    shard = pipe.sync.buffer if pipe.sync is not None else None
    report = {"losses": losses, "seconds": seconds, "retries": [m.retries for m in pipe.metrics],
              "generation": session.generation, "hierarchy": sorted(pipe.comm.hierarchy),
              "shard_rebound": shard.hier is pipe.comm.hierarchy[(0,)] if isinstance(shard, FlatShard) else None,
              "final": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}}
    pipe.close()
    return report


def _train(rank: int, world: int, builds: dict[str, str], out: str) -> None:
    dist.destroy_process_group()  # spawn_ranks' group: not a session's, so a failed step could not re-form it
    report = {name: _case(rank, world, build, out, name) for name, build in builds.items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def test_a_failed_step_of_a_hierarchical_plan_is_retried_on_new_sub_groups_at_once(tmp_path: Path) -> None:
    gm = trace(seeded_skipnet(), skipnet_batches(1, ROWS)[0][:1])
    base = split_plan(gm, "skipnet", 1, microbatches=2, replicas=[4])
    hosts = Cluster(devices=tuple(Device(f"cpu{i}", "cpu", 2.0, host="hostA" if i < 2 else "hostB")
                                  for i in range(4)), name="two-hosts")
    builds = {}
    for zero in ZEROS:
        plan = replace(base, cluster=hosts, stages=(replace(base.stages[0], zero=zero,
                                                            allreduce=AllReduce.HIERARCHICAL),))
        generate(gm, plan, tmp_path / f"zero{zero}")
        builds[f"zero{zero}"] = str(tmp_path / f"zero{zero}")
    spawn_ranks(_train, 4, tmp_path, builds, str(tmp_path), timeout_s=300)
    losses, final = trained_skipnet(STEPS, ROWS)
    for rank in range(4):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, row in report.items():
            where = (rank, name)
            assert row["retries"] == [0, 1, 0] and row["generation"] == 1, (where, row["retries"])
            assert row["hierarchy"] == [[0]], where  # the new communicator's sub-groups, made again
            assert row["shard_rebound"] in ((True,) if name == "zero1" else (None,)), where
            # no rank waited out the failed groups' time-out before the retry went on
            assert row["seconds"][FAIL_AT] < TIMEOUT_S / 3, (where, row["seconds"])
            assert row["losses"] == pytest.approx(losses, abs=TOL), (where, row["losses"])
            for n, got in row["final"].items():
                assert torch.allclose(torch.tensor(got), torch.tensor(final[n]), atol=TOL), (where, n)
