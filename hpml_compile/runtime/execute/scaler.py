"""fp16 loss scaling whose skip decision every stage and replica shares.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Loss scaling
multiplies the loss by ``S`` before the backward, so that the fp16 gradients
stay representable, and divides the fp32 gradients by ``S`` before the
optimizer step (Micikevicius et al., "Mixed Precision Training", ICLR 2018).
If any gradient is inf or NaN the step is skipped and ``S`` halves; after
``growth_interval`` steps without one, ``S`` doubles. The rule and its
defaults are :class:`torch.amp.GradScaler`'s.

Why not GradScaler itself: its found-inf is per process (per device, from
its own ``unscale_``) and its ``step``/``update`` act on it at once. In a
pipeline each rank holds a different part of the model, so one rank may
overflow while the others do not; the step must be skipped on every rank
together, and the scale must stay the same everywhere, or the replicas and
stages drift apart. GradScaler has no public way to be told the agreed
found-inf (it lives in its private per-optimizer state), and its ``step``
refuses an optimizer with no gradients (a stage without parameters). So
this class keeps GradScaler's rule and state and leaves the agreement to the
executor: :func:`~hpml_compile.runtime.execute.executor.run_actions` unscales, calls
the given ``agree_inf`` (one all-reduce over every rank of the job, in
:class:`~.pipeline.Pipeline`), and then steps or skips with :meth:`update`.

State (``scale``, ``growth_tracker``, ``skipped``) is plain numbers; the
checkpoint saves it as one float64 tensor (:func:`~.checkpoint.save_checkpoint`).

Example:
    >>> import torch
    >>> s = LossScaler(init_scale=1024.0, growth_interval=2)
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> s.scale_loss((w * 3).sum()).backward()
    >>> found = s.unscale_([w]); w.grad.tolist(), float(found)
    ([3.0, 3.0], 0.0)
    >>> s.update(found_inf=True); s.scale, s.skipped
    (512.0, 1)
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor

from ...errors import HpmlError

__all__ = ["LossScaler"]


class LossScaler:
    """Dynamic loss scale (see the module docstring).

    Args:
        init_scale: the first scale.
        growth_factor: the scale is multiplied by it after ``growth_interval`` steps without overflow.
        backoff_factor: the scale is multiplied by it after a step with an overflow (which is skipped).
        growth_interval: steps without overflow before the scale grows.

    Raises:
        HpmlError: a scale that is not a positive finite number, or factors the wrong way round.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise HpmlError(f"loss scale: init_scale {init_scale!r} must be a positive finite number (e.g. 65536)")
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise HpmlError(f"loss scale: expected growth_factor > 1, 0 < backoff_factor < 1 and growth_interval "
                            f">= 1, got {growth_factor}, {backoff_factor}, {growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0
        self.skipped = 0
        self.last_skipped = False

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss * scale``: what the backward starts from."""
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, params: Iterable[Tensor]) -> Tensor:
        """Divide every gradient of ``params`` by the scale, in place; 1.0 if one of them is inf or NaN, else 0.0.

        Returns:
            A float32 CPU scalar (the flag to agree on across ranks).
        """
        grads = [p.grad for p in params if p.grad is not None]
        found = torch.zeros((), dtype=torch.float32)
        if not grads:
            return found
        by_device: dict[torch.device, list[Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for gs in by_device.values():
            torch._foreach_mul_(gs, 1.0 / self.scale)
            bad = torch.stack([~torch.isfinite(g).all() for g in gs]).any()
            found = torch.maximum(found, bad.float().cpu())
        return found

    def update(self, found_inf: bool) -> None:
        """After the step (taken or skipped): back off on an overflow, grow after ``growth_interval`` clean steps."""
        self.last_skipped = bool(found_inf)
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_tensor(self) -> Tensor:
        """``[scale, growth_tracker, skipped]`` as float64 (what a checkpoint holds)."""
        return torch.tensor([self.scale, float(self.growth_tracker), float(self.skipped)], dtype=torch.float64)

    def load_state_tensor(self, t: Tensor) -> None:
        """Restore from :meth:`state_tensor`'s output.

        Raises:
            HpmlError: a tensor of another shape, or a scale that is not a positive finite number.
        """
        if tuple(t.shape) != (3,) or not (math.isfinite(float(t[0])) and float(t[0]) > 0):
            raise HpmlError(f"loss scaler state: expected [scale > 0, growth_tracker, skipped], got {t.tolist()}")
        self.scale, self.growth_tracker, self.skipped = float(t[0]), int(t[1]), int(t[2])
