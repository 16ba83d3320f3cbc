"""ZeRO-3 on real gloo ranks: the parameters are held as a shard between uses, and it trains as plain data parallel.

One spawned job per world size runs every case. gpt-tiny, AdamW, a few
steps, each ZeRO-3 build beside the same plan without ZeRO (same seed, same
batches):

- the losses of every step, the summed gradient of this replica's shard (first
  step), the model's outputs after training (``eval_forward``) and its
  parameters (``state_dict``) equal the unsharded run's;
- each microbatch's forward and backward gathers the stage once, through the
  rank's communicator;
- between steps a rank holds only its shard of the sharded parameters (their
  module tensors hold 0 bytes) and of the gradients; at the peak its shard plus
  the one gathered unit (the whole stage), which is what
  :func:`hpml_compile.stagecost.memory_parts` predicts for ZeRO-3;
- 2 ranks: a checkpoint saved under ZeRO-3 resumes under ZeRO-3 and, in the
  test process, under a one-process plan without ZeRO, both continuing as the
  uninterrupted run;
- 3 ranks: a two-stage pipeline (stage 0 on two replicas, recomputed, ZeRO-3;
  stage 1 alone) too, so the gather for the backward meets send/recv and a
  recomputed region.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.runtime.observe.held import held_bytes
from hpml_compile.runtime.sync.stage import UNBUFFERED
from hpml_compile.runtime.sync.zero3 import FlatShard3
from hpml_compile.stagecost import memory_parts
from hpml_compile.trace import trace
from test_zero_dist import _batches, _model, _optimizer  # the same gpt-tiny, AdamW and token batches as ZeRO-1/2

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # gpt-tiny, two to four builds per spawn

STEPS = 2
TOL = 1e-5


def _compile(tmp: Path, world: int, name: str, replicas: list[int], zero: int, recompute: tuple[int, ...] = ()
             ) -> str:
    loaded = _model(world)
    gm = trace(loaded.module, loaded.example_inputs)
    out = tmp / f"{name}-{world}"
    generate(gm, split_plan(gm, "gpt-tiny", len(replicas), microbatches=2, replicas=replicas, zero=zero,
                            recompute=recompute), out)
    return str(out)


def _flat_grad(pipe: Pipeline) -> torch.Tensor | None:
    """After the gradient sync, this replica's shard of the summed gradient of the sharded parameters."""
    for b in [pipe.sync.buffer] if pipe.sync is not None else []:
        if isinstance(b, FlatShard3):
            assert b.param.grad is not None
            return b.param.grad.detach().clone()
        if hasattr(b, "grad_flat"):  # ZeRO-0: the whole all-reduced buffer; the caller slices the shard
            return b.grad_flat.detach().clone()
    return None


def _run_build(build: str, world: int, out: str, save: bool) -> dict[str, Any]:
    loaded = _model(world)
    pipe = Pipeline.from_build(build, loaded.module, optimizer=_optimizer)
    stage = pipe.stages[pipe.stage_index]
    grads: list[torch.Tensor | None] = []
    held_after: list[list[int]] = []

    def measured(sync: Any) -> Any:  # the stage's gradient collectives, each followed by a measurement
        def call(*args: Any) -> None:
            sync(*args)
            if not grads:
                grads.append(_flat_grad(pipe))
            h = held_bytes(stage, pipe.optimizer)
            held_after.append([h.params, h.grads])

        return call

    # the replicas' own sync (ZeRO-3 or ZeRO-0), and the tied parameters' all-reduce across stages
    patched = [(pipe.sync, "reduce")] if pipe.sync is not None else []
    patched.append((UNBUFFERED, "run"))
    for obj, name in patched:
        setattr(obj, name, measured(getattr(obj, name)))
    comm_gathers = [0]
    if pipe.comm is not None:  # the communicator's all-gathers (ZeRO-3's gathers go through its transport)
        def counted(*args: Any, _own: Any = pipe.comm.all_gather, **kw: Any) -> Any:
            comm_gathers[0] += 1
            return _own(*args, **kw)

        pipe.comm.all_gather = counted  # type: ignore[method-assign]
        patched.append((pipe.comm, "all_gather"))
    batches = _batches(4 * world, STEPS + 2)
    losses = [pipe.step((x,), y, loaded.loss_fn).item() for x, y in batches[:STEPS]]
    for obj, name in patched:
        delattr(obj, name)  # the class's own again
    between = held_bytes(stage, pipe.optimizer)
    shards = [s for s in pipe._shards if isinstance(s, FlatShard3)]
    tied = {id(p) for j, other in enumerate(pipe.build.stages) if j != pipe.stage_index for p in other.parameters()}
    row: dict[str, Any] = {
        "losses": losses, "grad": grads[0], "replica": pipe.replica, "stage": pipe.stage_index,
        "d": pipe._reps[pipe.stage_index],
        "held_peak": [pipe.held.params, pipe.held.grads] if pipe.held else None, "held_after_sync": held_after[-1],
        "comm_gathers": comm_gathers[0],
        "between": [between.params, between.grads],
        "sharded_bytes": sum(p.numel() * p.element_size() for p in pipe.parameters() if id(p) not in tied),
        "tied_bytes": sum(p.numel() * p.element_size() for p in pipe.parameters() if id(p) in tied),
        "module_bytes": sum(p.untyped_storage().nbytes() for p in stage.parameters() if id(p) not in tied),
        "gathered_bytes": sum(s.gathered_bytes for s in shards), "shard_bytes": sum(
            s.param.numel() * s.param.element_size() for s in shards),
    }
    row["state"] = pipe.state_dict()
    row["eval"] = pipe.eval_forward((batches[0][0],), everywhere=True)
    if save:  # a checkpoint under this plan, then two more steps
        pipe.save(Path(out) / "ck")
        row["continued"] = [pipe.step((x,), y, loaded.loss_fn).item() for x, y in batches[STEPS:]]
        again = Pipeline.from_build(build, _model(world).module, optimizer=_optimizer)
        again.load(Path(out) / "ck")
        row["resumed"] = [again.step((x,), y, loaded.loss_fn).item() for x, y in batches[STEPS:]]
    return row


