"""Cutting planes for the Lagrangian duals of :mod:`.lagrange`: the box-step method over the few device prices.

One threshold pair's dual (:mod:`.lagrange`) is ``q(lam) = min_p [w0(p) + lam . (used_p - cap)]`` over the
tilings ``p`` its candidates allow: concave and piecewise linear in the ``K`` prices (one per device kind, ``K``
at most 4 or 5). Every shortest path ``p`` evaluated at some prices gives a plane

    ``L_p(lam) = w0(p) + lam . (used_p - cap)  >=  q(lam)``  for every ``lam``,

because ``q`` is the least of such planes over all of the pair's tilings. The planes seen so far are an upper
model ``q^ = min_p L_p >= q``; the box-step method (Marsten, Hogan and Blankenship, "The BOXSTEP method for
large-scale optimization", Operations Research 23(3), 1975) moves to the maximiser of ``q^`` within a box of
radius ``r`` around the best prices found (a linear program in ``K + 1`` variables, :func:`box_argmax`, HiGHS),
evaluates ``q`` there and adds its plane. In ``K <= 5`` dimensions the model pins the maximum down in tens of
paths, where the projected subgradient steps it replaced (a Polyak step towards a target level) needed hundreds
or never got there: on llama-70b with 3 x 32 GPUs at 64 microbatches the pair ``t <= 5,517 ms`` has a dual of
at least 62,000 ms (its exact optimum is 62,443), but the threshold boxes stayed at ~21,000, the value at zero
prices, after 20 CPU s of steps aimed at the slack that would settle the box (~340,000 ms), far above any value
the dual can reach.

Planes are shared between pairs (:class:`Planes`): a path is a tiling of every pair whose thresholds admit its
stages (bottleneck at most ``u``, largest tail at most ``v``), so its plane bounds those pairs' duals too, and a
new pair starts with a model instead of none. Correctness never rests on the model: a bound is always a value
``q(lam)`` that was evaluated; the model only chooses where to evaluate next, and tells when nothing better is
left (``max q^ <= best``: the best prices are optimal).

Example:
    >>> import numpy as np
    >>> pl = Planes(2)
    >>> pl.add(4.0, np.array([1.0, -1.0]), 1.0, 1.0)   # L = 4 + lam_0 - lam_1
    >>> pl.add(6.0, np.array([-1.0, 0.0]), 1.0, 1.0)   # L = 6 - lam_0
    >>> lam, z = box_argmax(*pl.valid(2.0, 2.0, np.zeros(2)), np.zeros(2), 5.0)
    >>> [round(float(x), 6) for x in lam], round(z, 6)
    ([1.0, 0.0], 5.0)
"""

from __future__ import annotations

import highspy
import numpy as np

from .highs import quiet_highs

__all__ = ["Planes", "box_argmax", "MODEL_PLANES"]

#: Planes of one model handed to the linear program: those lowest at the center (the ones that bind near it).
MODEL_PLANES = 64


class Planes:
    """Every plane found so far, with the largest stage time and tail of its path (which pairs it bounds)."""

    def __init__(self, kinds: int) -> None:
        self.k = kinds
        self.size = 0
        self.c = np.zeros(64)
        self.g = np.zeros((64, kinds))
        self.top_t = np.zeros(64)
        self.top_tail = np.zeros(64)

    def add(self, c: float, g: np.ndarray, top_t: float, top_tail: float) -> None:
        """Add ``L(lam) = c + g . lam``, the plane of a path whose slowest stage takes ``top_t`` ms and whose
        largest tail is ``top_tail`` ms."""
        if self.size == self.c.size:
            grow = self.c.size
            self.c = np.concatenate([self.c, np.zeros(grow)])
            self.g = np.concatenate([self.g, np.zeros((grow, self.k))])
            self.top_t = np.concatenate([self.top_t, np.zeros(grow)])
            self.top_tail = np.concatenate([self.top_tail, np.zeros(grow)])
        i = self.size
        self.c[i], self.g[i], self.top_t[i], self.top_tail[i] = c, g, top_t, top_tail
        self.size += 1

    def valid(self, u: float, v: float, center: np.ndarray, most: int = MODEL_PLANES) -> tuple[np.ndarray, np.ndarray]:
        """The planes of paths within thresholds ``u`` (stage time) and ``v`` (tail), so upper planes of that
        pair's dual; at most ``most`` of them, those lowest at ``center``. Returns ``(c, g)``."""
        n = self.size
        ok = np.flatnonzero((self.top_t[:n] <= u) & (self.top_tail[:n] <= v))
        if ok.size > most:
            at = self.c[ok] + self.g[ok] @ center
            ok = ok[np.argpartition(at, most - 1)[:most]]
        return self.c[ok], self.g[ok]


def box_argmax(c: np.ndarray, g: np.ndarray, center: np.ndarray, radius: float) -> tuple[np.ndarray, float]:
    """The maximiser of ``min_p (c_p + g_p . lam)`` over ``lam >= 0`` with ``|lam - center|_inf <= radius``, and
    the maximum (``inf`` coordinates of ``radius`` are not allowed: the box keeps the program bounded).

    The linear program: maximise ``z`` subject to ``z - g_p . lam <= c_p`` for every plane ``p`` and the box.
    Without planes the center is returned with ``z = inf``.
    """
    k, p = center.size, c.size
    if p == 0:
        return center.copy(), float("inf")
    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = k + 1, p
    lp.col_cost_ = np.r_[np.zeros(k), -1.0]
    lp.col_lower_ = np.r_[np.maximum(0.0, center - radius), -inf]
    lp.col_upper_ = np.r_[center + radius, inf]
    lp.row_lower_ = np.full(p, -inf)
    lp.row_upper_ = np.asarray(c, dtype=np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.arange(p + 1, dtype=np.int32) * (k + 1)
    lp.a_matrix_.index_ = np.tile(np.arange(k + 1, dtype=np.int32), p)
    lp.a_matrix_.value_ = np.c_[-g, np.ones(p)].ravel()
    h = quiet_highs()
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:  # numerical trouble: stay at the center
        return center.copy(), float(np.min(c + g @ center))
    x = np.asarray(h.getSolution().col_value)
    lam = np.maximum(0.0, x[:k])
    return lam, float(np.min(c + g @ lam))
