"""The operations that generated stage code calls: send/recv, swap, recompute, gradient collectives.

Codegen inserts calls to these functions as nodes of each stage's graph (and
of its ``sync_grads``/``after_step`` methods); they carry out what the plan
says and decide nothing. Each stage module holds a :class:`Comm` (set by the
executor as ``stage.hpml_comm``) that moves the tensors: a local mailbox in
one process, ``torch.distributed`` point-to-point and collectives across
ranks. Nothing here keeps module-level state: counters live on the objects
the stage owns.

- :func:`recv` / :func:`send`: a stage boundary carries a tuple of tensors.
  Both are autograd functions, so the backward pass sends the gradients of
  what was received back to the sender and receives the gradients of what was
  sent; only floating-point tensors carry gradients. ``send`` returns a
  scalar token: calling ``backward()`` on a stage's tokens runs its backward.
- :func:`swap`: runs a region with ``saved_tensors_hooks`` that copy every
  activation autograd saves to host memory (pinned, on a side CUDA stream so
  that the copy overlaps compute) when it is saved, and back to the device
  when the backward pass unpacks it. The device copy is freed after its last
  forward use. On a CPU the same copies run and are counted.
- :func:`checkpoint`: runs a region under ``torch.utils.checkpoint`` (non
  reentrant); the recomputation in backward leaves buffers (BatchNorm running
  statistics) as the first forward left them.
- :func:`all_reduce_grads`, :func:`reduce_scatter_grads`,
  :func:`all_gather_params`: gradient synchronisation of replicated stages
  and of parameters shared by several stages (tied embeddings).

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

import abc
import contextlib
import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

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
    "all_reduce_grads",
    "reduce_scatter_grads",
    "all_gather_params",
]

# One tensor crossing a boundary, as generated code spells it: (shape, dtype).
TensorSpec = tuple[tuple[int, ...], torch.dtype]


class Direction(str, enum.Enum):
    """Which way a message goes along a boundary ``src -> dst`` (``src`` is the earlier stage)."""

    FORWARD = "fwd"  # activations, src -> dst
    BACKWARD = "bwd"  # their gradients, dst -> src


def carries_grad(spec: TensorSpec) -> bool:
    """Whether a boundary tensor gets a gradient message back (floating-point ones do)."""
    return spec[1].is_floating_point or spec[1].is_complex


class Comm(abc.ABC):
    """Moves tensors between stages; an executor gives each stage module one (``stage.hpml_comm``).

    ``microbatch`` is set by the executor before each forward call; the
    autograd functions remember it for their backward.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.microbatch = 0
        self.device = torch.device(device)
        # Gradients a stage owes its sender for tensors it received: (src, dst, microbatch) -> specs.
        self._owed: dict[tuple[int, int, int], tuple[TensorSpec, ...]] = {}

    @abc.abstractmethod
    def send(self, src: int, dst: int, direction: Direction, microbatch: int, tensors: Sequence[Tensor]) -> None:
        """Send ``tensors`` along boundary ``src -> dst`` in ``direction`` (must not block on the peer)."""

    @abc.abstractmethod
    def recv(self, src: int, dst: int, direction: Direction, microbatch: int,
             specs: Sequence[TensorSpec]) -> list[Tensor]:
        """Receive tensors of ``specs`` along boundary ``src -> dst`` in ``direction`` (blocks)."""

    @abc.abstractmethod
    def all_reduce(self, stages: tuple[int, ...], flat: Tensor) -> None:
        """Sum ``flat`` in place over every rank running one of ``stages``."""

    @abc.abstractmethod
    def reduce_scatter(self, stage: int, flat: Tensor) -> Tensor:
        """Sum ``flat`` (length divisible by the replicas) over ``stage``'s replicas; return this replica's shard."""

    @abc.abstractmethod
    def all_gather(self, stage: int, shard: Tensor) -> Tensor:
        """Concatenate every replica's ``shard`` of ``stage`` in replica order."""

    @abc.abstractmethod
    def replicas(self, stage: int) -> tuple[int, int]:
        """``(this process's replica index, number of replicas)`` of ``stage``."""

    def owe(self, src: int, dst: int, microbatch: int, specs: tuple[TensorSpec, ...]) -> None:
        """Record that stage ``dst`` must send gradients for what it received from ``src``."""
        self._owed[(src, dst, microbatch)] = specs

    def repay(self, src: int, dst: int, microbatch: int, grads: Sequence[Tensor]) -> None:
        """Send the gradients owed for a received tuple (called by the backward of :func:`recv`)."""
        self._owed.pop((src, dst, microbatch), None)
        self.send(src, dst, Direction.BACKWARD, microbatch, grads)

    def settle(self, dst: int, microbatch: int) -> None:
        """After stage ``dst``'s backward of ``microbatch``: send zero gradients still owed.

        A received tensor that no path to the loss uses never sees a backward
        call; its sender still waits for a gradient, which is zero.
        """
        for key in [k for k in self._owed if k[1] == dst and k[2] == microbatch]:
            specs = self._owed.pop(key)
            zeros = [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in specs if carries_grad((shape, dtype))]
            self.send(key[0], key[1], Direction.BACKWARD, microbatch, zeros)

    def flush(self) -> None:
        """Wait for every message this process has sent (called at the end of a step)."""


class DetachedComm(Comm):
    """The comm of a stage no executor has attached yet: any message is an error saying what to do."""

    def _fail(self, *_: Any) -> Any:
        raise RuntimeError("this stage module has no communicator: run it through "
                           "hpml_compile.runtime.executor (which sets stage.hpml_comm), not by calling it directly")

    send = recv = all_reduce = reduce_scatter = all_gather = _fail  # type: ignore[assignment]

    def replicas(self, stage: int) -> tuple[int, int]:
        return 0, 1


