"""``run --adapt`` answers a slowed data-parallel replica by moving rows off it, and training stays exact.

The first test: gpt-tiny on a 2-rank data-parallel plan (what ``compile``
makes for ``local-cpu-2`` at batch 48 in 2 microbatches: one stage on cpu0 and
cpu1), rank 1 slowed 3x from step 6, and rank 0's gradient all-reduce failed
once at step 17 (``--inject-fault``, no retry). The closed loop prices both
candidates, the row move (same stage, same devices, new rows) and the full
re-plan, and switches by the row move: the cheaper to switch to that pays. The
restart a re-plan needs is priced at 0.1 s (``HPML_ADAPT_SWITCH_COST_S``) so
that both pay within a test's few steps; the row move is priced at the
in-place cost (``policy.ROW_MOVE_PRIOR_S`` before a move was measured), and
wins.

The running ranks take the new rows between two steps: no checkpoint loaded,
no restart; the run folder's plan.json is re-published with the rows,
replans.jsonl records the move with its measured cost, and the job's
events.jsonl has it too (``rows_moved``), which ``report`` prints. Then the
injected failure: the supervisor restarts both ranks on the same build from
the step-15 checkpoint, and the restarted ranks train with the moved rows, not
the build's even split (the new segment's plan.json and its event carry them;
every rank took them before its first step). Every loss, before and after the
move and after the restart, equals that of the original model trained in this
process: the gradient is the exact batch mean whatever the rows, so moving
rows changes only the summation order.

The second test is the row move that cannot happen in place: gpt-tiny in 2
stages of 2 replicas each (4 ranks), generated at even splits, so the boundary
between the stages was generated without its batch dimensions
(``adapt.in_place_refusal``). Rank 3 (stage 1's second replica) slowed 3x, only
the row move allowed (``HPML_ADAPT_CANDIDATES=rows``): rank 0 generates a build
with stage 1's new rows, the ranks checkpoint and stop, and the supervisor
restarts them on it; the losses stay exact across the restart.

The third test covers what the built-in model's example batch does not: a
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

from hpml_compile import models
from hpml_compile.cli import main
from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan, trained_plainly
from hpml_compile.costgraph import build as build_costgraph
from hpml_compile.driver import rebuild
from hpml_compile.plan import load_plan
from hpml_compile.profile import load_profile
from hpml_compile.recipe import read_recipe
from hpml_compile.runtime import spawn_ranks
from hpml_compile.runtime.execute.data import global_batch
from hpml_compile.runtime.observe.monitor import read_metrics
from hpml_compile.runtime.execute.pipeline import Pipeline
from hpml_compile.runtime.job.supervisor import timings
from hpml_compile.runtime.execute.trainer import Trainer
from hpml_compile.simulate import annotate
from hpml_compile.trace import trace
from hpml_compile.trainspec import TrainSpec

# The builds are compiled in this process, where profiling's notes on a busy machine's timing (which a CLI
# subprocess kept to its own stderr) would fill the summary: they are about the host, not what is tested here.
QUIET_PROFILE = [pytest.mark.filterwarnings("ignore:.*the model's blocks timed in sequence took:UserWarning"),
                 pytest.mark.filterwarnings("ignore:.*the whole-model pass took:UserWarning")]
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1800), *QUIET_PROFILE]
CLI = [sys.executable, "-m", "hpml_compile"]
STEPS, SLOW_FROM, FAIL_AT = 20, 6, 17
TOL = {"rel": 1e-5, "abs": 1e-6}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"hpml-compile {' '.join(args)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _compile(out: Path, cluster: str) -> Path:
    # in this process: a CLI subprocess would import torch and the package once more for the same build
    assert main(["compile", "gpt-tiny", "--cluster", cluster, "--batch-size", "48", "--microbatches", "2",
                 "--repeats", "1", "-o", str(out)]) == 0
    return out


def _losses(run: Path) -> dict[int, float]:
    """Step number (from 1) -> the batch loss, as rank 0 measured it."""
    return {m.step + 1: m.loss for m in read_metrics(run)[0] if m.loss is not None}


def _step_of(checkpoint: str) -> int:
    return int(Path(checkpoint).name.split("_")[1])


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _original(build: Path, steps: int) -> dict[int, float]:
    """Step number (from 1) -> the loss of the original model trained here as ``run`` trains it (AdamW, lr 1e-3,
    the recipe's example batch): the reference every run must equal."""
    recipe = read_recipe(build)
    loaded = models.load(recipe.model, batch_size=recipe.batch_size, seq_len=recipe.seq_len, seed=recipe.seed)
    opt = torch.optim.AdamW(loaded.module.parameters(), lr=1e-3)
    out = {}
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = loaded.loss_fn(loaded.module(*loaded.example_inputs), loaded.example_targets)
        loss.backward()
        opt.step()
        out[step] = loss.item()
    return out


def test_rows_moved_in_place_are_recorded_and_survive_a_failure_restart(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    build = _compile(tmp_path / "b", "local-cpu-2")
    plan = load_plan(build / "plan.json")
    assert [st.devices for st in plan.stages] == [("cpu0", "cpu1")] and not plan.stages[0].rows, \
        "the test needs compile's one-stage data-parallel plan for local-cpu-2"
    run = tmp_path / "run"
    r = _cli("run", str(build), "--steps", str(STEPS), "--adapt", "--adapt-patience", "3", "--slow",
             f"1:3:{SLOW_FROM}", "--inject-fault", f"{FAIL_AT}:0:collective", "--retries", "1",
             "--run-dir", str(run), "--no-tensorboard", "--no-report", env={"HPML_ADAPT_SWITCH_COST_S": "0.1"})
    out = r.stdout + r.stderr  # the ranks' decisions go to stderr
    decisions = _jsonl(run / "seg0" / "replans.jsonl")
    moves = [d for d in decisions if d.get("in_place")]
    assert moves, f"no in-place row move:\n{decisions}\n{out[-3000:]}"
    d = moves[0]
    assert d["step"] < FAIL_AT - 1, f"the move came too late for the failure to follow it: {d['step']}"
    assert d["switch"] and d["chosen"] == "rows" and set(d["candidates"]) == {"rows", "replan"}, d
    assert "cpu1" in d["slow_devices"] and "switching by rows in place" in out and "rows moved in place" in out
    rows, full = d["candidates"]["rows"], d["candidates"]["replan"]
    assert rows["in_place"] and rows["predicted_step_ms"] > 0 and full["predicted_step_ms"] > 0
    assert rows["switch_cost_s"] < 0.1 < full["switch_cost_s"]  # in place against a restart plus a solve
    assert 0 < d["switch_s"] < 5.0 and d["codegen_s"] == 0.0 and "build" not in d  # measured, no new build
    last = moves[-1]["rows"]  # the rows in force when the ranks failed
    st = load_plan(run / "seg0" / "plan.json").stages[0]  # re-published with them: same stage and devices
    assert st.devices == ("cpu0", "cpu1") and st.nodes == plan.stages[0].nodes and [list(st.rows)] == last
    assert sum(d["rows"][0]) == 24 and d["rows"][0][1] < d["rows"][0][0], d["rows"]  # fewer rows for cpu1
    # events.jsonl: the moves where they happened, then the failure and the restart on the same build
    events = _jsonl(run / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds == ["segment", *["rows_moved"] * len(moves), "failure", "segment", "done"], \
        f"{kinds}\n{[e for e in events if e['event'] == 'failure']}\n{out[-3000:]}"  # which rank, and why
    assert events[0]["resume_from"] is None  # the move itself restarted nothing
    for e, m in zip(events[1:], moves):
        assert (e["segment"], e["step"], e["rows"], e["switch_s"]) == (0, m["step"], m["rows"], m["switch_s"])
        assert events[0]["time"] < e["time"] < events[len(moves) + 1]["time"]
    failure, again = events[len(moves) + 1], events[len(moves) + 2]
    assert failure["segment"] == 0 and not failure["dropped"], failure
    assert again["build"] == str(build) and again["devices"] == ["cpu0", "cpu1"] and again.get("rows") == last
    assert again["resume_from"] is not None and _step_of(again["resume_from"]) == 15, again
    # the restarted ranks took those rows before their first step, every one of them
    assert [list(s.rows) for s in load_plan(run / "seg1" / "plan.json").stages] == last
    assert f"rows per replica from {run / 'seg1' / 'plan.json'}, on every rank: cpu0,cpu1 rows " \
           f"{':'.join(map(str, last[0]))}" in out, out[-3000:]
    assert "with the rows moved in place before the failure" in out
    # report shows the move beside the restart, with its measured cost
    t = timings(run)
    assert [x["kind"].split(" (")[0] for x in t] == [*["rows moved in place"] * len(moves), "failure"], t
    assert t[0]["resume_s"] == d["switch_s"] and t[0]["step"] == d["step"]
    capsys.readouterr()
    assert main(["report", str(run), "--no-export"]) == 0
    shown = capsys.readouterr().out
    assert f"rows moved in place (no restart) at step {d['step']} (segment 0, rows " \
           f"{':'.join(map(str, d['rows'][0]))}): chosen in" in shown and "ms (measured)" in shown, shown[-2000:]
    # exact: every step's loss, before and after the move and after the restart, as the original model's
    want = _original(build, STEPS)
    first, resumed = _losses(run / "seg0"), _losses(run / "seg1")
    assert sorted(first) == list(range(1, FAIL_AT)) and sorted(resumed) == list(range(16, STEPS + 1))
    for got in (first, resumed):
        for step in sorted(got):
            assert got[step] == pytest.approx(want[step], **TOL), (step, got, want)


def test_a_row_move_the_running_code_cannot_serve_restarts_on_a_new_build(tmp_path: Path) -> None:
    base = _compile(tmp_path / "base", "local-cpu-4")
    prof = load_profile(base / "profile.json")
    loaded = models.load("gpt-tiny", batch_size=48)
    two = split_plan(trace(loaded.module, loaded.example_inputs), "gpt-tiny", 2, microbatches=2, replicas=[2, 2])
    build = rebuild(base, annotate(two, build_costgraph(prof), prof.dtype)[0], prof, tmp_path / "b").out_dir
    plan = load_plan(Path(build) / "plan.json")
    assert [st.devices for st in plan.stages] == [("cpu0", "cpu1"), ("cpu2", "cpu3")]
    assert not any(st.rows for st in plan.stages)
    run = tmp_path / "run"
    # 5x and 18 steps: 4 ranks share 2 cores, and at 3x over 16 steps one long wait for a core once broke the
    # watch's run of slow steps before the end (the decision never came)
    steps = 18
    r = _cli("run", str(build), "--steps", str(steps), "--adapt", "--adapt-patience", "3", "--slow",
             f"3:5:{SLOW_FROM}", "--run-dir", str(run), "--no-tensorboard", "--no-report",
             env={"HPML_ADAPT_SWITCH_COST_S": "0.1", "HPML_ADAPT_CANDIDATES": "rows"})
    out = r.stdout + r.stderr
    decisions = [d for d in _jsonl(run / "seg0" / "replans.jsonl") if d.get("switch")]
    assert decisions, f"no switch:\n{(run / 'seg0' / 'replans.jsonl').read_text()}\n{out[-3000:]}"
    d = decisions[0]
    rows = d["candidates"]["rows"]
    assert d["chosen"] == "rows" and set(d["candidates"]) == {"rows"} and "cpu3" in d["slow_devices"], d
    assert not rows["in_place"] and "between stage 0 and stage 1 was generated without its batch dimensions" \
        in rows["why_not_in_place"], rows
    assert rows["switch_cost_s"] == pytest.approx(0.1) and d["codegen_s"] > 0 and "in_place" not in d
    # the switch restarted the ranks on the new build, from the checkpoint of the switch step
    events = _jsonl(run / "events.jsonl")
    assert [e["event"] for e in events] == ["segment", "switch", "segment", "done"], events
    switch, again = events[1], events[2]
    assert switch["build"] == d["build"] == again["build"] and _step_of(again["resume_from"]) == switch["step"]
    moved = load_plan(run / "seg1" / "plan.json")
    assert moved == load_plan(Path(d["build"]) / "plan.json")
    assert [st.devices for st in moved.stages] == [st.devices for st in plan.stages]
    assert [st.nodes for st in moved.stages] == [st.nodes for st in plan.stages]
    # stage 1's rows moved off the slowed cpu3 (stage 0's too, and cpu2 named as well, where 4 ranks sharing two
    # cores made other devices look slowed: their compute is counted less their waits for a core)
    a, b = moved.stages[1].rows
    assert a + b == 24 and b < a and [list(st.rows) for st in moved.stages] == rows["rows"], d
    assert sum(moved.stages[0].rows) in (0, 24), d
    t = timings(run)
    assert [(x["kind"], x["move"]) for x in t] == [("switch (imbalance)", "rows")] and t[0]["resume_s"] > 0
    # exact across the restart: every loss as the original model's
    want = _original(Path(build), steps)
    first, resumed = _losses(run / "seg0"), _losses(run / "seg1")
    assert sorted(first) == list(range(1, switch["step"] + 1))
    assert sorted(resumed) == list(range(switch["step"] + 1, steps + 1))
    for got in (first, resumed):
        for step in sorted(got):
            assert got[step] == pytest.approx(want[step], **TOL), (step, got, want)


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
    (x, y) = spec.dataset.tensors  # a plain loop over the same global batches
    want, _ = trained_plainly(spec.module, spec.loss_fn, spec.optimizer(spec.module.parameters()),
                              ((x[i], y[i]) for i in (global_batch(ITEMS, BATCH, SEED, s) for s in range(6))))
    for r in reports:
        assert r["losses"] == pytest.approx(want, **TOL), (r["losses"], want)
    # stage 1's replicas (ranks 1, 2) load 2:2, then 3:1, then 1:3 rows of each microbatch; stage 0 (rank 0) all
    assert [[len(x) for x in r["rows"]] for r in reports] == [[8, 8, 8], [4, 6, 2], [4, 2, 6]]
    assert reports[2]["rows"][1] == [3, 7] and reports[1]["rows"][2] == [0, 4]
