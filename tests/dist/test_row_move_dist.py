"""``run --adapt`` answers a slowed data-parallel replica by moving rows off it in place, and training stays exact.

gpt-tiny on a 2-rank data-parallel plan (what ``compile`` makes for
``local-cpu-2`` at batch 48 in 2 microbatches: one stage on cpu0 and cpu1),
rank 1 slowed 3x from step 6. The closed loop prices both candidates, the
row move (same stage, same devices, new rows) and the full re-plan, and
switches by the row move: the cheaper to switch to that pays. The restart a
re-plan needs is priced at 0.1 s (``HPML_ADAPT_SWITCH_COST_S``) so that both
pay within a test's few steps; the row move is priced at the in-place cost
(``policy.ROW_MOVE_PRIOR_S`` before a move was measured), and wins.

The running ranks take the new rows between two steps: one segment, one
launch, no checkpoint loaded; the run folder's plan.json is re-published with
the rows, and replans.jsonl records the move with its measured cost. After
it, the job's losses are those of a plain run of the original even plan: the
gradient is the exact batch mean whatever the rows, so moving rows changes
only the summation order.

The second test covers what the built-in model's example batch does not: a
TrainSpec's data path on 3 gloo ranks (stage 0 on one, stage 1's two replicas
generated at an even split), its rows moved twice between steps; each rank
then loads only its new rows of every batch, and the losses equal a plain
loop's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hpml_compile.codegen import generate
from hpml_compile.codegen.testing import split_plan
from hpml_compile.plan import load_plan
from hpml_compile.runtime import spawn_ranks
from hpml_compile.runtime.data import global_batch
from hpml_compile.runtime.monitor import read_metrics
from hpml_compile.runtime.pipeline import Pipeline
from hpml_compile.runtime.trainer import Trainer
from hpml_compile.trace import trace
from hpml_compile.trainspec import TrainSpec

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1800)]
CLI = [sys.executable, "-m", "hpml_compile"]
STEPS, SLOW_FROM = 16, 6


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"hpml-compile {' '.join(args)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _losses(run: Path) -> dict[int, float]:
    """Step number (from 1) -> the batch loss, as rank 0 measured it."""
    return {m.step + 1: m.loss for m in read_metrics(run)[0] if m.loss is not None}


def test_a_slowed_replica_loses_rows_in_place_and_the_losses_stay_exact(tmp_path: Path) -> None:
    build = tmp_path / "b"
    _cli("compile", "gpt-tiny", "--cluster", "local-cpu-2", "--batch-size", "48", "--microbatches", "2",
         "--repeats", "1", "-o", str(build))
    plan = load_plan(build / "plan.json")
    assert [st.devices for st in plan.stages] == [("cpu0", "cpu1")] and not plan.stages[0].rows, \
        "the test needs compile's one-stage data-parallel plan for local-cpu-2"
    run = tmp_path / "run"
    r = _cli("run", str(build), "--steps", str(STEPS), "--adapt", "--adapt-patience", "3", "--slow",
             f"1:3:{SLOW_FROM}", "--run-dir", str(run), "--no-tensorboard", "--no-report",
             env={"HPML_ADAPT_SWITCH_COST_S": "0.1"})
    out = r.stdout + r.stderr  # the ranks' decisions go to stderr
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    # no restart: one segment (one torchrun launch, the same processes throughout), nothing resumed
    assert [e["event"] for e in events] == ["segment", "done"], events
    assert events[0]["resume_from"] is None and "resuming from" not in out
    decisions = [json.loads(x) for x in (run / "seg0" / "replans.jsonl").read_text().splitlines() if x.strip()]
    moves = [d for d in decisions if d.get("in_place")]
    assert moves, f"no in-place row move:\n{decisions}\n{out[-3000:]}"
    d = moves[0]
    assert d["switch"] and d["chosen"] == "rows" and set(d["candidates"]) == {"rows", "replan"}, d
    assert "cpu1" in d["slow_devices"] and "switching by rows in place" in out and "rows moved in place" in out
    rows, full = d["candidates"]["rows"], d["candidates"]["replan"]
    assert rows["in_place"] and rows["predicted_step_ms"] > 0 and full["predicted_step_ms"] > 0
    assert rows["switch_cost_s"] < 0.1 < full["switch_cost_s"]  # in place against a restart plus a solve
    assert 0 < d["switch_s"] < 5.0 and d["codegen_s"] == 0.0 and "build" not in d  # measured, no new build
    # the run's plan.json has the new rows: the same stage on the same devices, fewer rows for the slowed cpu1
    moved = load_plan(run / "seg0" / "plan.json")
    st = moved.stages[0]
    assert len(moved.stages) == 1 and st.devices == ("cpu0", "cpu1") and st.nodes == plan.stages[0].nodes
    assert sum(st.rows) == 24 and st.rows[1] < st.rows[0] and [list(st.rows)] == d["rows"]
    # exact: every step's loss, before and after the move, as a plain run of the original even plan
    plain = tmp_path / "plain"
    _cli("run", str(build), "--steps", str(STEPS), "--run-dir", str(plain), "--no-tensorboard", "--no-report")
    want = _losses(plain)
    got = _losses(run / "seg0")
    assert sorted(got) == list(range(1, STEPS + 1)) and STEPS > d["step"] + 2
    for step in sorted(got):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), (step, got, want)


# -- the data path of a TrainSpec: each rank loads its new rows (one spawn of 3 gloo ranks, a few seconds) ------

ITEMS, BATCH, SEED = 48, 8, 4
MOVES = {2: (3, 1), 4: (1, 3)}  # before step k (from 0): stage 1's rows of each 4-row microbatch (even at first)


def _spec() -> TrainSpec:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    x = torch.randn(ITEMS, 6, generator=torch.Generator().manual_seed(1))
    return TrainSpec(net, TensorDataset(x, x[:, :3].argmax(1)), nn.functional.cross_entropy, batch_size=BATCH,
                     seed=SEED, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))


def _rank(rank: int, world: int, root: str) -> None:
    spec = _spec()
    pipe = Pipeline.from_build(root, spec.module, optimizer=spec.optimizer)
    trainer = pipe.trainer = Trainer(pipe, spec)
    losses, rows = [], [trainer.rows]
    for step in range(6):
        if step in MOVES:  # every rank, between two steps, as the closed loop's verdict does
            st = pipe.plan.stages
            pipe.move_rows(replace(pipe.plan, stages=(st[0], replace(st[1], rows=MOVES[step]))))
            rows.append(trainer.rows)
        losses.append(float(trainer.step()))
    Path(root, f"rank{rank}.json").write_text(json.dumps({"losses": losses, "rows": rows}))


def test_ranks_of_a_trainspec_load_their_new_rows_after_a_move(tmp_path: Path) -> None:
    spec = _spec()
    gm = trace(spec.module, (spec.dataset.tensors[0][:BATCH],))
    generate(gm, split_plan(gm, "mlp", 2, microbatches=2, replicas=[1, 2]), tmp_path)  # stage 1 generated even
    spawn_ranks(_rank, 3, tmp_path, str(tmp_path), timeout_s=300)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert spec.optimizer is not None
    opt, (x, y), want = spec.optimizer(spec.module.parameters()), spec.dataset.tensors, []
    for step in range(6):  # a plain loop over the same global batches
        idx = global_batch(ITEMS, BATCH, SEED, step)
        opt.zero_grad()
        loss = spec.loss_fn(spec.module(x[idx]), y[idx])
        loss.backward()
        opt.step()
        want.append(loss.item())
    for r in reports:
        assert r["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6), (r["losses"], want)
    # stage 1's replicas (ranks 1, 2) load 2:2, then 3:1, then 1:3 rows of each microbatch; stage 0 (rank 0) all
    assert [[len(x) for x in r["rows"]] for r in reports] == [[8, 8, 8], [4, 6, 2], [4, 2, 6]]
    assert reports[2]["rows"][1] == [3, 7] and reports[1]["rows"][2] == [0, 4]
