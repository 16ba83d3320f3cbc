"""Where the many-kind search's time goes on the incumbent side (solve/msearch.py, session 12).

- The blocked DP in the other kind orders is tried only where memory binds (the only reason the order of kinds
  along the pipeline matters beyond boundary transfers): without binding memory gpt2-xl on 3 x 256 spent 2 of its
  10 CPU s there and found nothing.
- A new incumbent's tiling is moved to every other open count and polished there at once, not only at each
  count's root.
"""

from __future__ import annotations

import time

import pytest

from hpml_compile.plan import Schedule
from hpml_compile.solve.candidates import Chain, Setting


@pytest.mark.parametrize("memory_gib,tried", [(0.16, True), (1024.0, False)])
def test_other_kind_orders_are_tried_only_where_memory_binds(monkeypatch, memory_gib, tried) -> None:
    """Twelve blocks on 6 + 6 devices of two kinds: with 0.16 GiB a stage fits only with at most 3-11 stages after
    it (memory binds), and the other order is tried at the incumbent's count; with 1024 GiB nothing binds and it is
    not (before: tried there too). The outcome is the same optimum either way."""
    from hpml_compile.solve import _first_plan
    from hpml_compile.solve import msearch
    from hpml_compile.solve.bounds import exact_classes
    from hpml_compile.solve.candidates import classes
    from hpml_compile.solve.table import build_table
    from hpml_compile.solve.testing import chain_graph, cluster_of

    graph = chain_graph([{"a": (1.0, 2.0), "b": (1.5, 3.0)}] * 12, activation_bytes=2**28, batch_size=16)
    cluster = cluster_of(["a"] * 6 + ["b"] * 6, memory_gib=memory_gib)
    chain = Chain.of(graph)
    sets = [Setting(m, Schedule.ONE_F_ONE_B, 16) for m in (16, 8, 4)]
    binds = [exact_classes(build_table(chain, cluster, s), classes(s, 12)) > 0 for s in sets]
    assert all(binds) if tried else not any(binds)
    firsts = {s.microbatches: p for s in sets if (p := _first_plan(chain, cluster, s, sweep=False))}
    calls: list[int] = []
    real = msearch.other_orders
    monkeypatch.setattr(msearch, "other_orders", lambda *a, **k: (calls.append(a[2].microbatches), real(*a, **k)))
    out = msearch.anytime(chain, cluster, sets, firsts, 30.0, lambda _: None, time.perf_counter())
    assert bool(calls) is tried, calls
    assert out.lower == pytest.approx(out.upper, rel=1e-6)
    assert out.upper == pytest.approx(6.46875 if tried else 6.375, rel=1e-9)
