"""Collectives through shared memory between the CPU ranks of one host.

gloo moves a CPU rank's tensors to the other ranks of its own host through
TCP over loopback: every byte is copied into a socket, through the kernel and
out again, and summed on the way in a ring. On the 2-core development VM an
all-reduce of gpt-mini's 25 MiB of gradients between two ranks takes 23-26 ms
that way; through a shared mapping the same sum takes 12.5 ms (and a
one-element one 1.3 ms against gloo's 3.4; two gloo ranks timing both in a
``/tmp`` script). Why our own: torch ships no shared-memory
backend for CPU collectives; DeepSpeed's CPU all-reduce through shared memory
is a C++ op of its own build, made for its tensor-parallel inference, and
oneCCL's torch bindings are not on PyPI for this torch. This is a few tensor
copies and additions over one mapping, with the group's gloo barrier between
them.

How one all-reduce of ``n`` elements over ``d`` ranks runs (:meth:`HostReduce.all_reduce`):

1. each rank copies its tensor into its own slot of the mapping (or it is
   there already: :meth:`HostReduce.own`, where ZeRO-0's gradient buffer lives);
2. barrier; rank ``i`` sums the ``i``-th of ``d`` chunks over every slot, in
   slot order, into its own slot (each chunk is summed once, by one rank, so
   every rank ends with the same bits);
3. barrier; each rank copies every chunk's sum out of its owner's slot;
4. barrier (no rank writes its slot again before every peer has read it).

An all-reduce of fewer than :data:`DIRECT_BYTES` goes through gloo instead, one
all-reduce on the group (:attr:`HostReduce.direct_bytes`): there the meetings cost more than the
bytes, and gloo's one meeting beats the mapping's three (two gloo ranks on the
2-core VM, busy: 64 KiB 240 us against 740, 256 KiB 320 against 890, 1 MiB 580
against 1170, 4 MiB 3.2 ms against 2.8; a gradient buffer that small stays
where it is, :meth:`~.zero.FlatGrads.all_reduce`).

A reduce-scatter is steps 1-2 (each rank keeps its own chunk's sum) and a
barrier; an all-gather puts each rank's shard in its slot, meets, copies the
others' and meets again (:meth:`HostReduce.reduce_scatter`,
:meth:`HostReduce.all_gather`: ZeRO-1/2's pair). A tensor larger than a slot
goes in windows of a slot's size.

The mapping is a file under ``/dev/shm``, made by the group's first rank with
``O_EXCL`` and removed by it as soon as every member has mapped it: the memory
lives as long as a member holds it, and nothing is left behind however the
ranks end. Each slot is a mapping of its own, so a buffer held in one counts
its own bytes, not the group's. Where any member cannot make, fill or map it
(no ``/dev/shm``, too little room, members on different machines after all),
every member agrees to go on with gloo (:meth:`HostReduce.open` returns None).

Numerics: every element is summed in rank order. For two ranks that is the
sum gloo computes, bit for bit; for more, gloo's ring adds in another order,
so the two agree within float rounding.

Example (one rank: nothing to share, so no mapping):
    >>> HostReduce.eligible([0], {0: "h"}, {0: "cpu"})
    False
    >>> HostReduce.eligible([0, 1], {0: "h", 1: "h"}, {0: "cpu", 1: "cpu"})
    True
"""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ...memory import SHM_DIRECT_BYTES

__all__ = ["HostReduce", "SLOT_BYTES", "SHM_DIR", "DIRECT_BYTES"]

SLOT_BYTES = 64 << 20  # per rank at most: a larger tensor goes in pieces (2 ranks: 128 MiB of /dev/shm at most)
DIRECT_BYTES = SHM_DIRECT_BYTES  # an all-reduce of fewer bytes goes through gloo: one meeting, not three (see above)
SHM_DIR = Path("/dev/shm")
_NAME = 4096  # bytes of the path broadcast from the first rank (PATH_MAX)


