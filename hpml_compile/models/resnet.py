"""A hand-written ResNet with Bottleneck blocks and BatchNorm.

Written by hand because torchvision has no usable CPU build for torch 2.13
here (see NOTES). Layout follows torchvision's ResNet v1.5 (stride on the 3x3
convolution), so ``resnet50`` has the same 25.6M parameters and the same
module names: stages ``layer1..layer4`` are Sequentials of blocks, and fx node
scopes read ``layer2.1.conv1``.

Example:
    >>> import torch
    >>> from hpml_compile.models.resnet import ResNet, PRESETS
    >>> model = ResNet(PRESETS["resnet-tiny"])
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hpml_compile.errors import ModelError

__all__ = ["Stem", "ResNetConfig", "Bottleneck", "ResNet", "PRESETS", "example_inputs", "example_targets", "loss"]


class Stem(enum.Enum):
    """Input stem: ImageNet's 7x7/2 conv + 3x3/2 max-pool, or CIFAR's single 3x3/1 conv."""

    IMAGENET = "imagenet"
    CIFAR = "cifar"  # keeps 32x32 inputs from shrinking to nothing by layer4


@dataclass(frozen=True, slots=True)
class ResNetConfig:
    """Shape of a ``ResNet``.

    Args:
        blocks: number of Bottleneck blocks in each of the four stages.
        width: channels of the first stage's 3x3 convs (64 for ResNet-50); each
            later stage doubles it, and blocks output ``4 * width``.
        n_classes: output logits.
        image_size: side of the square RGB input.
        stem: input stem kind.

    Raises:
        ModelError: if the sizes are not positive or there are not four stages.
    """

    blocks: tuple[int, int, int, int]
    width: int
    n_classes: int
    image_size: int
    stem: Stem

    def __post_init__(self) -> None:
        if len(self.blocks) != 4 or min(self.blocks) <= 0:
            raise ModelError(f"ResNetConfig.blocks must be four positive ints, got {self.blocks}")
        for field in ("width", "n_classes", "image_size"):
            if getattr(self, field) <= 0:
                raise ModelError(f"ResNetConfig.{field} must be a positive int, got {getattr(self, field)}")


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, each with BatchNorm; plus a shortcut.

    Args:
        in_ch: input channels.
        width: channels of the inner 3x3 conv; the block outputs ``4 * width``.
        stride: stride of the 3x3 conv (2 where a stage halves the resolution).
    """

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch))

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block to ``x`` [B, in_ch, H, W]."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))


class ResNet(nn.Module):
    """Images [B, 3, S, S] -> class logits [B, n_classes].

    Args:
        config: the model's shape.
    """

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        w = config.width
        if config.stem is Stem.IMAGENET:
            self.conv1 = nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(3, stride=2, padding=1)
        else:
            self.conv1 = nn.Conv2d(3, w, 3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU()
        in_ch = w
        stages = []
        for i, n_blocks in enumerate(config.blocks):
            stage_width = w * 2**i
            blocks = []
            for j in range(n_blocks):
                # The first block of stages 2-4 halves the resolution.
                blocks.append(Bottleneck(in_ch, stage_width, stride=2 if (i > 0 and j == 0) else 1))
                in_ch = stage_width * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, config.n_classes)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise as torchvision does: Kaiming-normal convs, BatchNorm at identity.

        Draws from torch's global RNG, so seed it first for reproducible weights.
        """
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                module.reset_parameters()
            elif isinstance(module, nn.Linear):
                module.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        """Compute logits for images ``x`` [B, 3, S, S]."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


PRESETS: Mapping[str, ResNetConfig] = MappingProxyType({
    "resnet50": ResNetConfig(blocks=(3, 4, 6, 3), width=64, n_classes=1000, image_size=224, stem=Stem.IMAGENET),
    "resnet-tiny": ResNetConfig(blocks=(1, 1, 1, 1), width=8, n_classes=10, image_size=32, stem=Stem.CIFAR),
})
"""Named configurations (read-only)."""


def example_inputs(config: ResNetConfig, batch_size: int, seq_len: int | None, device: torch.device | str) -> tuple[Tensor]:
    """Random images for ``ResNet(config)``.

    Args:
        config: the model's config.
        batch_size: B.
        seq_len: ignored (images have no sequence axis); present so that every
            zoo model shares one signature.
        device: where to create them.

    Returns:
        ``(x,)`` with x float32 [B, 3, image_size, image_size].
    """
    return (torch.randn(batch_size, 3, config.image_size, config.image_size, device=device),)


def example_targets(config: ResNetConfig, batch_size: int, seq_len: int | None, device: torch.device | str) -> Tensor:
    """Random class labels, int64 [B]; same arguments as ``example_inputs``."""
    return torch.randint(0, config.n_classes, (batch_size,), device=device)


def loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of logits [B, C] against class labels [B]."""
    return F.cross_entropy(logits, targets)
