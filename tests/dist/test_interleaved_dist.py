"""Interleaved 1F1B on gloo ranks: three AdamW steps on 2 device groups x 2 chunks equal the model trained in one
process.

gpt-tiny (its embedding tied to the head: stage 0 on rank 0 and stage 3 on rank 1, summed by the tied all-reduce;
and cut so that both uses are stages of rank 0) at 4 microbatches on 2 ranks, each rank running two stages from
its one lowered list: the loss of every step, every gradient of the rank's stages after the last step and the
parameters after it equal the reference's (float32, 1e-5), and every receive of a step was posted ahead of its
token. A checkpoint written under the interleaved plan resumes under a plain 1F1B plan of the same model, and one
written there resumes under the interleaved plan: the step after each equals the reference's.
Then the first device group on two replicas under ZeRO-1, and under ZeRO-3 (3 ranks): both of its stages shard
their optimizer (and under ZeRO-3 their parameters) over the group, the losses and the gathered parameters equal
the reference's, and the ZeRO-1 checkpoints (the optimizer's shards made whole by name) resume across the plans
as above. One spawn per world size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.plan import Schedule
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.schedule import ActionKind, parse_actions
from hpml_compile.testing import split_plan
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # gpt-tiny, two spawns: ~40 s on 2 shared cores

STEPS = 3
TOL = 1e-5


def _model() -> models.LoadedModel:
    return models.load("gpt-tiny", batch_size=8, seq_len=16, seed=0)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 256, (8, 16), generator=g) for _ in range(n)]
    return [(x, torch.roll(x, -1, dims=1)) for x in xs]


def _compile(tmp: Path, name: str, chunks: int, replicas: list[int] | None = None, zero: int = 0,
             after: list[str] | None = None) -> str:
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    schedule = Schedule.INTERLEAVED if chunks > 1 else Schedule.ONE_F_ONE_B
    plan = split_plan(gm, "gpt-tiny", 2 * chunks, microbatches=4, schedule=schedule, replicas=replicas, zero=zero,
                      chunks=chunks, after=after)
    generate(gm, plan, tmp / name)
    return str(tmp / name)


class _Reference:
    """The model trained in one process, step by step beside the pipeline."""

    def __init__(self) -> None:
        self.loaded = _model()
        self.opt = _optimizer(self.loaded.module.parameters())
        self.grads: dict[str, torch.Tensor] = {}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.zero_grad()
        loss = self.loaded.loss_fn(self.loaded.module(x), y)
        loss.backward()
        self.grads = {n: p.grad.clone() for n, p in self.loaded.module.named_parameters() if p.grad is not None}
        self.opt.step()
        return loss.item()


def _diff(state: dict[str, torch.Tensor], ref: _Reference) -> float:
    return max((state[k] - v).abs().max().item() for k, v in ref.loaded.module.state_dict().items())


def _train(build: str, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    loaded, ref = _model(), _Reference()
    pipe = Pipeline.from_build(build, loaded.module, optimizer=_optimizer)
    loss = 0.0
    for x, y in batches:
        got = pipe.step((x,), y, loaded.loss_fn).item()
        loss = max(loss, abs(got - ref.step(x, y)))
    mine = {n: p for n, p in loaded.module.named_parameters() if p.grad is not None}
    grad = max((p.grad - ref.grads[n]).abs().max().item() for n, p in mine.items()) if mine else 0.0
    stats = pipe.comm.stats  # the last step's
    return {"loss": loss, "grad": grad, "grads": len(mine), "stages": sorted(pipe.stages),
            "state": _diff(pipe.state_dict(), ref), "received": [len(stats.recv_s), stats.early_received]}


def _resume(first: str, then: str, root: Path) -> dict[str, Any]:
    """Two steps under ``first``, a checkpoint, then its third step under ``then`` resumed from it."""
    batches = _batches(STEPS)
    loaded, ref = _model(), _Reference()
    pipe = Pipeline.from_build(first, loaded.module, optimizer=_optimizer)
    for x, y in batches[:2]:
        pipe.step((x,), y, loaded.loss_fn)
        ref.step(x, y)
    pipe.save(root)
    again = _model()
    resumed = Pipeline.from_build(then, again.module, optimizer=_optimizer)
    resumed.load(root)
    x, y = batches[2]
    got = resumed.step((x,), y, again.loss_fn).item()
    return {"loss": abs(got - ref.step(x, y)), "state": _diff(resumed.state_dict(), ref)}


def _worker(rank: int, world: int, builds: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    if world == 2:
        report["ilv"] = _train(builds["ilv"], _batches(STEPS))
        report["tie-one-rank"] = _train(builds["tie-one-rank"], _batches(STEPS))
        report["to-plain"] = _resume(builds["ilv"], builds["plain"], Path(out, "ck-a"))
        report["to-ilv"] = _resume(builds["plain"], builds["ilv"], Path(out, "ck-b"))
    else:
        report["zero1"] = _train(builds["zero1"], _batches(STEPS))
        report["zero3"] = _train(builds["zero3"], _batches(STEPS))
        report["to-plain"] = _resume(builds["zero1"], builds["plain-zero1"], Path(out, "ck-a"))
        report["to-ilv"] = _resume(builds["plain-zero1"], builds["zero1"], Path(out, "ck-b"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def _run(tmp: Path, world: int, builds: dict[str, str]) -> list[dict[str, Any]]:
    spawn_ranks(_worker, world, tmp, builds, str(tmp))
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def test_interleaved_on_two_ranks_with_a_tied_embedding_and_checkpoints_across_plans(tmp_path: Path) -> None:
    builds = {"ilv": _compile(tmp_path, "ilv", 2), "plain": _compile(tmp_path, "plain", 1),
              # the head (tied to the embedding of stage 0) in stage 2: both uses on rank 0, stage 3 the output alone
              "tie-one-rank": _compile(tmp_path, "tie-one-rank", 2, after=["add", "add_2", "lm_head"])}
    manifest = json.loads((tmp_path / "ilv" / "manifest.json").read_text())
    lists = parse_actions([r["actions"] for r in manifest["ranks"]])
    assert [sorted({a.stage for a in acts if a.kind is ActionKind.FORWARD}) for acts in lists] == [[0, 2], [1, 3]]
    wrap = [a for a in lists[1] if a.kind is ActionKind.SEND and a.stages == (1, 2)]
    assert len(wrap) == 4  # the last group's chunk 0 sends every microbatch back to the first group's chunk 1
    reports = _run(tmp_path, 2, builds)
    assert [r["ilv"]["stages"] for r in reports] == [[0, 2], [1, 3]]
    for r in reports:
        for row in (r["ilv"], r["tie-one-rank"]):
            assert row["loss"] < TOL and row["state"] < TOL, row
            assert row["grads"] > 0 and row["grad"] < TOL, row
            # every receive of the step was posted ahead of its token (gloo's loop does not spin on a late one)
            assert row["received"][0] > 0 and row["received"][1] == row["received"][0], row
        for case in ("to-plain", "to-ilv"):
            assert r[case]["loss"] < TOL and r[case]["state"] < TOL, (case, r[case])


def test_interleaved_with_zero1_and_zero3_replicas(tmp_path: Path) -> None:
    builds = {"zero1": _compile(tmp_path, "zero1", 2, replicas=[2, 1], zero=1),
              "zero3": _compile(tmp_path, "zero3", 2, replicas=[2, 1], zero=3),
              "plain-zero1": _compile(tmp_path, "plain-zero1", 1, replicas=[2, 1], zero=1)}
    reports = _run(tmp_path, 3, builds)
    assert [r["zero1"]["stages"] for r in reports] == [[0, 2], [0, 2], [1, 3]]
    for r in reports:  # replicas of the first group: the second group's messages split between them, posted ahead
        assert r["zero1"]["received"][0] > 0 and r["zero1"]["received"][1] == r["zero1"]["received"][0], r["zero1"]
    for r in reports:
        for row in (r["zero1"], r["zero3"], r["to-plain"], r["to-ilv"]):
            assert row["loss"] < TOL and row["state"] < TOL, row
