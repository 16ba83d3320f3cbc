"""How well does cost_models predict a node's time? Calibrate on some models, predict a model it never saw.

For each zoo model, every node is measured on this machine's CPU (forward and
backward, median of repeats). By default each model is held out whole in
turn: ``cost_models.calibrate.fit`` sees the nodes of every other model, and
the held-out model's nodes are predicted from their FLOPs and bytes alone
(what a plan for a new model gets). A random split of the pooled nodes
(``--split nodes``, stratified by op kind) puts identical transformer layers
on both sides and so flatters the fit; it is kept for comparison. The tables
give the median and p90 relative error ``|predicted - measured| / measured``
per op kind and per held-out model, for the calibrated model and for the bare
datasheet roofline (same nodes, same run) as the baseline.

Run:
    python benchmarks/cost_model_accuracy/main.py                  # ~3-5 min on 2 cores
    python benchmarks/cost_model_accuracy/main.py --quick          # small models only
    python benchmarks/cost_model_accuracy/main.py --split nodes    # the random split of pooled nodes
Writes benchmarks/cost_model_accuracy/results/accuracy.json (``--split nodes``: accuracy-nodes.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

import cost_models
from cost_models.calibrate import OpSample, fit, predict_ms
from hpml_compile import models, profile
from hpml_compile.ir import NodeOp

# (zoo name, batch size, seq len): sizes chosen so each profiles in well under a minute on 2 cores.
FULL = [("gpt-mini", 8, 128), ("gpt2-small", 2, 128), ("mlp", 64, None), ("resnet-tiny", 16, None),
        ("resnet50", 2, None)]
QUICK = [("gpt-mini", 4, 64), ("mlp-tiny", 8, None), ("resnet-tiny", 4, None)]
BWD_MEM_FACTOR = 2.0  # the same assumption hpml_compile.profile makes


def _samples(name: str, batch: int, seq: int | None, repeats: int) -> list[tuple[str, OpSample]]:
    m = models.load(name, batch_size=batch, seq_len=seq)
    p = profile(m.module, m.example_inputs, name=name, repeats=repeats, warmup=1, progress=False)
    out: list[tuple[str, OpSample]] = []
    for n in p.nodes:
        if n.op in (NodeOp.PLACEHOLDER, NodeOp.OUTPUT, NodeOp.GET_ATTR):
            continue
        c = n.cost["cpu"]
        if c.fwd_ms > 0:
            out.append(("fwd", OpSample(n.op_kind, n.flops, n.mem_bytes, c.fwd_ms)))
        if c.bwd_ms > 0:
            out.append(("bwd", OpSample(n.op_kind, n.bwd_flops, BWD_MEM_FACTOR * n.mem_bytes, c.bwd_ms)))
    return out


def model_folds(rows: list[tuple[str, str, OpSample]]) -> list[tuple[str, list, list]]:
    """One fold per model: ``(model, the other models' rows, its rows)``, rows without the model name."""
    names = list(dict.fromkeys(m for m, _, _ in rows))
    return [(held, [(d, s) for m, d, s in rows if m != held], [(d, s) for m, d, s in rows if m == held])
            for held in names]


def _split(rows: list[tuple[str, OpSample]], seed: int) -> tuple[list, list]:
    rng = random.Random(seed)
    by_kind: dict[tuple[str, str], list] = defaultdict(list)
    for r in rows:
        by_kind[(r[0], r[1].kind)].append(r)
    train, test = [], []
    for key in sorted(by_kind):
        group = by_kind[key]
        rng.shuffle(group)
        half = max(1, len(group) // 2) if len(group) > 1 else 0
        train += group[:half]
        test += group[half:]
    return train, test


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small models only (~30 s)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="the random split's seed (--split nodes)")
    ap.add_argument("--split", choices=("models", "nodes"), default="models",
                    help="hold out each model whole (default), or split the pooled nodes at random")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "accuracy.json")
    args = ap.parse_args()

    t0 = time.time()
    rows: list[tuple[str, str, OpSample]] = []
    for name, batch, seq in (QUICK if args.quick else FULL):
        print(f"profiling {name} (batch {batch}{f', seq {seq}' if seq else ''}) ...", flush=True)
        rows += [(name, d, sample) for d, sample in _samples(name, batch, seq, args.repeats)]
    if args.split == "models":
        folds = model_folds(rows)
    else:
        train, test = _split([(d, sample) for _, d, sample in rows], args.seed)
        folds = [("pooled nodes", train, test)]
    cpu = cost_models.get_device("cpu")

    errs: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"calibrated": [], "roofline": []})
    per_model: dict[str, list[float]] = defaultdict(list)
    # time-weighted: |error| summed over nodes / measured time summed, what a plan's stage time feels
    abs_ms: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    fitted = predicted = 0
    calibs = {}
    for held, train, test in folds:
        calib = calibs[held] = {d: fit([s for dd, s in train if dd == d], cpu) for d in ("fwd", "bwd")}
        fitted, predicted = fitted + len(train), predicted + len(test)
        for direction, s in test:
            for label, cal in (("calibrated", calib[direction]), ("roofline", None)):
                pred = predict_ms(s.kind, s.flops, s.mem_bytes, cpu, "float32", cal)
                e = abs(pred - s.ms) / s.ms
                errs[s.kind][label].append(e)
                errs["ALL"][label].append(e)
                if label == "calibrated":
                    per_model[held].append(e)
                    for key in (s.kind, "ALL"):
                        abs_ms[key][0] += abs(pred - s.ms)
                        abs_ms[key][1] += s.ms

    how = "each model held out whole" if args.split == "models" else "pooled nodes split at random"
    print(f"\ncost_models accuracy, {how} ({fitted} fitted, {predicted} predicted over {len(folds)} fold(s); "
          f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    print(f"{'op kind':12s} {'n':>5s} {'median err':>11s} {'p90 err':>9s} {'time-weighted':>14s}   "
          f"{'roofline median':>15s} {'p90':>8s}")
    table = {}
    for kind in sorted(errs, key=lambda k: (k == "ALL", k)):
        c, r = errs[kind]["calibrated"], errs[kind]["roofline"]
        table[kind] = {"n": len(c), "median": statistics.median(c), "p90": _q(c, 0.9),
                       "time_weighted": abs_ms[kind][0] / abs_ms[kind][1],
                       "measured_ms": abs_ms[kind][1],
                       "roofline_median": statistics.median(r), "roofline_p90": _q(r, 0.9)}
        t = table[kind]
        print(f"{kind:12s} {t['n']:5d} {t['median']:10.1%} {t['p90']:9.1%} {t['time_weighted']:14.1%}   "
              f"{t['roofline_median']:15.1%} {t['roofline_p90']:8.1%}")
    print(f"\n{'held out':14s} {'n':>5s} {'median err':>11s} {'p90 err':>9s}")
    held_table = {}
    for held, es in per_model.items():
        held_table[held] = {"n": len(es), "median": statistics.median(es), "p90": _q(es, 0.9)}
        print(f"{held:14s} {len(es):5d} {held_table[held]['median']:10.1%} {held_table[held]['p90']:9.1%}")
    out = args.out if args.split == "models" or args.out != ap.get_default("out") else \
        args.out.with_name("accuracy-nodes.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({
        "benchmark": "cost_model_accuracy", "split": args.split, "models": QUICK if args.quick else FULL,
        "seed": args.seed, "per_held_out": held_table,
        "repeats": args.repeats, "machine": {"cpu": platform.processor() or platform.machine(),
                                             "threads": torch.get_num_threads(), "torch": torch.__version__},
        "seconds": round(time.time() - t0, 1), "per_kind": table,
        "calibration": {held: {d: c.to_dict() for d, c in cal.items()} for held, cal in calibs.items()},
    }, indent=1))
    os.replace(tmp, out)
    print(f"wrote {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