def _train(rank: int, world: int, pairs: dict[str, tuple[str, str]], out: str) -> None:
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for name, (plain, sharded) in sorted(pairs.items()):
        ref = _run_build(plain, world, out, save=False)
        got = _run_build(sharded, world, out, save=(name == "dp" and world == 2))
        grad_diff = 0.0
        if got["shard_bytes"]:  # the unsharded run's all-reduced buffer, sliced to this replica's shard
            n, r, d = got["grad"].numel(), got["replica"], got["d"]
            want = torch.nn.functional.pad(ref["grad"], (0, n * d - ref["grad"].numel()))[r * n:(r + 1) * n]
            grad_diff = float((got["grad"] - want).abs().max())
        report[name] = {
            "losses": [ref["losses"], got["losses"]],
            "grad_diff": grad_diff,
            "state_diff": max(float((got["state"][k] - v).abs().max()) for k, v in ref["state"].items()),
            "eval_diff": float((got["eval"] - ref["eval"]).abs().max()),
            **{k: got[k] for k in ("held_peak", "held_after_sync", "between", "sharded_bytes", "tied_bytes",
                                   "module_bytes", "gathered_bytes", "shard_bytes", "stage", "continued",
                                   "resumed", "comm_gathers") if k in got},
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def _run(tmp: Path, world: int, pairs: dict[str, tuple[list[int], tuple[int, ...]]]) -> list[dict[str, Any]]:
    builds = {name: (_compile(tmp, world, f"{name}0", reps, 0, rc), _compile(tmp, world, f"{name}3", reps, 3, rc))
              for name, (reps, rc) in pairs.items()}
    spawn_ranks(_train, world, tmp, builds, str(tmp))
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def _check(reports: list[dict[str, Any]], world: int) -> None:
    for rep in reports:
        for name, row in rep.items():
            ref, got = row["losses"]
            torch.testing.assert_close(got, ref, rtol=0, atol=TOL)
            assert row["grad_diff"] <= TOL and row["state_diff"] <= TOL and row["eval_diff"] <= TOL, (name, row)
            if not row["shard_bytes"]:
                continue  # a stage that is not replicated: nothing sharded
            d = world if name == "dp" else 2  # the replicas of the sharded stage
            p, slack = row["sharded_bytes"], 4 * d
            assert row["module_bytes"] == 0, "between uses the module's sharded parameters hold no memory"
            # each microbatch's forward and backward gathered through the communicator (its shared memory between
            # CPU ranks, straight into the flat buffer), none of them through a temporary of the backend's
            assert row["comm_gathers"] == 2 * 2 * STEPS, row["comm_gathers"]
            assert p // d <= row["shard_bytes"] <= p // d + slack
            # between steps: the shard of the parameters (and the tied ones, whole); no gradients left over
            assert row["between"][0] <= row["shard_bytes"] + row["tied_bytes"], row
            assert row["held_after_sync"][1] <= row["shard_bytes"] + 2 * row["tied_bytes"], row
            # at the peak: its share plus the one gathered unit, as the memory model says
            want = memory_parts(param_bytes=p, activation_bytes=0, input_bytes=0, dtype_bytes=4, replicas=d,
                                zero=3, microbatches=2)
            peak = row["held_peak"][0] - row["tied_bytes"]
            assert want.params <= peak <= want.params + 2 * slack, (row["held_peak"], want)
            assert peak <= row["shard_bytes"] + row["gathered_bytes"]


def test_zero3_on_two_ranks_equals_data_parallel_and_resumes(tmp_path: Path) -> None:
    reports = _run(tmp_path, 2, {"dp": ([2], ())})
    _check(reports, 2)
    # the ZeRO-3 checkpoint, resumed under another plan: one process, no replicas, no ZeRO
    loaded = _model(2)
    gm = trace(loaded.module, loaded.example_inputs)
    generate(gm, split_plan(gm, "gpt-tiny", 1, microbatches=2), tmp_path / "one")
    pipe = Pipeline.from_build(tmp_path / "one", loaded.module, optimizer=_optimizer)
    pipe.load(tmp_path / "ck")
    more = _batches(8, STEPS + 2)[STEPS:]
    alone = [pipe.step((x,), y, loaded.loss_fn).item() for x, y in more]
    for r in reports:
        torch.testing.assert_close(r["dp"]["resumed"], r["dp"]["continued"], rtol=0, atol=TOL)
        torch.testing.assert_close(alone, r["dp"]["continued"], rtol=0, atol=TOL)


def test_zero3_on_three_ranks_equals_data_parallel_in_a_pipeline_too(tmp_path: Path) -> None:
    _check(_run(tmp_path, 3, {"dp": ([3], ()), "pipe": ([2, 1], (0,))}), 3)
