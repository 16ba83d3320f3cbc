"""One pipeline stage of a Hugging Face Llama causal LM, with transformers' own cache per lane.

The same interface as :class:`hpml_compile.infer.kv.Stage` (open a lane, step it, close), for
``LlamaForCausalLM`` (``hf:llama?...`` models, or the user's own): the stage calls the model's decoder
layers with a :class:`transformers.DynamicCache` of its own per lane, the rotary embedding of the model,
and the same left-padded positions and explicit mask as the zoo's stage, so a sequence's tokens are the
ones it gets alone. One family only: other architectures name their modules and pass their caches
differently, and each would need its own adapter.

Example:
    >>> import os; os.environ["HF_HUB_OFFLINE"] = "1"
    >>> import torch
    >>> from hpml_compile.models import load
    >>> m = load("hf:llama?num_hidden_layers=2,hidden_size=32,num_attention_heads=2,num_key_value_heads=1,"
    ...          "intermediate_size=64,vocab_size=128,max_position_embeddings=32").module.eval()
    >>> stage = HFStage(m, 0, 2)
    >>> stage.open(0, torch.tensor([0]), 8)
    >>> torch.allclose(stage.step(0, torch.tensor([[5, 6]]), 0), m(torch.tensor([[5, 6]])).logits[:, -1], atol=1e-5)
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..errors import HpmlError
from .cost import DecoderShape
from .kv import attention_mask, positions

__all__ = ["HFStage", "is_hf_llama", "hf_shape"]


def is_hf_llama(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers Llama causal LM (what :class:`HFStage` runs)."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) == "llama" and hasattr(model, "lm_head") and hasattr(model, "model")


def hf_shape(model: nn.Module) -> DecoderShape:
    """The sizes of a transformers Llama.

    Raises:
        HpmlError: for another architecture.
    """
    if not is_hf_llama(model):
        raise HpmlError(f"inference runs the zoo's decoders and Hugging Face Llama causal LMs; got "
                        f"{type(model).__name__}")
    c = model.config
    return DecoderShape(c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                        c.num_key_value_heads or c.num_attention_heads, c.intermediate_size, c.vocab_size, True,
                        bool(c.tie_word_embeddings), False, c.max_position_embeddings)


class HFStage:
    """Decoder layers ``[first, end)`` of a transformers Llama, with a cache per lane."""

    def __init__(self, model: nn.Module, first: int, end: int) -> None:
        self.model, self.first, self.end = model, first, end
        c = model.config
        self.is_first, self.is_last = first == 0, end == c.num_hidden_layers
        self.d_model, self.vocab_size, self.max_seq_len = c.hidden_size, c.vocab_size, c.max_position_embeddings
        self._lanes: dict[int, tuple[Tensor, Any]] = {}

    @staticmethod
    def keep_only(model: nn.Module, first: int, end: int) -> nn.Module:
        """Drop the layers, table and head the stage does not use; in place."""
        inner = model.model
        for i in range(model.config.num_hidden_layers):
            if not first <= i < end:
                inner.layers[i] = nn.Identity()
        if first != 0:  # a tied head keeps the table as its own weight (the same tensor)
            inner.embed_tokens = None
        if end != model.config.num_hidden_layers:
            inner.norm, model.lm_head = None, None
        return model

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.model.layers[self.first].parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.model.layers[self.first].parameters()).device

    def open(self, lane: int, pads: Tensor, context: int) -> None:
        """Start lane ``lane`` with an empty cache (``context`` is the most slots it will hold)."""
        from transformers import DynamicCache

        self._lanes[lane] = (pads, DynamicCache(config=self.model.config))

    def close(self) -> None:
        self._lanes.clear()

    @torch.no_grad()
    def step(self, lane: int, x: Tensor, start: int) -> Tensor:
        """As :meth:`hpml_compile.infer.kv.Stage.step`."""
        pads, cache = self._lanes[lane]
        inner, length = self.model.model, x.shape[1]
        pos = positions(pads, start, length).to(self.device)
        h = inner.embed_tokens(x.to(self.device)) if self.is_first else x.to(self.device, self.dtype)
        cos, sin = inner.rotary_emb(h, pos)
        mask = attention_mask(pads, start, length).to(self.device)
        for i in range(self.first, self.end):
            h = inner.layers[i](h, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                                position_embeddings=(cos, sin))
        if not self.is_last:
            return h
        return self.model.lm_head(inner.norm(h[:, -1]))
