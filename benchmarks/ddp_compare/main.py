"""ddp_compare: our data-parallel plan (ZeRO 0, 1, 2) against torch DDP and FSDP2 on the same ranks, same batch.

One launch of 2 gloo ranks (one torch thread each) holds every runtime, each
built from the same seed, and runs them in alternating rounds (DDP, FSDP2,
ours ZeRO-0, ours ZeRO-0 with overlap forced, ours ZeRO-1, ours ZeRO-2, then
again), ``--steps`` steps per round between two barriers, so that the
machine's background load hits all of them alike. A round's step time is the
slower rank's. The table gives the median over rounds and the ratios against
ours (a ratio above 1 is ours faster): of the medians, and the median of the
per-round ratios (two runtimes of one round ran seconds apart, so that one
shares more of the machine's noise).

- **DDP**: ``torch.nn.parallel.DistributedDataParallel`` over the whole
  model (its default 25 MB buckets, overlapped with the backward), each rank
  given its half of the batch.
- **FSDP2**: ``torch.distributed.fsdp.fully_shard`` on every block, then on
  the model (parameters, gradients and optimizer state sharded: ZeRO-3).
- **ours ZeRO-z**: the build of a plan with one stage replicated on both
  ranks (``split_plan(..., replicas=[2], zero=z)``), run by
  :class:`hpml_compile.runtime.Pipeline` as the plan says
  (:func:`hpml_compile.plan.sync_overlap`: on these CPU ranks, one collective
  after the backward, as the cost model prices it), and ZeRO-0 once more with
  the overlapped gradient buckets forced on (``overlap=True``,
  :class:`hpml_compile.runtime.sync.zero.GradBuckets`; DDP's bucket sizes) to show
  what the overlap does here, and once with its all-reduce through gloo
  (``shared_memory=False``) instead of the host's shared memory
  (:mod:`hpml_compile.runtime.sync.shm`), to show what that does.
- **ours ZeRO-3**: the same plan with ZeRO-3 (``runtime.sync.zero3.FlatShard3``:
  the parameters sharded between uses, the stage gathered for each
  microbatch's forward and backward), against FSDP2.

Every runtime starts from the same weights, so the first losses must agree
(they are printed). AdamW, lr 1e-3, everywhere.

Run:  .venv/bin/python benchmarks/ddp_compare/main.py [--model gpt-mini] [--rounds 6] [--steps 3]
Prints a table; writes benchmarks/ddp_compare/results/ddp_compare-<model>.json.
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
from typing import Any, Callable

import torch
import torch.distributed as dist

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.trace import trace

HERE = Path(__file__).resolve().parent
DDP, FSDP2 = "torch DDP", "torch FSDP2 (fully_shard)"
OURS = {0: "ours ZeRO-0", 1: "ours ZeRO-1", 2: "ours ZeRO-2", 3: "ours ZeRO-3"}
FORCED = "ours ZeRO-0, overlap forced"
GLOO = "ours ZeRO-0, through gloo"
# --only: short names of the runtimes, in the table's order
SHORT = {"ddp": DDP, "fsdp2": FSDP2, "zero0": OURS[0], "zero0-overlap": FORCED, "zero0-gloo": GLOO, "zero1": OURS[1],
         "zero2": OURS[2], "zero3": OURS[3]}


def _load(model: str) -> models.LoadedModel:
    return models.load(model, seed=0)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _halves(loaded: models.LoadedModel, rank: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    rows = loaded.example_inputs[0].shape[0] // 2
    part = slice(rank * rows, (rank + 1) * rows)
    return tuple(x[part] for x in loaded.example_inputs), loaded.example_targets[part]


def _ddp(model: str, rank: int) -> Callable[[], float]:
    from torch.nn.parallel import DistributedDataParallel

    loaded = _load(model)
    net = DistributedDataParallel(loaded.module)
    opt = _adamw(net.parameters())
    xs, y = _halves(loaded, rank)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loaded.loss_fn(net(*xs), y)
        loss.backward()
        opt.step()
        out = loss.detach().clone()
        dist.all_reduce(out)  # the batch's loss, as ours reports it (ours agrees on it every step too)
        return out.item() / 2

    return step


def _blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    for name in ("layers", "blocks", "h"):
        seq = getattr(module, name, None)
        if isinstance(seq, (torch.nn.ModuleList, torch.nn.Sequential)):
            return list(seq)
    return [m for m in module.children() if any(True for _ in m.parameters())]


def _fsdp2(model: str, rank: int) -> Callable[[], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    loaded = _load(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in _blocks(loaded.module):
        fully_shard(block, mesh=mesh)
    fully_shard(loaded.module, mesh=mesh)
    opt = _adamw(loaded.module.parameters())
    xs, y = _halves(loaded, rank)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loaded.loss_fn(loaded.module(*xs), y)
        loss.backward()
        opt.step()
        out = loss.detach().clone()
        dist.all_reduce(out)
        return out.item() / 2

    return step


def _ours(build_dir: str, model: str, overlap: bool | None = None, shared_memory: bool = True
          ) -> Callable[[], float]:
    loaded = _load(model)
    pipe = Pipeline.from_build(build_dir, loaded.module, optimizer=_adamw, overlap=overlap, events=False,
                               shared_memory=shared_memory)

    def step() -> float:
        return pipe.step(loaded.example_inputs, loaded.example_targets, loaded.loss_fn).item()

    return step


def _worker(rank: int, world: int, args: argparse.Namespace, builds: dict[int, str], out: str) -> None:
    torch.set_num_threads(1)
    want = set(args.only)
    runs: dict[str, Callable[[], float]] = {DDP: _ddp(args.model, rank)} if DDP in want else {}
    errors: dict[str, str] = {}
    if FSDP2 in want:
        try:
            runs[FSDP2] = _fsdp2(args.model, rank)
        except Exception as e:  # noqa: BLE001 -- reported in the table, not hidden
            errors[FSDP2] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    for z, build in builds.items():
        if OURS[z] in want:
            runs[OURS[z]] = _ours(build, args.model)
        if z == 0 and FORCED in want:
            runs[FORCED] = _ours(build, args.model, overlap=True)
        if z == 0 and GLOO in want:
            runs[GLOO] = _ours(build, args.model, shared_memory=False)
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}  # (this thread, the others) s per step
    first: dict[str, float] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms every runtime up and is not counted
        order = list(runs.items())
        if rnd % 2:
            order.reverse()  # no runtime always follows the same one
        for name, step in order:
            dist.barrier()
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            losses = [step() for _ in range(args.steps)]
            main_s, all_s = time.thread_time() - c0, time.process_time() - p0
            dist.barrier()
            if rnd == 0:
                first[name] = losses[0]
            else:
                times[name].append((time.perf_counter() - t0) / args.steps)
                cpu[name].append((main_s / args.steps, (all_s - main_s) / args.steps))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"times": times, "cpu": cpu, "first_loss": first,
                                                         "errors": errors}))


def _builds(args: argparse.Namespace, root: Path) -> dict[int, str]:
    loaded = _load(args.model)
    gm = trace(loaded.module, loaded.example_inputs)
    out = {}
    for z in (0, 1, 2, 3):
        if OURS[z] not in args.only and (z or not {FORCED, GLOO} & set(args.only)):
            continue
        generate(gm, split_plan(gm, args.model, 1, replicas=[2], zero=z), root / f"zero{z}")
        out[z] = str(root / f"zero{z}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-mini", choices=["gpt-mini", "gpt-tiny", "mlp"])
    p.add_argument("--steps", type=int, default=3, help="steps per round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--only", default=",".join(SHORT),
                   help=f"comma-separated runtimes to run (default: all): {', '.join(SHORT)}; fewer runtimes share "
                   "each rank process's memory and caches (e.g. --only ddp,zero0 for the two alone)")
    p.add_argument("--publish", action="store_true",
                   help="also write benchmarks/results/peers_ddp_fsdp2-<model>.json (a README row; all runtimes)")
    p.add_argument("--machine", default=None, help="the machine, as the published row names it (with --publish)")
    args = p.parse_args(argv)
    if args.publish and not args.machine:
        p.error("--publish needs --machine (e.g. '2-core AMD EPYC VM, quiet')")
    names = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in names if x not in SHORT]
    if unknown or not names:
        p.error(f"--only: unknown runtime(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(SHORT)}")
    args.only = [SHORT[x] for x in names]
    root = Path(tempfile.mkdtemp(prefix="hpml-ddp-compare-"))
    builds = _builds(args, root)
    t0 = time.perf_counter()
    spawn_ranks(_worker, 2, root, args, builds, str(root), timeout_s=3600)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    batch = _load(args.model).batch_size
    rows: dict[str, dict[str, Any]] = {}
    for name in ranks[0]["times"]:
        per_round = [max(a, b) * 1e3 for a, b in zip(ranks[0]["times"][name], ranks[1]["times"][name])]
        # CPU time per step, which another job's load does not change (it stretches the wall time only): the
        # rank's main thread (the step itself) and its other threads (gloo's, the autograd engine's), summed
        # over both ranks, median over rounds
        main = [a[0] + b[0] for a, b in zip(ranks[0]["cpu"][name], ranks[1]["cpu"][name])]
        other = [a[1] + b[1] for a, b in zip(ranks[0]["cpu"][name], ranks[1]["cpu"][name])]
        rows[name] = {"step_ms_median": statistics.median(per_round), "step_ms_rounds": per_round,
                      "first_loss": ranks[0]["first_loss"][name],
                      "main_thread_cpu_ms": statistics.median(main) * 1e3,
                      "other_threads_cpu_ms": statistics.median(other) * 1e3}
    pairs = [(a, b) for a, b in ((DDP, OURS[0]), (FORCED, OURS[0]), (GLOO, OURS[0]), (DDP, GLOO), (FSDP2, OURS[1]), (FSDP2, OURS[2]),
                                 (FSDP2, OURS[3])) if a in rows and b in rows]
    ratios, paired = {}, {}
    for a, b in pairs:
        ratios[f"{a} / {b}"] = rows[a]["step_ms_median"] / rows[b]["step_ms_median"]
        # the two ran in the same round, close in time: the median of the per-round ratios shares more noise
        paired[f"{a} / {b}"] = statistics.median(x / y for x, y in zip(rows[a]["step_ms_rounds"],
                                                                    rows[b]["step_ms_rounds"]))
    print(f"{args.model}, batch {batch} ({batch // 2} rows per rank), 2 gloo ranks (1 thread each), AdamW; "
          f"{args.rounds} rounds x {args.steps} steps, interleaved; step ms = slower rank, median over rounds")
    print(f"  {'runtime':28s} {'step ms':>9s} {'first loss':>11s} {'cpu main':>9s} {'cpu other':>9s}   rounds")
    for name, r in rows.items():
        print(f"  {name:28s} {r['step_ms_median']:9.1f} {r['first_loss']:11.4f} {r['main_thread_cpu_ms']:9.1f} "
              f"{r['other_threads_cpu_ms']:9.1f}   " + " ".join(f"{t:.0f}" for t in r["step_ms_rounds"]))
    print("  (cpu main / other: CPU ms per step of the ranks' main threads / their other threads, both ranks "
          "summed: what another job's load does not change)")
    for name, err in ranks[0]["errors"].items():
        print(f"  {name:28s} {'failed':>9s}   {err}")
    for name, v in ratios.items():
        print(f"  ratio {name}: {v:.3f} (of the medians); {paired[name]:.3f} (median of the rounds' ratios)")
    goal = ratios[f"{DDP} / {OURS[0]}"] >= 1.0 if f"{DDP} / {OURS[0]}" in ratios else None
    if goal is not None:
        print(f"  goal DDP / ours ZeRO-0 >= 1.0: {'met' if goal else 'NOT met'}")
    if f"{FSDP2} / {OURS[3]}" in ratios:
        goal3 = ratios[f"{FSDP2} / {OURS[3]}"] >= 1.0
        print(f"  goal FSDP2 / ours ZeRO-3 >= 1.0: {'met' if goal3 else 'NOT met'}")
    result = {"benchmark": "ddp_compare", "command": " ".join([sys.executable, *sys.argv]), "model": args.model,
              "batch": batch, "ranks": 2, "steps_per_round": args.steps, "rounds": args.rounds, "runtimes": rows,
              "errors": ranks[0]["errors"], "ratios": ratios,
              "paired_ratios": paired,
              "goal": "DDP / ours ZeRO-0 >= 1.0", "meets_goal": goal, "wall_s": time.perf_counter() - t0,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}}
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    subset = "" if len(args.only) == len(SHORT) else "-" + "-".join(k for k, v in SHORT.items() if v in args.only)
    path = out / f"ddp_compare-{args.model}{subset}.json"  # a subset's run leaves the whole table's file alone
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)  # published whole
    print(f"wrote {path}")
    if args.publish:
        print(f"wrote {_publish(args, ratios, paired, rows)}")
    return 0


def _publish(args: argparse.Namespace, ratios: dict[str, float], paired: dict[str, float],
             rows: dict[str, dict[str, Any]]) -> Path:
    """The run as a README row: DDP against ours ZeRO-0 and FSDP2 against ours ZeRO-3, in the same launch."""
    need = (f"{DDP} / {OURS[0]}", f"{FSDP2} / {OURS[3]}")
    if any(k not in ratios for k in need):
        raise SystemExit("--publish needs DDP, FSDP2, ours ZeRO-0 and ours ZeRO-3 in the run (leave out --only)")
    sys.path.insert(0, str(HERE.parent))
    import results_table  # the README's table, beside this folder
    row = {"claim": f"Our data-parallel build against torch DDP and FSDP2 (`fully_shard`), {args.model}, 2 gloo "
                    "ranks, the same weights, data and AdamW, all in one launch, rounds alternating",
           "figure": ("DDP {ddp_ms[0]:.0f} ms, ours ZeRO-0 {ours0_ms[0]:.0f} ms: DDP / ours {ddp[0]:.2f}x; FSDP2 "
                      "{fsdp_ms[0]:.0f} ms, ours ZeRO-3 {ours3_ms[0]:.0f} ms: FSDP2 / ours {fsdp[0]:.2f}x "
                      "(above 1: ours faster; per-round medians {ddp_paired[0]:.2f}x and {fsdp_paired[0]:.2f}x)"),
           "figures": {"ddp": [round(ratios[need[0]], 3)], "fsdp": [round(ratios[need[1]], 3)],
                       "ddp_paired": [round(paired[need[0]], 3)], "fsdp_paired": [round(paired[need[1]], 3)],
                       "ddp_ms": [round(rows[DDP]["step_ms_median"], 1)],
                       "ours0_ms": [round(rows[OURS[0]]["step_ms_median"], 1)],
                       "fsdp_ms": [round(rows[FSDP2]["step_ms_median"], 1)],
                       "ours3_ms": [round(rows[OURS[3]]["step_ms_median"], 1)]},
           "goal": "ours at least as fast as each (both ratios >= 1.0)",
           "command": f"python benchmarks/ddp_compare/main.py --model {args.model} --rounds {args.rounds} "
                      f"--steps {args.steps}",
           "machine": args.machine, "details": "benchmarks/ddp_compare/README.md"}
    return results_table.publish(f"peers_ddp_fsdp2-{args.model}", row)


if __name__ == "__main__":
    sys.exit(main())
