"""`hpml-compile serve` refuses clients that send their request too slowly (a slow-loris) while the others
are served: raw sockets that trickle a request head, or a body, a byte at a time, and one that sends nothing,
each get a 408 (their connection closed) once their deadline passes, and ordinary requests sent meanwhile are
answered with the eager model's tokens; a request head that grows past its size bound gets a 400 at once."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hpml_compile import models
from hpml_compile.infer.plan import save_inference_plan
from hpml_compile.runtime.job.launcher import free_port

from test_infer_serve import LLAMA, _call, _wait_healthy, two_stage_plan

pytestmark = [pytest.mark.dist, pytest.mark.slow]

DEADLINE_S = 3.0


def _trickle(port: int, head: bytes, drip: bytes, out: dict[str, object]) -> None:
    """Send ``head`` at once, then ``drip`` a byte every 0.2 s until the server answers or closes."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    t0 = time.monotonic()
    got, i = b"", 0
    try:
        s.sendall(head)
        while time.monotonic() - t0 < 30:
            ready, _, _ = select.select([s], [], [], 0.2)
            if ready:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
                continue
            try:
                s.send(drip[i % len(drip):i % len(drip) + 1] if drip else b"")
            except OSError:  # the server closed the connection
                break
            i += 1
    finally:
        s.close()
    out.update(seconds=time.monotonic() - t0, answer=got.decode(errors="replace"))


def test_slow_clients_get_a_408_while_the_others_are_served(tmp_path: Path) -> None:
    build = tmp_path / "build"
    build.mkdir()
    save_inference_plan(two_stage_plan(LLAMA, [(0, 3)], lanes=1), build / "plan.json")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hpml_compile", "serve", str(build), "--port", str(port),
                             "--max-new-tokens", "8", "--header-timeout-s", str(DEADLINE_S),
                             "--body-timeout-s", str(DEADLINE_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_healthy(port, proc)
        body = json.dumps({"tokens": [5, 6, 7], "max_new_tokens": 4}).encode()
        slow_head = (b"POST /generate HTTP/1.1\r\nHost: x\r\n", b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
        slow_body = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body) + 100).encode() + b"\r\n\r\n", body + b" " * 100)
        silent = (b"", b"")
        kinds = [("head", slow_head)] * 4 + [("body", slow_body)] * 4 + [("silent", silent)] * 2
        results: list[dict[str, object]] = [{} for _ in kinds]
        threads = [threading.Thread(target=_trickle, args=(port, *how, out)) for (_, how), out in zip(kinds, results)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        eager = models.load(LLAMA, seed=0).module.eval()
        prompts = [[i + 1, 2 * i + 3, 7] for i in range(12)]
        with ThreadPoolExecutor(max_workers=6) as pool:
            answers = list(pool.map(lambda p: (_call(port, json.dumps({"tokens": p, "max_new_tokens": 4})),
                                               time.monotonic() - t0), prompts))
        for t in threads:
            t.join(timeout=60)
        for p, ((status, text), _) in zip(prompts, answers):
            seq = list(p)
            with torch.no_grad():
                for _ in range(4):
                    seq.append(int(eager(torch.tensor([seq]))[0, -1].argmax()))
            assert status == 200 and json.loads(text)["tokens"] == seq[len(p):], text
        assert min(at for _, at in answers) < DEADLINE_S, "an ordinary request was answered while the slow ones waited"
        for (kind, _), r in zip(kinds, results):
            assert r["answer"].startswith("HTTP/1.1 408"), (kind, r)  # type: ignore[union-attr]
            assert DEADLINE_S * 0.9 < r["seconds"] < DEADLINE_S + 10, (kind, r)  # type: ignore[operator]
            if kind == "body":
                assert "body_timeout_s" in r["answer"], r  # type: ignore[operator]
        big: dict[str, object] = {}  # a request head still incomplete past 16 KiB: refused at once
        _trickle(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000, b"", big)
        assert str(big["answer"]).startswith("HTTP/1.1 400"), big
        assert float(big["seconds"]) < DEADLINE_S, big  # type: ignore[arg-type]
        assert _call(port, "", "/health", "GET")[0] == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
