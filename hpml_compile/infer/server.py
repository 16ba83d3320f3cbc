"""An HTTP server for a pipelined generator: FastAPI on uvicorn, dynamic batching, streaming, metrics.

Endpoints:

- ``POST /generate`` with ``{"prompt": "text"}`` or ``{"tokens": [ids]}``, optional ``"max_new_tokens"``
  and ``"stream"``: the new tokens (and their text, for byte-level models) as one JSON object, or with
  ``"stream": true`` as JSON lines, one per token as it is generated, then a last ``{"done": true, ...}``.
- ``GET /health``: 200 with the stages and queue depth while the pipeline serves, 503 once a rank failed.
- ``GET /metrics``: Prometheus text: queue depth, batch sizes, request latency (a histogram, and the
  50th/95th/99th percentiles of the last 1000 requests), tokens generated, tokens/s of the last batch and the
  plan's predicted tokens/s beside it.

One thread, the batcher, owns the :class:`~hpml_compile.infer.engine.Generator`: it takes the first
waiting request, gathers more until ``max_batch`` or ``max_wait_ms`` after the first, runs them as one
batch (lanes as the plan says) and hands each token to its request as it arrives. Idle, it wakes the
ranks now and then so that their wait never reaches the process group's timeout.

Every bound is checked before a request is queued, and a violation is a 4xx naming the bound: the body
size (413), the prompt length and ``max_new_tokens`` (422), a prompt plus output longer than the model's
context (422), a full queue (429). A client too slow to send its request is refused while the others are
served: a request head not complete within ``header_timeout_s`` gets a 408 and its connection closes
(:mod:`hpml_compile.infer.deadline`), a body not complete within ``body_timeout_s`` gets a 408; a
request head still incomplete past ``max_header_bytes`` gets a 400, and at most ``max_queue + 64``
connections are open at once (uvicorn's ``limit_concurrency``; more get a 503). A body that is not JSON,
or not a request object, is a 400. Nothing a client sends reaches a rank unchecked, so no request can
take the server or a rank down. If a rank fails anyway, every request of the running batch gets a 503
naming the failure, ``/health`` says so, and the batcher places the model again on the devices left
(:func:`hpml_compile.infer.place.replan_without`), starts a new pipeline and serves the requests still
queued; new requests get a 503 until it has.

While serving, each stage's measured compute time is compared with its plan's; a device persistently
slower than the others relative to their predictions has the model placed again on the measured speeds,
and the batcher switches pipelines between two batches (:mod:`hpml_compile.infer.adapt`): the requests
queued meanwhile wait, none is dropped, and ``/health`` stays up.

Shutdown (SIGINT/SIGTERM): uvicorn stops accepting, the requests already queued are served, then the
batcher stops the ranks; uvicorn then raises the signal again, so the process ends as the signal says.

Example:
    >>> Limits().max_batch
    8
"""

from __future__ import annotations

import asyncio
import json
import queue
import sys
import threading
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest

from ..errors import HpmlError, LaunchError
from .adapt import AdaptOptions, SpeedWatch, expected_stage_ms, replan_on_speeds
from .batch import decode_tokens, encode_item
from .deadline import header_deadline_protocol
from .engine import Generated, Generator
from .plan import InferencePlan

__all__ = ["Limits", "make_app", "serve"]

HEARTBEAT_S = 30.0


