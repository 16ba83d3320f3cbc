"""Gradient collectives in bf16 (``Plan.reduce_dtype``) on gloo ranks: training as eager within bf16's rounding,
half the bytes on the wire, for the flat all-reduce (shared memory and gloo), ZeRO-1 (bucketed too), ZeRO-3, and
the hierarchical all-reduce and ZeRO-1 over two hosts of two ranks.

Two spawned jobs (2 ranks, then 4) run every build (gpt-tiny, one stage replicated over every rank, SGD, 3 steps),
each against the same eager run of the whole batch in this process.
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
from hpml_compile.ir import Cluster, Device
from hpml_compile.plan import AllReduce, Plan
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.runtime.observe.events import read_events
from hpml_compile.testing import split_plan
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # seven builds of gpt-tiny in two spawns: ~40 s on 2 shared cores

STEPS, LR, ROWS = 3, 0.1, 8
# name: (ranks, ZeRO stage, reduce dtype, Pipeline options); four ranks: two hosts, hierarchical
CASES: dict[str, tuple[int, int, str, dict[str, Any]]] = {
    "fp32": (2, 0, "fp32", {}),
    "bf16": (2, 0, "bf16", {}),  # the CPU ranks of one host: through shared memory
    "bf16-gloo": (2, 0, "bf16", {"shared_memory": False}),  # gloo's ring
    "bf16-zero1": (2, 1, "bf16", {"overlap": True, "bucket_mb": 0.1}),  # bucket by bucket (CastBack)
    "bf16-zero3": (2, 3, "bf16", {}),
    "bf16-hier": (4, 0, "bf16", {"overlap": True, "bucket_mb": 0.1}),  # each bucket a chain of three
    "bf16-hier-zero1": (4, 1, "bf16", {}),  # reduce-scatter in the host, all-reduce between hosts
}
SYNCED = ("ALLREDUCE", "REDUCESCATTER")


def _model() -> models.LoadedModel:
    return models.load("gpt-tiny", batch_size=ROWS, seq_len=16, seed=0)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 256, (ROWS, 16), generator=g) for _ in range(STEPS)]
    return [(x, torch.roll(x, -1, dims=1)) for x in xs]


def _bf16_exact(t: torch.Tensor) -> bool:
    return bool(torch.equal(t, t.to(torch.bfloat16).float()))


def _train(rank: int, world: int, builds: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for name, build in builds.items():
        loaded = _model()
        opts = CASES[name][3]
        pipe = Pipeline.from_build(build, loaded.module, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
                                   run_dir=str(Path(out, "run", name)), tensorboard=False, **opts)
        assert pipe.sync is not None
        reduce, exact = pipe.sync.reduce, []

        def watched(comm: Any, params: Any) -> None:  # the summed gradients as the optimizer will read them
            reduce(comm, params)
            sync = pipe.sync
            summed = sync.buffer.grad_flat if CASES[name][1] == 0 else sync.shard.param.grad  # type: ignore[union-attr]
            exact.append(_bf16_exact(summed))

        pipe.sync.reduce = watched  # type: ignore[method-assign]
        losses = [pipe.step((x,), y, loaded.loss_fn).item() for x, y in _batches()]
        state = {k: v.tolist() for k, v in pipe.state_dict().items() if v.is_floating_point()}
        report[name] = {"losses": losses, "bf16_exact": exact, "state": state,
                        "sync_bytes": pipe.metrics[-1].sync_dense_bytes, "inter": pipe.metrics[-1].sync_inter_bytes}
        pipe.close()
    Path(out, f"rank{rank}-{world}.json").write_text(json.dumps(report))


def _two_hosts(plan: Plan) -> Plan:
    """``plan``'s one stage on cpu0..cpu3, cpu0-1 on hostA and cpu2-3 on hostB, all-reducing hierarchically."""
    devs = tuple(Device(f"cpu{i}", "cpu", 2.0, host="hostA" if i < 2 else "hostB") for i in range(4))
    return replace(plan, cluster=Cluster(devices=devs, name="two-hosts"),
                   stages=(replace(plan.stages[0], allreduce=AllReduce.HIERARCHICAL),))


