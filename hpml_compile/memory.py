"""The memory types shared by the solvers, the simulator and plan validation.

The memory model itself (what a device of a stage holds under each ZeRO stage,
recompute, offload and swap) lives in :mod:`hpml_compile.stagecost`, beside the
other stage costs, so that the simulator and the solvers' candidate table read
one formula; this module keeps the types and units that many modules import.

Example:
    >>> m = MemoryBreakdown(params=100, grads=100, optimizer=100, stored_per_microbatch=10, working=0, in_flight=2)
    >>> m.static, m.activations, m.total
    (300, 20, 320)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .hostmem import MMAP_THRESHOLD

__all__ = ["ZeroStage", "MemoryBreakdown", "process_bytes", "heap_slack_bytes", "HEAP_SLACK_BLOCKS", "tied_shm_bytes", "SHM_SLOT_BYTES", "SHM_DIRECT_BYTES",
           "RIDE_IN_BYTES", "dtype_bytes", "compute_bytes", "GiB", "tied_elsewhere", "tied_shared",
           "autocast_copy_bytes", "bucket_ranges", "FIRST_BUCKET_BYTES", "BUCKET_BYTES"]

GiB = 2**30


class ZeroStage(enum.IntEnum):
    """ZeRO stage of a replicated stage: what is sharded over its replicas."""

    NONE = 0  # plain data parallel: everything replicated
    OS = 1  # optimizer state sharded
    OS_G = 2  # + gradients
    OS_G_P = 3  # + parameters


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a profile dtype name (``"float32"`` -> 4)."""
    return {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 4)


def compute_bytes(precision: str) -> int:
    """Bytes per element of a plan's compute dtype under autocast (``"bf16"``, ``"fp16"``: 2); 0 for ``"fp32"``
    (no autocast, no weight copies: see :func:`autocast_copy_bytes`)."""
    return {"bf16": 2, "fp16": 2}.get(str(getattr(precision, "value", precision)), 0)


def autocast_copy_bytes(param_bytes: Any, dtype_bytes: int, compute_bytes: int, microbatches: int,
                        replicas: int) -> Any:
    """The autocast weight copies a microbatch in flight holds beyond what the profile's activations count.

    Under autocast every matmul casts its weight to the compute dtype and
    saves that copy for the backward; the cache lives for one forward call, so
    each microbatch in flight (each replica's, each microbatch's forward) holds
    a whole copy of the stage's weights, ``C = P * compute_bytes / dtype_bytes``.
    The profile, taken once over the whole batch under autocast, counts ``C``
    once among the activations, which the memory model divides among the
    ``M * d`` microbatch slices; this is the rest, ``C - C / (M d)``, to add per
    microbatch in flight. Every parameter is counted as cast (norm weights and
    embedding tables are not, so this errs high, by their share).

    Args:
        param_bytes: the stage's parameter bytes in the parameters' dtype (an int or an int64 array).
        dtype_bytes: bytes per parameter element.
        compute_bytes: bytes per element of the compute dtype (:func:`compute_bytes`; 0: no autocast).
        microbatches: ``M``.
        replicas: ``d``.

    Returns:
        Bytes, of the form of ``param_bytes`` (0 without autocast).

    Example:
        >>> autocast_copy_bytes(400, 4, 2, microbatches=2, replicas=2), autocast_copy_bytes(400, 4, 0, 2, 2)
        (150, 0)
    """
    if not compute_bytes or compute_bytes >= dtype_bytes:
        return param_bytes * 0
    copies = param_bytes * compute_bytes // dtype_bytes
    return copies - copies // (max(1, microbatches) * max(1, replicas))


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes on one device of a stage, by what holds them.

    Attributes:
        params: parameter bytes.
        grads: gradient bytes.
        optimizer: Adam state bytes on the device.
        stored_per_microbatch: activation bytes kept per microbatch in flight.
        working: activation bytes of the one microbatch whose backward runs
            (recomputed or swapped back in).
        in_flight: microbatches whose activations are kept at the peak.
        host_bytes: bytes moved to host memory (offloaded optimizer state).
        process: bytes the device's process holds besides the stage's tensors (a CPU rank: the runtime's
            baseline and the rest of the model, :func:`process_bytes`; 0 on a GPU, or where not measured).
    """

    params: int
    grads: int
    optimizer: int
    stored_per_microbatch: int
    working: int
    in_flight: int
    host_bytes: int = 0
    process: int = 0

    @property
    def static(self) -> int:
        """Bytes held for the whole step: parameters, gradients, optimizer state, and the process's own."""
        return self.params + self.grads + self.optimizer + self.process

    @property
    def tensors(self) -> int:
        """Peak bytes of the stage's tensors alone (what the runtime's hooks count): the total less ``process``."""
        return self.total - self.process

    @property
    def activations(self) -> int:
        """Activation bytes at the peak."""
        return self.in_flight * self.stored_per_microbatch + self.working

    @property
    def total(self) -> int:
        """Peak bytes on the device."""
        return self.static + self.activations


