"""The uneven-rows search's budget: every plan it builds or scores is checked against the budget first, so
what it adds to the solver's time is bounded and said; and its neighbourhoods grow with the device classes
of a large cluster, not with its devices squared."""

from __future__ import annotations

from itertools import count

import pytest

from hpml_compile.ir import Cluster, Device
from hpml_compile.solve import solve, uneven
from hpml_compile.testing import chain_graph
from hpml_compile.solve.uneven import FAMILIES, device_class, group_sizes, improve, moved_devices, shape_of

KINDS = {"fast": (1.0, 2.0), "mid": (2.0, 4.0), "slow": (3.0, 6.0)}


def generated_cluster(per_kind: int, per_host: int = 8) -> Cluster:
    """``per_kind`` devices of each of three kinds, ``per_host`` to a host, hosts of one kind each."""
    devs = [Device(f"d{k * per_kind + i}", kind, 64.0, host=f"h{(k * per_kind + i) // per_host}")
            for k, kind in enumerate(KINDS) for i in range(per_kind)]
    return Cluster(devices=tuple(devs), name=f"3x{per_kind}")


class Ticks:
    """A clock that moves one second each time it is read: the budget's deadline, deterministically."""

    def __init__(self) -> None:
        self._n = count()
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return float(next(self._n))


def test_no_plan_is_built_or_simulated_without_a_budget_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """48 devices of three kinds: the search stops at its budget of 30 clock reads, mid-way through its
    families, and every plan built (or stage's rows chosen) and every plan simulated came after a check."""
    g = chain_graph([KINDS] * 12, param_bytes=1000, batch_size=96)
    c = generated_cluster(16)
    base = solve(g, c, solver="dp", microbatches=4)
    work = {"built": 0, "rows": 0, "simulated": 0}

    def counted(name: str, real):  # the real function, counted
        def run(*a, **kw):
            work[name] += 1
            return real(*a, **kw)
        return run

    monkeypatch.setattr(uneven, "build_plan", counted("built", uneven.build_plan))
    monkeypatch.setattr(uneven, "stage_rows", counted("rows", uneven.stage_rows))
    monkeypatch.setattr(uneven, "annotate", counted("simulated", uneven.annotate))
    monkeypatch.setattr(uneven, "step_ms", counted("simulated", uneven.step_ms))
    clock, lines = Ticks(), []
    got = improve(g, c, base, time_limit_s=30, progress=lines.append, clock=clock)
    checks = clock.reads - 2  # the start and the closing line's reading
    assert checks <= 31 + 1  # the budget ran out at its 31st check: one more was refused
    # each unit of work was preceded by a check (the closing simulation of the winner aside)
    assert work["simulated"] > 0 and work["built"] > 0
    assert work["built"] + work["rows"] + work["simulated"] - (got.chosen != "solver") <= checks
    assert got.tried <= checks + 1 and got.plan.predicted.step_ms <= base.predicted.step_ms
    summary = next(line for line in lines if line.startswith("uneven rows: stopped"))
    assert "budget 30 s" in summary and f"of {len(FAMILIES)} candidate families" in summary


def test_a_large_budget_searches_every_family_and_says_so() -> None:
    g = chain_graph([KINDS] * 6, param_bytes=1000, batch_size=48)
    c = generated_cluster(4)
    lines: list[str] = []
    improve(g, c, solve(g, c, solver="dp", microbatches=4), time_limit_s=1e9, progress=lines.append,
            clock=Ticks())
    assert any(f"searched {len(FAMILIES)} of {len(FAMILIES)} candidate families" in line for line in lines)


def test_one_kind_is_skipped_with_one_line() -> None:
    g = chain_graph([{"fast": (1.0, 2.0)}] * 4, batch_size=16)
    c = Cluster(devices=tuple(Device(f"d{i}", "fast", 64.0) for i in range(4)), name="same")
    lines: list[str] = []
    base = solve(g, c, solver="dp", microbatches=2)
    assert improve(g, c, base, progress=lines.append).plan is base
    assert lines == ["uneven rows: skipped, every device is a fast (equal rows per replica are the solver's own)"]


def test_neighbourhoods_grow_with_device_classes_not_devices() -> None:
    """192 devices in 24 hosts, 4 stages of 6 hosts each: one device per class and stage stands for the others
    (moves: 4 stages x 6 classes x 4 places, out or to another stage; swaps: 6 pairs of stages x 6 x 6 classes), against every device
    moved (4 x 48 x 4) and every pair swapped (6 x 48 x 48)."""
    g = chain_graph([KINDS] * 8, param_bytes=1000, batch_size=192)
    c = generated_cluster(64)
    names = [d.name for d in c.devices]
    groups = tuple(tuple(names[48 * i:48 * (i + 1)]) for i in range(4))
    shape = (groups, (0, 2, 4, 6, 8), 4)
    every = sum(1 for _ in moved_devices(shape, names))
    by_class = list(moved_devices(shape, names, device_class(c)))
    assert every == 4 * 48 * 4 + 6 * 48 * 48
    assert len(by_class) == 4 * 6 * 4 + 6 * 6 * 6
    # every shape still places each device once, and no stage is left empty
    for groups2, _, _ in by_class:
        placed = [d for grp in groups2 for d in grp]
        assert len(placed) == len(set(placed)) and all(groups2)
    # data parallelism: every k on a small cluster, the powers of two and each change of speed on a large one
    assert group_sizes([3.0] * 5 + [1.0] * 5) == list(range(2, 11))
    assert group_sizes([3.0] * 100 + [1.0] * 100, every=64) == [2, 4, 8, 16, 32, 64, 100, 128, 200]


def test_shape_of_a_solved_plan_on_the_generated_cluster_is_searchable() -> None:
    g = chain_graph([KINDS] * 8, param_bytes=1000, batch_size=96)
    c = generated_cluster(8)
    base = solve(g, c, solver="dp", microbatches=4)
    shape = shape_of(g, base)
    assert sum(len(grp) for grp in shape[0]) == sum(len(st.devices) for st in base.stages)


def test_the_step_alone_is_the_simulated_step() -> None:
    """The search scores plans by :func:`hpml_compile.simulate.step_ms`, which skips the bars and memory curves:
    it must be the step :func:`hpml_compile.simulate.simulate` gives, on uneven, pipelined and sharded plans."""
    from hpml_compile.simulate import simulate, step_ms

    g = chain_graph([KINDS] * 8, param_bytes=1000, batch_size=96)
    c = generated_cluster(8)
    base = solve(g, c, solver="dp", microbatches=4)
    plans = [base, improve(g, c, base, time_limit_s=1e9, clock=Ticks()).plan]
    plans += [solve(g, c, solver=s, microbatches=m) for s in ("uniform", "time") for m in (1, 8)]
    for p in plans:
        assert step_ms(p, g) == simulate(p, g).step_ms
