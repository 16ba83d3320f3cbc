"""Gradient collectives in the plan's reduce dtype: cast down for the wire, summed there, cast back.

A plan's ``reduce_dtype`` (``--reduce-dtype``; :func:`hpml_compile.plan.check_reduce_dtype`) names the dtype
the replicated stages' gradient all-reduce and reduce-scatter run in. The flat gradient buffers of
:mod:`.zero` and :mod:`.zero3` stay in the parameters' dtype (fp32 master gradients, under mixed precision
too); around each collective on them (a whole buffer, or one overlapped bucket):

1. the piece is copied into a tensor of the reduce dtype (:func:`down`);
2. the collective runs on that tensor, through whatever transport the communicator picks for the stage (a ring,
   shared memory, the hierarchical chain): half the bytes under ``bf16``/``fp16``, and the sum is rounded to
   the reduce dtype as the ring or the shared slots add it;
3. the result is copied back into the fp32 piece (:class:`CastBack`, after the wait of an overlapped bucket).

The copy is a temporary made for each collective and dropped after it (half the buffer's bytes at once where
the sync is not bucketed), after the stage's last backward, when its activations are gone; the memory model
does not count it. Its traffic (the casts down and back) is priced with the sync's other copies
(:func:`hpml_compile.stagecost.copy_ms`).

Nothing else changes: the optimizer steps fp32 gradients, the ZeRO shards and checkpoints are fp32, the
parameter all-gathers of ZeRO-1/2/3 carry fp32 parameters. The gradients of parameters tied across stages
(:class:`~.stage.Unbuffered`) are summed in fp32.

Why a cast around our own collectives: torch's peers do the same for their own buffers only. FSDP2's
``MixedPrecisionPolicy(reduce_dtype=...)`` casts its reduce-scatter input, but our stages do not run under
FSDP2 (:mod:`.zero` says why); DDP's communication hooks (``bf16_compress_hook``, ``fp16_compress_hook``) cast
each of DDP's buckets, but run only inside DDP's reducer, and a pipeline stage's buckets are ours
(:class:`~.zero.GradBuckets`), launched by our hooks in a fixed order across replicas.

Example:
    >>> import torch
    >>> from hpml_compile.ir import Precision
    >>> g = torch.tensor([1.0, 1.0 + 2 ** -10])
    >>> w = down(g, reduce_dtype(Precision.BF16, g.dtype))
    >>> w.dtype, w.tolist()          # bf16 keeps 8 bits of mantissa
    (torch.bfloat16, [1.0, 1.0])
    >>> reduce_dtype(Precision.FP32, g.dtype) is None
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...ir import Precision
from ...precision import torch_dtype

__all__ = ["reduce_dtype", "down", "CastBack", "launched"]


def reduce_dtype(wanted: Precision | str, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a gradient buffer of ``dtype`` is reduced in under the plan's ``wanted``; None where it is the
    buffer's own (nothing to cast)."""
    wire = torch_dtype(wanted)
    return None if wire == dtype or not dtype.is_floating_point else wire


def down(piece: Tensor, wire: torch.dtype | None) -> Tensor:
    """``piece`` as the collective's input: a copy in ``wire``, or ``piece`` itself where ``wire`` is None."""
    return piece if wire is None else piece.to(wire)


class CastBack:
    """A pending collective on a reduce-dtype copy whose :meth:`wait` also writes the result back into ``out``.

    Args:
        pending: the communicator's handle (:class:`~.comm.PendingCollective` or :class:`~.comm.PendingChain`).
        wire: the tensor the collective leaves its result in (the reduce dtype).
        out: the buffer's piece that gets it (the gradients' dtype).
    """

    def __init__(self, pending: Any, wire: Tensor, out: Tensor) -> None:
        self.pending, self.wire, self.out = pending, wire, out
        self.done = False

    @property
    def started(self) -> bool:
        """Whether the collective has started (a chain may wait for the buckets before it)."""
        return bool(self.pending.started)

    @property
    def issued(self) -> int:
        """Collectives started so far (a hierarchical chain has three)."""
        return int(self.pending.issued)

    def poll(self) -> None:
        """Let a chain start the levels its finished ones allow."""
        self.pending.poll()

    def wait(self) -> None:
        """Wait for the collective, then copy its result back into :attr:`out` (once)."""
        if self.done:
            return
        self.pending.wait()
        with torch.no_grad():
            self.out.copy_(self.wire)
        self.done = True


def launched(pending: Any, wire: Tensor, out: Tensor) -> Any:
    """``pending`` as :class:`GradBuckets <.zero.GradBuckets>` keeps it: wrapped in :class:`CastBack` where the
    collective runs on a copy (``wire`` is not ``out``); None stays None (a group of one rank)."""
    if pending is None or wire is out:
        return pending
    return CastBack(pending, wire, out)
