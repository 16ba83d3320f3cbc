"""The cached stage forward against the eager model: left-padded prompts of different lengths in one lane,
split over stages, give the tokens and logits of a plain greedy loop over the whole model."""

from __future__ import annotations

import pytest
import torch

from hpml_compile.infer.kv import Stage
from hpml_compile.models.gpt import GPT, GPTConfig, PRESETS

LLAMA = GPTConfig(vocab_size=256, n_layer=3, n_head=4, n_kv_head=2, d_model=64, d_ff=128, max_seq_len=64,
                  norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, tie_embeddings=False)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8], [7, 7, 7, 100]]


def eager_greedy(model: GPT, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    seq, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(new):
            out = model(torch.tensor([seq]))[0, -1]
            logits.append(out)
            seq.append(int(out.argmax()))
    return seq[len(prompt):], torch.stack(logits)


@pytest.mark.parametrize("config,cuts", [(PRESETS["gpt-tiny"], [(0, 1), (1, 2)]), (LLAMA, [(0, 1), (1, 3)])],
                         ids=["gpt2-shape", "llama-shape"])
def test_padded_lane_over_stages_equals_the_eager_greedy_loop(config: GPTConfig, cuts: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    model = GPT(config).eval()
    with torch.no_grad():  # larger weights than the init's, so that the tokens vary with the prompt
        for p in model.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    new, width = 6, max(map(len, PROMPTS))
    stages = [Stage(model, a, b) for a, b in cuts]
    pads = torch.tensor([width - len(p) for p in PROMPTS])
    for s in stages:
        s.open(0, pads, width + new)
    x, start = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS]), 0
    got: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    for _ in range(new):
        h = x
        for s in stages:
            h = s.step(0, h, start)
        start += x.shape[1]
        for i in range(len(PROMPTS)):
            got[i].append(h[i])
        x = h.argmax(-1)[:, None]
    for i, prompt in enumerate(PROMPTS):
        tokens, logits = eager_greedy(model, prompt, new)
        mine = torch.stack(got[i])
        assert mine.argmax(-1).tolist() == tokens
        torch.testing.assert_close(mine, logits, atol=1e-4, rtol=1e-4)
    assert len({tuple(eager_greedy(model, p, new)[0]) for p in PROMPTS}) > 1, "the prompts must differ in output"
