"""Floored-units DPs: a stronger relaxation than the prices for one threshold pair of :mod:`.lagrange`'s bound.

Split from :mod:`.lagrange` (it had grown past the house's ~500 lines). Where the prices of the Lagrangian
relaxation stall on a threshold pair, exact DPs over device counts kept in the state in units rounded down (each
kind alone, the others priced; then every kind in coarse units) raise the pair's bound: rounding down admits every
plan, so each is a relaxation, and it has no duality gap from the prices (:class:`_Floored`).

Example:
    >>> floor_variants({"a": 32, "b": 256}, ("a", "b"))
    [{'a': 1, 'b': None}, {'a': None, 'b': 2}, {'a': 2, 'b': 8}]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .dp import tile
from .restricted import units, vectors
from .table import CandidateTable

__all__ = ["FLOOR_VECTORS", "FLOOR_ONE", "FLOOR_WORK", "floor_variants"]

#: Count vectors of the floored-units DP over every kind that raises a threshold pair's bound (:class:`_Floored`).
FLOOR_VECTORS = 1000
#: Units of the one kind kept in the state of the cheaper floored DPs.
FLOOR_ONE = 128
#: Most candidates x count vectors of one floored DP (beyond, it is skipped: time).
FLOOR_WORK = 4_000_000


class _Floored:
    """A stronger relaxation for one threshold pair: device limits kept in the DP's state, in floored units.

    Every plan within the limits has ``sum_i floor(d_i / g_k) <= floor(sum_i d_i / g_k) <= floor(count_k /
    g_k)`` per kind, so the exact DP of :func:`~.dp.tile` over device *units*, where a stage takes
    ``floor(d / g_k)`` of them and kind ``k`` has ``floor(count_k / g_k)``, admits every plan: its least sum
    is a lower bound. A kind left out of the state (``g_k`` None) is only priced, as in the Lagrangian. With
    prices ``lam`` the weights are ``t + comm + lam_kind d`` and ``lam . count`` is subtracted (any
    ``lam >= 0`` gives a bound; prices on the kinds in the state are usually best left at zero). Where the
    stages are a large share of a kind's devices (gpt2-xl on 3 x 32: six stages of 16) the prices alone
    leave a duality gap (1.9% there: two stages of 24 H100 cost the prices what one of 48 does) that the
    state closes. Memory classes as in :class:`_Paths` (optimistic beyond ``J``).
    """

    def __init__(self, n: int, tab: CandidateTable, counts: dict[str, int], big_j: int, J: int,
                 g: dict[str, int | None]) -> None:
        self.n, self.tab, self.big_j, self.J = n, tab, big_j, J
        self.kept = np.asarray([g[k] is not None for k in tab.kinds])
        gk = np.asarray([g[k] or max(counts[k], 1) + 1 for k in tab.kinds], dtype=np.int64)
        self.ucounts = {k: counts[k] // int(gk[i]) for i, k in enumerate(tab.kinds)}
        self.ud = tab.d // gk[tab.kind]
        self.jmax = np.where(tab.jmax >= J, big_j, tab.jmax)  # class J admits jmax >= J: optimistic, a relaxation
        self.vectors = vectors(self.ucounts)
        self.useful = bool(np.any(self.ud > 0))  # else every stage is free in the units: the prices' bound again

    def run(self, sel: np.ndarray, w: np.ndarray) -> tuple[float, list[int]] | None:
        """Least ``sum w`` over tilings by the candidates of ``sel`` within the floored unit counts."""
        idx = np.flatnonzero(sel & np.isfinite(w))
        if idx.size == 0:
            return None
        sub = dataclasses.replace(self.tab.select(idx), d=self.ud[idx])
        got = tile(self.n, self.ucounts, sub, np.zeros(idx.size), w[idx], self.jmax[idx], self.big_j, self.J)
        return None if got is None else (got[1], [int(idx[i]) for i in got[2]])


def floor_variants(counts: dict[str, int], kinds: tuple[str, ...]) -> list[dict[str, int | None]]:
    """The state units of the floored DPs tried on a stalled pair: each kind alone in the state (at most
    :data:`FLOOR_ONE` units, the others priced), then every kind in units (:func:`units`, at most
    :data:`FLOOR_VECTORS` count vectors).

    >>> floor_variants({"a": 32, "b": 256}, ("a", "b"))
    [{'a': 1, 'b': None}, {'a': None, 'b': 2}, {'a': 2, 'b': 8}]
    """
    out: list[dict[str, int | None]] = []
    for k in kinds:
        g = 1
        while counts[k] // g > FLOOR_ONE:
            g *= 2
        out.append({x: (g if x == k else None) for x in kinds})
    if len(kinds) > 1:
        out.append(dict(units({k: counts[k] for k in kinds}, FLOOR_VECTORS)))
    return out
