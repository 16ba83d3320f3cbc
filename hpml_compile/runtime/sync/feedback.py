"""What a stage's replicas keep apart, in checkpoints: error feedback, and local SGD's diverged copies.

Top-K and PowerSGD (:mod:`.compress`) keep, per replica, the part of its
gradient that compression has not sent yet and add it to the next step's
(error feedback); PowerSGD also keeps its step count and warm-start factors.
A resumed run without them starts at zero error, re-draws PowerSGD's factors
and runs its two plain all-reduce steps again: it leaves the uninterrupted
run's path. A :class:`Feedback` is one rank's share in checkpoint form,
written and read by :mod:`.checkpoint` next to the parameters (plain tensors,
no pickle):

- **the error, by parameter name** (``comm.error.r<replica>of<d>.<name>``):
  each replica's residual sliced per parameter, in *gradient-sum* units (what
  the replicas' sum still owes: Top-K's error as it is, PowerSGD's divided by
  ``d``, since torch's hook keeps it in ``d``-times units). Keyed by name, it
  loads under another plan that moves the parameter to another stage. Under
  the same ``d`` each replica takes its own; under another ``d`` the new
  replica 0 takes the sum of every saved replica's error and the others start
  at zero: what error feedback guarantees (every gradient entry is applied
  once, now or later) holds for the sum over replicas, which is kept. A new
  plan that does not compress the stage holding a parameter drops its error,
  and :func:`.checkpoint.load_checkpoint` says so.
- **PowerSGD's step count and warm-start factors** (``P``, ``Q``): their
  layout follows the stage's parameters (grouped by shape inside torch's
  hook), so they are keyed by a digest of the stage's parameter names and
  sizes, the rank and ``d``; a plan whose stage differs re-draws them
  (torch's two plain all-reduce steps again) and says so.

Written here because torch keeps PowerSGD's state by pickling it whole
(``PowerSGDState.__getstate__``), which no checkpoint here does, in a layout
tied to one bucket of parameters; Top-K is ours.

**Local SGD's replicas** (:class:`.compress.LocalSGD`, ``Plan.sync_every =
H > 1``) step on their own gradients between two averages, so their
parameters, buffers and optimizer state differ there. The checkpoint keys them
by name (``model.<name>``, ``optim.<name>.<state>``), and DCP writes one copy
of a key that several ranks hold: alone, that kept one replica's state, and a
resumed run started with equal replicas (as after an average), not as the
uninterrupted run goes on. A :class:`Replica` (one per rank of a local SGD
stage, from :meth:`.stage.StageSync.state`) makes :mod:`.checkpoint` also write every
entry of the rank under a per-replica key (``comm.replica.r<replica>of<d>.``
followed by the entry's own key), always, not only between averages (simpler,
and the buffers, which are never averaged, differ at an average too); the
by-name copy stays, so that any plan can read the checkpoint. On a resume:

- **same replica count** and a :class:`Replica` for the rank: each replica
  reads its own copy instead of the by-name one, so the resumed run is the
  uninterrupted one, step for step (tests/dist/test_compress_dist.py);
- **another replica count**, or a plan that does not run local SGD on the
  stage that now holds the entry (a re-plan after a lost device, a run
  without ``--sync-every``): no replica's copy is more right than another,
  so every saved replica's copy is read and the rank starts from their
  average (parameters, buffers and optimizer state; exactly the copies where
  they agree), as if the replicas had averaged at the checkpoint, and the
  resume says so (:func:`merge_replicas`). Not an error, so that the closed
  loop can go on after losing a replica.

This is chosen over "checkpoint only at an average step" (the other simple
design): that loses the buffers, which are never averaged, and makes a user's
``--checkpoint-every`` depend on ``H``; the price here is ``d`` more copies of
the stage's state on disk (each rank writes its own, in parallel).

Example (one process, two replicas' keys as two ranks write them):
    >>> import torch
    >>> from hpml_compile.runtime.sync.compress import TopK
    >>> t = TopK(ratio=0.5, replicas=2); t.error = torch.tensor([1.0, 2.0, 3.0])
    >>> sorted(Feedback(t, ["w", "b"], [2, 1], replica=1).state())
    ['comm.error.r1of2.b', 'comm.error.r1of2.w']
    >>> list(Replica(1, 2).state({"model.w": torch.zeros(2)}))
    ['comm.replica.r1of2.model.w']
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence, Union

import torch
from torch import Tensor, nn

from .compress import PowerSGD, Reducer

__all__ = ["Feedback", "FEEDBACK_PREFIX", "error_key", "parse_error_key", "Replica", "CommState",
           "REPLICA_PREFIX", "replica_key", "parse_replica_key", "replica_reads", "merge_replicas"]

FEEDBACK_PREFIX = "comm."  # checkpoint keys of error-feedback state (see the module docstring)


_ERROR_KEY = re.compile(r"^" + re.escape(FEEDBACK_PREFIX) + r"error\.r(\d+)of(\d+)\.(.+)$")
REPLICA_PREFIX = f"{FEEDBACK_PREFIX}replica."  # checkpoint keys of local SGD's per-replica copies
_REPLICA_KEY = re.compile(r"^" + re.escape(REPLICA_PREFIX) + r"r(\d+)of(\d+)\.(.+)$")


def error_key(replica: int, replicas: int, name: str) -> str:
    """The checkpoint key of one replica's error for one parameter (``comm.error.r0of2.fc.weight``)."""
    return f"{FEEDBACK_PREFIX}error.r{replica}of{replicas}.{name}"


