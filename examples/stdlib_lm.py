"""A byte-level GPT trained on the source of Python's own standard library: real text every machine has.

The files are the ``*.py`` files at the top of ``sysconfig.get_paths()["stdlib"]``
(nothing is downloaded), sorted by name; every tenth file is held out for
validation, so the validation loss measures text the model never trained on.
An item is a window of ``SEQ`` bytes and the same window shifted by one (the
next byte to predict); the loss is the mean cross-entropy in nats per byte.

The baseline to beat is :func:`byte_entropy`: the entropy of the training
bytes' frequencies, which is what a model that knows only how often each byte
occurs would score. A model that learns any context gets well below it.

Compile and train it on two local CPU ranks::

    hpml-compile compile examples/stdlib_lm.py:spec --cluster local-cpu-2 -o out/lm/build
    hpml-compile run out/lm/build --steps 300 --val-every 50 --run-dir out/lm/run

(``hpml-compile demo`` does both, and prints the baseline below.)

Example:
    >>> s = spec()
    >>> x, y = s.dataset[0]
    >>> x.shape, bool((x[1:] == y[:-1]).all()), 2.5 < byte_entropy() < 5.0
    (torch.Size([64]), True, True)
"""

from __future__ import annotations

import functools
import math
import sysconfig
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from hpml_compile import TrainSpec
from hpml_compile.models.gpt import GPT, GPTConfig, MLPKind, Norm, PosEncoding, loss

SEQ = 64
TRAIN_BYTES = 3 << 20  # enough text for the demo's few hundred steps, read in well under a second
VAL_WINDOWS = 256  # windows spread evenly over the held-out files: a validation pass of 16 batches
STEPS = 300  # what the schedule below is laid out for


@functools.lru_cache(maxsize=1)
def stdlib_bytes() -> tuple[Tensor, Tensor]:
    """``(train, validation)`` bytes (uint8) of the standard library's top-level ``*.py`` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if len(files) < 20:
        raise RuntimeError(f"{root}: only {len(files)} Python files; is the standard library's source installed?")
    train = b"".join(p.read_bytes() for i, p in enumerate(files) if i % 10)[:TRAIN_BYTES]
    val = b"".join(p.read_bytes() for i, p in enumerate(files) if i % 10 == 0)
    return (torch.frombuffer(bytearray(train), dtype=torch.uint8),
            torch.frombuffer(bytearray(val), dtype=torch.uint8))


class ByteWindows(Dataset):
    """Windows of ``SEQ`` bytes and their next bytes: item ``i`` starts at ``starts[i]``."""

    def __init__(self, data: Tensor, starts: list[int]) -> None:
        self.data, self.starts = data, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        s = self.starts[i]
        chunk = self.data[s:s + SEQ + 1].long()
        return chunk[:-1], chunk[1:]


def byte_entropy() -> float:
    """The entropy of the training bytes' frequencies, in nats per byte (the loss of a unigram model)."""
    train, _ = stdlib_bytes()
    p = torch.bincount(train.long(), minlength=256).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def _schedule(step: int) -> float:
    """Linear warm-up over 20 steps, then a cosine down to a tenth over ``STEPS``."""
    if step < 20:
        return (step + 1) / 20
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 20) / (STEPS - 20))))


def spec(batch_size: int = 16) -> TrainSpec:
    """The training spec: a 2-layer byte GPT (d_model 128), AdamW 3e-3 with warm-up and cosine decay."""
    train, val = stdlib_bytes()
    config = GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=4, d_model=128, d_ff=512, max_seq_len=SEQ,
                       norm=Norm.LAYERNORM, mlp=MLPKind.GELU, pos=PosEncoding.LEARNED, bias=True,
                       tie_embeddings=True)
    gap = max(1, (len(val) - SEQ - 1) // VAL_WINDOWS)
    return TrainSpec(
        module=GPT(config),
        dataset=ByteWindows(train, list(range(0, len(train) - SEQ - 1, SEQ))),
        loss_fn=loss,
        batch_size=batch_size,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _schedule),
        val_dataset=ByteWindows(val, list(range(0, gap * VAL_WINDOWS, gap))),
        seed=0,
    )
