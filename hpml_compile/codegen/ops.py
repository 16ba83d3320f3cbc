"""The operations that generated stage code calls: send/recv, swap, recompute.

Codegen inserts calls to these functions as nodes of each stage's graph;
they carry out what the plan
says and decide nothing. Each stage module holds a :class:`~.comm.Comm` (set
by the executor as ``stage.hpml_comm``), whose mailbox its ``recv``/``send``
nodes take from and leave in, and which the executor's RECV and SEND tokens
move the tensors with: a local mailbox in one process, ``torch.distributed``
point-to-point across ranks; :mod:`.comm` says how a boundary between stages
of different replica counts is resharded. Nothing here keeps module-level state: counters
live on the objects the stage owns.

- :func:`recv` / :func:`send`: a stage boundary carries a tuple of tensors.
  Both are autograd functions: the stage's boundaries in its graph. They
  move nothing themselves: they take what the executor's ``kRECVp:j`` token
  received and leave what the ``kSENDp:j`` token sends, in the communicator's
  mailbox (:mod:`.mailbox`), so the backward pass leaves the gradients of
  what was received for the sender and takes the gradients of what was
  sent; only floating-point tensors carry gradients (zeros for a received
  tensor no path to the loss uses). ``send`` returns a scalar token: calling
  ``backward()`` on a stage's tokens runs its backward. A floating tensor
  crosses in its spec's dtype (the compute dtype under mixed precision,
  :mod:`hpml_compile.precision`), and its gradient comes back in it and is
  cast to the dtype the sender had.
- :func:`swap`: runs a region with ``saved_tensors_hooks`` that copy every
  activation autograd saves to host memory (pinned, on a side CUDA stream so
  that the copy overlaps compute) when it is saved, and back to the device
  when the backward pass unpacks it. The device copy is freed after its last
  forward use. On a CPU the same copies run and are counted.
- :func:`checkpoint`: runs a region under ``torch.utils.checkpoint`` (non
  reentrant); the recomputation in backward leaves buffers (BatchNorm running
  statistics) as the first forward left them.

The collectives of replicated stages and of parameters shared by several
stages (tied embeddings) are no stage code: a stage lists them
(``COLLECTIVES``) and the executor hands each token to its sync
(:mod:`hpml_compile.runtime.sync.stage`).

Example:
    >>> import torch
    >>> stats = SwapStats()
    >>> w = torch.randn(4, 4, requires_grad=True)
    >>> y = swap(stats, lambda x: (x @ w).tanh().sum(), torch.randn(2, 4))
    >>> y.backward()
    >>> stats.tensors_out == stats.tensors_in > 0, stats.bytes_out == stats.bytes_in
    (True, True)
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from .comm import Comm, DetachedComm, Direction, TensorSpec, carries_grad
from .tpops import tp_copy, tp_embedding, tp_head, tp_row  # noqa: F401 -- spelt ops.tp_* in stage code

__all__ = [
    "Direction",
    "TensorSpec",
    "Comm",
    "DetachedComm",
    "SwapStats",
    "recv",
    "send",
    "swap",
    "checkpoint",
]


_BREAKS = ("recv", "send", "swap", "checkpoint")


def break_graphs() -> None:
    """Make ``recv``, ``send``, ``swap`` and ``checkpoint`` execute as written inside a compiled stage.

    Communication, recompute and swap are Python around torch calls that a compiled graph cannot hold:
    ``torch.compile`` breaks the stage's graph at each, and the pieces between them compile
    (:mod:`hpml_compile.runtime.execute.compiled`, which calls this before it compiles a stage). Done then,
    not at import, since marking imports ``torch._dynamo`` (seconds), which an uncompiled run never needs;
    the generated code reads ``ops.<name>`` at each call, so it finds the marked function. Once marked, a call
    costs under a microsecond more (a few calls per microbatch, none per op).
    """
    here = globals()
    for name in _BREAKS:
        fn = here[name]
        if not getattr(fn, "hpml_breaks", False):
            marked = torch.compiler.disable(fn, recursive=True)
            marked.hpml_breaks = True  # type: ignore[attr-defined]
            here[name] = marked


def _anchor() -> Tensor:
    # An autograd function records a backward node only if one of its inputs
    # requires grad; a fresh scalar makes sure recv/send always get one.
    return torch.zeros((), requires_grad=True)


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: Tensor, comm: Comm, src: int,  # type: ignore[override]
                dst: int) -> tuple[Tensor, ...]:
        mb, rep = comm.microbatch, comm.replica
        tensors, specs = comm.mail.take((src, dst, Direction.FORWARD, mb, rep))  # the RECV token's
        ctx.comm, ctx.src, ctx.dst, ctx.mb, ctx.rep, ctx.specs = comm, src, dst, mb, rep, specs
        if any(carries_grad(s) for s in specs):
            comm.owe(src, dst, rep, mb, specs)
        ctx.mark_non_differentiable(*[t for t, s in zip(tensors, specs) if not carries_grad(s)])
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, ...]:
        out = [g.to(s[1]).contiguous() if g is not None else torch.zeros(s[0], dtype=s[1], device=ctx.comm.device)
               for g, s in zip(grads, ctx.specs) if carries_grad(s)]
        ctx.comm.repay(ctx.src, ctx.dst, ctx.rep, ctx.mb, out)  # left for the SEND token
        return (None,) * 4


class _Send(torch.autograd.Function):
    SENDS = True  # how hpml_compile.backsplit knows a send's backward (it sits below the code generator)

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, comm: Comm, src: int, dst: int,  # type: ignore[override]
                specs: tuple[TensorSpec, ...], *tensors: Tensor) -> Tensor:
        mb, rep = comm.microbatch, comm.replica
        specs = comm.shaped(src, rep, specs)  # this replica's rows (uneven data parallelism)
        wire = []
        for t, (shape, dtype, _) in zip(tensors, specs):
            if tuple(t.shape) != tuple(shape) or (t.dtype != dtype and not (
                    t.dtype.is_floating_point and dtype.is_floating_point)):
                raise RuntimeError(f"send {src}->{dst}: tensor of shape {tuple(t.shape)} {t.dtype}, but the build "
                                   f"expects {tuple(shape)} {dtype}: feed microbatches of the shapes the build "
                                   "was generated for (see manifest.json 'inputs')")
            # a floating tensor crosses in the spec's dtype: the compute dtype under mixed precision, whatever
            # dtype autocast left it in (a norm's fp32 output goes as bf16)
            wire.append(t.detach().to(dtype).contiguous())
        comm.mail.leave((src, dst, Direction.FORWARD, mb, rep), wire, specs)  # for the SEND token
        comm.mail.sent[(src, dst, mb, rep)] = specs  # their gradients come back at the RECV token before backward
        ctx.comm, ctx.src, ctx.dst, ctx.mb, ctx.rep, ctx.specs = comm, src, dst, mb, rep, specs
        ctx.dtypes = [t.dtype for t in tensors]
        return anchor.new_zeros(())  # the token: autograd links it to this function's backward

    @staticmethod
    def backward(ctx: Any, _token_grad: Tensor) -> tuple[Tensor | None, ...]:
        got = iter(ctx.comm.mail.take((ctx.src, ctx.dst, Direction.BACKWARD, ctx.mb, ctx.rep))[0])
        grads = [next(got).to(d) if carries_grad(s) else None for s, d in zip(ctx.specs, ctx.dtypes)]
        return (None, None, None, None, None, *grads)


def recv(comm: Comm, src: int, dst: int) -> tuple[Tensor, ...]:
    """The tuple that boundary ``src -> dst`` carries for the current microbatch, as the stage's ``dstRECVsrc:j``
    token received it (:mod:`.mailbox`; shapes: the stage's ``RECV`` specs at this replica's rows).

    Args:
        comm: the stage's communicator.
        src: the sending (earlier) stage.
        dst: this stage.

    Returns:
        The tensors; floating-point ones require grad, and their gradients are left for the stage's
        ``dstSENDsrc:j`` token to send back in the backward pass.
    """
    return _Recv.apply(_anchor(), comm, src, dst)


def send(comm: Comm, src: int, dst: int, specs: tuple[TensorSpec, ...], tensors: Sequence[Tensor]) -> Tensor:
    """Leave ``tensors`` for the stage's ``srcSENDdst:j`` token to send along boundary ``src -> dst``.

    Args:
        comm: the stage's communicator.
        src: this stage.
        dst: the receiving (next) stage.
        specs: ``(shape, dtype, batch dim)`` of each tensor on this replica (checked before sending).
        tensors: what the boundary carries, in the receiver's order.

    Returns:
        A scalar token; its backward takes the gradients of ``tensors`` that the stage's ``srcRECVdst:j``
        token received and passes them on into this stage's graph.
    """
    return _Send.apply(_anchor(), comm, src, dst, tuple(specs), *tensors)


@dataclass
class _Swapped:
    """An activation parked in host memory until the backward pass needs it."""

    host: Tensor
    device: torch.device
    ready: Any = None  # a CUDA event recorded after the device-to-host copy


@dataclass
class SwapStats:
    """Swap traffic of one stage, and the pack/unpack hooks that make it.

    Attributes:
        bytes_out: bytes copied to host memory (swap-out).
        bytes_in: bytes copied back for the backward pass (swap-in).
        tensors_out: activations swapped out.
        tensors_in: activations swapped in.
    """

    bytes_out: int = 0
    bytes_in: int = 0
    tensors_out: int = 0
    tensors_in: int = 0
    _streams: dict[torch.device, Any] = field(default_factory=dict, repr=False)

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def pack(self, t: Tensor, keep: frozenset[int]) -> Any:
        """Swap-out hook: copy ``t`` to host memory, unless it is a parameter or buffer (``keep``)."""
        if t.untyped_storage().data_ptr() in keep or t.numel() == 0:
            return t  # weights stay where they are; swapping them would only cost traffic
        nbytes = t.numel() * t.element_size()
        self.bytes_out += nbytes
        self.tensors_out += 1
        if t.is_cuda:
            stream = self._side_stream(t.device)
            host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
            # The copy waits for the kernel that produced t, then overlaps the compute that follows.
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)  # t's memory is not reused before the copy ends
                ready = torch.cuda.Event()
                ready.record(stream)
            return _Swapped(host, t.device, ready)
        host = torch.empty(t.size(), dtype=t.dtype)
        host.copy_(t)
        return _Swapped(host, t.device)

    def unpack(self, packed: Any) -> Tensor:
        """Swap-in hook: bring a swapped activation back to its device."""
        if not isinstance(packed, _Swapped):
            return packed
        self.bytes_in += packed.host.numel() * packed.host.element_size()
        self.tensors_in += 1
        if packed.device.type == "cuda":
            torch.cuda.current_stream(packed.device).wait_event(packed.ready)
            return packed.host.to(packed.device, non_blocking=True)
        return packed.host

    @contextlib.contextmanager
    def region(self, owner: Any) -> Iterator[None]:
        """Swap every activation saved inside the ``with`` block (``owner``'s weights excepted)."""
        keep = frozenset(_storage_ptrs(owner))
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(self.pack, keep=keep), self.unpack):
            yield