def parse_error_key(key: str) -> tuple[int, int, str] | None:
    """``(replica, replicas, parameter name)`` of an :func:`error_key`, None for any other key."""
    m = _ERROR_KEY.match(key)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def replica_key(replica: int, replicas: int, key: str) -> str:
    """The checkpoint key of one local SGD replica's copy of an entry (``comm.replica.r1of2.model.fc.weight``)."""
    return f"{REPLICA_PREFIX}r{replica}of{replicas}.{key}"


def parse_replica_key(key: str) -> tuple[int, int, str] | None:
    """``(replica, replicas, the entry's own key)`` of a :func:`replica_key`, None for any other key."""
    m = _REPLICA_KEY.match(key)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


@dataclass(frozen=True)
class Replica:
    """This rank's place among the replicas of a local SGD stage, whose copies differ between averages.

    Attributes:
        replica: this rank's replica of its stage.
        replicas: the stage's replica count ``d``.
    """

    replica: int
    replicas: int

    def state(self, entries: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This rank's checkpoint entries (``model.*``, ``optim.*``) again, under its per-replica keys."""
        return {replica_key(self.replica, self.replicas, k): v for k, v in entries.items()}

    def __str__(self) -> str:
        return f"replica {self.replica} of {self.replicas}"


def replica_reads(stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]], held: Iterable[str],
                  mine: Replica | None) -> dict[str, dict[str, Tensor]]:
    """What to read instead of each entry this rank holds that the checkpoint keeps per local SGD replica.

    Args:
        stored: the checkpoint's ``comm.`` keys -> shape and dtype.
        held: the entries this rank reads (``model.<name>``, ``optim.<name>.<state>``).
        mine: this rank's place among its stage's replicas; None where it runs no local SGD.

    Returns:
        entry -> {per-replica key: a tensor to read it into}: this replica's own copy when the checkpoint has
        one for it (the same replica count), else every saved replica's copy (to be averaged by
        :func:`merge_replicas`). Entries the checkpoint keeps only by name are absent.
    """
    copies: dict[str, list[str]] = {}
    for key in stored:
        parsed = parse_replica_key(key)
        if parsed is not None:
            copies.setdefault(parsed[2], []).append(key)
    out: dict[str, dict[str, Tensor]] = {}
    for entry in held:
        keys = copies.get(entry)
        if not keys:
            continue
        own = replica_key(mine.replica, mine.replicas, entry) if mine is not None else None
        chosen = [own] if own in keys else sorted(keys)
        out[entry] = {k: torch.empty(stored[k][0], dtype=stored[k][1]) for k in chosen if k is not None}
    return out


def merge_replicas(reads: Mapping[str, Mapping[str, Tensor]], mine: Replica | None
                   ) -> tuple[dict[str, Tensor], list[str]]:
    """Each entry's value from what :func:`replica_reads` asked for, once read.

    Args:
        reads: entry -> {per-replica key: the tensor read}.
        mine: this rank's place among its stage's replicas (None: no local SGD here).

    Returns:
        ``(entry -> value, notes)``: this replica's own copy; otherwise the saved replicas' copy where they
        agree and their mean where they differ (computed in float64; an integer entry that differs takes
        replica 0's), with a note for a person when any was averaged.
    """
    out: dict[str, Tensor] = {}
    averaged: list[str] = []
    counts: set[int] = set()
    for entry, got in reads.items():
        if mine is not None and replica_key(mine.replica, mine.replicas, entry) in got:
            out[entry] = got[replica_key(mine.replica, mine.replicas, entry)]
            continue
        counts.update(p[1] for k in got if (p := parse_replica_key(k)) is not None)
        values = [got[k] for k in sorted(got, key=lambda k: parse_replica_key(k) or (0, 0, ""))]
        if all(torch.equal(v, values[0]) for v in values[1:]):
            out[entry] = values[0]
        else:
            averaged.append(entry)
            out[entry] = (torch.stack([v.double() for v in values]).mean(0).to(values[0].dtype)
                          if values[0].is_floating_point() else values[0])
    notes = []
    if averaged:
        here = (f"this rank is {mine} of its stage" if mine is not None
                else "this rank's stage does not run local SGD")
        notes.append(f"taken between two local SGD averages by {'/'.join(map(str, sorted(counts)))} replicas, "
                     f"whose copies differ there, and {here}: it starts from their average for {len(averaged)} "
                     f"parameter, buffer and optimizer entries (e.g. {averaged[0]}), as if the replicas had "
                     "averaged at the checkpoint; the run goes on from there, not as the uninterrupted run would")
    return out, notes


