"""Less communication for a replicated stage: gradient compression specs and what they send.

A plan may name, per replicated stage, a gradient compression (``Stage.compress``)
and, for the whole plan, periodic synchronisation (``Plan.sync_every`` after
``Plan.sync_warmup`` steps of per-step sync). This module is the shared,
torch-free half: it parses the option string the user gives
(``--compress powersgd:RANK`` or ``topk:RATIO``), names what is wrong with a bad
one, and says how many bytes a compressed gradient puts on the wire and how many
passes over the gradient the compression costs, for the cost model
(:mod:`hpml_compile.stagecost`) and for ``report``. What runs on the ranks is
:mod:`hpml_compile.runtime.sync.compress`.

- **Top-K with error feedback** (Stich et al., NeurIPS 2018; Lin et al., ICLR
  2018 "Deep Gradient Compression"): each replica sends the ``k = ceil(ratio N)``
  largest-magnitude entries of (its gradient + the error it kept), as values
  and int32 indices; one all-gather of ``d k`` (value, index) pairs and a
  scatter-add give every replica the same sum. What was not sent stays in the
  replica's error and is added to the next step's gradient.
- **PowerSGD** (Vogels et al., NeurIPS 2019): each ``n x m`` gradient matrix is
  sent as two rank-``r`` factors (``P``: ``n x r``, ``Q``: ``m x r``), each
  all-reduced, with error feedback and warm start; vectors (biases, norms) go
  uncompressed. The plan does not know parameter shapes, only bytes, so the
  cost model prices a parameter of ``e`` elements as a square matrix
  (``2 r sqrt(e)`` elements on the wire, :func:`powersgd_fraction`): exact for
  square weights, ~20% low for a ``d x 4d`` MLP weight, and it counts vectors
  as compressed (they are small).

Example:
    >>> c = Compression.parse("topk:0.01")
    >>> c.kind.value, c.ratio, str(c)
    ('topk', 0.01, 'topk:0.01')
    >>> Compression.parse("powersgd:4").rank
    4
    >>> round(c.wire_bytes(4_000_000, dtype_bytes=4, replicas=2), 0)  # 10k pairs of 8 bytes, from each of 2
    160000.0
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Iterable

from .errors import OptionError

__all__ = ["CompressKind", "Compression", "INDEX_BYTES", "powersgd_fraction", "check_sync", "parse_compress"]

INDEX_BYTES = 4  # Top-K sends int32 indices: a flat stage gradient under 2^31 elements
_FORMS = "'powersgd:RANK' (an integer >= 1, e.g. powersgd:4) or 'topk:RATIO' (0 < RATIO < 1, e.g. topk:0.01)"


class CompressKind(str, enum.Enum):
    """Which gradient compression."""

    POWERSGD = "powersgd"
    TOPK = "topk"


@dataclass(frozen=True, slots=True)
class Compression:
    """A gradient compression: PowerSGD of a rank, or Top-K of a ratio (with error feedback, both).

    Attributes:
        kind: PowerSGD or Top-K.
        rank: PowerSGD's matrix approximation rank (0 for Top-K).
        ratio: the share of entries Top-K sends (0 for PowerSGD).
    """

    kind: CompressKind
    rank: int = 0
    ratio: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CompressKind(self.kind))
        if self.kind is CompressKind.POWERSGD and self.rank < 1:
            raise OptionError(f"powersgd needs a rank >= 1, got {self.rank}: write {_FORMS}")
        if self.kind is CompressKind.TOPK and not 0.0 < self.ratio < 1.0:
            raise OptionError(f"topk needs a ratio between 0 and 1 (exclusive), got {self.ratio}: write {_FORMS}")

    @classmethod
    def parse(cls, text: str, what: str = "--compress") -> "Compression":
        """Read ``powersgd:RANK`` or ``topk:RATIO``.

        Raises:
            OptionError: naming ``what``, the bad value and the two forms that are understood.
        """
        kind, sep, arg = str(text).strip().partition(":")
        try:
            k = CompressKind(kind.lower())
        except ValueError:
            raise OptionError(f"{what} {text!r}: unknown compression {kind!r}; write {_FORMS}") from None
        if not sep or not arg:
            raise OptionError(f"{what} {text!r}: {k.value} needs its {'rank' if k is CompressKind.POWERSGD else 'ratio'}"
                              f" after a colon; write {_FORMS}")
        try:
            if k is CompressKind.POWERSGD:
                return cls(k, rank=int(arg))
            return cls(k, ratio=float(arg))
        except ValueError:
            raise OptionError(f"{what} {text!r}: {arg!r} is not a number; write {_FORMS}") from None
        except OptionError as e:
            raise OptionError(f"{what} {text!r}: {e}") from None

    def __str__(self) -> str:
        return f"powersgd:{self.rank}" if self.kind is CompressKind.POWERSGD else f"topk:{self.ratio:g}"

    def wire_bytes(self, param_bytes: float, *, dtype_bytes: int, replicas: int, fraction: float | None = None
                   ) -> float:
        """The bytes of the compressed collective's payload (what cost_models prices), for ``param_bytes``.

        Top-K: the gathered output, ``d k (dtype + 4)`` bytes. PowerSGD: the ``P`` and ``Q`` factors
        all-reduced, ``fraction x param_bytes`` (:func:`powersgd_fraction`; default: every parameter one
        square matrix of ``param_bytes``).
        """
        if self.kind is CompressKind.TOPK:
            k = math.ceil(self.ratio * param_bytes / dtype_bytes)
            return float(replicas * k * (dtype_bytes + INDEX_BYTES))
        if fraction is None:
            fraction = powersgd_fraction([int(param_bytes // dtype_bytes)], self.rank)
        return fraction * param_bytes

    @property
    def passes(self) -> float:
        """Passes over the gradient's bytes that compressing and decompressing cost (an estimate, checked by
        benchmarks/comm_options): Top-K adds the error, takes |x|, selects, gathers, zeroes the sent entries
        and scatters the sum back (~6); PowerSGD adds the error, multiplies twice by thin factors,
        reconstructs and keeps the new error (~5, plus ``r`` columns each read of the matrix)."""
        return 6.0 if self.kind is CompressKind.TOPK else 5.0 + 0.5 * self.rank


def parse_compress(text: str | None, what: str = "--compress") -> Compression | None:
    """``None``, ``""`` and ``"none"`` mean no compression; anything else is :meth:`Compression.parse`."""
    if text is None or str(text).strip().lower() in ("", "none"):
        return None
    return Compression.parse(text, what)


def powersgd_fraction(elements: Iterable[int], rank: int) -> float:
    """Share of the gradient's elements PowerSGD of ``rank`` puts on the wire, each parameter as a square matrix.

    Args:
        elements: the element count of each parameter.
        rank: the approximation rank.

    Returns:
        ``sum(min(e, 2 r sqrt(e))) / sum(e)`` (1.0 for no elements).

    >>> powersgd_fraction([1024 * 1024], 4)  # a 1024 x 1024 weight: 2 x 1024 x 4 elements
    0.0078125
    """
    es = [int(e) for e in elements if e > 0]
    total = sum(es)
    if not total:
        return 1.0
    return sum(min(e, 2 * rank * math.sqrt(e)) for e in es) / total


def check_sync(sync_every: int, sync_warmup: int) -> None:
    """Local SGD's options: ``sync_every >= 1`` (1: every step, plain data parallelism), ``sync_warmup >= 0``.

    Raises:
        OptionError: naming the bad value.
    """
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise OptionError(f"--sync-every must be an integer >= 1 (1: average every step, plain data parallelism; "
                          f"H > 1: replicas step on their own gradients and average parameters every H steps), "
                          f"got {sync_every!r}")
    if isinstance(sync_warmup, bool) or not isinstance(sync_warmup, int) or sync_warmup < 0:
        raise OptionError(f"--sync-warmup must be an integer >= 0 (steps of per-step gradient sync before local "
                          f"SGD starts), got {sync_warmup!r}")