def _anchor() -> Tensor:
    # An autograd function records a backward node only if one of its inputs
    # requires grad; a fresh scalar makes sure recv/send always get one.
    return torch.zeros((), requires_grad=True)


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: Tensor, comm: Comm, src: int, dst: int,  # type: ignore[override]
                specs: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
        mb = comm.microbatch
        tensors = comm.recv(src, dst, Direction.FORWARD, mb, specs)
        ctx.comm, ctx.src, ctx.dst, ctx.mb, ctx.specs = comm, src, dst, mb, specs
        if any(carries_grad(s) for s in specs):
            comm.owe(src, dst, mb, specs)
        ctx.mark_non_differentiable(*[t for t, s in zip(tensors, specs) if not carries_grad(s)])
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, ...]:
        out = [g if g is not None else torch.zeros(s[0], dtype=s[1], device=ctx.comm.device)
               for g, s in zip(grads, ctx.specs) if carries_grad(s)]
        ctx.comm.repay(ctx.src, ctx.dst, ctx.mb, [g.contiguous() for g in out])
        return (None,) * 5


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: Tensor, comm: Comm, src: int, dst: int,  # type: ignore[override]
                specs: tuple[TensorSpec, ...], *tensors: Tensor) -> Tensor:
        mb = comm.microbatch
        for t, (shape, dtype) in zip(tensors, specs):
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise RuntimeError(f"send {src}->{dst}: tensor of shape {tuple(t.shape)} {t.dtype}, but the build "
                                   f"expects {tuple(shape)} {dtype}: feed microbatches of the shapes the build "
                                   "was generated for (see manifest.json 'inputs')")
        comm.send(src, dst, Direction.FORWARD, mb, [t.detach().contiguous() for t in tensors])
        ctx.comm, ctx.src, ctx.dst, ctx.mb, ctx.specs = comm, src, dst, mb, specs
        return anchor.new_zeros(())  # the token: autograd links it to this function's backward

    @staticmethod
    def backward(ctx: Any, _token_grad: Tensor) -> tuple[Tensor | None, ...]:
        wanted = [s for s in ctx.specs if carries_grad(s)]
        got = iter(ctx.comm.recv(ctx.src, ctx.dst, Direction.BACKWARD, ctx.mb, wanted))
        grads = [next(got) if carries_grad(s) else None for s in ctx.specs]
        return (None, None, None, None, None, *grads)


def recv(comm: Comm, src: int, dst: int, specs: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    """Receive the tuple that boundary ``src -> dst`` carries for the current microbatch.

    Args:
        comm: the stage's communicator.
        src: the sending (earlier) stage.
        dst: this stage.
        specs: ``(shape, dtype)`` of each tensor, from the trace at microbatch size.

    Returns:
        The tensors; floating-point ones require grad, and their gradients go
        back to ``src`` in the backward pass.
    """
    return _Recv.apply(_anchor(), comm, src, dst, tuple(specs))


def send(comm: Comm, src: int, dst: int, specs: tuple[TensorSpec, ...], tensors: Sequence[Tensor]) -> Tensor:
    """Send ``tensors`` along boundary ``src -> dst`` for the current microbatch.

    Args:
        comm: the stage's communicator.
        src: this stage.
        dst: the receiving (next) stage.
        specs: ``(shape, dtype)`` of each tensor (checked before sending).
        tensors: what the boundary carries, in the receiver's order.

    Returns:
        A scalar token; its backward receives the gradients of ``tensors``
        from ``dst`` and passes them on into this stage's graph.
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


def _flat_grads(params: Sequence[Tensor]) -> Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def _write_grads(params: Sequence[Tensor], flat: Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def all_reduce_grads(comm: Comm, stages: tuple[int, ...], params: Sequence[Tensor]) -> None:
    """Sum the gradients of ``params`` over every rank running one of ``stages``.

    Args:
        comm: the stage's communicator.
        stages: the stages holding these parameters (replicas of one stage, or
            the stages sharing a tied parameter).
        params: the parameters, in the same order on every rank.
    """
    if not params:
        return
    flat = _flat_grads(params)
    comm.all_reduce(stages, flat)
    _write_grads(params, flat)


def _padded(flat: Tensor, parts: int) -> Tensor:
    pad = (-flat.numel()) % parts
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


def reduce_scatter_grads(comm: Comm, stage: int, params: Sequence[Tensor]) -> None:
    """ZeRO-2/3 gradient sync: each replica keeps the summed gradient of its shard, zero elsewhere.

    The parameters are flattened in order and cut into as many equal shards
    as the stage has replicas; replica ``r`` owns shard ``r``.

    Args:
        comm: the stage's communicator.
        stage: the replicated stage.
        params: its parameters, in the same order on every replica.
    """
    me, d = comm.replicas(stage)
    if not params or d == 1:
        return
    flat = _padded(_flat_grads(params), d)
    shard = comm.reduce_scatter(stage, flat)
    out = torch.zeros_like(flat)
    n = flat.numel() // d
    out[me * n:(me + 1) * n] = shard
    _write_grads(params, out)


def all_gather_params(comm: Comm, stage: int, params: Sequence[Tensor]) -> None:
    """After the optimizer step under ZeRO-2/3: every replica takes each shard's owner's values.

    Args:
        comm: the stage's communicator.
        stage: the replicated stage.
        params: its parameters, in the order of :func:`reduce_scatter_grads`.
    """
    me, d = comm.replicas(stage)
    if not params or d == 1:
        return
    with torch.no_grad():
        flat = _padded(torch.cat([p.detach().reshape(-1) for p in params]), d)
        n = flat.numel() // d
        full = comm.all_gather(stage, flat[me * n:(me + 1) * n].contiguous())
        offset = 0
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
