"""All-reduce through shared memory between CPU ranks of one host (:mod:`hpml_compile.runtime.sync.shm`), on gloo ranks.

One job of three ranks checks the collective alone against ``dist.all_reduce``:

- integer-valued float32 tensors: the same sums bit for bit; random ones within
  float rounding (three ranks may add in another order than gloo's ring);
- lengths that fill several slots (a slot of 1 KiB), that leave a rank no chunk
  (2 elements over 3 ranks), and bf16;
- a two-rank sub-group beside the third rank, which is not in it;
- reduce-scatter and all-gather (ZeRO-1/2's pair) against gloo's, in one
  window and in several, the gather into a buffer whose chunk is the shard;
- a tensor in the rank's own slot (:meth:`HostReduce.own`, where a stage's
  gradient buffer lives), summed with no copy in: the same sums;
- the file is removed as soon as every member has mapped it, and where the
  directory cannot hold it every member goes on without it (``open`` -> None).

A second job trains gpt-tiny data-parallel on two ranks, through shared memory
and through gloo: the losses and parameters agree bit for bit (two ranks add in
one order either way), the communicator says which path it took, and through
shared memory the stage's gradient buffer has moved into the rank's own slot
(one buffer still, the parameters' gradients views of it). By default its
gradients, fewer bytes than ``DIRECT_BYTES``, go through gloo with shared
memory on, and the buffer stays where it was: the same bits again. The
collectives job checks that default too, on a small tensor. A third trains it
under ZeRO-1 both ways: its reduce-scatter and parameter all-gather through
shared memory give the same losses and parameters bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.runtime.sync.shm import HostReduce
from hpml_compile.trace import trace

pytestmark = pytest.mark.dist


def _collectives(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    here = Path(tmp, "shm")
    host = HostReduce.open(dist.group.WORLD, slot_bytes=1024, directory=here)
    assert host is not None
    # by default an all-reduce this small goes through gloo (one meeting): the same bits as gloo's
    small = torch.randn(2500, generator=torch.Generator().manual_seed(rank))
    ref = small.clone()
    dist.all_reduce(ref)
    host.all_reduce(small)
    out["direct_equal"] = bool(torch.equal(small, ref))
    host.direct_bytes = 0  # the mapping's own algorithm, on these small tensors, from here on
    out["left_in_dir"] = sorted(p.name for p in here.iterdir())
    g = torch.Generator().manual_seed(rank)
    cases = {"ints": torch.randint(-50, 50, (2500,), generator=g).float(),
             "random": torch.randn(2500, generator=g),
             "tiny": torch.randn(2, generator=g),
             "bf16": torch.randn(777, generator=g).bfloat16()}
    for name, t in cases.items():
        ref = t.clone()
        dist.all_reduce(ref)
        mine = t.clone()
        host.all_reduce(mine)
        out[name] = {"equal": bool(torch.equal(mine, ref)),
                     "max_err": float((mine.double() - ref.double()).abs().max()),
                     "scale": float(ref.double().abs().max())}
    # a tensor held in the rank's own slot (as a stage's gradient buffer is): summed with no copy in, twice
    slotted = host.own(250, torch.float32)
    assert slotted is not None and host.own(257, torch.float32) is None  # 1 KiB holds 256
    for rep in range(2):
        slotted.copy_(torch.randint(-50, 50, (250,), generator=g).float())
        ref = slotted.clone()
        dist.all_reduce(ref)
        host.all_reduce(slotted)
        out[f"slotted{rep}"] = bool(torch.equal(slotted, ref))
    # reduce-scatter and all-gather (ZeRO-1/2's pair): in windows of the 1 KiB slot, and the gather into a buffer
    # whose own chunk is the shard itself
    for name, n in (("rs_small", 3 * 20), ("rs_windows", 3 * 500)):
        t = torch.randint(-50, 50, (n,), generator=g).float()
        ref = torch.empty(n // 3)
        dist.reduce_scatter(ref, list(t.chunk(3)))
        mine = torch.empty(n // 3)
        host.reduce_scatter(t, mine)
        out[name] = bool(torch.equal(mine, ref))
    for name, n in (("ag_small", 20), ("ag_windows", 700)):
        whole = torch.zeros(3 * n)
        shard = whole[rank * n:(rank + 1) * n]
        shard.copy_(torch.randn(n, generator=g))
        ref = [torch.empty(n) for _ in range(3)]
        dist.all_gather(ref, shard.clone())
        host.all_gather(shard, whole)
        out[name] = bool(torch.equal(whole, torch.cat(ref)))
    pair = dist.new_group([0, 1])
    if rank < 2:
        sub = HostReduce.open(pair, slot_bytes=4096, directory=here)
        assert sub is not None and sub.size == 2
        sub.direct_bytes = 0
        t = torch.randn(3000, generator=g)
        ref = t.clone()
        dist.all_reduce(ref, group=pair)
        host2 = t.clone()
        sub.all_reduce(host2)
        out["pair_equal"] = bool(torch.equal(host2, ref))
    out["missing_dir"] = HostReduce.open(dist.group.WORLD, directory=Path(tmp, "no", "such")) is None
    Path(tmp, f"coll{rank}.json").write_text(json.dumps(out))


def test_host_all_reduce_equals_gloos(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    spawn_ranks(_collectives, 3, tmp_path, str(tmp_path))
    for rank in range(3):
        r = json.loads((tmp_path / f"coll{rank}.json").read_text())
        assert r["left_in_dir"] == [], r  # removed once mapped by all three
        assert r["ints"]["equal"], r["ints"]
        assert r["direct_equal"], r
        assert r["slotted0"] and r["slotted1"], r
        for name in ("rs_small", "rs_windows", "ag_small", "ag_windows"):
            assert r[name], (name, r)
        for name, tol in (("random", 1e-6), ("tiny", 1e-6), ("bf16", 1e-2)):
            assert r[name]["max_err"] <= tol * max(1.0, r[name]["scale"]), (name, r[name])
        assert r["missing_dir"] is True
        if rank < 2:
            assert r["pair_equal"] is True
    assert not any((tmp_path / "shm").iterdir())


STEPS = 3


def _model() -> models.LoadedModel:
    return models.load("gpt-tiny", batch_size=8, seq_len=16, seed=0)


def _runs(build: str, seed: int, small: bool = False) -> Iterator[tuple[bool | str, Pipeline, list[float]]]:
    """The build trained ``STEPS`` steps through shared memory, then through gloo: each pipeline and its losses.

    gpt-tiny's gradients (0.45 MiB) are fewer bytes than an all-reduce takes through the mapping by default
    (:data:`~hpml_compile.runtime.sync.shm.DIRECT_BYTES`): it is made to take them; ``small`` adds a third run,
    shared memory on with the default (``"small"``).
    """
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, 256, (8, 16), generator=g) for _ in range(STEPS)]
    for shared in (True, False, *(("small",) if small else ())):
        loaded = _model()
        pipe = Pipeline.from_build(build, loaded.module, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                   shared_memory=bool(shared), events=False)
        assert pipe.comm is not None
        if shared is True:
            pipe.comm.direct_bytes = 0
        losses = [pipe.step((x,), torch.roll(x, -1, dims=1), loaded.loss_fn).item() for x in xs]
        assert pipe.comm is not None
        yield shared, pipe, losses


def _used(pipe: Pipeline) -> list[bool]:
    assert pipe.comm is not None
    return [v[1] is not None for v in pipe.comm._host_reduce.values()]


def _train(rank: int, world: int, build: str, out: str) -> None:
    report: dict[str, Any] = {}
    for shared, pipe, losses in _runs(build, 1, small=True):
        assert pipe.comm is not None
        grads = pipe.sync.buffer.grad_flat
        held = [v[1] for v in pipe.comm._host_reduce.values() if v[1] is not None]
        slot = held[0].own(grads.numel(), grads.dtype) if held else None
        report[str(shared)] = {"losses": losses, "used": _used(pipe),
                               "in_slot": slot is not None and slot.data_ptr() == grads.data_ptr(),
                               "grad_bytes": grads.numel() * grads.element_size(),
                               "grad_storage": grads.untyped_storage().nbytes(),
                               "grads_in_buffer": all(p.grad.untyped_storage().data_ptr() == grads.data_ptr()
                                                      for p in pipe.sync.buffer.params),
                               "params": [p.detach().clone().tolist() for p in pipe.parameters()][:3]}
    Path(out, f"train{rank}.json").write_text(json.dumps(report))


def _zero1(rank: int, world: int, build: str, out: str) -> None:
    report = {str(shared): {"losses": losses, "used": _used(pipe), "flat": pipe.sync.buffer.flat.tolist()[:2000]}
              for shared, pipe, losses in _runs(build, 2)}
    Path(out, f"zero1-{rank}.json").write_text(json.dumps(report))


def test_zero1_through_shared_memory_equals_gloo(tmp_path: Path) -> None:
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    build = tmp_path / "zero1"
    generate(gm, split_plan(gm, "gpt-tiny", 1, microbatches=2, replicas=[2], zero=1), build)
    spawn_ranks(_zero1, 2, tmp_path, str(build), str(tmp_path))
    for r in range(2):
        rep = json.loads((tmp_path / f"zero1-{r}.json").read_text())
        assert rep["True"]["used"] == [True] and rep["False"]["used"] == []
        assert rep["True"]["losses"] == rep["False"]["losses"]
        assert rep["True"]["flat"] == rep["False"]["flat"]  # the parameters after the last gather, bit for bit


def test_data_parallel_through_shared_memory_equals_gloo(tmp_path: Path) -> None:
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    build = tmp_path / "dp2"
    generate(gm, split_plan(gm, "gpt-tiny", 1, microbatches=2, replicas=[2]), build)
    spawn_ranks(_train, 2, tmp_path, str(build), str(tmp_path))
    reports = [json.loads((tmp_path / f"train{r}.json").read_text()) for r in range(2)]
    for r in reports:
        assert r["True"]["used"] == [True], r["True"]["used"]  # the stage's all-reduce went through the mapping
        assert r["False"]["used"] == [], r["False"]["used"]
        assert r["True"]["in_slot"] and not r["False"]["in_slot"]
        assert r["True"]["losses"] == r["False"]["losses"]
        assert r["True"]["params"] == r["False"]["params"]
        small = r["small"]  # by default a buffer this small goes through gloo and stays where it is: the same bits
        assert small["used"] == [] and not small["in_slot"] and small["losses"] == r["False"]["losses"], small
        assert small["params"] == r["False"]["params"]
        for how in ("True", "False", "small"):  # one gradient buffer, the parameters' .grad views of it (in the slot: a mapping
            assert r[how]["grads_in_buffer"], how  # of its own, of the gradients' bytes)
            assert r[how]["grad_storage"] == r[how]["grad_bytes"], (how, r[how])
    assert reports[0]["True"]["params"] == reports[1]["True"]["params"]
