"""``hpml-compile generate``, ``infer`` and ``serve`` over an inference build, and the ``--inference`` options.

``compile --inference MODEL --cluster C -o build/`` and ``plan --inference MODEL --cluster C -o plan.json``
make an inference plan (:mod:`hpml_compile.infer.place`) instead of a training one; the other three
commands run it.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(prog="hpml-compile")
    >>> add_parsers(p.add_subparsers(dest="command"))
    >>> a = p.parse_args(["generate", "build", "--prompt", "def ", "--max-new-tokens", "8"])
    >>> a.run is run_generate, a.max_new_tokens
    (True, 8)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import HpmlError, OptionError

__all__ = ["add_parsers", "add_inference_options", "run_inference_compile", "run_inference_plan",
           "run_generate", "run_infer", "run_serve"]


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def add_inference_options(p: argparse.ArgumentParser) -> None:
    """``--inference`` and the workload it is planned for (on ``compile`` and ``plan``)."""
    g = p.add_argument_group("inference (with --inference: a forward-only plan for generation)")
    g.add_argument("--inference", action="store_true",
                   help="plan generation with a KV cache instead of training: MODEL is a zoo decoder "
                        "(for `plan`, in place of the profile)")
    g.add_argument("--objective", choices=["throughput", "latency"], default="throughput",
                   help="tokens/s over the batch (default), or time to first token and per token at batch 1")
    if "--batch-size" not in p._option_string_actions:
        g.add_argument("--batch-size", type=int, dest="batch_size", help="sequences in flight (default 8)")
    g.add_argument("--prompt-len", type=int, default=None, dest="prompt_len",
                   help="prompt tokens the plan is priced for (default: a quarter of the context)")
    g.add_argument("--new-tokens", type=int, default=None, dest="new_tokens",
                   help="tokens generated per sequence (default: a quarter of the context)")
    g.add_argument("--serve-dtype", default="float32", dest="serve_dtype",
                   choices=["float32", "bfloat16", "float16"], help="weights and cache dtype (default float32)")
    g.add_argument("--weights", type=Path, default=None,
                   help="a safetensors file of the model's state (safetensors.torch.save_model); each rank reads "
                        "only its stage's tensors (default: the weights of --seed)")
    g.add_argument("--latency-bound-ms", type=float, default=None, dest="latency_bound_ms",
                   help="with throughput: the most one decode step (per-token latency) may take")


def _plan(args: argparse.Namespace, model: str) -> Any:
    from ..infer.api import _shape, plan_for

    ctx = _shape(model, getattr(args, "seed", 0)).max_seq_len
    return plan_for(model, args.cluster, batch=args.batch_size or 8, prompt_len=args.prompt_len or ctx // 4,
                    new_tokens=args.new_tokens or ctx // 4, dtype=args.serve_dtype, objective=args.objective,
                    latency_bound_ms=args.latency_bound_ms, seed=getattr(args, "seed", 0), weights=args.weights)


def _report(plan: Any) -> None:
    p, w = plan.predicted, plan.workload
    print(f"{len(plan.stages)} stages, batch {w.batch} in {w.microbatches} lanes ({w.dtype}, {plan.objective.value}); "
          f"predicted {p.tokens_per_s:.4g} tokens/s, first token {p.ttft_ms:.4g} ms, {p.token_ms:.4g} ms per token; "
          f"planned in {plan.planning_ms:.0f} ms")
    for k, s in enumerate(plan.stages):
        extra = "".join([" +embedding" if s.embed else "", " +head" if s.head else "",
                         " (weights streamed from host)" if s.stream else ""])
        print(f"  stage {k} on {s.device}: blocks {s.first}..{s.end - 1}{extra}; decode {s.decode_ms:.3g} ms, "
              f"prefill {s.prefill_ms:.3g} ms per lane, {s.memory_bytes / 2**30:.3g} GiB")
    for d, why in plan.idle:
        print(f"  {d} idle: {why}")
    t = plan.cpu_timing
    if t is not None:
        print(f"  CPUs priced from one block timed here (torch threads {t.threads}, {t.rows} rows, prompt "
              f"{t.prompt_len}): prefill {t.prefill_ms:.3g} ms, decode step {t.decode_ms:.3g} ms"
              + (f" ({t.decode_cold_ms:.3g} ms with its weights out of the caches, as a stage of a pipeline)"
                 if t.decode_cold_ms > 0 else ""))
        if t.handoff_gbps > 0:
            print(f"  a hand-off between two ranks of this host (pipes): {t.handoff_us:.3g} us + "
                  f"{t.handoff_gbps:.3g} GB/s")
        if t.handoff_idle:
            print(f"  ... to a rank idle before it for {'/'.join(f'{ms:g}' for ms, _ in t.handoff_idle)} ms: "
                  f"{'/'.join(f'{us:.3g}' for _, us in t.handoff_idle)} us (a rank that waits while the others "
                  "compute)")
        if t.decode_turns:
            print(f"  ... its {t.turn_blocks} blocks as two stages taking turns, each idle "
                  f"{'/'.join(f'{g:.3g}' for g, _ in t.decode_turns)} ms between its steps: "
                  f"{'/'.join(f'{r:.3g}' for _, r in t.decode_turns)} ms for both steps (a stage's decode step woken "
                  "from its wait)")
    elif any(plan.cluster.device(s.device).is_cpu for s in plan.stages):
        print("  CPUs priced from the catalog's rates (assumed: no block of this model was timed on this host)")


def refuse_compiled_inference(args: argparse.Namespace) -> None:
    """Refuse ``--compile-stages on`` with ``--inference``: inference stages run eager (their KV-cache steps change
    shape every token), so a build that said otherwise would name what the runtime does not do.

    Raises:
        OptionError: ``--compile-stages on`` was given.
    """
    if getattr(args, "compile_stages", "auto") == "on":
        raise OptionError("--compile-stages on with --inference: inference stages run eager (each generated token "
                          "changes the KV cache's shape); leave --compile-stages out (or auto/off) for an inference "
                          "build")


def run_inference_compile(args: argparse.Namespace) -> int:
    """``compile --inference``: write an inference build (``plan.json``)."""
    from ..infer.api import _made_by
    from ..infer.plan import save_inference_plan
    from ..publish import publish_dir
    from ..recipe import absolute_model_spec

    plan = _plan(args, args.model)
    plan = plan.with_model(absolute_model_spec(args.model), plan.seed, plan.weights)
    publish_dir(args.output, lambda d: save_inference_plan(plan, d / "plan.json"), made_by=_made_by,
                what="inference build")
    _report(plan)
    print(f"wrote {Path(args.output) / 'plan.json'}")
    return 0


def run_inference_plan(args: argparse.Namespace) -> int:
    """``plan --inference MODEL``: write the inference plan."""
    from ..infer.plan import save_inference_plan

    plan = _plan(args, args.profile)
    _report(plan)
    if args.output:
        print(f"wrote {save_inference_plan(plan, args.output)}")
    return 0


def add_parsers(subparsers: Any) -> None:
    """Register ``generate``, ``infer`` and ``serve``."""
    p = subparsers.add_parser("generate", help="generate tokens from a prompt with an inference build",
                              description="Greedy generation through the build's pipeline (one process per stage).")
    p.add_argument("build", type=Path, help="the folder `compile --inference` wrote (or its plan.json)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (its UTF-8 bytes are the tokens); repeatable")
    src.add_argument("--tokens", action="append", help="prompt token ids, comma-separated; repeatable")
    p.add_argument("--max-new-tokens", type=int, default=32, dest="max_new_tokens", help="default 32")
    p.set_defaults(run=run_generate)

    p = subparsers.add_parser("infer", help="batch inference over a JSONL file, resumable",
                              description="Generate for every line of --data ({\"prompt\": text} or {\"tokens\": "
                                          "[ids]}) and write JSONL to -o; rerun the same command after a kill to "
                                          "continue where it stopped.")
    p.add_argument("build", type=Path)
    p.add_argument("--data", type=Path, required=True, help="input JSONL")
    p.add_argument("-o", "--output", type=Path, required=True, help="output JSONL (written when complete)")
    p.add_argument("--batch-size", type=int, default=None, dest="batch_size", help="default: the plan's batch")
    p.add_argument("--max-new-tokens", type=int, default=32, dest="max_new_tokens",
                   help="per item unless the item says (default 32)")
    p.set_defaults(run=run_infer)

    p = subparsers.add_parser("serve", help="serve an inference build over HTTP (batching, streaming, metrics)",
                              description="POST /generate, GET /health, GET /metrics (Prometheus).")
    p.add_argument("build", type=Path)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--max-batch", type=int, default=None, dest="max_batch", help="default: the plan's batch")
    p.add_argument("--max-wait-ms", type=float, default=10.0, dest="max_wait_ms")
    p.add_argument("--max-queue", type=int, default=256, dest="max_queue")
    p.add_argument("--max-body-bytes", type=int, default=1 << 16, dest="max_body_bytes")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, dest="max_prompt_tokens")
    p.add_argument("--max-new-tokens", type=int, default=256, dest="max_new_tokens")
    p.add_argument("--header-timeout-s", type=float, default=10.0, dest="header_timeout_s",
                   help="seconds a client may take to send a request's headers (then 408; default 10)")
    p.add_argument("--body-timeout-s", type=float, default=10.0, dest="body_timeout_s",
                   help="seconds a client may take to send a request's body (then 408; default 10)")
    a = p.add_argument_group("re-planning around a device measured slow while serving")
    a.add_argument("--no-adapt", action="store_false", dest="adapt", help="never re-plan on measured speeds")
    a.add_argument("--adapt-threshold", type=float, default=1.5, dest="adapt_threshold", metavar="X",
                   help="a stage is slow above X times its predicted share of a batch (default %(default)s)")
    a.add_argument("--adapt-patience", type=int, default=3, dest="adapt_patience", metavar="K",
                   help="slow batches in a row before re-planning (default %(default)s)")
    a.add_argument("--adapt-baseline", type=int, default=3, dest="adapt_baseline", metavar="N",
                   help="first batches of a plan that learn each stage's usual share (default %(default)s)")
    a.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR:FROM_BATCH",
                   help="a drill: rank RANK computes FACTOR times slower from its FROM_BATCH-th batch (from 1) on")
    p.set_defaults(run=run_serve)


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and not value > 0:
        raise HpmlError(f"{name} must be > 0, got {value}")


def run_generate(args: argparse.Namespace) -> int:
    """Handle ``generate``: print each continuation, then predicted against measured times."""
    from ..infer.api import open_build
    from ..infer.batch import decode_tokens, encode_item

    _positive("--max-new-tokens", args.max_new_tokens)
    if args.prompt:
        prompts = [encode_item({"prompt": t}, i, "--prompt") for i, t in enumerate(args.prompt)]
    else:
        try:
            prompts = [[int(x) for x in t.split(",") if x.strip()] for t in args.tokens]
        except ValueError:
            raise HpmlError("--tokens: expected comma-separated integer ids, e.g. --tokens 104,105") from None
    with open_build(args.build) as g:
        out = g.generate(prompts, args.max_new_tokens)
    for toks in out.tokens:
        text = decode_tokens(toks)
        print(repr(text) if text is not None else ",".join(map(str, toks)))
    p = out.predicted
    assert p is not None
    print(f"measured {out.tokens_per_s:.4g} tokens/s, first token {out.ttft_ms:.4g} ms, {out.token_ms:.4g} ms per "
          f"token; predicted {p.tokens_per_s:.4g} tokens/s, {p.ttft_ms:.4g} ms, {p.token_ms:.4g} ms (one cold run: "
          "the first call pays one-time start-up costs)", file=sys.stderr)
    return 0


def run_infer(args: argparse.Namespace) -> int:
    """Handle ``infer``."""
    from ..infer.api import open_build
    from ..infer.batch import run_batch

    _positive("--batch-size", args.batch_size)
    _positive("--max-new-tokens", args.max_new_tokens)
    with open_build(args.build) as g:
        made = run_batch(lambda prompts, n: g.generate(prompts, n).tokens, args.data, args.output,
                         batch=args.batch_size or g.plan.workload.batch, max_new_tokens=args.max_new_tokens,
                         say=_say)
    print(f"wrote {args.output} ({made} items generated by this run)")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """Handle ``serve``."""
    from ..infer.adapt import AdaptOptions
    from ..infer.plan import load_inference_plan
    from ..infer.engine import Generator
    from ..infer.server import Limits, serve
    from ..runtime.job.options import parse_slow

    for name in ("max_batch", "max_wait_ms", "max_queue", "max_body_bytes", "max_prompt_tokens", "max_new_tokens",
                 "header_timeout_s", "body_timeout_s"):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name))
    if not args.adapt_threshold > 1 or args.adapt_patience < 1 or args.adapt_baseline < 0:
        raise HpmlError(f"--adapt-threshold must be > 1, --adapt-patience >= 1 and --adapt-baseline >= 0, got "
                        f"{args.adapt_threshold}, {args.adapt_patience} and {args.adapt_baseline}")
    try:
        slows = [parse_slow(t) for t in args.slow]
    except argparse.ArgumentTypeError as e:
        raise HpmlError(f"--slow: {e}") from None
    plan = load_inference_plan(args.build)
    for rank, _, _ in slows:
        if rank >= len(plan.stages):
            raise HpmlError(f"--slow: rank {rank} is not a rank of the plan (0..{len(plan.stages) - 1})")
    gen = Generator(plan, slow={plan.stages[r].device: (f, b) for r, f, b in slows})
    limits = Limits(max_batch=args.max_batch or gen.plan.workload.batch, max_wait_ms=args.max_wait_ms,
                    max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                    max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                    default_new_tokens=min(16, args.max_new_tokens), header_timeout_s=args.header_timeout_s,
                    body_timeout_s=args.body_timeout_s)
    try:
        serve(gen, host=args.host, port=args.port, limits=limits, say=_say,
              adapt=AdaptOptions(args.adapt, args.adapt_threshold, args.adapt_patience,
                                                               baseline=args.adapt_baseline))
    finally:
        gen.close()
    return 0
