"""A Hugging Face causal LM as its user holds it: trained on the standard library's source, bytes as tokens.

The model is ``LlamaForCausalLM`` from a tiny ``LlamaConfig`` (random weights, nothing downloaded), with no
wrapper and no loss function: the dataset's items are dicts ``{"input_ids", "attention_mask", "labels"}``, as
a tokenizer gives them, and the model computes its own loss from ``labels`` (as ``transformers.Trainer``
trains it). The text is the ``*.py`` files of Python's standard library (:mod:`stdlib_lm`'s split: every tenth
file held out for validation); a token is a byte, so the vocabulary is 256 and no tokenizer is needed.

Compile and train it on two local CPU ranks::

    hpml-compile compile examples/hf_causal_lm.py:spec --cluster local-cpu-2 -o /tmp/hf/build
    hpml-compile run /tmp/hf/build --steps 50 --val-every 25 --run-dir /tmp/hf/run

Example:
    >>> s = spec()
    >>> item = s.dataset[0]
    >>> sorted(item), item["input_ids"].shape, bool((item["labels"] == item["input_ids"]).all())
    (['attention_mask', 'input_ids', 'labels'], torch.Size([64]), True)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from hpml_compile import TrainSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling example that reads the text
from stdlib_lm import SEQ, VAL_WINDOWS, stdlib_bytes  # noqa: E402


class TokenWindows(Dataset):
    """Windows of ``SEQ`` bytes as a tokenizer's dicts; the model shifts ``labels`` itself."""

    def __init__(self, data: Tensor, starts: list[int]) -> None:
        self.data, self.starts = data, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        ids = self.data[self.starts[i]:self.starts[i] + SEQ].long()
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def model() -> torch.nn.Module:
    """A 2-layer Llama (hidden 128, 4 heads, 2 key/value heads, rotary positions, SwiGLU), bytes as tokens."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def spec(batch_size: int = 16) -> TrainSpec:
    """The training spec: the model as it is, its own loss, AdamW 3e-3."""
    train, val = stdlib_bytes()
    gap = max(1, (len(val) - SEQ - 1) // VAL_WINDOWS)
    return TrainSpec(
        module=model(),
        dataset=TokenWindows(train, list(range(0, len(train) - SEQ, SEQ))),
        batch_size=batch_size,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01),
        val_dataset=TokenWindows(val, list(range(0, gap * VAL_WINDOWS, gap))),
    )
