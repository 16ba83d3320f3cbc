"""What the runtime does beside the model in a step, kept off the per-op and per-parameter path."""

from __future__ import annotations

import pytest
import torch


def test_memory_is_counted_on_the_first_steps_of_a_shape_then_every_so_often() -> None:
    from hpml_compile.saved import MEMORY_EVERY, counts_memory

    counted = [i for i in range(3 * MEMORY_EVERY) if counts_memory(i)]
    assert counted == [0, 1, MEMORY_EVERY, 2 * MEMORY_EVERY]


def test_gradients_are_counted_only_while_armed() -> None:
    from hpml_compile.saved import GradPeak

    net = torch.nn.Linear(4, 3)
    peak = GradPeak(net.parameters())
    net(torch.randn(2, 4)).sum().backward()
    assert peak.bytes == 0, "nothing is counted before arm()"
    for p in net.parameters():
        p.grad = None
    peak.arm()
    net(torch.randn(2, 4)).sum().backward()
    assert peak.bytes == (4 * 3 + 3) * 4
    peak.disarm()
    for p in net.parameters():
        p.grad = None
    net(torch.randn(2, 4)).sum().backward()
    assert peak.bytes == (4 * 3 + 3) * 4, "the last count is kept after disarm(), and nothing is added"
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())


