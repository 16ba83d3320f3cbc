"""Interleaved 1F1B in one process: the ranks' lowered lists, merged, train gpt-tiny as the model does; what the
runtime does not combine with several stages per rank is refused before anything runs.

Transparency: three AdamW steps on 2 device groups x 2 chunks (and x 3) at 4 microbatches: the loss of every
step, every gradient after the last and the parameters after it equal the original model's (float32, 1e-5);
gpt-tiny's embedding is tied to its head, on the first and the last stage.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.errors import PlanError
from hpml_compile.plan import Schedule
from hpml_compile.runtime import Pipeline
from hpml_compile.runtime.execute.chunks import interleave_refusal
from hpml_compile.runtime.observe.summary import summarise
from hpml_compile.testing import split_plan
from hpml_compile.trace import trace

TOL = 1e-5


def _model() -> models.LoadedModel:
    return models.load("gpt-tiny", batch_size=8, seq_len=16, seed=0)


def _plan(chunks: int, m: int = 4, **kw: object):  # type: ignore[no-untyped-def]
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    return gm, split_plan(gm, "gpt-tiny", 2 * chunks, microbatches=m, schedule=Schedule.INTERLEAVED, chunks=chunks,
                          **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunks", [2, 3])
def test_interleaved_in_one_process_equals_the_model(tmp_path: Path, chunks: int) -> None:
    gm, plan = _plan(chunks)
    generate(gm, plan, tmp_path)
    loaded, ref = _model(), _model()
    pipe = Pipeline.from_build(tmp_path, loaded.module, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                               events=False)
    assert sorted(pipe.stages) == list(range(2 * chunks))
    opt = torch.optim.AdamW(ref.module.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 256, (8, 16), generator=g)
        y = torch.roll(x, -1, dims=1)
        got = pipe.step((x,), y, loaded.loss_fn)
        opt.zero_grad()
        loss = ref.loss_fn(ref.module(x), y)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in ref.module.named_parameters()}
        opt.step()
        assert abs(got.item() - loss.item()) < TOL
    mine = dict(loaded.module.named_parameters())
    assert max((mine[n].grad - gr).abs().max().item() for n, gr in grads.items()) < TOL
    state = pipe.state_dict()
    assert max((state[k] - v).abs().max().item() for k, v in ref.module.state_dict().items()) < TOL
    # measured per device group (what one rank of it computes: its chunks together), as the summary reads it
    rows = {m.rank: [x for x in pipe.metrics if x.rank == m.rank] for m in pipe.metrics}
    summary = summarise(plan, rows, skip=0)
    assert [st.stage for st in summary.stages] == [0, 1]
    assert all(st.fwd_ms > 0 and st.bwd_ms > 0 for st in summary.stages)


def test_what_interleaving_does_not_run_is_refused(tmp_path: Path) -> None:
    gm, plan = _plan(2)
    assert interleave_refusal(plan) is None
    swapped = replace(plan, stages=tuple(replace(st, swap=st.nodes[:1]) if st.index == 1 else st
                                         for st in plan.stages))
    assert "stage 1 uses activation swap" in (interleave_refusal(swapped) or "")
    _, replicated = _plan(2, replicas=[2, 1])
    compressed = replace(replicated, stages=tuple(replace(st, compress="topk:0.01") if st.replicas > 1 else st
                                                  for st in replicated.stages))
    assert "stage 0 uses gradient compression" in (interleave_refusal(compressed) or "")
    generate(gm, plan, tmp_path)
    with pytest.raises(PlanError, match="lost in place is not combined with an interleaved plan"):
        Pipeline.from_build(tmp_path, _model().module, live=True)
