"""What the generated ops need from a communicator, and how boundaries between replica groups are resharded.

A stage replicated over ``d`` devices runs every microbatch on ``d`` slices
of its rows (replica ``r`` takes rows ``r*b/d .. (r+1)*b/d`` of a microbatch
of ``b`` rows), as the solver's cost model assumes. A boundary between a
stage with ``d`` replicas and one with ``d'``:

- ``d == d'``: replica ``r`` talks to replica ``r``, whole tensors;
- otherwise each tensor with a batch dimension is cut into the row ranges
  the two sides share (a replica sends each peer the rows it holds of that
  peer's range); a tensor without one (same on every replica) goes from
  producer replica ``q % d`` to consumer replica ``q``, and in backward the
  producer sums the gradients of the consumers it served.

Uneven data parallelism (``Stage.rows``): replica ``r`` of such a stage runs
``rows[r]`` consecutive rows of each microbatch (:meth:`Comm.ranges`), so the
row ranges of the two sides are absolute, not proportional, and a boundary
reshards whenever they differ (the same rule as above, on those ranges;
:func:`overlaps`). The generated code of such a stage is traced at its first
replica's rows; :meth:`Comm.shaped` scales the batch dimension of each
boundary tensor's spec to this replica's rows, so one stage file serves
every replica.

:class:`Comm` implements that on top of two primitives, a point-to-point
``_put``/``_get`` between endpoints ``(stage, replica)``: a local mailbox in
one process (:class:`hpml_compile.runtime.sync.comm.LocalComm`) or torch.distributed
ranks (:class:`hpml_compile.runtime.sync.comm.DistComm`).

Example:
    >>> pieces(rows=4, me=0, d_me=2, d_peer=4)  # replica 0 of 2 holds rows 0-3 of 8; peers hold 2 each
    [(0, 0, 2), (1, 2, 2)]
    >>> pieces(rows=2, me=3, d_me=4, d_peer=2)  # replica 3 of 4 (rows 6-7) -> peer 1 (rows 4-7) at offset 0
    [(1, 0, 2)]
    >>> overlaps((0, 3), [(0, 1), (1, 3), (3, 4)])  # rows 0-2 of a microbatch against a 1:2:1 split
    [(0, 0, 1), (1, 1, 2)]
"""

from __future__ import annotations

import abc
import enum
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .mailbox import Mailbox

__all__ = ["Direction", "TensorSpec", "carries_grad", "pieces", "overlaps", "split_ranges", "Comm", "DetachedComm"]

# One tensor crossing a boundary, as generated code spells it: (shape on this side, dtype,
# batch dimension -- None when the two sides have the same replica count or the tensor has none).
TensorSpec = tuple[tuple[int, ...], torch.dtype, int | None]
Endpoint = tuple[int, int]  # (stage, replica)


class Direction(str, enum.Enum):
    """Which way a message goes along a boundary ``src -> dst`` (``src`` is the earlier stage)."""

    FORWARD = "fwd"  # activations, src -> dst
    BACKWARD = "bwd"  # their gradients, dst -> src


def carries_grad(spec: TensorSpec) -> bool:
    """Whether a boundary tensor gets a gradient message back (floating-point ones do)."""
    return spec[1].is_floating_point or spec[1].is_complex


def pieces(rows: int, me: int, d_me: int, d_peer: int) -> list[tuple[int, int, int]]:
    """Row ranges this replica shares with each peer replica: ``(peer, offset in mine, length)``.

    Args:
        rows: rows this replica holds (its slice of the microbatch).
        me: this replica's index.
        d_me: replicas on this side.
        d_peer: replicas on the other side.
    """
    total = rows * d_me
    if total % d_peer:
        raise ValueError(f"a microbatch of {total} rows does not split over {d_peer} replicas")
    peer_rows = total // d_peer
    lo, hi = me * rows, (me + 1) * rows
    out = []
    for q in range(d_peer):
        a, b = max(lo, q * peer_rows), min(hi, (q + 1) * peer_rows)
        if a < b:
            out.append((q, a - lo, b - a))
    return out


