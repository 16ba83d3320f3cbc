"""ZB-H1's two backward parts of each block, timed as the runtime runs them.

A ZB-H1 stage runs each microbatch's backward as an input-gradient part and,
later, a weight-gradient part (:mod:`hpml_compile.backsplit`). How
the backward divides between them is the block's own (a matmul's is about half
and half; a norm or an activation has no weight part), and the split costs
something of its own besides: it walks the autograd graph once more in Python
to find where the parameters' paths meet the inputs', and runs the weight part
as separate autograd calls, a fixed cost per microbatch that a model of many
small layers feels most. :func:`split_facts` times each block's backward both
ways, whole and split, at the microbatch's rows, and gives per block the weight
part's share of the split backward and the split's extra milliseconds over the
whole one; the cost graph carries them (:func:`hpml_compile.costgraph.build`)
and the simulator prices ZB-H1 with them
(:func:`hpml_compile.simulate.stage_costs`). A few passes at the microbatch's
rows keep it cheap.

Why not torch's profiler or ``stage_backward_weight``: the runtime runs its own
weight part (:func:`hpml_compile.backsplit.backward_weight`), and
that is what must be timed.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

import torch
from torch import fx

from .static import segments
from .timing import Timer, _passes

__all__ = ["split_facts", "time_split"]

# Passes of each kind (whole, split) after one untimed one: the medians of three.
_PASSES = 3


def time_split(gm: fx.GraphModule, example_inputs: Sequence[Any], groups: Sequence[Sequence[str]], *,
               device: torch.device | str = "cpu", passes: int = _PASSES, warmup: int = 1,
               timer: Timer | None = None) -> list[tuple[float, float]]:
    """Per segment, its weight-gradient part's share of the split backward and the split's extra ms.

    Passes alternate, the backward whole then split (input-gradient part, weight-gradient part), so that a
    change of the machine's pace between passes falls on both; each pair gives one sample of each figure.

    Args:
        gm: a traced GraphModule whose parameters live on ``device``.
        example_inputs: the model's inputs (moved to ``device``).
        groups: each segment's node names, contiguous and in graph order (:func:`.static.segments`).
        device: where to measure.
        passes: timed pairs of passes.
        warmup: untimed pairs first.
        timer: the timer to use (default: a plain one on ``device``).

    Returns:
        ``(weight share, extra ms)`` per segment: the medians over the pairs of the weight part over both parts
        (0 where both took no time) and of both parts less the whole backward (at least 0).
    """
    modes = [bool(i % 2) for i in range(2 * (warmup + passes))]
    got = _passes(gm, example_inputs, groups, torch.device(device), modes, 2 * warmup, timer)
    out: list[tuple[float, float]] = []
    for _, b, w in got:
        whole, first, weight = b[0::2], b[1::2], w[1::2]
        shares = [y / (x + y) if x + y > 0 else 0.0 for x, y in zip(first, weight)]
        extras = [x + y - z for x, y, z in zip(first, weight, whole)]
        out.append((statistics.median(shares), max(0.0, statistics.median(extras))))
    return out


def split_facts(gm: fx.GraphModule, inputs: Sequence[Any], device: torch.device, rows: int) -> dict[str, Any]:
    """What ``profile.devices[kind]["split"]`` records: ``{"rows": rows, "blocks": [[first node, weight share,
    extra ms], ...]}``, one entry per block (:func:`.static.segments`) in graph order.

    The weight share is the weight-gradient part over the two parts together; the extra is what the two take
    beyond the backward run whole (at least 0), a cost per microbatch that does not shrink with its rows. A block
    with no backward gets share 0 and extra 0.

    Args:
        gm: the traced model, on ``device``.
        inputs: its inputs at ``rows`` rows (the microbatch's where the profile measures one).
        device: where to measure.
        rows: the rows of ``inputs``, recorded.

    Returns:
        The facts (``{"skipped": why}`` where a block cannot run split).
    """
    groups = [list(sg.nodes) for sg in segments(gm)]
    try:
        times = time_split(gm, inputs, groups, device=device)
    except Exception as e:  # noqa: BLE001 -- a model whose blocks cannot run split: ZB-H1 is priced as assumed
        return {"skipped": f"{type(e).__name__}: {e}"}
    return {"rows": rows, "blocks": [[names[0], round(share, 4), round(extra, 5)]
                                     for names, (share, extra) in zip(groups, times)]}