@dataclass(frozen=True, slots=True)
class Limits:
    """The server's bounds and batching."""

    max_batch: int = 8  # requests gathered into one batch
    max_wait_ms: float = 10.0  # how long the first request of a batch waits for others
    max_queue: int = 256  # requests waiting, beyond which a request gets 429
    max_body_bytes: int = 1 << 16
    max_prompt_tokens: int = 1024
    max_new_tokens: int = 256  # the most a request may ask for
    default_new_tokens: int = 16
    header_timeout_s: float = 10.0  # from a connection's start (or its last response) to a whole request head
    body_timeout_s: float = 10.0  # from the request head to the whole body
    max_header_bytes: int = 1 << 14  # a request head still incomplete past this many bytes gets a 400


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    want: int
    loop: asyncio.AbstractEventLoop
    tokens: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    t0: float = field(default_factory=time.perf_counter)


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.queue = Gauge("hpml_queue_depth", "requests waiting for a batch", registry=r)
        self.batch = Histogram("hpml_batch_size", "requests per batch", buckets=(1, 2, 4, 8, 16, 32, 64),
                               registry=r)
        self.latency = Histogram("hpml_request_latency_seconds", "request latency, queue included", registry=r)
        self.pct = Gauge("hpml_request_latency_quantile_seconds", "latency quantile of the last 1000 requests",
                         ["quantile"], registry=r)
        self.tokens = Counter("hpml_generated_tokens", "tokens generated", registry=r)
        self.rate = Gauge("hpml_tokens_per_second", "tokens/s of the last batch", registry=r)
        self.requests = Counter("hpml_requests", "requests answered, by HTTP status", ["status"], registry=r)
        self.replans = Counter("hpml_replans", "pipelines re-planned after a rank failed", registry=r)
        self.speed_replans = Counter("hpml_speed_replans", "pipelines re-planned around a device measured slow",
                                     registry=r)
        self.stage_ratio = Gauge("hpml_stage_time_ratio", "a stage's measured compute time over its predicted, "
                                 "last batch", ["device"], registry=r)
        self.predicted = Gauge("hpml_predicted_tokens_per_second", "the plan's predicted tokens/s at its batch",
                               registry=r)
        self._recent: deque[float] = deque(maxlen=1000)

    def done(self, seconds: float) -> None:
        self.latency.observe(seconds)
        self._recent.append(seconds)
        s = sorted(self._recent)
        for q in (0.5, 0.95, 0.99):
            self.pct.labels(str(q)).set(s[min(len(s) - 1, int(q * len(s)))])