class HostReduce:
    """A shared mapping over one group of CPU ranks on one host, and the collectives run through it.

    Build it with :meth:`open` (collective over ``group``); close it with :meth:`close`.

    Attributes:
        index: this rank's place in the group (0 ... ``size - 1``).
        size: the group's ranks, ``d``.
        slot_bytes: each rank's slot.
        path: where the mapping was made (already removed).
        direct_bytes: an all-reduce of fewer bytes goes through gloo (:data:`DIRECT_BYTES`; 0: none does).
    """

    def __init__(self, group: Any, index: int, slots: list[Tensor], path: str) -> None:
        self.group = group
        self.index = index
        self.size = len(slots)
        self._slots = slots  # uint8, one mapping each: a rank's own slot is a storage of its own (held_bytes)
        self.slot_bytes = int(slots[0].numel())
        self.path = path
        self.lent = False  # the slot holds a buffer of the caller's (own()): only all_reduce may use it
        self._meet = torch.zeros(1)
        self.direct_bytes = DIRECT_BYTES

    @staticmethod
    def eligible(members: Sequence[int], hosts: Mapping[int, str], kinds: Mapping[int, str]) -> bool:
        """Whether a group of these global ranks may share memory: two or more, all CPU, all on one host."""
        return len(members) > 1 and all(kinds[r] == "cpu" for r in members) and len({hosts[r] for r in members}) == 1

    @classmethod
    def open(cls, group: Any, slot_bytes: int = SLOT_BYTES, directory: Path | str = SHM_DIR) -> HostReduce | None:
        """Make the mapping for ``group`` (every member calls it at the same point: it is collective).

        Args:
            group: the members' gloo process group.
            slot_bytes: each rank's slot (at least 16 bytes). Slots start a page apart; each is mapped at its
                own length, so that a buffer held in one counts its own bytes (``held_bytes``).
            directory: where the first rank makes the file (a tmpfs: ``/dev/shm``).

        Returns:
            The mapping, or None on every member where any one of them could not make or map it.
        """
        size, index = dist.get_world_size(group), dist.get_rank(group)
        slot_bytes = max(16, int(slot_bytes))
        nbytes = size * _stride(slot_bytes)
        name = torch.zeros(_NAME, dtype=torch.uint8)
        token = torch.zeros(16, dtype=torch.uint8)  # what the first rank wrote: a member that reads it shares it
        slots = None
        if index == 0:
            path = _make(Path(directory), nbytes)
            raw = path.encode()
            if len(raw) > _NAME:  # longer than any path the system takes
                _remove(path)
                raw = b""
            if raw:
                slots = _map(path, size, slot_bytes)
            if slots is not None:
                name[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
                token.copy_(torch.tensor(list(uuid.uuid4().bytes), dtype=torch.uint8))
                slots[0][:16].copy_(token)
            elif raw:
                _remove(path)
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(name, src, group=group)
        dist.broadcast(token, src, group=group)
        path = bytes(name[name != 0].tolist()).decode()
        if index != 0 and path:
            slots = _map(path, size, slot_bytes)
        ok = torch.tensor([float(slots is not None and torch.equal(slots[0][:16], token))])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every member maps the same memory, or none uses it
        if index == 0 and path:
            _remove(path)  # mapped by all who could: the name is no longer needed
        dist.barrier(group=group)  # ... and gone when any member returns
        if not ok.item() or slots is None:
            return None
        return cls(group, index, slots, path)

    def own(self, numel: int, dtype: torch.dtype) -> Tensor | None:
        """This rank's slot as a buffer of ``numel`` elements, where it holds them (None where it does not).

        A tensor summed from there by :meth:`all_reduce` needs no copy into the slot first: the gradient
        buffer of a replicated stage lives there (:class:`~.zero.FlatGrads`).
        """
        width = torch.empty(0, dtype=dtype).element_size()
        if numel * width > self.slot_bytes:
            return None
        self.lent = True
        return self._slots[self.index][:numel * width].view(dtype)

    def close(self) -> None:
        """Drop this rank's hold on the mapping (the memory goes when the last hold on it does) and on the group
        (a gloo group closes its connections only when its last reference goes: a peer blocked on it is
        released then, as a failed step's re-forming needs)."""
        self._slots = []
        self.group = None

    def barrier(self, carry: Tensor | None = None) -> None:
        """Wait for every member: a one-element all-reduce on the group, the meeting the runtime's other
        collectives start with (:meth:`~.comm.DistComm._collective`); ``carry``: a small tensor to sum over the
        group instead (a :class:`~.comm.Rider`'s), which meets them as well."""
        dist.all_reduce(self._meet if carry is None else carry, group=self.group)

    def fits(self, t: Tensor) -> bool:
        """Whether ``t`` fits in one slot (the same answer on every member: the same sizes everywhere)."""
        return t.numel() * t.element_size() <= self.slot_bytes

    def elsewhere(self, t: Tensor) -> bool:
        """Whether ``t`` lies in this rank's slot, but not from its start (to be summed from a copy)."""
        start = self._slots[self.index].data_ptr()
        lo = t.data_ptr()
        return lo != start and start < lo + t.numel() * t.element_size() and lo < start + self.slot_bytes

    def stage(self, t: Tensor) -> None:
        """Put ``t`` (which :meth:`fits`) into this rank's slot, unless it is there already (:meth:`own`)."""
        mine = self._slots[self.index]
        if t.data_ptr() != mine.data_ptr():
            mine[:t.numel() * t.element_size()].view(t.dtype).copy_(t.view(-1))

    def all_reduce(self, t: Tensor, met: bool = False) -> None:
        """Sum ``t`` (contiguous, on the CPU) in place over the group (see the module docstring).

        ``met``: every member put its ``t`` (which :meth:`fits`) in its slot (:meth:`stage`), then met the others
        at :meth:`barrier`: the first copy and barrier are done. A tensor of fewer than :data:`DIRECT_BYTES` is
        summed by gloo's all-reduce on the group instead (:attr:`direct_bytes`).
        """
        flat = t.view(-1)
        if flat.numel() * flat.element_size() < self.direct_bytes:
            dist.all_reduce(flat, group=self.group)
            return
        width = flat.element_size()
        per = self.slot_bytes // width
        slots = [s[:per * width].view(flat.dtype) for s in self._slots]
        mine = slots[self.index]
        if not met and self.elsewhere(flat):  # a part of the slot elsewhere than at its start: summed from a copy
            tmp = flat.clone()
            self.all_reduce(tmp)
            flat.copy_(tmp)
            return
        d, i = self.size, self.index
        for lo in range(0, flat.numel(), per):
            piece = flat[lo:lo + per]
            m = piece.numel()
            bounds = [j * m // d for j in range(d + 1)]
            if not met:
                if piece.data_ptr() != mine.data_ptr():  # else it is already there (own())
                    mine[:m].copy_(piece)
                self.barrier()
            a, b = bounds[i], bounds[i + 1]
            if b > a:
                own = piece[a:b]  # the chunk's sum in slot order, then published in the slot
                if d == 2:  # in place even where ``own`` is this rank's slot: each element read, then written
                    torch.add(slots[0][a:b], slots[1][a:b], out=own)
                else:  # a third slot may be ``own`` itself: summed aside, not over an addend still to come
                    acc = torch.add(slots[0][a:b], slots[1][a:b])
                    for j in range(2, d):
                        acc.add_(slots[j][a:b])
                    own.copy_(acc)
                if own.data_ptr() != mine.data_ptr() + a * width:
                    mine[a:b].copy_(own)
            self.barrier()
            for j in range(d):
                if j != i and bounds[j + 1] > bounds[j]:
                    piece[bounds[j]:bounds[j + 1]].copy_(slots[j][bounds[j]:bounds[j + 1]])
            self.barrier()


    def reduce_scatter(self, t: Tensor, out: Tensor) -> None:
        """``out`` = this rank's chunk (the ``index``-th of ``size`` equal ones) of ``t`` summed over the group.

        Each rank puts a window of every chunk into its slot (``size`` windows side by side), the ranks meet, each
        sums its own chunk's window over the slots in slot order into ``out``, and meet again before the slots
        are written again: two barriers a window (one where the whole tensor fits in a slot's windows).
        """
        flat, d, i = t.view(-1), self.size, self.index
        c = flat.numel() // d
        width = flat.element_size()
        w = max(1, self.slot_bytes // width // d)
        slots = [s[:(self.slot_bytes // width) * width].view(flat.dtype) for s in self._slots]
        mine = slots[i]
        for o in range(0, c, w):
            n = min(w, c - o)
            for j in range(d):
                mine[j * n:(j + 1) * n].copy_(flat[j * c + o:j * c + o + n])
            self.barrier()
            torch.add(slots[0][i * n:(i + 1) * n], slots[1][i * n:(i + 1) * n], out=out[o:o + n])
            for j in range(2, d):
                out[o:o + n].add_(slots[j][i * n:(i + 1) * n])
            self.barrier()

    def all_gather(self, shard: Tensor, out: Tensor) -> None:
        """``out`` (``size`` chunks, each the size of ``shard``) gets every rank's ``shard``, in rank order.

        ``shard`` may be ``out``'s own chunk (read before anything is written there). Each rank puts a window of its
        shard in its slot, the ranks meet, each copies the others' windows, and they meet again.
        """
        src, dst, d, i = shard.reshape(-1), out.view(-1), self.size, self.index
        c = src.numel()
        width = src.element_size()
        w = max(1, self.slot_bytes // width)
        slots = [s[:w * width].view(src.dtype) for s in self._slots]
        if src.data_ptr() != dst[i * c:].data_ptr():
            dst[i * c:(i + 1) * c].copy_(src)
        for o in range(0, c, w):
            n = min(w, c - o)
            slots[i][:n].copy_(src[o:o + n])
            self.barrier()
            for j in range(d):
                if j != i:
                    dst[j * c + o:j * c + o + n].copy_(slots[j][:n])
            self.barrier()


def _make(directory: Path, nbytes: int) -> str:
    """A new file of ``nbytes`` in ``directory`` (its space reserved), or "" where it cannot be made."""
    path = str(directory / f"hpml-compile-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return ""
    try:
        os.posix_fallocate(fd, 0, nbytes)  # the room now, or ENOSPC now (not SIGBUS at a later write)
    except OSError:
        os.close(fd)
        _remove(path)
        return ""
    os.close(fd)
    return path


def _stride(slot_bytes: int) -> int:
    """Where one slot starts after the last in the file: a mapping starts on a page."""
    return -(-slot_bytes // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY


def _map(path: str, size: int, slot_bytes: int) -> list[Tensor] | None:
    """The file at ``path`` (``size`` slots of ``slot_bytes``) mapped shared, one mapping per slot, or None.

    Only an existing file of that size: a rank on another machine opens nothing rather than a file of its own.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size * _stride(slot_bytes):
            return None
        maps = [mmap.mmap(fd, slot_bytes, flags=mmap.MAP_SHARED, offset=j * _stride(slot_bytes))
                for j in range(size)]
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)  # the mappings stay
    return [torch.frombuffer(m, dtype=torch.uint8) for m in maps]  # each tensor holds its mapping


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
