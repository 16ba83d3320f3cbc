"""Tensor-parallel stages on real gloo ranks equal the model trained in one process.

A build whose stages have ``tp > 1`` runs on ``replicas x tp`` ranks per
stage; each rank holds slices of the sharded layers' parameters. Three AdamW
steps: the loss of every step, every gradient (a rank's slice against the
same slice of the eager gradient) and every parameter after the steps (the
state dict, gathered whole) equal the eager model's within 1e-5 (fp32), with
stages of different tp in one pipeline, ZeRO over the data-parallel groups
and recompute.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.errors import HpmlError, PlanError
from hpml_compile.memory import ZeroStage
from hpml_compile.plan import Plan, Schedule
from hpml_compile.recipe import ModelRecipe
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.testing import split_plan
from hpml_compile.trace import trace
from hpml_compile.trainspec import model_loss

pytestmark = pytest.mark.dist

STEPS = 3
TOL = 1e-5
ROWS, SEQ = 4, 16


@dataclass(frozen=True)
class Subject:
    """A model as a user holds it, its batches (inputs, target) and its loss."""

    module: torch.nn.Module
    batches: list[tuple[tuple[torch.Tensor, ...], Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]


def _subject(name: str) -> Subject:
    """``gpt-mini`` / ``gpt-tiny`` from the zoo (``-untied``: its LM head not tied to its embedding), or ``llama``:
    a tiny transformers Llama computing its own loss."""
    g = torch.Generator().manual_seed(1)
    if name == "llama":
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                                   num_attention_heads=2, num_key_value_heads=2,
                                                   intermediate_size=64, max_position_embeddings=64)).eval()
        batches: list[tuple[tuple[torch.Tensor, ...], Any]] = []
        for _ in range(STEPS):
            ids = torch.randint(3, 96, (ROWS, SEQ), generator=g)
            batches.append(((ids, torch.ones(ROWS, SEQ, dtype=torch.long), ids.clone()), None))
        return Subject(model, batches, model_loss)
    loaded = models.load(name.removesuffix("-untied"), batch_size=ROWS, seq_len=SEQ, seed=0)
    if name.endswith("-untied"):  # its LM head a weight of its own, equal to the embedding's at the start
        head = loaded.module.get_submodule("lm_head")
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    wte = loaded.module.get_submodule("wte")
    assert isinstance(wte, torch.nn.Embedding)
    vocab = wte.num_embeddings
    xs = [torch.randint(0, vocab, (ROWS, SEQ), generator=g) for _ in range(STEPS)]
    return Subject(loaded.module, [((x,), torch.roll(x, -1, dims=1)) for x in xs], loaded.loss_fn)


@lru_cache(maxsize=None)
def _traced(name: str) -> tuple[Subject, torch.fx.GraphModule]:
    """The subject and its graph, traced once per model in this process (codegen reads the graph, never
    changes it)."""
    sub = _subject(name)
    inputs = sub.batches[0][0]
    names = ("input_ids", "attention_mask", "labels") if name == "llama" else None
    return sub, trace(sub.module, inputs, input_names=names)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    # AdamW divides each gradient by its own size: a gradient near zero (1e-9 here) that two summation orders
    # give differently in its last bits would move its parameter by up to lr either way; eps bounds that.
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5)


@lru_cache(maxsize=None)
def _reference(name: str) -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Eager's losses, gradients and final state for ``name``: computed once per model in each process (a rank
    checks several builds of one model against it; callers only read it)."""
    sub = _subject(name)
    model = sub.module
    opt = _optimizer(model.parameters())
    losses, grads = [], []
    for x, y in sub.batches:
        opt.zero_grad()
        out = model(*x) if name != "llama" else model(input_ids=x[0], attention_mask=x[1], labels=x[2])
        loss = sub.loss_fn(out, y)
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        losses.append(loss.item())
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tp_plan(gm: Any, name: str, stages: int, tp: list[int], replicas: list[int], microbatches: int = 1,
             zero: ZeroStage = ZeroStage.NONE, recompute: bool = False, schedule: Schedule = Schedule.GPIPE) -> Plan:
    plan = split_plan(gm, name, stages, replicas=[r * t for r, t in zip(replicas, tp)],
                      microbatches=microbatches, schedule=schedule)
    return replace(plan, stages=tuple(replace(st, tp=t, zero=zero, recompute=recompute)
                                      for st, t in zip(plan.stages, tp)))


