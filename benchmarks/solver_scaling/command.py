"""How long does a user wait for ``hpml-compile plan``? The command end to end beside the solver's own time.

``main.py`` and ``kinds.py`` time the solver function; what a user runs also
loads the profile, builds and coarsens the cost graph, searches uneven rows
(with its budget), validates and writes the plan. Each row here starts the
CLI in a fresh process (``python -m hpml_compile plan PROFILE --cluster
CLUSTER.json -o PLAN.json``, default options but ``--time-limit``) and
measures from just before the process starts until it exits with the plan
written, beside the solver's seconds the plan records (``solver.seconds``)
and the uneven-rows line the command printed (how far its search got in
what time, against its budget).

The models are profiled once on the meta device (every cost predicted for
A100-80GB, H100-80GB and V100-32GB), outside the timing; the clusters are
cluster.json files of ``n`` GPUs of each kind, 8 to a host, no links named
(so hosts talk over the assumed eth100 default).

Goal: llama-70b (batch 512 x 2048) on 3 x 256 GPUs (768) plans in under 60 s
with default options.

Run:
    python benchmarks/solver_scaling/command.py                # 3 x 32 and 3 x 256 (~1 min on 2 cores)
    python benchmarks/solver_scaling/command.py --per 256      # the 768-device row only
Writes benchmarks/solver_scaling/results/command.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KINDS = ("A100-80GB", "H100-80GB", "V100-32GB")
MEMORY_GIB = {"V100-32GB": 32}
GOAL_S = 60.0


def cluster_json(per_kind: int, per_host: int = 8) -> dict[str, Any]:
    """``per_kind`` GPUs of each of :data:`KINDS`, ``per_host`` to a host, no links named."""
    devs = []
    for k, kind in enumerate(KINDS):
        for i in range(per_kind):
            g = k * per_kind + i
            devs.append({"name": f"gpu{g}", "kind": kind, "memory_gib": MEMORY_GIB.get(kind, 80),
                         "host": f"node{g // per_host}"})
    return {"schema_version": 1, "name": f"3x{per_kind}", "devices": devs}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpml_compile", *args]


def profile_once(model: str, batch: int, seq: int, out: Path) -> Path:
    """Write the meta profile of ``model`` (not timed)."""
    subprocess.run(_cli("profile", model, "--meta", "--batch-size", str(batch), "--seq-len", str(seq),
                        "--device-kinds", ",".join(KINDS), "-q", "-o", str(out)), check=True)
    return out


def timed_plan(prof: Path, cluster: Path, out: Path, time_limit: float) -> dict[str, Any]:
    """One ``hpml-compile plan`` in a fresh process: seconds from before its start to its exit, plan written."""
    t0 = time.perf_counter()
    run = subprocess.run(_cli("plan", str(prof), "--cluster", str(cluster), "--time-limit", str(time_limit),
                              "-o", str(out)), capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if run.returncode != 0 or not out.exists():
        return {"seconds": round(seconds, 2), "error": (run.stderr.strip().splitlines() or ["?"])[-1]}
    plan = json.loads(out.read_text())
    uneven = [line for line in run.stderr.splitlines() if line.startswith("uneven rows:")]
    return {"seconds": round(seconds, 2), "solver_seconds": round(plan["solver"]["seconds"], 2),
            "solver": plan["solver"]["name"], "step_ms": plan["predicted"]["step_ms"],
            "stages": len(plan["stages"]), "uneven": uneven[0] if uneven else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-70b")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--per", default="32,256", help="GPUs per kind, comma-separated (3 kinds)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="the plan command's --time-limit")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "command.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        prof = profile_once(args.model, args.batch, args.seq, where / "profile.json")
        print(f"{'devices':>8} {'command s':>10} {'solver s':>9} {'stages':>7}  uneven rows")
        for per in (int(x) for x in args.per.split(",")):
            cpath = where / f"cluster-{per}.json"
            cpath.write_text(json.dumps(cluster_json(per)))
            row = {"model": args.model, "devices": 3 * per,
                   **timed_plan(prof, cpath, where / f"plan-{per}.json", args.time_limit),
                   "load": round(os.getloadavg()[0], 2)}
            rows.append(row)
            print(f"{row['devices']:>8} {row['seconds']:>10.1f} {row.get('solver_seconds', float('nan')):>9.1f} "
                  f"{row.get('stages', '-'):>7}  {row.get('uneven') or row.get('error', '')}", flush=True)
    big = [r for r in rows if r["devices"] >= 768 and "error" not in r]
    result = {"model": args.model, "batch": args.batch, "seq": args.seq, "time_limit_s": args.time_limit,
              "goal_s": GOAL_S, "goal_met": bool(big) and all(r["seconds"] < GOAL_S for r in big),
              "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(result, indent=2))
    tmp_out.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
