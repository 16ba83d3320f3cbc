"""Keep freed host memory inside the process, so that a CPU training step stops page-faulting.

PyTorch's CPU allocator hands every freed tensor back to ``malloc``. glibc's
``malloc`` gives large blocks back to the kernel: blocks above the *mmap
threshold* are unmapped when freed, and free space at the top of the heap above
the *trim threshold* is trimmed. A training step allocates and frees the same
sizes every step (activations, gradients, the optimizer's temporaries), so with
glibc's defaults it faults fresh, kernel-zeroed pages in again and again, and
how often depends on glibc's sliding thresholds: the time of a step becomes
bimodal. PyTorch's CPU performance guide recommends jemalloc or tcmalloc for
this; :func:`keep_freed_memory` sets glibc's own two knobs with ``mallopt(3)``
instead, which needs nothing installed and works in an already running process.

Measured on the 2-core development VM (one torch thread, torch 2.13.0), AdamW
over the ``mlp`` zoo model's 31.5 MB: 15-40 ms per step, bimodal, with glibc's
defaults; 14.6-15.4 ms, steady, after :func:`keep_freed_memory`.

The price: memory freed after a peak stays with the process (its RSS does not
shrink), which is what a loop that reaches the same peak every step wants.
Blocks above 32 MiB (glibc's largest mmap threshold on 64-bit) are still
unmapped when freed.

And a rank's peak differs between identical runs. A step frees and allocates
again the same large blocks in the same order (traced by size and thread: all
of them in the main thread, the same sequence in every run), but where
``malloc`` places each depends on the small allocations that landed between
them, which differ from run to run; a block that finds no free range grows the
heap, and the range it could not use stays resident. Measured on two CPU ranks
of the ``mlp`` zoo model under ZeRO-2 (a 30 MiB gradient buffer and 15 MiB
shards each step), 26 runs of one build in fresh processes, 3-12 steps each:
one rank's peak 539-615 MiB, the other's 539-585, in steps of 15 MiB, growing
over the first steps and then steady; ``malloc``'s thread arenas (gloo's
threads) stayed under 1 MiB each, and the part before the first step varied by
1 MiB. With ``MALLOC_MMAP_THRESHOLD_=1048576`` (every block of 1 MiB and up
mapped apart and returned when freed) the two ranks peaked at 511-512 and
496-497 MiB in each of 6 runs, but each step faulted 34,000 fresh pages in and
took twice the CPU time (106 against 52 ms), so the thresholds stay as above
and the memory model counts the slack instead (:func:`hpml_compile.memory.heap_slack_bytes`).

Set ``HPML_KEEP_FREED_MEMORY=0`` to leave ``malloc`` alone; it is also left
alone when the environment already sets ``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES`` (the user chose), and where
the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["keep_freed_memory", "TRIM_THRESHOLD", "MMAP_THRESHOLD"]

# mallopt(3) parameter numbers (glibc malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
TRIM_THRESHOLD = 2**31 - 1  # trim the heap top only beyond 2 GiB free (mallopt takes an int)
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's trim and mmap thresholds in this process (once; later calls return the first answer).

    Returns:
        True when the thresholds are now set, False when ``malloc`` was left alone (not glibc, the
        user's environment decides, or ``HPML_KEEP_FREED_MEMORY=0``).
    """
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if os.environ.get("HPML_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if any(k in os.environ for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(TRIM_THRESHOLD))) and bool(
            libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD)))
    except (OSError, AttributeError):
        return False