class _Batcher(threading.Thread):
    """The one thread that runs the generator (see the module docstring)."""

    def __init__(self, gen: Generator, limits: Limits, metrics: _Metrics, adapt: AdaptOptions) -> None:
        super().__init__(name="hpml-batcher", daemon=True)
        self.gen, self.limits, self.metrics, self.adapt = gen, limits, metrics, adapt
        self.inbox: queue.Queue[_Request | None] = queue.Queue(maxsize=limits.max_queue)
        self.failure: str | None = None
        self.switching = False  # between two pipelines: the old one closed, the new one starting
        self.watch = SpeedWatch(adapt)

    def down(self) -> str | None:
        """Why the server cannot take requests now, or None."""
        return self.failure or (None if self.switching else self.gen.broken)

    def _switch(self, plan: InferencePlan) -> None:
        """Stop the running pipeline and start ``plan``'s (queued requests wait for it)."""
        self.switching = True
        try:
            self.gen.close()
            self.gen = Generator(plan, slow=self.gen.slow)
        finally:
            self.switching = False

    def run(self) -> None:
        while True:
            try:
                first = self.inbox.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                self._safely(self.gen.heartbeat)
                continue
            if first is None:
                return
            batch, stop = [first], False
            deadline = time.monotonic() + self.limits.max_wait_ms / 1e3
            while len(batch) < self.limits.max_batch:
                try:
                    nxt = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self.metrics.queue.set(self.inbox.qsize())
            self._run(batch)
            if stop:
                return

    def _safely(self, fn: Any) -> None:
        try:
            fn()
        except LaunchError as e:
            self.failure = str(e)
            self._recover()

    def _recover(self) -> None:
        """Place the model again on the devices left, start a new pipeline and serve on (or stay failed)."""
        from .place import replan_without

        lost = self.gen.lost_devices()
        try:
            plan = replan_without(self.gen.plan, lost, self.watch.specs(self.gen.plan.cluster, self.gen.plan.specs()))
            self._switch(plan)
        except HpmlError as e:
            self.failure = f"{self.failure}; re-planning without {', '.join(lost) or 'the failed rank'} failed: {e}"
            return
        self.metrics.replans.inc()
        print(f"re-planned without {', '.join(lost) or 'the failed rank'}: {len(plan.stages)} stages on "
              f"{', '.join(s.device for s in plan.stages)}; serving again", file=sys.stderr, flush=True)
        self.failure = None

    def _run(self, batch: list[_Request]) -> None:
        if self.failure is not None:
            for r in batch:
                r.loop.call_soon_threadsafe(r.tokens.put_nowait, LaunchError(self.failure))
            return
        self.metrics.batch.observe(len(batch))

        def on_token(i: int, step: int, token: int) -> None:
            if step < batch[i].want:
                batch[i].loop.call_soon_threadsafe(batch[i].tokens.put_nowait, token)

        try:
            out = self.gen.generate([r.prompt for r in batch], max(r.want for r in batch), on_token=on_token)
        except (LaunchError, HpmlError) as e:
            if isinstance(e, LaunchError):
                self.failure = self.failure or str(e)
            for r in batch:
                r.loop.call_soon_threadsafe(r.tokens.put_nowait, e)
            if isinstance(e, LaunchError):
                self._recover()
            return
        n = sum(r.want for r in batch)
        self.metrics.tokens.inc(n)
        self.metrics.rate.set(n / max(out.total_ms / 1e3, 1e-9))
        for r in batch:
            r.loop.call_soon_threadsafe(r.tokens.put_nowait, None)  # the end of its tokens
        self._adapt(batch, out)

    def _adapt(self, batch: list[_Request], out: Generated) -> None:
        """Between two batches: re-plan around a device measured persistently slow (see :mod:`.adapt`)."""
        plan = self.gen.plan
        if not self.adapt.enabled or len(out.stage_ms) < 2:
            return
        specs = self.watch.specs(plan.cluster, plan.specs())
        mean_len = round(sum(len(r.prompt) for r in batch) / len(batch))
        expected = expected_stage_ms(plan, len(batch), mean_len, max(r.want for r in batch),
                                     plan.workload.microbatches, specs)
        devices = [s.device for s in plan.stages]
        for d, m, e in zip(devices, out.stage_ms, expected):
            self.metrics.stage_ratio.labels(d).set(m / e if e > 0 else 0.0)
        fired = self.watch.observe(devices, out.stage_ms, expected)
        if not fired:
            return
        self.watch.accept(fired)
        said = ", ".join(f"{d} {r:.2g}x" for d, r in fired.items())
        try:
            new, old = replan_on_speeds(plan, self.watch.specs(plan.cluster, plan.specs()))
        except HpmlError as e:
            print(f"measured slower than planned: {said}; no other placement: {e}", file=sys.stderr, flush=True)
            return
        where = "; ".join(f"{s.device} blocks {s.first}-{s.end - 1}" for s in new.stages)
        if new.predicted.tokens_per_s < old.tokens_per_s * self.adapt.min_gain:
            print(f"measured slower than planned: {said}; kept the running plan (the best on the measured speeds, "
                  f"{where}, predicts {new.predicted.tokens_per_s:.4g} tokens/s against "
                  f"{old.tokens_per_s:.4g})", file=sys.stderr, flush=True)
            return
        try:
            self._switch(new)
        except HpmlError as e:
            self.failure = f"switching to the plan for the measured speeds failed: {e}"
            return
        self.metrics.speed_replans.inc()
        self.metrics.stage_ratio.clear()
        self.metrics.predicted.set(new.predicted.tokens_per_s)
        print(f"measured slower than planned: {said}; re-planned on the measured speeds: {where} (predicts "
              f"{new.predicted.tokens_per_s:.4g} tokens/s against {old.tokens_per_s:.4g}); serving again",
              file=sys.stderr, flush=True)


