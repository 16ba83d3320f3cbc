"""The lowered schedule: tokens round-trip, lists round-trip through the manifest, the validator refuses bad orders."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from hpml_compile.cluster import load_cluster
from hpml_compile.codegen import generate, load_build
from hpml_compile.codegen.build import Manifest
from hpml_compile.errors import BuildMismatchError, ScheduleError
from hpml_compile.plan import Plan, Schedule, Stage
from hpml_compile.schedule import COMPUTE, Action, ActionKind, lower, op_order, parse_actions, relower
from hpml_compile.schedule_check import replay, validate
from hpml_compile.trace import trace

ONE_CHUNK = [s for s in Schedule if s is not Schedule.INTERLEAVED]  # interleaved 1F1B: test_interleaved.py

ROOT = Path(__file__).resolve().parents[2]


def _acts(*rows: str) -> list[tuple[Action, ...]]:
    return parse_actions([r.split() for r in rows])


@pytest.mark.parametrize("token", ["0F3", "12B0", "0SEND1:3", "1RECV0:3", "2SEND1:10", "ALLREDUCE(0,3)",
                                   "REDUCESCATTER(1)", "ALLGATHER(2)", "LOSS", "OPT0"])
def test_every_token_prints_and_parses_back(token: str) -> None:
    assert str(Action.parse(token)) == token


@pytest.mark.parametrize("token", ["0F", "F3", "0SEND1", "0RECV:1", "ALLREDUCE()", "OPT", "loss", "0X1"])
def test_bad_tokens_are_refused(token: str) -> None:
    with pytest.raises(ValueError, match="not a schedule action token"):
        Action.parse(token)


def test_action_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="microbatch"):
        Action(ActionKind.FORWARD, (0,))
    with pytest.raises(ValueError, match="stage"):
        Action(ActionKind.SEND, (0,), 1)


@pytest.mark.parametrize("schedule", ONE_CHUNK)
@pytest.mark.parametrize("replicas", [(1,), (1, 1), (2, 1), (1, 2, 1, 3)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_lowered_lists_validate_and_their_compute_is_op_order(schedule: Schedule, replicas: tuple[int, ...],
                                                              m: int) -> None:
    s = len(replicas)
    grad: list[list[str]] = [[] for _ in range(s)]
    if replicas[0] > 1:
        grad[0].append("ALLREDUCE(0)")  # data parallel, then the tied parameters of the first and last stage
    if s > 1:
        grad[0].append(f"ALLREDUCE(0,{s - 1})")
        grad[s - 1].append(f"ALLREDUCE(0,{s - 1})")
    ranks = lower(schedule, m, replicas, grad_sync=grad)
    validate(ranks, replicas)
    k = 0
    for rank, acts in enumerate(ranks):
        while rank >= sum(replicas[:k + 1]):
            k += 1
        compute = [(a.kind, a.microbatch) for a in acts if a.kind in COMPUTE]
        assert compute == op_order(schedule, k, s, m)
        assert [str(a) for a in acts][-2:] == ["LOSS", f"OPT{k}"]
    assert relower(ranks, replicas, schedule, m) == ranks
    assert len(relower(ranks, replicas, schedule, 2 * m)[0]) > len(ranks[0])


def test_1f1b_keeps_at_most_s_minus_i_microbatches_in_flight() -> None:
    ranks = lower(Schedule.ONE_F_ONE_B, 6, (1, 1, 1))
    for i, acts in enumerate(ranks):
        live = peak = 0
        for a in acts:
            live += {ActionKind.FORWARD: 1, ActionKind.BACKWARD: -1}.get(a.kind, 0)
            peak = max(peak, live)
        assert peak == 3 - i


def test_a_send_without_its_receive_is_refused() -> None:
    ranks = _acts("0F0 0SEND1:0 0B0 LOSS OPT0", "1F0 1B0 LOSS OPT1")
    with pytest.raises(ScheduleError, match=r"rank 0 \(stage 0, replica 0\): 0SEND1:0 .*no matching receive.*"
                                            r"rank 1 .*1RECV0:0 0 time"):
        validate(ranks, (1, 1))


def test_a_receive_waits_on_every_replica_of_its_peer() -> None:
    ranks = _acts("0F0 0SEND1:0 0B0", "0F0 0B0", "1RECV0:0 1F0 1B0")
    with pytest.raises(ScheduleError, match=r"rank 2 .*1RECV0:0.*no matching send.*rank 1 \(stage 0, replica 1\)"):
        validate(ranks, (2, 1))


def test_a_cyclic_wait_is_found_and_each_rank_named() -> None:
    # every message is matched, but each rank receives before it sends
    ranks = _acts("0RECV1:0 0F0 0SEND1:0 0B0", "1RECV0:0 1F0 1B0 1SEND0:0")
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 \(stage 0, replica 0\) waits at 0RECV1:0 for "
                                            r"1SEND0:0 from rank 1, which sits at 1RECV0:0; rank 1 .* waits at "
                                            r"1RECV0:0 for 0SEND1:0 from rank 0"):
        validate(ranks, (1, 1))


def test_gpipe_backward_before_forwards_downstream_deadlocks() -> None:
    # stage 1 waits for the gradient of microbatch 0 before it sends the activations of microbatch 1
    ranks = _acts("0F0 0SEND1:0 0F1 0SEND1:1 0RECV1:0 0B0 0RECV1:1 0B1",
                  "1RECV0:0 1F0 1B0 1RECV0:1 1F1 1B1 1SEND0:1 1SEND0:0")
    validate(ranks, (1, 1))  # sends never block: this order is fine
    bad = _acts("0F0 0SEND1:0 0RECV1:0 0B0 0F1 0SEND1:1 0RECV1:1 0B1",
                "1RECV0:0 1F0 1RECV0:1 1F1 1B1 1SEND0:1 1B0 1SEND0:0")
    with pytest.raises(ScheduleError, match=r"rank 0 .* waits at 0RECV1:0 .* rank 1 .* waits at 1RECV0:1"):
        validate(bad, (1, 1))


def test_a_rank_waiting_on_itself_is_refused() -> None:
    ranks = _acts("0F0 0B0", "1RECV1:0 1F0 1B0")
    with pytest.raises(ScheduleError, match=r"rank 1 \(stage 1, replica 0\): action 1RECV1:0 waits on its own stage"):
        validate(ranks, (1, 1))


def test_a_collective_missing_a_member_deadlocks() -> None:
    ranks = _acts("0F0 0B0 ALLREDUCE(0,1) LOSS OPT0", "1F0 1B0 LOSS OPT1")
    with pytest.raises(ScheduleError, match=r"waits at collective ALLREDUCE\(0,1\) for rank\(s\) \[1\], which sit "
                                            r"at LOSS"):
        validate(ranks, (1, 1))


@pytest.mark.parametrize("rows, match", [
    (("0F0 0B0 1F0", "1F0 1B0"), r"rank 0 .*action 1F0 is not one of stage 0's"),
    (("0B0 0F0", "1F0 1B0"), r"0B0 comes before its forward 0F0"),
    (("0F0 0F0 0B0", "1F0 1B0"), r"microbatch 0 has 2 forward"),
    (("0F0 0B0",), r"1 action lists for 2 ranks"),
    (("0SEND1:0 0F0 0B0", "1RECV0:0 1F0 1B0"), r"rank 0 .*0SEND1:0 must come after 0F0, the forward that produces"),
    (("0F0 0SEND1:0 0B0", "1F0 1RECV0:0 1B0"), r"rank 1 .*1RECV0:0 must come before 1F0, the forward that reads"),
    (("0F0 0SEND1:0 0B0 0RECV1:0", "1RECV0:0 1F0 1B0 1SEND0:0"), r"0RECV1:0 must come before 0B0, the backward"),
])
def test_malformed_lists_are_refused(rows: tuple[str, ...], match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        validate(_acts(*rows), (1, 1))


def test_replay_orders_by_key_within_what_may_run() -> None:
    ranks = lower(Schedule.GPIPE, 2, (1, 1))
    order = replay(ranks, (1, 1), key=lambda rank, a: (0,) if a.kind not in (ActionKind.FORWARD, ActionKind.BACKWARD)
                   else (a.kind is ActionKind.BACKWARD, a.microbatch or 0, rank))
    compute = [str(a) for _, a in order if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD)]
    assert compute == ["0F0", "1F0", "0F1", "1F1", "1B0", "0B0", "1B1", "0B1"]


def _build(tmp: Path, schedule: Schedule = Schedule.ONE_F_ONE_B, replicas: tuple[int, int] = (2, 1)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(8, 8)
    names = iter(f"cpu{i}" for i in range(sum(replicas)))
    devs = [tuple(next(names) for _ in range(d)) for d in replicas]
    st = (Stage(0, devs[0], ("input_1", "_0", "_1")), Stage(1, devs[1], ("_2", "output")))
    plan = Plan("seq", load_cluster(f"local-cpu-{sum(replicas)}"), schedule, 2, st)
    return model, generate(trace(model, (x,)), plan, tmp)


def test_action_lists_round_trip_through_the_manifest(tmp_path: Path) -> None:
    model, build = _build(tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert [(r["stage"], r["replica"]) for r in data["ranks"]] == [(0, 0), (0, 1), (1, 0)]
    assert data["ranks"][0]["actions"][:3] == ["0F0", "0SEND1:0", "0F1"]
    assert "ALLREDUCE.shm(0)" in data["ranks"][1]["actions"]  # CPU replicas of one host: shared memory
    assert Manifest.from_dict(data).to_dict() == data
    loaded = load_build(tmp_path, model)
    assert loaded.actions == build.actions
    assert [[str(a) for a in acts] for acts in loaded.actions] == [r["actions"] for r in data["ranks"]]


def test_a_build_without_lists_lowers_them_from_its_plan(tmp_path: Path) -> None:
    model, build = _build(tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    del data["ranks"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    assert load_build(tmp_path, model).actions == build.actions


def test_load_build_refuses_lists_that_deadlock(tmp_path: Path) -> None:
    model, _ = _build(tmp_path, Schedule.GPIPE, (1, 1))
    data = json.loads((tmp_path / "manifest.json").read_text())
    acts = data["ranks"][1]["actions"]  # 1RECV0:0 1F0 1RECV0:1 1F1 1B0 1SEND0:0 ...: wait for mb 1 before sending
    data["ranks"][1]["actions"] = ["1RECV0:0", "1F0", "1B0", "1SEND0:0", "1RECV0:1", "1F1", "1B1", "1SEND0:1",
                                   *acts[8:]]
    data["ranks"][0]["actions"] = ["0F0", "0SEND1:0", "0RECV1:0", "0B0", "0F1", "0SEND1:1", "0RECV1:1", "0B1",
                                   *data["ranks"][0]["actions"][8:]]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    load_build(tmp_path, model)  # an interleaved order is fine
    data["ranks"][0]["actions"][:4] = ["0RECV1:0", "0F0", "0SEND1:0", "0B0"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 \(stage 0, replica 0\) waits at 0RECV1:0"):
        load_build(tmp_path, model)
    data["ranks"][0]["actions"][0] = "0RECV1"
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BuildMismatchError, match="rank 0: not a schedule action token: '0RECV1'"):
        load_build(tmp_path, model)


def test_the_schedule_imports_no_later_pass() -> None:
    tree = ast.parse((ROOT / "hpml_compile" / "schedule.py").read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert mods <= {"__future__", "enum", "re", "collections", "dataclasses", "typing", "errors", "plan", "memory", "functools",
                    "interleave"}, mods
