"""Inference plans against memory-proportional placement, on the simulator and on 2 CPU ranks.

**Simulated** (:func:`simulated_rows`): each scenario's model is placed by

- ``ours``: :func:`hpml_compile.infer.place.place` (speed-aware, lanes searched, idle devices allowed);
- ``accelerate``: ``device_map="auto"`` as its docs describe it: fill the fastest GPU with blocks, then
  the next, then CPU RAM; CPU-held blocks are copied to the first GPU before each use (synchronously:
  copy plus compute) and one device works at a time on the whole batch (no lanes);
- ``llama.cpp``: layers split over the GPUs in proportion to their memory (``--tensor-split``'s
  default), as many as fit (``-ngl``), the rest computed on the CPU; credited with our lanes (its
  pipeline parallelism over concurrent sequences), the best lane count kept;
- ``best single``: the best device alone, resident or streaming.

- ``at most``: the most any pipeline plan could gain over ``accelerate`` under this cost model: its
  predicted time over ``(new_tokens - 1)`` times :func:`hpml_compile.infer.place.decode_floor_ms`, a floor
  under every decode step of every plan :func:`~hpml_compile.infer.place.place` can return, any lanes (a
  decode step reads each block's weights at least once, from a memory that holds it or over the host link).
  Where it is under 1.5, 1.5x over accelerate is out of reach for pipeline plans, proven, not just unmet.

All are priced by the same cost model (:mod:`hpml_compile.infer.cost`) and scored by the same formula
(:func:`hpml_compile.infer.place.score`); tokens/s are for the scenario's whole workload, prefill included.
The scenarios: (a) a fast GPU and a slower one where the model fits the faster (the shape of the
lmstudio-bug-tracker#1608 report, 5090 + 3080 slower than the 5090 alone); (b) a GPU plus the host CPU
where the model and its cache do not fit the GPU (the CPU is a stated two-socket server, not this
machine); (c) the built-in ``hetero-4`` and ``benchmarks/plan_quality/mix3-8.json``.

**Measured** (:func:`measured_rows`, skipped with ``--sim-only``): ``gpt-mini`` greedy generation on 2 CPU
ranks of this machine (a 2-stage plan, 2 lanes, one torch thread each) against one process running the
same model (all cores): the eager model recomputing the sequence each token (what ``model(ids)`` in a loop
does) and the same cached forward without a pipeline. Throughput at batch 16 and latency at batch 1, with
the plan's predicted tokens/s, time to first token and per-token latency beside the measured (the median of
:data:`RUNS` generations) and the error of each. The plan prices the CPUs from a block of the model timed in
this process with one torch thread (:func:`hpml_compile.infer.timing.time_block`: back to back, and with its
weights out of the caches as a stage of a pipeline runs it) and the hand-off between the ranks timed through
the generator's pipes, to a receiver waiting for it and to one idle for a while before it (as a rank is at
batch 1 while the other computes), and the blocks split in two stages taking turns with one lane (a rank woken
from a wait computes slower than one run back to back), as ``compile --inference`` does. Timings need a
quiet machine; ``--measured-only --batch 1`` measures one row alone.

Run:
    python benchmarks/inference/main.py                 # ~1-2 min
    python benchmarks/inference/main.py --sim-only      # the simulated table only, seconds
Writes benchmarks/inference/results/inference.json (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import cost_models
from hpml_compile.cluster import load_cluster
from hpml_compile.infer import DecoderShape, InferencePlan, Workload, place, score
from hpml_compile.infer.cost import Objective, stage_bytes
from hpml_compile.infer.place import (LANES, MEMORY_FRACTION, decode_compute_ms, decode_floor_ms, device_order,
                                      stages_for)
from hpml_compile.infer.timing import time_block, timed_specs
from hpml_compile.ir import Cluster, Device
from hpml_compile.models.gpt import PRESETS

HERE = Path(__file__).resolve().parent
# A two-socket server's CPUs for scenario (b): ~200 GB/s of DDR5 over 16 channels at half efficiency, ~2
# TFLOP/s of float32 from 64 AVX-512 cores; per-op dispatch of eager PyTorch.
SERVER_CPU = cost_models.DeviceSpec("cpu", "cpu", 512 * 2**30, 200e9, {"float32": 2e12}, 0.01, "gloo-loopback",
                                    None, source="stated for this benchmark: a two-socket server")
SPECS = {"cpu": SERVER_CPU}
RUNS = 7  # generations per measured row, the median kept: one of 32 tokens at batch 1 takes well under 0.1 s


def _cluster(name: str, *devs: tuple[str, str, float]) -> Cluster:
    return Cluster(devices=tuple(Device(n, k, g) for n, k, g in devs), name=name)


def scenarios() -> list[tuple[str, str, Cluster, Workload, str]]:
    """``(label, model, cluster, workload, objective)`` for each simulated case."""
    bf = dict(dtype="bfloat16")
    fits = _cluster("4090+T4", ("gpu0", "RTX-4090", 24), ("gpu1", "T4", 16))
    spill = _cluster("T4+cpu", ("gpu0", "T4", 16), ("cpu0", "cpu", 256))
    mix = Cluster.from_dict(json.loads((HERE.parent / "plan_quality" / "mix3-8.json").read_text()))
    return [
        ("(a) fits the faster, batch 1", "llama-7b", fits, Workload(1, 512, 128, **bf), "latency"),
        ("(a) fits the faster, batch 8", "llama-7b", fits, Workload(8, 512, 128, **bf), "throughput"),
        ("(b) GPU + host CPU", "llama-7b", spill, Workload(16, 512, 256, **bf), "throughput"),
        ("(c) hetero-4, llama-70b", "llama-70b", load_cluster("hetero-4"), Workload(16, 512, 128, **bf),
         "throughput"),
        ("(c) mix3-8, llama-70b", "llama-70b", mix, Workload(16, 512, 128, **bf), "throughput"),
        ("(c) mix3-8, llama-7b", "llama-7b", mix, Workload(32, 512, 128, **bf), "throughput"),
    ]


def _fill(shape: DecoderShape, cluster: Cluster, work: Workload, gpus: list[str], share: dict[str, float] | None
          ) -> tuple[list[tuple[str, int, int]], int]:
    """Blocks per GPU in order: as many as fit (``share`` None), or a split in proportion to ``share`` (cut at
    the rounded cumulative shares) with each GPU keeping what of its part fits; returns the ranges and the
    first block left over."""
    ranges, at, L, cum = [], 0, shape.n_layer, 0.0
    for g in gpus:
        cap = cluster.device(g).memory_bytes * MEMORY_FRACTION
        if share is None:
            n = L - at
        else:
            cum += share[g]
            n = max(0, min(L, round(L * cum)) - at)
        while n > 0 and stage_bytes(shape, work, n, embed=at == 0, head=at + n == L) > cap:
            n -= 1
        if n:
            ranges.append((g, at, at + n))
            at += n
        if share is not None and n < round(L * cum) - (at - n):  # a part that does not fit ends the split
            break
    return ranges, at


def accelerate(shape: DecoderShape, cluster: Cluster, work: Workload) -> tuple[Any, ...] | None:
    """``device_map="auto"``: fill GPUs fastest first, then CPU RAM streamed to the first GPU; no lanes."""
    work = replace(work, microbatches=1)
    order = device_order(cluster, shape, work, SPECS)
    gpus = [n for n in order if not cluster.device(n).is_cpu]
    if not gpus:
        return None
    ranges, at = _fill(shape, cluster, work, gpus, None)
    stages = list(stages_for(cluster, shape, work, [(g, a, b, False) for g, a, b in ranges], SPECS))
    if at < shape.n_layer:  # on CPU RAM, run on the first GPU after a synchronous copy per use
        (host,) = stages_for(cluster, shape, work, [(gpus[0], at, shape.n_layer, True)], SPECS)
        from hpml_compile.infer.cost import block_ms, device_spec, head_ms, stream_ms

        spec = device_spec(cluster.device(gpus[0]), SPECS)
        n = shape.n_layer - at
        copy = stream_ms(spec, shape, work, n)
        pre = block_ms(spec, shape, work, n, decode=False) + head_ms(spec, shape, work) + copy
        dec = block_ms(spec, shape, work, n, decode=True) + head_ms(spec, shape, work) + copy
        stages.append(replace(host, prefill_ms=pre, decode_ms=dec))
    return tuple(stages), work, score(cluster, shape, work, stages, sequential=True)


def llamacpp(shape: DecoderShape, cluster: Cluster, work: Workload) -> tuple[Any, ...] | None:
    """Layers over the GPUs by memory share (as many as fit), the rest on the CPU; best lane count."""
    gpus = [d.name for d in cluster.devices if not d.is_cpu]
    cpus = [d.name for d in cluster.devices if d.is_cpu]
    total = sum(cluster.device(g).memory_bytes for g in gpus)
    best = None
    for m in (x for x in LANES if x <= work.batch):
        w = replace(work, microbatches=m)
        ranges, at = _fill(shape, cluster, w, gpus, {g: cluster.device(g).memory_bytes / total for g in gpus})
        if at < shape.n_layer:
            if not cpus:
                continue
            ranges.append((cpus[0], at, shape.n_layer))
        stages = stages_for(cluster, shape, w, [(d, a, b, False) for d, a, b in ranges], SPECS)
        pred = score(cluster, shape, w, stages)
        if best is None or pred.tokens_per_s > best[2].tokens_per_s:
            best = (stages, w, pred)
    return best


def best_single(shape: DecoderShape, cluster: Cluster, work: Workload, objective: str) -> float:
    """Tokens/s of the best device used alone (our planner restricted to it)."""
    best = 0.0
    for d in cluster.devices:
        try:
            p = place(shape, Cluster(devices=(d,), name=d.name), work, objective=objective, specs=SPECS,
                      explain_idle=False)
        except Exception:  # noqa: BLE001 - a device that cannot hold the model alone
            continue
        best = max(best, p.predicted.tokens_per_s)
    return best


def _where(stages: Any) -> str:
    return " ".join(f"{s.device}:{s.first}-{s.end - 1}{'s' if s.stream else ''}" for s in stages)


def simulated_rows() -> list[dict[str, Any]]:
    rows = []
    for label, model, cluster, work, objective in scenarios():
        shape = DecoderShape.from_config(PRESETS[model])
        t0 = time.perf_counter()
        ours = place(shape, cluster, work, objective=objective, specs=SPECS, explain_idle=False)
        plan_ms = (time.perf_counter() - t0) * 1e3
        w = ours.workload
        acc, lcpp = accelerate(shape, cluster, w), llamacpp(shape, cluster, w)
        floor_ms = (w.new_tokens - 1) * decode_floor_ms(shape, cluster, w, SPECS)
        rows.append({
            "scenario": label, "model": model, "cluster": cluster.name, "batch": w.batch, "objective": objective,
            "ours": ours.predicted.tokens_per_s, "ours_where": _where(ours.stages), "lanes": w.microbatches,
            "planning_ms": plan_ms,
            "accelerate": acc[2].tokens_per_s if acc else None, "accelerate_where": _where(acc[0]) if acc else "",
            "llamacpp": lcpp[2].tokens_per_s if lcpp else None, "llamacpp_where": _where(lcpp[0]) if lcpp else "",
            "best_single": best_single(shape, cluster, w, objective),
            # the most any pipeline plan can gain over accelerate: its total over a floor under every plan's
            "ceiling_vs_accelerate": acc[2].total_ms / floor_ms if acc and floor_ms > 0 else None,
        })
    return rows


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def print_simulated(rows: list[dict[str, Any]]) -> None:
    print(f"{'scenario':32} {'ours tok/s':>11} {'vs accel.':>9} {'at most':>8} {'vs llama.cpp':>12} "
          f"{'vs single':>9} {'plan ms':>8}  ours placed")
    for r in rows:
        most = r.get("ceiling_vs_accelerate")
        print(f"{r['scenario']:32} {r['ours']:11.4g} {_ratio(r['ours'], r['accelerate']):>9} "
              f"{f'{most:.2f}x' if most else '-':>8} {_ratio(r['ours'], r['llamacpp']):>12} "
              f"{_ratio(r['ours'], r['best_single']):>9} {r['planning_ms']:8.0f}  {r['ours_where']} "
              f"({r['lanes']} lanes)")
    print("at most: accelerate's predicted time over a floor under every pipeline plan's (decode_floor_ms: each "
          "step reads the weights once\nfrom the fastest memories that hold them; prefill, cache, sends and head "
          "left out), so no pipeline plan beats accelerate by more")


def _eager_greedy(model: torch.nn.Module, prompts: torch.Tensor, new: int) -> float:
    """Seconds for a plain greedy loop that recomputes the whole sequence each token."""
    t0 = time.perf_counter()
    seq = prompts
    with torch.no_grad():
        for _ in range(new):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return time.perf_counter() - t0


def measured_rows(batches: tuple[int, ...] = (16, 1)) -> list[dict[str, Any]]:
    from hpml_compile import models
    from hpml_compile.infer.engine import Generator

    model_name, prompt_len, new = "gpt-mini", 32, 32
    shape = DecoderShape.from_config(PRESETS[model_name])
    cluster = load_cluster("local-cpu-2")
    rows = []
    eager = models.load(model_name, seed=0).module.eval()
    g = torch.Generator().manual_seed(0)
    for batch in batches:
        lanes = min(2, batch)
        work = Workload(batch, prompt_len, new, microbatches=lanes)
        timing = time_block(PRESETS[model_name], work, threads=1)  # this CPU, as `compile --inference` prices it
        specs = timed_specs(shape, timing)
        stages = stages_for(cluster, shape, work, [("cpu0", 0, 3, False), ("cpu1", 3, 6, False)], specs)
        plan = InferencePlan(Objective.THROUGHPUT, model_name, shape, work, cluster, stages,
                             score(cluster, shape, work, stages, specs=specs), cpu_timing=timing)
        one = replace(plan, cluster=Cluster(devices=(cluster.devices[0],), name="local-cpu-1"),
                      stages=stages_for(cluster, shape, work, [("cpu0", 0, 6, False)], specs))
        prompts = torch.randint(0, shape.vocab_size, (batch, prompt_len), generator=g)
        ids = prompts.tolist()
        with Generator(plan, threads=1) as gen:
            gen.generate(ids, 2)  # warm-up
            piped = [gen.generate(ids, new) for _ in range(RUNS)]
        before = torch.get_num_threads()
        with Generator(one) as gen:
            gen.generate(ids, 2)
            single = [gen.generate(ids, new) for _ in range(RUNS)]
        eager_s = _eager_greedy(eager, prompts, new)
        torch.set_num_threads(before)
        p = piped[0].predicted
        tok_s, ttft, token_ms = (_median(piped, k) for k in ("tokens_per_s", "ttft_ms", "token_ms"))
        # the same plan priced as if a rank woken from a wait computed as fast as one run back to back
        warm = {"cpu": replace(specs["cpu"], idle_compute=())}  # type: ignore[index]
        unwoken = score(cluster, shape, work, stages, specs=warm).tokens_per_s
        rows.append({"batch": batch, "lanes": lanes, "runs": RUNS, "predicted_tok_s": p.tokens_per_s,
                     "predicted_tok_s_warm_compute": unwoken,
                     "predicted_ttft_ms": p.ttft_ms, "predicted_token_ms": p.token_ms,
                     "error_tok_s": p.tokens_per_s / tok_s - 1,
                     "error_ttft_ms": p.ttft_ms / ttft - 1, "error_token_ms": p.token_ms / token_ms - 1,
                     "cpu_timing": timing.to_dict(),
                     "pipeline_tok_s": tok_s, "pipeline_tok_s_each": [r.tokens_per_s for r in piped],
                     "pipeline_ttft_ms": ttft, "pipeline_token_ms": token_ms,
                     "one_process_cached_tok_s": _median(single, "tokens_per_s"),
                     "one_process_cached_token_ms": _median(single, "token_ms"), "eager_tok_s": batch * new / eager_s,
                     "eager_token_ms": eager_s * 1e3 / new,
                     **_where_time_went(piped, stages, decode_compute_ms(cluster, shape, work, stages, specs=specs),
                                        lanes, new)})
    return rows


def _where_time_went(piped: list[Any], stages: Any, decode: list[float], lanes: int, new: int) -> dict[str, Any]:
    """Each rank's compute over a generation (waits excluded; medians) against its stage's predicted time
    (``decode``: per stage, a lane's decode step as the prediction prices it, a step woken from a wait included),
    and what the run took beyond the ranks' compute (with one lane: the hand-offs and the wake-ups) against the
    prediction's."""
    compute = [statistics.median(r.stage_ms[k] for r in piped) for k in range(len(stages))]
    predicted = [lanes * (s.prefill_ms + (new - 1) * d) for s, d in zip(stages, decode)]
    return {"rank_compute_ms": compute, "predicted_rank_compute_ms": predicted,
            "beyond_compute_ms": statistics.median(r.total_ms - sum(r.stage_ms) for r in piped),
            "predicted_beyond_compute_ms": piped[0].predicted.total_ms - sum(predicted)}


def _median(runs: list[Any], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def print_measured(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'batch':>5} {'2 ranks tok/s':>13} {'(least-most)':>15} {'predicted':>9} {'1 proc cached':>13} "
          f"{'eager':>9} {'2 ranks ms/tok':>14} {'eager ms/tok':>12}")
    for r in rows:
        each = r["pipeline_tok_s_each"]
        print(f"{r['batch']:5d} {r['pipeline_tok_s']:13.4g} {f'{min(each):.4g}-{max(each):.4g}':>15} "
              f"{r['predicted_tok_s']:9.4g} {r['one_process_cached_tok_s']:13.4g} {r['eager_tok_s']:9.4g} "
              f"{r['pipeline_token_ms']:14.4g} {r['eager_token_ms']:12.4g}")
    print(f"(medians of {rows[0]['runs']} generations each; the eager loop once)")
    for r in rows:
        t = r["cpu_timing"]
        idle = ", ".join(f"{us:.0f} us after {ms:g} ms" for ms, us in t.get("handoff_idle", ()))
        print(f"batch {r['batch']}: a hand-off timed here takes {t['handoff_us']:.0f} us to a receiver waiting for it; "
              f"{idle or 'not timed after an idle wait'}")
        woke = ", ".join(f"{ring:.2f} ms after {idle:.2f} ms idle" for idle, ring in t.get("decode_turns", ()))
        print(f"  a block's decode step + the step's work outside the blocks: {t['decode_ms'] * 1e3:.0f} + "
              f"{t['step_ms'] * 1e3:.0f} us back to back, {t['decode_cold_ms'] * 1e3:.0f} + "
              f"{t['step_cold_ms'] * 1e3:.0f} us with the caches flushed; the {t.get('turn_blocks', 0)} blocks as "
              f"two stages taking turns, both steps: {woke or 'not timed'}")
        print(f"  ranks computed {' + '.join(f'{x:.1f}' for x in r['rank_compute_ms'])} ms (predicted "
              f"{' + '.join(f'{x:.1f}' for x in r['predicted_rank_compute_ms'])}); the run took "
              f"{r['beyond_compute_ms']:.1f} ms beyond their sum (predicted {r['predicted_beyond_compute_ms']:.1f}; "
              f"with one lane: the hand-offs and wake-ups)")
        warm = r["predicted_tok_s_warm_compute"]
        print(f"  priced as if a rank woken from a wait computed as fast as back to back: {warm:.4g} tokens/s "
              f"({warm / r['pipeline_tok_s'] - 1:+.0%} against the measured)")
    print(f"\n2 ranks, predicted against measured (error = predicted / measured - 1; CPUs priced from a block "
          f"timed here)\n{'batch':>5} {'tok/s':>17} {'error':>7} {'first token ms':>17} {'error':>7} "
          f"{'ms per token':>15} {'error':>7}")
    for r in rows:
        print(f"{r['batch']:5d} {r['predicted_tok_s']:8.4g}/{r['pipeline_tok_s']:<8.4g} {r['error_tok_s']:+7.0%} "
              f"{r['predicted_ttft_ms']:8.4g}/{r['pipeline_ttft_ms']:<8.4g} {r['error_ttft_ms']:+7.0%} "
              f"{r['predicted_token_ms']:7.4g}/{r['pipeline_token_ms']:<7.4g} {r['error_token_ms']:+7.0%}")
    errors = sorted(abs(r["error_tok_s"]) for r in rows)
    print(f"median |error| of tokens/s: {statistics.median(errors):.0%} (goal: within 15%; on a quiet machine; "
          "error against the median run)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim-only", action="store_true", help="the simulated table only")
    ap.add_argument("--measured-only", action="store_true", help="the measured table only")
    ap.add_argument("--batch", type=int, action="append", choices=(1, 16),
                    help="measure this batch only (repeat the option for both; default: 16 and 1)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "inference.json")
    args = ap.parse_args()
    t0 = time.time()
    sim = [] if args.measured_only else simulated_rows()
    if sim:
        print_simulated(sim)
    measured = [] if args.sim_only else measured_rows(tuple(args.batch or (16, 1)))
    if measured:
        print_measured(measured)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps({"simulated": sim, "measured": measured, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "machine": {"cpu": platform.processor() or platform.machine(),
                                           "cores": os.cpu_count(), "torch": torch.__version__},
                               "seconds": round(time.time() - t0, 1)}, indent=1))
    os.replace(tmp, args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