def make_app(gen: Generator, limits: Limits = Limits(), adapt: AdaptOptions = AdaptOptions()) -> FastAPI:
    """The FastAPI application serving ``gen`` (see the module docstring)."""
    metrics = _Metrics()
    metrics.predicted.set(gen.plan.predicted.tokens_per_s)
    batcher = _Batcher(gen, limits, metrics, adapt)
    vocab, context = gen.vocab, gen.stage.max_seq_len

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        batcher.start()
        yield
        batcher.inbox.put(None)  # after the queued requests: they are served first
        await asyncio.get_running_loop().run_in_executor(None, batcher.join)
        batcher.gen.close()
        print("stopped: the queued requests were served and the ranks stopped", file=sys.stderr, flush=True)

    app = FastAPI(title="hpml-compile generation server", lifespan=lifespan)

    def refuse(status: int, message: str) -> JSONResponse:
        metrics.requests.labels(str(status)).inc()
        # A request refused before its body was read ends its connection (the rest of the body is not waited for).
        close = {"connection": "close"} if status in (408, 413) else None
        return JSONResponse({"error": message}, status_code=status, headers=close)

    async def read_body(request: Request) -> bytes | None:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            return None
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > limits.max_body_bytes:
                return None
        return body

    @app.get("/health")
    async def health() -> JSONResponse:
        failure = batcher.down()
        if failure:
            return JSONResponse({"status": "failed", "error": failure}, status_code=503)
        return JSONResponse({"status": "ok", "stages": batcher.gen.world, "queue": batcher.inbox.qsize(),
                             "devices": [s.device for s in batcher.gen.plan.stages]})

    @app.get("/metrics")
    async def prom() -> PlainTextResponse:
        metrics.queue.set(batcher.inbox.qsize())
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        try:
            body = await asyncio.wait_for(read_body(request), limits.body_timeout_s)
        except asyncio.TimeoutError:
            return refuse(408, f"request body not received in body_timeout_s ({limits.body_timeout_s:g} s)")
        if body is None:
            return refuse(413, f"request body over max_body_bytes ({limits.max_body_bytes} bytes)")
        try:
            item = json.loads(body)
            prompt = encode_item(item, 0, where="request")
            want = item.get("max_new_tokens", limits.default_new_tokens)
            stream = item.get("stream", False)
        except (ValueError, HpmlError) as e:  # json's error is a ValueError
            return refuse(400, f"malformed request: {e}")
        if not isinstance(want, int) or isinstance(want, bool) or want < 1:
            return refuse(422, f"max_new_tokens must be a positive integer, got {want!r}")
        if not isinstance(stream, bool):
            return refuse(400, f"malformed request: \"stream\" must be true or false, got {stream!r}")
        if want > limits.max_new_tokens:
            return refuse(422, f"max_new_tokens {want} is over the server's max_new_tokens ({limits.max_new_tokens})")
        if not prompt:
            return refuse(422, "the prompt is empty; give at least one token")
        if len(prompt) > limits.max_prompt_tokens:
            return refuse(422, f"prompt of {len(prompt)} tokens is over max_prompt_tokens ({limits.max_prompt_tokens})")
        if len(prompt) + want > context:
            return refuse(422, f"prompt of {len(prompt)} tokens plus max_new_tokens {want} is over the model's "
                               f"context ({context})")
        if any(not 0 <= t < vocab for t in prompt):
            return refuse(422, f"token ids must be in 0..{vocab - 1} (the model's vocabulary)")
        if failure := batcher.down():
            return refuse(503, f"the pipeline has failed: {failure}")
        req = _Request(prompt, want, asyncio.get_running_loop())
        try:
            batcher.inbox.put_nowait(req)
        except queue.Full:
            return refuse(429, f"the queue is full (max_queue {limits.max_queue}); retry later")
        if stream:
            return StreamingResponse(_stream(req, metrics), media_type="application/x-ndjson")
        tokens: list[int] = []
        while (tok := await req.tokens.get()) is not None:
            if isinstance(tok, Exception):
                return refuse(503, f"generation failed: {tok}")
            tokens.append(tok)
        metrics.done(time.perf_counter() - req.t0)
        metrics.requests.labels("200").inc()
        return {"tokens": tokens, "text": decode_tokens(tokens)}

    return app


async def _stream(req: _Request, metrics: _Metrics) -> AsyncIterator[bytes]:
    tokens: list[int] = []
    while (tok := await req.tokens.get()) is not None:
        if isinstance(tok, Exception):
            yield (json.dumps({"error": f"generation failed: {tok}"}) + "\n").encode()
            metrics.requests.labels("503").inc()
            return
        tokens.append(tok)
        yield (json.dumps({"token": tok}) + "\n").encode()
    metrics.done(time.perf_counter() - req.t0)
    metrics.requests.labels("200").inc()
    yield (json.dumps({"done": True, "tokens": tokens, "text": decode_tokens(tokens)}) + "\n").encode()


def serve(gen: Generator, *, host: str = "127.0.0.1", port: int = 8000, limits: Limits = Limits(),
          adapt: AdaptOptions = AdaptOptions(), say: Any = print) -> None:
    """Serve ``gen`` until SIGINT/SIGTERM (then drain the queue and stop the ranks)."""
    import uvicorn

    say(f"serving on http://{host}:{port} ({gen.world} stages; POST /generate, GET /health, GET /metrics)")
    uvicorn.Server(uvicorn.Config(make_app(gen, limits, adapt), host=host, port=port, log_level="warning",
                                  http=header_deadline_protocol(limits.header_timeout_s),
                                  h11_max_incomplete_event_size=limits.max_header_bytes,
                                  timeout_graceful_shutdown=30, limit_concurrency=limits.max_queue + 64)).run()
