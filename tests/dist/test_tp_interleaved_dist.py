"""Interleaved 1F1B with tensor-parallel chunks on gloo ranks equals the model trained in one process.

gpt-mini on 4 ranks: 2 device groups of tp 2, each holding 2 chunks (stages 0 and 2 on ranks 0-1, stages 1 and 3
on ranks 2-3), 4 microbatches. Each rank slices the sharded layers of both its chunks over its one
tensor-parallel group; the embedding (stage 0) and the LM head tied to it (stage 3) are split by vocabulary on
different device groups and summed by the tied all-reduce. Then a group of tp 2 beside a group of 2 replicas
of tp 1. Three AdamW steps: the loss of every step, every
gradient of the rank's chunks (a slice against the same slice of the eager gradient) and every parameter after
the steps (the state dict, gathered whole) equal eager's within 1e-5 (float32). A checkpoint written then (each
chunk's slices made whole, Adam's moments too) loads into a new job of the same build, whose fourth step equals
eager's fourth.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.plan import Schedule
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.testing import split_plan
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # one 4-rank spawn of gpt-mini

STEPS = 3
TOL = 1e-5
ROWS, SEQ, MICRO = 8, 16, 4


def _model() -> models.LoadedModel:
    return models.load("gpt-mini", batch_size=ROWS, seq_len=SEQ, seed=0)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    # eps bounds the move of a parameter whose gradient is near zero, where two summation orders differ in
    # its last bits (AdamW divides each gradient by its own size)
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5)


def _batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, vocab, (ROWS, SEQ), generator=g) for _ in range(STEPS + 1)]
    return [(x, torch.roll(x, -1, dims=1)) for x in xs]


def _vocab(module: torch.nn.Module) -> int:
    wte = module.get_submodule("wte")
    assert isinstance(wte, torch.nn.Embedding)
    return wte.num_embeddings


def _reference() -> tuple[list[float], list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Eager's loss and gradients of each step, and its state after the third and the fourth."""
    loaded = _model()
    opt = _optimizer(loaded.module.parameters())
    losses, grads, states = [], [], []
    for x, y in _batches(_vocab(loaded.module)):
        opt.zero_grad()
        loss = loaded.loss_fn(loaded.module(x), y)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in loaded.module.named_parameters() if p.grad is not None})
        opt.step()
        losses.append(loss.item())
        states.append({k: v.detach().clone() for k, v in loaded.module.state_dict().items()})
    return losses, grads, states[STEPS - 1:]


def _worker(rank: int, world: int, builds: list[str], tmp: str) -> None:
    torch.set_num_threads(1)
    dist.barrier()  # every rank joined the spawn's group before any leaves it
    dist.destroy_process_group()  # tensor-parallel ranks form their own groups
    report = {build: _case(rank, world, build, str(Path(build).parent)) for build in builds}
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(report))


def _case(rank: int, world: int, build: str, tmp: str) -> dict[str, Any]:
    """Three steps of ``build`` against eager, then a checkpoint resumed for a fourth."""
    loaded = _model()
    init = f"file://{tmp}/rendezvous?rank={rank}&world_size={world}"
    pipe = Pipeline.from_build(build, loaded.module, init_method=init, optimizer=_optimizer, events=False)
    ref_losses, ref_grads, (ref_state, ref_after) = _reference()
    batches = _batches(_vocab(loaded.module))
    sliced: dict[int, tuple[int, Any]] = {}
    for k in pipe.stages:
        st = pipe.build.stages[k]
        if st.hpml_tp is not None:
            sliced.update({id(loaded.module.get_parameter(n)): (d, st.hpml_tp) for n, d in st.TP_SHARDS})
    losses, grad, checked = [], 0.0, 0
    for (x, y), ref in zip(batches[:STEPS], ref_grads):
        losses.append(pipe.step((x,), y, loaded.loss_fn).item())
        for name, p in loaded.module.named_parameters():
            if p.grad is None:
                continue
            want = ref[name]
            if id(p) in sliced:
                dim, group = sliced[id(p)]
                want = want.chunk(group.size, dim=dim)[group.rank]
            grad = max(grad, (p.grad - want).abs().max().item())
            checked += 1
    state = pipe.state_dict()
    pipe.save(Path(tmp, "checkpoint"))
    pipe.close()
    again = _model()
    resumed = Pipeline.from_build(build, again.module, init_method=f"file://{tmp}/rendezvous-2?rank={rank}&world_size"
                                  f"={world}", optimizer=_optimizer, events=False)
    resumed.load(Path(tmp, "checkpoint"))
    (x, y) = batches[STEPS]
    after_loss = abs(resumed.step((x,), y, again.loss_fn).item() - ref_losses[STEPS])
    after = resumed.state_dict()
    resumed.close()
    report = {"stages": sorted(pipe.stages), "sliced": len(sliced), "checked": checked,
              "shards": [len(pipe.build.stages[k].TP_SHARDS) for k in sorted(pipe.stages)],
              "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "grad": grad,
              "keys": sorted(state) == sorted(ref_state),
              "state": max((state[k] - v).abs().max().item() for k, v in ref_state.items()),
              "moved": max((ref_state[k] - v).abs().max().item() for k, v in _model().module.state_dict().items()),
              "resumed": max(after_loss, *((after[k] - v).abs().max().item() for k, v in ref_after.items()))}
    return report


def _build(tmp: Path, name: str, tps: tuple[int, int], after: list[str]) -> str:
    """gpt-mini on 2 device groups of 2 ranks (``tps[g]`` their degree, the rest replicas), 2 chunks each."""
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    plan = split_plan(gm, "gpt-mini", 4, microbatches=MICRO, replicas=[2, 2], schedule=Schedule.INTERLEAVED,
                      chunks=2, after=after)
    plan = replace(plan, stages=tuple(replace(st, tp=tps[st.index % 2]) for st in plan.stages))
    (tmp / name).mkdir()
    generate(gm, plan, tmp / name / "build")
    return str(tmp / name / "build")


def test_tensor_parallel_chunks_of_an_interleaved_plan_equal_eager(tmp_path: Path) -> None:
    builds = [
        # cut between blocks (a tensor-parallel stage holds each sharded block whole): every chunk has blocks,
        # the embedding (stage 0) and the head tied to it (stage 3) split by vocabulary on different groups
        _build(tmp_path, "tp2", (2, 2), ["add_2", "add_6", "add_10"]),
        # tp 2 beside 2 replicas of tp 1 (boundaries between degrees both ways, the wrap included, and the
        # replicas' gradient all-reduce per chunk); the tied head in stage 2, so both uses are on the tp-2 group
        _build(tmp_path, "mixed", (2, 1), ["add_2", "add_6", "lm_head"]),
    ]
    spawn_ranks(_worker, 4, tmp_path, builds, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for build in builds:
        assert [r[build]["stages"] for r in reports] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    for r in (rank[build] for rank in reports for build in builds):
        assert r["moved"] > 1e-4, ("the reference must move its parameters", r)
        assert r["checked"] > 0, r
        assert r["loss"] < TOL and r["grad"] < TOL, r
        assert r["keys"] and r["state"] < TOL, r
        assert r["resumed"] < TOL, r
    tp2, mixed = ([rank[b] for rank in reports] for b in builds)
    assert all(n > 0 for r in tp2 for n in r["shards"]) and all(r["sliced"] > 0 for r in tp2)
    assert [r["sliced"] > 0 for r in mixed] == [True, True, False, False]
