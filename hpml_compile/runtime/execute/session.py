"""The process group of a pipeline: opened on torchrun's store, re-opened after a transient failure.

Launch and rendezvous are torchrun's (``torch.distributed.run``): a rank
started by it finds ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``
in its environment, and torch's own ``env://`` rendezvous hands back the
store (the agent's TCPStore). Tests started with ``torch.multiprocessing``
use a ``file://`` store instead. Nothing here replaces either.

What torch lacks, and this adds: a *generation* of the process group. gloo
cannot retry a send, a receive or a collective in place (a time-out closes
the pair), so when a step fails with a transient error (:func:`~.comm.is_transient`)
every rank tears its group down, which makes every peer's pending operation
fail at once (measured: within ~10 ms on localhost; but a rank with an async
collective of its own still pending, a prefetched parameter gather, waits in
the teardown for it to finish or reach the groups' time-out, the session's:
tests/dist/test_zero_retry_dist.py), waits a back-off, and
initialises generation ``g + 1`` on the same store under the prefix
``hpml/gen<g+1>/``; the pipeline then re-runs the step from the same
parameters. Ranks check that they all re-run the same step before going on.
A rank that really died never joins the new generation: the others fail
after ``RetryPolicy.rejoin_timeout_s`` with a message saying so, and
torchrun's agent (``--max-restarts``) takes over. A *live* session
(``live=True``, ranks not started by torchrun's agent, which would kill the
survivors) tells the dead from the slow by heartbeats in the same store
(:mod:`.members`): the survivors agree who is left, :meth:`Session.reopen`
raises :class:`RanksLost`, and :meth:`Session.shrink` opens the next
generation on the survivors alone, in the same processes. A process started
later for the same store (``join``) asks to come in: the running ranks let it
in at a step boundary (:mod:`.join`) and :meth:`Session.grow` opens the next
generation with it.

Example:
    >>> p = RetryPolicy(attempts=3, backoff_s=0.5)
    >>> [p.delay(a) for a in range(3)]
    [0.5, 1.0, 2.0]
"""

from __future__ import annotations

import datetime
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from ...errors import CommFailure, RanksLost
from ..sync.comm import Backend, is_transient
from .join import Grant, announce, ask, wait_grant
from .members import Heartbeat, agree_survivors

__all__ = ["RetryPolicy", "Session", "CommFailure", "RanksLost", "env_rank"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How transient communication errors are retried.

    Attributes:
        attempts: tries per step (1: no retry).
        backoff_s: wait before the first retry; doubled (``factor``) each time.
        factor: back-off growth.
        rejoin_timeout_s: how long a rank waits for the others to re-form the process group.
        timeout_s: time-out of every operation of the process group (and of the sub-groups a pipeline makes on it).
    """

    attempts: int = 3
    backoff_s: float = 0.5
    factor: float = 2.0
    rejoin_timeout_s: float = 120.0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0 or self.factor < 1:
            raise ValueError(f"RetryPolicy: attempts >= 1, backoff_s >= 0, factor >= 1; got {self}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt + 1``."""
        return self.backoff_s * self.factor ** attempt


def env_rank() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_world_size)`` from torchrun's environment, or None outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


