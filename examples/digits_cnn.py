"""A small CNN on scikit-learn's bundled handwritten digits (8 x 8 images, 10 classes), as a TrainSpec.

The 1,797 images ship with scikit-learn (``sklearn.datasets.load_digits``;
nothing is downloaded). A seeded fifth of them is held out for validation. The
network has BatchNorm, so its validation loss (eval mode) uses the running
statistics, not the batch's.

Compile and train it on two local CPU ranks::

    hpml-compile compile examples/digits_cnn.py:spec --cluster local-cpu-2 -o out/digits/build
    hpml-compile run out/digits/build --epochs 5 --val-every 20 --run-dir out/digits/run

Example:
    >>> s = spec()
    >>> x, y = s.dataset[0]
    >>> tuple(x.shape), int(y) in range(10), len(s.dataset) + len(s.val_dataset)
    ((1, 8, 8), True, 1797)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from hpml_compile import TrainSpec


def digits() -> tuple[TensorDataset, TensorDataset]:
    """``(train, validation)``: images scaled to [0, 1] as [1, 8, 8] float tensors, labels as int64."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    held = len(y) // 5
    val, train = order[:held], order[held:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def net() -> nn.Module:
    """Two 3x3 convolutions with BatchNorm, a 2x2 max-pool, a linear classifier."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )


def spec(batch_size: int = 32) -> TrainSpec:
    """The training spec: AdamW 2e-3, halved every 100 steps."""
    train, val = digits()
    return TrainSpec(net(), train, nn.functional.cross_entropy, batch_size=batch_size,
                     optimizer=lambda ps: torch.optim.AdamW(ps, lr=2e-3),
                     lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=100, gamma=0.5),
                     val_dataset=val, seed=0)
