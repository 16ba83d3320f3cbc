"""A replica that joins a running job at a step boundary: announced in the job's store, agreed, given state by a peer.

The counterpart of going on without a lost replica (:mod:`.members`): a process started for the same build and
the same store (``Pipeline.from_build(..., live=True, join=True)``, or ``join="cpu1"`` to name its device) takes
a ticket, beats like the others and writes what it asks for. Nothing new runs; the job's store carries it all:

- every rank's heartbeat thread reads the ticket count (:data:`.members.JOIN_TICKETS`) with each beat, so a
  step boundary costs one store operation: :meth:`Door.boundary` proposes ``"<step>:<tickets seen>"`` with
  ``compare_set`` on one key, expecting the value the ranks agreed at the boundary before. The first rank there
  sets it and every other one reads back that same value, so all of them let in the same joiners at the same
  boundary (no rank can reach the next boundary before every rank has left this one: each step ends with an
  all-reduce over every rank);
- the joiners let in are placed (:func:`with_replica`): on the device named, or the device a lost replica had,
  in the stage whose device it is (a device the plan never used: the replicated stage short of the most
  replicas); a plan or stage that cannot take one (tensor parallelism, a ZeRO shard, compressed or local-SGD
  gradients, a stage the plan does not replicate, a device of another kind, in use or unknown) refuses it by
  name, and the others go on as they were;
- one decision per boundary (the new members in rank order, every stage's devices and rows, the generation) is
  written with ``compare_set`` under each joiner's ticket and read by every rank; all open that generation of
  the group, and the first replica of the joined stage sends the stage's parameters and buffers, the
  optimizer's state, the loss scale and the RNG state to each joiner (:func:`send_state`,
  :func:`receive_state`) as one safetensors blob: tensors and JSON, never a pickle.

Each stage's rows are split evenly over its replicas (the gradient stays the batch mean, so the run computes
what it would have on any split). A joiner lost while it is let in fails the running ranks' boundary as a lost
rank fails a step, and they go on without it (:mod:`.members`): at once where the group had formed with it,
after the group's time-out (``RetryPolicy.timeout_s``: gloo waits that long for every rank) where it had not.

Example:
    >>> from hpml_compile.plan import Plan, Schedule, Stage
    >>> from hpml_compile.cluster import builtin_cluster
    >>> three = (Stage(0, ("cpu0", "cpu1", "cpu2"), ("x",)),)
    >>> full = Plan("mlp", builtin_cluster("local-cpu-3"), Schedule.GPIPE, 1, three)
    >>> left = Plan("mlp", full.cluster, Schedule.GPIPE, 1, (Stage(0, ("cpu0", "cpu2"), ("x",), rows=(6, 6)),))
    >>> plan, k, dev = with_replica(left, full, None, 12)
    >>> (k, dev, plan.stages[0].devices, plan.stages[0].rows)
    (0, 'cpu1', ('cpu0', 'cpu2', 'cpu1'), (4, 4, 4))
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load, save as st_save

from ...errors import JoinRefused
from ...plan import Plan
from ...schedule import RankActions, deferral, relower, stage_ranks
from .members import JOIN_TICKETS

if TYPE_CHECKING:
    from .pipeline import Pipeline

__all__ = ["JoinRefused", "Grant", "Door", "announce", "ask", "wait_grant", "joined_actions", "with_replica",
           "send_state", "receive_state"]

_BOUNDARY = "hpml/join/boundary"


def _ask_key(ticket: int) -> str:
    return f"hpml/join/ask/{ticket}"


def _grant_key(ticket: int) -> str:
    return f"hpml/join/grant/{ticket}"


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class Grant:
    """One boundary's decision, the same for every rank and joiner.

    Attributes:
        step: the steps completed at the boundary.
        boundary: the agreed value of the boundary key there (the next boundary's ``compare_set`` expects it).
        generation: the group generation the ranks open with the joiners.
        members: the job ranks of the new group, in rank order (empty: nobody let in).
        devices: each stage's devices in the new plan.
        rows: each stage's rows per replica in the new plan.
        events: whether the running ranks record events (a joiner does as they do: the clock alignment is a
            collective).
        refused: ticket -> why it was refused.
    """

    step: int
    boundary: str
    generation: int
    members: list[int]
    devices: list[list[str]]
    rows: list[list[int]]
    events: bool
    refused: dict[str, str]

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Grant":
        return cls(**json.loads(text))

    def plan(self, plan: Plan) -> Plan:
        """``plan`` with this decision's devices and rows."""
        return replace(plan, stages=tuple(replace(st, devices=tuple(d), rows=tuple(r))
                                          for st, d, r in zip(plan.stages, self.devices, self.rows)))


def announce(store: Any, world: int) -> tuple[int, int]:
    """Take a ticket: ``(ticket, job rank)``, the job rank one no rank of the job had (``world`` and up).

    The caller starts its heartbeat under that job rank, then calls :func:`ask` (the running ranks read the ask
    only once the ticket count has moved, and wait for it).
    """
    ticket = int(store.add(JOIN_TICKETS, 1))
    return ticket, world + ticket - 1


def ask(store: Any, ticket: int, me: int, device: str | None) -> None:
    """Write what joiner ``ticket`` (job rank ``me``) asks for: a device (None: the one a lost replica had)."""
    store.set(_ask_key(ticket), json.dumps({"rank": me, "device": device}))


def wait_grant(store: Any, ticket: int, timeout_s: float) -> Grant:
    """The decision that lets joiner ``ticket`` in.

    Raises:
        JoinRefused: the running ranks refused it (their reason), or none took it in ``timeout_s`` (no job runs
            on this store, or it is not live).
    """
    key, t0 = _grant_key(ticket), time.monotonic()
    while not store.check([key]):
        if time.monotonic() - t0 > timeout_s:
            raise JoinRefused(f"no running rank took this process in within {timeout_s:g} s: start it for the store "
                              "of a job whose ranks run live (Pipeline.from_build(..., live=True))")
        time.sleep(0.02)
    grant = Grant.from_json(_text(store.get(key)))
    if str(ticket) in grant.refused:
        raise JoinRefused(grant.refused[str(ticket)])
    return grant


def _even(rows: int, n: int) -> tuple[int, ...]:
    return tuple(rows // n + (j < rows % n) for j in range(n))


def _refusal(plan: Plan, generated: Plan, k: int, device: str) -> str | None:
    """Why stage ``k`` of ``plan`` cannot take a replica on ``device`` (None: it can)."""
    st = plan.stages[k]
    if len(generated.stages[k].devices) < 2:
        return f"stage {k} is not replicated by the plan (one device, {generated.stages[k].devices[0]}): a replica " \
               "cannot join it; compile for more devices to replicate it"
    if st.tp > 1:
        return f"stage {k} runs tensor parallelism: a joining replica would need a group of {st.tp} devices"
    if int(st.zero):
        return f"stage {k} shards its optimizer state over its replicas (ZeRO-{int(st.zero)}): a joining replica " \
               "would need the shards cut again; only ZeRO-0 stages take a replica in place"
    if st.compress:
        return f"stage {k} compresses its gradients ({st.compress}): a joining replica has no error feedback"
    if plan.sync_every > 1:
        return f"the replicas synchronise every {plan.sync_every} steps (local SGD): a joining replica cannot take " \
               "another replica's drift"
    if plan.cluster.device(device).is_cpu != plan.cluster.device(st.devices[0]).is_cpu:
        return f"{device} is a {plan.cluster.device(device).kind}, stage {k} runs on " \
               f"{plan.cluster.device(st.devices[0]).kind} devices"
    return None


def with_replica(plan: Plan, generated: Plan, device: str | None, microbatch_rows: int) -> tuple[Plan, int, str]:
    """``plan`` with one more replica: ``(new plan, its stage, its device)``.

    Args:
        plan: the running plan.
        generated: the plan the build was made for (the devices each stage had).
        device: the device asked for; None: the first device of ``generated`` that ``plan`` no longer uses.
        microbatch_rows: the rows of one microbatch (split evenly over the stage's replicas).

    Raises:
        JoinRefused: no place for it (see the module docstring).
    """
    if any(st.tp > 1 for st in plan.stages):
        raise JoinRefused("the plan runs tensor parallelism: a replica cannot join it in place; restart the job on "
                          "the new devices")
    used = {d for st in plan.stages for d in st.devices}
    names = [d.name for d in plan.cluster.devices]
    if device is None:
        free = [d for st in generated.stages if len(st.devices) > 1 for d in st.devices if d not in used]
        if not free:
            raise JoinRefused(f"every device of the plan's replicated stages is in use ({', '.join(sorted(used))}): "
                              f"name a free device of cluster {plan.cluster.name} to join on "
                              f"({', '.join(d for d in names if d not in used) or 'none is free'})")
        device = free[0]
    if device not in names:
        raise JoinRefused(f"device {device!r} is not in cluster {plan.cluster.name} (devices {', '.join(names)})")
    if device in used:
        raise JoinRefused(f"device {device} already runs a rank of the job: name a free one "
                          f"({', '.join(d for d in names if d not in used) or 'none is free'})")
    home = [k for k, st in enumerate(generated.stages) if device in st.devices]
    if home:
        k = home[0]
    else:  # a device the plan never used: the replicated stage short of the most replicas
        short = [(len(plan.stages[j].devices) - len(st.devices), j) for j, st in enumerate(generated.stages)
                 if len(st.devices) > 1]
        if not short:
            raise JoinRefused("the plan replicates no stage: a replica cannot join it; compile for more devices")
        k = min(short)[1]
    why = _refusal(plan, generated, k, device)
    if why is not None:
        raise JoinRefused(why)
    st = plan.stages[k]
    n = len(st.devices) + 1
    if microbatch_rows < n:
        raise JoinRefused(f"stage {k}: a microbatch of {microbatch_rows} rows cannot be split over {n} replicas")
    stages = list(plan.stages)
    stages[k] = replace(st, devices=(*st.devices, device), rows=_even(microbatch_rows, n))
    return replace(plan, stages=tuple(stages)), k, device


def joined_actions(generated: Sequence[RankActions], generated_plan: Plan, plan: Plan) -> list[RankActions]:
    """The build's action lists lowered again for ``plan``'s replicas (each stage's first list is what counts)."""
    first = [rs[0] for rs in stage_ranks(generated_plan)]
    lists = [generated[first[k]] for k, st in enumerate(plan.stages) for _ in st.devices]
    return relower(lists, [len(st.devices) for st in plan.stages], plan.schedule, plan.microbatches, deferral(plan))


class Door:
    """The running ranks' side: at each step boundary, whether joiners come in, and where.

    Args:
        store: the job's store.
        generated: the plan the build was made for.
        microbatch_rows: the rows of one microbatch.
    """

    def __init__(self, store: Any, generated: Plan, microbatch_rows: int) -> None:
        self._store, self._generated, self._rows = store, generated, microbatch_rows
        self.agreed = ""  # the boundary key's value the ranks agreed last
        self.handled = 0  # tickets let in or refused
        self.step = -1  # the boundary agreed last: one decision each (a step run again does not ask twice)

    def adopt(self, grant: Grant) -> None:
        """Start from ``grant``'s boundary (a joiner's door: the ranks it joined decided that one already)."""
        self.agreed, self.handled, self.step = grant.boundary, int(grant.boundary.rpartition(":")[2]), grant.step

    def boundary(self, step: int, seen: int, plan: Plan, members: list[int], generation: int,
                 events: bool, refuse: str | None = None) -> Grant | None:
        """Agree at boundary ``step`` (every running rank calls it); the decision when tickets are let in or refused.

        Args:
            step: the steps completed.
            seen: the tickets this rank's heartbeat has seen.
            plan: the running plan.
            members: the job ranks of the running group, in rank order.
            generation: the running group's generation.
            events: whether the ranks record events.
            refuse: why the running ranks take no joiner at all (None: each is placed or refused on its own).
        """
        if step == self.step:
            return None
        won = _text(self._store.compare_set(_BOUNDARY, self.agreed, f"{step}:{max(seen, self.handled)}"))
        self.agreed, self.step = won, step
        upto = int(won.rpartition(":")[2])
        if upto <= self.handled:
            return None
        refused: dict[str, str] = {}
        for ticket in range(self.handled + 1, upto + 1):
            want = json.loads(_text(self._store.get(_ask_key(ticket))))
            try:
                if refuse is not None:
                    raise JoinRefused(refuse)
                joined, k, _ = with_replica(plan, self._generated, want["device"], self._rows)
            except JoinRefused as e:
                refused[str(ticket)] = str(e)
                continue
            ranks = stage_ranks(plan)
            members = [m for j in range(len(ranks)) for m in
                       [*(members[r] for r in ranks[j]), *([want["rank"]] if j == k else [])]]
            plan = joined
        grant = Grant(step, won, generation + 1, members, [list(st.devices) for st in plan.stages],
                      [list(st.rows) for st in plan.stages], events, refused)
        out = grant.to_json()
        for ticket in range(self.handled + 1, upto + 1):  # one decision: the first rank's, read back by all
            out = _text(self._store.compare_set(_grant_key(ticket), "", out))
        self.handled = upto
        return Grant.from_json(out)


def send_state(pipe: "Pipeline", to: Sequence[int]) -> None:
    """Send this rank's stage state to the ranks ``to`` (the joiners of its stage; this rank is its first replica).

    Point to point on the new group: the other replicas, which hold the same state, take no part.
    """
    blob = torch.frombuffer(bytearray(_pack(pipe)), dtype=torch.uint8)
    size = torch.tensor([blob.numel()], dtype=torch.int64)
    for rank in to:
        dist.send(size, dst=rank)
        dist.send(blob, dst=rank)


def receive_state(pipe: "Pipeline", src: int) -> None:
    """Take the stage's state from rank ``src`` (a joiner's side of :func:`send_state`)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src)
    blob = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.recv(blob, src=src)
    _unpack(pipe, bytes(blob.numpy()))


def _pack(pipe: "Pipeline") -> bytes:
    """This rank's stage state as safetensors bytes (tensors by name, the rest as JSON metadata)."""
    stage = pipe.stages[pipe.stage_index]
    tensors = {f"m/{n}": v.detach().cpu().contiguous().clone() for n, v in stage.state_dict().items()}
    meta: dict[str, Any] = {}
    if pipe.optimizer is not None:
        sd = pipe.optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for idx, state in sd["state"].items():
            for key, v in state.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"o/{idx}/{key}"] = v.detach().cpu().contiguous().clone()
                else:
                    scalars.setdefault(str(idx), {})[key] = v
        meta["opt_scalars"] = json.dumps(scalars)
        meta["param_groups"] = json.dumps(sd["param_groups"], default=lambda o: o.tolist())
    if pipe.scaler is not None:
        tensors["scaler"] = pipe.scaler.state_tensor().cpu()
    tensors["rng/cpu"] = torch.get_rng_state()
    if pipe.device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(pipe.device)
    return st_save(tensors, metadata=meta)


def _unpack(pipe: "Pipeline", blob: bytes) -> None:
    """Load :func:`_pack`'s bytes into this rank's stage, optimizer, scaler and RNG."""
    (n,) = struct.unpack("<Q", blob[:8])  # safetensors: an 8-byte header length, the JSON header, the data
    meta = json.loads(blob[8:8 + n]).get("__metadata__", {})
    tensors = st_load(blob)
    stage = pipe.stages[pipe.stage_index]
    stage.load_state_dict({k[2:]: v for k, v in tensors.items() if k.startswith("m/")}, strict=True)
    if pipe.optimizer is not None:
        state: dict[int, dict[str, Any]] = {}
        for name, v in tensors.items():
            if name.startswith("o/"):
                _, idx, key = name.split("/", 2)
                state.setdefault(int(idx), {})[key] = v
        for idx, extra in json.loads(meta["opt_scalars"]).items():
            state.setdefault(int(idx), {}).update(extra)
        pipe.optimizer.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
    if pipe.scaler is not None:
        pipe.scaler.load_state_tensor(tensors["scaler"])
    torch.set_rng_state(tensors["rng/cpu"])
    if "rng/cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng/cuda"], pipe.device)
