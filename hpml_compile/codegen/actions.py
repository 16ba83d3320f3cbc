"""The explicit actions lowering derives from a plan: transfers, regions, gradient collectives.

Codegen decides nothing: the plan says which stage runs each node, which
stages recompute, which nodes swap, how stages are replicated, and
:func:`hpml_compile.schedule.sync_impl` which implementation runs each
collective. Lowering turns that into the actions below, each a frozen record
that prints as a short token of the schedule's one grammar and parses back
(``0SEND1``, ``SWAP2``, ``ALLREDUCE.flat(0,3)``), and the stage graphs are
built from them. The order each rank runs them in, per microbatch (``0F3``,
``0SEND1:3``, ``1B3``, ``OPT0``), is the schedule's lowering:
:class:`hpml_compile.schedule.Action`, re-exported here. One enum names every
kind: :class:`~hpml_compile.schedule.ActionKind` (``TokenKind`` and
``SyncKind`` are its names here).

Example:
    >>> t = Transfer(0, 1, ("add_2", "size"))
    >>> str(t), Transfer.parse("0SEND1").src
    ('0SEND1', 0)
    >>> g = GradSync(SyncKind.ALL_REDUCE, (0, 3), ("wte.weight",), "hier")
    >>> str(g), GradSync.parse(str(g)).stages, GradSync.parse(str(g)).impl
    ('ALLREDUCE.hier(0,3)', (0, 3), 'hier')
    >>> [(k.value, s) for k, s in map(parse_token, ("0RECV1", "SWAP1", "1SEND2", "ALLREDUCE.flat(0,3)"))]
    [('RECV', (0, 1)), ('SWAP', (1,)), ('SEND', (1, 2)), ('ALLREDUCE', (0, 3))]
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule import COLLECTIVES, Action, ActionKind, parse_token

__all__ = ["SyncKind", "TokenKind", "Transfer", "GradSync", "StageActions", "parse_token", "Action", "ActionKind"]

TokenKind = ActionKind  # what a stage's summary token names
SyncKind = ActionKind  # a collective over parameters or their gradients: one of COLLECTIVES


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
        try:
            kind, stages = parse_token(token)
        except ValueError:
            kind, stages = ActionKind.RECV, ()
        if kind is not ActionKind.SEND or ":" in token:
            raise ValueError(f"not a transfer token: {token!r} (expected e.g. '0SEND1')")
        return cls(stages[0], stages[1], ())


@dataclass(frozen=True, slots=True)
class GradSync:
    """One collective over the parameters that ``stages`` share.

    Attributes:
        kind: which collective (one of :data:`~hpml_compile.schedule.COLLECTIVES`).
        stages: every rank running one of these stages takes part.
        params: canonical parameter names, in the order flattened on every rank.
        impl: the implementation that runs it (:func:`hpml_compile.schedule.sync_impl`; "" for none named).
    """

    kind: ActionKind
    stages: tuple[int, ...]
    params: tuple[str, ...]
    impl: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.kind not in COLLECTIVES:
            raise ValueError(f"{self.kind.value} is no collective (expected one of "
                             f"{', '.join(sorted(k.value for k in COLLECTIVES))})")

    def __str__(self) -> str:
        return str(Action(self.kind, self.stages, impl=self.impl))

    @classmethod
    def parse(cls, token: str) -> "GradSync":
        """The collective a token names (its parameters are not part of the token)."""
        try:
            a = Action.parse(token)
        except ValueError:
            a = Action(ActionKind.LOSS)
        if a.kind not in COLLECTIVES:
            raise ValueError(f"not a collective token: {token!r} (expected e.g. 'ALLREDUCE.flat(0,3)')")
        return cls(a.kind, a.stages, (), a.impl)


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
