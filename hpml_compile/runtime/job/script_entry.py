"""The program torchrun starts for each rank of ``hpml-compile launch``: the launcher watched, then the user's script.

``python script_entry.py SCRIPT ARGS...`` runs ``SCRIPT`` as ``python SCRIPT
ARGS...`` would (``__name__ == "__main__"``, ``sys.argv`` and ``sys.path[0]``
as Python sets them for a script, via :func:`runpy.run_path`), after one
thing: a thread that ends the rank when its launcher is gone
(:func:`~hpml_compile.runtime.job.lifeline.watch_launcher`). A user's script
does not watch its launcher itself, so without this a launch agent killed
with SIGKILL would leave its ranks running until their peers' collectives
time out.

Why :func:`runpy.run_path` and not ``exec`` of a new interpreter: the watcher
is a thread, and a thread does not survive ``exec`` (``prctl(PR_SET_PDEATHSIG)``
would, but it follows the agent's thread that started the rank, not the
launcher: see :mod:`.lifeline`). :mod:`.lifeline` is loaded from its file, not
imported through the package: it needs only the standard library, and the
script's own imports then happen in the order it writes them.
"""

import importlib.util
import os
import runpy
import sys


def _watch() -> None:
    """Start the launcher watch (a no-op when no launcher is recorded in the environment)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lifeline.py")
    spec = importlib.util.spec_from_file_location("_hpml_lifeline", path)
    assert spec is not None and spec.loader is not None
    lifeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lifeline)
    rank = os.environ.get("RANK", "")
    lifeline.watch_launcher(rank=int(rank) if rank.isdigit() else None)


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` as a script with arguments ``argv[1:]``, its launcher watched.

    Args:
        argv: the script's path and its arguments.
    """
    if not argv:
        raise SystemExit("usage: script_entry.py SCRIPT [ARGS...] (hpml-compile launch starts it on each rank)")
    _watch()
    script = argv[0]
    sys.argv = list(argv)
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this folder is no root of packages: its modules must not shadow the script's imports
    if not getattr(sys.flags, "safe_path", False):  # as for `python SCRIPT`: the script's folder first
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
