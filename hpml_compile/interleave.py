"""Interleaved 1F1B's order on one device group, and the activations it holds: the arithmetic alone.

Narayanan et al. (SC 2021) and Megatron-LM's virtual pipeline: ``S`` device
groups hold ``v`` chunks each, chunk ``c`` of group ``g`` being the model's
piece ``g + c S``. Group ``g`` runs ``2 (S - g - 1) + (v - 1) S`` warm-up
forwards, then one forward and one backward in turn, then the remaining
backwards; the ``i``-th forward runs chunk ``(i mod S v) // S`` on microbatch
``(i // S v) S + i mod S``, the ``i``-th backward the same with the chunks
reversed. Megatron-LM asks for ``M`` a multiple of ``S``. For any other
``M`` this takes Megatron-LM's order for the next multiple of ``S`` and
leaves out the microbatches past ``M``: every message and wait of the rest
is as it was there, so the order stays free of deadlock (the validator,
:mod:`hpml_compile.schedule_check`, replays it), at the price of the empty
slots of the last round.

This module imports nothing of the package, so that the cost formulas
(:mod:`hpml_compile.stagecost`), the lowering (:mod:`hpml_compile.schedule`)
and the simulator read one order.

Example:
    >>> ["F" if f else "B" for f, c, j in order(1, 2, 2, 2)]
    ['F', 'F', 'F', 'B', 'F', 'B', 'B', 'B']
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["order", "warmup", "peak_in_flight", "moments"]


def warmup(group: int, groups: int, chunks: int, microbatches: int) -> int:
    """Group ``g``'s warm-up forwards: ``min(2 (S - g - 1) + (v - 1) S, v M)``.

    >>> [warmup(g, 4, 2, 8) for g in range(4)]
    [10, 8, 6, 4]
    """
    return min(2 * (groups - group - 1) + (chunks - 1) * groups, chunks * microbatches)


def order(group: int, groups: int, chunks: int, microbatches: int) -> list[tuple[bool, int, int]]:
    """Group ``g``'s compute order: ``(forward?, chunk, microbatch)``, ``v M`` forwards and as many backwards.

    Raises:
        ValueError: ``g`` not one of the ``S`` groups, or no chunks or microbatches.

    >>> " ".join(f"{'F' if f else 'B'}{c}.{j}" for f, c, j in order(0, 2, 2, 3))
    'F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 B1.1 F1.2 B0.0 B0.1 B1.2 B0.2'
    """
    s, v, m = groups, chunks, microbatches
    if m < 1 or not 0 <= group < s or v < 1:
        raise ValueError(f"interleaved 1F1B on group {group} of {s} with {v} chunks and {m} microbatches: give a "
                         f"group from 0 to {s - 1}, chunks and microbatches >= 1")
    padded = -(-m // s) * s  # Megatron's order for the next multiple of S, the microbatches past M left out
    total, warm = v * padded, warmup(group, s, v, padded)

    def nth(i: int, forward: bool) -> tuple[bool, int, int]:
        chunk = i % (s * v) // s
        return forward, chunk if forward else v - 1 - chunk, i // (s * v) * s + i % s

    ops = [nth(i, True) for i in range(warm)]
    for i in range(total - warm):
        ops += [nth(warm + i, True), nth(i, False)]
    return [op for op in ops + [nth(i, False) for i in range(total - warm, total)] if op[2] < m]


def moments(group: int, groups: int, chunks: int, microbatches: int) -> tuple[tuple[int, ...], ...]:
    """The microbatches each chunk of group ``g`` holds activations of (forward ran, backward not yet), at each
    moment that can be the group's peak (after a forward), dominated moments dropped.

    >>> moments(0, 2, 2, 4), moments(1, 2, 2, 4)
    (((3, 2), (4, 1)), ((2, 1), (3, 0)))
    """
    live, seen = [0] * chunks, set()
    for forward, c, _ in order(group, groups, chunks, microbatches):
        live[c] += 1 if forward else -1
        if forward:
            seen.add(tuple(live))
    return tuple(sorted(x for x in seen if not any(y != x and all(a >= b for a, b in zip(y, x)) for y in seen)))


def peak_in_flight(group: int, groups: int, chunks: int, microbatches: int,
                   stored: Sequence[float]) -> tuple[int, ...]:
    """Per chunk, the microbatches held at the group's peak of activation bytes, ``stored[c]`` bytes each.

    Args:
        group: ``g``.
        groups: ``S``.
        chunks: ``v``.
        microbatches: ``M``.
        stored: the bytes one microbatch leaves on each chunk.

    Returns:
        One count per chunk (each at least 1, as a stage's count is).

    >>> peak_in_flight(0, 2, 2, 4, [1, 1]), peak_in_flight(0, 2, 2, 4, [1, 5])
    ((3, 2), (3, 2))
    >>> peak_in_flight(0, 2, 2, 4, [5, 1])
    (4, 1)
    """
    best = max(moments(group, groups, chunks, microbatches), key=lambda x: sum(n * b for n, b in zip(x, stored)))
    return tuple(max(1, n) for n in best)
