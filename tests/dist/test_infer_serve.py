"""`hpml-compile serve` on a 2-stage pipeline under a bounded load on localhost: 32 concurrent clients send 64
requests (some streamed) and each gets the eager model's greedy tokens, while malformed and oversized requests
are refused with a 4xx naming the bound; a worker rank killed under load costs no request its answer or an
error, and the server re-plans and serves again; then SIGTERM stops the server."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from hpml_compile import models
from hpml_compile.infer.plan import save_inference_plan
from hpml_compile.runtime.launcher import free_port

pytestmark = [pytest.mark.dist, pytest.mark.slow]

LLAMA = f"{Path(__file__).with_name('infer_models.py')}:sharp_llama"


def two_stage_plan(model: str, cuts: list[tuple[int, int]], lanes: int) -> Any:
    from hpml_compile.cluster import load_cluster
    from hpml_compile.infer import DecoderShape, InferencePlan, Workload, score
    from hpml_compile.infer.cost import Objective
    from hpml_compile.infer.place import stages_for

    shape = DecoderShape.from_config(models.load(model, device="meta").module.config)
    cluster = load_cluster(f"local-cpu-{len(cuts)}")
    work = Workload(8, 8, 8, microbatches=lanes)
    stages = stages_for(cluster, shape, work, [(f"cpu{k}", a, b, False) for k, (a, b) in enumerate(cuts)])
    return InferencePlan(Objective.THROUGHPUT, model, shape, work, cluster, stages, score(cluster, shape, work, stages))


def _call(port: int, body: bytes | str, path: str = "/generate", method: str = "POST") -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=body if method == "POST" else None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def _wait_healthy(port: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if _call(port, "", "/health", "GET")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not come up in 120 s")


def test_the_server_answers_every_request_with_the_eager_tokens_and_refuses_bad_ones(tmp_path: Path) -> None:
    build = tmp_path / "build"
    build.mkdir()
    save_inference_plan(two_stage_plan(LLAMA, [(0, 2), (2, 3)], lanes=2), build / "plan.json")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hpml_compile", "serve", str(build), "--port", str(port),
                             "--max-batch", "8", "--max-queue", "128", "--max-prompt-tokens", "60",
                             "--max-new-tokens", "8", "--max-body-bytes", "2048"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_healthy(port, proc)
        worker_pids = [c.pid for c in psutil.Process(proc.pid).children()]
        rng = random.Random(0)
        good = [{"tokens": [rng.randrange(256) for _ in range(rng.randint(1, 10))], "max_new_tokens": rng.randint(1, 8),
                 "stream": i % 4 == 0} for i in range(64)]
        bad: list[tuple[bytes | str, int, str]] = [
            ("{not json", 400, "malformed"),
            (json.dumps({"prompt": "x" * 3000}), 413, "max_body_bytes"),
            (json.dumps({"tokens": list(range(61))}), 422, "max_prompt_tokens"),
            (json.dumps({"prompt": "hi", "max_new_tokens": 100}), 422, "max_new_tokens"),
            (json.dumps({"tokens": [999]}), 422, "vocabulary"),
            (json.dumps({"prompt": "hi", "stream": "yes"}), 400, "stream"),
            (json.dumps([1, 2]), 400, "malformed"),
            (json.dumps({"tokens": [1] * 60, "max_new_tokens": 8}), 422, "context"),
        ]
        jobs: list[Any] = [("good", g) for g in good] + [("bad", b) for b in bad]
        rng.shuffle(jobs)

        def run(job: Any) -> tuple[int, str]:
            kind, x = job
            return _call(port, json.dumps(x) if kind == "good" else x[0])

        with ThreadPoolExecutor(max_workers=32) as pool:
            answers = list(pool.map(run, jobs, timeout=300))

        eager = models.load(LLAMA, seed=0).module.eval()
        for (kind, x), (status, text) in zip(jobs, answers):
            if kind == "bad":
                assert status == x[1] and x[2] in text, (x, status, text)
                continue
            assert status == 200, text
            if x["stream"]:
                lines = [json.loads(line) for line in text.splitlines()]
                got = lines[-1]["tokens"]
                assert [line["token"] for line in lines[:-1]] == got and lines[-1]["done"]
            else:
                got = json.loads(text)["tokens"]
            seq = list(x["tokens"])
            with torch.no_grad():
                for _ in range(x["max_new_tokens"]):
                    seq.append(int(eager(torch.tensor([seq]))[0, -1].argmax()))
            assert got == seq[len(x["tokens"]):], x

        status, metrics = _call(port, "", "/metrics", "GET")
        assert status == 200
        batches = float(next(m.split()[-1] for m in metrics.splitlines() if m.startswith("hpml_batch_size_count")))
        assert 0 < batches < len(good), "requests were batched"
        assert 'hpml_request_latency_quantile_seconds{quantile="0.99"}' in metrics
        assert "hpml_queue_depth" in metrics and "hpml_tokens_per_second" in metrics

        # A worker rank killed under load: every request gets its answer or a 503, then the server re-plans on
        # the device left and answers again.
        os.kill(worker_pids[0], signal.SIGKILL)
        with ThreadPoolExecutor(max_workers=16) as pool:
            during = list(pool.map(lambda x: _call(port, json.dumps(x)), good[:16], timeout=300))
        assert all(status in (200, 503) for status, _ in during), during
        deadline = time.monotonic() + 120
        while _call(port, "", "/health", "GET")[0] != 200:
            assert time.monotonic() < deadline, "the server did not re-plan in 120 s"
            time.sleep(0.2)
        x = good[1]
        status, text = _call(port, json.dumps({**x, "stream": False}))
        seq = list(x["tokens"])
        with torch.no_grad():
            for _ in range(x["max_new_tokens"]):
                seq.append(int(eager(torch.tensor([seq]))[0, -1].argmax()))
        assert status == 200 and json.loads(text)["tokens"] == seq[len(x["tokens"]):], text

        proc.send_signal(signal.SIGTERM)
        said, _ = proc.communicate(timeout=60)
        assert proc.returncode in (0, -signal.SIGTERM) and "stopped: the queued requests were served" in said, said
        assert "2 stages" in said and "re-planned without cpu1" in said
        for pid in worker_pids:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
