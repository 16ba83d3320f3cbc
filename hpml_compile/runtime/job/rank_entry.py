"""The program torchrun starts for each rank: signal handling first, then :func:`hpml_compile.runtime.job.worker.main`.

torchrun forwards the signal that stops it (Ctrl-C's SIGINT, SIGTERM) to
every rank. A rank that is still importing torch when it arrives would print
a KeyboardInterrupt traceback per rank, so this file is started as a script
(``python rank_entry.py``, not ``-m``, which would import the package and
torch first) and makes SIGINT and SIGTERM end the process quietly before it
imports anything else. The launcher prints the one line that says what
happened. ``os._exit`` rather than ``SystemExit``: an orderly interpreter exit
would destroy gloo's C++ threads while they run ("terminate called without an
active exception"); the per-step files are flushed as they are written.
"""

import os
import signal
import sys


def _stop(signum: int, _frame: object) -> None:
    os._exit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this folder is no root of packages: its comm.py must not shadow anything
    from hpml_compile.runtime.job.worker import main

    sys.exit(main())
