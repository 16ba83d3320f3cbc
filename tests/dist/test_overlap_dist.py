"""Overlapped gradient buckets on real gloo ranks: launched during the last backward; trains as the original.

One spawned job of 3 ranks runs every case: gpt-tiny (tied embedding and
output weights) cut into 2 stages, stage 0 replicated twice and stage 1 once,
3 microbatches, small buckets (many of them), ZeRO 0, 1 and 2. So stage 0's
gradients are synced by overlapped bucket collectives on its 2-rank group
while the tied weight is all-reduced over all 3 ranks by the other path.
Each rank checks, after a few SGD steps:

- its stage's parameters equal the original model trained in one process
  on the same batches (transparency, through accumulation over microbatches);
- on stage 0, there is more than one bucket, the hooks launched every bucket
  during the backward (none left to the collective after it), and launched some while
  other gradients were still to come: all but the last under ZeRO-0, at least
  one under ZeRO-1/2 (a bucket spans every replica's shard). A bucket launched
  before the last microbatch's backward would miss the later microbatches'
  gradients, which the first check sees;
- the path without overlap (``overlap=False``: one collective after the whole
  backward), for ZeRO-0 and ZeRO-1, trains as the original too;
- left to the plan (``overlap=None``), these CPU ranks sync after the backward
  (no buckets), as :func:`hpml_compile.plan.sync_overlap` says and the cost
  model prices; the overlapped cases above force the buckets on
  (``overlap=True``) to test that path here.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # 3 ranks, 5 pipelines of gpt-tiny on 2 shared cores

STEPS = 3
MICRO = 3
ROWS = 12  # 3 microbatches of 4 rows, 2 rows per replica of stage 0
TOL = 1e-5
# (zero, overlap): True forces the buckets on (the plan would not: these ranks are CPUs), False off, None
# follows the plan (plan.sync_overlap: 0 on CPU ranks, so no buckets)
CASES = [("0", True), ("1", True), ("2", True), ("0", False), ("1", False), ("0", None)]
BUCKET_MB = 0.05  # ~52 KB buckets: gpt-tiny's 474 KB of gradients in ~9 of them


def _model() -> models.LoadedModel:
    return models.load("gpt-tiny", batch_size=ROWS, seq_len=16, seed=0)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    # SGD: a parameter's error is the gradient's (Adam's normalisation blows float noise up where a gradient is ~0)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    xs = [torch.randint(0, 256, (ROWS, 16), generator=g) for _ in range(STEPS)]
    return [(x, torch.roll(x, -1, dims=1)) for x in xs]


def _compile(tmp: Path, zero: int) -> str:
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    out = tmp / f"zero{zero}"
    generate(gm, split_plan(gm, "gpt-tiny", 2, microbatches=MICRO, replicas=[2, 1], zero=zero), out)
    return str(out)


def _train(rank: int, world: int, builds: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    ref = _model()
    ref_opt = _optimizer(ref.module.parameters())
    after_two: dict[str, torch.Tensor] = {}
    eval_last = 0.0
    for i, (x, y) in enumerate(_batches()):
        ref_opt.zero_grad()
        ref.loss_fn(ref.module(x), y).backward()
        ref_opt.step()
        if i == 1:
            after_two = {n: p.detach().clone() for n, p in ref.module.state_dict().items()}
        if i == STEPS - 1:
            ref.module.eval()
            with torch.no_grad():
                eval_last = float(ref.loss_fn(ref.module(x), y))
            ref.module.train()
    want = dict(ref.module.named_parameters())
    for zero, overlap in CASES:
        build = builds[zero]
        loaded = _model()
        pipe = Pipeline.from_build(build, loaded.module, optimizer=_optimizer, overlap=overlap,
                                   bucket_mb=BUCKET_MB, events=False)
        launches: list[tuple[int, int]] = []
        buckets = pipe.sync.buffer if pipe.sync is not None else None
        grad_buckets = getattr(buckets, "buckets", None)
        pending, sd_diff, eval_diff, train_waits, user_diff = [], 0.0, 0.0, 0, 0.0
        for i, (x, y) in enumerate(_batches()):
            pipe.step((x,), y, loaded.loss_fn)
            if grad_buckets is not None:
                launches.append((grad_buckets.launched_in_backward, grad_buckets.launched_early))
            pending.append(len(getattr(buckets, "_gathers", ())))  # prefetched gathers in flight after the step
            if i == 1:
                train_waits = getattr(buckets, "prefetched", 0)  # step 1's gathers, waited by step 2's forward
                # the user's own model's state dict with step 2's gathers in flight (its pre-hook waits for them)
                mine_sd = {id(p) for p in pipe.parameters()}
                usd = loaded.module.state_dict(keep_vars=True)
                user_diff = max((usd[n].detach() - after_two[n]).abs().max().item() for n in after_two
                                if id(usd[n]) in mine_sd)
                # the state dict (as a checkpoint reads it) with step 2's gathers in flight: the new parameters
                sd = pipe.state_dict()
                sd_diff = max((sd[n] - v).abs().max().item() for n, v in after_two.items())
            if i == STEPS - 1:  # an eval forward after a step, its gathers in flight: its hooks wait for them
                eval_diff = abs(pipe.eval_loss((x,), y, loaded.loss_fn) - eval_last)
        forward_waits = getattr(buckets, "prefetched", 0)
        pipe.settle()  # read the parameters directly below: the last step's gathers first
        mine = {id(p) for p in pipe.parameters()}
        diff = max((p.detach() - want[n].detach()).abs().max().item()
                   for n, p in loaded.module.named_parameters() if id(p) in mine)
        report[f"{zero}-{overlap}"] = {
            "stage": pipe.stage_index, "diff": diff, "launched_in_backward": launches,
            "buckets": len(grad_buckets.members) if grad_buckets is not None else 0,
            "pending": pending, "train_waits": train_waits, "forward_waits": forward_waits, "sd_diff": sd_diff, "user_diff": user_diff,
            "eval_diff": eval_diff}
        pipe.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def test_overlapped_buckets_train_as_the_original_with_microbatches_ties_and_zero(tmp_path: Path) -> None:
    builds = {str(z): _compile(tmp_path, z) for z in (0, 1, 2)}
    spawn_ranks(_train, 3, tmp_path, builds, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for rank, rep in enumerate(reports):
        for key, row in rep.items():
            assert row["diff"] < TOL, (rank, key, row["diff"])
            assert row["sd_diff"] < TOL and row["eval_diff"] < TOL and row["user_diff"] < TOL, (rank, key, row)  # mid-run readers see the step
            zero, overlap = key.split("-")
            if row["stage"] == 0 and overlap == "True" and zero in "12":
                # ZeRO-1/2 overlapped: every bucket's parameter all-gather left in flight by the step (prefetched),
                # and the next forward's hooks waited for them (none left to settle() but the last step's)
                assert row["pending"] == [row["buckets"]] * STEPS, (rank, key, row)
                assert row["train_waits"] == row["buckets"], (rank, key, row)  # by the training forward
                assert row["forward_waits"] == 2 * row["buckets"], (rank, key, row)  # and by the eval forward
            else:
                assert set(row["pending"]) == {0} and row["forward_waits"] == 0, (rank, key, row)
            if row["stage"] == 0 and overlap == "True":
                assert row["buckets"] > 1, (rank, key, row)
                # launched by the hooks during the backward, every one; and while gradients were still to come
                # (overlapped): all but the last under ZeRO-0 (buckets in reverse order of use), at least one
                # under ZeRO-1/2 (a bucket spans every replica's shard: ready from the middle of the backward on)
                early = row["buckets"] - 1 if zero == "0" else 1
                assert all(n == row["buckets"] and e >= early for n, e in row["launched_in_backward"]), \
                    (rank, key, row["launched_in_backward"], row["buckets"])
            else:  # no overlap asked, the plan's rule on CPU ranks, or a stage of one replica: nothing to bucket
                assert row["buckets"] == 0, (rank, key, row)
