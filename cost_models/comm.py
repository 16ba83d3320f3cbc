"""Communication cost: the alpha-beta (latency-bandwidth) model.

A message of ``b`` bytes over a link costs ``alpha + b * beta`` with
``alpha = latency_us`` and ``beta = 1 / gbps``. Collectives over ``n`` ranks
(Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 19(1), 2005; ring all-reduce as in Patarasuk &
Yuan, JPDC 69(2), 2009), for ``B`` bytes per rank, reduction cost ignored:

====================  ==========================  ================================
collective            latency term                bandwidth term
====================  ==========================  ================================
all-reduce, ring      ``2 (n-1) alpha``           ``2 (n-1)/n B beta``
all-reduce, tree      ``2 ceil(log2 n) alpha``    ``2 ceil(log2 n) B beta``
reduce-scatter, ring  ``(n-1) alpha``             ``(n-1)/n B beta`` (B = input)
all-gather, ring      ``(n-1) alpha``             ``(n-1)/n B beta`` (B = output)
broadcast, tree       ``ceil(log2 n) alpha``      ``ceil(log2 n) B beta``
====================  ==========================  ================================

On a ``shared`` link (ranks on one host over loopback, one pool of
bandwidth) the bandwidth term is instead the traffic of all ranks together,
``(n-1) B beta`` per pass (two passes for all-reduce): the ranks' copies run
on the same cores and memory, so they do not overlap. One rank, or zero
bytes, costs nothing. A link may carry a measured fit of its own for the
reduce-scatter, the all-gather and the all-reduce (``LinkSpec.collectives``),
timed on their own (gloo runs the first two slower than this ring); they then
use it.

Example:
    >>> from cost_models.catalog import get_link
    >>> nvl = get_link("nvlink3")  # 300 GB/s, 3 us
    >>> round(allreduce_ms(1e9, 8, nvl), 3)  # 14 * 3 us + 1.75 * 1 GB / 300 GB/s
    5.875
    >>> allreduce_ms(1e9, 1, nvl)
    0.0
"""

from __future__ import annotations

import enum
import math

from cost_models.catalog import LinkSpec

__all__ = ["CollectiveAlgo", "all_gather_ms", "allreduce_ms", "broadcast_ms", "p2p_ms",
           "reduce_scatter_ms"]


class CollectiveAlgo(str, enum.Enum):
    """All-reduce algorithm: ring is bandwidth-optimal, tree latency-optimal."""

    RING = "ring"
    TREE = "tree"


def _check(nbytes: float, n: int) -> None:
    if not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be finite and >= 0, got {nbytes}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (number of ranks) must be an int >= 1, got {n!r}")


def _ms(steps: float, per_rank_bytes: float, total_bytes: float, link: LinkSpec) -> float:
    moved = total_bytes if link.shared else per_rank_bytes
    return steps * link.latency_us * 1e-3 + moved / (link.gbps * 1e9) * 1e3


def p2p_ms(nbytes: float, link: LinkSpec) -> float:
    """One point-to-point message (send/recv).

    Args:
        nbytes: message size in bytes.
        link: the link it crosses.

    Returns:
        Milliseconds: ``alpha + nbytes * beta``; 0 for an empty message.

    Raises:
        ValueError: if ``nbytes`` is negative or not finite.
    """
    _check(nbytes, 2)
    return 0.0 if nbytes == 0 else _ms(1, nbytes, nbytes, link)


def allreduce_ms(nbytes: float, n: int, link: LinkSpec,
                 algo: CollectiveAlgo | str = CollectiveAlgo.RING) -> float:
    """All-reduce of ``nbytes`` per rank over ``n`` ranks.

    Args:
        nbytes: bytes each rank contributes (and receives).
        n: number of ranks.
        link: the slowest link the collective crosses.
        algo: ``"ring"`` (bandwidth-optimal) or ``"tree"`` (binomial reduce + broadcast).

    Returns:
        Milliseconds; 0 for one rank or zero bytes.

    Raises:
        ValueError: on negative bytes, ``n < 1`` or an unknown ``algo``.
    """
    _check(nbytes, n)
    algo = CollectiveAlgo(algo)
    if n == 1 or nbytes == 0:
        return 0.0
    link = link.for_collective("all_reduce")  # the backend's all-reduce as timed, whichever algorithm it runs
    total = 2 * (n - 1) * nbytes  # every rank's traffic, both passes
    if algo is CollectiveAlgo.RING:
        return _ms(2 * (n - 1), 2 * (n - 1) / n * nbytes, total, link)
    steps = 2 * math.ceil(math.log2(n))
    return _ms(steps, steps * nbytes, total, link)


def reduce_scatter_ms(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring reduce-scatter: each rank ends with 1/n of the reduced ``nbytes``.

    Args:
        nbytes: bytes of each rank's full input.
        n: number of ranks.
        link: the slowest link the collective crosses.

    Returns:
        Milliseconds; 0 for one rank or zero bytes.

    Raises:
        ValueError: on negative bytes or ``n < 1``.
    """
    return _ring_pass(nbytes, n, link.for_collective("reduce_scatter"))


def _ring_pass(nbytes: float, n: int, link: LinkSpec) -> float:
    _check(nbytes, n)
    if n == 1 or nbytes == 0:
        return 0.0
    return _ms(n - 1, (n - 1) / n * nbytes, (n - 1) * nbytes, link)


def all_gather_ms(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring all-gather: each rank ends with all ``nbytes`` (1/n from each rank).

    Args:
        nbytes: bytes of the gathered output on each rank.
        n: number of ranks.
        link: the slowest link the collective crosses.

    Returns:
        Milliseconds; 0 for one rank or zero bytes.

    Raises:
        ValueError: on negative bytes or ``n < 1``.
    """
    # The ring all-gather is the reduce-scatter run backwards: same steps, same bytes per step (a link may
    # carry a measured fit of its own for each: LinkSpec.collectives).
    return _ring_pass(nbytes, n, link.for_collective("all_gather"))


def broadcast_ms(nbytes: float, n: int, link: LinkSpec) -> float:
    """Binomial-tree broadcast of ``nbytes`` from one rank to ``n - 1`` others.

    Args:
        nbytes: message size in bytes.
        n: number of ranks, the root included.
        link: the slowest link the collective crosses.

    Returns:
        Milliseconds; 0 for one rank or zero bytes.

    Raises:
        ValueError: on negative bytes or ``n < 1``.
    """
    _check(nbytes, n)
    if n == 1 or nbytes == 0:
        return 0.0
    steps = math.ceil(math.log2(n))
    return _ms(steps, steps * nbytes, (n - 1) * nbytes, link)
