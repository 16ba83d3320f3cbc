"""Runtime overhead against plain eager: our build, uncompiled and compiled, beside eager and torch.compile.

The same model from the same seed, the same batch, SGD, one torch thread per process, four ways, in
alternating rounds (each round runs ``--steps`` steps of every variant, so a change in the machine's load
hits all), the median round per variant, ratios to eager from the same run:

- **eager**: ``zero_grad``, forward, loss, ``backward``, ``step`` of the plain model;
- **ours**: the build's :class:`~hpml_compile.runtime.Pipeline` (events on, as ``compile`` returns it), stages
  uncompiled (``compile_stages="off"``);
- **ours compiled**: the same with ``compile_stages="on"`` (:mod:`hpml_compile.runtime.execute.compiled`);
- **torch.compile**: ``torch.compile`` of the plain model, the same loop as eager.

``--ranks 1``: one process, a one-stage build. ``--ranks 2``: two gloo ranks, data parallel: eager and
torch.compile wrap the model in ``DistributedDataParallel`` (torch.compile of the DDP module), each rank
training on its half of the batch; ours is a one-stage build with two replicas (ZeRO 0), given the whole
batch. Models: ``mlp`` (100 Linear+ReLU layers of width 16, batch 8: many small ops, where per-op
overhead shows) and any zoo model (``gpt-mini``). The compiled variants compile during the first, uncounted
round (tens of seconds on a CPU; on ranks at the third step, after the two that count memory eagerly).

Goals: ours / eager <= 1.10 (mlp) and <= 1.05 (gpt-mini); ours compiled / torch.compile <= 1.10.

Run::

    python benchmarks/runtime_overhead/eager.py --model mlp --ranks 1
    python benchmarks/runtime_overhead/eager.py --model gpt-mini --ranks 2
    python benchmarks/runtime_overhead/eager.py --model mlp --ranks 1 --publish --machine "2-core ..., quiet"

Prints a table with each variant's first loss, the batch's (on ranks eager's is the mean of the ranks'
halves, ours returns the batch's): the four start from the same weights and data, so the four agree.
``--json PATH`` writes the whole result there; ``--publish`` writes
``benchmarks/results/runtime_overhead_eager-<model>-<ranks>.json`` (the README's results table,
``benchmarks/results_table.py``), only when asked.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.testing import split_plan
from hpml_compile.trace import trace

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("eager", "ours", "ours compiled", "torch.compile")
GOALS = {"mlp": 1.10, "gpt-mini": 1.05}
WARMUP_STEPS = 4
Step = Callable[[], float]


def small_op_mlp(layers: int = 100, width: int = 16) -> nn.Module:
    """``layers`` x (Linear(width, width), ReLU), then Linear(width, 1), from seed 0."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(width, 1))


def load(model: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any, Callable[[Any, Any], torch.Tensor]]:
    """A fresh copy of ``model`` (same seed each call), its batch's inputs, targets and loss."""
    if model == "mlp":
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        return small_op_mlp(), (x,), y, nn.functional.mse_loss
    loaded = models.load(model, seed=0)
    return loaded.module, tuple(loaded.example_inputs), loaded.example_targets, loaded.loss_fn


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def _plain(module: nn.Module, inputs: tuple[Any, ...], targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
           params: list[nn.Parameter]) -> Step:
    opt = _sgd(params)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(module(*inputs), targets)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _half(value: Any, rank: int, world: int) -> Any:
    return value.chunk(world)[rank] if isinstance(value, torch.Tensor) else value


def variants(model: str, build: str, rank: int, world: int) -> dict[str, Step]:
    """The four steps, each over its own copy of the model."""
    steps: dict[str, Step] = {}
    for name in VARIANTS:
        module, inputs, targets, loss_fn = load(model)
        if name in ("eager", "torch.compile"):
            params = list(module.parameters())
            if world > 1:
                inputs = tuple(_half(x, rank, world) for x in inputs)
                targets = _half(targets, rank, world)
                module = nn.parallel.DistributedDataParallel(module)
            run = torch.compile(module) if name == "torch.compile" else module
            steps[name] = _plain(run, inputs, targets, loss_fn, params)
        else:
            pipe = Pipeline.from_build(build, module, optimizer=_sgd,
                                       compile_stages="on" if name == "ours compiled" else "off")

            def ours(pipe: Pipeline = pipe, inputs: tuple[Any, ...] = inputs, targets: Any = targets,
                     loss_fn: Callable[[Any, Any], torch.Tensor] = loss_fn) -> float:
                return pipe.step(inputs, targets, loss_fn).item()

            steps[name] = ours
    return steps


def measure(steps: dict[str, Step], rounds: int, per_round: int, barrier: Callable[[], None]) -> dict[str, Any]:
    """Alternating rounds; round 0 warms up (and compiles) and is not counted.

    Round 0 runs :data:`WARMUP_STEPS` steps: on ranks the first two steps of a shape count memory on the
    eager forward (:func:`hpml_compile.saved.counts_memory`), so a compiled stage compiles at the third.
    """
    times: dict[str, list[float]] = {k: [] for k in steps}
    first: dict[str, float] = {}
    for rnd in range(rounds + 1):
        for name, step in steps.items():
            barrier()
            t0 = time.perf_counter()
            losses = [step() for _ in range(per_round if rnd else WARMUP_STEPS)]
            barrier()
            if rnd:
                times[name].append((time.perf_counter() - t0) / per_round)
            else:
                first[name] = losses[0]
    return {"times": times, "first_loss": first}


