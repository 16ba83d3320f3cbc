"""ZeRO on real gloo ranks: each replica holds its share (counted by storage), and trains as plain data parallel.

One spawned job per world size runs every case (starting ranks is the
expensive part). gpt-tiny on one stage replicated over every rank, AdamW
(its two moments are what ZeRO shards), a few steps:

- the bytes a rank holds at its peak (the end of the last backward, just
  before the gradient collectives, with the optimizer state of the previous
  steps alive), counted by :func:`hpml_compile.runtime.observe.held.held_bytes`, are
  what :func:`hpml_compile.stagecost.memory_parts` predicts for the plan's
  ZeRO stage, part by part (to a few bytes of padding and Adam's step counter);
- the losses equal those of the same plan without ZeRO (same seed, same batches);
- under ZeRO-2 only the shard of the gradients is held after the reduce-scatter;
- a checkpoint written under ZeRO-1 on 2 ranks resumes in one process without
  ZeRO, and in a ZeRO-2 run, and both continue as the uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.runtime.execute.checkpoint import latest, load_checkpoint, save_checkpoint
from hpml_compile.runtime.observe.held import held_bytes
from hpml_compile.stagecost import memory_parts
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # gpt-tiny, three builds per spawn: ~1 min on 2 shared cores

STEPS = 4
TOL = 1e-5  # float32 losses near 5, the same sums in another grouping (flat shards)


def _model(world: int) -> models.LoadedModel:
    return models.load("gpt-tiny", batch_size=4 * world, seq_len=16, seed=0)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _batches(rows: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 256, (rows, 16), generator=g) for _ in range(steps)]
    return [(x, torch.roll(x, -1, dims=1)) for x in xs]


def _compile(tmp: Path, world: int, zero: int) -> str:
    loaded = _model(world)
    gm = trace(loaded.module, loaded.example_inputs)
    out = tmp / f"zero{zero}-{world}"
    generate(gm, split_plan(gm, "gpt-tiny", 1, microbatches=2, replicas=[world], zero=zero), out)
    return str(out)


def _train(rank: int, world: int, builds: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for zero, build in sorted(builds.items()):
        loaded = _model(world)
        pipe = Pipeline.from_build(build, loaded.module, optimizer=_optimizer)
        stage = pipe.stages[pipe.stage_index]
        peaks: list[list[int]] = []
        assert pipe.sync is not None
        sync = pipe.sync.reduce

        def measured_sync(comm: Any, params: Any) -> None:  # the peak: every gradient accumulated, state alive
            h = held_bytes(stage, pipe.optimizer)
            peaks.append([h.params, h.grads, h.optimizer])
            sync(comm, params)
            after.append(held_bytes(stage, pipe.optimizer).grads)

        after: list[int] = []
        pipe.sync.reduce = measured_sync  # type: ignore[method-assign]
        losses = [pipe.step((x,), y, loaded.loss_fn).item() for x, y in _batches(4 * world)]
        pipe.sync.reduce = sync  # type: ignore[method-assign]
        report[zero] = {"losses": losses, "peak": peaks[-1], "after_sync": after[-1],
                        "param_bytes": sum(p.numel() * p.element_size() for p in pipe.parameters()),
                        "tensors": len(pipe.parameters())}
        if zero == "1" and world == 2:  # a checkpoint under ZeRO-1, then two more steps
            save_checkpoint(str(Path(out) / "ck"), STEPS, pipe.local_module(), pipe.optimizer)
            more = _batches(4 * world, STEPS + 2)[STEPS:]
            report["continued"] = [pipe.step((x,), y, loaded.loss_fn).item() for x, y in more]
            resumed = _model(world)  # the ZeRO-2 build, loading the ZeRO-1 checkpoint
            again = Pipeline.from_build(builds["2"], resumed.module, optimizer=_optimizer)
            load_checkpoint(latest(str(Path(out) / "ck")), again.local_module(), again.optimizer)
            report["resumed_zero2"] = [again.step((x,), y, resumed.loss_fn).item() for x, y in more]
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def _run(tmp: Path, world: int) -> list[dict[str, Any]]:
    builds = {str(z): _compile(tmp, world, z) for z in (0, 1, 2)}
    spawn_ranks(_train, world, tmp, builds, str(tmp))
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def _check_shares(reports: list[dict[str, Any]], world: int) -> None:
    for r in reports:
        for zero in (0, 1, 2):
            row = r[str(zero)]
            p = row["param_bytes"]
            want = memory_parts(param_bytes=p, activation_bytes=0, input_bytes=0, dtype_bytes=4, replicas=world,
                                zero=zero, microbatches=2)
            params, grads, opt = row["peak"]
            slack = 4 * world + 64  # the flat buffer's padding to d shards; Adam's step counters (4 bytes each)
            assert want.params <= params <= want.params + slack, (zero, row["peak"], want)
            assert want.grads <= grads <= want.grads + slack, (zero, row["peak"], want)
            counters = 4 * (1 if zero else row["tensors"])  # Adam's step: one per parameter it steps
            assert want.optimizer <= opt <= want.optimizer + 2 * slack + counters, (zero, row["peak"], want)
            torch.testing.assert_close(row["losses"], r["0"]["losses"], rtol=0, atol=TOL)
        assert r["1"]["peak"][2] * world <= r["0"]["peak"][2] + 64 * world, "ZeRO-1 holds 1/d of Adam's state"
        assert r["2"]["after_sync"] <= r["2"]["param_bytes"] // world + 4 * world, "ZeRO-2 keeps only its shard"
        assert r["1"]["after_sync"] >= r["1"]["param_bytes"], "ZeRO-1 keeps its flat gradient buffer"


def test_zero_on_two_ranks_holds_its_share_trains_and_resumes(tmp_path: Path) -> None:
    reports = _run(tmp_path, 2)
    _check_shares(reports, 2)
    # resumed under another plan: one process, no replicas, no ZeRO
    loaded = _model(2)
    gm = trace(loaded.module, loaded.example_inputs)
    generate(gm, split_plan(gm, "gpt-tiny", 1, microbatches=2), tmp_path / "one")
    pipe = Pipeline.from_build(tmp_path / "one", loaded.module, optimizer=_optimizer)
    load_checkpoint(latest(str(tmp_path / "ck")), pipe.local_module(), pipe.optimizer)
    more = _batches(8, STEPS + 2)[STEPS:]
    alone = [pipe.step((x,), y, loaded.loss_fn).item() for x, y in more]
    for r in reports:
        torch.testing.assert_close(alone, r["continued"], rtol=0, atol=TOL)
        torch.testing.assert_close(r["resumed_zero2"], r["continued"], rtol=0, atol=TOL)


def test_zero_on_three_ranks_holds_its_share_and_trains(tmp_path: Path) -> None:
    _check_shares(_run(tmp_path, 3), 3)
