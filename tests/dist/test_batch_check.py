"""Ranks given different batches (a per-rank shard, the natural mistake) fail at once, on every rank, by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.errors import BatchMismatchError
from hpml_compile.plan import Schedule
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.trace import trace

pytestmark = pytest.mark.dist


def _model() -> models.LoadedModel:
    return models.load("gpt-tiny", batch_size=8, seq_len=16, seed=0)


def _worker(rank: int, world: int, builds: list[str], out: str) -> None:
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for build in builds:
        loaded = _model()
        pipe = Pipeline.from_build(build, loaded.module, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        g = torch.Generator().manual_seed(7)
        x = torch.randint(0, 256, (8, 16), generator=g)
        same = pipe.step((x,), torch.roll(x, -1, dims=1), loaded.loss_fn).item()
        before = {k: v.clone() for k, v in pipe.local_module().state_dict().items()}
        mine = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(100 + rank))
        try:
            pipe.step((mine,), torch.roll(mine, -1, dims=1), loaded.loss_fn)
            error = ""
        except BatchMismatchError as e:
            error = str(e)
        after = pipe.local_module().state_dict()
        report[Path(build).name] = {"same": same, "error": error,
                                    "unchanged": all(torch.equal(before[k], after[k]) for k in before)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def test_different_batches_fail_on_every_rank_before_the_optimizer_step(tmp_path: Path) -> None:
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    builds = []
    for name, stages, replicas in (("dp", 1, [2]), ("pipe", 2, None)):
        generate(gm, split_plan(gm, "gpt-tiny", stages, microbatches=2, schedule=Schedule.ONE_F_ONE_B,
                                replicas=replicas), tmp_path / name)
        builds.append(str(tmp_path / name))
    spawn_ranks(_worker, 2, tmp_path, builds, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in reports:
        for name in ("dp", "pipe"):  # replicas would train on half of each; stages would mix two batches
            assert r[name]["same"] > 0 and "the 2 ranks were given different batches" in r[name]["error"], r
            assert r[name]["unchanged"], "the step must fail before the optimizer changes any weight"
