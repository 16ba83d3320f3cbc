"""A plain multi-layer perceptron classifier: the simplest chain to partition.

Every hidden layer is one ``MLPBlock`` (Linear then GELU) in ``MLP.layers``,
so fx node scopes read ``layers.3.fc``; a final ``head`` Linear gives class
logits. The loss is cross-entropy against integer class targets.

Example:
    >>> import torch
    >>> from hpml_compile.models.mlp import MLP, PRESETS
    >>> model = MLP(PRESETS["mlp-tiny"])
    >>> model(torch.zeros(8, 32)).shape
    torch.Size([8, 10])
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hpml_compile.errors import ModelError

__all__ = ["MLPConfig", "MLPBlock", "MLP", "PRESETS", "example_inputs", "example_targets", "loss"]


@dataclass(frozen=True, slots=True)
class MLPConfig:
    """Shape of an ``MLP``.

    Args:
        d_in: input features.
        width: hidden width of every layer.
        depth: number of hidden Linear+GELU layers.
        n_classes: output logits.

    Raises:
        ModelError: if a size is not positive.
    """

    d_in: int
    width: int
    depth: int
    n_classes: int

    def __post_init__(self) -> None:
        for field in ("d_in", "width", "depth", "n_classes"):
            if getattr(self, field) <= 0:
                raise ModelError(f"MLPConfig.{field} must be a positive int, got {getattr(self, field)}")


class MLPBlock(nn.Module):
    """One hidden layer: GELU(Linear(x))."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        """Apply the layer to ``x`` [B, d_in]."""
        return self.act(self.fc(x))


class MLP(nn.Module):
    """Features [B, d_in] -> class logits [B, n_classes].

    Args:
        config: the model's shape.
    """

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        widths = [config.d_in] + [config.width] * config.depth
        self.layers = nn.ModuleList(MLPBlock(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.head = nn.Linear(config.width, config.n_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Compute logits for ``x`` [B, d_in]."""
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


PRESETS: Mapping[str, MLPConfig] = MappingProxyType({
    "mlp": MLPConfig(d_in=512, width=1024, depth=8, n_classes=10),
    "mlp-tiny": MLPConfig(d_in=32, width=32, depth=3, n_classes=10),
})
"""Named configurations (read-only)."""


def example_inputs(config: MLPConfig, batch_size: int, seq_len: int | None, device: torch.device | str) -> tuple[Tensor]:
    """Random features for ``MLP(config)``.

    Args:
        config: the model's config.
        batch_size: B.
        seq_len: ignored (an MLP has no sequence axis); present so that every
            zoo model shares one signature.
        device: where to create them.

    Returns:
        ``(x,)`` with x float32 [B, d_in].
    """
    return (torch.randn(batch_size, config.d_in, device=device),)


def example_targets(config: MLPConfig, batch_size: int, seq_len: int | None, device: torch.device | str) -> Tensor:
    """Random class labels, int64 [B]; same arguments as ``example_inputs``."""
    return torch.randint(0, config.n_classes, (batch_size,), device=device)


def loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of logits [B, C] against class labels [B]."""
    return F.cross_entropy(logits, targets)
