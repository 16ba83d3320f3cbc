"""The explicit actions lowering derives from a plan: transfers, regions, gradient collectives.

Codegen decides nothing: the plan says which stage runs each node, which
stages recompute, which nodes swap, how stages are replicated. Lowering turns
that into the actions below, each a frozen record that prints as a short
token and parses back (``0SEND1``, ``SWAP2``, ``ALLREDUCE(0,3)``), and the
stage graphs are built from them. The order each rank runs them in, per
microbatch (``0F3``, ``0SEND1:3``, ``1B3``, ``OPT0``), is the schedule's
lowering: :class:`hpml_compile.schedule.Action`, re-exported here.

Example:
    >>> t = Transfer(0, 1, ("add_2", "size"))
    >>> str(t), Transfer.parse("0SEND1").src
    ('0SEND1', 0)
    >>> g = GradSync(SyncKind.ALL_REDUCE, (0, 3), ("wte.weight",))
    >>> str(g), GradSync.parse(str(g)).stages
    ('ALLREDUCE(0,3)', (0, 3))
    >>> [(k.value, s) for k, s in map(parse_token, ("0RECV1", "SWAP1", "1SEND2", "ALLREDUCE(0,3)"))]
    [('RECV', (0, 1)), ('SWAP', (1,)), ('SEND', (1, 2)), ('ALLREDUCE', (0, 3))]
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from ..schedule import Action, ActionKind

__all__ = ["SyncKind", "TokenKind", "Transfer", "GradSync", "StageActions", "parse_token", "Action", "ActionKind"]

_TRANSFER = re.compile(r"^(\d+)SEND(\d+)$")
_SYNC = re.compile(r"^([A-Z]+)\((\d+(?:,\d+)*)\)$")
_POINT = re.compile(r"^(\d+)(SEND|RECV)(\d+)$")
_REGION = re.compile(r"^(SWAP|RECOMPUTE)(\d+)$")


class TokenKind(str, enum.Enum):
    """What an action token names."""

    SEND = "SEND"
    RECV = "RECV"
    SWAP = "SWAP"
    RECOMPUTE = "RECOMPUTE"
    ALL_REDUCE = "ALLREDUCE"
    REDUCE_SCATTER = "REDUCESCATTER"
    ALL_GATHER = "ALLGATHER"


def parse_token(token: str) -> tuple[TokenKind, tuple[int, ...]]:
    """The kind and stages of an action token (``0SEND1``, ``0RECV1``, ``SWAP2``, ``ALLREDUCE(0,3)``).

    Raises:
        ValueError: for text that is no action token.
    """
    if m := _POINT.match(token):
        return TokenKind(m.group(2)), (int(m.group(1)), int(m.group(3)))
    if m := _REGION.match(token):
        return TokenKind(m.group(1)), (int(m.group(2)),)
    if m := _SYNC.match(token):
        return TokenKind(m.group(1)), tuple(int(x) for x in m.group(2).split(","))
    raise ValueError(f"not an action token: {token!r} (expected e.g. '0SEND1', 'SWAP2' or 'ALLREDUCE(0,3)')")


class SyncKind(str, enum.Enum):
    """A collective over parameters or their gradients."""

    ALL_REDUCE = "ALLREDUCE"  # data parallel (ZeRO 0) and tied parameters: sum the gradients
    REDUCE_SCATTER = "REDUCESCATTER"  # ZeRO 1/2: each replica keeps the summed gradient of its shard
    ALL_GATHER = "ALLGATHER"  # ZeRO 1/2, after the optimizer step: every replica takes each owner's shard


@dataclass(frozen=True, slots=True)
class Transfer:
    """Boundary ``src -> src+1``: the fx values it carries, in order (their gradients go back).

    Attributes:
        src: the sending stage.
        dst: the receiving stage (``src + 1``: values skipping stages are relayed).
        values: fx node names; each is a tensor or a tuple/list of tensors.
    """

    src: int
    dst: int
    values: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.src}SEND{self.dst}"

    @classmethod
    def parse(cls, token: str) -> "Transfer":
        """The transfer a token names (its values are not part of the token)."""
        m = _TRANSFER.match(token)
        if not m:
            raise ValueError(f"not a transfer token: {token!r} (expected e.g. '0SEND1')")
        return cls(int(m.group(1)), int(m.group(2)), ())


@dataclass(frozen=True, slots=True)
class GradSync:
    """One collective over the parameters that ``stages`` share.

    Attributes:
        kind: which collective.
        stages: every rank running one of these stages takes part.
        params: canonical parameter names, in the order flattened on every rank.
    """

    kind: SyncKind
    stages: tuple[int, ...]
    params: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SyncKind(self.kind))

    def __str__(self) -> str:
        return f"{self.kind.value}({','.join(map(str, self.stages))})"

    @classmethod
    def parse(cls, token: str) -> "GradSync":
        """The collective a token names (its parameters are not part of the token)."""
        m = _SYNC.match(token)
        if not m:
            raise ValueError(f"not a collective token: {token!r} (expected e.g. 'ALLREDUCE(0,3)')")
        return cls(SyncKind(m.group(1)), tuple(int(x) for x in m.group(2).split(",")), ())


@dataclass(frozen=True, slots=True)
class StageActions:
    """Everything one stage does, as lowering derived it from the plan.

    Attributes:
        index: the stage.
        nodes: fx nodes the plan puts here that run here, in graph order
            (placeholders and attribute reads excluded: they are duplicated where used).
        inputs: model inputs (placeholders) this stage reads.
        remat: non-tensor values of earlier stages (``x.size(1)``) recomputed here, in order.
        recv: what arrives from the previous stage, or None.
        send: what leaves for the next stage, or None.
        recompute: run ``nodes`` under a checkpoint.
        swap: runs of consecutive ``nodes`` whose saved activations go to host memory.
        grad_sync: collectives after the last backward of a step.
        after_step: collectives after the optimizer step.
        local_params: canonical parameter name -> the name this stage binds it under.
    """

    index: int
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    remat: tuple[str, ...]
    recv: Transfer | None
    send: Transfer | None
    recompute: bool
    swap: tuple[tuple[str, ...], ...]
    grad_sync: tuple[GradSync, ...]
    after_step: tuple[GradSync, ...]
    local_params: tuple[tuple[str, str], ...] = ()

    def tokens(self) -> list[str]:
        """The stage's actions as short tokens, in execution order."""
        out = [str(self.recv).replace("SEND", "RECV")] if self.recv else []
        out += [f"RECOMPUTE{self.index}"] if self.recompute else []
        out += [f"SWAP{self.index}"] * (1 if self.swap else 0)
        out += [str(self.send)] if self.send else []
        out += [str(g) for g in (*self.grad_sync, *self.after_step)]
        return out
