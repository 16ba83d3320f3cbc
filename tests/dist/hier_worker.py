"""One rank of tests/dist/test_hierarchical_dist.py, started by torchrun (two agents standing in for two hosts).

Writes ``rank<r>.json``: the hierarchical all-reduce against the flat one on
random and integer tensors, and the parameters after one SGD step of the flat
and the hierarchical build (so the gradients, since ``p1 = p0 - lr * grad``):
SkipNet on one stage of four replicas, and gpt-tiny on two stages of two
replicas, one stage per host, whose tied embedding is all-reduced over both.
The hierarchical builds run once more with the buckets forced on
(``overlap=True``, buckets of 393 floats: each pads to the host's two ranks),
recording when each bucket's collectives started; and three chains of the
overlapped path (:class:`~hpml_compile.runtime.sync.comm.ChainQueue`) are driven to
the end by polls alone, as the gradient hooks drive them.
"""

from __future__ import annotations

import faulthandler
import json
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpml_compile import models
from hpml_compile.testing import SkipNet, skipnet_batch, skipnet_loss
from hpml_compile.plan import load_plan
from hpml_compile.runtime import Pipeline
from hpml_compile.runtime.sync.comm import (ChainQueue, CommStats, PendingChain, hierarchical_all_reduce,
                                       hierarchical_levels, make_hierarchy)

LR = 0.5
BUCKET_MB = 393 * 4 / 2**20  # several buckets of SkipNet's 2004 parameters, each an odd number of floats


def gpt_tiny() -> models.LoadedModel:
    """gpt-tiny, whose token embedding and LM head share one weight (a tied group across two stages)."""
    return models.load("gpt-tiny", batch_size=8, seq_len=16, seed=0)


def _buckets(pipe: Pipeline) -> dict[str, object]:
    """This rank's stage's overlapped buckets in the last step: how many, and what had started by the backward's end."""
    assert pipe.comm is not None
    grads = pipe.sync.buffer if pipe.sync is not None else None
    b = getattr(grads, "buckets", None)
    if b is None:
        return {"count": 0}
    return {"count": len(b.members), "launched_in_backward": b.launched_in_backward,
            "launched_early": b.launched_early, "started_in_backward": b.started_in_backward,
            "levels_in_backward": b.levels_in_backward}


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
    # the overlapped path's chains, advanced by polls alone (as the gradient hooks do), then against the
    # hierarchical all-reduce run level by level after them
    queue, xs = ChainQueue(), [torch.randn(n, generator=g, dtype=torch.float64) for n in (5, 1000, 7)]
    chains = [queue.add(PendingChain(queue, *hierarchical_levels(x, mine), x, x, CommStats(), 0.0, 0, 4, 0))
              for x in (t.clone() for t in xs)]
    report["chain_started_at_add"] = [c.issued for c in chains]
    deadline = time.monotonic() + 60
    while queue.chains and time.monotonic() < deadline:
        chains[-1].poll()
        time.sleep(0.001)
    report["chains_finished_by_polls"] = [c.finished for c in chains]
    for c in chains:
        c.wait()
    report["chains_equal"] = [bool(torch.equal(c.out, hierarchical_all_reduce(x.clone(), mine)))
                              for c, x in zip(chains, xs)]
    x, y = skipnet_batch(rows=16)
    for name, build, overlap in (("flat", flat_build, None), ("hierarchical", hier_build, None),
                                 ("hierarchical_overlap", hier_build, True)):
        torch.manual_seed(0)
        model = SkipNet()
        pipe = Pipeline.from_build(build, model, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR), overlap=overlap,
                                   bucket_mb=BUCKET_MB)
        report[f"{name}_loss"] = float(pipe.step((x,), y, skipnet_loss))
        report[name] = {k: v.detach().flatten().tolist() for k, v in pipe.local_module().named_parameters()}
        assert pipe.comm is not None
        report[f"{name}_hierarchy"] = sorted(pipe.comm.hierarchy)  # the stages whose all-reduce is hierarchical
        m = pipe.metrics[-1]  # the bytes of each level, as the runtime counted them
        report[f"{name}_levels"] = [m.sync_intra_bytes, m.sync_inter_bytes, m.sync_flat_bytes]
        report[f"{name}_buckets"] = _buckets(pipe)
    for name, build, overlap in (("tied_flat", tied_flat, None), ("tied_hierarchical", tied_hier, None),
                                 ("tied_hierarchical_overlap", tied_hier, True)):
        loaded = gpt_tiny()
        pipe = Pipeline.from_build(build, loaded.module, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
                                   overlap=overlap)
        report[f"{name}_loss"] = float(pipe.step(loaded.example_inputs, loaded.example_targets, loaded.loss_fn))
        report[name] = {k: v.detach().flatten().tolist() for k, v in pipe.local_module().named_parameters()}
        assert pipe.comm is not None
        report[f"{name}_hierarchy"] = [list(k) for k in sorted(pipe.comm.hierarchy)]
        report[f"{name}_buckets"] = _buckets(pipe)
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:6])
