"""One vocabulary for action tokens: the grammar round-trips, every kind a rank runs has a handler, collectives
name the implementation the plan gives them, the simulator replays the lowered lists, and an old build is
refused with a clear message."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpml_compile.cluster import load_cluster
from hpml_compile.codegen import generate, load_build
from hpml_compile.codegen.actions import GradSync, SyncKind, TokenKind, Transfer
from hpml_compile.errors import BuildMismatchError
from hpml_compile.memory import ZeroStage
from hpml_compile.plan import AllReduce, Plan, Schedule, Stage, with_comm
from hpml_compile.runtime.execute.executor import HANDLERS, actions_for
from hpml_compile.runtime.sync.hierarchy import HierGroups
from hpml_compile.runtime.sync.stage import Compressed, DataParallel, Sharded, Sharded3, StageSync, for_stage
from hpml_compile.schedule import (COMPUTE, MARKERS, RANK_KINDS, REGIONS, Action, ActionKind, SyncImpl, lower, op_order,
                                   parse_actions, parse_token, stage_lists, sync_impl)
from hpml_compile.trace import trace

ONE_CHUNK = [s for s in Schedule if s is not Schedule.INTERLEAVED]  # interleaved 1F1B: test_interleaved.py


@pytest.mark.parametrize("token", ["ALLREDUCE.flat(0,3)", "REDUCESCATTER.shm(1)", "ALLGATHER.hier(1)",
                                   "ALLREDUCE.powersgd(2)", "ALLREDUCE(0,1)", "0SEND1:3", "1RECV0:0", "2F7", "OPT1"])
def test_rank_tokens_print_as_they_parse(token: str) -> None:
    a = Action.parse(token)
    assert str(a) == token
    assert parse_token(token) == (a.kind, a.stages)


@pytest.mark.parametrize("token", ["0SEND1", "1RECV0", "SWAP2", "RECOMPUTE0", "ALLREDUCE.shm(0,2)"])
def test_a_stage_summary_uses_the_same_grammar(token: str) -> None:
    kind, stages = parse_token(token)
    if kind in REGIONS:
        assert str(Action(kind, stages)) == token
    elif kind is ActionKind.SEND:
        assert str(Transfer.parse(token)) == token
    elif kind in (ActionKind.ALL_REDUCE,):
        g = GradSync.parse(token)
        assert (str(g), g.impl) == (token, "shm")
    else:
        assert kind is ActionKind.RECV and stages == (1, 0)


def test_one_enum_names_every_kind() -> None:
    assert TokenKind is ActionKind and SyncKind is ActionKind
    assert TokenKind("SWAP") is ActionKind.SWAP and SyncKind("ALLGATHER") is ActionKind.ALL_GATHER


@pytest.mark.parametrize("token, match", [("ALLREDUCE.ring(0)", "no collective implementation 'ring'"),
                                          ("0SEND1", "not a schedule action token"),
                                          ("SWAP1", "region of a stage")])
def test_a_bad_rank_token_is_named(token: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_actions([[token]])


def test_every_kind_a_rank_runs_has_a_handler() -> None:
    assert set(HANDLERS) == set(RANK_KINDS)
    assert not REGIONS & set(HANDLERS)


def _plan(cluster: str, devices: list[tuple[str, ...]], **stage: object) -> Plan:
    stages = tuple(Stage(k, d, (f"n{k}",), **stage) for k, d in enumerate(devices))  # type: ignore[arg-type]
    return Plan("m", load_cluster(cluster), Schedule.GPIPE, 1, stages)


def test_sync_impl_is_what_the_plan_names() -> None:
    cpus = _plan("local-cpu-4", [("cpu0", "cpu1"), ("cpu2", "cpu3")])
    assert sync_impl(cpus, (0,)) is SyncImpl.SHM and sync_impl(cpus, (0, 1)) is SyncImpl.SHM
    z3 = _plan("local-cpu-2", [("cpu0", "cpu1")], zero=ZeroStage.OS_G_P)
    assert sync_impl(z3, (0,)) is SyncImpl.ZERO3
    topk = _plan("local-cpu-2", [("cpu0", "cpu1")], compress="topk:0.01")
    assert sync_impl(topk, (0,)) is SyncImpl.TOPK
    assert sync_impl(replace(cpus, sync_every=4), (0,)) is SyncImpl.LOCAL
    hier = _plan("local-cpu-4", [("cpu0", "cpu1")], allreduce=AllReduce.HIERARCHICAL)
    assert sync_impl(hier, (0,)) is SyncImpl.HIER


@pytest.mark.parametrize("schedule", ONE_CHUNK)
@pytest.mark.parametrize("stages, microbatches", [(1, 1), (2, 3), (4, 4), (3, 8)])
def test_the_simulator_replays_the_lowered_lists(schedule: Schedule, stages: int, microbatches: int) -> None:
    lists = lower(schedule, microbatches, [1] * stages)
    for k, acts in enumerate(lists):
        compute = [(a.kind, a.microbatch) for a in acts if a.kind in COMPUTE]
        replayed = stage_lists(schedule, stages, microbatches)[k]
        assert [(a.kind, a.microbatch) for a in replayed if a.kind in COMPUTE] == compute
        assert [a for a in replayed if a.kind not in COMPUTE] == [a for a in acts if a.kind in MARKERS]
        assert compute == op_order(schedule, k, stages, microbatches)


def _replicated_build(tmp: Path) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    st = (Stage(0, ("cpu0", "cpu1"), ("input_1", "_0", "_1")), Stage(1, ("cpu2",), ("_2", "output")))
    plan = Plan("seq", load_cluster("local-cpu-3"), Schedule.GPIPE, 2, st)
    generate(trace(model, (torch.randn(8, 8),)), plan, tmp)
    return model, tmp


def test_collective_tokens_in_a_build_name_their_implementation(tmp_path: Path) -> None:
    model, out = _replicated_build(tmp_path)
    data = json.loads((out / "manifest.json").read_text())
    assert data["collectives"] == ["ALLREDUCE.shm(0)"]
    assert "ALLREDUCE.shm(0)" in data["ranks"][0]["actions"]
    assert load_build(out, model).actions[0][-3] == Action(ActionKind.ALL_REDUCE, (0,), impl="shm")


def test_local_sgd_averages_the_parameters_at_a_token_after_the_optimizer_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    st = (Stage(0, ("cpu0", "cpu1"), ("input_1", "_0", "_1")), Stage(1, ("cpu2",), ("_2", "output")))
    plan = Plan("seq", load_cluster("local-cpu-3"), Schedule.GPIPE, 2, st, sync_every=4)
    generate(trace(model, (torch.randn(8, 8),)), plan, tmp_path)
    build = load_build(tmp_path, model)
    tail = [str(a) for a in build.actions[0][-3:]]
    assert tail == ["LOSS", "OPT0", "ALLREDUCE.local(0)"]  # and its gradient token before them, as any stage's
    assert str(build.actions[0][-4]) == "ALLREDUCE.local(0)"
    assert list(build.stages[0].COLLECTIVES) == ["ALLREDUCE.local(0)"]  # one entry: the same parameters


def test_local_sgd_turned_on_at_run_time_adds_the_average_to_the_lists(tmp_path: Path) -> None:
    model, out = _replicated_build(tmp_path)
    build = load_build(out, model)
    running = with_comm(build.plan, sync_every=4)
    for lists in (actions_for(build, 2, running), actions_for(build, 4, running)):  # the build's count and more
        assert [str(a) for a in lists[0][-3:]] == ["LOSS", "OPT0", "ALLREDUCE.shm(0)"]
        assert [str(a) for a in lists[2][-2:]] == ["LOSS", "OPT1"]  # stage 1 has one replica: nothing to average
    assert [str(a) for a in actions_for(build, 2, build.plan)[0][-2:]] == ["LOSS", "OPT0"]


def test_a_version_1_build_with_collectives_asks_to_recompile(tmp_path: Path) -> None:
    model, out = _replicated_build(tmp_path)
    data = json.loads((out / "manifest.json").read_text())
    data["schema_version"] = 1
    data["collectives"] = ["ALLREDUCE(0)"]
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BuildMismatchError, match=r"manifest version 1.*regenerate the build"):
        load_build(out, model)


def _stage_params(seed: int = 0) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return module, list(module.parameters())


@pytest.mark.parametrize("stage, sharded, impl, cls", [
    ({}, True, SyncImpl.SHM, DataParallel),
    ({"compress": "topk:0.1"}, True, SyncImpl.TOPK, Compressed),
    ({"compress": "powersgd:1"}, True, SyncImpl.POWERSGD, Compressed),
    ({"zero": ZeroStage.OS}, True, SyncImpl.SHM, Sharded),
    ({"zero": ZeroStage.OS}, False, SyncImpl.SHM, DataParallel),  # no optimizer factory: nothing to shard
    ({"zero": ZeroStage.OS_G_P}, True, SyncImpl.ZERO3, Sharded3),
])
def test_for_stage_builds_the_implementation_the_plan_names(stage: dict[str, object], sharded: bool,
                                                            impl: SyncImpl, cls: type[StageSync]) -> None:
    plan = _plan("local-cpu-2", [("cpu0", "cpu1")], **stage)
    module, params = _stage_params()
    # the communicator's process groups are all for_stage reads here: none (a rank without overlap)
    comm = SimpleNamespace(groups={}, hierarchy={})
    sync = for_stage(plan, 0, comm, params, module, replica=0, sharded=sharded, overlap=False, bucket_bytes=1 << 20)
    assert type(sync) is cls and sync.impl is impl is sync_impl(plan, (0,))
    assert sync.stages == (0,) and (sync.shards != []) == isinstance(sync, Sharded)


def test_for_stage_shards_a_hierarchical_zero1_per_host() -> None:
    plan = _plan("local-cpu-4", [("cpu0", "cpu1")], zero=ZeroStage.OS, allreduce=AllReduce.HIERARCHICAL)
    module, params = _stage_params()
    comm = SimpleNamespace(groups={}, hierarchy={(0,): HierGroups(None, None, 1, 0)})
    sync = for_stage(plan, 0, comm, params, module, replica=0, sharded=True, overlap=False, bucket_bytes=1 << 20)
    assert isinstance(sync, Sharded) and sync.impl is SyncImpl.HIER and sync.shard.hier is comm.hierarchy[(0,)]


def test_a_stage_without_replicas_has_no_sync() -> None:
    module, params = _stage_params()
    plan = _plan("local-cpu-2", [("cpu0",)])
    assert for_stage(plan, 0, SimpleNamespace(groups={}, hierarchy={}), params, module, replica=0, sharded=True,
                     overlap=False, bucket_bytes=1 << 20) is None