def _storage_ptrs(owner: Any) -> Iterator[int]:
    if isinstance(owner, nn.Module):
        for t in (*owner.parameters(), *owner.buffers()):
            yield t.untyped_storage().data_ptr()


def swap(stats: SwapStats, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` with its saved activations swapped to host memory.

    Args:
        stats: the stage's swap counters (``stage.hpml_swap``).
        fn: the region (a submodule of the stage).
        args: its inputs.

    Returns:
        What ``fn`` returns.
    """
    with stats.region(fn):
        return fn(*args)


class _BuffersKept:
    """Context manager: buffers of ``module`` are put back on exit (recomputation must not update them twice)."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self._saved: list[tuple[Tensor, Tensor]] = []

    def __enter__(self) -> None:
        if isinstance(self._module, nn.Module):
            self._saved = [(b, b.detach().clone()) for b in self._module.buffers()]

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for b, old in self._saved:
                b.copy_(old)


def checkpoint(fn: Callable[..., Any], *args: Any, swap: SwapStats | None = None) -> Any:
    """Run ``fn(*args)`` keeping only its inputs; recompute it during backward.

    Args:
        fn: the region (a submodule of the stage).
        args: its inputs.
        swap: also swap what the checkpoint saves (its inputs) to host memory.

    Returns:
        What ``fn`` returns.
    """
    def contexts() -> tuple[Any, Any]:
        return contextlib.nullcontext(), _BuffersKept(fn)

    outer = swap.region(fn) if swap is not None else contextlib.nullcontext()
    with outer:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=contexts,
                                                 preserve_rng_state=True)