def test_closely_following_short_steps_share_a_sample_window(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from hpml_compile.runtime.observe import host

    # thresholds far above any scheduling delay of a busy machine, then none: the outcome does not hang on timing
    monkeypatch.setattr(host, "REUSE_S", 60.0)
    monkeypatch.setattr(host, "WINDOW_S", 60.0)
    h = host.HostSampler()
    calls: list[float] = []
    real = h.sample
    h.sample = lambda: calls.append(time.monotonic()) or real()  # type: ignore[method-assign]
    h.begin()
    first = h.end()
    assert len(calls) == 2, "the first step samples at its start and end"
    for _ in range(5):  # steps back to back inside one window: no sample
        h.begin()
        busy = h.end()
        assert (busy.steal, busy.others, busy.cpu_util) == (first.steal, first.others, first.cpu_util)
    assert len(calls) == 2
    monkeypatch.setattr(host, "REUSE_S", 0.0)
    h.begin()
    assert len(calls) == 3, "a step after a gap samples afresh"
    monkeypatch.setattr(host, "WINDOW_S", 0.0)
    busy = h.end()
    assert len(calls) == 4, "a window as long as WINDOW_S is sampled at its end"
    assert 0.0 <= busy.others <= 1.0 and busy.cpu_util >= 0.0


def test_compile_without_an_optimizer_says_that_it_trains_nothing() -> None:
    import pytest

    import hpml_compile

    net = torch.nn.Linear(4, 2)
    with pytest.warns(UserWarning, match="no optimizer given"):
        pipe = hpml_compile.compile(net, (torch.randn(4, 4),), cluster="local-cpu-1", profile_repeats=1)
    before = net.weight.detach().clone()
    pipe.step((torch.randn(4, 4),), torch.randn(4, 2), torch.nn.functional.mse_loss)
    assert torch.equal(net.weight, before), "no optimizer: the weights stay as they were"


def _calls_per_step(step: object, steps: int = 4) -> int:
    """Python function calls of the cheapest of ``steps`` calls of ``step`` (sys.setprofile).

    Calls into C are not counted: the generated forward reads each submodule with the builtin ``getattr``
    (a C call found in the instance dict, tens of nanoseconds) where ``nn.Sequential`` iterates.
    """
    import sys

    counts = []
    for _ in range(steps):
        n = 0

        def count(frame: object, event: str, arg: object) -> None:
            nonlocal n
            if event == "call":
                n += 1

        sys.setprofile(count)
        try:
            step()  # type: ignore[operator]
        finally:
            sys.setprofile(None)
        counts.append(n)
    return min(counts)


def test_what_a_step_adds_to_eager_does_not_grow_with_the_ops_or_parameters(tmp_path: object) -> None:
    from pathlib import Path

    from hpml_compile.codegen import generate
    from hpml_compile.runtime import Pipeline
    from hpml_compile.testing import split_plan
    from hpml_compile.trace import trace

    def mlp(layers: int) -> torch.nn.Module:
        torch.manual_seed(0)
        mods: list[torch.nn.Module] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(4, 4), torch.nn.ReLU()]
        return torch.nn.Sequential(*mods)

    x, y = torch.randn(2, 4), torch.randn(2, 4)
    loss_fn = torch.nn.functional.mse_loss
    extra = {}
    for layers in (5, 20):
        net = mlp(layers)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def eager() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(net(x), y).backward()
            opt.step()

        gm = trace(mlp(layers), (x,))
        build = Path(str(tmp_path)) / f"b{layers}"
        generate(gm, split_plan(gm, "mlp", 1), build)
        pipe = Pipeline.from_build(build, mlp(layers), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        for _ in range(2):
            eager()
            pipe.step((x,), y, loss_fn)
        extra[layers] = _calls_per_step(lambda: pipe.step((x,), y, loss_fn)) - _calls_per_step(eager)
    assert extra[20] <= extra[5] + 4, f"calls a step adds to eager, by layers: {extra}"


def test_a_steps_wall_clock_splits_into_parts_that_each_measure_their_own_span(tmp_path) -> None:
    """wall = before + the executor's span + after; inside the span, the work between tokens and the LOSS token are
    measured apart from the compute, the sync and the optimizer."""
    import time

    from hpml_compile.codegen import generate
    from hpml_compile.runtime import Pipeline
    from hpml_compile.testing import split_plan
    from hpml_compile.trace import trace

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(4, 4)
    generate(trace(net, (x,)), split_plan(trace(net, (x,)), "default", 2, microbatches=2), tmp_path / "b")
    pipe = Pipeline.from_build(tmp_path / "b", net, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    pipe.step((x,), torch.zeros(4, 1), torch.nn.functional.mse_loss)
    m = pipe.metrics[-1]
    assert m.wall_ms == pytest.approx(m.before_ms + m.step_ms + m.after_ms)
    assert m.before_ms > 0.0 and m.after_ms > 0.0 and m.between_ms > 0.0
    assert m.fwd_ms + m.bwd_ms + m.loss_ms + m.between_ms <= m.step_ms
    # a slow LOSS token (waiting for the sends) shows in loss_ms, not in the work between tokens
    flush = pipe._local.flush

    def slow_flush() -> None:
        time.sleep(0.05)
        flush()

    pipe._local.flush = slow_flush  # type: ignore[method-assign]
    pipe.step((x,), torch.zeros(4, 1), torch.nn.functional.mse_loss)
    m = pipe.metrics[-1]
    assert m.loss_ms >= 50.0 and m.between_ms < 25.0


def test_a_step_that_is_retried_gets_its_buffers_back_from_a_list_made_once(tmp_path) -> None:
    from hpml_compile.codegen import generate
    from hpml_compile.runtime import Pipeline
    from hpml_compile.testing import split_plan
    from hpml_compile.trace import trace

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    x = torch.randn(8, 4)
    gm = trace(net, (x,))
    generate(gm, split_plan(gm, "default", 2, microbatches=1), tmp_path / "b")
    pipe = Pipeline.from_build(tmp_path / "b", net, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    before = {n: b.clone() for k, st in pipe.stages.items() for n, b in st.named_buffers()}
    snap = pipe._snapshot()
    pipe.step((x,), torch.zeros(8, 1), torch.nn.functional.mse_loss)  # moves the running statistics
    moved = {n: b.clone() for k, st in pipe.stages.items() for n, b in st.named_buffers()}
    assert any(not torch.equal(before[n], moved[n]) for n in before if before[n].is_floating_point())
    pipe._restore(snap)
    assert all(torch.equal(before[n], b) for k, st in pipe.stages.items() for n, b in st.named_buffers())
    again = pipe._snapshot()
    assert [id(b) for b, _ in again["buffers"]] == [id(b) for b, _ in snap["buffers"]] and snap["buffers"]


@pytest.mark.parametrize("value", [
    torch.arange(24.0).reshape(6, 4),
    (torch.arange(12.0).reshape(6, 2), torch.arange(6)),
    [torch.arange(6.0), torch.ones(6, 1)],
    (torch.arange(6.0), 3),  # not only tensors: through pytree
    {"x": torch.arange(6.0)},
])
@pytest.mark.parametrize("split", [2, (2, 4), 3])
def test_batches_split_without_pytree_as_with_it(value: object, split: object) -> None:
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from hpml_compile.runtime.execute.slices import split_replicas

    def piece(x: object, r: int) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        return x.split(list(split))[r] if isinstance(split, tuple) else x.tensor_split(split)[r]

    leaves, spec = tree_flatten(value)
    parts = [[piece(x, r) for x in leaves] for r in range(len(split) if isinstance(split, tuple) else split)]
    want = [tree_unflatten(p, spec) for p in parts]
    got = split_replicas(value, split)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        gl, gs = tree_flatten(g)
        wl, ws = tree_flatten(w)
        assert type(g) is type(w) and gs == ws
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(gl, wl))


def test_a_buffered_sync_resolves_the_tokens_parameters_until_it_has_checked_them() -> None:
    from hpml_compile.errors import HpmlError
    from hpml_compile.memory import ZeroStage
    from hpml_compile.runtime.sync.stage import DataParallel, Sharded
    from hpml_compile.runtime.sync.zero import FlatGrads, FlatShard
    from hpml_compile.schedule import SyncImpl

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    params = list(net.parameters())
    flat = FlatGrads(0, params)
    shard = FlatShard(0, params, replicas=2, replica=0, zero=ZeroStage.OS)
    for sync, buffer in [(DataParallel(flat, SyncImpl.SHM), flat), (Sharded(shard, SyncImpl.SHM), shard)]:
        asked: list[int] = []

        def resolve() -> list[torch.nn.Parameter]:
            asked.append(1)
            return list(reversed(params))  # the generated code's order may differ: the check compares sets

        assert sync.token_params(resolve) == list(reversed(params)) and len(asked) == 1
        buffer.check(sync.token_params(resolve))
        assert buffer.checked and len(asked) == 2
        assert sync.token_params(resolve) is buffer.params and len(asked) == 2, "checked: no names resolved"
    with pytest.raises(HpmlError, match="disagree"):  # what the check is for: a list that is not the buffer's
        FlatGrads(0, params[:1]).check(params)
