#!/usr/bin/env bash
# Every GPU check of the project in one command, for a machine with one CUDA GPU (under 8 minutes on an H100/H200):
#   1. the GPU test tier (tests/gpu: CUDA profile against measured, NCCL runtime, offload, GPU counters);
#   2. the GPU rows of the prediction benchmark (a GPU stage and a GPU + CPU pipeline, fp32 and bf16,
#      predicted against measured, and the GPU stage's predicted peak memory against the CUDA allocator's);
#   3. the eager per-op host cost of a generated stage on this GPU (what cost_models' EAGER_GPU_OP_MS assumes).
# It writes one results file, RESULTS (default benchmarks/gpu/results/gpu_run_all.json; $OUT/ when the
# device tool runs it), with each part's exit status, wall time and output tail, beside the JSON results the
# benchmarks write themselves.
#
# Run from the repository root:  bash benchmarks/gpu/run_all.sh [RESULTS]
# Where the machine lacks this project's pure-Python dependencies (nothing can be fetched there), first run
# `bash benchmarks/gpu/wheels.sh` here: it downloads them as wheels into .whl/, which this script installs.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:-${OUT:+$OUT/gpu_run_all.json}}
RESULTS=${RESULTS:-benchmarks/gpu/results/gpu_run_all.json}
mkdir -p "$(dirname "$RESULTS")"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hpml-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/hpml-site"
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "run_all: no CUDA device visible to $PY (torch.cuda.is_available() is False); nothing to run" >&2
  exit 2
fi
LOGS=$(mktemp -d)
part() {  # part NAME LIMIT_S COMMAND...: run one check with a time limit, its output kept for the results file
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (at most ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
  echo "${PIPESTATUS[0]} $((SECONDS - t0))" > "$LOGS/$name.rc"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$LOGS/gpu.txt" 2>&1 || true
part gpu_tests 180 "$PY" -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" --timeout 150
part prediction_gpu 240 "$PY" benchmarks/prediction/gpu.py --models gpt-mini,mlp --steps 10 --bf16
part op_cost 60 "$PY" benchmarks/gpu/op_cost.py
"$PY" - "$LOGS" "$RESULTS" <<'PYEOF'
import json, os, subprocess, sys, time
from pathlib import Path
logs, out = Path(sys.argv[1]), Path(sys.argv[2])
try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    commit = ""
parts = {}
for rc in sorted(logs.glob("*.rc")):
    code, secs = rc.read_text().split()
    tail = (logs / f"{rc.stem}.log").read_text()[-4000:]
    parts[rc.stem] = {"exit": int(code), "wall_s": int(secs), "output_tail": tail}
doc = {"command": "bash benchmarks/gpu/run_all.sh", "date": time.strftime("%Y-%m-%d"), "commit": commit or None,
       "gpu": (logs / "gpu.txt").read_text().strip(), "parts": parts}
tmp = out.with_name(f".{out.name}.tmp")
tmp.write_text(json.dumps(doc, indent=2) + "\n")
os.replace(tmp, out)
print(f"wrote {out}: " + ", ".join(f"{k} exit {v['exit']} in {v['wall_s']} s" for k, v in parts.items()))
PYEOF
