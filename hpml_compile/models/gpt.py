"""A decoder-only transformer that covers GPT-2 and Llama shapes, written to trace.

One ``GPT`` class, configured by a frozen ``GPTConfig``, spans the GPT-2 family
(LayerNorm, GELU MLP, learned positions, biases, tied embeddings) and the Llama
family (RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases,
untied head). Blocks live in ``GPT.layers`` so fx node scopes read
``layers.3.attn.q_proj``.

``forward`` has no data-dependent Python control flow: every branch depends
only on the config, so ``torch.fx.symbolic_trace`` works, and so does building
a 70B model under ``torch.device("meta")`` (no weights allocated).

Example:
    >>> import torch
    >>> from hpml_compile.models.gpt import GPT, PRESETS
    >>> model = GPT(PRESETS["gpt-tiny"])
    >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 256])
    >>> gm = torch.fx.symbolic_trace(model)
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hpml_compile.errors import ModelError

__all__ = [
    "Norm", "MLPKind", "PosEncoding", "GPTConfig", "Attention", "MLP", "Block", "GPT",
    "PRESETS", "example_inputs", "example_targets", "loss",
]


class Norm(enum.Enum):
    """Normalisation layer used before attention, before the MLP and at the end."""

    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class MLPKind(enum.Enum):
    """Feed-forward block: GPT-2's GELU MLP or Llama's gated SwiGLU."""

    GELU = "gelu"
    SWIGLU = "swiglu"


class PosEncoding(enum.Enum):
    """Position information: a learned table (GPT-2) or rotary embeddings (Llama)."""

    LEARNED = "learned"
    ROPE = "rope"


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """Shape and flavour of a ``GPT``.

    Args:
        vocab_size: number of token ids.
        n_layer: number of transformer blocks.
        n_head: number of query heads.
        n_kv_head: number of key/value heads (``< n_head`` is grouped-query attention).
        d_model: residual width; must be divisible by ``n_head``.
        d_ff: hidden width of the MLP.
        max_seq_len: longest sequence the position table / rotary cache covers.
        norm: normalisation kind (the enum or its string value).
        mlp: feed-forward kind (the enum or its string value).
        pos: position encoding kind (the enum or its string value).
        bias: whether linear layers (and LayerNorm) carry a bias.
        tie_embeddings: whether the output head shares the token embedding.
        dropout: dropout probability (0 for deterministic profiling).
        rope_theta: base of the rotary frequencies.

    Raises:
        ModelError: if the sizes are inconsistent.
    """

    vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    d_model: int
    d_ff: int
    max_seq_len: int
    norm: Norm
    mlp: MLPKind
    pos: PosEncoding
    bias: bool
    tie_embeddings: bool
    dropout: float = 0.0
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        # Accept the enums' string values too (JSON, CLI); frozen, hence object.__setattr__.
        for field, kind in (("norm", Norm), ("mlp", MLPKind), ("pos", PosEncoding)):
            try:
                object.__setattr__(self, field, kind(getattr(self, field)))
            except ValueError:
                raise ModelError(
                    f"GPTConfig.{field} must be one of {[k.value for k in kind]}, got {getattr(self, field)!r}"
                ) from None
        for field in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "max_seq_len"):
            if getattr(self, field) <= 0:
                raise ModelError(f"GPTConfig.{field} must be a positive int, got {getattr(self, field)}")
        if self.d_model % self.n_head:
            raise ModelError(f"GPTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:  # each key/value head serves a whole group of query heads
            raise ModelError(f"GPTConfig: n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.pos is PosEncoding.ROPE and self.head_dim % 2:
            raise ModelError(f"GPTConfig: rotary embeddings need an even head_dim, got {self.head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ModelError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm is Norm.RMSNORM:
        return nn.RMSNorm(config.d_model, eps=1e-5)
    return nn.LayerNorm(config.d_model, eps=1e-5, bias=config.bias)


def _rotate_half(x: Tensor, half: int) -> Tensor:
    # Slicing with a config constant, not x.chunk(), keeps the fx graph free of
    # tuple-unpacking of proxies.
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with optional grouped-query heads and rotary positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.dropout = config.dropout
        kv_dim = config.n_kv_head * config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=config.bias)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=config.bias)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)

    def qkv(self, x: Tensor, cos: Tensor | None, sin: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries [B, n_head, T, head_dim], keys and values [B, n_kv_head, T, head_dim], rotated where RoPE is on.

        Shared by :meth:`forward` and the cached forward of inference (:mod:`hpml_compile.infer.kv`).
        """
        # unflatten/flatten instead of view(B, T, ...): no Python ints cross the graph.
        q = self.q_proj(x).unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_proj(x).unflatten(-1, (self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (self.n_kv_head, self.head_dim)).transpose(1, 2)
        if cos is not None and sin is not None:
            half = self.head_dim // 2
            q = q * cos + _rotate_half(q, half) * sin
            k = k * cos + _rotate_half(k, half) * sin
        return q, k, v

    def forward(self, x: Tensor, cos: Tensor | None, sin: Tensor | None) -> Tensor:
        """Attend over ``x`` [B, T, d_model]; ``cos``/``sin`` [T, head_dim] (None without RoPE)."""
        q, k, v = self.qkv(x, cos, sin)
        if self.n_kv_head != self.n_head:
            rep = self.n_head // self.n_kv_head
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.o_proj(y.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    """GPT-2 MLP (up, GELU, down) or Llama SwiGLU (down(silu(gate) * up))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.swiglu = config.mlp is MLPKind.SWIGLU
        if self.swiglu:
            self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        else:
            # GPT-2 uses the tanh approximation ("gelu_new").
            self.act = nn.GELU(approximate="tanh")
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the feed-forward block to ``x`` [B, T, d_model]."""
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = _norm(config)
        self.attn = Attention(config)
        self.mlp_norm = _norm(config)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cos: Tensor | None, sin: Tensor | None) -> Tensor:
        """Run one block on ``x`` [B, T, d_model]."""
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    """Decoder-only language model: token ids [B, T] -> logits [B, T, vocab_size].

    Args:
        config: the model's shape.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        if config.pos is PosEncoding.LEARNED:
            self.wpe = nn.Embedding(config.max_seq_len, config.d_model)
        # Non-persistent: derived from the config, so checkpoints need not carry
        # them; init_weights() recomputes them after a meta -> real materialisation.
        if config.pos is PosEncoding.ROPE:
            rope_shape = (config.max_seq_len, config.head_dim)
            self.register_buffer("rope_cos", torch.ones(rope_shape), persistent=False)
            self.register_buffer("rope_sin", torch.zeros(rope_shape), persistent=False)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = _norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise parameters GPT-2 style and recompute the rotary cache.

        Draws from torch's global RNG, so seed it first for reproducible weights.
        On meta tensors this only records shapes; after ``to_empty(device=...)``
        it gives valid weights, though not bit-equal to a cpu build with the same
        seed (the layer constructors draw from the RNG first).
        """
        c = self.config
        # GPT-2: N(0, 0.02), residual output projections scaled by 1/sqrt(2L) so
        # that the residual stream's variance does not grow with depth.
        resid_std = 0.02 / math.sqrt(2 * c.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = resid_std if name.endswith(("o_proj", "down_proj")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
        if c.pos is PosEncoding.ROPE:
            device = self.rope_cos.device
            inv_freq = 1.0 / c.rope_theta ** (
                torch.arange(0, c.head_dim, 2, device=device, dtype=torch.float32) / c.head_dim
            )
            freqs = torch.outer(torch.arange(c.max_seq_len, device=device, dtype=torch.float32), inv_freq)
            angles = torch.cat((freqs, freqs), dim=-1)
            self.rope_cos.copy_(angles.cos())
            self.rope_sin.copy_(angles.sin())

    def forward(self, idx: Tensor) -> Tensor:
        """Compute logits.

        Args:
            idx: token ids, int64 [B, T] with T <= max_seq_len.

        Returns:
            Logits [B, T, vocab_size].
        """
        seq_len = idx.size(1)
        x = self.wte(idx)
        if self.config.pos is PosEncoding.LEARNED:
            # Slicing the table avoids an arange over a traced length.
            x = x + self.wpe.weight[:seq_len]
        x = self.drop(x)
        cos: Tensor | None = None
        sin: Tensor | None = None
        if self.config.pos is PosEncoding.ROPE:
            # torch.narrow, not [:seq_len]: under fx the length is a Proxy, which
            # a slice object hides from tracing; narrow records a get_attr node.
            cos = torch.narrow(self.rope_cos, 0, 0, seq_len)
            sin = torch.narrow(self.rope_sin, 0, 0, seq_len)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def _gpt2(n_layer: int, d_model: int, n_head: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=50257, n_layer=n_layer, n_head=n_head, n_kv_head=n_head, d_model=d_model,
        d_ff=4 * d_model, max_seq_len=1024, norm=Norm.LAYERNORM, mlp=MLPKind.GELU,
        pos=PosEncoding.LEARNED, bias=True, tie_embeddings=True,
    )


def _llama(n_layer: int, d_model: int, n_head: int, n_kv_head: int, d_ff: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=32000, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, d_model=d_model,
        d_ff=d_ff, max_seq_len=4096, norm=Norm.RMSNORM, mlp=MLPKind.SWIGLU,
        pos=PosEncoding.ROPE, bias=False, tie_embeddings=False,
    )


PRESETS: Mapping[str, GPTConfig] = MappingProxyType({
    "gpt-tiny": GPTConfig(
        vocab_size=256, n_layer=2, n_head=4, n_kv_head=4, d_model=64, d_ff=256, max_seq_len=32,
        norm=Norm.LAYERNORM, mlp=MLPKind.GELU, pos=PosEncoding.LEARNED, bias=True, tie_embeddings=True,
    ),
    # The demo's model: big enough that a pipeline split matters, small enough
    # that profiling and training it on 2 CPU cores takes seconds.
    "gpt-mini": GPTConfig(
        vocab_size=4096, n_layer=6, n_head=4, n_kv_head=4, d_model=256, d_ff=1024, max_seq_len=256,
        norm=Norm.LAYERNORM, mlp=MLPKind.GELU, pos=PosEncoding.LEARNED, bias=True, tie_embeddings=True,
    ),
    "gpt2-small": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-xl": _gpt2(48, 1600, 25),
    "llama-7b": _llama(32, 4096, 32, 32, 11008),
    "llama-70b": _llama(80, 8192, 64, 8, 28672),
})
"""Named configurations (read-only)."""


def example_inputs(config: GPTConfig, batch_size: int, seq_len: int | None, device: torch.device | str) -> tuple[Tensor]:
    """Random token ids for ``GPT(config)``.

    Args:
        config: the model's config.
        batch_size: B.
        seq_len: T, at most ``config.max_seq_len``.
        device: where to create them (``"meta"`` gives shape-only tensors).

    Returns:
        ``(idx,)`` with idx int64 [B, T] below ``vocab_size``.

    Raises:
        ModelError: if ``seq_len`` is missing or too long.
    """
    if seq_len is None or not 0 < seq_len <= config.max_seq_len:
        raise ModelError(f"seq_len must be an int in 1..{config.max_seq_len} for this GPT, got {seq_len}")
    return (torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device),)


def example_targets(config: GPTConfig, batch_size: int, seq_len: int | None, device: torch.device | str) -> Tensor:
    """Random next-token targets, int64 [B, T]; same arguments as ``example_inputs``."""
    (idx,) = example_inputs(config, batch_size, seq_len, device)
    return idx


def loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Token-level cross-entropy of logits [B, T, V] against targets [B, T]."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
