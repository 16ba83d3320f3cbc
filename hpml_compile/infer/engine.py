"""Pipelined generation on gloo ranks: this process is stage 0 and drives; one process per further stage.

:class:`Generator` starts a worker process per stage after the first
(``python -m hpml_compile.infer.worker``), forms a gloo process group with
them over a free localhost port, and runs the plan's stages as
:class:`~hpml_compile.infer.kv.Stage` objects. A call to
:meth:`Generator.generate` broadcasts the request's shape (prompt lengths,
lanes, tokens wanted) to every rank over gloo, then every rank runs the same
loop, handing tensors on through a ring of pipes (:mod:`.handoff`: the ranks
share this host)::

    for step in range(max_new_tokens):          # step 0 is the prefill
        for lane in lanes:                       # microbatches of sequences, each with its own cache
            x = recv from the previous stage     # stage 0: the prompt, or the lane's last token
            y = stage.step(lane, x, start)
            send y to the next stage             # the last stage sends the greedy tokens back to stage 0

Sends never block (what a pipe does not take is written while the rank next
waits), so while the last stage works on lane 0, stage 0 already runs lane 1:
with as many lanes as stages every stage is busy.
Stage 0 waits for a lane's token only when that lane's next step begins.
Greedy decoding only: each token is the argmax of the last position's logits.

Example:
    >>> from hpml_compile.cluster import load_cluster
    >>> from hpml_compile.infer import place, DecoderShape, Workload
    >>> from hpml_compile.models.gpt import PRESETS
    >>> plan = place(DecoderShape.from_config(PRESETS["gpt-tiny"]), load_cluster("local-cpu-1"), Workload(2, 4, 4),
    ...              model="gpt-tiny")
    >>> with Generator(plan) as g:
    ...     out = g.generate([[1, 2, 3], [4]], max_new_tokens=3)
    >>> [len(t) for t in out.tokens]
    [3, 3]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import HpmlError, LaunchError
from ..ir import Device
from .handoff import PipeLink, pipe_ring
from .hf import HFStage, is_hf_llama
from .kv import Stage
from .plan import InferencePlan, Prediction, save_inference_plan

__all__ = ["Generator", "Generated", "StageClock", "build_stage", "gather_stage_ms", "load_stage_weights", "lanes_of",
           "OP_STOP", "OP_GENERATE", "OP_NOOP"]

OP_STOP, OP_GENERATE, OP_NOOP = 0, 1, 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
START_TIMEOUT_S = 120.0
OnToken = Callable[[int, int, int], None]  # (sequence index, step, token)


@dataclass(frozen=True, slots=True)
class Generated:
    """What :meth:`Generator.generate` returns, with its measured times."""

    tokens: list[list[int]]  # per sequence, the new tokens
    logits: list[Tensor] | None  # per sequence, [new, vocab] float32, when asked for
    ttft_ms: float  # until every sequence had its first token (the batch's prefill)
    token_ms: float  # mean time of one decode step after that
    total_ms: float
    predicted: Prediction | None = None  # what the plan's stages predict for this run's batch and lengths
    stage_ms: tuple[float, ...] = ()  # per stage, the time its rank spent computing (waits for others excluded)

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.tokens)) / max(self.total_ms / 1e3, 1e-9)


class StageClock:
    """A rank's compute time over one generation, with an injected slowdown (a fault drill) applied.

    Args:
        slow: ``(factor, from_run)``: from the ``from_run``-th generation on (counted from 1), every step
            takes ``factor`` times as long (the rank sleeps the difference); None: no fault.
    """

    def __init__(self, slow: Sequence[float] | None = None) -> None:
        self.factor, self.from_run = (float(slow[0]), int(slow[1])) if slow else (1.0, 1)
        self.runs, self.ms = 0, 0.0

    def begin(self) -> None:
        """Start a generation: the time so far is forgotten."""
        self.runs += 1
        self.ms = 0.0

    def time(self, fn: Callable[..., Tensor], *args: Any) -> Tensor:
        """``fn(*args)``, its time added to :attr:`ms` (stretched by the fault when it applies)."""
        t0 = time.perf_counter()
        y = fn(*args)
        if self.factor > 1 and self.runs >= self.from_run:
            time.sleep((time.perf_counter() - t0) * (self.factor - 1))
        self.ms += (time.perf_counter() - t0) * 1e3
        return y


def gather_stage_ms(ms: float, world: int) -> tuple[float, ...]:
    """Every rank's compute time of the generation just run, on rank 0 (a collective: every rank calls it).

    Returns:
        Per stage, milliseconds on rank 0; an empty tuple elsewhere.
    """
    mine = torch.tensor([ms], dtype=torch.float64)
    if world == 1:
        return (ms,)
    parts = [torch.empty(1, dtype=torch.float64) for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather(mine, parts, dst=0)
    return tuple(float(p) for p in parts) if parts is not None else ()


def lanes_of(n: int, lanes: int) -> list[range]:
    """Split ``n`` sequences into ``min(lanes, n)`` contiguous lanes as even as can be."""
    k = max(1, min(lanes, n))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(k)]


def torch_device(device: Device) -> torch.device:
    """The torch device a plan's device runs on here: ``cpu``, or ``cuda:N`` for a GPU named ``...N``.

    Raises:
        LaunchError: for a GPU this machine does not have.
    """
    if device.is_cpu:
        return torch.device("cpu")
    digits = "".join(ch for ch in device.name if ch.isdigit()) or "0"
    if not torch.cuda.is_available() or int(digits) >= torch.cuda.device_count():
        raise LaunchError(f"plan device {device.name} ({device.kind}) is a GPU, but this machine has "
                          f"{torch.cuda.device_count()} CUDA devices; plan for the devices here "
                          "(`hpml-compile devices -o cluster.json`)")
    return torch.device(f"cuda:{int(digits)}")


def build_stage(plan: InferencePlan, rank: int, model: torch.nn.Module | None = None) -> Stage | HFStage:
    """Rank ``rank``'s stage: the model rebuilt from its seed, cut to the stage, moved to its device and dtype.

    Raises:
        HpmlError: for a model that is neither a zoo decoder nor a Hugging Face Llama.
    """
    from ..models.gpt import GPT

    st = plan.stages[rank]
    if model is None:
        from .. import models

        model = models.load(plan.model, seed=plan.seed).module
    if isinstance(model, GPT):
        kind: type[Stage] | type[HFStage] = Stage
    elif is_hf_llama(model):
        kind = HFStage
    else:
        raise HpmlError(f"generation runs the zoo's decoder models (GPT-2 and Llama shapes) and Hugging Face "
                        f"Llama causal LMs; {plan.model} is a {type(model).__name__}")
    model = kind.keep_only(model.eval(), st.first, st.end)
    if plan.weights:
        load_stage_weights(model, plan.weights)
    model.to(device=torch_device(plan.cluster.device(st.device)), dtype=DTYPES[plan.workload.dtype])
    return kind(model, st.first, st.end)  # type: ignore[arg-type]


# A tied table saved once is found under any of its names.
_TIED = {"lm_head.weight": ("wte.weight", "model.embed_tokens.weight"), "wte.weight": ("lm_head.weight",),
         "model.embed_tokens.weight": ("lm_head.weight",)}


@torch.no_grad()
def load_stage_weights(model: torch.nn.Module, path: str) -> None:
    """Copy the tensors a cut model still holds from a safetensors file, reading only those.

    A tied table saved once (``safetensors.torch.save_model`` keeps one name of a shared tensor) is found
    under either name.

    Raises:
        HpmlError: for a missing file, a tensor the file lacks or one of another shape, naming it.
    """
    from safetensors import safe_open

    if not Path(path).is_file():
        raise HpmlError(f"weights {path}: no such file; save them with safetensors.torch.save_model(model, path)")
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        for name, t in model.state_dict(keep_vars=True).items():
            src = next((k for k in (name, *_TIED.get(name, ())) if k in keys), None)
            if src is None:
                raise HpmlError(f"weights {path}: no tensor {name!r}; the file must hold the whole model's state "
                                "(safetensors.torch.save_model(model, path))")
            value = f.get_tensor(src)
            if value.shape != t.shape:
                raise HpmlError(f"weights {path}: {name} has shape {tuple(value.shape)}, the model's is "
                                f"{tuple(t.shape)}; were they saved from another model?")
            t.copy_(value)


class Generator:
    """Pipelined greedy generation over a plan's stages (see the module docstring).

    Args:
        plan: the inference plan (its ``model`` a zoo decoder).
        model: the whole model for stage 0 (default: rebuilt from the plan's seed, as the workers do).
        threads: torch threads of each rank, this process's included while it generates (default: the count
            the plan's CPU block was timed with, :mod:`hpml_compile.infer.timing`; else this machine's cores
            over the stages; with one stage, this process's own setting).
        timeout_s: how long a rank may wait on another before the group fails.
        slow: a fault to inject on purpose: device name -> ``(factor, from_run)``: the rank of that device
            computes ``factor`` times slower from its ``from_run``-th generation on (counted from 1 by each
            generator).

    Raises:
        LaunchError: if a worker cannot start or join.
    """

    def __init__(self, plan: InferencePlan, *, model: torch.nn.Module | None = None, threads: int | None = None,
                 timeout_s: float = 600.0, slow: Mapping[str, tuple[float, int]] | None = None) -> None:
        self.plan, self.world = plan, len(plan.stages)
        self.slow = dict(slow or {})
        self._closed = False
        self.broken: str | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._link: PipeLink | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="hpml-infer-")
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)
        timed = plan.cpu_timing.threads if plan.cpu_timing is not None else None  # what its CPUs were priced at
        self.threads = threads or timed or (max(1, (os.cpu_count() or 1) // self.world) if self.world > 1 else None)
        if self.world > 1:
            self._start_workers(self.threads or 1, timeout_s)
        self.stage = build_stage(plan, 0, model)
        self.d_model, self.vocab = self.stage.d_model, self.stage.vocab_size
        self._clock = StageClock(self.slow.get(plan.stages[0].device))

    def _start_workers(self, threads: int, timeout_s: float) -> None:
        from ..runtime.job.launcher import free_port

        plan_path = save_inference_plan(self.plan, Path(self._dir.name) / "plan.json")
        port = free_port()
        pipes = pipe_ring(self.world)  # pipes[i]: rank i -> rank i + 1 (the last: -> rank 0)
        for rank in range(1, self.world):
            log = open(Path(self._dir.name) / f"rank{rank}.log", "wb")
            ends = (pipes[rank - 1][0], pipes[rank][1])
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "hpml_compile.infer.worker", str(plan_path), str(rank), str(self.world),
                 str(port), str(threads), str(timeout_s), json.dumps(self.slow.get(self.plan.stages[rank].device)),
                 *map(str, ends)], stdout=log, stderr=subprocess.STDOUT, pass_fds=ends))
            log.close()
            for fd in ends:  # the worker's now: it alone holds them, so its exit closes them
                os.close(fd)
        self._link = PipeLink(pipes[-1][0], pipes[0][1], f"rank {self.world - 1} / rank 1", timeout_s)
        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=self.world,
                                    timeout=timedelta(seconds=min(timeout_s, START_TIMEOUT_S)))
        except Exception as e:  # noqa: BLE001 - a worker that died before joining shows as a timeout here
            _kill_all(self._procs)
            self._link.close()
            raise LaunchError(f"inference ranks did not join: {e}; {self._worker_report()}") from None

    def _worker_report(self) -> str:
        words = []
        for rank, p in enumerate(self._procs, start=1):
            code = p.poll()
            log = Path(self._dir.name) / f"rank{rank}.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            state = "running" if code is None else f"exited with status {code}"
            words.append(f"rank {rank} {state}" + (f" ({tail[0]})" if tail and code else ""))
        return "; ".join(words) or "no workers"

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker ranks (stages 1..), in stage order."""
        return [p.pid for p in self._procs]

    def lost_devices(self) -> list[str]:
        """The plan devices whose worker rank has exited."""
        return [self.plan.stages[rank].device for rank, p in enumerate(self._procs, start=1) if p.poll() is not None]

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def heartbeat(self) -> None:
        """Wake the workers (an idle server calls this so that their wait never reaches the group's timeout)."""
        if self.world > 1 and self.broken is None:
            self._guarded(lambda: dist.broadcast(torch.tensor([OP_NOOP, 0, 0, 0, 0]), src=0))

    def close(self) -> None:
        """Stop the workers (a stop message, then a kill after 10 s) and leave the process group; once."""
        if self._closed:
            return  # a later generator may hold the process group by now
        self._closed = True
        if self.world > 1 and dist.is_initialized():
            if self.broken is None:
                try:
                    dist.broadcast(torch.tensor([OP_STOP, 0, 0, 0, 0]), src=0)
                except RuntimeError:
                    pass
            for p in self._procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            dist.destroy_process_group()
        _kill_all(self._procs)
        if self._link is not None:
            self._link.close()
        self.stage.close()
        self.broken = self.broken or "closed"

    def _guarded(self, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except RuntimeError as e:  # gloo or a pipe (HandoffError): a peer's connection closed or timed out
            said = re.sub(r"\[[^\]]*\.cc:\d+\] ", "", str(e)).split(". This is typically")[0]
            time.sleep(0.5)  # the dead worker's exit status settles
            self.broken = f"a rank failed while generating ({said}); {self._worker_report()}"
            raise LaunchError(self.broken) from None

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, lanes: int | None = None,
                 on_token: OnToken | None = None, return_logits: bool = False) -> Generated:
        """Greedy tokens for each prompt.

        Args:
            prompts: token ids per sequence (each non-empty, ids below the vocabulary size).
            max_new_tokens: tokens to generate per sequence.
            lanes: microbatches in flight (default: the plan's).
            on_token: called with (sequence, step, token) as each token arrives on stage 0.
            return_logits: also return each step's logits.

        Returns:
            The tokens (and logits) with measured times.

        Raises:
            HpmlError: on an empty prompt, an id out of range or a context longer than the model's.
            LaunchError: if a rank has failed (the generator is then broken).
        """
        if self.broken is not None:
            raise LaunchError(f"the generator cannot run: {self.broken}")
        _check(prompts, max_new_tokens, self.vocab, self.stage.max_seq_len)
        lens = torch.tensor([len(p) for p in prompts])
        m = lanes or self.plan.workload.microbatches
        if self.world > 1:
            self._guarded(lambda: (dist.broadcast(torch.tensor([OP_GENERATE, len(prompts), m, max_new_tokens,
                                                                int(return_logits)]), src=0),
                                   dist.broadcast(lens, src=0)))
        before = torch.get_num_threads()
        if self.threads:  # rank 0 computes a stage too: as many threads as the others, not all the cores
            torch.set_num_threads(self.threads)
        try:
            out: Generated = self._guarded(lambda: self._drive(prompts, lens, m, max_new_tokens, on_token,
                                                               return_logits))  # type: ignore[assignment]
        finally:
            torch.set_num_threads(before)
        from .place import predict_run

        pred = predict_run(self.plan, len(prompts), int(lens.float().mean().round()), max_new_tokens, m)
        return replace(out, predicted=pred)

    def _drive(self, prompts: Sequence[Sequence[int]], lens: Tensor, m: int, new: int, on_token: OnToken | None,
               want_logits: bool) -> Generated:
        lanes = lanes_of(len(prompts), m)
        width = [int(lens[list(r)].max()) for r in lanes]
        for k, r in enumerate(lanes):
            self.stage.open(k, width[k] - lens[list(r)], width[k] + new)
        x = [torch.tensor([[0] * (width[k] - len(prompts[i])) + list(prompts[i]) for i in r])
             for k, r in enumerate(lanes)]
        tokens: list[list[int]] = [[] for _ in prompts]
        logits: list[list[Tensor]] = [[] for _ in prompts]
        link = self._link
        t0 = time.perf_counter()
        first_done = [t0]

        def take(k: int, step: int) -> None:
            if self.world == 1:
                out = self._last_out[k]
            else:
                out = torch.empty(len(lanes[k]), self.vocab) if want_logits else None
                tok = torch.empty(len(lanes[k]), dtype=torch.long)
                assert link is not None
                link.recv(tok)
                if out is not None:
                    link.recv(out)
            toks = out.argmax(-1) if self.world == 1 else tok
            for j, i in enumerate(lanes[k]):
                tokens[i].append(int(toks[j]))
                if want_logits and out is not None:
                    logits[i].append(out[j].float())
                if on_token is not None:
                    on_token(i, step, int(toks[j]))
            x[k] = toks[:, None]
            if step == 0 and k == len(lanes) - 1:
                first_done[0] = time.perf_counter()  # every sequence has its first token

        self._last_out: dict[int, Tensor] = {}
        self._clock.begin()
        for step in range(new):
            for k in range(len(lanes)):
                if step > 0:
                    take(k, step - 1)
                start = 0 if step == 0 else width[k] + step - 1
                y = self._clock.time(self.stage.step, k, x[k], start)
                if self.world == 1:
                    self._last_out[k] = y.float()
                else:
                    assert link is not None
                    link.send(y.float().cpu().contiguous())
        for k in range(len(lanes)):
            take(k, new - 1)
        if link is not None:
            link.flush()
        total = (time.perf_counter() - t0) * 1e3
        self.stage.close()
        ttft = (first_done[0] - t0) * 1e3
        return Generated(tokens, [torch.stack(v) for v in logits] if want_logits else None, ttft,
                         (total - ttft) / max(new - 1, 1), total, stage_ms=gather_stage_ms(self._clock.ms, self.world))


def _check(prompts: Sequence[Sequence[int]], new: int, vocab: int, max_seq_len: int) -> None:
    if not prompts:
        raise HpmlError("generate: no prompts given")
    if new < 1:
        raise HpmlError(f"generate: max_new_tokens must be >= 1, got {new}")
    for i, p in enumerate(prompts):
        if not p:
            raise HpmlError(f"generate: prompt {i} is empty; give at least one token")
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise HpmlError(f"generate: prompt {i} has token ids {bad[:5]} outside 0..{vocab - 1} (the vocabulary)")
        if len(p) + new > max_seq_len:
            raise HpmlError(f"generate: prompt {i} ({len(p)} tokens) plus {new} new tokens exceeds the model's "
                            f"context of {max_seq_len}; shorten it or ask for fewer tokens")


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