# Each rank's slot of the shared memory a CPU stage's gradient collective goes through on one host
# (hpml_compile.runtime.sync.shm.SLOT_BYTES: a larger gradient goes in pieces); every member maps every slot.
SHM_SLOT_BYTES = 64 << 20
# An all-reduce of fewer bytes goes through gloo, its meeting issued with it, not through the shared mapping
# (hpml_compile.runtime.sync.shm.DIRECT_BYTES; hpml_compile.simulate prices the two ways).
SHM_DIRECT_BYTES = 1 << 20
# Such an all-reduce and the loss agreement's vector that rides it are summed as ONE float64 all-reduce where the
# two come to at most this many bytes in float64 (hpml_compile.runtime.sync.comm.DistComm, whose docstring has
# the measurements; hpml_compile.simulate prices it so).
RIDE_IN_BYTES = SHM_DIRECT_BYTES // 2
# How many of a step's largest heap blocks a CPU rank's peak resident set may hold beyond its live bytes, where
# malloc could not place the block in memory the process already holds (heap_slack_bytes).
HEAP_SLACK_BLOCKS = 2


def _smaller(a: Any, b: Any) -> Any:
    """The smaller of ``a`` and ``b``, element-wise where they are numpy arrays (no branch on a value)."""
    return a * (a <= b) + b * (a > b)


def process_bytes(baseline: Any, model_param_bytes: Any, stage_param_bytes: Any, *, replicas: int = 1,
                  zero: int = 0, largest_param: Any = None) -> Any:
    """What a CPU rank's process holds besides its stage's tensors, at the peak (ints, or numpy arrays alike).

    A CPU device's memory is its process's, as its peak resident set counts it (measured against it by
    benchmarks/memory_truth, each rank in a fresh process):

    - the runtime's baseline: the interpreter, torch and the runtime's imports, measured by the profile on this
      host (:mod:`hpml_compile.profile.process`);
    - the model as built: a rank builds the whole model and keeps it. Its stage's parameters are counted with the
      stage where they stay in place (ZeRO-0, one replica); a replicated stage under ZeRO-1/2/3 copies them into
      its flat buffer, and the built ones go back to the allocator, which keeps them (:mod:`hpml_compile.hostmem`),
      so the whole model counts. A model whose ``TrainSpec`` names saved weights leaves the other stages'
      parameters unallocated (:mod:`hpml_compile.runtime.execute.unallocated`): the caller passes the stage's
      own bytes as the model's (the profile's process entry says ``stage_only``);
    - a replicated stage's shared memory: its gradient collectives go through one slot per member of at most
      :data:`SHM_SLOT_BYTES` each, every member mapping every slot (:mod:`hpml_compile.runtime.sync.shm`);
    - the optimizer's temporaries: AdamW's step allocates about two tensors the size of the one it steps (the
      square root of its second moment and the quotient): the flat shard (``P / d``) under ZeRO-1 and up, else
      the stage's largest parameter (``largest_param``, at most the stage's bytes; None: the stage's).
    - the heap's slack (:func:`heap_slack_bytes`): where ``malloc`` places a step's large blocks varies from run
      to run, and a block it cannot place in memory the process already holds grows the heap;
    - under ZeRO-3, one more copy of the stage's parameters (``P``): the gathered flat buffer is freed and
      allocated again for every forward and backward (:mod:`hpml_compile.runtime.sync.zero3`), and between
      two gathers ``malloc`` splits the freed block for smaller tensors (the reduce-scatter's shard, the
      optimizer's temporaries, the next gradient buffer), so the next gather takes fresh memory: measured on
      two CPU ranks (the ``mlp`` zoo model, ``P`` = 30 MiB), a ZeRO-3 rank's resident set exceeded a ZeRO-1
      rank's of the same plan by 20-100 MiB (about 40 typically) over the first steps, where the tensors
      differ by ``P / d`` = 15 MiB.

    Args:
        baseline: the measured baseline bytes.
        model_param_bytes: the whole model's parameter bytes.
        stage_param_bytes: the stage's own (counted with its tensors).
        replicas: the stage's data-parallel degree.
        zero: its ZeRO stage.
        largest_param: the largest parameter's bytes.

    Returns:
        Bytes, of the form of ``stage_param_bytes``.

    >>> process_bytes(300 << 20, 40 << 20, 10 << 20, largest_param=4 << 20) >> 20  # 300 + 30 + 2 x 4, slack 2 x 4
    346
    >>> process_bytes(300 << 20, 40 << 20, 10 << 20, replicas=2, zero=1) >> 20  # 300 + 40 + 2 x 10 + 2 x 5 + 2 x 5
    380
    >>> process_bytes(300 << 20, 40 << 20, 10 << 20, replicas=2, zero=3) >> 20  # the gathered unit again, slack 2 x 10
    400
    """
    flat = replicas > 1 and zero >= 1
    rest = model_param_bytes - stage_param_bytes
    built = model_param_bytes + stage_param_bytes * 0 if flat else rest * (rest > 0)
    shm = replicas * _smaller(stage_param_bytes, SHM_SLOT_BYTES) if replicas > 1 else stage_param_bytes * 0
    stepped = stage_param_bytes // replicas if flat else (
        stage_param_bytes if largest_param is None else _smaller(stage_param_bytes, largest_param))
    regathered = stage_param_bytes if replicas > 1 and zero >= 3 else stage_param_bytes * 0
    slack = heap_slack_bytes(stage_param_bytes, replicas=replicas, zero=zero, largest_param=largest_param)
    return baseline + built + shm + 2 * stepped + regathered + slack


