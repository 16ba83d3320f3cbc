"""When to re-plan: the runtime's decisions, as small pure objects that tests can drive step by step.

* :class:`ImbalanceWatch` fires on a change, not on a level. Its first
  ``baseline`` steps learn the machine's constant misprediction (measured /
  predicted: a CPU model the cost model was not tuned on may run every step
  30% slower than predicted, healthily); afterwards it fires when the
  measured step exceeds ``threshold`` x that learned level x the prediction
  for ``patience`` steps in a row (one slow step, a GC pause or a noisy
  neighbour, must not trigger a re-plan). After it fires it stays quiet for
  ``cooldown`` steps, so that a re-plan that did not help cannot make the
  job thrash.
* :func:`worth_switching` weighs the predicted gain of a new plan against the
  cost of switching (checkpoint, restart, reload) over the steps that are left;
  :func:`choose_switch` picks among several candidates (the closed loop's
  row move and full re-plan): of those that pay, the one that saves the most
  time over the steps left once its switch is paid for, so a cheap row move
  wins near the end of a run and a re-plan that gains more wins early. A row move the running ranks
  take in place costs what the last such move of the run measured
  (milliseconds: no checkpoint, no restart), :data:`ROW_MOVE_PRIOR_S` before
  the first; a switch that restarts the ranks costs the restart.
* :class:`FailureLedger` counts failures per device; a device that fails
  ``max_failures`` times is dropped rather than retried forever.
* :func:`contention_discount` takes off a step's time what the rank lost to
  other programs and the hypervisor during it, so that a busy host is not
  mistaken for a wrong plan; :func:`lost_share` says how busy a host was.
* :func:`memory_shortfalls` finds the devices whose measured peak (the bytes
  the rank's tensors held, :mod:`.held` and :mod:`.saved`) exceeded their
  capacity: a plan the runtime cannot hold there, a reason to re-plan at
  once (no patience: on a GPU the next step may not allocate at all), with
  that device's budget cut by what the memory model missed
  (:func:`replan_capacity`).

Example:
    >>> w = ImbalanceWatch(threshold=1.2, patience=3)
    >>> [w.observe(measured_ms=m, predicted_ms=10.0) for m in (13, 13, 11, 13, 13, 13)]
    [False, False, False, False, False, True]
    >>> w = ImbalanceWatch(threshold=1.25, patience=2, baseline=3)  # 30% slower than predicted, steadily
    >>> [w.observe(m, 10.0) for m in (13, 13, 13, 13, 13, 13, 40, 40)], round(w.level, 2)
    ([False, False, False, False, False, False, False, True], 1.3)
    >>> worth_switching(old_step_ms=30, new_step_ms=20, switch_cost_ms=5_000, steps_left=1000)
    True
    >>> rows = Candidate("rows", step_ms=20.0, gain=1.5, switch_cost_ms=50)
    >>> full = Candidate("replan", step_ms=19.0, gain=1.58, switch_cost_ms=5_000)
    >>> choose_switch([full, rows], measured_ms=30.0, steps_left=1000)[0].name
    'rows'
    >>> contention_discount(150.0, contention_ms=60.0)
    90.0
    >>> memory_shortfalls({"cpu0": 95, "cpu1": 80}, {"cpu0": 90, "cpu1": 90})
    {'cpu0': 5}
    >>> replan_capacity(capacity=90, held=95, predicted=85)
    80
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["ImbalanceWatch", "FailureLedger", "worth_switching", "Candidate", "choose_switch", "contention_discount", "lost_share",
           "memory_shortfalls", "replan_capacity", "DEFAULT_THRESHOLD", "DEFAULT_PATIENCE", "MAX_LOST",
           "ROW_MOVE_PRIOR_S"]

DEFAULT_THRESHOLD = 1.25  # measured / predicted step time that counts as "worse than planned"
DEFAULT_PATIENCE = 5  # consecutive such steps before re-planning
MAX_LOST = 0.9  # a host's contention never explains more than this share of a step
# An in-place row move's switch cost before the run has measured one (seconds): above what
# benchmarks/uneven_rows --adapt measured on a shared 2-core VM (10-13 ms), so the first move is not
# under-priced; every later decision of the run uses the move it measured.
ROW_MOVE_PRIOR_S = 0.05


@dataclass(slots=True)
class ImbalanceWatch:
    """Detects a sustained change of the measured step time against the predicted one.

    Args:
        threshold: a step is "slow" when measured > threshold * level * predicted.
        patience: how many slow steps in a row fire the watch.
        cooldown: steps to stay quiet after firing.
        baseline: first steps that learn ``level``, the median measured / predicted ratio (never fire);
            0: ``level`` stays 1 and the watch fires on the prediction itself.
    """

    threshold: float = DEFAULT_THRESHOLD
    patience: int = DEFAULT_PATIENCE
    cooldown: int = 10
    baseline: int = 0
    level: float = field(default=1.0, init=False)
    _ratios: list[float] = field(default_factory=list, init=False)
    _streak: int = field(default=0, init=False)
    _quiet: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.threshold <= 1.0 or self.patience < 1 or self.cooldown < 0 or self.baseline < 0:
            raise ValueError(f"ImbalanceWatch needs threshold > 1, patience >= 1, cooldown >= 0, baseline >= 0; "
                             f"got {self.threshold}, {self.patience}, {self.cooldown}, {self.baseline}")

    @property
    def learning(self) -> bool:
        """True while the baseline steps are still being learned."""
        return len(self._ratios) < self.baseline

    def observe(self, measured_ms: float, predicted_ms: float) -> bool:
        """Feed one step; True when the watch fires (re-plan now)."""
        if self.learning:
            if predicted_ms > 0 and measured_ms > 0:
                self._ratios.append(measured_ms / predicted_ms)
                if not self.learning:
                    self.level = statistics.median(self._ratios)
            return False
        if self._quiet > 0:
            self._quiet -= 1
            return False
        slow = predicted_ms > 0 and measured_ms > self.threshold * self.level * predicted_ms
        self._streak = self._streak + 1 if slow else 0
        if self._streak >= self.patience:
            self._streak, self._quiet = 0, self.cooldown
            return True
        return False

    def rebase(self, level: float | None = None) -> None:
        """Forget the streak; with ``level``, also replace the learned level (1.0 when the reference the
        watch is fed becomes a measured step time, which holds the misprediction already)."""
        self._streak = 0
        if level is not None:
            self.level = level


def worth_switching(old_step_ms: float, new_step_ms: float, switch_cost_ms: float, steps_left: int,
                    min_gain: float = 1.05) -> bool:
    """True when a new plan pays for the switch over the steps left.

    Args:
        old_step_ms: the running plan's step time on the measured costs.
        new_step_ms: the new plan's predicted step time.
        switch_cost_ms: checkpoint + restart + reload, measured or estimated.
        steps_left: training steps still to run.
        min_gain: below this speed-up a switch is not worth its risk, whatever the arithmetic says.
    """
    if new_step_ms <= 0 or old_step_ms / new_step_ms < min_gain:
        return False
    return (old_step_ms - new_step_ms) * steps_left > switch_cost_ms


@dataclass(frozen=True, slots=True)
class Candidate:
    """One way to switch, priced.

    Attributes:
        name: what it changes (``rows``: the same stages with new rows per replica; ``replan``: a new solve).
        step_ms: its predicted step on the measured costs.
        gain: the running plan's predicted step on the same costs over ``step_ms`` (1.0: no gain).
        switch_cost_ms: what switching to it costs (solve, checkpoint, restart).
    """

    name: str
    step_ms: float
    gain: float
    switch_cost_ms: float

    def pays(self, measured_ms: float, steps_left: int, min_gain: float = 1.05) -> bool:
        """Whether it pays over the steps left, its gain applied to the step as measured."""
        return self.gain > 1.0 and worth_switching(measured_ms, measured_ms / self.gain, self.switch_cost_ms,
                                                   steps_left, min_gain)

    def net_gain_ms(self, measured_ms: float, steps_left: int) -> float:
        """Time saved over the steps left, its gain applied to the step as measured, less the switch."""
        return (measured_ms - measured_ms / self.gain) * steps_left - self.switch_cost_ms


def choose_switch(candidates: list[Candidate], measured_ms: float, steps_left: int,
                  min_gain: float = 1.05) -> tuple[Candidate | None, str]:
    """The candidate to switch to, or None, and why.

    Of the candidates that pay (:meth:`Candidate.pays`), the one with the largest net gain over the steps left
    (:meth:`Candidate.net_gain_ms`: the time it saves, its gain applied to the step as measured, less what
    switching to it costs); between equal net gains, the cheaper to switch to. A row move that costs 0.05 s
    loses to a re-plan that costs 3.6 s when the re-plan's faster steps win back more than the difference
    before the run ends, and wins when few steps are left.

    Args:
        candidates: the priced candidates.
        measured_ms: the step as measured now.
        steps_left: training steps still to run.
        min_gain: below this speed-up a switch is not worth its risk.
    """
    paying = [c for c in candidates if c.pays(measured_ms, steps_left, min_gain)]
    if not paying:
        return None, "no candidate pays: " + "; ".join(
            f"{c.name} predicts {c.gain:.2f}x for a switch of {c.switch_cost_ms / 1e3:.3g} s" for c in candidates)
    best = max(paying, key=lambda c: (c.net_gain_ms(measured_ms, steps_left), -c.switch_cost_ms))

    def said(c: Candidate) -> str:
        return (f"{c.name}: {c.gain:.2f}x, switch {c.switch_cost_ms / 1e3:.3g} s, net "
                f"{c.net_gain_ms(measured_ms, steps_left) / 1e3:.3g} s over {steps_left} steps")

    why = said(best).replace(":", " pays", 1) + "".join(
        f"; {said(c)}" + ("" if c in paying else ", does not pay") for c in candidates if c is not best)
    return best, why + (" (the largest net gain)" if len(paying) > 1 else "")


@dataclass(slots=True)
class FailureLedger:
    """Failures per device; a device failing ``max_failures`` times is dropped for good."""

    max_failures: int = 2
    _count: dict[str, int] = field(default_factory=dict, init=False)

    def record(self, device: str) -> bool:
        """Count one failure of ``device``; True when it should now be dropped."""
        self._count[device] = self._count.get(device, 0) + 1
        return self._count[device] >= self.max_failures

    def failures(self, device: str) -> int:
        return self._count.get(device, 0)


def lost_share(steal: float, others: float) -> float:
    """The share of the host's CPU a job could not have had: stolen plus used by other processes (at most MAX_LOST).

    Args:
        steal: the share of the host's CPU time stolen by the hypervisor during the step.
        others: the share used by processes that are not the job's.
    """
    return min(MAX_LOST, max(0.0, steal) + max(0.0, others))


def contention_discount(measured_ms: float, contention_ms: float, baseline_ms: float = 0.0) -> float:
    """The step time without the contention beyond the baseline's: ``measured_ms - (contention_ms - baseline_ms)``.

    Args:
        measured_ms: the step's time.
        contention_ms: the time the rank lost to other programs and the hypervisor in the step (waiting on a
            run queue while ready, and stolen: ``contention_ms`` of :mod:`hpml_compile.runtime.observe.host`).
        baseline_ms: the contention while the reference was measured (0 for a quiet host), so that a host
            that was always this busy is not discounted twice.

    Returns:
        At least ``(1 - MAX_LOST) x measured_ms``: contention never explains a whole step.
    """
    lost = max(0.0, contention_ms - max(0.0, baseline_ms))
    return max(measured_ms - lost, (1.0 - MAX_LOST) * measured_ms)


def memory_shortfalls(held: Mapping[str, int], capacity: Mapping[str, int]) -> dict[str, int]:
    """The devices whose measured peak exceeds their capacity, each with the bytes it is short by.

    Args:
        held: device name -> the most bytes its rank held in a step (tensors, by storage).
        capacity: device name -> its memory in bytes (the plan's cluster).

    Returns:
        device -> ``held - capacity`` for every device over; empty when the plan fits where it runs.
    """
    return {d: held[d] - capacity[d] for d in sorted(held) if d in capacity and held[d] > capacity[d]}


def replan_capacity(capacity: int, held: int, predicted: int) -> int:
    """The budget to re-plan a device with after its peak exceeded the prediction.

    The memory model missed ``held - predicted`` bytes on that device; a new plan is solved with the
    capacity less that miss, so that what it predicts, plus the same miss, fits.

    Args:
        capacity: the device's memory.
        held: its measured peak.
        predicted: the running plan's prediction for it.

    Returns:
        Bytes (the capacity itself when the prediction was not exceeded).
    """
    return capacity - max(0, held - predicted)