def _build(tmp: Path, model: str, name: str, stages: int, tp: list[int], replicas: list[int],
           microbatches: int = 1, zero: ZeroStage = ZeroStage.NONE, recompute: bool = False,
           schedule: Schedule = Schedule.GPIPE) -> tuple[str, str]:
    _, gm = _traced(model)
    generate(gm, _tp_plan(gm, model, stages, tp, replicas, microbatches, zero, recompute, schedule), tmp / name)
    return model, str(tmp / name)


def _worker(rank: int, world: int, builds: list[tuple[str, str]], tmp: str) -> None:
    torch.set_num_threads(1)
    dist.barrier()  # every rank joined the spawn's group before any leaves it
    dist.destroy_process_group()  # tensor-parallel ranks form their own groups
    report = {}
    for i, (model, build_dir) in enumerate(builds):
        init = f"file://{tmp}/rendezvous-{i}?rank={rank}&world_size={world}"
        report[build_dir] = _case(model, build_dir, init)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(report))


def _case(model: str, build_dir: str, init: str) -> dict[str, Any]:
    sub = _subject(model)
    pipe = Pipeline.from_build(build_dir, sub.module, init_method=init, optimizer=_optimizer, events=False)
    ref_losses, ref_grads, ref_state = _reference(model)
    stage = pipe.build.stages[pipe.stage_index]
    group = stage.hpml_tp
    sliced = {id(sub.module.get_parameter(n)): d for n, d in stage.TP_SHARDS}  # a tied parameter: any name
    losses, grad_diff, checked = [], 0.0, 0
    for (x, y), ref in zip(sub.batches, ref_grads):
        losses.append(pipe.step(x, y, sub.loss_fn).item())
        for name, p in sub.module.named_parameters():
            if p.grad is None:
                continue
            want = ref[name]
            if id(p) in sliced:
                want = want.chunk(group.size, dim=sliced[id(p)])[group.rank]
            grad_diff = max(grad_diff, (p.grad - want).abs().max().item())
            checked += 1
    state = pipe.state_dict()
    report = {
        "stage": pipe.stage_index,
        "tp": stage.TP,
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "grad": grad_diff,
        "checked": checked,
        "sliced": len(sliced),
        "state": max((state[k] - v).abs().max().item() for k, v in ref_state.items()),
        "keys": sorted(state) == sorted(ref_state),
        "worst": max(ref_state, key=lambda k: (state[k] - ref_state[k]).abs().max().item()),
        "moved": max((ref_state[k] - v).abs().max().item() for k, v in _subject(model).module.state_dict().items()),
    }
    pipe.close()
    return report


def _run(tmp: Path, world: int, *builds: tuple[str, str]) -> list[dict[str, Any]]:
    spawn_ranks(_worker, world, tmp, list(builds), str(tmp))
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def _check(reports: list[dict[str, Any]], build: tuple[str, str], grads: bool = True) -> None:
    """Every rank's losses and parameters equal eager's; its gradients too where ``grads`` (ZeRO keeps none
    in ``p.grad`` after the step: its flat buffers hold this replica's shard)."""
    for r in (rank[build[1]] for rank in reports):
        assert r["moved"] > 1e-4, ("the reference must move its parameters", r)
        assert (r["sliced"] > 0 or r["tp"] == 1) and (r["checked"] > 0 or not grads), r
        assert r["loss"] < TOL and r["grad"] < TOL, r
        assert r["keys"] and r["state"] < TOL, r


