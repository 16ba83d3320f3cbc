"""Tiny decoders for the generation tests: a Llama shape (grouped-query attention, rotary positions,
untied head) with 3 blocks, so that a 3-stage pipeline has a block per stage."""

from __future__ import annotations

import torch

from hpml_compile.models.gpt import GPT, GPTConfig

LLAMA = GPTConfig(vocab_size=256, n_layer=3, n_head=4, n_kv_head=2, d_model=64, d_ff=128, max_seq_len=64,
                  norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, tie_embeddings=False)


def tiny_llama(batch_size: int = 2, seq_len: int = 16) -> tuple[GPT, tuple[torch.Tensor]]:
    """The model and an example batch (the factory form `hpml_compile.models.load` takes)."""
    model = GPT(LLAMA)
    return model, (torch.randint(0, LLAMA.vocab_size, (batch_size, seq_len)),)


def sharp_llama(batch_size: int = 2, seq_len: int = 16) -> tuple[GPT, tuple[torch.Tensor]]:
    """:func:`tiny_llama` with its matrices scaled up, so that greedy tokens vary with the prompt."""
    model, example = tiny_llama(batch_size, seq_len)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model, example
