"""A plan's CPU prices follow what generation measures here: a block of the model timed on this host
prices the plan's CPU stages, and the tokens/s the generator then measures is within 2x of the plan's
prediction for it (loose: the host may be busy). A plan priced from the catalog's CPU rates is not held to
this: on a small model it was off by an order of magnitude."""

from __future__ import annotations

import statistics

import pytest
import torch

from hpml_compile.infer.api import plan_for
from hpml_compile.infer.engine import Generator
from hpml_compile.infer.plan import InferencePlan
from hpml_compile.infer.timing import _TURN_SPIN_MS, BlockTiming, timed_specs

BATCH, PROMPT, NEW = 4, 16, 16


def _within(predicted: float, measured: float, factor: float) -> bool:
    return measured / factor <= predicted <= measured * factor


def test_a_cpu_plan_is_priced_from_a_block_timed_here_and_keeps_it_through_json() -> None:
    plan = plan_for("gpt-mini", "local-cpu-1", batch=BATCH, prompt_len=PROMPT, new_tokens=NEW, threads=1)
    t = plan.cpu_timing
    assert isinstance(t, BlockTiming) and t.prefill_ms > 0 and t.decode_ms > 0
    assert (t.rows, t.prompt_len, t.new_tokens) == (plan.workload.rows, PROMPT, NEW)
    # and its blocks as two stages taking turns, each idle while the other computes, then longer by each spin
    assert t.turn_blocks == plan.shape.n_layer and len(t.decode_turns) == len(_TURN_SPIN_MS)
    idle = [g for g, _ in t.decode_turns]
    assert idle == sorted(idle) and idle[0] > 0, t.decode_turns
    assert idle[-1] - idle[0] >= 0.5 * (_TURN_SPIN_MS[-1] - _TURN_SPIN_MS[0]), t.decode_turns
    assert all(ring > 0 for _, ring in t.decode_turns), t.decode_turns
    assert InferencePlan.from_dict(plan.to_dict()) == plan
    spec = timed_specs(plan.shape, t)["cpu"]  # type: ignore[index]
    assert spec.source.startswith("timed on this host")


@pytest.mark.timeout(120)
def test_predicted_tokens_per_s_of_a_local_cpu_plan_is_within_2x_of_the_measured() -> None:
    plan = plan_for("gpt-mini", "local-cpu-1", batch=BATCH, prompt_len=PROMPT, new_tokens=NEW, threads=1)
    prompts = torch.randint(0, plan.shape.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    with Generator(plan) as gen:  # at the threads the plan was timed with
        gen.generate(prompts.tolist(), 2)  # warm-up
        runs = [gen.generate(prompts.tolist(), NEW) for _ in range(3)]
    measured = statistics.median(r.tokens_per_s for r in runs)
    predicted = runs[0].predicted.tokens_per_s  # type: ignore[union-attr]
    assert _within(predicted, measured, 2.0), (predicted, measured, plan.cpu_timing)
    token_ms = statistics.median(r.token_ms for r in runs)
    assert _within(runs[0].predicted.token_ms, token_ms, 2.0), (runs[0].predicted, token_ms)  # type: ignore[union-attr]