def heap_slack_bytes(stage_param_bytes: Any, *, replicas: int = 1, zero: int = 0, largest_param: Any = None) -> Any:
    """What a CPU rank's peak resident set may hold beyond its live bytes: :data:`HEAP_SLACK_BLOCKS` of the largest
    block its step frees and allocates again on ``malloc``'s heap (ints, or numpy arrays alike).

    A CPU rank keeps the memory it frees (:mod:`hpml_compile.hostmem`), so its resident set is its heap's high-water
    mark. Each step frees and allocates again the same large blocks, in the same order; whether ``malloc`` finds a
    free range for a block depends on where the small allocations between them (Python objects, small tensors)
    landed, and these differ from run to run (with Python's cyclic collector off as well). A block that finds no free
    range is taken from the top of the heap, and the range it left stays resident: the heap grows over the first
    steps, by a different number of blocks in each run, and then stays. Measured on two CPU ranks of the ``mlp``
    zoo model (``P`` = 30 MiB, ZeRO-2: a 30 MiB gradient buffer and 15 MiB shards each step), 26 runs of the
    same build in fresh processes, 3-12 steps each: one rank peaked at 539-615 MiB, the other at 539-585, in steps
    of 15 MiB; the same ranks with every block of 1 MiB and up taken from ``mmap`` (returned when freed: no heap
    to fragment) peaked at 511-512 and 496-497 in each of 6 runs, but each step faulted 34,000 fresh pages in and
    took twice the CPU time.
    The largest block is one ``malloc`` serves from the heap: at most its mmap threshold
    (:data:`hpml_compile.hostmem.MMAP_THRESHOLD`; larger ones are mapped apart and returned when freed).

    Which block a step allocates again:

    - ZeRO-2 and ZeRO-3 on a replicated stage: the stage's flat gradient buffer, freed after each reduce-scatter
      (ZeRO-3 also gathers its parameters into a new buffer for each pass): ``P``;
    - ZeRO-1: the reduce-scatter's shard and AdamW's temporaries of it, ``P / d``;
    - otherwise AdamW's temporaries of the largest parameter (``largest_param``, at most the stage's ``P``; None:
      the stage's).

    Args:
        stage_param_bytes: the stage's parameter bytes ``P``.
        replicas: the stage's data-parallel degree ``d``.
        zero: its ZeRO stage.
        largest_param: the largest parameter's bytes.

    Returns:
        Bytes, of the form of ``stage_param_bytes``.

    >>> heap_slack_bytes(30 << 20, replicas=2, zero=2) >> 20  # two of the 30 MiB gradient buffer
    60
    >>> heap_slack_bytes(30 << 20, replicas=2, zero=1) >> 20  # two of the 15 MiB shard
    30
    >>> heap_slack_bytes(200 << 20, replicas=2, zero=2) >> 20  # mapped apart: at most two of the mmap threshold
    64
    """
    flat = replicas > 1 and zero >= 1
    if flat:
        block = stage_param_bytes if zero >= 2 else stage_param_bytes // replicas
    else:
        block = stage_param_bytes if largest_param is None else _smaller(stage_param_bytes, largest_param)
    return HEAP_SLACK_BLOCKS * _smaller(block, MMAP_THRESHOLD)


