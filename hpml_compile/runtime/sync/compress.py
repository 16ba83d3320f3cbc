"""Gradient compression and local SGD on a replicated stage's flat gradient (ZeRO-0).

A replicated stage without ZeRO keeps its gradients in one flat buffer
(:class:`.zero.FlatGrads`) that is summed over its replicas after the last
backward. Where the plan says so, a *reducer* from this module does that sum
instead (one call, ``FlatGrads.all_reduce -> reducer.reduce``):

- :class:`TopK` (``Stage.compress = "topk:RATIO"``): Top-K sparsification with
  error feedback (Stich et al., NeurIPS 2018; Lin et al., ICLR 2018). Each
  replica adds the error it kept to its gradient, sends the ``k`` entries of
  largest magnitude (values and int32 indices) in one all-gather each, and keeps
  the rest as its new error; every replica scatter-adds the ``d k`` pairs into
  the same sum. Written here because torch ships no Top-K hook.
- :class:`PowerSGD` (``Stage.compress = "powersgd:RANK"``): torch's own
  (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``, Vogels et
  al., NeurIPS 2019): its :class:`PowerSGDState` (error feedback, warm start,
  the per-step random seed) and its ``powerSGD_hook`` run unchanged. The hook
  takes a DDP ``GradBucket``, which only DDP's reducer constructs; our runtime
  is not DDP, so :class:`_Bucket` gives the hook the five methods it calls on
  one (``buffer``, ``index``, ``gradients``, ``parameters``, ``is_last``) over
  our flat buffer, and we wait on the future it returns. What we add is the
  scaling: the hook averages (DDP's convention), our buffer is summed (the loss
  of a slice is already scaled by ``1 / replicas``), so the buffer is
  multiplied by ``d`` first. The hook runs plain all-reduce for its first
  ``start_powerSGD_iter`` steps, which torch requires to be >= 2 with error
  feedback; we use 2.
- :class:`LocalSGD` (``Plan.sync_every = H > 1``): post-local SGD (Lin et al.,
  ICLR 2020). For ``Plan.sync_warmup`` steps the gradients are all-reduced as
  in plain data parallelism; after that each replica steps on its own
  gradient (its slice's mean: the buffer times ``d``) and the replicas average
  their parameters after every ``H``-th local optimizer step with torch's
  ``average_parameters`` (``torch.distributed.algorithms.model_averaging.utils``).
  torch's :class:`PeriodicModelAverager` schedule is not used: it averages on
  the first local step (its ``step == warmup_steps``) and keeps its own count,
  where ours follows the run's step count so that a resumed run keeps the
  phase. DDP's ``post_localSGD_hook`` is the gradient half, the three lines of
  :meth:`LocalSGD.reduce` here (for the same GradBucket reason).
  ``H = 1`` is never a LocalSGD: a plan with ``sync_every = 1`` runs plain data
  parallelism (same code, so the same numbers). Buffers (BatchNorm's running
  statistics) are not averaged; each replica keeps its own.

What each sends is counted per step (``sent``: the payload this rank put into
the collectives; ``dense``: what the uncompressed all-reduce would have put),
which the monitor records as ``sync_bytes`` / ``sync_dense_bytes``.

Error-feedback state lives per rank (``state_dict`` / ``load_state_dict``:
plain tensors, no pickle; :meth:`Reducer.residual` in gradient-sum units), and
checkpoints carry it (:mod:`.feedback`), so that a resumed run goes on with
the error it had. Local SGD keeps no state of its own (its schedule follows
the resumed step count), but its replicas' parameters, buffers and optimizer
state differ between two averages (``diverges``): a checkpoint keeps every
replica's copy and each replica resumes from its own, so a run resumed
between two averages goes on as the uninterrupted one, bit for bit; under
another replica count, or a plan without local SGD, the ranks start from the
replicas' average and the resume says so (:mod:`.feedback` says why this
design). A retried step (a transient communication failure) may leave
PowerSGD's warm-start factors from the failed attempt; the gradient it
recomputes is the same.

Example (one process: the collectives of a group of one):
    >>> import torch
    >>> t = TopK(ratio=0.25, replicas=1)
    >>> g = torch.tensor([0.1, -2.0, 0.3, 1.0])
    >>> out = t.compress_local(g.clone())
    >>> out.tolist(), t.error.tolist()  # one entry of four sent; the rest kept for the next step
    ([0.0, -2.0, 0.0, 0.0], [0.10000000149011612, 0.0, 0.30000001192092896, 1.0])
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from ...compression import INDEX_BYTES, CompressKind, Compression
from ...errors import HpmlError

__all__ = ["Reducer", "TopK", "PowerSGD", "LocalSGD", "make_reducer"]


class Reducer:
    """What replaces the in-place all-reduce of a stage's flat gradient (see the module docstring).

    Attributes:
        replicas: the stage's data-parallel degree ``d``.
        sent: payload bytes this rank put into the gradient collectives this step.
        dense: what the uncompressed all-reduce would have put.
    """

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.step = 0
        self.sent = self.dense = 0

    def begin_step(self, step: int) -> None:
        """Called before each step's backward, with the number of steps done before it."""
        self.step = step
        self.sent = self.dense = 0

    def reduce(self, comm: Any, stage: int, flat: Tensor, params: Sequence[nn.Parameter]) -> None:
        """Leave in ``flat`` what the optimizer steps on (the replicas' sum, or its estimate)."""
        raise NotImplementedError

    def after_step(self, params: Sequence[nn.Parameter]) -> None:
        """After the optimizer step (local SGD averages parameters here)."""

    def rebind(self, group: Any) -> None:
        """The stage's process group was re-formed (a retried step): collectives go to ``group`` from now on.
        A reducer that kept the old group would also keep its gloo context alive, whose open sockets can keep a
        peer's pending collective on it from failing."""

    def state_dict(self) -> dict[str, Tensor]:
        """Per-rank state as plain tensors."""
        return {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Take back :meth:`state_dict`."""

    keeps_error = False  # whether it carries an error from step to step (what a checkpoint must keep)
    diverges = False  # whether the replicas' parameters and optimizer state differ between steps (local SGD)

    def residual(self) -> Tensor | None:
        """The error this replica still owes the replicas' sum, over the flat gradient, in gradient-sum units
        (None: none kept yet)."""
        return None

    def set_residual(self, flat: Tensor) -> None:
        """Take back :meth:`residual` (a checkpoint's)."""

    def layout_state(self) -> dict[str, Tensor]:
        """State whose layout follows the stage's parameters (PowerSGD's step count and factors)."""
        return {}

    def load_layout_state(self, state: Mapping[str, Tensor]) -> None:
        """Take back :meth:`layout_state`."""


class TopK(Reducer):
    """Top-K sparsification with error feedback (module docstring).

    Args:
        ratio: the share of entries each replica sends, ``0 < ratio < 1``.
        replicas: ``d``.
    """

    def __init__(self, ratio: float, replicas: int) -> None:
        super().__init__(replicas)
        self.ratio = ratio
        self.error: Tensor | None = None

    def _select(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(acc, values, indices)``: the gradient plus the kept error, and its ``k`` largest entries."""
        if self.error is None or self.error.shape != flat.shape:
            self.error = torch.zeros_like(flat)
        acc = flat.add(self.error)
        k = max(1, math.ceil(self.ratio * acc.numel()))
        idx = acc.abs().topk(k, sorted=False).indices
        return acc, acc[idx], idx.to(torch.int32)

    def _keep(self, acc: Tensor, idx: Tensor) -> None:
        acc[idx.long()] = 0
        self.error = acc

    def compress_local(self, flat: Tensor) -> Tensor:
        """One replica's round trip without a collective: what it sends, densified (for tests and docs)."""
        acc, vals, idx = self._select(flat)
        out = torch.zeros_like(flat)
        out[idx.long()] = vals
        self._keep(acc, idx)
        return out

    def reduce(self, comm: Any, stage: int, flat: Tensor, params: Sequence[nn.Parameter]) -> None:
        acc, vals, idx = self._select(flat)
        all_vals = comm.all_gather(stage, vals)
        all_idx = comm.all_gather(stage, idx)
        self._keep(acc, idx)  # only once the collectives went through (a failed step is retried from scratch)
        flat.zero_()
        flat.index_add_(0, all_idx.long().to(flat.device), all_vals.to(flat.device))
        self.sent += vals.numel() * (vals.element_size() + INDEX_BYTES)
        self.dense += flat.numel() * flat.element_size()

    keeps_error = True

    def residual(self) -> Tensor | None:
        return self.error  # the replicas' slices are already 1/d-scaled to be summed: gradient-sum units

    def set_residual(self, flat: Tensor) -> None:
        self.error = flat.clone()

    def state_dict(self) -> dict[str, Tensor]:
        return {} if self.error is None else {"error": self.error.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if "error" in state:
            self.error = state["error"].clone()


class _Bucket:
    """The part of ``torch.distributed.GradBucket`` that ``powerSGD_hook`` calls, over one flat buffer."""

    def __init__(self, flat: Tensor, params: Sequence[nn.Parameter]) -> None:
        self._flat, self._params = flat, list(params)

    def buffer(self) -> Tensor:
        return self._flat

    def index(self) -> int:
        return 0  # one bucket per stage: the key of its error and warm-start factors in PowerSGDState

    def is_last(self) -> bool:
        return True  # the hook's step counter advances once per step

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def gradients(self) -> list[Tensor]:
        out, offset = [], 0
        for p in self._params:
            out.append(self._flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return out


class PowerSGD(Reducer):
    """torch's PowerSGD hook over the stage's flat gradient (module docstring).

    Args:
        rank: the approximation rank.
        replicas: ``d``.
        group: the stage's process group.
        seed: PowerSGD's random seed (the same on every replica).
    """

    START = 2  # plain all-reduce steps first: torch requires >= 2 with error feedback and warm start

    def __init__(self, rank: int, replicas: int, group: Any, seed: int = 0) -> None:
        super().__init__(replicas)
        self.rank = rank
        self.state = PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=self.START, min_compression_rate=2, use_error_feedback=True,
                                   warm_start=True, random_seed=seed)

    def rebind(self, group: Any) -> None:
        self.state.process_group = group

    def reduce(self, comm: Any, stage: int, flat: Tensor, params: Sequence[nn.Parameter]) -> None:
        before = (self.state.total_numel_before_compression, self.state.total_numel_after_compression)
        plain = self.state.iter < self.state.start_powerSGD_iter
        flat.mul_(self.replicas)  # the hook averages; our buffer holds 1/d-scaled slices to be summed
        out = powerSGD_hook(self.state, _Bucket(flat, params)).wait()  # type: ignore[arg-type]
        if out is not flat:
            flat.copy_(out[0] if isinstance(out, (list, tuple)) else out)
        if plain:
            self.sent += flat.numel() * flat.element_size()
        else:
            self.sent += (self.state.total_numel_after_compression - before[1]) * flat.element_size()
        self.dense += flat.numel() * flat.element_size()

    keeps_error = True

    def residual(self) -> Tensor | None:
        err = self.state.error_dict.get(0)
        return None if err is None else err / self.replicas  # the hook keeps it in d-times units (see reduce)

    def set_residual(self, flat: Tensor) -> None:
        self.state.error_dict[0] = flat * self.replicas

    def layout_state(self) -> dict[str, Tensor]:
        out = {"iter": torch.tensor(self.state.iter)}
        for name, d in (("p", self.state.p_memory_dict), ("q", self.state.q_memory_dict)):
            if 0 in d:
                out[name] = d[0].detach().cpu().clone()
        return out

    def load_layout_state(self, state: Mapping[str, Tensor]) -> None:
        self.state.iter = int(state["iter"]) if "iter" in state else self.state.iter
        for name, d in (("p", self.state.p_memory_dict), ("q", self.state.q_memory_dict)):
            if name in state:
                d[0] = state[name].clone()

    def state_dict(self) -> dict[str, Tensor]:
        out = {"iter": torch.tensor(self.state.iter)}
        for name, d in (("error", self.state.error_dict), ("p", self.state.p_memory_dict),
                        ("q", self.state.q_memory_dict)):
            if 0 in d:
                out[name] = d[0].detach().cpu().clone()
        return out

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.state.iter = int(state.get("iter", torch.tensor(0)))
        for name, d in (("error", self.state.error_dict), ("p", self.state.p_memory_dict),
                        ("q", self.state.q_memory_dict)):
            if name in state:
                d[0] = state[name].clone()


class LocalSGD(Reducer):
    """Post-local SGD: per-step sync for ``warmup`` steps, then local steps and parameter averaging every ``H``.

    Args:
        every: ``H`` >= 2.
        warmup: steps of plain data parallelism first.
        replicas: ``d``.
        group: the stage's process group.
    """

    def __init__(self, every: int, warmup: int, replicas: int, group: Any) -> None:
        super().__init__(replicas)
        if every < 2:
            raise HpmlError(f"local SGD averages every H >= 2 steps, got {every}: --sync-every 1 is plain data "
                            "parallelism and needs no reducer")
        self.every, self.warmup, self.group = every, warmup, group

    diverges = True  # between two averages: a checkpoint keeps each replica's copy (.feedback.Replica)

    def rebind(self, group: Any) -> None:
        self.group = group

    @property
    def local(self) -> bool:
        """Whether this step's gradients stay on this replica."""
        return self.step >= self.warmup

    def reduce(self, comm: Any, stage: int, flat: Tensor, params: Sequence[nn.Parameter]) -> None:
        nbytes = flat.numel() * flat.element_size()
        self.dense += nbytes
        if self.local:
            flat.mul_(self.replicas)  # this replica's mean gradient: its slices were scaled by 1/d for a sum
            return
        comm.all_reduce((stage,), flat)
        self.sent += nbytes

    def due(self, step: int) -> bool:
        """Whether the parameters are averaged after step ``step`` (0-based): after every ``H``-th local step."""
        return step >= self.warmup and (step - self.warmup + 1) % self.every == 0

    def after_step(self, params: Sequence[nn.Parameter]) -> None:
        if self.due(self.step):
            average_parameters(iter(params), self.group)
            self.sent += sum(p.numel() * p.element_size() for p in params)


def make_reducer(plan: Any, stage: int, group: Any) -> Reducer | None:
    """The reducer a plan asks for on ``stage`` (None: plain all-reduce).

    Args:
        plan: the build's plan.
        stage: the replicated stage this rank runs.
        group: its process group.
    """
    st = plan.stages[stage]
    d = len(st.devices)
    if d < 2:
        return None
    if st.compress:
        c = Compression.parse(st.compress, f"stage {stage}: compress")
        if c.kind is CompressKind.TOPK:
            return TopK(c.ratio, d)
        return PowerSGD(c.rank, d, group)
    if plan.sync_every > 1:
        return LocalSGD(plan.sync_every, plan.sync_warmup, d, group)
    return None

