"""HiGHS without its banner in the middle of ``plan``'s log.

The first HiGHS instance of a process prints two banner lines to file
descriptor 1 when it is constructed, before any option (``output_flag``) can be
set (highspy 1.16), whether we make it (:mod:`.bundle`) or PuLP does
(:mod:`.ilp`). :func:`quiet_banner` makes that first instance with the
descriptor pointed at /dev/null; every later instance prints nothing until
asked to. Why the descriptor and not ``sys.stdout``: the banner is written by
C++, below Python's streams.
"""

from __future__ import annotations

import os
import sys

import highspy

__all__ = ["quiet_banner", "quiet_highs"]

_shown = False


def quiet_banner() -> None:
    """Make this process's first HiGHS instance with stdout silenced (once; later calls do nothing)."""
    global _shown
    if _shown:
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _shown = True


def quiet_highs() -> highspy.Highs:
    """A HiGHS instance that prints nothing."""
    quiet_banner()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    return h
