"""Optimizer offload: the optimizer's state and its step live in host memory (a plan's ``offload_optimizer``).

What the plan promises (:func:`hpml_compile.stagecost.memory_parts`): a stage
that offloads keeps no Adam state on its device, and pays, per step, its
gradients copied to the host and its updated parameters copied back
(:func:`hpml_compile.stagecost.sync_ms`). :class:`OffloadedOptimizer` does
exactly that around the user's own optimizer:

1. every gradient is copied from the device into a host buffer (pinned on
   CUDA, issued ``non_blocking`` so that the copies of all parameters queue
   back to back; one synchronisation waits for them all);
2. the optimizer steps on host fp32 master copies of the parameters: for the
   step, each parameter's ``.data`` is its host master and its ``.grad`` the
   host gradient, so the state tensors the optimizer creates (Adam's
   ``exp_avg``/``exp_avg_sq``) are made in host memory and stay there;
3. each parameter gets its device tensor back and the updated master is copied
   into it (``non_blocking`` from pinned memory: the copy overlaps whatever
   the host does next, and the device's stream orders it before the next
   forward).

Why our own and not a library's: torch has no optimizer offload outside FSDP
(``CPUOffloadPolicy`` offloads parameters too, a different plan), and
DeepSpeed's ZeRO-Offload needs its engine around the whole model. Swapping
``.data`` for the step keeps everything else as it is: the optimizer is the
user's (any ``torch.optim`` class), its ``param_groups`` hold the model's
parameters, so LR schedulers and checkpoints
(``torch.distributed.checkpoint.state_dict``, which maps state to parameter
names by identity) work unchanged; :meth:`OffloadedOptimizer.load_state_dict`
moves loaded state back to the host.

The master copies are refreshed from the device when a parameter was changed
there since the last step (a checkpoint load, a manual edit): the parameter's
autograd version counter says so, at no cost.

Offload needs a device that is not the host: on a CPU rank the host *is* the
device, the copies would save nothing, so the solver never offers it there and
:func:`hpml_compile.plan.validate_plan` refuses a plan that names it. The
``host`` argument exists so that the numerics can be tested on a CPU
(``cpu -> cpu`` copies, the same code path).

Example:
    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    >>> _ = b.load_state_dict(a.state_dict())
    >>> plain = torch.optim.AdamW(a.parameters(), lr=0.1)
    >>> off = OffloadedOptimizer(torch.optim.AdamW(b.parameters(), lr=0.1), host=torch.device("cpu"))
    >>> x = torch.randn(3, 4)
    >>> for m, o in ((a, plain), (b, off)):
    ...     m(x).square().sum().backward(); o.step()
    >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    True
    >>> off.state_bytes() == 2 * sum(p.numel() * 4 for p in b.parameters())
    True
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn

from ...errors import HpmlError

__all__ = ["OffloadedOptimizer", "offload_optimizer"]


class OffloadedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer so that its state and its step are in host memory.

    Args:
        inner: the optimizer, built over the device parameters (before any step: its state must be empty).
        host: where the state lives (the CPU; a test may pass the CPU for CPU parameters).

    Raises:
        HpmlError: ``inner`` has state already (it would stay where it is).
    """

    def __init__(self, inner: torch.optim.Optimizer, host: torch.device = torch.device("cpu")) -> None:
        # No super().__init__: every Optimizer attribute that matters is the inner optimizer's (below).
        if inner.state:
            raise HpmlError("optimizer offload wraps an optimizer before its first step; this one has state "
                            "already: build it with the factory (optimizer=lambda ps: torch.optim.AdamW(ps, ...))")
        self.inner, self.host = inner, torch.device(host)
        self._master: dict[nn.Parameter, Tensor] = {}
        self._grad: dict[nn.Parameter, Tensor] = {}
        self._version: dict[nn.Parameter, int] = {}
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    # -- what an Optimizer exposes, the inner one's ------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """Any other attribute is the inner optimizer's (e.g. the runtime's ZeRO shards, ``hpml_zero``)."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def __repr__(self) -> str:
        return f"OffloadedOptimizer({self.inner!r}, host={self.host})"

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load as the inner optimizer does (which puts state on each parameter's device), then move it host-side."""
        self.inner.load_state_dict(state_dict)
        for st in self.inner.state.values():
            for key, v in list(st.items()):
                if isinstance(v, Tensor) and v.device != self.host:
                    st[key] = v.to(self.host)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)

    # -- the step ------------------------------------------------------------------------------------
    def _buffers(self, p: nn.Parameter) -> tuple[Tensor, Tensor]:
        """The host master copy (fp32, refreshed when the device copy changed) and the host gradient buffer."""
        pin = p.device.type == "cuda"
        master = self._master.get(p)
        if master is None:
            master = self._master[p] = torch.empty(p.shape, dtype=torch.float32, device=self.host, pin_memory=pin)
            self._grad[p] = torch.empty(p.shape, dtype=torch.float32, device=self.host, pin_memory=pin)
            self._version[p] = -1
        if self._version[p] != p._version:  # new, or changed on the device since our last copy
            master.copy_(p.detach())
        return master, self._grad[p]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Gradients to the host, the inner optimizer's step there, parameters back to their devices.

        Args:
            closure: not supported (the loss would be recomputed on the device mid-step).

        Raises:
            HpmlError: a closure was given.
        """
        if closure is not None:
            raise HpmlError("optimizer offload does not take a closure (LBFGS-style optimizers re-evaluate the "
                            "model inside the step); use an optimizer without one, or a plan without offload")
        live = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        swapped: list[tuple[nn.Parameter, Tensor, Tensor, Tensor]] = []
        for p in live:  # 1. every gradient to the host, queued back to back
            master, grad = self._buffers(p)
            grad.copy_(p.grad, non_blocking=True)
            self.bytes_to_host += p.grad.numel() * p.grad.element_size()
            swapped.append((p, p.data, p.grad, master))
        for dev in {p.device for p in live if p.device.type == "cuda"}:
            torch.cuda.synchronize(dev)
        for p, _, _, master in swapped:  # 2. the step on the host copies
            p.data = master
            p.grad = self._grad[p]
        try:
            self.inner.step()
        finally:
            for p, data, grad, master in swapped:  # 3. parameters back, the updated values copied in
                p.data, p.grad = data, grad
                p.copy_(master, non_blocking=True)
                self.bytes_to_device += p.numel() * p.element_size()
                self._version[p] = p._version
        return None

    # -- what it holds -------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state (every tensor of every parameter's state, by unique storage)."""
        seen: dict[int, int] = {}
        for st in self.inner.state.values():
            for v in st.values():
                if isinstance(v, Tensor) and v.dim() > 0:
                    s = v.untyped_storage()
                    seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    def host_bytes(self) -> int:
        """Host bytes this offload holds: the state, the fp32 masters and the gradient buffers."""
        extra = sum(t.untyped_storage().nbytes() for d in (self._master, self._grad) for t in d.values())
        return self.state_bytes() + extra


def offload_optimizer(optimizer: torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                      params: Iterable[nn.Parameter], device: torch.device) -> OffloadedOptimizer:
    """The optimizer of a rank whose stage offloads (what :class:`~.pipeline.Pipeline` builds).

    Args:
        optimizer: an optimizer (before its first step) or a factory called with ``params``.
        params: the rank's parameters.
        device: the rank's device.

    Returns:
        The wrapped optimizer.

    Raises:
        HpmlError: ``device`` is a CPU (the host is the device: there is nothing to offload to).
    """
    if device.type == "cpu":
        raise HpmlError("the plan offloads the optimizer of a stage on a CPU device, where the host is the device "
                        "and offload saves nothing; recompile (the solver offers offload only on GPUs) or set "
                        "offload_optimizer to false in plan.json")
    inner = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(params)
    return OffloadedOptimizer(inner, host=torch.device("cpu"))
