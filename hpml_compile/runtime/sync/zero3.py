"""ZeRO-3 over a stage's replicas: only the owned shard of the parameters is held between uses.

A stage replicated over ``d`` ranks with ZeRO-3 (Rajbhandari et al., SC 2020)
runs with a :class:`FlatShard3`, a :class:`~.zero.FlatShard` whose flat
parameter buffer is *freed* between uses:

- the shard ``[r n, (r+1) n)`` of the flat buffer is a tensor of its own (the
  parameter the optimizer steps, ``n = ceil(N / d)`` elements), so the
  optimizer, its state and the update are over the shard only, as under
  ZeRO-1/2;
- the module's parameters stay views into the flat buffer, whose *storage* is
  resized to 0 bytes between uses (FSDP's ``_free_storage``): the views keep
  their shapes and names (checkpoints, the evaluation pass and the tied-stage
  all-reduce see ordinary parameters) but hold no memory;
- the stage's forward gathers it (a forward pre-hook: the storage is
  re-allocated and one all-gather of the replicas' shards fills it) and frees
  it after (a forward hook), for every microbatch;
- the all-gather is the communicator's (:meth:`.comm.DistComm.all_gather`):
  between the CPU ranks of one host it goes through their shared memory
  (:mod:`.shm`) straight into the flat buffer. Gloo's own all-gather stages
  the whole output in a temporary of its own, allocated and freed at every
  gather; with the flat buffer freed and re-allocated as often, ``malloc``'s
  heap fragmented, and a rank's resident set grew by several times the
  stage's parameters over the first steps (measured on the ``mlp`` zoo model,
  30 MiB of parameters on two CPU ranks: 697 MiB after the first step, 837
  after the fourth; 550-670 through shared memory, and the step about twice
  as fast). What fragmentation remains, from the flat buffer itself, is about
  one more gathered unit, which :func:`hpml_compile.memory.process_bytes`
  counts;
- the backward gathers it again before the first node of the stage's graph
  runs (a pre-hook on the ``grad_fn`` of each tensor the forward returned) and
  frees it when that backward ends (``queue_callback`` of the autograd engine,
  as FSDP does); a recomputed region (activation checkpointing) re-runs inside
  that backward, while the parameters are gathered;
- gradients accumulate into the flat gradient buffer over the step's
  microbatches, then one reduce-scatter leaves this replica its shard's summed
  gradient and the buffer is freed (as ZeRO-2; not overlapped with the
  backward); after the optimizer step nothing is all-gathered: the next
  forward gathers the new values.

Writing the gathered values must not bump the autograd version counter of the
parameters (autograd saved them, or views of them, for the backward): the
all-gather writes through a second tensor made with ``set_`` on the same
storage, which has a version counter of its own.

**The gathered unit is the whole stage.** The bytes a replica holds are its
shard of the parameters, gradients and optimizer state between uses, and at
the peak (during a microbatch's forward or backward) its shard *plus* the
whole stage's parameters and the whole flat gradient buffer: the memory model
(:func:`hpml_compile.stagecost.memory_parts`) counts ``P + P / d`` parameters
and ``P`` gradients, so ZeRO-3 lowers the peak only where the stage is split
into smaller units, which this module does not do. What it lowers is what is
held between uses (between a microbatch's forward and its backward, and
between steps: evaluation, checkpoints, the other stages' turn).

Why our own and not ``torch.distributed.fsdp.fully_shard`` (FSDP2): tried on
two gloo CPU ranks (torch 2.13), a whole generated stage as one FSDP2 unit
trains to the reference losses, but turns every parameter into a DTensor,
and the runtime's checkpoints (saved by original names, loaded under any
plan), the full state dict gathered across stages, the evaluation pass, the
retry snapshot and the tied-parameter all-reduce between stages all read
plain tensors; per-layer units fail (``TypeError`` in
``DeviceMesh._concatenate``) because generated stages bind some parameters
directly on container modules. A flat buffer whose storage is freed keeps the
parameters plain tensors and reuses the ZeRO-1/2 machinery of :mod:`.zero`
(shard, reduce-scatter, checkpoint by name) unchanged.

Example (one process, a stage "replicated" once: the shard is everything):
    >>> import torch
    >>> lin = torch.nn.Linear(3, 2)
    >>> want = lin(torch.ones(1, 3))
    >>> sh = FlatShard3(0, list(lin.parameters()), replicas=1, replica=0)
    >>> lin.weight.untyped_storage().nbytes()          # freed between uses
    0
    >>> hooks = sh.attach(lin)
    >>> torch.equal(lin(torch.ones(1, 3)), want), lin.weight.untyped_storage().nbytes()
    (True, 0)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from ...codegen.comm import Comm
from ...memory import ZeroStage
from .zero import FlatShard

__all__ = ["FlatShard3"]


class FlatShard3(FlatShard):
    """One stage's ZeRO-3 state on one replica (see the module docstring).

    Args:
        stage: the stage index.
        params: the stage's parameters to shard (not those tied to another stage), in the same order on every
            replica.
        replicas: ``d``.
        replica: this rank's replica index ``r``.

    Raises:
        HpmlError: parameters of different dtypes or devices, or none.
    """

    def __init__(self, stage: int, params: list[nn.Parameter], *, replicas: int, replica: int) -> None:
        super().__init__(stage, params, replicas=replicas, replica=replica, zero=ZeroStage.OS_G)
        self.zero = ZeroStage.OS_G_P
        self.param = nn.Parameter(self.flat[self.owned].clone())  # the shard owns its memory
        self._nbytes = self.flat.untyped_storage().nbytes()
        self.gathered = True
        self.gathers = 0  # all-gathers since the last reset_peak (a step's gathers, for held bytes at the peak)
        self._pending = False  # a backward holds the gathered parameters; its end frees them
        self._holds = 0  # open whole() blocks (they nest: a checkpoint inside Pipeline.whole)
        self.free()

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the whole stage's parameters while gathered (the flat buffer, padding included)."""
        return self._nbytes

    # -- gather and free --------------------------------------------------------------------------
    def _alias(self) -> Tensor:
        """The flat buffer through a tensor of its own version counter (see the module docstring)."""
        return torch.empty(0, dtype=self.flat.dtype, device=self.flat.device).set_(
            self.flat.untyped_storage(), 0, self.flat.shape, (1,))

    def gather(self) -> None:
        """Make the stage's parameters whole: re-allocate the flat buffer, all-gather the shards into it."""
        if self.gathered:
            return
        self.flat.untyped_storage().resize_(self._nbytes)
        alias = self._alias()
        with torch.no_grad():
            if self.replicas == 1:
                alias.copy_(self.param.detach())
            elif self.comm is not None:  # the rank's communicator: its transport, straight into the buffer
                out = self.comm.all_gather(self.stage, self.param.detach(), into=alias)
                if out.data_ptr() != alias.data_ptr():
                    alias.copy_(out)
            else:
                dist.all_gather(list(alias.chunk(self.replicas)), self.param.detach())
        self.gathered = True
        self.gathers += 1

    def free(self) -> None:
        """Let go of the whole parameters (their storage to 0 bytes); the shard stays."""
        if not self.gathered or self._pending or self._holds:
            return
        self.flat.untyped_storage().resize_(0)
        self.gathered = False

    def _backward_done(self) -> None:
        self._pending = False
        self.free()

    def _before_backward(self, *_: Any) -> None:
        self.gather()
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        """Gather around ``module``'s forward and again for its backward (see the module docstring)."""

        def pre(_m: nn.Module, _args: Any) -> None:
            self.gather()

        def post(_m: nn.Module, _args: Any, out: Any) -> None:
            if torch.is_grad_enabled():
                for t in tree_leaves(out):
                    if isinstance(t, Tensor) and t.grad_fn is not None:
                        t.grad_fn.register_prehook(self._before_backward)
            self.free()

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    @contextlib.contextmanager
    def whole(self, *, changed: bool = False) -> Iterator[None]:
        """The parameters gathered for the block (a collective); ``changed``: they were written (a checkpoint
        load), so this replica's shard takes its part of them after."""
        self.gather()
        self._holds += 1
        try:
            yield
        finally:
            if changed:
                with torch.no_grad():
                    self.param.copy_(self._alias()[self.owned])
            self._holds -= 1
            self.free()

    # -- the step -----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Zero the flat gradient buffer; parameters a failed attempt left gathered (its backward never ended,
        so its callback never ran) are freed."""
        super().begin_step()
        self._pending = False
        self.gathers = 0
        self.free()

    def forget(self) -> None:
        """A failed step: nothing is owed (no gather follows the optimizer step; each forward gathers anew)."""
        self._gathers.clear()

    def enable_overlap(self, *_: Any, **__: Any) -> None:
        """Not overlapped: the gradients are reduce-scattered once, after the step's last backward (a bucketed
        sync during the backward, as ZeRO-1/2 may have, is not combined with the gathers here, nor tested)."""

    def all_gather(self, comm: Comm) -> None:
        """After the optimizer step: nothing to gather (the next forward does); the shard's gradient is used up."""
        self.param.grad = None
