"""Pipelined generation on gloo ranks equals a plain greedy loop over the eager model: tokens exactly,
logits within float tolerance, for 1, 2 and 3 stages, with lanes of uneven rows and prompts of different
lengths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpml_compile import models
from hpml_compile.cluster import load_cluster
from hpml_compile.infer import DecoderShape, InferencePlan, Workload, score
from hpml_compile.infer.cost import Objective
from hpml_compile.infer.engine import Generator
from hpml_compile.infer.hf import hf_shape
from hpml_compile.infer.place import stages_for

pytestmark = pytest.mark.dist

LLAMA = f"{Path(__file__).with_name('infer_models.py')}:sharp_llama"
HF_LLAMA = ("hf:llama?num_hidden_layers=3,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
            "intermediate_size=128,vocab_size=256,max_position_embeddings=64,initializer_range=0.2")
PROMPTS = [[1, 2, 3, 4, 5], [9, 8], [7, 7, 7, 100], [42], [3, 1, 4, 1, 5, 9, 2]]
NEW = 5


def _plan(model: str, cuts: list[tuple[int, int]], lanes: int) -> InferencePlan:
    module = models.load(model, seed=0).module
    shape = hf_shape(module) if model.startswith("hf:") else DecoderShape.from_config(module.config)
    cluster = load_cluster(f"local-cpu-{len(cuts)}")
    work = Workload(len(PROMPTS), 8, NEW, microbatches=lanes)
    stages = stages_for(cluster, shape, work, [(f"cpu{k}", a, b, False) for k, (a, b) in enumerate(cuts)])
    return InferencePlan(Objective.THROUGHPUT, model, shape, work, cluster, stages,
                         score(cluster, shape, work, stages))


@pytest.mark.parametrize("model,cuts,lanes", [
    (LLAMA, [(0, 3)], 2),
    (LLAMA, [(0, 2), (2, 3)], 2),
    (LLAMA, [(0, 1), (1, 2), (2, 3)], 3),
    ("gpt-tiny", [(0, 1), (1, 2)], 2),  # tied embeddings: the last stage's head holds the table
    (HF_LLAMA, [(0, 1), (1, 3)], 2),  # transformers' own layers and cache
], ids=["1-stage", "2-stage-uneven", "3-stage", "2-stage-tied", "hf-llama-2-stage"])
def test_pipelined_generation_equals_the_eager_greedy_loop(model: str, cuts: list[tuple[int, int]],
                                                           lanes: int) -> None:
    eager = models.load(model, seed=0).module.eval()
    with Generator(_plan(model, cuts, lanes), threads=1) as gen:
        out = gen.generate(PROMPTS, NEW, return_logits=True)
        again = gen.generate(PROMPTS[:1], 2)  # a second request on the same ranks
    assert out.logits is not None
    for i, prompt in enumerate(PROMPTS):
        seq, logits = list(prompt), []
        with torch.no_grad():
            for _ in range(NEW):
                out_ = eager(torch.tensor([seq]))
                last = getattr(out_, "logits", out_)[0, -1]
                logits.append(last)
                seq.append(int(last.argmax()))
        assert out.tokens[i] == seq[len(prompt):], i
        torch.testing.assert_close(out.logits[i], torch.stack(logits), atol=1e-4, rtol=1e-4)
    assert again.tokens[0] == out.tokens[0][:2]
    if model in (LLAMA, HF_LLAMA):
        assert len({tuple(t) for t in out.tokens}) > 1, "the prompts must differ in output"


def test_a_rank_killed_mid_generation_fails_the_call_with_its_name_not_a_hang() -> None:
    import os
    import signal
    import threading
    import time

    from hpml_compile.errors import LaunchError

    gen = Generator(_plan(LLAMA, [(0, 2), (2, 3)], 2), threads=1)
    try:
        pid = gen.worker_pids[0]
        threading.Timer(0.5, lambda: os.kill(pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(LaunchError, match=r"rank 1 exited with status -9"):
            for _ in range(1000):
                gen.generate(PROMPTS, NEW)
        assert time.monotonic() - t0 < 60
        with pytest.raises(LaunchError, match="cannot run"):
            gen.generate(PROMPTS, NEW)
    finally:
        gen.close()
