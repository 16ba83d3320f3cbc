"""Codegen of a stage with tp > 1: one rank's shard, readable in its stage file (no ranks run here)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.codegen.tensor_parallel import Places, replica_plan, tp_degree
from hpml_compile.errors import PlanError
from hpml_compile.testing import split_plan
from hpml_compile.trace import trace


def _build(tmp: Path, tp: int, recompute: bool = False) -> str:
    m = models.load("gpt-tiny", batch_size=4, seq_len=8, seed=0)
    gm = trace(m.module, m.example_inputs)
    plan = split_plan(gm, "gpt-tiny", 1, replicas=[tp])
    generate(gm, replace(plan, stages=(replace(plan.stages[0], tp=tp, recompute=recompute),)), tmp)
    return (tmp / "stage_0.py").read_text()


def test_a_tp2_stage_is_one_ranks_shard(tmp_path: Path) -> None:
    src = _build(tmp_path, 2)
    # 4 heads of 16 features: a rank of 2 runs 2 heads
    assert src.count("unflatten(-1, (2, 16))") == 6 and "(4, 16)" not in src
    assert src.count("ops.tp_copy(hpml_tp") == 4  # before each attention and MLP unit's column layers
    assert src.count("ops.tp_row(hpml_tp") == 4
    assert "ops.tp_embedding(hpml_tp, idx" in src and "ops.tp_head(hpml_tp" in src
    assert "TP = 2" in src
    assert "('layers.0.attn.o_proj.weight', 1)" in src and "('layers.0.attn.q_proj.bias', 0)" in src
    assert "o_proj.bias', " not in src  # a row layer's bias is whole, added once after the sum
    assert src.count("('wte.weight', 0)") == 1 and "lm_head.weight', 0" not in src  # tied: listed once


def test_a_recomputing_tp2_stage_shards_its_region(tmp_path: Path) -> None:
    """The layers of a stage that recomputes are in its region's graph: that graph is the one sharded, and the
    region reads the group itself; the stage's own graph only calls the region."""
    src = _build(tmp_path, 2, recompute=True)
    region, stage = src.split("class Stage0(StageModule)")
    assert region.count("ops.tp_row(hpml_tp") == 4 and "hpml_tp = self.hpml_tp" in region
    assert "ops.checkpoint(" in stage and "tp_" not in stage.split("def forward")[1]
    assert "('layers.0.attn.o_proj.weight', 1)" in stage  # TP_SHARDS lists the region's slices


def test_a_tp1_build_is_unchanged(tmp_path: Path) -> None:
    src = _build(tmp_path, 1)
    assert "tp_" not in src and "TP_SHARDS" not in src and "(4, 16)" in src


def test_replica_plan_and_degree() -> None:
    m = models.load("gpt-tiny", batch_size=4, seq_len=8, seed=0)
    gm = trace(m.module, m.example_inputs)
    plan = split_plan(gm, "gpt-tiny", 2, replicas=[4, 2])
    plan = replace(plan, stages=(replace(plan.stages[0], tp=2), replace(plan.stages[1], tp=2)))
    assert tp_degree(plan) == 2
    assert [st.devices for st in replica_plan(plan, 1).stages] == [("cpu1", "cpu3"), ("cpu5",)]
    mixed = replace(plan, stages=(plan.stages[0], replace(plan.stages[1], tp=1)))  # 2 x tp 2, then 2 x tp 1
    assert tp_degree(mixed) == 2
    assert [st.devices for st in replica_plan(mixed, 1).stages] == [("cpu1", "cpu3"), ("cpu4", "cpu5")]
    places = Places.of(mixed)
    assert places.table(0) == [[0, 2], [4, 5]] and places.table(1) == [[1, 3], [4, 5]]
    assert [places.locate(r) for r in (3, 5)] == [(0, 1, 1), (1, 1, 0)]
    # forward: place 0 of the tp-2 stage sends, place 1 does not; backward: the tp-1 rank sends to both places
    assert places.send_places(0, 1, 0) == [0] and places.send_places(0, 1, 1) == []
    assert places.send_places(1, 0, 0) == [0, 1] and places.recv_place(0, 1, 1) == 0
    with pytest.raises(PlanError, match="swap"):
        tp_degree(replace(plan, stages=(replace(plan.stages[0], swap=plan.stages[0].nodes[-1:]), plan.stages[1])))
