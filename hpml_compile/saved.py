"""Activation bytes a rank holds for backward, counted by storage at their peak.

The runtime counts them every step (beside :mod:`hpml_compile.runtime.observe.held`), and the profile times the
model's blocks through the same hooks (:func:`hpml_compile.profile.timing.time_segments`), since every step
the runtime runs pays for them: a module shared by the two layers.

:mod:`hpml_compile.runtime.observe.held` counts what lives for the whole step (parameters, gradients,
optimizer state); this module counts what autograd *saves for backward*, the
activations of the memory model (:func:`hpml_compile.stagecost.memory_parts`:
``in_flight x stored + working``). :class:`SavedActivations` is a context
manager that installs ``torch.autograd.graph.saved_tensors_hooks``: every
tensor autograd saves passes through its pack hook, which keys it by
``untyped_storage().data_ptr()`` and counts the storage's bytes once however
many nodes save it (a ReLU's output saved by the ReLU and the next matmul is
one storage). The handle the hook returns holds the tensor; when autograd
frees the node (after its backward), the handle dies and the storage's count
drops. ``peak`` is the most bytes alive at once: the activations of the
microbatches in flight at the schedule's peak. Parameters and buffers (a
Linear saves its weight) are excluded: :mod:`hpml_compile.runtime.observe.held` counts them.

What it does not see: a region with saved-tensor hooks of its own hides its
saved tensors from the outer hooks (PyTorch calls only the innermost). Two
regions of a build do: ``ops.checkpoint`` (recompute: the checkpoint keeps
its inputs in its own frame, and the recomputed activations of one
microbatch's backward are kept there too) and ``ops.swap`` (the swapped
copies are in host memory, which is what swap is for on a GPU). So under
recompute the count is what is saved *outside* the checkpoint, usually
nothing; benchmarks/memory_truth says so beside those rows.

:class:`GradPeak` counts the gradients at *their* peak, the end of the
step's last backward: counted after the step, a ZeRO-2 rank has freed its
whole gradient buffer already (it keeps only its shard until the optimizer
step), yet it held all of it before the reduce-scatter. Every gradient
storage a parameter's ``.grad`` had when autograd accumulated into it
(``register_post_accumulate_grad_hook``) is alive at the end of the backward
(gradients accumulate, nothing frees them before the sync), so their bytes,
each storage once, are the peak.

``rss`` is the process's resident set (psutil) at the end of the context
and its peak as seen at each pack: on a CPU rank the whole process (the
Python interpreter, torch's libraries, gloo's buffers), not only the model.

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(256, 256)
    >>> with SavedActivations(exclude=[lin]) as acts:
    ...     y = torch.relu(lin(torch.randn(64, 256)))     # saves the input and relu's output
    ...     mid = acts.current
    ...     y.sum().backward()
    >>> mid == 2 * 64 * 256 * 4, acts.peak == mid, acts.current
    (True, True, 0)
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import psutil
import torch
from torch import Tensor, nn

__all__ = ["SavedActivations", "GradPeak", "rss_bytes", "counts_memory", "MEMORY_EVERY"]

MEMORY_EVERY = 25  # a step of each shape counts its saved activations and gradients this often
_STATM = "/proc/self/statm"  # size, resident, ... in pages (Linux)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") and "SC_PAGE_SIZE" in os.sysconf_names else 4096


def counts_memory(seen: int) -> bool:
    """Whether a step counts its saved activations and gradients, given how many steps of its shape came before.

    Counting costs a Python call per saved tensor and per gradient accumulation. A step's memory follows
    from its shapes, so a run counts the first two steps of each shape (the first may allocate lazily), then
    every :data:`MEMORY_EVERY`-th; the steps between report the last count. The runtime measures the rest of a
    rank's memory on the same steps: the parameter, gradient and optimizer-state bytes (a walk over every
    tensor) and, on a CPU, the peak resident set (a ``/proc`` write before the step, a read after).
    """
    return seen < 2 or seen % MEMORY_EVERY == 0


def rss_bytes() -> int:
    """This process's resident set size in bytes.

    Read from ``/proc/self/statm`` where Linux has it (5 us; psutil's ``Process`` made for each call, 24 us, a
    counted step calls it half a dozen times), else through psutil.
    """
    try:
        fd = os.open(_STATM, os.O_RDONLY)
    except OSError:
        return int(psutil.Process(os.getpid()).memory_info().rss)
    try:
        return int(os.read(fd, 256).split()[1]) * _PAGE
    finally:
        os.close(fd)


class _Handle:
    """What a saved tensor is packed into: the tensor, and a release of its count when autograd drops it."""

    __slots__ = ("tensor", "_owner", "_key")

    def __init__(self, owner: "SavedActivations", key: tuple[torch.device, int], tensor: Tensor) -> None:
        self.tensor, self._owner, self._key = tensor, owner, key

    def __del__(self) -> None:
        self._owner._release(self._key)


class SavedActivations:
    """Count the storage autograd saves for backward inside the ``with`` block: ``current`` and ``peak`` bytes.

    Args:
        exclude: modules or tensors whose storage is not an activation (the rank's parameters and buffers).

    Attributes:
        current: bytes of saved storage alive now.
        peak: the most bytes alive at once since entering (or since :meth:`reset_peak`).
        rss_peak: the largest process RSS seen at a pack (sampled every 64 packs and at exit).
    """

    def __init__(self, exclude: Iterable[nn.Module | Tensor] = ()) -> None:
        self._exclude: set[int] = set()
        self._exclude_impl: set[int] = set()  # the storages themselves: a ZeRO-3 parameter's (runtime.sync.zero3)
        for x in exclude:  # is freed between uses and re-allocated at another address for each
            ts = [*x.parameters(), *x.buffers()] if isinstance(x, nn.Module) else [x]
            self._exclude.update(t.untyped_storage().data_ptr() for t in ts)
            self._exclude_impl.update(t.untyped_storage()._cdata for t in ts)
        self._live: dict[tuple[torch.device, int], list[int]] = {}
        self.current = self.peak = 0
        self.rss_peak = 0
        self._packs = 0
        self._hooks: Any = None

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak = self.current
        self.rss_peak = rss_bytes()

    def _pack(self, t: Tensor) -> Any:
        s = t.untyped_storage()
        ptr, n = s.data_ptr(), s.nbytes()
        if n == 0 or ptr in self._exclude or s._cdata in self._exclude_impl:
            return t
        key = (t.device, ptr)  # the device itself, not its name: a string made at every pack
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [n, 1]
            self.current += n
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        self._packs += 1
        if self._packs % 64 == 1:
            self.rss_peak = max(self.rss_peak, rss_bytes())
        return _Handle(self, key, t)

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _Handle) else packed

    def _release(self, key: tuple[torch.device, int]) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.current -= entry[0]

    def __enter__(self) -> "SavedActivations":
        self.rss_peak = max(self.rss_peak, rss_bytes())
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        self.rss_peak = max(self.rss_peak, rss_bytes())


class GradPeak:
    """The gradient bytes of ``params`` at the end of the backward: every ``.grad`` storage seen, once.

    Counts only between :meth:`arm` and :meth:`disarm` (a hook per parameter, called at each of its
    gradient accumulations: a step that does not count pays nothing).

    Args:
        params: the rank's parameters.

    Attributes:
        bytes: gradient bytes seen since the last :meth:`arm` (kept after :meth:`disarm`).
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._params = [p for p in params if p.requires_grad]
        self._seen: dict[tuple[torch.device, int], int] = {}
        self.bytes = 0
        self._handles: list[Any] = []

    def _hook(self, p: Tensor) -> None:
        g = p.grad
        if g is None:
            return
        s = g.untyped_storage()
        key = (g.device, s.data_ptr())
        if key not in self._seen:
            self._seen[key] = s.nbytes()
            self.bytes += s.nbytes()

    def arm(self) -> None:
        """Count this step's gradients from zero."""
        self._seen.clear()
        self.bytes = 0
        if not self._handles:
            self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self._params]

    def disarm(self) -> None:
        """Take the hooks off the parameters; :attr:`bytes` keeps the last count."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._seen.clear()

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        self.disarm()
