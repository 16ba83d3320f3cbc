"""Where a stage's boundary values wait between its ``ops.recv``/``ops.send`` nodes and the executor's tokens.

A generated stage does not talk to its neighbours itself: the executor's
``kRECVp:j`` and ``kSENDp:j`` tokens do (:mod:`hpml_compile.schedule`), as
``torch.distributed.pipelining``'s ``_perform_action`` does, so the lowered
per-rank lists are what runs. The stage's ``ops.recv`` and ``ops.send``
nodes (autograd functions, :mod:`.ops`) stay its boundaries in the graph and
hand values to and from the :class:`Mailbox` of its communicator
(``comm.mail``), keyed by ``(src, dst, direction, microbatch, replica)``
(``src`` the earlier stage, ``replica`` this side's):

- forward, receiving: ``kRECVp:j`` (``p < k``) receives the tuple into the
  inbox (:func:`post_recv`, shaped by the stage's ``RECV`` specs); the
  forward's ``ops.recv`` takes it;
- forward, sending: the forward's ``ops.send`` leaves its tuple in the
  outbox; ``kSENDp:j`` (``p > k``) hands it to the transport (:func:`post_send`,
  which never blocks: sends are waited for at ``LOSS``);
- backward, receiving: ``kRECVp:j`` (``p > k``) receives the gradients of
  what ``ops.send`` sent (its specs are remembered, :attr:`Mailbox.sent`);
  the backward of ``ops.send`` takes them;
- backward, sending: the backward of ``ops.recv`` (or
  :meth:`~.comm.Comm.settle`, for a value no path to the loss used) leaves
  the gradients owed in the outbox; ``kSENDp:j`` (``p < k``) sends them.

Example:
    >>> import torch
    >>> box = Mailbox()
    >>> box.leave((0, 1, Direction.FORWARD, 0, 0), [torch.ones(2)], ())
    >>> box.pending()
    ['0->1 fwd microbatch 0 replica 0 (to send)']
    >>> box.take((0, 1, Direction.FORWARD, 0, 0))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: stage 1 replica 0: nothing was received from stage 0 for microbatch 0 ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from torch import Tensor

from .comm import Comm, Direction, TensorSpec, carries_grad

__all__ = ["Key", "Mailbox", "post_recv", "expect_recv", "post_send", "message"]

Key = tuple[int, int, Direction, int, int]  # (src, dst, direction, microbatch, this side's replica)


@dataclass
class Mailbox:
    """One communicator's boundary values in flight between the stage graph and the tokens (one step's).

    Attributes:
        inbox: received, not yet taken by ``ops.recv`` (forward) or ``ops.send``'s backward: key -> (tensors,
            their specs on this side).
        outbox: left by ``ops.send`` (forward) or ``ops.recv``'s backward, not yet sent: key -> (tensors, specs).
        sent: ``(src, dst, microbatch, replica)`` -> the specs ``ops.send`` sent, whose gradients come back.
    """

    inbox: dict[Key, tuple[list[Tensor], tuple[TensorSpec, ...]]] = field(default_factory=dict)
    outbox: dict[Key, tuple[list[Tensor], tuple[TensorSpec, ...]]] = field(default_factory=dict)
    sent: dict[tuple[int, int, int, int], tuple[TensorSpec, ...]] = field(default_factory=dict)

    def leave(self, key: Key, tensors: Sequence[Tensor], specs: Sequence[TensorSpec]) -> None:
        """Put ``tensors`` (this side's ``specs``) in the outbox for the ``kSEND`` token of ``key``."""
        self.outbox[key] = (list(tensors), tuple(specs))

    def take(self, key: Key) -> tuple[list[Tensor], tuple[TensorSpec, ...]]:
        """What the ``kRECV`` token of ``key`` received, and its specs.

        Raises:
            RuntimeError: nothing was received for it (the stage ran outside the executor, or out of order).
        """
        got = self.inbox.pop(key, None)
        if got is None:
            src, dst, direction, mb, rep = key
            me, peer = (dst, src) if direction is Direction.FORWARD else (src, dst)
            raise RuntimeError(f"stage {me} replica {rep}: nothing was received from stage {peer} for microbatch "
                               f"{mb} ({direction.value}): its {me}RECV{peer}:{mb} token must run before; run the "
                               "stage through hpml_compile.runtime.execute.executor")
        return got

    def pending(self) -> list[str]:
        """What is left (received and not taken, left and not sent), for error messages."""
        def name(key: Key, what: str) -> str:
            return f"{key[0]}->{key[1]} {key[2].value} microbatch {key[3]} replica {key[4]} ({what})"
        return [name(k, "received") for k in self.inbox] + [name(k, "to send") for k in self.outbox]

    def clear(self) -> None:
        """Drop everything (after an evaluation pass or a failed step)."""
        self.inbox.clear()
        self.outbox.clear()
        self.sent.clear()


def message(stage: int, peer: int, send: bool) -> tuple[int, int, Direction]:
    """``(src, dst, direction)`` of the token ``{stage}SEND{peer}`` (``send``) or ``{stage}RECV{peer}``.

    Example:
        >>> [message(1, 0, False), message(1, 0, True)]  # activations in, their gradients out
        [(0, 1, <Direction.FORWARD: 'fwd'>), (0, 1, <Direction.BACKWARD: 'bwd'>)]
    """
    src, dst = (stage, peer) if stage < peer else (peer, stage)
    return src, dst, Direction.FORWARD if send == (stage < peer) else Direction.BACKWARD


def post_recv(comm: Comm, stage: int, peer: int, microbatch: int, replica: int,
              specs: Sequence[TensorSpec] = ()) -> None:
    """``{stage}RECV{peer}:{microbatch}``: receive through the transport (blocks) into the inbox.

    Args:
        comm: this process's communicator.
        stage: the receiving stage.
        peer: the stage it receives from.
        microbatch: the microbatch.
        replica: the receiving replica.
        specs: activations (``peer < stage``): the stage's ``RECV`` specs as generated (scaled here to this
            replica's rows); gradients: ignored (those of what ``ops.send`` sent, :attr:`Mailbox.sent`).
    """
    src, dst, direction = message(stage, peer, send=False)
    if direction is Direction.FORWARD:
        want = comm.shaped(dst, replica, specs)
    else:
        want = tuple(s for s in comm.mail.sent.pop((src, dst, microbatch, replica), ()) if carries_grad(s))
    comm.mail.inbox[(src, dst, direction, microbatch, replica)] = (
        comm.recv(src, dst, direction, microbatch, replica, want), want)


def expect_recv(comm: Comm, stage: int, peer: int, microbatch: int, replica: int,
                specs: Sequence[TensorSpec] = ()) -> None:
    """Post ``{stage}RECV{peer}:{microbatch}``'s receive ahead of its token (:meth:`~.comm.Comm.expect`), which
    then only waits for it.

    Args: as :func:`post_recv`'s; a gradient message must follow its forward's ``SEND`` (its specs are those sent).
    """
    src, dst, direction = message(stage, peer, send=False)
    if direction is Direction.FORWARD:
        want = comm.shaped(dst, replica, specs)
    else:
        want = tuple(s for s in comm.mail.sent.get((src, dst, microbatch, replica), ()) if carries_grad(s))
    if want:
        comm.expect(src, dst, direction, microbatch, replica, want)


def post_send(comm: Comm, stage: int, peer: int, microbatch: int, replica: int) -> None:
    """``{stage}SEND{peer}:{microbatch}``: hand what the forward or backward left in the outbox to the transport.

    Never blocks (:meth:`~.comm.Comm.flush` waits, at ``LOSS``). Nothing left for a gradient message means
    nothing owed (no boundary tensor carries a gradient).

    Raises:
        RuntimeError: the forward left nothing to send (it did not run before the token).
    """
    src, dst, direction = message(stage, peer, send=True)
    left = comm.mail.outbox.pop((src, dst, direction, microbatch, replica), None)
    if left is None:
        if direction is Direction.FORWARD:
            raise RuntimeError(f"stage {stage} replica {replica}: nothing to send to stage {peer} for microbatch "
                               f"{microbatch}: its forward {stage}F{microbatch} must run before "
                               f"{stage}SEND{peer}:{microbatch}")
        return
    comm.send(src, dst, direction, microbatch, replica, *left)
