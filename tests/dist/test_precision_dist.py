"""Mixed precision on 2 gloo ranks: a bf16 pipeline trains as the bf16-autocast eager model does, sends half
the bytes, keeps fp32 master weights; an fp16 overflow on one stage skips the step on every stage together.

One spawned job checks everything (two builds of gpt-tiny, two stages each).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.plan import Schedule
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.runtime.execute.scaler import LossScaler
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # bf16 matmuls are emulated on most CPUs: ~1.5 min here

STEPS, LR, B, T = 20, 2e-3, 8, 8


def _model() -> models.LoadedModel:
    return models.load("gpt-tiny", batch_size=B, seq_len=T, seed=0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(7))
    return x, torch.roll(x, -1, dims=1)  # the same batch every step: the loss falls, so the runs can part


def _bf16(rank: int, build: str) -> dict[str, Any]:
    loaded = _model()
    pipe = Pipeline.from_build(build, loaded.module, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR))
    seen: set[str] = set()
    for m in pipe.local_module().modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda _m, _i, out: seen.add(str(out.dtype)))
    x, y = _batch()
    losses = [pipe.step((x,), y, loaded.loss_fn).item() for _ in range(STEPS)]
    state = [t for s in pipe.optimizer.state.values() for t in s.values() if t.dim() > 0]
    return {"losses": losses, "linear_out": sorted(seen), "bytes_sent": pipe.metrics[-1].bytes_sent,
            "bytes_received": pipe.metrics[-1].bytes_received,
            "params": sorted({str(p.dtype) for p in pipe.parameters()}),
            "grads": sorted({str(p.grad.dtype) for p in pipe.parameters() if p.grad is not None}),
            "adam": sorted({str(t.dtype) for t in state})}


def _fp16(rank: int, build: str) -> dict[str, Any]:
    loaded = _model()
    pipe = Pipeline.from_build(build, loaded.module, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                               scaler=LossScaler(init_scale=1024.0, growth_interval=1000))
    poison = [False]
    if rank == 1:  # an overflow in one parameter of the last stage only: stage 0's gradients stay finite
        p = pipe.parameters()[-1]
        p.register_hook(lambda g: torch.full_like(g, float("inf")) if poison[0] else g)
    x, y = _batch()
    out: dict[str, Any] = {"steps": []}
    for step in range(3):
        poison[0] = step == 1
        before = [p.detach().clone() for p in pipe.parameters()]
        pipe.step((x,), y, loaded.loss_fn)
        changed = any(not torch.equal(a, p) for a, p in zip(before, pipe.parameters()))
        out["steps"].append({"skipped": pipe.scaler.last_skipped, "changed": changed, "scale": pipe.scaler.scale})
    return out


def _worker(rank: int, world: int, bf16: str, fp16: str, out: str) -> None:
    torch.set_num_threads(1)
    report = {"bf16": _bf16(rank, bf16), "fp16": _fp16(rank, fp16)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def _eager(autocast: bool) -> list[float]:
    loaded = _model()
    opt = torch.optim.AdamW(loaded.module.parameters(), lr=LR)
    x, y = _batch()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loaded.loss_fn(loaded.module(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_bf16_pipeline_matches_autocast_eager_and_fp16_overflow_skips_everywhere(tmp_path: Path) -> None:
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    builds = {}
    for prec in ("bf16", "fp16"):
        plan = split_plan(gm, "gpt-tiny", 2, microbatches=2, schedule=Schedule.ONE_F_ONE_B)
        builds[prec] = generate(gm, replace(plan, precision=prec), tmp_path / prec)
    spawn_ranks(_worker, 2, tmp_path, str(tmp_path / "bf16"), str(tmp_path / "fp16"), str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    # bf16: the losses of 20 steps are the bf16-autocast eager model's, within half a bf16 ulp (2^-8)
    eager = _eager(autocast=True)
    for r in reports:
        got = r["bf16"]["losses"]
        assert all(abs(a - b) <= 4e-3 * abs(b) for a, b in zip(got, eager)), (got, eager)
        assert got[-1] < 0.7 * got[0], "the pipeline must train"
        assert r["bf16"]["params"] == r["bf16"]["grads"] == r["bf16"]["adam"] == ["torch.float32"], r
    # it computes in bf16 (each stage's Linear layers under autocast) ...
    assert all(r["bf16"]["linear_out"] == ["torch.bfloat16"] for r in reports), reports
    # ... and sends bf16: the cut after layer 0's attention carries two (B/2, T, 64) tensors (the residual and the
    # dropout output) for each of 2 microbatches, 2 bytes an element: the same bytes go back as gradients
    spec = f"(({B // 2}, {T}, 64), torch.bfloat16, None)"
    assert f"{spec}, {spec}" in builds["bf16"].source(1)
    wire = 2 * 2 * (B // 2) * T * 64 * 2
    assert reports[0]["bf16"]["bytes_sent"] == reports[0]["bf16"]["bytes_received"] == wire, reports[0]
    assert reports[1]["bf16"]["bytes_sent"] == reports[1]["bf16"]["bytes_received"] == wire, reports[1]

    # fp16: the overflow on rank 1 at step 2 skips the step on both ranks, and both halve the scale
    for r in reports:
        s = r["fp16"]["steps"]
        assert [x["skipped"] for x in s] == [False, True, False], s
        assert [x["changed"] for x in s] == [True, False, True], s
        assert [x["scale"] for x in s] == [1024.0, 512.0, 512.0], s
