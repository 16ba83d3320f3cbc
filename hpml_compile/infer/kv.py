"""One pipeline stage of a zoo GPT with a KV cache per microbatch lane: prefill, then one token at a time.

A stage runs the model's own modules (its token table if it is the first,
its blocks ``[first, end)``, the final norm and output projection if it is
the last) with a forward of its own that reads and extends a cache, rather
than the training build's fx stage files: those are traced for a fixed
sequence length and recompute every position, where generation needs one
new position per step against the positions already seen, a shape and a
state an fx graph traced for training does not have.

Sequences of one lane may have prompts of different lengths: they are padded
on the left, each query attends to its own sequence's keys only (an explicit
mask) and positions count from each sequence's first real token, so a
sequence's tokens are the ones it gets alone. A pad query attends to itself
only, so that no row of the softmax is empty.

Example:
    >>> import torch
    >>> from hpml_compile.models.gpt import GPT, PRESETS
    >>> torch.manual_seed(0); model = GPT(PRESETS["gpt-tiny"]).eval()  # doctest: +ELLIPSIS
    <...>
    >>> stage = Stage(model, 0, 2)
    >>> prompt = torch.tensor([[5, 6, 7]])
    >>> stage.open(0, pads=torch.tensor([0]), context=5)
    >>> logits = stage.step(0, prompt, start=0)
    >>> torch.allclose(logits, model(prompt)[:, -1], atol=1e-5)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.gpt import GPT, Block, PosEncoding

__all__ = ["Stage", "positions", "attention_mask"]


def positions(pads: Tensor, start: int, length: int) -> Tensor:
    """Positions [B, length] of cache slots ``start..start+length`` for sequences left-padded by ``pads``."""
    slots = torch.arange(start, start + length)
    return (slots[None, :] - pads[:, None]).clamp(min=0)


def attention_mask(pads: Tensor, start: int, length: int) -> Tensor:
    """Boolean mask [B, 1, length, start+length]: causal, within the sequence, a pad row on itself."""
    q = torch.arange(start, start + length)[:, None]
    k = torch.arange(start + length)[None, :]
    causal = k <= q
    own = k[None] >= pads[:, None, None]
    return ((causal[None] & own) | (k == q)[None])[:, None]


class Stage:
    """Blocks ``[first, end)`` of ``model`` with caches per lane; the first stage embeds, the last gives logits.

    Args:
        model: the whole zoo GPT (modules outside the stage may already be dropped, see :meth:`keep_only`).
        first: the first block.
        end: one past the last block.
    """

    def __init__(self, model: GPT, first: int, end: int) -> None:
        self.model, self.first, self.end = model, first, end
        self.is_first, self.is_last = first == 0, end == model.config.n_layer
        c = model.config
        self.d_model, self.vocab_size, self.max_seq_len = c.d_model, c.vocab_size, c.max_seq_len
        self._kv_shape = (c.n_kv_head, c.head_dim)
        self._lanes: dict[int, tuple[Tensor, list[Tensor], list[Tensor]]] = {}

    @staticmethod
    def keep_only(model: GPT, first: int, end: int) -> GPT:
        """Drop (set to None) the blocks, tables and head a stage ``[first, end)`` does not use; in place."""
        for i in range(model.config.n_layer):
            if not first <= i < end:
                model.layers[i] = nn.Identity()
        if first != 0:  # a tied head keeps the table as its own weight (lm_head.weight is the same tensor)
            model.wte = None  # type: ignore[assignment]
            if hasattr(model, "wpe"):
                model.wpe = None  # type: ignore[assignment]
        if end != model.config.n_layer:
            model.norm, model.lm_head = None, None  # type: ignore[assignment]
        return model

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.layers[self.first].parameters()).dtype

    @property
    def device(self) -> torch.device:
        block = self.model.layers[self.first]
        return next(block.parameters()).device

    def open(self, lane: int, pads: Tensor, context: int) -> None:
        """Allocate lane ``lane``'s cache for sequences left-padded by ``pads`` [B], ``context`` slots each."""
        dtype = next(self.model.layers[self.first].parameters()).dtype
        shape = (len(pads), self._kv_shape[0], context, self._kv_shape[1])
        n = self.end - self.first
        self._lanes[lane] = (pads, [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n)],
                             [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n)])

    def close(self) -> None:
        """Free every lane's cache."""
        self._lanes.clear()

    @torch.no_grad()
    def step(self, lane: int, x: Tensor, start: int) -> Tensor:
        """Run ``x`` at cache slots ``start..start+T`` of lane ``lane``.

        Args:
            lane: an opened lane.
            x: token ids [B, T] on the first stage, else the previous stage's hidden states [B, T, d_model].
            start: the first cache slot ``x`` fills (0 for the prompt).

        Returns:
            Hidden states [B, T, d_model], or on the last stage the logits of the last position [B, vocab].
        """
        pads, ks, vs = self._lanes[lane]
        m, length = self.model, x.shape[1]
        pos = positions(pads, start, length).to(self.device)
        if self.is_first:
            x = m.wte(x.to(self.device))
            if m.config.pos is PosEncoding.LEARNED:
                x = x + m.wpe(pos)
        x = x.to(self.device)
        cos = sin = None
        if m.config.pos is PosEncoding.ROPE:
            cos, sin = m.rope_cos[pos][:, None].to(x.dtype), m.rope_sin[pos][:, None].to(x.dtype)
        mask = attention_mask(pads, start, length).to(self.device)
        for j, i in enumerate(range(self.first, self.end)):
            x = _block(m.layers[i], x, cos, sin, ks[j], vs[j], start, mask)
        if not self.is_last:
            return x
        return m.lm_head(m.norm(x[:, -1]))


def _block(block: Block, x: Tensor, cos: Tensor | None, sin: Tensor | None, k_cache: Tensor, v_cache: Tensor,
           start: int, mask: Tensor) -> Tensor:
    x = x + _attend(block, block.attn_norm(x), cos, sin, k_cache, v_cache, start, mask)
    return x + block.mlp(block.mlp_norm(x))


def _attend(block: Block, x: Tensor, cos: Tensor | None, sin: Tensor | None, k_cache: Tensor, v_cache: Tensor,
            start: int, mask: Tensor) -> Tensor:
    a = block.attn
    q, k, v = a.qkv(x, cos, sin)
    stop = start + x.shape[1]
    k_cache[:, :, start:stop] = k
    v_cache[:, :, start:stop] = v
    k, v = k_cache[:, :, :stop], v_cache[:, :, :stop]
    if a.n_kv_head != a.n_head:
        k = k.repeat_interleave(a.n_head // a.n_kv_head, dim=1)
        v = v.repeat_interleave(a.n_head // a.n_kv_head, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return a.o_proj(y.transpose(1, 2).flatten(-2))
