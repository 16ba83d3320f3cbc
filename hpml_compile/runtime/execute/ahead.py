"""Receives posted ahead of their tokens: which of a rank's ``kRECVp:j`` to post early, and when.

A ``kRECVp:j`` token receives (and waits) where the lowered list puts it
(:mod:`.executor`). On gloo that is often after the sender's ``isend``: its
payload then comes back the moment the receive is posted, while this rank's
thread still holds gloo's pair lock, and gloo's event loop retries that lock
without sleeping (:meth:`~..sync.comm.DistComm.expect` says more). Posting the
receive earlier lets the payload meet a receive that is already there, so the
executor posts, through :meth:`~hpml_compile.codegen.comm.Comm.expect`:

- each activation stream's (stage ``k`` from ``p < k``) first receive when the
  step starts, and each next one when the token before it in the same stream
  runs: one buffer ahead per stream;
- a gradient receive (``k`` from ``p > k``) right after the forward's
  ``kSENDp:j`` it answers, whose specs it needs: the peer can send it only
  after its own forward and backward of ``j``.

Only receives the list runs this step are posted (gloo cannot take one back);
their tokens then wait for them. A communicator without a transport (one
process) ignores ``expect``.

Example:
    >>> tokens = "1RECV0:0 1F0 1RECV0:1 1F1 1SEND2:1 3RECV2:1 1RECV2:1".split()
    >>> plan = Ahead([(1, Action.parse(t)) for t in tokens])
    >>> plan.first, plan.next[(1, 1, 0, 0)], sorted(plan.grads)
    ([(1, 1, 0, 0), (1, 3, 2, 1)], 1, [(1, 1, 2, 1)])
"""

from __future__ import annotations

from typing import Sequence

from ...schedule import Action, ActionKind

__all__ = ["Ahead"]

Token = tuple[int, int, int, int]  # (rank, stage, peer, microbatch)


class Ahead:
    """The early receives of one run of ``order`` (see the module docstring).

    Attributes:
        first: the first receive of each activation stream, posted when the step starts.
        next: an activation receive -> the microbatch of the next one of its stream.
        grads: the gradient receives of the list, each posted after the forward ``SEND`` it answers.
    """

    def __init__(self, order: Sequence[tuple[int, Action]]) -> None:
        self.first: list[Token] = []
        self.next: dict[Token, int] = {}
        self.grads: set[Token] = set()
        last: dict[tuple[int, int, int], Token] = {}
        for rank, a in order:
            if a.kind is not ActionKind.RECV:
                continue
            k, p, j = a.stage, a.stages[1], a.microbatch or 0
            if p > k:
                self.grads.add((rank, k, p, j))
                continue
            before = last.get((rank, k, p))
            if before is None:
                self.first.append((rank, k, p, j))
            else:
                self.next[before] = j
            last[(rank, k, p)] = (rank, k, p, j)
