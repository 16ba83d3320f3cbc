"""Codegen, unit tier: a compiled build reproduces the original model's training step (one process).

Transparency is the core: for each model, stage count and memory mode, the
outputs, the loss, every parameter's gradient and the buffers after one step
of the build (stages chained in this process, through the generated files)
equal the original model's. Then: the generated source holds the operations
where the plan puts them, only tensors cross stages, and a tampered build or
a plan for another model is refused.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.utils._pytree import tree_leaves

from hpml_compile import models
from hpml_compile.codegen import SyncKind, generate, load_build
from hpml_compile.codegen.actions import TokenKind, parse_token
from hpml_compile.codegen.comm import pieces
from hpml_compile.codegen.partition import microbatch_values, place, plan_actions
from hpml_compile.testing import (SkipNet, max_buffer_diff, max_grad_diff, skipnet_batch, skipnet_loss,
                                          split_plan)
from hpml_compile.cli.compile import add_parsers
from hpml_compile.errors import BuildMismatchError, HpmlError
from hpml_compile.runtime import merge_outputs, step_local
from hpml_compile.trace import trace

HF = "hf:gpt2?n_layer=2,n_embd=64,n_head=2,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"
TOL = 1e-5


@dataclass
class Case:
    """A model under test: a fresh copy per test, its batch, its loss and how it is compiled."""

    name: str
    model: torch.nn.Module
    inputs: tuple[Any, ...]
    targets: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    microbatches: int
    gm: torch.fx.GraphModule


def _load(key: str) -> Case:
    if key == "skipnet":
        torch.manual_seed(0)
        net = SkipNet()
        x, y = skipnet_batch()
        return Case(key, net, (x,), y, skipnet_loss, 2, trace(net, (x,)))
    loaded = models.load(HF if key == "hf-gpt2" else key, batch_size=4 if key == "hf-gpt2" else None,
                         seq_len=16 if key == "hf-gpt2" else None)
    net = loaded.module.eval() if key == "hf-gpt2" else loaded.module  # eval: no dropout in the reference
    # BatchNorm normalises each microbatch by its own statistics: one microbatch keeps resnet transparent.
    m = 1 if key == "resnet-tiny" else 2
    # the HF model goes through torch.export, with a symbolic batch: traced at the whole batch like the others
    return Case(key, net, loaded.example_inputs, loaded.example_targets, loaded.loss_fn, m,
                trace(net, loaded.example_inputs))


MODEL_KEYS = ["mlp-tiny", "gpt-tiny", "resnet-tiny", "hf-gpt2", "skipnet"]


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    return {}


def _case(cases: dict[str, Case], key: str) -> Case:
    if key not in cases:
        cases[key] = _load(key)
    return cases[key]


def _modes(stages: int) -> dict[str, dict[str, tuple[int, ...]]]:
    every = tuple(range(stages))
    return {
        "plain": {},
        "swap": {"swap": every},
        "recompute": {"recompute": every},
        # swap on even stages, recompute on odd ones, both on stage 0 (the checkpoint's inputs are swapped)
        "mixed": {"swap": every[::2], "recompute": (0, *every[1::2])},
    }


def _run(case: Case, plan: Any, tmp: Path, *, optimizer: bool = False) -> tuple[Any, torch.nn.Module, torch.nn.Module]:
    """Compile, load onto a fresh copy, step it and the reference; returns (result, compiled model, reference)."""
    model, ref = copy.deepcopy(case.model), copy.deepcopy(case.model)
    generate(case.gm, plan, tmp)
    build = load_build(tmp, model, graph_module=case.gm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    result = step_local(build, case.inputs, case.targets, case.loss_fn, optimizer=opt)
    out = ref(*case.inputs)
    loss = case.loss_fn(out, case.targets)
    loss.backward()
    if optimizer:
        torch.optim.SGD(ref.parameters(), lr=0.1).step()
    result.reference = (out, loss)  # type: ignore[attr-defined]
    return result, model, ref


def _assert_transparent(result: Any, model: torch.nn.Module, ref: torch.nn.Module) -> None:
    out, loss = result.reference
    assert torch.allclose(result.loss, loss, atol=TOL), (result.loss, loss)
    ours = merge_outputs([o for _, _, o in sorted(result.outputs, key=lambda t: t[:2])])
    theirs = [out.logits] if hasattr(out, "logits") else tree_leaves(out)
    for a, b in zip(tree_leaves(ours), theirs):
        assert a.shape == b.shape and torch.allclose(a, b, atol=TOL), (a - b).abs().max()
    assert max_grad_diff(model, ref) < TOL
    assert max_buffer_diff(model, ref) < TOL


@pytest.mark.parametrize("mode", ["plain", "swap", "recompute", "mixed"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("key", MODEL_KEYS)
def test_transparency(cases: dict[str, Case], key: str, stages: int, mode: str, tmp_path: Path) -> None:
    case = _case(cases, key)
    plan = split_plan(case.gm, key, stages, microbatches=case.microbatches, **_modes(stages)[mode])
    result, model, ref = _run(case, plan, tmp_path)
    _assert_transparent(result, model, ref)
    assert (result.swap_bytes > 0) == (mode in ("swap", "mixed"))


@pytest.mark.parametrize("replicas,microbatches,batch", [
    ([2, 1], 2, 4), ([1, 2], 2, 4), ([2, 2], 2, 4), ([1, 2, 4], 1, 4), ([3], 2, 6)])
def test_replicated_stages_in_one_process(replicas: list[int], microbatches: int, batch: int, tmp_path: Path) -> None:
    # Replica r of a stage runs slice r of every microbatch; boundaries between different replica counts reshard.
    loaded = models.load("gpt-tiny", batch_size=batch)
    case = Case("gpt-tiny", loaded.module, loaded.example_inputs, loaded.example_targets, loaded.loss_fn,
                microbatches, trace(loaded.module, loaded.example_inputs))
    plan = split_plan(case.gm, "gpt-tiny", len(replicas), microbatches=microbatches, replicas=replicas,
                      swap=(0,), recompute=(len(replicas) - 1,))
    result, model, ref = _run(case, plan, tmp_path)
    _assert_transparent(result, model, ref)


def test_zero2_replicas_update_like_the_original(cases: dict[str, Case], tmp_path: Path) -> None:
    case = _case(cases, "skipnet")
    plan = split_plan(case.gm, "skipnet", 2, microbatches=2, replicas=[2, 2], zero=2)
    result, model, ref = _run(case, plan, tmp_path, optimizer=True)
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(a, b, atol=TOL), name
    table = _collectives(tmp_path / "stage_0.py", "Stage0")
    assert [t.split("(")[0] for t in table] == ["REDUCESCATTER.shm", "ALLGATHER.shm"]
    assert table["REDUCESCATTER.shm(0)"] == table["ALLGATHER.shm(0)"] and table["ALLGATHER.shm(0)"]


def _collectives(path: Path | str, cls: str) -> dict[str, tuple[str, ...]]:
    """The ``COLLECTIVES`` table of a generated class (token -> parameter names), as its source spells it."""
    source = path.read_text() if isinstance(path, Path) else path
    klass = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls)
    found = [n.value for n in klass.body if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "COLLECTIVES" for t in n.targets)]
    return ast.literal_eval(found[0]) if found else {}


def _ops_called(source: str, cls: str, method: str) -> list[str]:
    """Names of the ``ops.<name>(...)`` calls in one method of a generated class, in order."""
    tree = ast.parse(source)
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next((n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
    if fn is None:
        return []
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "ops"]
    return [c.func.attr for c in sorted(calls, key=lambda c: c.lineno)]  # type: ignore[attr-defined]


def test_source_has_the_operations_the_plan_implies(cases: dict[str, Case], tmp_path: Path) -> None:
    case = _case(cases, "gpt-tiny")
    plan = split_plan(case.gm, "gpt-tiny", 3, microbatches=2, replicas=[2, 1, 1], swap=(1,), recompute=(2,))
    build = generate(case.gm, plan, tmp_path)
    src = [build.source(k) for k in range(3)]
    assert _ops_called(src[0], "Stage0", "forward") == ["send"]
    assert _ops_called(src[1], "Stage1", "forward") == ["recv", "swap", "send"]
    assert _ops_called(src[2], "Stage2", "forward") == ["recv", "checkpoint"]
    # stage 0 is replicated (gradient all-reduce over its replicas) and shares the tied embedding with stage 2
    tables = [_collectives(src[k], f"Stage{k}") for k in range(3)]
    assert list(tables[0]) == ["ALLREDUCE.shm(0)", "ALLREDUCE.shm(0,2)"] and tables[0]["ALLREDUCE.shm(0)"]
    assert tables[0]["ALLREDUCE.shm(0,2)"] == ("wte.weight",)
    assert tables[2] == {"ALLREDUCE.shm(0,2)": ("lm_head.weight",)}
    assert tables[1] == {}
    assert build.stages[0].COLLECTIVES == tables[0]  # what runs is what the file says
    # the swap region runs the plan's swapped nodes; the recompute region the whole stage
    region = next(n for n in ast.parse(src[1]).body if isinstance(n, ast.ClassDef) and n.name == "Stage1Swap0")
    assigned = {t.id for n in ast.walk(region) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    ops_of = {n.name: n.op for n in case.gm.graph.nodes}
    assert {n for n in plan.stages[1].swap if ops_of[n].startswith("call_")} <= assigned
    assert "class Stage2Recompute(RegionModule)" in src[2]
    assert build.manifest.stages[1]["actions"] == ["0RECV1", "SWAP1", "1SEND2"]


def test_only_tensors_cross_and_skips_are_relayed(cases: dict[str, Case], tmp_path: Path) -> None:
    case = _case(cases, "skipnet")
    # cuts right after the size read and right after the tuple-valued chunk
    plan = split_plan(case.gm, "skipnet", 4, microbatches=2, after=["size", "chunk", "norm"])
    rows = case.inputs[0].shape[0] // 2
    actions = plan_actions(case.gm, plan, place(case.gm, plan), microbatch_values(case.gm, rows))
    assert "size" in actions[3].remat and "x" in actions[3].inputs  # the int is recomputed from the input
    assert actions[2].recv is not None and "chunk" in actions[2].recv.values  # a tuple crosses as its tensors
    # tanh (h0) is made in stage 1 and used in stage 3: boundary 2 -> 3 relays it
    assert actions[3].recv is not None and "tanh" in actions[3].recv.values
    assert actions[2].recv is not None and "tanh" in actions[2].recv.values
    result, model, ref = _run(case, plan, tmp_path)
    _assert_transparent(result, model, ref)
    src = (tmp_path / "stage_3.py").read_text()
    assert "size = x.size(0)" in src and "INPUTS = ('x',)" in src
    assert "chunk_0 = recv[" in (tmp_path / "stage_2.py").read_text()


def test_solver_plans_compile_and_stay_transparent(cases: dict[str, Case], tmp_path: Path) -> None:
    from hpml_compile.cluster import load_cluster
    from hpml_compile.costgraph import build as build_costgraph
    from hpml_compile.profile import profile
    from hpml_compile.solve import solve

    case = _case(cases, "gpt-tiny")
    prof = profile(case.gm, case.inputs, name="gpt-tiny", repeats=1, warmup=0, progress=False)
    for n in (2, 3):
        plan = solve(build_costgraph(prof).coarsen(), load_cluster(f"local-cpu-{n}"), solver="uniform",
                     microbatches=2)
        assert len(plan.stages) == n
        result, model, ref = _run(case, plan, tmp_path / f"n{n}")
        _assert_transparent(result, model, ref)
    assert (tmp_path / "n3" / "stage_2.py").is_file()


def test_hand_edited_stage_file_is_refused(cases: dict[str, Case], tmp_path: Path) -> None:
    case = _case(cases, "mlp-tiny")
    generate(case.gm, split_plan(case.gm, "mlp-tiny", 2, microbatches=2), tmp_path)
    stage = tmp_path / "stage_1.py"
    stage.write_text(stage.read_text().replace("def forward", "# tuned by hand\n    def forward"))
    with pytest.raises(BuildMismatchError, match=r"stage_1\.py was edited by hand: it is for reading; the build runs "
                                                 r"the code regenerated from plan\.json .* differs at line \d+"):
        load_build(tmp_path, case.model, graph_module=case.gm)


def test_plan_for_another_model_is_refused(cases: dict[str, Case], tmp_path: Path) -> None:
    mlp, gpt = _case(cases, "mlp-tiny"), _case(cases, "gpt-tiny")
    gpt_plan = split_plan(gpt.gm, "gpt-tiny", 2, microbatches=2)
    with pytest.raises(BuildMismatchError, match="made for another model"):
        generate(mlp.gm, gpt_plan, tmp_path / "wrong")
    # a build for gpt-tiny loaded with the MLP: the model graph does not match (re-traced from the model)
    generate(gpt.gm, gpt_plan, tmp_path / "gpt")
    with pytest.raises(BuildMismatchError, match=r"manifest\.json: this model's graph .* belongs to another model"):
        load_build(tmp_path / "gpt", copy.deepcopy(mlp.model))
    # plan.json copied over from another build is a changed file
    generate(mlp.gm, split_plan(mlp.gm, "mlp-tiny", 2, microbatches=2), tmp_path / "mlp")
    (tmp_path / "mlp" / "plan.json").write_text((tmp_path / "gpt" / "plan.json").read_text())
    with pytest.raises(BuildMismatchError, match=r"plan\.json was changed"):
        load_build(tmp_path / "mlp", mlp.model, graph_module=mlp.gm)


def test_load_build_retraces_the_model(cases: dict[str, Case], tmp_path: Path) -> None:
    case = _case(cases, "resnet-tiny")
    generate(case.gm, split_plan(case.gm, "resnet-tiny", 2, recompute=(1,)), tmp_path)
    model = copy.deepcopy(case.model)
    build = load_build(tmp_path, model)  # no graph given: traced again from the manifest's input shapes
    assert [type(s).__name__ for s in build.stages] == ["Stage0", "Stage1"]
    assert build.stages[0].conv1 is model.conv1  # weights are the user's model's own, not copies
    bn = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    owners = [sum(any(b is x for x in s.modules()) for s in build.stages) for b in bn]
    assert owners == [1] * len(bn)  # every BatchNorm (and its running statistics) lives on exactly one stage


def test_wrong_batch_size_is_a_clear_error(cases: dict[str, Case], tmp_path: Path) -> None:
    case = _case(cases, "mlp-tiny")
    build = generate(case.gm, split_plan(case.gm, "mlp-tiny", 2, microbatches=2), tmp_path)
    x, y = case.inputs[0], case.targets
    with pytest.raises(HpmlError, match="the build was generated for"):
        step_local(build, (torch.cat([x, x]),), torch.cat([y, y]), case.loss_fn)


def test_manifest_and_debug_dump(cases: dict[str, Case], tmp_path: Path) -> None:
    case = _case(cases, "gpt-tiny")
    plan = split_plan(case.gm, "gpt-tiny", 2, microbatches=2, replicas=[2, 1], zero=1)
    generate(case.gm, plan, tmp_path, debug=True)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"stage_0.py", "stage_1.py", "plan.json", "graph.txt", "lowering.json"}
    # ZeRO-1: stage 0's own parameters are reduce-scattered into shards and all-gathered after the step; the
    # tied embedding is summed over both stages
    assert manifest["collectives"] == ["ALLGATHER.shm(0)", "REDUCESCATTER.shm(0)", "ALLREDUCE.shm(0,1)"]
    assert manifest["inputs"] == [{"name": "idx", "shape": [2, 32], "dtype": "int64"}]
    lowering = json.loads((tmp_path / "lowering.json").read_text())
    assert lowering["actions"][1]["tokens"] == ["0RECV1", "ALLREDUCE.shm(0,1)"]
    assert SyncKind("ALLREDUCE") is SyncKind.ALL_REDUCE
    kinds = {parse_token(t)[0] for s in manifest["stages"] for t in s["actions"]}  # every token parses back
    assert kinds == {TokenKind.SEND, TokenKind.RECV, TokenKind.ALL_REDUCE, TokenKind.REDUCE_SCATTER,
                     TokenKind.ALL_GATHER}


def test_compile_cli_writes_a_loadable_build(cases: dict[str, Case], tmp_path: Path, capsys: Any) -> None:
    parser = argparse.ArgumentParser(prog="hpml-compile")
    add_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["compile", "mlp-tiny", "--cluster", "local-cpu-2", "--solver", "uniform",
                              "--microbatches", "2", "--repeats", "1", "--warmup", "0", "-o", str(tmp_path / "b")])
    assert args.run(args) == 0
    assert "2 stages, 2 microbatches" in capsys.readouterr().out
    names = {p.name for p in (tmp_path / "b").iterdir()}
    assert {"stage_0.py", "stage_1.py", "plan.json", "profile.json", "manifest.json", "graph.txt"} <= names
    if len(os.sched_getaffinity(0)) >= 2:  # two CPU ranks on this host: their co-run slow-down is timed by default
        assert "corun" in json.loads((tmp_path / "b" / "profile.json").read_text())["devices"]["cpu"]
    loaded = models.load("mlp-tiny")
    build = load_build(tmp_path / "b", loaded.module)
    result = step_local(build, loaded.example_inputs, loaded.example_targets, loaded.loss_fn)
    ref = models.load("mlp-tiny")
    expected = ref.loss_fn(ref.module(*ref.example_inputs), ref.example_targets)
    assert torch.allclose(result.loss, expected, atol=TOL)


class _SharedNorm(torch.nn.Module):
    """One BatchNorm called twice: a plan splitting its calls would put its statistics on two stages."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(self.bn(x)))


