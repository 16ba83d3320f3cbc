"""Serving around a slow device: each stage's time measured against its plan, the model placed again on the
measured speeds.

Training's closed loop re-plans when a step is persistently slower than predicted
(:class:`hpml_compile.runtime.observe.policy.ImbalanceWatch`). A server applies the same rule per stage:

- after each batch every rank reports the time it spent computing
  (:attr:`hpml_compile.infer.engine.Generated.stage_ms`), which is compared with what its stage is predicted
  to take for that batch (:func:`expected_stage_ms`);
- each stage's ratio measured / predicted is divided by the batch's smallest such ratio, so that a host
  slower (or faster) than the cost model assumes, which slows every stage alike, moves nothing; one
  :class:`~hpml_compile.runtime.observe.policy.ImbalanceWatch` per device learns over the first ``baseline``
  batches of a plan how far that relative ratio sits from 1 when nothing is wrong (the cost model prices
  a stage holding the output head, say, less well than one holding blocks only), and fires when it
  exceeds ``threshold`` times that level for ``patience`` batches in a row (one slow batch, a noisy
  neighbour, does not);
- when it fires, the device is taken to be as slow as measured: its catalog entry's rates are divided by
  the ratio (:func:`slowed_spec`), the model is placed again with those speeds
  (:func:`hpml_compile.infer.place.place`), and the server switches to the new plan between two batches
  (queued requests wait; none is dropped) if it predicts at least ``min_gain`` times the running plan's
  tokens/s, both scored on the measured speeds.

Example:
    >>> w = SpeedWatch(AdaptOptions(threshold=1.5, patience=2, baseline=0))
    >>> [w.observe(["gpu0", "gpu1"], [10.0, m], [10.0, 10.0]) for m in (30.0, 12.0, 30.0, 30.0)]
    [{}, {}, {}, {'gpu1': 3.0}]
    >>> w.observe(["gpu0", "gpu1"], [20.0, 20.0], [10.0, 10.0])  # every stage alike: the host, not a device
    {}
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import cost_models

from ..ir import Cluster
from ..runtime.observe.policy import ImbalanceWatch
from .cost import TimedCpuSpec, Workload, device_spec
from .place import decode_compute_ms, place, score, stages_for
from .plan import InferencePlan, Prediction

__all__ = ["AdaptOptions", "SpeedWatch", "slowed_spec", "expected_stage_ms", "replan_on_speeds"]


@dataclass(frozen=True, slots=True)
class AdaptOptions:
    """When a server re-plans around a slow device (see the module docstring).

    Raises:
        ValueError: on a threshold or a gain not above 1, or a patience below 1.
    """

    enabled: bool = True
    threshold: float = 1.5  # a stage is slow above this many times its predicted share
    patience: int = 3  # slow batches in a row before re-planning
    baseline: int = 3  # first batches of each plan that learn each stage's usual relative ratio
    min_gain: float = 1.05  # the new plan's predicted tokens/s over the running plan's, both on measured speeds

    def __post_init__(self) -> None:
        if not (self.threshold > 1 and self.patience >= 1 and self.min_gain >= 1 and self.baseline >= 0):
            raise ValueError(f"re-planning around a slow device needs threshold > 1, patience >= 1, min_gain >= 1 "
                             f"and baseline >= 0; got {self.threshold}, {self.patience}, {self.min_gain}, "
                             f"{self.baseline}")


def slowed_spec(spec: cost_models.DeviceSpec, factor: float) -> cost_models.DeviceSpec:
    """``spec`` with its memory bandwidth and FLOP rates divided by ``factor`` and its per-op cost multiplied (a
    step woken from a wait too, where timed)."""
    slow = replace(spec, mem_bw=spec.mem_bw / factor, peak_flops={k: v / factor for k, v in spec.peak_flops.items()},
                   launch_overhead_ms=spec.launch_overhead_ms * factor,
                   source=f"{spec.source}; measured {factor:.3g}x slower while serving".lstrip("; "))
    if isinstance(slow, TimedCpuSpec):
        slow = replace(slow, idle_compute=tuple((idle, op * factor) for idle, op in slow.idle_compute))
    return slow


def expected_stage_ms(plan: InferencePlan, batch: int, prompt_len: int, new_tokens: int, lanes: int,
                      specs: Mapping[str, cost_models.DeviceSpec] | None = None) -> list[float]:
    """Per stage of ``plan``, the compute time one generation of this shape is predicted to take on it.

    Args:
        plan: the running plan.
        batch: sequences in the generation.
        prompt_len: their mean prompt length.
        new_tokens: tokens generated per sequence.
        lanes: microbatch lanes (at most ``batch`` are used).
        specs: device specs by name or kind, as :func:`hpml_compile.infer.place.place` takes them.

    Returns:
        Milliseconds per stage: every lane's prefill and decode steps.
    """
    m = max(1, min(lanes, batch))
    work = Workload(batch, max(prompt_len, 1), max(new_tokens, 1), m, plan.workload.dtype)
    stages = stages_for(plan.cluster, plan.shape, work, [(s.device, s.first, s.end, s.stream) for s in plan.stages],
                        specs)
    decode = decode_compute_ms(plan.cluster, plan.shape, work, stages, specs=specs)  # a woken step's included
    return [m * (s.prefill_ms + (work.new_tokens - 1) * d) for s, d in zip(stages, decode)]


class SpeedWatch:
    """Per device, whether its stage is persistently slower than the others relative to their predictions.

    Args:
        options: the threshold and patience.
    """

    def __init__(self, options: AdaptOptions = AdaptOptions()) -> None:
        self.options = options
        self.factors: dict[str, float] = {}  # device -> how many times slower than its catalog entry, measured
        self._watch: dict[str, ImbalanceWatch] = {}

    def observe(self, devices: Sequence[str], measured_ms: Sequence[float], expected_ms: Sequence[float]
                ) -> dict[str, float]:
        """Feed one batch's per-stage times.

        Args:
            devices: the device of each stage.
            measured_ms: each stage's measured compute time.
            expected_ms: each stage's predicted compute time (with the speeds measured so far).

        Returns:
            The devices whose watch fired, each with its measured ratio to the others (empty: nothing to do).
        """
        ratios = [m / e for m, e in zip(measured_ms, expected_ms) if e > 0 and m > 0]
        if len(ratios) != len(devices) or len(devices) < 2:
            return {}
        ref = min(ratios)
        fired = {}
        for d, r in zip(devices, ratios):
            w = self._watch.setdefault(d, ImbalanceWatch(self.options.threshold, self.options.patience, cooldown=0,
                                                         baseline=self.options.baseline))
            if w.observe(r, ref):
                fired[d] = r / ref
        return fired

    def accept(self, fired: Mapping[str, float]) -> None:
        """Take the fired devices' measured ratios as their speeds from now on; the next plan's stages differ,
        so every watch learns its level again."""
        for d, ratio in fired.items():
            self.factors[d] = self.factors.get(d, 1.0) * ratio
        self._watch.clear()

    def specs(self, cluster: Cluster, base: Mapping[str, cost_models.DeviceSpec] | None = None
              ) -> dict[str, cost_models.DeviceSpec]:
        """``base`` with each slowed device of ``cluster`` entered by name at its measured speed."""
        out = dict(base or {})
        for d in cluster.devices:
            if d.name in self.factors:
                out[d.name] = slowed_spec(device_spec(d, base), self.factors[d.name])
        return out


def replan_on_speeds(plan: InferencePlan, specs: Mapping[str, cost_models.DeviceSpec]
                     ) -> tuple[InferencePlan, Prediction]:
    """``plan``'s model placed again on its cluster at the speeds ``specs`` say.

    Returns:
        The new plan, and the running plan's prediction on the same speeds (to compare with the new one's).

    Raises:
        InfeasibleError: if no placement fits (it cannot happen for a cluster the running plan fits).
    """
    ranges = [(s.device, s.first, s.end, s.stream) for s in plan.stages]
    old = score(plan.cluster, plan.shape, plan.workload, stages_for(plan.cluster, plan.shape, plan.workload, ranges,
                                                                    specs), specs=specs)
    new = place(plan.shape, plan.cluster, plan.workload, objective=plan.objective,
                latency_bound_ms=plan.latency_bound_ms, model=plan.model, specs=specs, explain_idle=False)
    return replace(new.with_model(plan.model, plan.seed, plan.weights), cpu_timing=plan.cpu_timing), old
