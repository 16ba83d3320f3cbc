"""Checkpoints across real gloo ranks: two stages write their halves; other splits read them back by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from hpml_compile.runtime import spawn_ranks
from hpml_compile.runtime.execute.checkpoint import latest, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.dist
CHILDREN = {0: ["0"], 1: ["2"]}  # rank -> the children of the full model it holds


def _full() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def _holding(names: list[str]) -> nn.ModuleDict:
    full = _full()
    return nn.ModuleDict({n: full[int(n)] for n in names})


def _train_and_save(rank: int, world: int, root: str) -> None:
    full = _full()
    opt = torch.optim.Adam(full.parameters(), lr=0.05)
    for step in range(2):  # every rank trains the same full model, then keeps only its stage
        opt.zero_grad()
        full(torch.ones(4, 8) * (step + 1)).pow(2).mean().backward()
        opt.step()
    mine = nn.ModuleDict({n: full[int(n)] for n in CHILDREN[rank]})
    stage_opt = torch.optim.Adam(mine.parameters(), lr=0.05)
    stage_opt.load_state_dict(_slice_optimizer(opt, full, mine))
    save_checkpoint(root, 2, mine, stage_opt, extra={"plan": "two stages"})


def _slice_optimizer(opt: torch.optim.Optimizer, full: nn.Module, part: nn.Module) -> dict:
    ids = {id(p): i for i, p in enumerate(full.parameters())}
    state = opt.state_dict()
    keep = [ids[id(p)] for p in part.parameters()]
    group = {**state["param_groups"][0], "params": list(range(len(keep)))}
    return {"state": {j: state["state"][i] for j, i in enumerate(keep)}, "param_groups": [group]}


def _load_on_one_rank(rank: int, world: int, root: str, out: str) -> None:
    """Loaded under a 1-rank plan inside a process group: the whole model on one rank."""
    whole = _holding(["0", "2"])
    opt = torch.optim.Adam(whole.parameters(), lr=0.05)
    meta = load_checkpoint(latest(root), whole, opt)
    assert meta["world_size"] == 2 and meta["plan"] == "two stages"
    torch.save({"model": whole.state_dict(), "steps": [s["step"].item() for s in opt.state.values()]}, out)


def test_two_rank_checkpoint_loads_under_another_split(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    spawn_ranks(_train_and_save, 2, tmp_path, root)
    out = str(tmp_path / "loaded.pt")
    spawn_ranks(_load_on_one_rank, 1, tmp_path, root, out)
    ref = _full()
    opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    for step in range(2):
        opt.zero_grad()
        ref(torch.ones(4, 8) * (step + 1)).pow(2).mean().backward()
        opt.step()
    got = torch.load(out, weights_only=True)
    assert got["steps"] == [2.0] * 4, "Adam's step counters came back for every parameter"
    for name, value in got["model"].items():
        torch.testing.assert_close(value, ref.state_dict()[name], rtol=0, atol=0)
