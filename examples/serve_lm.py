"""Compile a byte-level GPT for inference once, generate from it, serve it, and load-test the server.

The model is the one of ``examples/stdlib_lm.py`` (a byte GPT: a prompt's UTF-8 bytes are its tokens),
with the weights of its seed: the text it writes is noise until it is trained. Run::

    python examples/serve_lm.py                   # compile, generate, serve on a free port, 32 clients
    python examples/serve_lm.py --clients 64 --requests 256

What it does, step by step, with the commands a user would type instead:

1. ``hpml-compile compile examples/stdlib_lm.py:spec --inference --cluster local-cpu-2 -o out/serve/build``
   (:func:`hpml_compile.infer.api.compile_inference`): a plan placing the blocks on two CPU ranks;
2. ``hpml-compile generate out/serve/build --prompt "def " --max-new-tokens 32``;
3. ``hpml-compile serve out/serve/build --port 8000``, then many clients at once ``POST /generate``;
   the server batches them, and ``GET /metrics`` shows the batch sizes and latency percentiles.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = f"{HERE / 'stdlib_lm.py'}:spec"


def _post(port: int, body: dict[str, object]) -> tuple[float, dict[str, object]]:
    t0 = time.perf_counter()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return time.perf_counter() - t0, json.loads(resp.read())


def _wait(port: int, server: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if server.poll() is not None:
            raise SystemExit("the server exited before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the server did not come up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/serve"))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    args = ap.parse_args()
    from hpml_compile.infer.api import compile_inference, generate
    from hpml_compile.runtime.launcher import free_port

    build = args.out / "build"
    plan = compile_inference(MODEL, "local-cpu-2", build, batch=8, prompt_len=32, new_tokens=32)
    print(f"1. compiled: {len(plan.stages)} stages, predicted {plan.predicted.tokens_per_s:.4g} tokens/s at batch 8")

    out = generate(build, ["def ", "import "], max_new_tokens=24)
    for text in out.tokens:
        print(f"2. generated {bytes(t for t in text if t < 256)!r}")

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "hpml_compile", "serve", str(build), "--port", str(port)],
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), *sys.path])})
    try:
        _wait(port, server)
        bodies = [{"prompt": f"def f{i}(", "max_new_tokens": 16} for i in range(args.requests)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.clients) as pool:
            results = list(pool.map(lambda b: _post(port, b), bodies))
        wall = time.perf_counter() - t0
        lat = sorted(s for s, _ in results)
        tokens = sum(len(r["tokens"]) for _, r in results)  # type: ignore[arg-type]
        print(f"3. served {len(results)} requests from {args.clients} clients in {wall:.3g} s: {tokens / wall:.4g} "
              f"tokens/s, latency p50 {statistics.median(lat):.3g} s, p99 {lat[int(0.99 * (len(lat) - 1))]:.3g} s")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            batch = [x for x in r.read().decode().splitlines()
                     if x.startswith(("hpml_batch_size_count", "hpml_batch_size_sum"))]
        print("   " + "; ".join(batch))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
