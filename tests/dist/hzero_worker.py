"""One rank of tests/dist/test_hier_zero_dist.py, started by torchrun (two agents standing in for two hosts).

Trains SkipNet (one stage on four CPU ranks, two per host) under a plan whose stage is ZeRO-1 with
``allreduce: hierarchical`` for a few AdamW steps, twice: as the plan runs it on CPU ranks (the two levels after
the backward, one bucket) and with the buckets forced on (``overlap=True``, buckets of 393 floats: each rank's
shard is then its piece of every bucket). The bucketed run then saves a checkpoint, takes two more steps, and
the checkpoint is resumed under the flat ZeRO-0 build, and under this build again, for the same two steps. Writes ``rank<r>.json``: per
run the losses, the final parameters, this rank's shard and optimizer-state sizes, the bytes it holds by part
(parameters as :mod:`hpml_compile.runtime.observe.held` counts them; gradients: the flat buffer and the shard's own),
its Adam moments (every host holds the same shards), the bytes the runtime counted at each level, the
buckets launched during the backward, and the resumed losses.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hpml_compile.testing import SkipNet, skipnet_batch, skipnet_loss
from hpml_compile.runtime import Pipeline
from hpml_compile.runtime.sync.zero import FlatShard

LR = 0.01
STEPS = 3  # then a checkpoint, then 2 more
BUCKET_MB = 393 * 4 / 2**20  # several buckets of SkipNet's 2004 parameters


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step batches (16 rows each), the same in the test's one-process reference."""
    return [skipnet_batch(rows=16, seed=s) for s in range(STEPS + 2)]


def optimizer(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=LR)


def _run(hz_build: str, dp_build: str, out: Path, overlap: bool | None) -> dict[str, object]:
    data = batches()
    torch.manual_seed(0)
    pipe = Pipeline.from_build(hz_build, SkipNet(), optimizer=optimizer, overlap=overlap, bucket_mb=BUCKET_MB)
    losses = [float(pipe.step((x,), y, skipnet_loss)) for x, y in data[:STEPS]]
    assert pipe.comm is not None
    shard = pipe.sync.buffer if pipe.sync is not None else None
    assert isinstance(shard, FlatShard) and pipe.optimizer is not None and shard.grad_flat is not None
    # the prefetch (overlap): the last step's gathers in flight now, the earlier steps' waited by the next forward
    prefetch = [len(shard._gathers), shard.prefetched]
    if overlap:
        pipe.save(out / "ck")  # with the gathers in flight: the save waits for them
    state = pipe.optimizer.state[shard.param]
    m, held = pipe.metrics[-1], pipe.held
    assert held is not None and shard.param.grad is not None
    b = shard.buckets
    report: dict[str, object] = {
        "held_params": held.params, "held_optimizer": held.optimizer,
        "grad_storage": [shard.grad_flat.untyped_storage().nbytes(), shard.param.grad.untyped_storage().nbytes(),
                         shard.param.grad.untyped_storage().data_ptr() != shard.grad_flat.untyped_storage().data_ptr()],
        "optimizer_params": len(pipe.optimizer.param_groups[0]["params"]),
        "losses": losses, "hierarchy": sorted(pipe.comm.hierarchy), "replicas": shard.replicas,
        "local": shard.replica, "numel": shard.numel, "shard_numel": shard.param.numel(),
        "state_numel": {k: v.numel() for k, v in state.items() if isinstance(v, torch.Tensor)},
        "exp_avg": state["exp_avg"].tolist(),
        "buckets": None if b is None else [len(b.members), b.launched_in_backward, b.launched_early],
        "levels": [m.sync_intra_bytes, m.sync_inter_bytes, m.sync_flat_bytes], "prefetch": prefetch,
        "params": {k: v.flatten().tolist() for k, v in pipe.state_dict().items()},
    }
    if overlap:
        report["continued"] = [float(pipe.step((x,), y, skipnet_loss)) for x, y in data[STEPS:]]
        x, y = data[-1]  # an eval forward with the last step's gathers in flight: its hooks wait for them
        report["eval"] = [len(shard._gathers), pipe.eval_loss((x,), y, skipnet_loss), len(shard._gathers)]
        torch.manual_seed(1)  # other initial values: the checkpoint must bring them back
        flat = Pipeline.from_build(dp_build, SkipNet(), optimizer=optimizer)
        flat.load(out / "ck")
        report["resumed"] = [float(flat.step((x,), y, skipnet_loss)) for x, y in data[STEPS:]]
        report["resumed_params"] = {k: v.flatten().tolist() for k, v in flat.state_dict().items()}
        torch.manual_seed(2)  # and under this plan again, bucketed: each shard must take its pieces of the load
        again = Pipeline.from_build(hz_build, SkipNet(), optimizer=optimizer, overlap=True, bucket_mb=BUCKET_MB)
        again.load(out / "ck")
        report["resumed_here"] = [float(again.step((x,), y, skipnet_loss)) for x, y in data[STEPS:]]
        report["continued_params"] = {k: v.flatten().tolist() for k, v in pipe.state_dict().items()}
        flat.close()
        again.close()  # its last step's gathers in flight: a gather left pending at the group's end aborts the rank
    pipe.close()
    return report


def main(hz_build: str, dp_build: str, out: str) -> None:
    faulthandler.dump_traceback_later(150, exit=True)  # a hang ends as a traceback, not a test time-out
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    report = {"after": _run(hz_build, dp_build, Path(out), None), "buckets": _run(hz_build, dp_build, Path(out), True)}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
