"""One rank of tests/dist/test_hierarchical_dist.py, started by torchrun (two agents standing in for two hosts).

Writes ``rank<r>.json``: the hierarchical all-reduce against the flat one on
random and integer tensors, and the parameters after one SGD step of the flat
and the hierarchical build (so the gradients, since ``p1 = p0 - lr * grad``):
SkipNet on one stage of four replicas, and gpt-tiny on two stages of two
replicas, one stage per host, whose tied embedding is all-reduced over both.
"""

from __future__ import annotations

import faulthandler
import json
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hpml_compile import models
from hpml_compile.codegen.testing import SkipNet, skipnet_batch, skipnet_loss
from hpml_compile.plan import load_plan
from hpml_compile.runtime import Pipeline
from hpml_compile.runtime.comm import hierarchical_all_reduce, make_hierarchy

LR = 0.5


def gpt_tiny() -> models.LoadedModel:
    """gpt-tiny, whose token embedding and LM head share one weight (a tied group across two stages)."""
    return models.load("gpt-tiny", batch_size=8, seq_len=16, seed=0)


def main(flat_build: str, hier_build: str, tied_flat: str, tied_hier: str, out: str) -> None:
    faulthandler.dump_traceback_later(150, exit=True)  # a hang ends as a traceback, not a test time-out
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict[str, object] = {"agent": socket.gethostname(), "world": dist.get_world_size()}
    plan = load_plan(Path(hier_build) / "plan.json")
    groups = make_hierarchy(plan, [torch.device("cpu")] * dist.get_world_size())
    mine = groups[(0,)]
    report["per_host"] = mine.per_host
    g = torch.Generator().manual_seed(100 + rank)
    diffs, exact = [], []
    for n in (1, 3, 1000, 1001):  # lengths that do and do not split into the hosts' ranks
        x = torch.randn(n, generator=g, dtype=torch.float64)
        flat = x.clone()
        dist.all_reduce(flat)
        diffs.append(float((hierarchical_all_reduce(x.clone(), mine) - flat).abs().max()))
        ints = torch.randint(-1000, 1000, (n,), generator=g).to(torch.float32)  # sums exact in any order
        flat_i = ints.clone()
        dist.all_reduce(flat_i)
        exact.append(bool(torch.equal(hierarchical_all_reduce(ints.clone(), mine), flat_i)))
    report["random_max_diff"], report["integers_equal"] = diffs, exact
    x, y = skipnet_batch(rows=16)
    for name, build in (("flat", flat_build), ("hierarchical", hier_build)):
        torch.manual_seed(0)
        model = SkipNet()
        pipe = Pipeline.from_build(build, model, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        report[f"{name}_loss"] = float(pipe.step((x,), y, skipnet_loss))
        report[name] = {k: v.detach().flatten().tolist() for k, v in pipe.local_module().named_parameters()}
        assert pipe.comm is not None
        report[f"{name}_hierarchy"] = sorted(pipe.comm.hierarchy)  # the stages whose all-reduce is hierarchical
        m = pipe.metrics[-1]  # the bytes of each level, as the runtime counted them
        report[f"{name}_levels"] = [m.sync_intra_bytes, m.sync_inter_bytes, m.sync_flat_bytes]
    for name, build in (("tied_flat", tied_flat), ("tied_hierarchical", tied_hier)):
        loaded = gpt_tiny()
        pipe = Pipeline.from_build(build, loaded.module, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        report[f"{name}_loss"] = float(pipe.step(loaded.example_inputs, loaded.example_targets, loaded.loss_fn))
        report[name] = {k: v.detach().flatten().tolist() for k, v in pipe.local_module().named_parameters()}
        assert pipe.comm is not None
        report[f"{name}_hierarchy"] = [list(k) for k in sorted(pipe.comm.hierarchy)]
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:6])