def _worker(rank: int, world: int, model: str, build: str, rounds: int, per_round: int, out: str) -> None:
    torch.set_num_threads(1)
    result = measure(variants(model, build, rank, world), rounds, per_round, dist.barrier)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def make_build(model: str, ranks: int, root: Path) -> str:
    """A one-stage build: one replica, or ``ranks`` replicas (data parallel, ZeRO 0)."""
    module, inputs, _, _ = load(model)
    gm = trace(module, inputs)
    plan = split_plan(gm, model, 1, replicas=[ranks], zero=0) if ranks > 1 else split_plan(gm, model, 1)
    generate(gm, plan, root / "build")
    return str(root / "build")


def run(model: str, ranks: int, rounds: int, per_round: int) -> dict[str, Any]:
    """Measure; the per-variant median step (slowest rank per round) and the ratios."""
    root = Path(tempfile.mkdtemp(prefix="hpml-overhead-eager-"))
    build = make_build(model, ranks, root)
    if ranks == 1:
        torch.set_num_threads(1)
        per_rank = [measure(variants(model, build, 0, 1), rounds, per_round, lambda: None)]
    else:
        spawn_ranks(_worker, ranks, root, model, build, rounds, per_round, str(root), timeout_s=3600)
        per_rank = [json.loads((root / f"rank{r}.json").read_text()) for r in range(ranks)]
    ms = {}
    for name in VARIANTS:
        rounds_ms = [max(ts) * 1e3 for ts in zip(*(r["times"][name] for r in per_rank))]
        # the batch's loss: eager's ranks each see the loss of their half (equal halves: the mean is the batch's),
        # ours returns the batch's on every rank
        first = statistics.fmean(r["first_loss"][name] for r in per_rank)
        ms[name] = {"step_ms_median": statistics.median(rounds_ms), "step_ms_rounds": rounds_ms, "first_loss": first}
    eager = ms["eager"]["step_ms_median"]
    ratios = {"ours / eager": ms["ours"]["step_ms_median"] / eager,
              "ours compiled / eager": ms["ours compiled"]["step_ms_median"] / eager,
              "torch.compile / eager": ms["torch.compile"]["step_ms_median"] / eager,
              "ours compiled / torch.compile": ms["ours compiled"]["step_ms_median"]
              / ms["torch.compile"]["step_ms_median"]}
    return {"benchmark": "runtime_overhead/eager", "model": model, "ranks": ranks, "rounds": rounds,
            "steps_per_round": per_round, "variants": ms, "ratios": ratios,
            "goal_ours": GOALS.get(model), "load_average": os.getloadavg(),
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__}}


def published(result: dict[str, Any], machine: str, command: str) -> dict[str, Any]:
    """The result as a ``benchmarks/results`` row (:mod:`benchmarks.results_table`)."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    r = result["ratios"]
    where = "one process" if result["ranks"] == 1 else f"{result['ranks']} gloo ranks, data parallel"
    return {"claim": f"Step time of our build against plain eager, {result['model']}, {where}, one thread each",
            "figure": ("ours {ours[0]:.2f}x eager; compiled {compiled[0]:.2f}x eager, "
                       "{vs_tc[0]:.2f}x torch.compile"),
            "figures": {"ours": [round(r["ours / eager"], 3)], "compiled": [round(r["ours compiled / eager"], 3)],
                        "vs_tc": [round(r["ours compiled / torch.compile"], 3)],
                        "eager_ms": [round(result["variants"]["eager"]["step_ms_median"], 3)]},
            "goal": f"ours <= {result['goal_ours']:.2f}x eager; compiled <= 1.10x torch.compile"
            if result["goal_ours"] else "compiled <= 1.10x torch.compile",
            "command": command, "date": datetime.date.today().isoformat(), "commit": commit[:7],
            "machine": machine, "details": "benchmarks/runtime_overhead/README.md"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp", help="mlp (the small-op MLP) or a zoo model (gpt-mini)")
    p.add_argument("--ranks", type=int, choices=[1, 2], default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=None, help="steps per round (default: 50 for mlp, 3 otherwise)")
    p.add_argument("--json", type=Path, default=None, help="write the whole result to this file")
    p.add_argument("--publish", action="store_true", help="write benchmarks/results/runtime_overhead_eager-*.json")
    p.add_argument("--machine", default=None, help="the machine, as the published row names it (with --publish)")
    args = p.parse_args(argv)
    if args.publish and not args.machine:
        p.error("--publish needs --machine (e.g. '2-core AMD EPYC VM, quiet')")
    per_round = args.steps or (50 if args.model == "mlp" else 3)
    result = run(args.model, args.ranks, args.rounds, per_round)
    print(f"{args.model}, {args.ranks} process(es), one thread each, SGD; {args.rounds} rounds x {per_round} steps, "
          f"alternating; load average {result['load_average'][0]:.1f}")
    print(f"  {'variant':15s} {'step ms':>9s} {'first loss':>11s}")
    for name, v in result["variants"].items():
        print(f"  {name:15s} {v['step_ms_median']:9.3f} {v['first_loss']:11.5f}")
    for name, ratio in result["ratios"].items():
        print(f"  {name:30s} {ratio:.3f}")
    command = " ".join(["python", "benchmarks/runtime_overhead/eager.py", *(argv if argv is not None else sys.argv[1:])])
    if args.json is not None:
        args.json.write_text(json.dumps({**result, "command": command}, indent=2) + "\n")
    if args.publish:
        again = (f"python benchmarks/runtime_overhead/eager.py --model {args.model} --ranks {args.ranks} "
                 f"--rounds {args.rounds}" + (f" --steps {args.steps}" if args.steps else ""))
        row = published(result, args.machine, again)
        path = ROOT / "benchmarks" / "results" / f"runtime_overhead_eager-{args.model}-{args.ranks}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(row, indent=2) + "\n")
        tmp.replace(path)  # published whole or not at all
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
