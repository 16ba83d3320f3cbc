"""Real transformers architectures as their users hold them: traced, split, and trained exactly like eager.

Each architecture (tiny config, random weights, nothing downloaded) takes a dict batch with ``labels`` and
computes its own loss, as ``transformers.Trainer`` trains it. Its graph is traced once with a symbolic batch,
cut after its first repeated block into 2 pipeline stages (2 microbatches) and laid out as 1 stage on
2 replicas; in one process, 3 optimizer steps of each build give the eager model's losses and gradients.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from hpml_compile.codegen import generate, load_build
from hpml_compile.codegen.testing import last_node_of, max_grad_diff, split_plan
from hpml_compile.costgraph import block_key
from hpml_compile.runtime import step_local
from hpml_compile.trace import output_structure, repeated_blocks, trace
from hpml_compile.trainspec import model_loss

from .archs import ARCHS, make

TOL = 2e-5
STEPS = 3


@pytest.fixture(scope="module")
def traced() -> dict[str, Any]:
    return {}


def _traced(cache: dict[str, Any], name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.fx.GraphModule]:
    if name not in cache:
        model, batch = make(name)
        cache[name] = (model, batch, trace(model, tuple(batch.values()), input_names=tuple(batch)))
    return cache[name]


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_traces_with_a_symbolic_batch(traced: dict[str, Any], name: str) -> None:
    model, batch, gm = _traced(traced, name)
    assert gm.meta["hpml_dynamic_batch"], f"{name}: the batch was specialised"
    # one graph serves any row count: 3 rows of the traced 4 give eager's loss on those rows
    rows = {k: v[:3] for k, v in batch.items()}
    got = output_structure(gm, torch.fx.Interpreter(gm).run(*rows.values()))
    want = model(**rows)
    assert type(got) is type(want)
    torch.testing.assert_close(got.loss, want.loss, atol=TOL, rtol=1e-4)
    # the repeated blocks, found from the module tree, are the coarsening's units
    blocks = repeated_blocks(model)
    assert len(blocks) >= 2, blocks
    keys = {block_key(n.meta["hpml"].scope) for n in gm.graph.nodes}
    assert set(blocks[:2]) <= keys, (blocks, keys)


@pytest.mark.parametrize("layout", ["2 stages", "2 replicas"])
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_trains_like_eager(traced: dict[str, Any], name: str, layout: str, tmp_path: Path) -> None:
    model, batch, gm = _traced(traced, name)
    if layout == "2 stages":
        plan = split_plan(gm, name, 2, microbatches=2, after=[last_node_of(gm, repeated_blocks(model)[0])])
    else:
        plan = split_plan(gm, name, 1, microbatches=1, replicas=[2])
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    generate(gm, plan, tmp_path)
    build = load_build(tmp_path, ours, graph_module=gm)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    inputs = tuple(batch.values())
    for step in range(STEPS):
        opt_ours.zero_grad()
        opt_ref.zero_grad()
        got = step_local(build, inputs, None, model_loss).loss
        want = ref(**batch).loss
        want.backward()
        assert abs(float(got) - float(want)) < TOL, (step, float(got), float(want))
        worst = max_grad_diff(ours, ref)
        assert worst < TOL, (step, worst)
        opt_ours.step()
        opt_ref.step()
