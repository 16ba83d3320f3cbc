"""Runtime overhead: our runtime against a hand-written torch.distributed.pipelining script, same split and schedule.

Both train the same model (same seed) split at the same layer into the same
number of stages, with the same schedule, microbatches and optimizer, on the
same gloo ranks of this machine (one torch thread each), in one launch. They
alternate in rounds (ours, theirs, ours, ...) so that a change in the
machine's background load hits both; each round runs ``--steps`` steps
between two barriers. The hand-written side is what a user would write with
``torch.distributed.pipelining``: a ``PipelineStage`` around a hand-made
module per stage (embedding + first layers; last layers + head),
``Schedule1F1B``/``ScheduleGPipe``, and an all-reduce of the tied embedding's
gradient (the build does the same: ``ALLREDUCE.shm(0,1)``). Our side is
:class:`hpml_compile.runtime.Pipeline` on a build cut at the same node, with
its monitoring on; a second copy of it with the per-step events and host
sampling off (``Pipeline(events=False)``) gives the cost of those.

Run:  .venv/bin/python benchmarks/runtime_overhead/main.py [--model gpt-mini] [--schedule 1f1b]
Prints a table; writes benchmarks/runtime_overhead/results/runtime_overhead-<model>-<schedule>-m<M>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.plan import Schedule
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.trace import trace

HERE = Path(__file__).resolve().parent
EVENTS_OFF = "ours, events off"


class First(nn.Module):
    """Stage 0 by hand: embeddings and the first ``k`` blocks of the zoo GPT."""

    def __init__(self, gpt: nn.Module, k: int) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.layers = nn.ModuleList(gpt.layers[:k])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe.weight[: idx.size(1)])
        for layer in self.layers:
            x = layer(x, None, None)
        return x


class Last(nn.Module):
    """Stage 1 by hand: the remaining blocks, the final norm and the (tied) head."""

    def __init__(self, gpt: nn.Module, k: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(gpt.layers[k:])
        self.norm, self.lm_head = gpt.norm, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, None, None)
        return self.lm_head(self.norm(x))


def _load(model: str) -> models.LoadedModel:
    return models.load(model, seed=0)


def _ours(build_dir: str, model: str, run_dir: str, events: bool = True) -> tuple[Any, Any]:
    loaded = _load(model)
    pipe = Pipeline.from_build(build_dir, loaded.module, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                               run_dir=run_dir, events=events)

    def step() -> float:
        return pipe.step(loaded.example_inputs, loaded.example_targets, loaded.loss_fn).item()

    return step, pipe


def _theirs(model: str, k: int, schedule: str, microbatches: int, rank: int) -> Any:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    loaded = _load(model)
    gpt = loaded.module
    part = First(gpt, k) if rank == 0 else Last(gpt, k)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = cls(stage, n_microbatches=microbatches, loss_fn=loaded.loss_fn)
    opt = torch.optim.AdamW(part.parameters(), lr=1e-3)
    tied = gpt.wte.weight  # stage 0 uses it as the embedding, stage 1 as the head: sum the two gradients

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(loaded.example_inputs[0])
        else:
            sched.step(target=loaded.example_targets, losses=losses)
        grad = tied.grad if tied.grad is not None else torch.zeros_like(tied)
        dist.all_reduce(grad)
        tied.grad = grad
        opt.step()
        return float(torch.stack(losses).detach().mean()) if losses else float("nan")

    return step


def _worker(rank: int, world: int, args: argparse.Namespace, build_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    ours, pipe = _ours(build_dir, args.model, str(Path(out) / "ours"))
    quiet, pipe_quiet = _ours(build_dir, args.model, str(Path(out) / "ours-no-events"), events=False)
    theirs = _theirs(args.model, args.cut_layer, args.schedule, args.microbatches, rank)
    times: dict[str, list[float]] = {"ours": [], EVENTS_OFF: [], "torch.distributed.pipelining": []}
    first: dict[str, float] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms all up and is not counted
        for name, step in (("ours", ours), (EVENTS_OFF, quiet), ("torch.distributed.pipelining", theirs)):
            dist.barrier()
            t0 = time.perf_counter()
            losses = [step() for _ in range(args.steps)]
            dist.barrier()
            if rnd == 0:
                first[name] = losses[0]
            else:
                times[name].append((time.perf_counter() - t0) / args.steps)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"times": times, "first_loss": first}))
    pipe.monitor.close()
    pipe_quiet.monitor.close()


def _events_cost(root: Path, events: int = 40, steps: int = 200) -> float:
    """Milliseconds per step of recording ``events`` events, sampling the host and writing, in isolation."""
    from hpml_compile.runtime.observe.events import EventLog, EventStore
    from hpml_compile.runtime.observe.host import HostSampler

    log, store, host = EventLog(0), EventStore(root / "events-alone", 0), HostSampler([os.getpid()])
    t0 = time.perf_counter()
    for step in range(steps):
        log.begin()
        host.begin()
        for i in range(events):
            t = time.perf_counter()
            log.add("F", t, time.perf_counter(), 0, i, 1, 4096, i)
        host.end()
        store.write(log.finish(step))
    store.close()
    return (time.perf_counter() - t0) / steps * 1e3


def _build(args: argparse.Namespace, root: Path) -> str:
    loaded = _load(args.model)
    gm = trace(loaded.module, loaded.example_inputs)
    cut = [n.name for n in gm.graph.nodes if n.meta.get("hpml") is not None
           and getattr(n.meta["hpml"], "scope", "") == f"layers.{args.cut_layer - 1}"][-1]  # the block's last add
    plan = split_plan(gm, args.model, 2, microbatches=args.microbatches, after=[cut], schedule=Schedule(args.schedule))
    generate(gm, plan, root / "build")
    return str(root / "build")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--cut-layer", type=int, default=3, dest="cut_layer", help="stage 1 starts at this block")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="steps per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--publish", action="store_true",
                   help="also write benchmarks/results/peers_pipelining-<model>.json (a README row)")
    p.add_argument("--machine", default=None, help="the machine, as the published row names it (with --publish)")
    args = p.parse_args(argv)
    if args.publish and not args.machine:
        p.error("--publish needs --machine (e.g. '2-core AMD EPYC VM, quiet')")
    root = Path(tempfile.mkdtemp(prefix="hpml-overhead-"))
    build_dir = _build(args, root)
    t0 = time.perf_counter()
    spawn_ranks(_worker, 2, root, args, build_dir, str(root))
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    rows = {}
    loaded = _load(args.model)
    batch = loaded.batch_size
    for name in ranks[0]["times"]:
        per_step = [max(a, b) for a, b in zip(ranks[0]["times"][name], ranks[1]["times"][name])]
        med = statistics.median(per_step)
        rows[name] = {"step_ms_median": med * 1e3, "step_ms_rounds": [t * 1e3 for t in per_step],
                      "samples_per_s": batch / med, "first_loss": ranks[1]["first_loss"][name]}
    ours, theirs = rows["ours"], rows["torch.distributed.pipelining"]
    ratio = ours["samples_per_s"] / theirs["samples_per_s"]
    print(f"{args.model}, 2 gloo ranks (1 thread each), 2 stages cut before block {args.cut_layer}, "
          f"{args.schedule}, {args.microbatches} microbatches, batch {batch}; {args.rounds} rounds x {args.steps} "
          f"steps, alternating")
    print(f"  {'runtime':30s} {'step ms':>9s} {'samples/s':>10s} {'first loss':>11s}")
    for name, r in rows.items():
        print(f"  {name:30s} {r['step_ms_median']:9.1f} {r['samples_per_s']:10.2f} {r['first_loss']:11.4f}")
    print(f"  ours / hand-written throughput: {ratio:.3f} (goal >= 0.95)")
    # paired by round (the two ran back to back): the machine's load changes between rounds more than this
    events_cost = statistics.median(a / b for a, b in zip(ours["step_ms_rounds"], rows[EVENTS_OFF]["step_ms_rounds"])) - 1
    alone_ms = _events_cost(root)
    print(f"  per-step events and host sampling: {events_cost:+.1%} step time (median over rounds of ours against "
          f"ours with them off); alone: {alone_ms:.2f} ms per step of 40 events")
    result = {"benchmark": "runtime_overhead", "command": " ".join([sys.executable, *sys.argv]),
              "model": args.model, "schedule": args.schedule, "microbatches": args.microbatches,
              "cut_layer": args.cut_layer, "steps_per_round": args.steps, "rounds": args.rounds, "batch": batch,
              "runtimes": rows, "throughput_ratio": ratio, "events_overhead": events_cost, "events_alone_ms": alone_ms, "goal": 0.95, "meets_goal": ratio >= 0.95,
              "wall_s": time.perf_counter() - t0,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}}
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    path = out / f"runtime_overhead-{args.model}-{args.schedule}-m{args.microbatches}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    if args.publish:
        print(f"wrote {_publish(args, rows, ratio)}")
    return 0


def _publish(args: argparse.Namespace, rows: dict[str, dict[str, Any]], ratio: float) -> Path:
    """The run as a README row: our generated pipeline against torch.distributed.pipelining's, same run."""
    sys.path.insert(0, str(HERE.parent))
    import results_table  # the README's table, beside this folder
    row = {"claim": f"Our generated 2-stage pipeline against torch.distributed.pipelining's {args.schedule.upper()} "
                    f"on the same cut, {args.model}, {args.microbatches} microbatches, 2 gloo ranks, one launch, "
                    "rounds alternating",
           "figure": "ours {ours_ms[0]:.0f} ms, torch.distributed.pipelining {theirs_ms[0]:.0f} ms a step: "
                     "throughput {ratio[0]:.2f}x theirs",
           "figures": {"ratio": [round(ratio, 3)], "ours_ms": [round(rows["ours"]["step_ms_median"], 1)],
                       "theirs_ms": [round(rows["torch.distributed.pipelining"]["step_ms_median"], 1)]},
           "goal": "at least 1.0x (ours at least as fast)",
           "command": f"python benchmarks/runtime_overhead/main.py --model {args.model} --schedule {args.schedule} "
                      f"--microbatches {args.microbatches} --rounds {args.rounds} --steps {args.steps}",
           "machine": args.machine, "details": "benchmarks/runtime_overhead/README.md"}
    return results_table.publish(f"peers_pipelining-{args.model}", row)


if __name__ == "__main__":
    sys.exit(main())