@dataclass
class Feedback:
    """One rank's error-feedback state in checkpoint form (see the module docstring).

    Attributes:
        reducer: the stage's reducer (one that keeps an error: Top-K, PowerSGD).
        names: the stage's flat gradient's parameters, by their original names, in buffer order.
        sizes: their element counts.
        replica: this rank's replica of the stage.
        device: where the stage's gradients live (a loaded error goes there).
    """

    reducer: Reducer
    names: list[str]
    sizes: list[int]
    replica: int
    device: torch.device = torch.device("cpu")

    @property
    def replicas(self) -> int:
        return self.reducer.replicas

    @property
    def _layout(self) -> str:
        """The key prefix of the state whose layout follows the stage's parameters (PowerSGD's)."""
        kind = f"powersgd{self.reducer.rank}" if isinstance(self.reducer, PowerSGD) else type(self.reducer).__name__
        digest = hashlib.sha256(repr((self.names, self.sizes)).encode()).hexdigest()[:16]
        return f"{FEEDBACK_PREFIX}{kind}.{digest}.r{self.replica}of{self.replicas}."

    def state(self) -> dict[str, Tensor]:
        """What the checkpoint keeps of this rank's state: the error per parameter, and the layout's state."""
        out: dict[str, Tensor] = {}
        res = self.reducer.residual()
        if res is not None:
            offset = 0
            for name, n in zip(self.names, self.sizes):
                out[error_key(self.replica, self.replicas, name)] = res[offset:offset + n].detach().cpu().clone()
                offset += n
        out.update({self._layout + k: v for k, v in self.reducer.layout_state().items()})
        return out

    def wanted(self, stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Tensor]:
        """Tensors to read from a checkpoint holding ``stored`` (key -> shape and dtype): this replica's error
        (every saved replica's for replica 0 when the checkpoint's replica count differs), the layout's state."""
        mine = set(self.names)
        out: dict[str, Tensor] = {}
        for key, (shape, dtype) in stored.items():
            parsed = parse_error_key(key)
            if parsed is not None:
                r, d, name = parsed
                if name in mine and (r == self.replica if d == self.replicas else self.replica == 0):
                    out[key] = torch.empty(shape, dtype=dtype)
            elif key.startswith(self._layout):
                out[key] = torch.empty(shape, dtype=dtype)
        return out

    def load(self, got: Mapping[str, Tensor]) -> list[str]:
        """Take this rank's state from what :meth:`wanted` read; returns notes for a person on what was not
        carried as it was."""
        notes: list[str] = []
        by_name: dict[str, list[tuple[int, Tensor]]] = {}
        for key, value in got.items():
            parsed = parse_error_key(key)
            if parsed is not None:
                by_name.setdefault(parsed[2], []).append((parsed[1], value))
        if by_name:
            parts: list[Tensor] = []
            saved_d: set[int] = set()
            dtype = next(v for vs in by_name.values() for _, v in vs).dtype
            for name, n in zip(self.names, self.sizes):
                found = [v.reshape(-1) for _, v in by_name.get(name, [])]
                saved_d.update(d for d, _ in by_name.get(name, []))
                # one replica's own error as it was saved; several saved replicas' summed (another replica count)
                parts.append(found[0] if len(found) == 1 else torch.stack(found).sum(0) if found
                             else torch.zeros(n, dtype=dtype))
            self.reducer.set_residual(torch.cat(parts).to(self.device))
            missing = [n for n in self.names if n not in by_name]
            if saved_d - {self.replicas}:  # only replica 0 reads another replica count's errors (wanted)
                notes.append(f"error feedback saved by {'/'.join(map(str, sorted(saved_d)))} replicas, this stage "
                             f"has {self.replicas}: replica 0 takes their sum (what the replicas still owe is "
                             "kept), the others start at zero")
            if missing:
                notes.append(f"no error feedback saved for {len(missing)} of this stage's {len(self.names)} "
                             f"parameters (e.g. {missing[0]}): they start at zero error")
        layout = {k[len(self._layout):]: v for k, v in got.items() if k.startswith(self._layout)}
        if layout:
            self.reducer.load_layout_state({k: v.to(self.device) for k, v in layout.items()})
        elif isinstance(self.reducer, PowerSGD) and by_name:
            notes.append(f"no PowerSGD state for this stage's parameters and rank {self.reducer.rank} in the "
                         "checkpoint (another plan's stage, or another compression): its warm-start factors are "
                         f"drawn again and its first {PowerSGD.START} steps are plain all-reduces")
        return notes


CommState = Union[Feedback, Replica]  # what Pipeline.feedback() gives a checkpoint, one per reducer that needs it