class Session:
    """Owns (or borrows) the default process group.

    Args:
        init_method: ``env://`` (torchrun) or ``file:///path`` (torch.multiprocessing).
        rank: this rank (None: from the environment).
        world_size: the world size (None: from the environment).
        policy: the retry policy.
        log: where retry notices go.
        live: a lost rank is answered in place (see the module docstring).
        join: join a running live job as a new replica (:mod:`.join`): True on the device a lost replica had,
            or the name of the device; ``world_size`` is then the build's device count and ``rank`` is not given.
            The session opens the group's next generation with the running ranks; :attr:`grant` says where.

    Raises:
        JoinRefused: with ``join``, the running ranks refused this process (their reason).
    """

    def __init__(self, init_method: str = "env://", rank: int | None = None, world_size: int | None = None,
                 policy: RetryPolicy = RetryPolicy(), log: Callable[[str], None] | None = None,
                 live: bool = False, join: str | bool = False) -> None:
        self.policy = policy
        self.generation = 0
        self.retries = 0
        self._log = log or (lambda line: None)
        self.owned = not dist.is_initialized()
        self._store: Any = None
        self._heartbeat: Heartbeat | None = None
        self.grant: Grant | None = None
        if join is not False and (not self.owned or world_size is None or rank is not None):
            raise CommFailure("a joining session opens its own group for the build's device count: give it an "
                              "init_method and world_size (no rank), with no process group initialised before")
        if not self.owned:  # the user's script made the group: use it, and never tear it down
            if live:
                raise CommFailure("a live session re-forms the process group without lost ranks, so it must open "
                                  "the group itself: give it an init_method and do not initialise one before")
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.members = list(range(self.world_size))
            return
        if join is not False:  # never rank 0 of the rendezvous: that one hosts a TCP store
            assert world_size is not None
            self._store = self._with_retry("rendezvous", lambda: next(dist.rendezvous(init_method, world_size,
                                                                                      world_size))[0])
            self._join(world_size, None if join is True else str(join))
            return
        self._store, self.rank, self.world_size = self._with_retry(
            "rendezvous", lambda: next(dist.rendezvous(init_method, rank if rank is not None else -1,
                                                       world_size if world_size is not None else -1)))
        self.members = list(range(self.world_size))  # the job ranks (as started) of this group's ranks, in order
        self.start_rank = self.rank
        if live:  # the others tell a lost rank from a slow one by its beat (:mod:`.members`)
            self._heartbeat = Heartbeat(self._store, self.rank)
        self._open()

    def _join(self, world: int, device: str | None) -> None:
        """Ask the running ranks in for a place, beat, and open the generation they decided (:mod:`.join`)."""
        ticket, self.start_rank = announce(self._store, world)
        self._heartbeat = Heartbeat(self._store, self.start_rank)  # beating before the others can count on it
        ask(self._store, ticket, self.start_rank, device)
        where = device or "the device of a lost replica"
        self._log(f"rank {self.start_rank}: asked to join the running job on {where}")
        try:
            self.grant = grant = wait_grant(self._store, ticket, self.policy.rejoin_timeout_s)
        except Exception:
            self.close()
            raise
        self.grow(grant.members, grant.generation, grant.step)

    def grow(self, members: list[int], generation: int, step: int) -> None:
        """Open generation ``generation`` of the group on ``members`` (job ranks, in rank order), joiners included.

        Args:
            members: the job ranks of the new group; this session's among them.
            generation: the generation the decision named (the same on every rank).
            step: the steps completed (every rank and joiner must be at the same).

        Raises:
            CommFailure: the group did not form (a joiner died before it), or the ranks are at different steps.
        """
        if dist.is_initialized():  # a running rank's group: the next generation replaces it
            dist.destroy_process_group()
        self.members, self.generation = list(members), generation
        self.rank, self.world_size = self.members.index(self.start_rank), len(self.members)
        if self._rejoin(step, None) is not None:
            raise CommFailure(f"step {step}: a joining rank found the others at another step")

    @property
    def store(self) -> Any:
        """The job's store (None for a group this session borrows)."""
        return self._store

    @property
    def joiners(self) -> int:
        """How many processes have asked to join so far, as this rank's last beat read (0 when not live)."""
        return self._heartbeat.joiners if self._heartbeat is not None else 0

    @property
    def live(self) -> bool:
        """Whether a lost rank is answered in place (the survivors go on without it) rather than by a restart."""
        return self._heartbeat is not None

    @property
    def can_retry(self) -> bool:
        """Whether a failed step can re-form the group (only a group this session made)."""
        return self.owned and self.policy.attempts > 1

    def _with_retry(self, what: str, fn: Callable[[], T]) -> T:
        for attempt in range(self.policy.attempts):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 -- classified just below
                if not is_transient(e) or attempt + 1 == self.policy.attempts:
                    raise
                wait = self.policy.delay(attempt)
                self._log(f"rank {os.environ.get('RANK', '?')}: {what} failed ({str(e).splitlines()[0][:120]}); "
                          f"retrying in {wait:g} s")
                time.sleep(wait)
        raise AssertionError("unreachable")

    @property
    def timeout(self) -> datetime.timedelta | None:
        """The time-out of every operation of a group this session made, the sub-groups a pipeline makes on it
        included (:func:`~.comm.make_groups`); None for a group it borrows (the script's: its own choice)."""
        return datetime.timedelta(seconds=self.policy.timeout_s) if self.owned else None

    def _open(self) -> None:
        timeout = datetime.timedelta(seconds=self.policy.timeout_s)
        store = dist.PrefixStore(f"hpml/gen{self.generation}/", self._store)
        self._with_retry("process group", lambda: dist.init_process_group(
            Backend.GLOO.value, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout))

    def reopen(self, step: int, agreed_loss: float | None = None) -> float | None:
        """Tear the group down and form the next generation; all ranks must be re-running ``step``, or be one
        step apart after a loss agreement that reached some ranks and not others.

        The loss agreement (the all-reduce of the loss and the batch check before any optimizer step) is where a
        step commits. Its all-reduce can complete on one rank and fail on another (the failing rank's share went
        out; the answer did not come back): the first steps its optimizer and goes on to the next step, the second
        does not know whether anyone agreed. After re-forming, the ranks compare steps: equal, nobody committed
        and the step is run again; one apart, the ranks ahead committed ``step`` with every rank's share, so a rank
        behind may take the update too (its gradients are synchronised: the agreement comes after every sync).
        The ranks ahead send the agreed loss sum for that, and this returns it to a rank behind.

        Args:
            step: the steps this rank has completed (the step it re-runs, from 0).
            agreed_loss: on a rank whose last step committed, that step's agreed loss sum (sent to a rank behind).

        Returns:
            None on ranks at the newest step; on a rank one step behind, the agreed loss sum of its step.

        Raises:
            CommFailure: if the group is not this session's, the others do not
                rejoin in time, or they are more than one step apart.
        """
        if not self.owned:
            raise CommFailure("the process group belongs to your script (it was initialised before compile), so "
                              "a failed step cannot be retried; let hpml_compile.compile create it")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                dist.destroy_process_group()  # makes every peer's pending operation fail now
            except Exception:  # noqa: BLE001 -- a broken group may fail to close; it is gone either way
                pass
        self.generation += 1
        self.retries += 1
        if self._heartbeat is not None:  # who is left? (the same answer on every rank that is)
            survivors = [self.members.index(r) for r in agree_survivors(
                self._store, self.generation, self.start_rank, self.members, timeout_s=self.policy.rejoin_timeout_s)]
            if len(survivors) < self.world_size:
                raise RanksLost(step, [r for r in range(self.world_size) if r not in survivors])
        return self._rejoin(step, agreed_loss)

    def shrink(self, lost: list[int], step: int, agreed_loss: float | None = None) -> float | None:
        """Open the next generation of the group on the ranks left after :class:`RanksLost` (same processes).

        Args:
            lost: the ranks of the current group that are gone (:attr:`RanksLost.lost`).
            step: the steps this rank has completed.
            agreed_loss: as for :meth:`reopen`.

        Returns:
            As :meth:`reopen`.

        Raises:
            CommFailure: as :meth:`reopen`.
        """
        keep = [r for r in range(self.world_size) if r not in lost]
        self.rank, self.world_size = keep.index(self.rank), len(keep)
        self.members = [self.members[r] for r in keep]
        self.generation += 1  # a fresh prefix: the round's keys and the failed generation's stay apart
        return self._rejoin(step, agreed_loss)

    def _rejoin(self, step: int, agreed_loss: float | None) -> float | None:
        """Open the group of the current generation and compare the ranks' steps (see :meth:`reopen`)."""
        self._store.set_timeout(datetime.timedelta(seconds=self.policy.rejoin_timeout_s))
        try:
            self._open()
            seen = torch.tensor([step, -step], dtype=torch.int64)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            newest, oldest = int(seen[0]), int(-seen[1])
            share = None
            if newest == oldest + 1:  # the ranks ahead tell the others what they agreed
                ahead = step == newest and agreed_loss is not None
                share = torch.tensor([agreed_loss if ahead else 0.0, 1.0 if ahead else 0.0], dtype=torch.float64)
                dist.all_reduce(share)
        except Exception as e:
            raise CommFailure(f"step {step}: the ranks did not re-form the process group within "
                              f"{self.policy.rejoin_timeout_s:g} s after a communication error ({e}); a rank has "
                              "probably died: see its log. `hpml-compile run --max-restarts N` lets torchrun "
                              "restart the job") from e
        self._store.set_timeout(datetime.timedelta(seconds=self.policy.timeout_s))
        if newest == oldest:
            return None
        if share is None or share[1] < 1:
            raise CommFailure(f"after a communication error the ranks re-formed the group on different steps "
                              f"({oldest}..{newest}, this rank {step}); the job cannot continue "
                              "consistently: restart it from the last checkpoint")
        return float(share[0] / share[1]) if step == oldest else None

    def close(self) -> None:
        """Stop beating and destroy the group if this session made it."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