def tied_shm_bytes(shared: Any, members: int) -> Any:
    """The shared memory a CPU rank maps for the all-reduce of the gradients of parameters tied across stages.

    The tied parameters' gradients are summed over every rank of the stages that use them, through one flat
    buffer of ``shared`` bytes (counted with the gradients); where those ranks are CPU ranks of one host the sum
    goes through shared memory, one slot of that buffer's size (at most :data:`SHM_SLOT_BYTES`) per member, and
    every member maps every slot (:mod:`hpml_compile.runtime.sync.shm`), as a replicated stage's gradient sync
    does (:func:`process_bytes`). Measured on two CPU ranks of gpt-mini's two-stage pipeline (its tied embedding,
    4 MiB): 8 MiB of shared memory in each rank's resident set after the first step.

    Args:
        shared: bytes of the tied parameters' flat buffer on this rank (an int, or a numpy array alike).
        members: ranks in the all-reduce (0 or 1: none).

    Returns:
        Bytes, of the form of ``shared``.

    >>> tied_shm_bytes(4 << 20, 2) >> 20, tied_shm_bytes(4 << 20, 1), tied_shm_bytes(100 << 20, 2) >> 20
    (8, 0, 128)
    """
    if members <= 1:
        return shared * 0
    return members * (shared * (shared <= SHM_SLOT_BYTES) + SHM_SLOT_BYTES * (shared > SHM_SLOT_BYTES))


def tied_elsewhere(users: Iterable[tuple[str, Sequence[str]]], sizes: Mapping[str, int], members: set[str]) -> int:
    """Bytes of the parameters a stage uses whose first user (where ``param_bytes`` counts them) is elsewhere.

    A profile counts a parameter once, on its first user, so a tied embedding
    and LM head weigh on the first stage only; but a pipeline that puts the
    head on another stage holds the weight there too (and its gradient and
    optimizer state: codegen gives each stage its own copy and all-reduces
    their gradients). A stage's parameter bytes are its nodes' ``param_bytes``
    plus this.

    Args:
        users: ``(node, parameter names it uses)`` for every node, in topological order.
        sizes: bytes per parameter name (a name without a size counts 0).
        members: the stage's nodes.

    Returns:
        Bytes.

    Example:
        >>> order = [("wte", ["w"]), ("h", ["h.w"]), ("head", ["w"])]
        >>> tied_elsewhere(order, {"w": 40, "h.w": 8}, {"h", "head"}), tied_elsewhere(order, {"w": 40}, {"wte"})
        (40, 0)
    """
    first: dict[str, str] = {}
    used: set[str] = set()
    for node, names in users:
        for name in names:
            first.setdefault(name, node)
            if node in members:
                used.add(name)
    return sum(sizes.get(name, 0) for name in used if first[name] not in members)


def tied_shared(users: Iterable[tuple[str, Sequence[str]]], sizes: Mapping[str, int], members: set[str]) -> int:
    """Bytes of the parameters a stage shares with another stage: the flat buffer their gradients are
    all-reduced in between the stages (``codegen.ops``), which the runtime keeps from step to step.

    Args:
        users: ``(node, parameter names it uses)`` for every node.
        sizes: bytes per parameter name.
        members: the stage's nodes.

    Returns:
        Bytes.

    Example:
        >>> order = [("wte", ["w"]), ("h", ["h.w"]), ("head", ["w"])]
        >>> tied_shared(order, {"w": 40, "h.w": 8}, {"wte", "h"}), tied_shared(order, {"w": 40}, {"wte", "h", "head"})
        (40, 0)
    """
    inside: set[str] = set()
    outside: set[str] = set()
    for node, names in users:
        (inside if node in members else outside).update(names)
    return sum(sizes.get(name, 0) for name in inside & outside)


# The overlapped gradient buckets of a replicated stage (hpml_compile.runtime.sync.zero.GradBuckets), here because the
# cost model (hpml_compile.stagecost.overlapped_ms) prices the same buckets the runtime launches.
FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket (small, so that the first launch comes early)
BUCKET_BYTES = 25 << 20  # DDP's bucket_cap_mb


def bucket_ranges(numel: int, element_size: int, first_bytes: int = FIRST_BUCKET_BYTES,
                  cap_bytes: int = BUCKET_BYTES) -> list[tuple[int, int]]:
    """Element ranges ``[lo, hi)`` cutting ``[0, numel)`` from the top: the first of ``first_bytes``, then ``cap_bytes``.

    >>> bucket_ranges(10, 4, first_bytes=8, cap_bytes=16)
    [(8, 10), (4, 8), (0, 4)]
    """
    out: list[tuple[int, int]] = []
    hi, size = numel, max(1, first_bytes // element_size)
    while hi > 0:
        lo = max(0, hi - size)
        out.append((lo, hi))
        hi, size = lo, max(1, cap_bytes // element_size)
    return out
