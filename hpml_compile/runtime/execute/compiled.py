"""Stages compiled with ``torch.compile`` (inductor): each stage's forward, and so its backward through AOTAutograd.

:func:`compile_stages` replaces a stage's ``forward`` with a :class:`CompiledForward`: the generated
forward compiled by ``torch.compile`` (dynamo, then inductor; on a CPU inductor writes C++ that the
machine's compiler builds). The operations codegen inserted (``ops.recv``, ``ops.send``,
``ops.checkpoint``, ``ops.swap``) are ``torch.compiler.disable``-d first
(:func:`hpml_compile.codegen.ops.break_graphs`): the stage's graph breaks there, the
pieces between them are compiled, and a recompute or swap region runs as written (eagerly), so
communication, recompute and swap behave as in an uncompiled stage. The module hooks (ZeRO-1/2's
prefetch wait) stay outside the compiled code: only ``forward`` is compiled, not the module call.

Where it does not compile, a stage falls back, with one line naming the stage and why:

- a graph that inductor fails on runs as dynamo traced it (eagerly), by the backend's own fallback here,
  before anything of it ran, so nothing runs twice;
- a ZeRO-3 stage is not compiled: its parameters are gathered before every forward and freed after it
  (:mod:`..sync.zero3`), which a compiled graph's guards see as new tensors, recompiling each time.

Memory accounting: :class:`~hpml_compile.saved.SavedActivations` counts what autograd saves through one
Python hook per saved tensor, which a compiled graph does not call (AOTAutograd saves inside its own
function). So the steps that count memory (the first two of each shape, then every 25th,
:func:`~hpml_compile.saved.counts_memory`) run the stage's eager forward (:attr:`CompiledForward.measuring`),
and the other steps run compiled, with no hook at all. The count is then of the eager stage's activations:
what a compiled stage saves can differ (inductor recomputes cheap pointwise ops rather than save them, so
usually less), which the memory model does not yet separate.

Where CPU stages will run compiled (:func:`hpml_compile.compile` with ``compile_stages="on"``), the profile
also times each kind of block compiled (:mod:`hpml_compile.profile.compiled`) and the plan is priced at those
times. A compiled call pays its guards and wrapper (tens of microseconds on a CPU) once per block timed alone,
where a stage pays it once per graph: the profile measures it on a trivial function and takes it off each
block. ``hpml-compile compile --compile-stages on`` does the same, and records the mode in the plan
(:attr:`hpml_compile.plan.Plan.compile_stages`), which ``hpml-compile run`` follows unless told otherwise,
saying in one line (:func:`mode_mismatch`) where it is told a mode the plan was not priced for.

The default (``auto``): compiled on CUDA devices, uncompiled on CPUs. On a GPU a small op's launch and
Python dispatch is the step (``cost_models/catalog.py``'s ``EAGER_GPU_OP_MS``), which fused kernels remove;
on a CPU inductor's first compile takes tens of seconds per stage (C++ through the host compiler; 20-60 s
for a small MLP on a busy 2-core machine), paid back only over thousands of steps of a small-op model, and
a test suite that trains for a few steps would mostly compile. ``on`` compiles on a CPU too.

Example:
    >>> CompileStages.parse("auto").wants(torch.device("cpu")), CompileStages.parse("on").wants(torch.device("cpu"))
    (False, True)
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ...errors import OptionError
from ...ir import Cluster
from ...plan import Plan

__all__ = ["CompileStages", "CompiledForward", "compile_stages", "inductor_or_eager", "priced_compiled",
           "mode_mismatch"]


class CompileStages(str, enum.Enum):
    """Whether stages run compiled: ``auto`` (on CUDA devices), ``on``, ``off``."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    @classmethod
    def parse(cls, value: "CompileStages | str | bool | None", what: str = "compile_stages") -> "CompileStages":
        """``value`` as a member (True/False as on/off, None as auto).

        Raises:
            OptionError: not one of auto, on, off.
        """
        if value is None:
            return cls.AUTO
        if isinstance(value, bool):
            return cls.ON if value else cls.OFF
        try:
            return cls(str(getattr(value, "value", value)).lower())
        except ValueError:
            raise OptionError(f"{what} must be auto, on or off, got {value!r}") from None

    def wants(self, device: torch.device) -> bool:
        """Whether a stage on ``device`` is compiled under this choice."""
        return self is CompileStages.ON or (self is CompileStages.AUTO and device.type == "cuda")


_CPU = torch.device("cpu")


