"""How well does cost_models predict a node's time? Calibrate on half, predict the other half.

For each zoo model, every node is measured on this machine's CPU (forward and
backward, median of repeats). The measured nodes of all models are pooled and
split in two at random, stratified by op kind; ``cost_models.calibrate.fit``
sees one half, and the other half is predicted from its FLOPs and bytes
alone. The table gives the median and p90 relative error
``|predicted - measured| / measured`` per op kind, for the calibrated model
and for the bare datasheet roofline (same nodes, same run) as the baseline.

Run:
    python benchmarks/cost_model_accuracy/main.py            # ~3-5 min on 2 cores
    python benchmarks/cost_model_accuracy/main.py --quick    # small models only
Writes benchmarks/cost_model_accuracy/results/accuracy.json.
"""

from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "accuracy.json")
    args = ap.parse_args()

    t0 = time.time()
    rows: list[tuple[str, OpSample]] = []
    for name, batch, seq in (QUICK if args.quick else FULL):
        print(f"profiling {name} (batch {batch}{f', seq {seq}' if seq else ''}) ...", flush=True)
        rows += _samples(name, batch, seq, args.repeats)
    train, test = _split(rows, args.seed)
    cpu = cost_models.get_device("cpu")
    calib = {d: fit([s for dd, s in train if dd == d], cpu) for d in ("fwd", "bwd")}

    errs: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"calibrated": [], "roofline": []})
    # time-weighted: |error| summed over nodes / measured time summed, what a plan's stage time feels
    abs_ms: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for direction, s in test:
        for label, cal in (("calibrated", calib[direction]), ("roofline", None)):
            pred = predict_ms(s.kind, s.flops, s.mem_bytes, cpu, "float32", cal)
            e = abs(pred - s.ms) / s.ms
            errs[s.kind][label].append(e)
            errs["ALL"][label].append(e)
            if label == "calibrated":
                for key in (s.kind, "ALL"):
                    abs_ms[key][0] += abs(pred - s.ms)
                    abs_ms[key][1] += s.ms

    print(f"\ncost_models accuracy on held-out nodes ({len(train)} fitted, {len(test)} predicted; "
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "cost_model_accuracy", "models": QUICK if args.quick else FULL, "seed": args.seed,
        "repeats": args.repeats, "machine": {"cpu": platform.processor() or platform.machine(),
                                             "threads": torch.get_num_threads(), "torch": torch.__version__},
        "seconds": round(time.time() - t0, 1), "per_kind": table,
        "calibration": {d: c.to_dict() for d, c in calib.items()},
    }, indent=1))
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
