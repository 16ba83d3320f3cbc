"""What ranks hold against what the plan predicts (ZeRO-0: a 2-stage pipeline, and one stage on 2 replicas).

Per device and per part: parameters, gradients and optimizer state counted by
storage after AdamW steps (:mod:`hpml_compile.runtime.observe.held`), activations
saved for backward at their peak (:mod:`hpml_compile.saved`), against
:func:`hpml_compile.plan.stage_breakdown`. benchmarks/memory_truth does the
same for every memory option and two models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hpml_compile import models, profile
from hpml_compile.codegen import generate
from hpml_compile.runtime.sync import stage as stage_sync
from hpml_compile.testing import split_plan
from hpml_compile.plan import Schedule, load_plan, stage_breakdown
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.trace import trace

pytestmark = pytest.mark.dist


def _model() -> models.LoadedModel:
    return models.load("gpt-tiny", seed=0)


def _worker(rank: int, world: int, builds: list[str], out: str) -> None:
    report: dict[str, Any] = {}
    for build in builds:
        loaded = _model()
        pipe = Pipeline.from_build(build, loaded.module, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        for _ in range(2):
            pipe.step(loaded.example_inputs, loaded.example_targets, loaded.loss_fn)
        h = pipe.held
        assert h is not None
        # the flat buffer the gradients of parameters tied to another stage are all-reduced through
        mine = {id(p) for p in pipe.parameters()}
        tied = sum(b.untyped_storage().nbytes() for k, b in stage_sync._BUFFERS.items() if set(k) & mine)
        report[Path(build).name] = {"stage": pipe.stage_index, "params": h.params, "grads": h.grads + tied,
                                    "optimizer": h.optimizer, "n_params": len(pipe.parameters()),
                                    "activations": max(m.held_activation_bytes for m in pipe.metrics),
                                    "held_bytes": pipe.metrics[-1].held_bytes, "tied": tied}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def test_held_bytes_match_the_prediction_at_zero0(tmp_path: Path) -> None:
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    prof = profile(loaded.module, loaded.example_inputs, name="gpt-tiny", repeats=1, warmup=0, progress=False,
                   loss_fn=loaded.loss_fn, targets=loaded.example_targets)
    builds = []
    for name, stages, replicas in (("pipe", 2, None), ("dp", 1, [2])):
        generate(gm, split_plan(gm, "gpt-tiny", stages, microbatches=2, schedule=Schedule.ONE_F_ONE_B,
                                replicas=replicas), tmp_path / name, profile=prof)
        builds.append(str(tmp_path / name))
    spawn_ranks(_worker, 2, tmp_path, builds, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name in ("pipe", "dp"):
        plan = load_plan(tmp_path / name / "plan.json")
        for r in reports:
            got = r[name]
            want = stage_breakdown(plan, prof, plan.stages[got["stage"]])
            assert got["params"] == want.params and got["grads"] == want.grads, (name, got, want)
            # Adam's two moments as predicted, plus its step counter (one 4-byte tensor per parameter)
            assert got["optimizer"] == want.optimizer + 4 * got["n_params"], (name, got, want)
            # within 5% above (the loss's own saved tensors), and over by at most what the profile counts twice (a
            # tensor several nodes save, e.g. the input of the q, k and v projections, is one storage)
            assert 0.7 * want.activations <= got["activations"] <= 1.05 * want.activations, (name, got, want)
            assert got["held_bytes"] == got["params"] + got["grads"] - got["tied"] + got["optimizer"] + got["activations"]