def test_running_statistics_must_live_on_one_stage(tmp_path: Path) -> None:
    net = _SharedNorm()
    gm = trace(net, (torch.randn(4, 8),))
    with pytest.raises(HpmlError, match="running statistics must live on one stage"):
        generate(gm, split_plan(gm, "shared-norm", 2, after=["bn"]), tmp_path)
    generate(gm, split_plan(gm, "shared-norm", 1), tmp_path)  # one stage: fine


@given(rows=st.integers(1, 6), d_src=st.integers(1, 4), d_dst=st.integers(1, 4))
def test_resharding_moves_every_row_once(rows: int, d_src: int, d_dst: int) -> None:
    total = rows * d_src
    assume(total % d_dst == 0)
    got: dict[int, list[int]] = {q: [] for q in range(d_dst)}
    for me in range(d_src):
        for q, off, n in pieces(rows, me, d_src, d_dst):
            got[q].extend(range(me * rows + off, me * rows + off + n))
    per = total // d_dst
    assert all(sorted(got[q]) == list(range(q * per, (q + 1) * per)) for q in range(d_dst))


def test_stage_params_follow_a_parameter_registered_again_under_its_name(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    gm = trace(model, (torch.ones(4, 4),))
    generate(gm, split_plan(gm, "seq", 1), tmp_path / "build")
    stage = load_build(tmp_path / "build", model).stages[0]
    names = ("0.weight", "2.bias")
    first = stage.params(*names)
    assert [p is q for p, q in zip(first, (model[0].weight, model[2].bias))] == [True, True]
    assert all(p is q for p, q in zip(stage.params(*names), first))  # read from the tables kept
    new = torch.nn.Parameter(torch.zeros(2))
    stage.get_submodule("2").register_parameter("bias", new)
    assert stage.params(*names)[1] is new
