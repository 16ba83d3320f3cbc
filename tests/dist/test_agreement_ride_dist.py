"""Plain data parallelism meets once a step: the loss agreement rides the gradient collective.

Where the plan's one stage spans every rank, the loss agreement's vector (the loss sum, the batch check's count,
hash and squared hash) is the gradient collective's meeting instead of an all-reduce of its own at ``LOSS``
(:mod:`hpml_compile.runtime.execute.batchcheck`). Two gloo ranks, SkipNet, one stage replicated twice: ZeRO-0
through gloo (small gradients: the vector and the gradients summed as ONE float64 all-reduce), ZeRO-0 through
shared memory (the meeting is the host's first barrier) and ZeRO-1 (the first barrier of its reduce-scatter).
Each step's ``torch.distributed.all_reduce`` calls are recorded as they run (the real collectives, counted on
their way): one float64 vector of four (through gloo: four plus the gradients), and no other meeting; the losses
and parameters equal the one-process run's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.testing import (replicated_skipnet_builds, seeded_skipnet, skipnet_batches, skipnet_loss,
                                  skipnet_sgd, trained_skipnet)

pytestmark = [pytest.mark.dist]

STEPS, MICRO, ROWS, TOL = 3, 2, 8, 1e-5


def _train(rank: int, world: int, builds: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    real = dist.all_reduce
    calls: list[tuple[str, int]] = []
    wires: list[int] = []  # where each float64 all-reduce of more than the vector sums

    def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((str(t.dtype), t.numel()))
        if t.dtype == torch.float64 and t.numel() > 4:
            wires.append(t.data_ptr())
        return real(t, *args, **kwargs)

    report = {}
    dist.all_reduce = counted  # type: ignore[assignment]
    try:
        for case, build in (("zero0", builds["zero0"]), ("zero0-shm", builds["zero0"]), ("zero1", builds["zero1"])):
            model = seeded_skipnet()
            pipe = Pipeline.from_build(build, model, optimizer=skipnet_sgd, events=False)
            if case.endswith("shm"):
                assert pipe.comm is not None
                pipe.comm.direct_bytes = 0  # every all-reduce through the host's shared memory
            steps, losses = [], []
            wires.clear()
            for x, y in skipnet_batches(STEPS, ROWS):
                calls.clear()
                losses.append(float(pipe.step((x,), y, skipnet_loss)))
                steps.append(list(calls))
                host = pipe.comm.host_reduce((0,)) if case.endswith("shm") and pipe.comm is not None else None
                if host is not None:  # made at the first step: its own algorithm from here on, small as they are
                    host.direct_bytes = 0
            mine = {id(p) for p in pipe.parameters()}
            report[case] = {"losses": losses, "calls": steps, "wires": list(wires),
                            "held_grads": [m.held_grads_bytes for m in pipe.metrics],
                            "final": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()
                                      if id(p) in mine}}
            pipe.close()
    finally:
        dist.all_reduce = real  # type: ignore[assignment]
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def test_one_stage_data_parallel_meets_once_a_step_and_trains_as_one_process(tmp_path: Path) -> None:
    builds = {f"zero{z}": b for z, b in replicated_skipnet_builds(tmp_path, (0, 1), microbatches=MICRO,
                                                                     rows=ROWS).items()}
    spawn_ranks(_train, 2, tmp_path, builds, str(tmp_path), timeout_s=300)
    losses, params = trained_skipnet(STEPS, ROWS)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(reports):
        for case, row in report.items():
            where = (case, rank)
            assert row["losses"] == pytest.approx(losses, abs=TOL), (where, row["losses"], losses)
            for name, got in row["final"].items():
                assert torch.allclose(torch.tensor(got), torch.tensor(params[name]), atol=TOL), (where, name)
            n = len(sum(row["final"].values(), []))
            # the gradients as held at their peak, whole before any sync (ZeRO-1 frees them in its reduce-scatter,
            # ZeRO-0 keeps its buffer to the step's end): counted on the steps that count memory, kept after
            assert all(g >= 4 * n for g in row["held_grads"]), (where, row["held_grads"], 4 * n)
            for calls in row["calls"][1:]:  # after the first step (which sets up buffers and mappings)
                if case == "zero0":  # through gloo, small: ONE float64 all-reduce, the vector then the gradients
                    assert calls == [["torch.float64", 4 + n]], (where, calls)
                    assert len(set(row["wires"])) == 1, (where, row["wires"])  # one wire, written each step
                    continue
                # the agreement once, as the gradient collective's meeting (the step's first call): no meeting
                # before it and no all-reduce of its own at LOSS
                assert calls[0] == ["torch.float64", 4] and calls.count(calls[0]) == 1, (where, calls)
                # through the shared mapping (ZeRO-1's reduce-scatter and all-gather too): its own barriers
                assert all(c == ["torch.float32", 1] for c in calls[1:]), (where, calls)
    assert reports[0]["zero0"]["losses"] == reports[1]["zero0"]["losses"]  # the committed loss, bit for bit
