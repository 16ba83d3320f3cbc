"""``report`` on a ZeRO-3 run: the parameter all-gathers inside the forward and backward are communication, not compute.

A ZeRO-3 stage gathers its parameters in hooks of its forward and of its
backward, so the executor's forward and backward calls contain those
collectives and the waits for the other replica before them. The plan prices
the gathers with the stage's sync, not with its compute. One stage of
mlp-tiny on two gloo ranks, ZeRO-3, a few steps with a run folder; against the
events the ranks recorded (each forward and backward call, each collective
and its wait, on one clock):

- each step's ``fwd_ms + bwd_ms`` is the forward and backward calls less the
  collectives and waits inside them, and ``inner_comm_ms`` /
  ``inner_wait_ms`` are those collectives and waits;
- the gradient sync (``allreduce_ms``) is not negative: the waits inside the
  compute are not taken off it;
- the report's stage line and its "collectives inside" line say the same.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.runtime.observe.events import read_events
from hpml_compile.runtime.observe.monitor import read_metrics
from hpml_compile.runtime.observe.summary import analyse, format_summary
from hpml_compile.testing import split_plan
from hpml_compile.trace import trace

pytestmark = pytest.mark.dist

STEPS = 3
INSIDE = ("ALLGATHER", "COLL_WAIT")


def _model() -> models.LoadedModel:
    return models.load("mlp-tiny", seed=0)


def _train(rank: int, world: int, build: str, run_dir: str) -> None:
    torch.set_num_threads(1)
    loaded = _model()
    pipe = Pipeline.from_build(build, loaded.module, run_dir=run_dir,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    for _ in range(STEPS):
        pipe.step(loaded.example_inputs, loaded.example_targets, loaded.loss_fn)
    pipe.close()


def _ms(spans: list[dict[str, Any]], kinds: tuple[str, ...]) -> float:
    return sum(e["dur_us"] for e in spans if e["kind"] in kinds) / 1e3


def _inside(spans: list[dict[str, Any]]) -> float:
    """Milliseconds of the collectives and waits that ran inside a forward or backward call."""
    calls = [(e["start"], e["end"]) for e in spans if e["kind"] in ("F", "B")]
    return sum(e["dur_us"] for e in spans if e["kind"] in INSIDE
               and any(a <= e["start"] and e["end"] <= b for a, b in calls)) / 1e3


def test_a_zero3_stages_gathers_count_as_communication_not_compute(tmp_path: Path) -> None:
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    build = tmp_path / "build"
    generate(gm, split_plan(gm, "mlp-tiny", 1, microbatches=2, replicas=[2], zero=3), build)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copyfile(build / "plan.json", run / "plan.json")  # as `hpml-compile run` does
    spawn_ranks(_train, 2, tmp_path, str(build), str(run))

    rows, events = read_metrics(run), read_events(run)
    assert sorted(rows) == [0, 1] and all(len(rs) == STEPS for rs in rows.values())
    for rank, rs in rows.items():
        for m in rs:
            spans = list(events[rank][m.step].spans())
            inside = _inside(spans)
            assert inside > 0 and _ms(spans, ("ALLGATHER",)) > 0  # 2 microbatches: 4 gathers, each with its meeting
            assert m.inner_comm_ms + m.inner_wait_ms == pytest.approx(inside, abs=0.05)
            # the forward and backward calls, less the collectives inside them (events are whole microseconds)
            assert m.fwd_ms + m.bwd_ms == pytest.approx(_ms(spans, ("F", "B")) - inside, abs=0.05)
            assert m.allreduce_ms >= 0 and m.comm_ms >= m.inner_comm_ms
    s = analyse(run, skip=0)
    st = s.stages[0]
    assert st.inner_comm_ms > 0 and st.allreduce_ms >= 0
    text = format_summary(s)
    assert "collectives inside the forward and backward, stage 0 (ZeRO-3's parameter all-gathers" in text, text
