"""Run a build: this rank's stage on a GPipe or 1F1B schedule, measured, with retried communication.

Why our own schedule and not torch.distributed.pipelining's: codegen already
made every stage boundary an explicit node of the stage graphs (``ops.recv`` /
``ops.send`` autograd functions that take activations in and leave them out,
their gradients the other way), and lowered the schedule into per-rank lists
whose RECV and SEND tokens say when each message moves. ``PipelineStage``
wants to own that communication around a plain module (and passes only
tensors between stages, with ``batch_isend_irecv``, which has known trouble
on gloo). What remains for the runtime is small: run the tokens of the
build's per-rank action lists in order (lowered from the plan by
:mod:`hpml_compile.schedule`, replayed by the simulator, validated when the
build loads), which the one executor (:func:`.executor.run_actions`) does;
this module adds the process group, retries and measurements. GPipe (Huang et al., 2019): all
forwards, then all backwards. 1F1B (PipeDream-flush, Narayanan et al., 2021):
stage ``i`` runs ``S - i - 1`` warm-up forwards, then alternates, so at most
``S - i`` microbatches hold activations.

Microbatching and gradient accumulation: a batch of ``c`` times the build's
batch runs as ``c x M`` microbatches of the build's size (gradients
accumulate over all of them; one optimizer step). Every rank passes the same
batch; a stage reads only the model inputs its code uses, the last stage the
targets. The loss of a slice is scaled by ``1 / (microbatches x replicas)``
so the gradients are the batch mean's, and :meth:`Pipeline.step` returns the
batch loss on every rank.

Interleaved 1F1B (a plan with ``chunks`` above 1): a rank holds every stage of
its device group (:mod:`.chunks`), runs them from its one lowered list, syncs
each replicated stage over its group (one sync per stage,
:class:`..sync.stage.Several`) and steps one optimizer over all of them; its
checkpoint holds its stages' tensors by the model's names, so it resumes under
any plan.

Single process: without torchrun (no ``WORLD_SIZE``, no process group) every
stage runs in this process, chained through a mailbox, every rank's list
merged into one order (for notebooks and tests).

Example:
    >>> import tempfile, torch
    >>> from hpml_compile.trace import trace
    >>> from hpml_compile.codegen import generate
    >>> from hpml_compile.testing import split_plan
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> x, y = torch.randn(4, 8), torch.randn(4, 1)
    >>> d = tempfile.mkdtemp()
    >>> _ = generate(trace(model, (x,)), split_plan(trace(model, (x,)), "seq", 2, microbatches=2), d)
    >>> ref = torch.nn.functional.mse_loss(model(x), y).item()
    >>> pipe = Pipeline.from_build(d, model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> abs(pipe.step((x,), y, torch.nn.functional.mse_loss).item() - ref) < 1e-6
    True
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...codegen import Build, load_build
from ...codegen.comm import DetachedComm
from ...codegen.mailbox import post_recv, post_send
from ...errors import HpmlError, OptionError, PlanError, UpdateApplied
from ...ir import Precision, Schedule
from ...plan import Plan, sync_overlap, with_comm
from .batchcheck import Agreement, StepAgreement, agree_with_check, fingerprint
from ...hostmem import keep_freed_memory
from ...memory import ZeroStage
from ...trainspec import check_batch_split, rank_rows
from ...codegen.tensor_parallel import tp_degree
from ...schedule import Action, RankActions, deferral, rank_layout, relower, stage_ranks
from ...schedule_check import validate as validate_actions
from .tensor_parallel import TensorParallelSession, open_tensor_parallel, shard_rank, whole_params
from ..sync.comm import CommFault, CommOp, DistComm, LocalComm, Rider, is_transient, make_groups, rank_devices
from .chunks import held_stages, interleave_refusal, rank_module
from .compiled import CompiledForward, CompileStages, compile_stages as compile_stages_of
from .data import RankBatch
from .executor import (actions_for, forward_stage, local_order, loss_share, merge_outputs, run_actions,
                       split_microbatches, split_replicas, stage_sends, stage_splits, to_device, StepRun)
from ..observe.events import EventLog, align_clock
from .weights import load_stage_weights
from .gather import gather_outputs, gather_state_dict
from ..observe.host import HostBusy, HostSampler, hostname
from ..observe.gpustats import GpuStats
from ..observe.held import Held, held_bytes
from .scaler import LossScaler
from ..observe.monitor import Monitor, StepMetrics, peak_memory, reserved_memory, reset_peak_memory, split_wait
from ..sync.offload import offload_optimizer
from ...saved import GradPeak, SavedActivations, counts_memory
from .join import Door, JoinRefused, joined_actions, receive_state, send_state
from .members import in_place_refusal, without_ranks
from .session import CommFailure, RanksLost, RetryPolicy, Session
from ..sync.feedback import CommState
from ..sync.stage import Several, StageSync, for_stage
from ..sync.zero import FlatShard
from ..sync.zero3 import FlatShard3

__all__ = ["Pipeline", "OptimizerArg"]

OptimizerArg = torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None


class Pipeline:
    """A build's stages on this process: ``step``, ``eval_forward``, ``state_dict``.

    Use :meth:`from_build` (or :func:`hpml_compile.compile`), not the constructor.

    Args:
        build: the loaded build, bound to ``model``.
        model: the user's model (every rank holds a copy; each trains its stage's part).
        optimizer: an optimizer over ``model.parameters()``, or a factory called with this rank's parameters
            (a factory is needed where the plan shards a replicated stage with ZeRO-1/2/3: it is called with
            this replica's flat shard, see :mod:`.zero` and :mod:`.zero3`).
        session: the process group (None: every stage in this process).
        run_dir: where the monitor writes (None: measurements kept in memory only).
        tensorboard: also write TensorBoard event files.
        faults: communication failures to inject, each once (tests and drills).
        log: where progress and retry notices go.
        events: record every step's events (:mod:`.events`) and the host's load (:mod:`.host`).
        scaler: the fp16 loss scaler (default for an fp16 build: :class:`~.scaler.LossScaler` with torch's
            defaults; refused for a bf16 or fp32 build, which need none).
        overlap: None (the default) does what the plan says: a replicated stage's gradient collectives run
            bucket by bucket during the step's last backward (:class:`~.zero.GradBuckets`) where
            :func:`hpml_compile.plan.sync_overlap` is above 0 (GPU groups), after the whole backward in one
            collective where it is 0 (CPU ranks: gloo's threads would take the backward's cores), as the cost
            model prices it. True forces the buckets on (where the stage's sync is a flat or hierarchical
            all-reduce or a ZeRO-1/2 reduce-scatter), False off; either departs from the plan's prediction.
        bucket_mb: the size of an overlapped bucket after the first (1 MiB), as DDP's ``bucket_cap_mb``.
        comm_options: ``compress`` / ``sync_every`` / ``sync_warmup`` overriding the build's plan
            (:func:`hpml_compile.plan.with_comm`; None values keep the plan's): they change only how the
            gradients of a replicated stage are synchronised (:mod:`.compress`), not the generated code.
        shared_memory: a replicated stage's blocking gradient collectives (ZeRO-0's all-reduce, ZeRO-1/2's
            reduce-scatter and parameter all-gather) through shared memory where its replicas are CPU ranks the
            plan puts on one host (:mod:`.shm`; what ``devices --measure`` and ``profile`` time); False: through
            gloo, as before.
        compile_stages: ``auto`` (compiled on CUDA devices, not on CPUs), ``on`` or ``off``: this
            process's stages run their forward (and so backward) compiled by ``torch.compile``
            (:mod:`.compiled`; a stage that cannot be is named in one line through ``log``); None (the
            default): as the plan was made for (its ``compile_stages``: ``auto`` where it names none).
        generated: the build as generated, where ``build`` carries a plan changed since (a joining replica's:
            :meth:`from_build` with ``join``); None: ``build``.

    Attributes:
        ride_agreement: where the plan's one stage spans every rank, the loss agreement rides the gradient
            collective (:mod:`.batchcheck`: one meeting a step); False gives it an all-reduce of its own, as a
            pipeline's (the profile's probe sets it to time that all-reduce).
    """

    ride_agreement = True

    def __init__(self, build: Build, model: nn.Module, *, optimizer: OptimizerArg = None,
                 session: Session | None = None, run_dir: str | Path | None = None, tensorboard: bool = True,
                 faults: Sequence[CommFault] = (), log: Callable[[str], None] | None = None,
                 events: bool = True, scaler: LossScaler | None = None, overlap: bool | None = None,
                 bucket_mb: float = 25.0, comm_options: dict[str, Any] | None = None,
                 shared_memory: bool = True, compile_stages: CompileStages | str | bool | None = None,
                 generated: Build | None = None) -> None:
        self.build, self.model, self.session = build, model, session
        refusal = interleave_refusal(build.plan, live=session is not None and session.live,
                                     join=session is not None and session.grant is not None)
        if refusal is not None:
            raise PlanError(refusal)
        self._generated = generated or build  # the devices and rows the stage code was generated for
        self._shared_memory = shared_memory
        if bucket_mb <= 0:
            raise HpmlError(f"bucket_mb must be positive (the size of an overlapped gradient bucket in MiB, DDP's "
                            f"default is 25), got {bucket_mb}")
        self._overlap, self._bucket_bytes = overlap, int(bucket_mb * (1 << 20))
        fp16 = build.plan.precision is Precision.FP16
        if scaler is not None and not fp16:
            raise HpmlError(f"a loss scaler was given, but the build trains in {build.plan.precision.value}: loss "
                            "scaling is for fp16 builds only (compile with --precision fp16)")
        self.scaler = scaler if scaler is not None else LossScaler() if fp16 else None
        self.plan = with_comm(build.plan, **comm_options) if comm_options else build.plan
        self._log = log or (lambda line: None)
        self._faults = list(faults)
        self.steps_done = 0
        self._params: list[nn.Parameter] | None = None  # parameters(), listed once the stages are set
        self._held_module: nn.Module | None = None  # local_module() of a rank holding several stages
        self._clear: list[nn.Parameter] | None = None  # _cleared(), listed once the sync is made
        self._memory_seen: dict[tuple[int, int], int] = {}  # (microbatches, rows) -> steps whose memory was counted
        self._agreed_loss: float | None = None  # the last step's agreed loss sum (ranks), for a peer behind
        self._regrouped = False  # the loss agreement re-formed the group and nobody had committed: retry as is
        # job ranks of each stage's replicas, as this rank sees them (its place, where stages have tp > 1)
        self._places = session.places if isinstance(session, TensorParallelSession) else None
        self._ranks = self._places.table(session.tp_index) if isinstance(session, TensorParallelSession) \
            else stage_ranks(self.plan)
        self._reps = [len(st.devices) for st in self.plan.stages]
        self._splits = stage_splits(build)  # each stage's replica count, or its plan rows (uneven)
        self._sends = stage_sends(build)  # which stages send to the next (an evaluation forward's SEND)
        self._mb_rows = build.manifest.inputs[0].shape[0] if build.manifest.inputs else None
        # the rows each stage's code was generated at (its first replica's): the boundary specs' (move_rows)
        self._spec_rows = [st.rows[0] if st.rows else (self._mb_rows or 0) // len(st.devices)
                           for st in self._generated.plan.stages]
        self._orders: dict[int, list[tuple[int, Action]]] = {}  # microbatches -> what this process runs
        self._buffer_list: tuple[tuple[nn.Module, ...], list[Tensor]] | None = None  # the stages' buffers (_snapshot)
        self.sync: StageSync | None = None  # this rank's replicated stage's sync (:mod:`..sync.stage`)
        if session is None:
            self.rank, self.world_size = 0, 1
            self.device = torch.device("cpu")
            self._local = LocalComm(self.plan)
            self._local.spec_rows = self._spec_rows
            self.comm: DistComm | None = None
            self.stages = dict(enumerate(build.stages))
            for st in self.stages.values():
                st.hpml_comm = self._local
            self.stage_index, self.replica = 0, 0
        else:
            self.rank, self.world_size = session.rank, session.world_size
            want = self._places.size if self._places is not None else len(rank_layout(self.plan))
            if self.world_size != want:
                raise HpmlError(f"the build's plan runs on {want} devices (one rank each: "
                                f"{', '.join(dict.fromkeys(d for st in self.plan.stages for d in st.devices))}), but "
                                f"the world has {self.world_size} ranks: start {want} processes (hpml-compile run "
                                f"--nproc {want}) or recompile the model for this many devices")
            whole = session.plan if isinstance(session, TensorParallelSession) else self.plan  # every job rank's
            self._devices = rank_devices(whole, torch.cuda.device_count() if torch.cuda.is_available() else None)
            self.device = self._devices[self.rank]
            self._check_device()
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # NCCL binds its communicators to the current device
            if session.live:
                # what exists now (torch, the model, its stage; not the groups made next) moves out of the
                # collector's sight: the collection that releases a failed group's sockets (_drop_groups) then
                # scans only what came since; a full one took 0.5-0.7 s of the time to go on without a lost rank
                # (gpt-mini, 2 busy cores)
                gc.freeze()
            self.comm = self._connect()
            self.stage_index, self.replica = self.comm.stage, self.comm.replica  # interleaved: its first stage
            self.stages = {k: build.stages[k] for k in held_stages(self.plan, self.stage_index)}
            for st in self.stages.values():
                st.to(self.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's tensors reuse freed memory instead of faulting fresh pages in
        self.sync = self._make_sync(optimizer)
        self._syncs = {s.stages: s for s in self.sync.parts} if self.sync is not None else {}
        self._shards: list[FlatShard] = self.sync.shards if self.sync is not None else []
        if any(s.prefetch for s in self._shards):  # the user's own reads of the model wait for the gathers too
            self._user_hooks = [model.register_forward_pre_hook(lambda *_: self.settle()),
                                model.register_state_dict_pre_hook(lambda *_: self.settle())]
        self.optimizer = self._offloaded(self._make_optimizer(optimizer))
        say = log or (lambda line: warnings.warn(line, RuntimeWarning, stacklevel=3))
        self.compiled: list[CompiledForward] = compile_stages_of(
            self.stages, _compiled_under(self.plan, CompileStages.parse(
                compile_stages if compile_stages is not None else self.plan.compile_stages), self.device, say),
            self.device, say,
            zero3=[s.stage for s in self._shards if isinstance(s, FlatShard3)])
        self.saved = SavedActivations(exclude=self.stages.values())  # what autograd keeps (counted steps)
        # gradients at the end of the backward, before any sync: a hook per parameter only where no sync buffer holds
        # its gradient (a buffer's gradients stay whole to the step's end, where held_bytes counts the same bytes;
        # hooks on every parameter of the small-op MLP made each counted step's backward a quarter slower)
        self.grad_peak = GradPeak(self._cleared())
        self.gpu = GpuStats(self.device)  # NVML counters on a GPU rank (reads nothing on a CPU)
        # parameters and optimizer state after the last step that counted memory, gradients at their peak
        self.held: Held | None = None
        self._peak: tuple[int, str] | None = None  # the peak memory of the last step that measured it
        # files of its own (a joiner's job rank is one no rank of the job had)
        mon = session.start_rank if session is not None and session.grant is not None else self.rank
        self.monitor = Monitor(run_dir, mon, tensorboard=tensorboard, events=events) \
            if run_dir is not None else Monitor(None, mon)
        self.trainer: Any = None  # a TrainSpec's loop (.trainer.Trainer) where compile() was given one
        self.events: EventLog | None = None
        self.host: HostSampler | None = None
        self._hostname = hostname()
        if events:
            self._watch_host()
        self._door = Door(session.store, self._generated.plan, self._mb_rows) \
            if session is not None and session.live and self._mb_rows else None  # replicas that join (.join)

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_build(cls, build_dir: str | Path, model: nn.Module, *, init_method: str | None = None,
                   retry: RetryPolicy = RetryPolicy(), weights: str | os.PathLike[str] | None = None,
                   live: bool = False, join: bool | str = False, **kwargs: Any) -> "Pipeline":
        """Load a build folder for ``model`` and join the job (or run every stage here without one).

        Args:
            build_dir: the folder ``hpml-compile compile`` or :func:`hpml_compile.compile` wrote.
            model: the model the build was made for (built the same way on every rank).
            init_method: ``env://``, torchrun's environment (the default when ``WORLD_SIZE`` is set). A
                process group the caller initialised already is used as it is (then a failed step is not
                retried: the group is not ours to re-form). None and neither: every stage in this process.
            retry: how transient communication errors are retried.
            weights: saved weights (a ``save_pretrained`` folder or a ``.safetensors`` file) to load into the
                stages this rank runs, by name, before anything reads them (:mod:`.weights`).
            live: a rank lost from a replicated stage is answered in place: the others go on without it and run
                the failed step again (:meth:`.session.Session.shrink`). Only for ranks not started by torchrun's
                agent, which stops every worker when one dies (start them yourself, as
                :func:`hpml_compile.runtime.spawn_ranks` does, with an ``init_method`` of their own).
            join: this process joins a job already running live on ``init_method``'s store, as a new replica, at
                its next step boundary (:mod:`.join`): True on the device a lost replica had, or a device's name.
                It is given the stage's parameters, optimizer state and step by a peer (``weights`` is not read);
                train from ``steps_done`` on.
            kwargs: passed to the constructor (``optimizer``, ``run_dir``, ``faults``, ``log``, ...).

        Raises:
            BuildMismatchError: the build is not for this model, or was edited.
            HpmlError: the world size is not the plan's device count, or a GPU the plan needs is missing.
            PlanError: an interleaved plan with an option the runtime does not combine with it
                (:func:`.chunks.interleave_refusal`).
            JoinRefused: with ``join``, the running ranks have no place for this process (their reason).
        """
        build = load_build(build_dir, model)
        refusal = interleave_refusal(build.plan, live=live, join=join is not False)
        if refusal is not None:  # before any process group forms
            raise PlanError(refusal)
        if join is not False:
            return cls._join(build, model, init_method, retry, join, kwargs)
        if init_method is None and (dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1):
            init_method = "env://"
        session: Session | None
        if tp_degree(build.plan) > 1:  # the job's group, and each rank's tensor-parallel group
            session, build = open_tensor_parallel(build, init_method, retry, kwargs.get("log"))
        else:
            session = Session(init_method, policy=retry, log=kwargs.get("log"), live=live) if init_method else None
        if weights is not None:  # only this rank's stages read their tensors
            ranks = stage_ranks(build.plan)
            mine = [st for k, st in enumerate(build.stages)
                    if session is None or (k in held_stages(build.plan, session.stage)
                                           if isinstance(session, TensorParallelSession)
                                           else session.rank in ranks[k])]
            load_stage_weights(model, mine, Path(weights))
        if isinstance(session, TensorParallelSession):
            shard_rank(build, model, session)  # after the weights: each rank keeps its slices
        return cls(build, model, session=session, **kwargs)

    @classmethod
    def _join(cls, build: Build, model: nn.Module, init_method: str | None, retry: RetryPolicy, join: bool | str,
              kwargs: dict[str, Any]) -> "Pipeline":
        """:meth:`from_build` for a joining replica: placed by the running ranks, then given a peer's state."""
        if init_method is None or tp_degree(build.plan) > 1:
            raise JoinRefused("a joining replica needs the running job's init_method (its store), and a plan without "
                              "tensor parallelism")
        world = sum(len(st.devices) for st in build.plan.stages)
        session = Session(init_method, world_size=world, policy=retry, log=kwargs.get("log"), live=True, join=join)
        grant = session.grant
        assert grant is not None
        plan = grant.plan(build.plan)
        joined = replace(build, plan=plan, actions=tuple(joined_actions(build.actions, build.plan, plan)))
        pipe = cls(joined, model, session=session, generated=build, **{**kwargs, "events": grant.events})
        pipe.steps_done = grant.step
        assert pipe._door is not None
        pipe._door.adopt(grant)
        receive_state(pipe, pipe._ranks[pipe.stage_index][0])
        device = pipe.plan.stages[pipe.stage_index].devices[pipe.replica]
        pipe._log(f"rank {session.start_rank}: joined at step {grant.step + 1} as rank {pipe.rank} of "
                  f"{pipe.world_size} (stage {pipe.stage_index} on {device})")
        return pipe

    def _check_device(self) -> None:
        if self.device.type == "cuda" and not torch.cuda.is_available():
            k = self.stage_index_of(self.rank)
            dev = self.plan.stages[k].devices[self._ranks[k].index(self.rank)]
            raise HpmlError(f"rank {self.rank} runs stage {k} on {dev} "
                            f"({self.plan.cluster.device(dev).kind}), but this host has no CUDA device: start it "
                            "on a host with a GPU, or compile for a cluster of this host's devices")

    def stage_index_of(self, rank: int) -> int:
        """The stage a rank runs."""
        return next(k for k, rs in enumerate(self._ranks) if rank in rs)

    def _watch_host(self) -> None:
        """Align this rank's clock with rank 0's and find the job's processes on this host (every rank calls it)."""
        pids = [os.getpid()]
        if self.session is not None:
            every: list[Any] = [None] * self.world_size
            dist.all_gather_object(every, (self._hostname, os.getpid()))
            pids = [pid for host, pid in every if host == self._hostname]
        self.events = EventLog(self.rank, align_clock(self.rank, self.world_size))
        self.host = HostSampler(pids)
        if self.comm is not None:
            self.comm.events = self.events
        else:
            self._local.events = self.events

    def _connect(self) -> DistComm:
        # the session's time-out on the sub-groups too: a gather a failed step left pending holds the teardown
        # (Session.reopen) until it ends, which on a dead peer is that time-out (torch's default is 30 minutes)
        timeout = self.session.timeout if self.session is not None else None
        pairs, groups = make_groups(self.plan, self._devices, self.build.manifest.groups(), timeout, self._places)
        comm = DistComm(self.plan, self.rank, self._devices, pairs, groups, timeout=timeout, places=self._places)
        comm.faults = self._faults
        comm.shared_memory = self._shared_memory
        comm.events = getattr(self, "events", None)
        comm.spec_rows = self._spec_rows
        for k in held_stages(self.plan, comm.stage):
            self.build.stages[k].hpml_comm = comm
        if self.sync is not None:  # after a reconnect: the new communicator (and sub-groups) run the collectives
            self.sync.bind(comm)
        return comm

    def _make_sync(self, optimizer: OptimizerArg) -> StageSync | None:
        """The sync of this rank's replicated stage, as the plan names it (:func:`..sync.stage.for_stage`); under an
        interleaved plan, one per stage the rank holds, driven together (:class:`..sync.stage.Several`).

        Parameters tied to another stage stay apart (all-reduced across those stages). In one process nothing is
        replicated; without an optimizer factory there is no state to shard (every replica keeps the sum).

        Raises:
            HpmlError: a ZeRO stage given an optimizer already built (a factory is needed to shard it).
        """
        if self.session is None or self.comm is None:
            return None
        built = isinstance(optimizer, torch.optim.Optimizer)
        parts = []
        for k, module in self.stages.items():
            st = self.plan.stages[k]
            tied = {id(p) for j, other in enumerate(self.build.stages) if j != k for p in other.parameters()}
            params = [p for p in module.parameters() if id(p) not in tied]
            if self._reps[k] > 1 and params and st.zero != ZeroStage.NONE and built:
                raise HpmlError(f"stage {k} runs ZeRO-{int(st.zero)} over {self._reps[k]} replicas, which builds the "
                                "optimizer over this rank's shard of the parameters: pass a factory called with the "
                                "parameters (e.g. optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)), not an "
                                "optimizer already built")
            sync = for_stage(self.plan, k, self.comm, params, module, replica=self.replica,
                             sharded=optimizer is not None, overlap=self._overlaps(k), bucket_bytes=self._bucket_bytes)
            if sync is not None:
                parts.append(sync)
        return None if not parts else parts[0] if len(parts) == 1 else Several(parts)

    def _overlaps(self, k: int) -> bool:
        """Whether stage ``k``'s gradient buckets launch during the backward: the plan's rule unless forced."""
        return sync_overlap(self.plan, k) > 0 if self._overlap is None else self._overlap

    def _make_optimizer(self, optimizer: OptimizerArg) -> torch.optim.Optimizer | None:
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            return optimizer  # over the whole model: parameters of other stages never get a gradient here
        if not callable(optimizer):
            raise HpmlError(f"optimizer must be a torch.optim.Optimizer or a factory called with the parameters "
                            f"(e.g. lambda ps: torch.optim.AdamW(ps, lr=1e-3)), got {optimizer!r}")
        if not self._shards:
            params = list(self.parameters())
            # a stage without parameters (a loss-only tail, say) has nothing to step, and torch's optimizers
            # refuse an empty parameter list
            return optimizer(params) if params else None
        sharded = {id(p) for sh in self._shards for p in sh.params}
        opt = optimizer([*(sh.param for sh in self._shards),
                         *(p for p in self.parameters() if id(p) not in sharded)])
        opt.hpml_zero = self._shards  # type: ignore[attr-defined]  # read by .zero.shards_of (checkpoints)
        return opt

    def _offloaded(self, optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
        """The optimizer with its state and step in host memory where the plan offloads this rank's stage."""
        if optimizer is None or self.session is None or not self.plan.stages[self.stage_index].offload_optimizer:
            return optimizer
        return offload_optimizer(optimizer, self.parameters(), self.device)

    # -- what this rank holds ---------------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """The parameters this process trains (its stage's), each once.

        Listed once: walking the modules costs a Python call per module, every step, and a stage's parameters
        are the same objects for the whole run (ZeRO, offload and row moves change their ``.data``, not them).
        """
        if self._params is None:
            seen: dict[int, nn.Parameter] = {}
            for st in self.stages.values():
                for p in st.parameters():
                    seen.setdefault(id(p), p)
            self._params = list(seen.values())
        return self._params

    def _cleared(self) -> list[nn.Parameter]:
        """The parameters whose gradients a step sets to None first: all but those the sync points at its zeroed
        buffer anyway (:meth:`..sync.stage.StageSync.pointed`). Listed once."""
        if self._clear is None:
            pointed = {id(p) for p in self.sync.pointed()} if self.sync is not None else set()
            self._clear = [p for p in self.parameters() if id(p) not in pointed]
        return self._clear

    def local_module(self) -> nn.Module:
        """This process's stage as a module whose parameter names are the original model's (for checkpoints); a
        rank of an interleaved plan: its stages' tensors in one module (:func:`rank_module`)."""
        if len(self.stages) == 1:
            return next(iter(self.stages.values()))
        if self.session is None:
            return self.model
        if self._held_module is None:
            self._held_module = rank_module(self.stages.values())
        return self._held_module

    @property
    def is_last(self) -> bool:
        """Whether this process runs the last stage."""
        return len(self.plan.stages) - 1 in self.stages

    @property
    def batch_rows(self) -> int:
        """Rows of one build batch (every microbatch's rows together)."""
        return (self._mb_rows or 0) * self.plan.microbatches

    def rows_role(self) -> tuple[list[int], bool, bool]:
        """``(rows, needs inputs, needs targets)`` of this process's share of a batch (all of it without ranks).

        Raises:
            ModelError: the build batch does not split into the plan's microbatches and replicas.
        """
        b, m = self.batch_rows, self.plan.microbatches
        check_batch_split(b, m, self._splits)
        if self.session is None:
            return list(range(b)), True, True
        rows = rank_rows(b, m, self._splits[self.stage_index], self.replica)
        return rows, any(bool(st.INPUTS) for st in self.stages.values()), self.is_last

    def move_rows(self, plan: Plan) -> None:
        """Train on ``plan`` from the next step on: the running plan with new rows per replica, nothing else changed.

        The closed loop's in-place row move (:mod:`.adapt`); call it on every rank between two steps, with the
        same plan. The stage code stays: one stage file serves any rows (each boundary spec is scaled to a
        replica's rows, :meth:`~hpml_compile.codegen.comm.Comm.shaped`); what takes the new rows is the split
        of each microbatch, each replica's loss weight, the boundaries' row ranges and, with a TrainSpec, the
        rows this rank loads (:meth:`.trainer.Trainer.rows_moved`).

        Raises:
            HpmlError: ``plan`` changes more than rows, or its rows do not split a microbatch of this build.
        """
        old = self.plan
        if ([(st.devices, st.nodes) for st in plan.stages] != [(st.devices, st.nodes) for st in old.stages]
                or (plan.microbatches, plan.schedule) != (old.microbatches, old.schedule)):
            raise HpmlError("move_rows takes the running plan with new rows per replica and nothing else changed: "
                            "the stages, their devices and nodes, the microbatches and the schedule must stay")
        for st in plan.stages:
            if st.rows and (len(st.rows) != len(st.devices) or sum(st.rows) != self._mb_rows):
                raise HpmlError(f"stage {st.index}: rows {list(st.rows)} for {len(st.devices)} replicas do not split "
                                f"a microbatch of this build ({self._mb_rows} rows)")
        self.plan = plan
        self.build = replace(self.build, plan=replace(self.build.plan, stages=tuple(
            replace(b, rows=n.rows) for b, n in zip(self.build.plan.stages, plan.stages))))
        self._splits = stage_splits(self.build)
        (self.comm if self.comm is not None else self._local).rows = [st.rows for st in plan.stages]
        if self.trainer is not None:
            self.trainer.rows_moved()

    @property
    def metrics(self) -> list[StepMetrics]:
        """Every step's measurements on this process."""
        return self.monitor.rows

    # -- training ---------------------------------------------------------------------------------
    def _microbatches(self, inputs: Sequence[Any]) -> int:
        m = self.plan.microbatches
        rows = next((x.shape[0] for x in inputs if isinstance(x, Tensor) and x.dim()), None)
        if rows is None or self._mb_rows is None:
            return m
        if rows % self._mb_rows:
            raise HpmlError(f"a batch of {rows} rows does not split into microbatches of {self._mb_rows} rows (the "
                            f"build's batch of {self._mb_rows * m} in {m} microbatches): feed a multiple of "
                            f"{self._mb_rows} rows (a multiple of {self._mb_rows * m} accumulates gradients over "
                            "several build batches), or recompile for this batch size")
        return rows // self._mb_rows

    def step(self, inputs: Sequence[Any] | Tensor, targets: Any, loss_fn: Callable[[Any, Any], Tensor], *,
             rank_batch: RankBatch | None = None, validate: Callable[[], float] | None = None) -> Tensor:
        """One training step on every rank: forward and backward of every microbatch, gradient sync, optimizer.

        Args:
            inputs: the model's positional inputs for the whole batch (the same on every rank).
            targets: the targets for ``loss_fn`` (split into microbatches like the inputs).
            loss_fn: ``(output, targets) -> loss``, a mean over the rows it is given.
            rank_batch: instead of ``inputs`` and ``targets`` (pass ``()`` and None): only this rank's rows
                (:mod:`.data`, with a process group); the ranks check that they agree on the batch's indices.
            validate: called after the optimizer step (on every rank); what it returns, the validation loss
                of the updated model, goes into this step's measurements (``val_loss``).

        Returns:
            The batch loss (a CPU scalar), on every rank.

        Raises:
            CommFailure: communication kept failing after the retries.
            BatchMismatchError: the ranks were given different batches (checked with the loss all-reduce,
                before the optimizer step).
            HpmlError: a batch that does not split into the build's microbatches.
        """
        self._t_called = time.perf_counter()  # the step's wall clock (StepMetrics.wall_ms) starts here
        inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
        if rank_batch is not None:
            if self.session is None:
                raise HpmlError("step(rank_batch=...) is for ranks of a job; in one process pass the whole batch")
            inputs, targets = rank_batch.inputs or (), rank_batch.target
            n = self.plan.microbatches
        else:
            n = self._microbatches(inputs)
        if self.session is None:
            return self._run_local(inputs, targets, loss_fn, n, validate)
        policy = self.session.policy
        snapshot = self._snapshot() if self.session.can_retry else None
        attempt = 0
        while True:  # each retry counts an attempt; going on without lost ranks does not (the world shrinks)
            lost: RanksLost | None = None
            try:
                if self._door is not None:  # a joiner lost while it is let in fails here as in a step: then the
                    self._welcome()  # others go on without it (at a boundary already agreed, a no-op)
                return self._run_rank(inputs, targets, loss_fn, n, attempt, rank_batch, validate)
            except RanksLost as e:  # the loss agreement re-formed the group and found ranks gone
                lost = e
            except Exception as e:  # noqa: BLE001 -- only transient communication errors are retried
                if not is_transient(e):
                    raise
                if not self.session.can_retry or (attempt + 1 == policy.attempts and not self.session.live):
                    raise CommFailure(f"step {self.steps_done + 1}: communication failed on rank {self.rank} "
                                      f"({str(e).splitlines()[0][:200]}) after {attempt + 1} attempt(s); check the "
                                      "network between the hosts, or let torchrun restart the job "
                                      "(hpml-compile run --max-restarts N)") from e
                reason = str(e).splitlines()[0][:160]
            # Out of the except block: the exception's frames, which hold the old groups, are gone now.
            if lost is None and self._regrouped:  # the loss agreement re-formed the group, and nobody had committed
                self._regrouped = False
                self._log(f"rank {self.rank}: step {self.steps_done + 1}: {reason}; retrying the step on the "
                          f"re-formed process group (attempt {attempt + 2}/{policy.attempts})")
                self._restore(snapshot)
                attempt += 1
                continue
            if lost is None:
                lost = self._retry_or_lost(attempt, reason, snapshot)
                attempt += 1
            if lost is not None:
                self._restore(snapshot)
                self._go_on_without(lost, rank_batch is not None)
                if rank_batch is not None:  # the same batch, this rank's rows of it now
                    rank_batch = self.trainer.batch_again(rank_batch.step)
                    inputs, targets = rank_batch.inputs or (), rank_batch.target

    def _retry_or_lost(self, attempt: int, reason: str, snapshot: dict[str, Any] | None) -> RanksLost | None:
        """Re-form the group for another attempt of the step; the lost ranks where a live session finds some.

        Raises:
            CommFailure: the attempts are spent, or the others finished the step this rank must re-run.
        """
        assert self.session is not None
        policy = self.session.policy
        spent = attempt + 1 >= policy.attempts  # a live session still asks who is left: a death is no retry
        if not spent:
            wait = 0.0 if self.session.live else policy.delay(attempt)
            self._log(f"rank {self.rank}: step {self.steps_done + 1}: {reason}; re-forming the process group and "
                      f"retrying the step in {wait:g} s (attempt {attempt + 2}/{policy.attempts})")
        self._restore(snapshot)
        self._drop_groups()
        if not self.session.live:
            time.sleep(policy.delay(attempt))  # a live session's round waits for the others already
        try:
            if self.session.reopen(self.steps_done, self._agreed_loss) is not None:
                raise CommFailure(f"step {self.steps_done + 1}: after a communication error on rank {self.rank} the "
                                  "other ranks had finished this step, and this rank failed before its loss "
                                  "agreement, so it cannot take their update: restart the job from the last checkpoint")
        except RanksLost as e:
            return e
        if spent:
            raise CommFailure(f"step {self.steps_done + 1}: communication failed on rank {self.rank} ({reason}) "
                              f"after {attempt + 1} attempt(s); check the network between the hosts")
        self.comm = self._connect()
        return None

    def _go_on_without(self, lost: RanksLost, own_rows: bool) -> None:
        """Carry on in this process without the ranks ``lost``: their rows go to the replicas left, and the step
        that failed runs again (its update was not applied: the gradient sync had not completed everywhere).

        What changes: the plan (the lost devices out, :func:`.members.without_ranks`), the action lists (lowered
        again for the replicas left), this rank's number, the groups (the session's next generation on the
        survivors, :meth:`.session.Session.shrink`) and the communicator; the parameters, the optimizer and its
        state, the stage code and the flat gradient buffer stay.

        Raises:
            CommFailure: a lost rank was a stage's only replica, or held state the others lack
                (:func:`.members.in_place_refusal`), or the failure came after the update, or this rank reads only
                its own rows of batches not a TrainSpec's (which could not be read again with the new rows): then
                only the restart from the last checkpoint can go on.
        """
        assert self.session is not None and self._mb_rows is not None
        stream = own_rows and self.trainer is not None and self.trainer.data.stream
        if lost.step != self.steps_done or (own_rows and self.trainer is None) or stream:
            why = ("after the step's update" if lost.step != self.steps_done else
                   "while the data is a stream, whose batch cannot be read again with other rows" if stream else
                   "while each rank reads its own rows of a batch given to step(), not a TrainSpec's")
            raise CommFailure(f"{lost} ({why}): restart from the last checkpoint") from lost
        refusal = in_place_refusal(self.plan, lost.lost)
        if refusal is not None:
            raise CommFailure(f"{lost}: {refusal}") from lost
        t0 = time.perf_counter()
        plan = without_ranks(self.plan, lost.lost, self._mb_rows)  # CommFailure where a stage has no replica left
        kept = [acts for r, acts in enumerate(self.build.actions) if r not in lost.lost]
        replicas = [len(st.devices) for st in plan.stages]
        actions = relower(kept, replicas, plan.schedule, plan.microbatches, deferral(plan))
        validate_actions(actions, replicas, deferral(plan))
        if self.comm is not None:
            self._drop_groups()
        gone = [self.session.members[r] for r in lost.lost]
        if self.session.shrink(lost.lost, self.steps_done, self._agreed_loss) is not None:
            raise CommFailure(f"{lost}: the others had finished the step: restart from the last checkpoint") from lost
        self._replan(plan, actions)
        self._log(f"rank {self.session.start_rank}: step {self.steps_done + 1}: ranks {gone} of the job died; going "
                  f"on without them in {time.perf_counter() - t0:.2f} s (now rank {self.rank} of {self.world_size}), "
                  "the step runs again: " + "; ".join(f"stage {st.index} on {','.join(st.devices)}"
                                                      + (f" rows {':'.join(map(str, st.rows))}" if st.rows else "")
                                                      for st in plan.stages))

    def _replan(self, plan: Plan, actions: Sequence[RankActions], *, connect: bool = True) -> None:
        """Run ``plan`` (the same stages on other devices) with ``actions`` on the session's current group
        (``connect``: make its sub-groups now; else the group did not form and the step's retry follows)."""
        assert self.session is not None
        self.plan, self._ranks, self._reps = plan, stage_ranks(plan), [len(st.devices) for st in plan.stages]
        self.build = replace(self.build, actions=tuple(actions), plan=replace(self.build.plan, stages=tuple(
            replace(b, devices=n.devices, rows=n.rows) for b, n in zip(self.build.plan.stages, plan.stages))))
        self._splits, self._orders = stage_splits(self.build), {}
        self.rank, self.world_size = self.session.rank, self.session.world_size
        self._devices = rank_devices(plan, torch.cuda.device_count() if torch.cuda.is_available() else None)
        if not connect:
            return
        self.comm = self._connect()
        self.replica = self.comm.replica
        if self.trainer is not None:
            self.trainer.rows_moved()

    def _welcome(self) -> None:
        """At this step boundary, let in the replicas that asked to join and give them their stage's state
        (:mod:`.join`); one store operation when none did."""
        assert self.session is not None and self._door is not None
        s = self.session
        grant = self._door.boundary(self.steps_done, s.joiners, self.plan, s.members, s.generation,
                                    self.events is not None, None if self.trainer is None else
                                    "the running ranks train a TrainSpec, whose data position and learning-rate "
                                    "schedule a joiner is not given: only ranks fed with step() take a joiner")
        for why in (grant.refused.values() if grant is not None else ()):
            self._log(f"rank {s.start_rank}: step {self.steps_done + 1}: a replica asked to join, refused: {why}")
        if grant is None or len(grant.members) == len(s.members):
            return
        t0, plan, new = time.perf_counter(), grant.plan(self.plan), sorted(set(grant.members) - set(s.members))
        actions = joined_actions(self._generated.actions, self._generated.plan, plan)
        self._drop_groups()
        try:
            s.grow(grant.members, grant.generation, self.steps_done)
        except CommFailure as e:  # a joiner gone before the group formed: found gone by its beat, as any rank
            self._replan(plan, actions, connect=False)
            raise ConnectionError(f"the group did not form with the joining ranks {new}: {e}") from e
        self._replan(plan, actions)
        if self.events is not None:
            self._watch_host()  # as the joiner's constructor does: the clock alignment is a collective
        mine = self._ranks[self.stage_index]
        if self.rank == mine[0]:  # the stage's first replica gives its state to its joiners
            send_state(self, [r for r in mine if s.members[r] in new])
        self._log(f"rank {s.start_rank}: step {self.steps_done + 1}: ranks {new} of the job joined in "
                  f"{time.perf_counter() - t0:.2f} s (now rank {self.rank} of {self.world_size})")

    def _agreement(self, inner: Agreement) -> StepAgreement:
        """The executor's ``agree``: ``inner`` (the loss all-reduce with the batch check), and what to do when it fails.

        The agreement is where a step commits, and its all-reduce may complete on some ranks and fail on others:
        those that completed step their optimizers and go on; one that failed cannot tell whether anyone agreed. It
        re-forms the group at once and asks (:meth:`.session.Session.reopen`): if the others are a step ahead they
        agreed, with this rank's share, so this rank takes the same update (its gradients are synchronised: every
        sync comes before the agreement), adopts their loss, and owes the parameter gathers after the optimizer
        step to the next step, as the others do after failing in theirs (returns True). If nobody is ahead, nobody
        committed: the step runs again on the re-formed group. Before, the ranks re-formed on different steps and
        the job stopped.

        Where the share rides the gradient collective (``board``, :mod:`.batchcheck`), a failure of that collective
        is the sync's (the step's retry): this rank cannot have its summed gradients then, so it could not take an
        update the others committed. What fails at ``LOSS`` after the ride came back is handled as above.
        """
        assert self.session is not None

        def board(stages: tuple[int, ...], loss_sum: Tensor) -> Rider | None:
            if stages != inner.rides:
                return None
            assert self.comm is not None
            self.comm.maybe_fail(CommOp.AGREE)  # a drill: before this rank's share goes out (with its gradients)
            return inner.board(stages, loss_sum)

        def agree(loss_sum: Tensor) -> bool:
            comm = self.comm
            assert comm is not None and self.session is not None
            try:
                if not inner.boarded:
                    comm.maybe_fail(CommOp.AGREE)  # a drill: before this rank's share goes out
                inner(loss_sum)
                comm.maybe_fail(CommOp.AGREE)  # a drill: after the answer came back (the others may have agreed)
                return False
            except Exception as e:  # noqa: BLE001 -- only transient communication errors are handled here
                if not is_transient(e) or not self.session.can_retry:
                    raise
                reason = str(e).splitlines()[0][:160]
            step = self.steps_done + 1
            self._log(f"rank {self.rank}: step {step}: {reason} in the loss agreement; re-forming the process group "
                      "to learn whether the other ranks agreed")
            agreed = self._reform(self.steps_done)
            if agreed is None:
                self._regrouped = True
                raise ConnectionError(f"the loss agreement of step {step} failed on every rank ({reason})")
            loss_sum.fill_(agreed)
            self._log(f"rank {self.rank}: step {step}: the other ranks had agreed; this rank takes the same update "
                      "(the step is not run again) and gathers the parameters at the next step")
            return True

        return StepAgreement(agree, board)

    def _reform_after_update(self, failure: UpdateApplied) -> None:
        """A collective after the optimizer update failed (:class:`~hpml_compile.errors.UpdateApplied`): the update
        stands, so the step is not re-run; the group is re-formed and the next step begins by gathering the parameters
        from their shards (:meth:`.zero.FlatShard.forget`). A rank whose own side of that collective succeeded fails
        in the next step's first collective instead and retries that step from its start: both re-form the group at
        the same step number, the one after this one (:meth:`.session.Session.reopen` checks it), and both gather
        first.

        Raises:
            The failure's cause: not a transient communication error, or this process group cannot be re-formed
            (``step`` turns a transient one into :class:`~hpml_compile.errors.CommFailure`).
        """
        cause = failure.__cause__
        if cause is None or not is_transient(cause) or self.session is None or not self.session.can_retry:
            raise cause if cause is not None else failure
        reason = str(cause).splitlines()[0][:160]
        self._log(f"rank {self.rank}: step {self.steps_done + 1}: {reason} after the optimizer update, which stands "
                  "(the step is not run again); re-forming the process group; the next step gathers the parameters "
                  "first")
        self._agreed_loss = float(failure.run.loss_sum)  # this rank agreed: never behind
        self._reform(self.steps_done + 1)

    def _reform(self, step: int) -> float | None:
        """Let go of the failed groups, re-form the process group at ``step`` (:meth:`.session.Session.reopen`, with
        the last agreed loss for a peer one step behind) and connect again; what ``reopen`` returns."""
        assert self.session is not None
        self._drop_groups()
        got = self.session.reopen(step, self._agreed_loss)
        self.comm = self._connect()
        return got

    def _drop_groups(self) -> None:
        """Let go of every reference to the failed groups, so that destroying them closes their connections.

        A gloo group closes its sockets only when the last reference goes; a
        peer blocked in a collective on it is released only then.
        """
        if self.sync is not None:
            self.sync.forget()  # prefetched parameter gathers on the failed groups: gathered again by the retry
            self.sync.release()  # a hierarchical ZeRO-1 shard's sub-groups: rebound to the new ones by _connect
        if self.comm is not None:
            self.comm.forget()
            self.comm.groups.clear()
            self.comm.pairs.clear()
            self.comm.hierarchy.clear()  # the hierarchical all-reduces' sub-groups
            self.comm.drop_host_memory()  # the shared mappings hold their groups too
        self.comm = None
        for k in self.stages:
            self.build.stages[k].hpml_comm = DetachedComm()
        gc.collect()

    def _snapshot(self) -> dict[str, Any]:
        """What a failed attempt may have changed before the optimizer step: buffers and RNG.

        The stages' buffers are listed once per set of stage modules (a walk over every submodule costs more
        than the copies of a model without buffers: 50-80 us a step on the demo's stage), again after a re-plan
        gives this rank other modules."""
        mods = tuple(self.stages.values())
        known = self._buffer_list
        if known is None or len(known[0]) != len(mods) or any(a is not b for a, b in zip(known[0], mods)):
            known = self._buffer_list = (mods, list({id(b): b for st in mods for b in st.buffers()}.values()))
        return {"buffers": [(b, b.detach().clone()) for b in known[1]], "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}

    def _restore(self, snap: dict[str, Any] | None) -> None:
        for p in self.parameters():
            p.grad = None
        if self.comm is not None:
            self.comm.forget()
        if snap is None:
            return
        with torch.no_grad():
            for b, old in snap["buffers"]:
                b.copy_(old)
        torch.set_rng_state(snap["rng"])
        if snap["cuda_rng"] is not None:
            torch.cuda.set_rng_state(snap["cuda_rng"], self.device)

    def _sum_once(self, t: Tensor) -> None:
        """A SUM all-reduce over the job of what each stage replica holds once: the ranks of a tensor-parallel
        group hold the same loss, so only place 0 adds its value (every rank adds the rest: the loss
        agreement's count and batch hash)."""
        if isinstance(self.session, TensorParallelSession) and self.session.tp_index:
            t.view(-1)[0] = 0
        dist.all_reduce(t)

    def _order(self, n: int) -> list[tuple[int, Action]]:
        """What this process runs for ``n`` microbatches: its rank's list, or every rank's merged (cached)."""
        if n not in self._orders:
            if self.session is None:
                self._orders[n] = local_order(self.build, n)
            else:
                slot = self.comm.slot if self.comm is not None else self.rank  # (stage, replica) in plan order
                self._orders[n] = [(slot, a) for a in actions_for(self.build, n, self.plan)[slot]]
        return self._orders[n]

    def _run_rank(self, inputs: tuple[Any, ...], targets: Any, loss_fn: Callable[[Any, Any], Tensor], n: int,
                  attempt: int, rank_batch: RankBatch | None = None,
                  validate: Callable[[], float] | None = None) -> Tensor:
        comm, k, r = self.comm, self.stage_index, self.replica
        assert comm is not None
        comm.begin_step(self.steps_done)
        for p in self._cleared():
            p.grad = None
        if self.sync is not None:
            self.sync.begin_step(self.steps_done)  # gradients accumulate into the flat buffer the collective reads
        if self.events is not None and self.host is not None:
            self.events.begin()
            self.host.begin()
        # every rank must have been given this very batch: checked in the loss all-reduce (see .batchcheck)
        # (a rank given only its own rows checks the batch's dataset indices and number instead)
        seen = [inputs, targets] if rank_batch is None else [rank_batch.step, rank_batch.indices]
        # where the one stage spans every rank, the agreement rides its gradient collective: one meeting a step
        one = self.ride_agreement and len(self.plan.stages) == 1 and comm.group_size((0,)) == self.world_size
        rides = (0,) if one else None
        agree = self._agreement(agree_with_check(self._sum_once, fingerprint(seen), self.steps_done + 1, rides))
        counted = self._counts_memory(n, rows=self.batch_rows if rank_batch is not None else
                                      sum(x.shape[0] for x in inputs[:1] if isinstance(x, Tensor)))
        if counted:
            self.saved.reset_peak()
            self.grad_peak.arm()
        if counted or self.device.type == "cuda":  # a CPU's peak RSS: a /proc write now, a read after
            reset_peak_memory(self.device)
        for c in self.compiled:  # the hooks that count memory see only an eager forward's saved tensors
            c.measuring = counted
        with self.saved if counted else contextlib.nullcontext():  # activations saved for backward, at their peak
            try:
                run = run_actions(self.build, self._order(n), self.stages, comm, inputs, targets, loss_fn, n,
                                  device=self.device, optimizer=self.optimizer, agree=agree,
                                  own_rows=rank_batch is not None, scaler=self.scaler, arm=self._arm,
                                  agree_inf=lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX),  # all skip alike
                                  syncs=self._syncs)
                self._agreed_loss = float(run.loss_sum)  # a peer behind may ask for it (Session.reopen)
            except UpdateApplied as e:
                run = e.run
                self._reform_after_update(e)
        busy = self.host.end() if self.host is not None else HostBusy(0.0, 0.0, 0.0)
        self.grad_peak.disarm()
        if counted or self.held is None:  # a walk over every parameter, gradient and state tensor
            # the parameters listed once (a walk over the stages' modules was half the count, busy 2-core VM)
            h = held_bytes((), self.optimizer, extra_params=self.parameters())
            # gradients at their peak; ZeRO-3 parameters too: the whole stage's while a microbatch computes
            gathered = self.sync.gathered_bytes() if self.sync is not None else 0
            self.held = Held(h.params + gathered, max(h.grads, self.grad_peak.bytes), h.optimizer)
        wait_ms, p2p_ms = split_wait(comm.stats)
        if counted or self.device.type == "cuda" or self._peak is None:
            self._peak = peak_memory(self.device)
        mem, mem_kind = self._peak
        gpu = self.gpu.sample()
        t_val = time.perf_counter()
        val = self._validate(validate)
        done = time.perf_counter()
        self.monitor.record(StepMetrics(
            step=self.steps_done, rank=self.rank, stage=k, replica=r, device=str(self.device), microbatches=n,
            samples=(self.batch_rows if rank_batch is not None
                     else sum(x.shape[0] for x in inputs[:1] if isinstance(x, Tensor))),
            step_ms=(run.t_end - run.t_start) * 1e3, pipeline_ms=(run.t_pipe - run.t_start) * 1e3,
            wall_ms=(t_val - self._t_called + time.perf_counter() - done) * 1e3, **_parts_ms(run, self._t_called),
            fwd_ms=sum(run.busy.get((j, True), 0.0) for j in self.stages) * 1e3,  # every stage of this rank
            bwd_ms=sum(run.busy.get((j, False), 0.0) for j in self.stages) * 1e3, wait_ms=wait_ms, p2p_ms=p2p_ms,
            # the gradient sync as this rank pays it: packing the gradients, the collectives, unpacking
            send_ms=comm.stats.send_s * 1e3,
            # the sync phase less its meetings' waits (those inside the forward and backward are not in it)
            allreduce_ms=(run.t_synced - run.t_pipe - (comm.stats.collective_wait_s - run.inner_wait_s)) * 1e3,
            sync_wait_ms=comm.stats.collective_wait_s * 1e3,
            inner_comm_ms=run.inner_comm_s * 1e3, inner_wait_ms=run.inner_wait_s * 1e3,
            optimizer_ms=(run.t_end - run.t_opt) * 1e3, peak_memory_bytes=mem, memory_kind=mem_kind,
            bytes_sent=comm.stats.bytes_sent, bytes_received=comm.stats.bytes_received,
            sync_bytes=self._sync_bytes(dense=False), sync_dense_bytes=self._sync_bytes(dense=True),
            sync_intra_bytes=comm.stats.intra_bytes, sync_inter_bytes=comm.stats.inter_bytes,
            sync_flat_bytes=comm.stats.flat_bytes,
            loss=float(run.loss_sum), retries=attempt, val_loss=val, host=self._hostname, steal=busy.steal,
            others_load=busy.others, cpu_util=busy.cpu_util,
            contention_ms=busy.contention_s * 1e3, held_bytes=self.held.total + self.saved.peak,
            held_activation_bytes=self.saved.peak, held_params_bytes=self.held.params,
            held_grads_bytes=self.held.grads, held_optimizer_bytes=self.held.optimizer,
            reserved_bytes=reserved_memory(self.device), gpu_util=gpu.util if gpu else None,
            gpu_memory_bytes=gpu.memory_bytes if gpu else None, gpu_power_w=gpu.power_w if gpu else None),
            self.events.finish(self.steps_done) if self.events is not None else None)
        self.steps_done += 1
        return run.loss_sum.float()

    def _counts_memory(self, microbatches: int, rows: int) -> bool:
        """Whether this step counts its saved activations and gradients (:func:`~hpml_compile.saved.counts_memory`)."""
        key = (microbatches, rows)
        seen = self._memory_seen.get(key, 0)
        self._memory_seen[key] = seen + 1
        return counts_memory(seen)

    def _arm(self, stage: int) -> None:
        """Just before ``stage``'s last backward of the step: its gradient buckets launch as they become ready."""
        sync = self._syncs.get((stage,))
        if sync is not None:
            sync.arm()

    def feedback(self) -> list[CommState]:
        """This rank's error-feedback state (compressed stages) and its place among a local SGD stage's replicas,
        for checkpoints (:class:`.feedback.Feedback`, :class:`.feedback.Replica`)."""
        return self.sync.state(self.local_module(), self.replica) if self.sync is not None else []

    def _sync_bytes(self, *, dense: bool) -> int:
        """Payload this rank put into its stage's gradient sync this step (``dense``: uncompressed, every step)."""
        return self.sync.sync_bytes(dense=dense) if self.sync is not None else 0

    def _validate(self, validate: Callable[[], float] | None) -> float | None:
        """Run ``validate`` after an update; a communication failure in it must not retry the (applied) step.

        A transient failure re-forms the process group at the next step's number, as a failure after the update
        does (:meth:`_reform_after_update`): the update stands, this step has no validation loss (None), and a
        peer whose validation succeeded fails in the next step's first collective and joins there.

        Raises:
            CommFailure: communication failed during validation and this process group cannot be re-formed (the
                script's own), or the others did not rejoin.
        """
        if validate is None:
            return None
        try:
            return validate()
        except Exception as e:  # noqa: BLE001 -- only transient communication errors are re-classified
            if not is_transient(e):
                raise
            if self.session is None or not self.session.can_retry:
                raise CommFailure(f"step {self.steps_done + 1}: communication failed on rank {self.rank} while "
                                  f"measuring the validation loss after the update ({str(e).splitlines()[0][:200]}); "
                                  "the update is applied, so the step is not retried: resume from the last "
                                  "checkpoint") from e
            reason = str(e).splitlines()[0][:160]
        self._log(f"rank {self.rank}: step {self.steps_done + 1}: {reason} while measuring the validation loss after "
                  "the update, which stands; re-forming the process group; this step has no validation loss")
        self._reform(self.steps_done + 1)
        return None

    def _run_local(self, inputs: tuple[Any, ...], targets: Any, loss_fn: Callable[[Any, Any], Tensor],
                   n: int, validate: Callable[[], float] | None = None) -> Tensor:
        """Every stage here: every rank's action list, merged into one order (:func:`.executor.local_order`)."""
        for p in self.parameters():
            p.grad = None
        if self.events is not None and self.host is not None:
            self.events.begin()
            self.host.begin()
        run = run_actions(self.build, self._order(n), self.stages, self._local, inputs, targets, loss_fn, n,
                          optimizer=self.optimizer, scaler=self.scaler)
        busy = self.host.end() if self.host is not None else HostBusy(0.0, 0.0, 0.0)
        events = self.events.finish(self.steps_done) if self.events is not None else None
        rows = sum(x.shape[0] for x in inputs[:1] if isinstance(x, Tensor))
        wall_ms = (time.perf_counter() - self._t_called) * 1e3
        val = validate() if validate is not None else None
        for k in range(len(self.plan.stages) // self.plan.chunks):  # a rank's stages (interleaved: its chunks)
            held = held_stages(self.plan, k)
            self.monitor.record(StepMetrics(
                step=self.steps_done, rank=self._ranks[k][0], stage=k, replica=0, device="cpu", microbatches=n,
                samples=rows, step_ms=(run.t_end - run.t_start) * 1e3, pipeline_ms=(run.t_synced - run.t_start) * 1e3,
                wall_ms=wall_ms, **_parts_ms(run, self._t_called),
                fwd_ms=sum(run.busy.get((j, True), 0.0) for j in held) * 1e3,
                bwd_ms=sum(run.busy.get((j, False), 0.0) for j in held) * 1e3,
                optimizer_ms=(run.t_end - run.t_synced) * 1e3, loss=float(run.loss_sum), val_loss=val, host=self._hostname,
                steal=busy.steal, others_load=busy.others, cpu_util=busy.cpu_util,
                contention_ms=busy.contention_s * 1e3),
                events if k == min(self.stages) else None)  # one process: one record of every stage's events
        self.steps_done += 1
        return run.loss_sum.float()

    # -- inference and the full model -------------------------------------------------------------
    @torch.no_grad()
    def eval_forward(self, inputs: Sequence[Any] | Tensor, *, everywhere: bool = False) -> Any:
        """The model's output for ``inputs`` (no gradients, modules in eval mode), microbatched like training.

        Args:
            inputs: positional inputs; any multiple of the build's microbatch rows.
            everywhere: return the output on every rank (else only where the last stage runs).

        Returns:
            The output, rows in input order, on the last stage's ranks (every rank with
            ``everywhere``); None on the other ranks.
        """
        inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
        n = self._microbatches(inputs)
        outs = self._eval(inputs, n)
        if self.session is None:
            return merge_outputs([o for _, _, o in sorted(outs, key=lambda t: (t[0], t[1]))])
        return gather_outputs(outs, self.plan, self.rank, everywhere, self._ranks[-1])

    def _eval(self, inputs: tuple[Any, ...], n: int, own: bool = False) -> list[tuple[int, int, Any]]:
        """Forward ``inputs`` in eval mode (each stage's mode is restored after); the last stage's outputs."""
        modes = {k: st.training for k, st in self.stages.items()}
        for st in self.stages.values():
            st.eval()
        try:
            last, outs = len(self.plan.stages) - 1, []
            comm = self.comm if self.comm is not None else self._local
            micro_in = split_microbatches(inputs, n)
            for j in range(n):
                for k, stage in sorted(self.stages.items()):
                    reps = range(self._reps[k]) if self.session is None else (self.replica,)
                    for r in reps:  # a forward's messages as its RECV and SEND tokens move them in training
                        comm.microbatch, comm.replica = j, r
                        if k > 0 and stage.RECV:
                            post_recv(comm, k, k - 1, j, r, stage.RECV)
                        part = micro_in[j] if own else split_replicas(micro_in[j], self._splits[k])[r]
                        out = forward_stage(self.build, stage, part, self.device)
                        if self._sends[k]:
                            post_send(comm, k, k + 1, j, r)
                        if k == last:
                            outs.append((j, r, to_device(self.build.model_output(out), torch.device("cpu"))))
            comm.flush()
            comm.forget()  # receives owe gradients that no backward will ask for
            return outs
        finally:
            for k, st in self.stages.items():
                st.train(modes[k])

    @torch.no_grad()
    def eval_loss(self, inputs: Sequence[Any] | Tensor, targets: Any, loss_fn: Callable[[Any, Any], Tensor], *,
                  rank_batch: RankBatch | None = None) -> float:
        """The loss of one batch in eval mode (dropout off, BatchNorm's running statistics), on every rank.

        Args:
            inputs: the whole batch's positional inputs (ignored with ``rank_batch``).
            targets: the whole batch's targets (ignored with ``rank_batch``).
            loss_fn: ``(output, targets) -> loss``, a mean over the rows it is given.
            rank_batch: only this rank's rows (:mod:`.data`), with a process group.

        Returns:
            The batch's mean loss (the mean of its microbatch slices' losses, as in training).
        """
        own = rank_batch is not None
        if rank_batch is not None:
            inputs, targets, n = rank_batch.inputs or (), rank_batch.target, self.plan.microbatches
        else:
            inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
            n = self._microbatches(inputs)
        outs = self._eval(tuple(inputs), n, own=own)
        total = torch.zeros((), dtype=torch.float64)
        if outs:
            last = len(self.plan.stages) - 1
            ys = split_microbatches(targets, n)
            for j, r, out in outs:
                y = ys[j] if own else split_replicas(ys[j], self._splits[last])[r]
                total += loss_share(loss_fn(out, y).detach().double().cpu(), self._splits[last], r, n)
        if self.session is not None:
            self._sum_once(total)  # only the last stage's replicas add anything
        return float(total)

    # -- users who own their loop (see .trainer) ----------------------------------------------------
    def save(self, root: str | Path, *, extra: dict[str, Any] | None = None, keep: int = 3) -> Path:
        """Checkpoint what ``hpml-compile run`` keeps (:func:`.trainer.save_pipeline`); call on every rank."""
        from .trainer import save_pipeline

        return save_pipeline(self, root, extra=extra, keep=keep)

    def load(self, root: str | Path, *, missing_ok: bool = False) -> dict[str, Any] | None:
        """Resume from the latest checkpoint in ``root`` under this plan; returns ``extra`` and ``step``
        (None with ``missing_ok`` when there is none yet)."""
        from .trainer import load_pipeline

        return load_pipeline(self, root, missing_ok=missing_ok)

    def evaluate(self, loader: Iterable[Any], loss_fn: Callable[[Any, Any], Tensor] | None = None) -> float:
        """Mean eval-mode loss over ``loader``'s ``(inputs, target)`` batches (:func:`.trainer.evaluate_pipeline`)."""
        from .trainer import evaluate_pipeline

        return evaluate_pipeline(self, loader, loss_fn)

    def state_dict(self) -> dict[str, Tensor]:
        """The full model's state (original names, CPU tensors, current values); call on every rank."""
        if self.session is None:
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        with self.whole():
            canonical = self._places.table(0) if self._places is not None else None  # the same owners everywhere
            return gather_state_dict(self.model, self.build, self.rank, canonical)

    @contextlib.contextmanager
    def whole(self, *, changed: bool = False) -> Iterator[None]:
        """This rank's ZeRO-3 parameters gathered for the block (a collective over the stage's replicas; a no-op
        without ZeRO-3), for what reads or writes parameters outside a step: the state dict, checkpoints.

        Args:
            changed: the block writes the parameters (a checkpoint load): each replica's shard takes its part.
        """
        with contextlib.ExitStack() as stack:
            if self.sync is not None:  # ZeRO-3 gathers; a hierarchical ZeRO-1 shard takes its pieces of a write after
                stack.enter_context(self.sync.whole(changed=changed))
            if self.session is not None:  # tensor-parallel slices (:mod:`.tensor_parallel`)
                stack.enter_context(whole_params(self.build, self.model, sorted(self.stages), changed=changed,
                                                 optimizer=getattr(self, "optimizer", None)))
            yield

    def settle(self) -> None:
        """Wait for the parameters' prefetched all-gathers (ZeRO-1/2 where the sync overlaps: launched after the
        optimizer step, waited by the next forward, see :meth:`.zero.FlatShard.enable_prefetch`). Call it before
        reading the model's parameters directly between steps; the state dict, checkpoints, evaluation,
        :meth:`close`, and a forward or ``state_dict()`` of the user's model itself (hooks on its root module)
        wait on their own. A no-op elsewhere."""
        if self.sync is not None:
            self.sync.settle()

    def close(self) -> None:
        """Flush the measurements and leave the process group (if this pipeline made it); the parameters'
        prefetched all-gathers are waited first (none is left in flight)."""
        self.settle()
        self.monitor.close()
        if self.session is not None:
            self.session.close()


def _parts_ms(run: StepRun, t_called: float) -> dict[str, float]:
    """The step's parts that no other measurement names (:class:`~..observe.monitor.StepMetrics`): ``loss_ms``,
    ``between_ms`` (the executor's span outside its tokens) and ``before_ms`` (``Pipeline.step`` before it)."""
    return {"loss_ms": run.loss_s * 1e3, "between_ms": max(0.0, run.t_end - run.t_start - run.tokens_s) * 1e3,
            "before_ms": max(0.0, run.t_start - t_called) * 1e3}


def _compiled_under(plan: Plan, mode: CompileStages, device: torch.device, log: Callable[[str], None]
                    ) -> CompileStages:
    """``mode``, or off under ZB-H1 (its backward is split at autograd's nodes, which a compiled stage's one
    backward node hides): said in one line where ``auto`` would have compiled, refused where ``on`` asks.

    Raises:
        OptionError: ``compile_stages="on"`` with a ZB-H1 plan.
    """
    if plan.schedule is not Schedule.ZB_H1 or not mode.wants(device):
        return mode
    if mode is CompileStages.ON:
        raise OptionError("compile_stages=on: schedule zb-h1 splits each backward into its input- and weight-"
                          "gradient parts at autograd's nodes, which a compiled stage hides in one node; run it "
                          "with compile_stages=off (or auto), or compile the plan with schedule 1f1b")
    log("every stage runs uncompiled: schedule zb-h1 splits each backward at autograd's nodes, which a compiled "
        "stage hides in one node")
    return CompileStages.OFF

