"""Moving tensors between ranks: the communicators and the data-parallel sync of gradients and parameters.

:mod:`.stage` is the one interface a step uses (:class:`~.stage.StageSync`, one class per implementation a
collective token names, chosen from the plan by :func:`~.stage.for_stage`); :mod:`.comm` holds the communicators (a mailbox in one process; NCCL between GPUs, gloo where a CPU is
involved, host staging), their byte statistics and fault injection; :mod:`.shm` reduces through shared
memory between the ranks of one host and :mod:`.hierarchy` chains reductions host by host; :mod:`.zero`
(flat buffers, ZeRO-1/2) and :mod:`.zero3` (parameters gathered around a stage's compute) shard a stage
across its replicas; :mod:`.compress` and :mod:`.feedback` compress gradients with error feedback (and
local SGD's model averaging); :mod:`.offload` keeps optimizer state and step in host memory. This is the
bottom room: it imports no other room of the runtime.
"""