def overlaps(mine: tuple[int, int], peers: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Rows of range ``mine`` that each peer's range shares: ``(peer, offset in mine, length)``.

    Args:
        mine: ``(first row, end)`` of this replica within a microbatch.
        peers: the same for each replica of the other side.
    """
    lo, hi = mine
    out = []
    for q, (a, b) in enumerate(peers):
        x, y = max(lo, a), min(hi, b)
        if x < y:
            out.append((q, x - lo, y - x))
    return out


def split_ranges(rows: Sequence[int]) -> list[tuple[int, int]]:
    """``(first row, end)`` of each replica's consecutive run of a microbatch, from each one's row count.

    Example:
        >>> split_ranges([3, 1])
        [(0, 3), (3, 4)]
    """
    out, lo = [], 0
    for n in rows:
        out.append((lo, lo + n))
        lo += n
    return out


class Comm(abc.ABC):
    """Moves tensors between stages; an executor gives each stage module one (``stage.hpml_comm``).

    The executor sets ``microbatch`` and ``replica`` before each forward call;
    the autograd functions remember them for their backward. The stage's
    ``ops.recv``/``ops.send`` nodes meet the executor's RECV/SEND tokens in
    ``mail`` (:mod:`.mailbox`).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        from .mailbox import Mailbox  # (which imports this module)

        self.mail: Mailbox = Mailbox()
        self.microbatch = 0
        self.replica = 0
        self.device = torch.device(device)
        # Gradients owed to senders for tensors received: (src, dst, replica, microbatch) -> specs.
        self._owed: dict[tuple[int, int, int, int], tuple[TensorSpec, ...]] = {}
        # The plan's rows of each replica per microbatch, by stage (Stage.rows; () for an equal split).
        self.rows: list[tuple[int, ...]] = []
        # The rows each stage's code was generated at (its first replica's), by stage; empty: ``rows[0]``.
        # Set by a runtime that moves rows between replicas without regenerating the code.
        self.spec_rows: list[int] = []
        self.events: Any = None  # where a runtime records each step's events (None: nowhere)
        # A small SUM all-reduce over the same ranks that travels as the meeting of the next collective of its
        # stages (a runtime over processes: the loss agreement of a one-stage plan); None: none.
        self.rider: Any = None

    @abc.abstractmethod
    def _put(self, frm: Endpoint, to: Endpoint, key: tuple[int, ...], tensor: Tensor) -> None:
        """Send one tensor between endpoints without waiting for the receiver."""

    @abc.abstractmethod
    def _get(self, frm: Endpoint, to: Endpoint, key: tuple[int, ...], shape: tuple[int, ...],
             dtype: torch.dtype) -> Tensor:
        """Receive one tensor (blocks until it is there)."""

    @abc.abstractmethod
    def replicas(self, stage: int) -> int:
        """How many replicas ``stage`` has."""

    @abc.abstractmethod
    def all_reduce(self, stages: tuple[int, ...], flat: Tensor) -> None:
        """Sum ``flat`` in place over every process running one of ``stages``."""

    @abc.abstractmethod
    def reduce_scatter(self, stage: int, flat: Tensor) -> Tensor:
        """Sum ``flat`` (length divisible by the replicas) over ``stage``'s replicas; return this replica's shard."""

    @abc.abstractmethod
    def all_gather(self, stage: int, shard: Tensor, into: Tensor | None = None) -> Tensor:
        """Concatenate every replica's ``shard`` of ``stage`` in replica order; ``into``, a contiguous buffer of
        that size (``shard`` may be a view of it), is written in place where the communicator can, and returned
        then (the caller copies otherwise)."""

    def group_size(self, stages: tuple[int, ...]) -> int:
        """How many processes run one of ``stages`` (1: a collective over them is a no-op)."""
        return 1

    def flush(self) -> None:
        """Wait for every message this process has sent (called at the end of a step)."""

    def _rows(self, stage: int) -> tuple[int, ...]:
        return self.rows[stage] if stage < len(self.rows) else ()

    def ranges(self, a: int, b: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
        """Each replica's row range of a microbatch on stages ``a`` and ``b``; None when both split it equally.

        A stage with plan rows fixes the microbatch (their sum); an equally split
        neighbour divides that sum by its replica count.
        """
        ra, rb = self._rows(a), self._rows(b)
        if not ra and not rb:
            return None
        mb = sum(ra or rb)
        return tuple(split_ranges(r or [mb // self.replicas(k)] * self.replicas(k))  # type: ignore[return-value]
                     for k, r in ((a, ra), (b, rb)))

    def shaped(self, stage: int, replica: int, specs: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
        """``specs`` (as generated: at the stage's first replica's rows, ``spec_rows``) at ``replica``'s rows.

        Only a stage with plan rows has replicas of different rows; the batch
        dimension of each boundary tensor scales with them (a ``B*T`` row
        dimension too: it is a whole number of elements per row).
        """
        rows = self._rows(stage)
        made = self.spec_rows[stage] if stage < len(self.spec_rows) else rows[0] if rows else 0
        if not rows or rows[replica] == made:
            return tuple(specs)
        out = []
        for shape, dtype, bd in specs:
            if bd is not None:
                per, left = divmod(shape[bd], made)
                if left:
                    raise RuntimeError(f"stage {stage}: a boundary tensor of shape {shape} has {shape[bd]} rows in "
                                       f"dimension {bd}, not a multiple of the {made} rows it was generated for")
                shape = tuple(per * rows[replica] if i == bd else n for i, n in enumerate(shape))
            out.append((shape, dtype, bd))
        return tuple(out)

    def _sides(self, src: int, dst: int, direction: Direction) -> tuple[int, int]:
        """(sending stage, receiving stage) of a message."""
        return (src, dst) if direction is Direction.FORWARD else (dst, src)

    def send(self, src: int, dst: int, direction: Direction, microbatch: int, replica: int,
             tensors: Sequence[Tensor], specs: Sequence[TensorSpec]) -> None:
        """Send ``tensors`` (this side's shapes ``specs``) along boundary ``src -> dst``; never blocks."""
        me, peer = self._sides(src, dst, direction)
        d_me, d_peer = self.replicas(me), self.replicas(peer)
        d_src = self.replicas(src)
        rng = self.ranges(me, peer)
        for i, (t, (_, _, bd)) in enumerate(zip(tensors, specs)):
            key = (src, dst, 0 if direction is Direction.FORWARD else 1, microbatch, i)
            if (rng is None and d_me == d_peer) or (rng is not None and rng[0] == rng[1]):
                self._put((me, replica), (peer, replica), key, t)
            elif bd is not None and rng is not None:  # plan rows: absolute row ranges
                lo, hi = rng[0][replica]
                per = t.shape[bd] // (hi - lo)
                for q, off, n in overlaps(rng[0][replica], rng[1]):
                    self._put((me, replica), (peer, q), key, t.narrow(bd, off * per, n * per).contiguous())
            elif bd is not None:
                for q, off, n in pieces(t.shape[bd], replica, d_me, d_peer):
                    self._put((me, replica), (peer, q), key, t.narrow(bd, off, n).contiguous())
            elif direction is Direction.FORWARD:  # same on every replica: consumer q reads producer q % d_src
                for q in range(d_peer):
                    if q % d_src == replica:
                        self._put((me, replica), (peer, q), key, t)
            else:
                self._put((me, replica), (peer, replica % d_src), key, t)

    def recv(self, src: int, dst: int, direction: Direction, microbatch: int, replica: int,
             specs: Sequence[TensorSpec]) -> list[Tensor]:
        """Receive tensors of this side's ``specs`` along boundary ``src -> dst`` (blocks)."""
        peer, me = self._sides(src, dst, direction)
        d_me, d_peer = self.replicas(me), self.replicas(peer)
        d_src = self.replicas(src)
        rng = self.ranges(me, peer)
        out = []
        for i, (shape, dtype, bd) in enumerate(specs):
            key = (src, dst, 0 if direction is Direction.FORWARD else 1, microbatch, i)
            if (rng is None and d_me == d_peer) or (rng is not None and rng[0] == rng[1]):
                out.append(self._get((peer, replica), (me, replica), key, shape, dtype))
            elif bd is not None and rng is not None:  # plan rows: absolute row ranges
                lo, hi = rng[0][replica]
                per = shape[bd] // (hi - lo)
                parts = []
                for q, _, n in overlaps(rng[0][replica], rng[1]):
                    part_shape = tuple(n * per if j == bd else s for j, s in enumerate(shape))
                    parts.append(self._get((peer, q), (me, replica), key, part_shape, dtype))
                out.append(torch.cat(parts, dim=bd))
            elif bd is not None:
                parts = []
                for q, _, n in pieces(shape[bd], replica, d_me, d_peer):
                    part_shape = tuple(n if j == bd else s for j, s in enumerate(shape))
                    parts.append(self._get((peer, q), (me, replica), key, part_shape, dtype))
                out.append(torch.cat(parts, dim=bd))
            elif direction is Direction.FORWARD:
                out.append(self._get((peer, replica % d_src), (me, replica), key, shape, dtype))
            else:  # the producer sums the gradients of every consumer it served
                total = torch.zeros(shape, dtype=dtype, device=self.device)
                for q in range(d_peer):
                    if q % d_src == replica:
                        total = total + self._get((peer, q), (me, replica), key, shape, dtype)
                out.append(total)
        return out

    def expect(self, src: int, dst: int, direction: Direction, microbatch: int, replica: int,
               specs: Sequence[TensorSpec]) -> None:
        """Post, without waiting, the receive that :meth:`recv` of the same arguments will wait for (a transport
        that gains nothing from it, a mailbox, does nothing). Only for a message this step is sure to receive: a
        posted receive cannot be taken back."""

    def owe(self, src: int, dst: int, replica: int, microbatch: int, specs: tuple[TensorSpec, ...]) -> None:
        """Record that replica ``replica`` of stage ``dst`` must send gradients for what it received."""
        self._owed[(src, dst, replica, microbatch)] = specs

    def repay(self, src: int, dst: int, replica: int, microbatch: int, grads: Sequence[Tensor]) -> None:
        """Leave the gradients owed for a received tuple for the stage's ``SEND`` token to send (called by the
        backward of ``ops.recv``)."""
        specs = self._owed.pop((src, dst, replica, microbatch))
        self.mail.leave((src, dst, Direction.BACKWARD, microbatch, replica), grads,
                        [s for s in specs if carries_grad(s)])

    def settle(self, dst: int, replica: int, microbatch: int) -> None:
        """After a stage replica's backward of ``microbatch``: leave the zero gradients it still owes.

        A received tensor that no path to the loss uses never sees a backward
        call; its sender still waits for a gradient, which is zero.
        """
        for key in [k for k in self._owed if k[1] == dst and k[2] == replica and k[3] == microbatch]:
            specs = tuple(s for s in self._owed[key] if carries_grad(s))
            self.repay(key[0], dst, replica, microbatch,
                       [torch.zeros(s[0], dtype=s[1], device=self.device) for s in specs])


class DetachedComm(Comm):
    """The comm of a stage no executor has attached yet: any message is an error saying what to do."""

    def _fail(self, *_: Any) -> Any:
        raise RuntimeError("this stage module has no communicator: run it through "
                           "hpml_compile.runtime.execute.executor (which sets stage.hpml_comm), not by calling it directly")

    _put = _get = all_reduce = reduce_scatter = all_gather = _fail  # type: ignore[assignment]

    def replicas(self, stage: int) -> int:
        return 1
