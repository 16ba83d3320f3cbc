"""``hpml-compile run --adapt`` on one host: a lost replica is answered without a restart.

The supervisor starts the ranks itself (:mod:`hpml_compile.runtime.job.hostranks`),
so torchrun's agent does not stop the others when one dies. ``mlp-tiny`` as one
stage on 3 replicas; ``--kill-at`` ends replica 1 at step ``KILL``. Checked: the
job ran as one segment (no restart, no checkpoint read), the survivors said they
went on without it and ran the failed step again, the job's events record the
loss with no step lost, every loss of the run equals the model trained plainly
in this process on the same batch (the gradient is the batch mean whatever the
rows, so an uninterrupted run that switched to the survivors' rows at ``KILL``
computes the same values), no process is left, and the segment's report
summarises the survivors' steps from the failed one on, on the replicas left.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpml_compile import models
from hpml_compile.cli import main
from hpml_compile.runtime.observe.monitor import read_metrics
from hpml_compile.runtime.observe.summary import analyse, format_summary
from hpml_compile.testing import one_replicated_stage, process_gone, trained_plainly

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.filterwarnings("ignore:.*took:UserWarning")]
STEPS, KILL, VICTIM, BATCH = 7, 4, 1, 12


def _three_replicas(tmp: Path) -> Path:
    """mlp-tiny as one stage replicated on cpu0..cpu2 (compiled, then rebuilt on that plan)."""
    first = tmp / "compiled"
    assert main(["compile", "mlp-tiny", "--cluster", "local-cpu-3", "--solver", "uniform", "--repeats", "1",
                 "--microbatches", "1", "--batch-size", str(BATCH), "--no-measure-links", "-o", str(first)]) == 0
    return one_replicated_stage(first, tmp / "b")


def test_a_lost_replica_goes_on_in_the_same_processes_with_equal_losses(tmp_path: Path) -> None:
    build = _three_replicas(tmp_path)
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "hpml_compile", "run", str(build), "--steps", str(STEPS), "--adapt",
                        "--no-replan-on-imbalance", "--kill-at", f"{KILL}:{VICTIM}", "--retries", "2",
                        "--run-dir", str(run), "--no-tensorboard", "--no-report"],
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["segment", "replica_lost", "done"], events  # one segment: no restart
    lost = events[1]
    assert (lost["device"], lost["step"], lost["exit_code"]) == (f"cpu{VICTIM}", KILL, 137)
    assert lost["resumed_at"] is not None and lost["resumed_at"] >= lost["died_at"]
    for survivor in (0, 2):
        assert f"rank {survivor}: step {KILL}: ranks [{VICTIM}] of the job died; going on without them" in out
    assert "the step runs again: stage 0 on cpu0,cpu2 rows 6:6" in out
    assert "resumed from" not in out and "no step lost" in out
    rows = read_metrics(run / "seg0")
    assert len(rows[VICTIM]) == KILL - 1
    got = {s: [m.loss for m in rows[s]] for s in (0, 2)}
    assert all(len(v) == STEPS for v in got.values()), got  # every step once, in the processes that started
    ld = models.load("mlp-tiny", batch_size=BATCH, seed=0)
    x, = ld.example_inputs
    want, _ = trained_plainly(ld.module, ld.loss_fn, torch.optim.AdamW(ld.module.parameters(), lr=1e-3),
                              [(x, ld.example_targets)] * STEPS)
    for s, losses in got.items():
        assert losses == pytest.approx(want, rel=1e-5, abs=1e-6), (s, losses, want)
    assert all(process_gone(pid) for pid in lost["pids"]), "a rank outlived the job"
    # the report counts the survivors' steps after the loss (not every rank cut at the lost one's last step)
    summary = analyse(run / "seg0")
    assert [st.devices for st in summary.stages] == [("cpu0", "cpu2")] and summary.steps == STEPS - KILL + 1
    assert f"since step {KILL}, when cpu{VICTIM} was lost in place" in format_summary(summary)
