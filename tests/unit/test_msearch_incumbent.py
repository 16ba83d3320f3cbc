"""Where the many-kind search's time goes on the incumbent side (solve/msearch.py).

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
    from hpml_compile.testing import chain_graph, cluster_of

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


def test_a_new_incumbent_is_moved_to_the_other_open_counts(monkeypatch) -> None:
    """The 8-block instance of test_lagrange_msearch whose first plans rank M=64 best (5.044 ms) while M=32 holds
    4.651: once the search finds the better plans at M=32, each is moved to the counts still open and polished
    there (before: only the incumbent of each count's root time was, so the final one never was)."""
    from hpml_compile.solve import _first_plan
    from hpml_compile.solve import msearch
    from test_lagrange_msearch import _ranked_wrong

    graph, cluster = _ranked_wrong()
    chain = Chain.of(graph)
    sets = [Setting(m, Schedule.ONE_F_ONE_B, graph.batch_size) for m in (64, 32, 16, 8, 4, 2, 1)]
    firsts = {s.microbatches: p for s in sets if (p := _first_plan(chain, cluster, s, sweep=False))}
    moved: list[tuple[int, tuple[tuple[int, int, str, int], ...]]] = []
    real = msearch.polish

    def recorded(tab, plan, counts, big_j, m, **kw):  # type: ignore[no-untyped-def]
        if not kw.get("same", True):
            moved.append((m, tuple((c.a, c.b, c.kind, c.d) for c in plan)))
        return real(tab, plan, counts, big_j, m, **kw)

    monkeypatch.setattr(msearch, "polish", recorded)
    out = msearch.anytime(chain, cluster, sets, firsts, 30.0, lambda _: None, time.perf_counter())
    assert out.setting.microbatches == 32 and out.upper == pytest.approx(4.651238, rel=1e-6)
    tiling = tuple((c.a, c.b, c.kind, c.d) for c in out.picked)
    assert {m for m, t in moved if t == tiling} - {32}, moved  # the final incumbent was tried at another count