def priced_compiled(mode: CompileStages, cluster: Cluster) -> bool:
    """Whether a plan for ``cluster`` whose stages run under ``mode`` is priced at compiled block times: its CPU
    stages run compiled, so the profile times the blocks compiled on the CPU (GPU kinds are predicted either way).

    Args:
        mode: how the stages will run.
        cluster: the devices planned for.

    Returns:
        True where ``mode`` compiles on a CPU and ``cluster`` has CPU devices.
    """
    return mode.wants(_CPU) and any(d.is_cpu for d in cluster.devices)


def mode_mismatch(plan: Plan, mode: CompileStages, where: str) -> str | None:
    """One line where running ``plan``'s stages under ``mode`` differs from how its figures were priced (its CPU
    stages compiled or not: :attr:`~hpml_compile.plan.Plan.compile_stages`); None where it does not.

    Args:
        plan: the plan (of a build).
        mode: how the stages are about to run.
        where: the build, as the line names it.

    Returns:
        The line, or None.
    """
    if not any(d.is_cpu for d in plan.cluster.devices):
        return None  # GPU kinds are predicted the same way for both modes
    planned = CompileStages.parse(plan.compile_stages).wants(_CPU)
    if mode.wants(_CPU) == planned:
        return None
    run, priced = ("compiled", "uncompiled") if mode.wants(_CPU) else ("uncompiled", "compiled")
    return (f"--compile-stages {mode.value}: the CPU stages run {run}, but {where} was planned for {priced} ones "
            f"(compile-stages {plan.compile_stages}): its predicted figures are priced {priced}; compile it with "
            f"--compile-stages {mode.value} to price them {run}")


class CompiledForward:
    """A stage's forward: compiled, or its own eager forward while memory is measured.

    Args:
        stage: the stage module (its ``forward`` is the generated one).
        index: the stage's index (named in the fallback line).
        log: where the one-line fallback notice goes.
    """

    def __init__(self, stage: nn.Module, index: int, log: Callable[[str], None]) -> None:
        self.eager = stage.forward
        self.index = index
        self.measuring = False  # run eagerly: a step that counts the saved activations through hooks
        backend = inductor_or_eager(f"stage {index}", log)
        self.fallbacks: list[str] = backend.fallbacks  # type: ignore[attr-defined]  # why a graph runs uncompiled
        self.compiled = torch.compile(self.eager, backend=backend, dynamic=False)

    def __call__(self, *args: Any) -> Any:
        return self.eager(*args) if self.measuring else self.compiled(*args)


def inductor_or_eager(what: str, log: Callable[[str], None]) -> Callable[..., Any]:
    """A ``torch.compile`` backend: inductor, or the traced graph as it is where inductor fails (said once)."""
    said: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        try:
            compiled: Callable[..., Any] = compile_fx(gm, example_inputs)  # type: ignore[assignment]
            return compiled
        except Exception as e:  # noqa: BLE001 -- any compiler failure falls back, and says why
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            if not said:
                log(f"{what} runs uncompiled: torch.compile (inductor) failed: {reason}")
            said.append(reason)
            return gm.forward

    backend.fallbacks = said  # type: ignore[attr-defined]
    return backend


def compile_stages(stages: dict[int, nn.Module], mode: CompileStages, device: torch.device,
                   log: Callable[[str], None], *, zero3: Iterable[int] = ()) -> list[CompiledForward]:
    """Compile each of ``stages`` whose device ``mode`` compiles on (see the module docstring).

    Args:
        stages: the stage modules of this process, by index.
        mode: the choice.
        device: where they run.
        log: where a stage that cannot be compiled is named, with why (one line each).
        zero3: indices of stages whose parameters ZeRO-3 gathers and frees around each forward.

    Returns:
        The compiled forwards (set ``measuring`` on them for a step that counts memory).
    """
    if not mode.wants(device):
        return []
    from ...codegen.ops import break_graphs

    break_graphs()
    out = []
    sharded = set(zero3)
    for k, stage in sorted(stages.items()):
        if k in sharded:
            log(f"stage {k} runs uncompiled: ZeRO-3 gathers its parameters before every forward and frees them "
                "after, which a compiled graph would recompile for")
            continue
        if isinstance(stage.forward, CompiledForward):  # a build's stages shared by two pipelines
            out.append(stage.forward)
            continue
        fwd = CompiledForward(stage, k, log)
        stage.forward = fwd  # an instance attribute: nn.Module's call (and its hooks) calls it
        out.append(fwd)
    return out
