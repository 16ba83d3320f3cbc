"""A worker rank of :class:`hpml_compile.infer.engine.Generator`: one pipeline stage, run until told to stop.

Started by the generator as
``python -m hpml_compile.infer.worker PLAN RANK WORLD PORT THREADS TIMEOUT_S SLOW READ_FD WRITE_FD``
(``SLOW``: JSON, null or ``[factor, from_run]``, a slowdown to inject on purpose; ``READ_FD``/``WRITE_FD``:
its ends of the generator's ring of pipes, :mod:`.handoff`); not a command for users. It joins the gloo
group on localhost, builds its stage (the model from the plan's seed, cut to its blocks), then waits for a
request's shape from rank 0 and runs the loop the engine's docstring describes: receive from the previous
stage, step, send to the next (the last stage sends the greedy tokens, and the logits when asked, back to
rank 0). After each generation every rank sends rank 0 the time it spent computing.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from .engine import OP_GENERATE, OP_NOOP, OP_STOP, StageClock, build_stage, gather_stage_ms, lanes_of
from .handoff import PipeLink
from .hf import HFStage
from .kv import Stage
from .plan import load_inference_plan

__all__ = ["serve_stage", "main"]


def serve_stage(stage: Stage | HFStage, rank: int, world: int, d_model: int, link: PipeLink,
                clock: StageClock | None = None) -> None:
    """Answer rank 0's requests until it sends the stop message (``link``: this rank's ends of the ring of pipes;
    ``clock``: times each step, see the engine)."""
    clock = clock or StageClock()
    while True:
        header = torch.empty(5, dtype=torch.long)
        dist.broadcast(header, src=0)
        op, n, m, new, want_logits = (int(v) for v in header)
        if op == OP_STOP:
            return
        if op == OP_NOOP:
            continue
        if op != OP_GENERATE:
            raise RuntimeError(f"rank {rank}: unknown request {op} from rank 0")
        lens = torch.empty(n, dtype=torch.long)
        dist.broadcast(lens, src=0)
        clock.begin()
        _generate(stage, rank, world, d_model, link, lens, m, new, bool(want_logits), clock)
        gather_stage_ms(clock.ms, world)


def _generate(stage: Stage | HFStage, rank: int, world: int, d_model: int, link: PipeLink, lens: torch.Tensor,
              m: int, new: int, want_logits: bool, clock: StageClock) -> None:
    lanes = lanes_of(len(lens), m)
    width = [int(lens[list(r)].max()) for r in lanes]
    for k, r in enumerate(lanes):
        stage.open(k, width[k] - lens[list(r)], width[k] + new)
    last = rank == world - 1
    for step in range(new):
        for k, r in enumerate(lanes):
            length = width[k] if step == 0 else 1
            h = torch.empty(len(r), length, d_model)
            link.recv(h)
            y = clock.time(stage.step, k, h.to(stage.dtype), 0 if step == 0 else width[k] + step - 1)
            y = y.float().cpu().contiguous()
            if last:
                link.send(y.argmax(-1))
                if want_logits:
                    link.send(y)
            else:
                link.send(y)
    link.flush()
    stage.close()


def main(argv: list[str]) -> int:
    """Entry point (see the module docstring)."""
    plan_path, rank, world, port, threads, timeout_s, slow, read_fd, write_fd = argv
    torch.set_num_threads(int(threads))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=int(world),
                            timeout=timedelta(seconds=float(timeout_s)))
    try:
        plan = load_inference_plan(plan_path)
        stage = build_stage(plan, int(rank))
        peers = f"rank {int(rank) - 1} / rank {(int(rank) + 1) % int(world)}"
        link = PipeLink(int(read_fd), int(write_fd), peers, float(timeout_s))
        serve_stage(stage, int(rank), int(world), stage.d_model, link, StageClock(json.loads(slow)))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
