"""What starting a rank costs before its first step: import CPU in fresh interpreters, and a short ``run``.

Every (re)start of the closed loop, every ``hpml-compile run`` and every test
that spawns ranks pays a rank's imports again, so they are measured here, not
guessed: each figure is the median over ``--repeats`` fresh processes.

- *import*: ``time.process_time()`` around ``import MODULE`` in a fresh
  interpreter (``torch`` alone is the floor), for the package, its runtime and
  the worker (what ``rank_entry.py`` imports after its signal handlers);
- *--help*: the CPU (user + system) of ``python -m hpml_compile --help``;
- *run* (with ``--build``): ``hpml-compile run BUILD --steps 3`` end to end:
  the CPU of the launcher and its ranks together, the wall time, and the time
  from starting the command to rank 0's first step (its ``started.json``).

The script imports nothing from ``hpml_compile`` itself, so the same file
measures another checkout: ``PYTHONPATH=OTHER python startup.py --label other``.

Example:
    $ PYTHONPATH=$PWD .venv/bin/python benchmarks/runtime_overhead/startup.py --label after --build out/b
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# torch alone is the floor; rank_entry.py, torchrun's script, imports the worker and nothing else.
MODULES = ("torch", "hpml_compile", "hpml_compile.runtime", "hpml_compile.runtime.job.worker")


def _cpu_of(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run ``cmd`` to completion; its CPU (user + system, its children included) and wall seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, wall


def import_cpu(module: str, repeats: int) -> list[float]:
    """CPU seconds of ``import module`` in each of ``repeats`` fresh interpreters."""
    code = f"import time; t = time.process_time(); import {module}; print(time.process_time() - t)"
    return [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                  .stdout.split()[-1]) for _ in range(repeats)]


def run_once(build: Path) -> dict[str, float]:
    """One ``hpml-compile run BUILD --steps 3``: CPU of every process, wall, and seconds to rank 0's first step."""
    out = Path(tempfile.mkdtemp(prefix="startup-run-"))
    try:
        started = time.time()
        cpu, wall = _cpu_of([sys.executable, "-m", "hpml_compile", "run", str(build), "--steps", "3",
                             "--run-dir", str(out / "run"), "--no-tensorboard", "--no-report"], dict(os.environ))
        first = json.loads((out / "run" / "started.json").read_text())["first_step_at"]
        return {"cpu_s": cpu, "wall_s": wall, "first_step_s": first - started}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--label", default="this checkout", help="names the measured checkout in the table and file")
    p.add_argument("--repeats", type=int, default=5, help="fresh processes per figure (median kept; default 5)")
    p.add_argument("--runs", type=int, default=3, help="`run` commands with --build (default 3)")
    p.add_argument("--build", type=Path, default=None, help="a build of `hpml-compile compile` to `run` 3 steps of")
    p.add_argument("-o", "--output", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="folder for the JSON (benchmarks/runtime_overhead/results/)")
    a = p.parse_args(argv)
    rows: dict[str, Any] = {}
    for m in MODULES:
        xs = import_cpu(m, a.repeats)
        rows[f"import {m}"] = {"cpu_s": xs}
    helps = [_cpu_of([sys.executable, "-m", "hpml_compile", "--help"], dict(os.environ)) for _ in range(a.repeats)]
    rows["hpml-compile --help"] = {"cpu_s": [c for c, _ in helps], "wall_s": [w for _, w in helps]}
    if a.build is not None:
        runs = [run_once(a.build) for _ in range(a.runs)]
        rows["run --steps 3 (launcher + 2 ranks)"] = {k: [r[k] for r in runs] for k in runs[0]}
    print(f"{a.label}: median of {a.repeats} fresh processes ({a.runs} for run); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'what':40s} {'CPU s':>8s} {'wall s':>8s} {'first step s':>13s}")
    for name, r in rows.items():
        print(f"{name:40s} {_median(r['cpu_s']):8.2f} {_median(r.get('wall_s', [])):8.2f} "
              f"{_median(r.get('first_step_s', [])):13.2f}")
    a.output.mkdir(parents=True, exist_ok=True)
    path = a.output / f"startup-{a.label.replace(' ', '_')}.json"
    tmp = path.with_suffix(".json.tmp")  # published whole or not at all
    tmp.write_text(json.dumps({"label": a.label, "python": sys.version.split()[0], "cores": os.cpu_count(),
                               "loadavg": os.getloadavg(), "rows": rows}, indent=1))
    os.replace(tmp, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