# The builds of each world size run in one spawn, built and run once for the tests below that check them:
# a rank goes through every build in turn, each in process groups of its own (see _worker), so one spawn checks
# what a spawn per test would, without starting and tearing down the ranks again.
@dataclass(frozen=True)
class Ran:
    """Builds (name -> ``(model, build folder)``) and every rank's reports on them."""

    builds: dict[str, tuple[str, str]]
    reports: list[dict[str, Any]]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """gpt-mini and a transformers Llama, one stage of tp=2 each, on 2 ranks."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    builds = {"tp2": _build(tmp, "gpt-mini", "tp2", 1, [2], [1]),
              "llama-tp2": _build(tmp, "llama", "llama-tp2", 1, [2], [1])}
    return Ran(builds, _run(tmp, 2, *builds.values()))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """Every 4-rank build of the tests below (replicas, pipelines, mixed degrees, ZeRO, recompute, ZB-H1)."""
    tmp = tmp_path_factory.mktemp("four-ranks")
    builds = {
        "tp2x2": _build(tmp, "gpt-tiny", "tp2x2", 1, [2], [2]),
        "pipe-tp2-tp2": _build(tmp, "gpt-tiny", "pipe-tp2-tp2", 2, [2, 2], [1, 1], microbatches=2),
        "pipe-tp21-x12": _build(tmp, "gpt-tiny-untied", "pipe-tp21-x12", 2, [2, 1], [1, 2], microbatches=2),
        "pipe-tp12-x21": _build(tmp, "gpt-tiny-untied", "pipe-tp12-x21", 2, [1, 2], [2, 1], microbatches=2),
        **{f"tp2x2-zero{int(z)}": _build(tmp, "gpt-tiny", f"tp2x2-zero{int(z)}", 1, [2], [2], microbatches=2, zero=z)
           for z in (ZeroStage.OS, ZeroStage.OS_G, ZeroStage.OS_G_P)},
        "tp2-recompute": _build(tmp, "gpt-tiny", "tp2-recompute", 2, [2, 2], [1, 1], microbatches=2, recompute=True),
        **{f"zb-{model}-m{m}": _build(tmp, model, f"zb-{model}-m{m}", 2, [2, 2], [1, 1], microbatches=m,
                                      schedule=Schedule.ZB_H1)
           for model, m in (("gpt-tiny-untied", 2), ("gpt-tiny-untied", 4), ("llama", 4))},
    }
    return Ran(builds, _run(tmp, 4, *builds.values()))


@pytest.mark.slow
def test_one_stage_tp2_on_two_ranks(two_ranks: Ran) -> None:
    _check(two_ranks.reports, two_ranks.builds["tp2"])


@pytest.mark.slow
def test_replicas_and_pipelines_with_tp_on_four_ranks(four_ranks: Ran) -> None:
    """tp=2 x 2 replicas of one stage; two stages of tp=2 each, two microbatches (every rank of a group
    receives the boundary tensors); and tp 2 x 1 replica beside tp 1 x 2 replicas, both ways round (a boundary
    that splits the rows between replicas and moves them between degrees)."""
    reports, builds = four_ranks.reports, four_ranks.builds
    for name in ("tp2x2", "pipe-tp2-tp2", "pipe-tp21-x12", "pipe-tp12-x21"):
        _check(reports, builds[name])
    assert [r[builds["pipe-tp2-tp2"][1]]["stage"] for r in reports] == [0, 0, 1, 1]
    assert [r[builds["pipe-tp21-x12"][1]]["tp"] for r in reports] == [2, 2, 1, 1]


@pytest.mark.slow
def test_transformers_llama_tp2_on_two_ranks(two_ranks: Ran) -> None:
    """A transformers Llama (torch.export graph: linear layers as aten.linear on lifted weights, rotary
    embeddings inside the attention unit, the model's own loss); its LM head feeds the loss, so it stays whole."""
    _check(two_ranks.reports, two_ranks.builds["llama-tp2"])


@pytest.mark.slow
def test_zero_over_the_data_parallel_groups_of_tp2_replicas(four_ranks: Ran) -> None:
    """tp=2 x 2 replicas on 4 ranks under ZeRO-1, 2 and 3: each shard is a slice of this rank's tensor-parallel
    slices, over its data-parallel group; losses and parameters after 3 AdamW steps are eager's."""
    for z in (ZeroStage.OS, ZeroStage.OS_G, ZeroStage.OS_G_P):
        _check(four_ranks.reports, four_ranks.builds[f"tp2x2-zero{int(z)}"], grads=False)


@pytest.mark.slow
def test_recompute_repeats_the_tensor_parallel_collectives(four_ranks: Ran) -> None:
    """Two stages of tp=2 that recompute (their layers in a region graph, sharded the same way): the
    recomputed forward repeats each all-reduce in the same order on both ranks of a group."""
    build = four_ranks.builds["tp2-recompute"]
    text = Path(build[1], "stage_0.py").read_text()
    assert "ops.checkpoint(" in text and "ops.tp_row(hpml_tp" in text, text
    _check(four_ranks.reports, build)


@pytest.mark.slow
def test_pipelines_of_tp_2_then_1_and_1_then_2_on_three_ranks(tmp_path: Path) -> None:
    """Two stages of different tp on 3 ranks, a GPT and a transformers Llama: a tp-2 stage's output goes
    forward from its place 0 and the gradient comes back to both places; a tp-1 stage's output goes to both
    places of the tp-2 stage after it, whose place 0 sends the gradient back."""
    builds = [_build(tmp_path, model, f"{model}-tp{a}{b}", 2, [a, b], [1, 1], microbatches=2)
              for model in ("gpt-tiny-untied", "llama") for a, b in ((2, 1), (1, 2))]
    reports = _run(tmp_path, 3, *builds)
    for b in builds:
        _check(reports, b)
        assert [r[b[1]]["stage"] for r in reports] == ([0, 0, 1] if "tp21" in b[1] else [0, 1, 1])
        assert [r[b[1]]["tp"] for r in reports] == ([2, 2, 1] if "tp21" in b[1] else [1, 2, 2])


@pytest.mark.slow
def test_zb_h1_runs_tp2_stages_on_four_ranks(four_ranks: Ran) -> None:
    """ZB-H1 on two stages of tp=2: each backward's input-gradient part runs the all-reduces of the inputs'
    gradients (the same ones, in the same order, on both ranks of a group), its weight-gradient part none;
    a GPT with its own head at 2 and 4 microbatches and a transformers Llama at 4."""
    for name in ("zb-gpt-tiny-untied-m2", "zb-gpt-tiny-untied-m4", "zb-llama-m4"):
        b = four_ranks.builds[name]
        _check(four_ranks.reports, b)
        assert [r[b[1]]["stage"] for r in four_ranks.reports] == [0, 0, 1, 1]


def test_what_the_runtime_cannot_run_is_refused_by_name(tmp_path: Path) -> None:
    """Weights tied between stages of different tp, tp with swap, and a tensor-parallel build in one process."""
    _, gm = _traced("gpt-tiny")
    with pytest.raises(PlanError, match=r"stages \[0, 1\] share parameters \(tied weights\).*\[2, 1\]"):
        generate(gm, _tp_plan(gm, "gpt-tiny", 2, [2, 1], [1, 1]), tmp_path / "mixed")
    swap = _tp_plan(gm, "gpt-tiny", 1, [2], [1])
    swap = replace(swap, stages=(replace(swap.stages[0], swap=swap.stages[0].nodes[-3:]),))
    with pytest.raises(PlanError, match="swap"):
        generate(gm, swap, tmp_path / "swap")
    _, build = _build(tmp_path, "gpt-tiny", "tp2", 1, [2], [1])
    with pytest.raises(HpmlError, match="ranks of their own"):
        Pipeline.from_build(build, _subject("gpt-tiny").module)  # not the traced one, which later tests build from


def _resume_worker(rank: int, world: int, sharded: str, plain: str, tmp: str) -> None:
    """Two steps under ``plain`` (tp=1, 2 replicas) and a checkpoint; the third step under ``sharded`` (tp=2)
    resumed from it, and a checkpoint; that one loaded under ``plain`` again."""
    torch.set_num_threads(1)
    dist.barrier()
    dist.destroy_process_group()
    ref_losses, _, ref_state = _reference("gpt-tiny")

    def pipeline(build: str, name: str) -> tuple[Pipeline, Subject]:
        sub = _subject("gpt-tiny")  # a fresh model: what it trains on comes from the checkpoint
        init = f"file://{tmp}/rendezvous-{name}?rank={rank}&world_size={world}"
        return Pipeline.from_build(build, sub.module, init_method=init, optimizer=_optimizer, events=False), sub

    pipe, sub = pipeline(plain, "a")
    for x, y in sub.batches[:2]:
        pipe.step(x, y, sub.loss_fn)
    pipe.save(Path(tmp, "ckpt-tp1"))
    pipe.close()
    pipe, sub = pipeline(sharded, "b")
    meta = pipe.load(Path(tmp, "ckpt-tp1"))
    x, y = sub.batches[2]
    loss = pipe.step(x, y, sub.loss_fn).item()
    pipe.save(Path(tmp, "ckpt-tp2"))
    pipe.close()
    pipe, sub = pipeline(plain, "c")
    again = pipe.load(Path(tmp, "ckpt-tp2"))
    state = pipe.state_dict()
    pipe.close()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps({
        "steps": [meta["step"] if meta else None, again["step"] if again else None], "loss": abs(loss - ref_losses[2]),
        "state": max((state[k] - v).abs().max().item() for k, v in ref_state.items())}))