def _eager() -> tuple[list[float], dict[str, torch.Tensor], float]:
    """Losses, parameters after the steps, and the largest gradient element of any step."""
    loaded = _model()
    opt = torch.optim.SGD(loaded.module.parameters(), lr=LR)
    losses, most = [], 0.0
    for x, y in _batches():
        opt.zero_grad()
        loss = loaded.loss_fn(loaded.module(x), y)
        loss.backward()
        most = max(most, max(float(p.grad.abs().max()) for p in loaded.module.parameters() if p.grad is not None))
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in loaded.module.state_dict().items()}, most


def test_bf16_gradient_sync_trains_as_eager_within_its_rounding_on_half_the_bytes(tmp_path: Path) -> None:
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    builds: dict[int, dict[str, str]] = {2: {}, 4: {}}
    for name, (world, zero, wire, _) in CASES.items():
        plan = replace(split_plan(gm, "gpt-tiny", 1, microbatches=2, replicas=[world], zero=zero), reduce_dtype=wire)
        builds[world][name] = str(generate(gm, _two_hosts(plan) if world == 4 else plan, tmp_path / name).out_dir)
    reports: list[dict[str, Any]] = [{} for _ in range(4)]
    for world, some in builds.items():
        spawn_ranks(_train, world, tmp_path, some, str(tmp_path))
        for r in range(world):
            reports[r].update(json.loads((tmp_path / f"rank{r}-{world}.json").read_text()))
    losses, state, most = _eager()

    # Tolerance: each replica's gradient and every partial sum are rounded to bf16 (8 significant bits, unit
    # roundoff 2^-9), so an element of the summed gradient is off by about 2^-8 of the largest gradient element
    # (2^-7 over four replicas' partial sums); SGD moves a parameter by LR times it per step, so after STEPS steps
    # by at most STEPS * LR * 2^-7 * max|g| (doubled: the later steps' gradients are taken at parameters already
    # that far apart). The fp32 build sums the same halves in another grouping: 1e-5. The losses move far less
    # than the parameters (measured: a few parts in a million of a loss near 5.5; bounded at 1e-4).
    atol = 2 * STEPS * LR * 2 ** -7 * most
    for r in reports:
        if "fp32" in r:
            torch.testing.assert_close(r["fp32"]["losses"], losses, rtol=0, atol=1e-5)
            assert not any(r["fp32"]["bf16_exact"]), "fp32 sums are not all bf16 values"
        for name in (n for n in CASES if n in r):
            row = r[name]
            tol = 1e-5 if name == "fp32" else atol
            for k, v in state.items():
                torch.testing.assert_close(torch.tensor(row["state"][k]), v, rtol=0, atol=tol, msg=f"{name} {k}")
            if name == "fp32":
                continue
            assert all(row["bf16_exact"]) and len(row["bf16_exact"]) == STEPS, (name, row["bf16_exact"])
            # the first loss is before any update; the later ones move by far less than a part in a thousand
            assert row["losses"][0] == pytest.approx(losses[0], abs=1e-5), name
            torch.testing.assert_close(row["losses"], losses, rtol=1e-4, atol=0)
            assert (row["inter"] > 0) == ("hier" in name), (name, row["inter"])  # the levels between hosts ran
            # half the bytes: what the stage's sync reports (the flat buffer: padded to 4 shards under ZeRO)
            fp32 = reports[0]["fp32"]["sync_bytes"]
            assert 2 * row["sync_bytes"] == pytest.approx(fp32, abs=16), (name, row["sync_bytes"], fp32)
    events = {name: read_events(tmp_path / "run" / name) for name in CASES}  # the communicator's own counts

    def moved(name: str) -> int:
        last = max(events[name][0])
        return sum(e[6] for e in events[name][0][last].events if e[0] in SYNCED)

    assert moved("fp32") > 0
    for name in (n for n in CASES if n != "fp32"):
        assert 2 * moved(name) == pytest.approx(moved("fp32"), abs=16), (name, moved(name), moved("fp32"))