@pytest.mark.slow
def test_checkpoints_move_between_tp1_and_tp2(tmp_path: Path) -> None:
    """A checkpoint written under tp=1 resumes under tp=2 (each rank keeps its slices of the parameters and of
    AdamW's moments), and one written under tp=2 (whole tensors) loads under tp=1."""
    _, sharded = _build(tmp_path, "gpt-tiny", "tp2", 1, [2], [1])
    _, gm = _traced("gpt-tiny")
    generate(gm, split_plan(gm, "gpt-tiny", 1, replicas=[2]), tmp_path / "dp2")
    spawn_ranks(_resume_worker, 2, tmp_path, sharded, str(tmp_path / "dp2"), str(tmp_path))
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["steps"] == [2, 3], got
        assert got["loss"] < TOL and got["state"] < TOL, got


@pytest.mark.slow
def test_hpml_compile_run_trains_a_tp2_build(tmp_path: Path) -> None:
    """`hpml-compile run` on a tp=2 build (torchrun, 2 ranks): the losses it prints are eager's, and each rank
    writes its own measurements."""
    loaded = models.load("gpt-tiny", batch_size=8, seq_len=16, seed=0)
    gm = trace(loaded.module, loaded.example_inputs)
    generate(gm, _tp_plan(gm, "gpt-tiny", 1, [2], [1]), tmp_path / "build",
             recipe=ModelRecipe("gpt-tiny", 8, 16, 0, threads_per_rank=1))
    r = subprocess.run([sys.executable, "-m", "hpml_compile", "run", str(tmp_path / "build"), "--nproc", "2",
                        "--steps", "3", "--run-dir", str(tmp_path / "run"), "--no-report"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = [float(x) for x in re.findall(r"step\s+\d+/3\s+loss\s+([0-9.]+)", r.stdout)]
    model = loaded.module
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the run's default optimizer
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = loaded.loss_fn(model(*loaded.example_inputs), loaded.example_targets)
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert got == pytest.approx(want, abs=2e-4), (got, want, r.stdout)  # printed with 4 decimals, once
    assert sorted(p.name for p in (tmp_path / "run" / "metrics").glob("rank*.jsonl")) == ["rank0.jsonl", "rank1.jsonl"]
