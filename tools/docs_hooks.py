"""MkDocs hooks: the pages that are generated from the code at build time, so that they cannot drift.

- ``<!-- cli-reference -->`` in a page becomes every command's ``--help``, from
  :func:`hpml_compile.cli.build_parser` (the parser the CLI runs).
- ``<!-- error-reference -->`` becomes one section per :class:`~hpml_compile.errors.HpmlError` class: its
  docstring (what it means) and the fix from :data:`FIXES`. A class without a fix fails the build, so a new
  error class cannot reach users undocumented.
- ``<!-- results-table -->`` becomes the README's results table (``benchmarks/results_table.py``).
- Each ``benchmarks/<name>/README.md`` is added to the site as ``benchmarks/<name>.md``.

Why hooks and not a plugin: three small text substitutions need no package of their own
(https://www.mkdocs.org/user-guide/configuration/#hooks).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the docs document this checkout, not an installed copy
    sys.path.insert(0, str(ROOT))

from hpml_compile import errors  # noqa: E402
from hpml_compile.cli import build_parser  # noqa: E402

#: What a user does about each error. Keyed by class name; the build fails on a class missing here.
FIXES: dict[str, str] = {
    "HpmlError": "The base class: catch it to handle every error hpml-compile raises on purpose. Its message says "
                 "what to do; the CLI prints it as one line and exits with status 2.",
    "SchemaError": "Correct the field the message names (file, path inside it, what was expected, what was "
                   "found). Files are never repaired silently: regenerate a profile with `hpml-compile profile`, "
                   "a plan with `hpml-compile plan`, or edit your `cluster.json`.",
    "TraceError": "Mark the module the message names as a leaf (`--leaf ClassName`, or `leaf_modules=[...]` in "
                  "Python), so it stays one opaque node, or use the export front end (`--front-end export`).",
    "ModelError": "Check the model name (`hpml-compile models`), the factory's `path/to/file.py:name`, or the "
                  "TrainSpec field the message names; a factory returns `(module, example_inputs)`.",
    "UnknownDeviceError": "Use a kind `hpml-compile devices` lists, or profile for the kind (`--device-kinds`) "
                          "before planning a cluster that has it.",
    "InfeasibleError": "The message names each device's shortfall. Add devices, lower the batch size, or let the "
                       "solver use memory options (ZeRO, recompute, offload on GPUs); for a model larger than "
                       "the cluster's memory no option helps.",
    "BuildMismatchError": "The build no longer matches its model or manifest (an edited stage file, a changed "
                          "model file). Compile again: `hpml-compile compile ... -o build/`.",
    "OutputError": "Choose an output folder that is empty or was written by hpml-compile; the tool never "
                   "overwrites files it did not make.",
    "PlanError": "The plan breaks a rule the message names (a node placed twice, a producer after its "
                 "consumer, memory over budget). Plans written by `plan` are valid; a hand-edited plan must "
                 "keep the rules of `hpml_compile.plan.validate_plan`.",
    "LaunchError": "The ranks could not start, or one failed; the message names the rank and its exit. Check "
                   "the run folder's logs; with `--adapt` the job re-plans around a failed device itself.",
    "RankFailure": "A rank failed while the job ran (its exit code and torchrun's message are attached). Run "
                   "again with `--adapt` to recover from the last checkpoint, or fix the cause in the rank log.",
    "SupervisorError": "The closed loop cannot go on: no device is left, or no plan fits those that are. The "
                       "message gives the last intact checkpoint; resume from it on more devices.",
    "CheckpointError": "Point `--checkpoint-dir` at a folder with a complete checkpoint, or start without "
                       "`--resume`; a damaged newest checkpoint falls back to the previous one by itself.",
    "CommFailure": "A step's communication failed after its retries. Check the network between hosts and the "
                   "`--timeout`; with `--adapt` the job re-forms the group and resumes.",
    "RanksLost": "Ranks died during a step. With `live=True` the survivors go on in place when every lost rank "
                 "was one replica of a replicated stage (plain data parallel); otherwise resume from the last "
                 "checkpoint (`run --adapt` does this by itself) on the devices left.",
    "LeadLost": "Host 0 of a multi-host `run --adapt` was lost before the other hosts could take over (before "
                "every host had announced itself, or a second time). The checkpoints in `--run-dir` are intact: "
                "start the hosts left with the same `--run-dir`, one of them as host 0, to resume.",
    "HandoffError": "A rank of the generator exited or stopped answering: see the first error of the other "
                    "ranks (often out of memory), fix it and start again; `serve` re-places the model by itself.",
    "JoinRefused": "The running job has no place for this process: name a device of the plan's cluster that no "
                   "rank uses (`join=\"cpu3\"`), of the kind its stage runs on, on a replicated stage without "
                   "tensor parallelism, ZeRO shards, compressed or local-SGD gradients; or re-plan with more devices.",
    "ScheduleError": "A build's per-rank action lists cannot run (an unmatched message, a deadlock). Builds "
                     "made by `compile` are checked before they run; compile again rather than editing one.",
    "IndexFormatError": "The checkpoint's `index.json` does not describe its own tensors: it was edited or "
                        "comes from elsewhere. Use another checkpoint.",
    "RanksTimeout": "Ranks did not finish in time: a deadlock, or a machine far slower than expected. Raise the "
                    "time-out, or look for a rank stuck in communication in the run's events.",
    "BatchMismatchError": "Ranks that must read the same batch were given different ones. Give every rank the "
                          "same batch in `Pipeline.step` (it takes its own rows), or use a TrainSpec and "
                          "`pipe.trainer.step()`.",
    "OptionError": "Correct the option the message names, within the range it gives; nothing has started yet.",
    "UpdateApplied": "Raised inside the runtime and handled there: the step's update stands and the pipeline "
                     "completes the failed collective before the next step. Seen by a user only in a traceback "
                     "of another error.",
}


def _error_classes() -> list[type[errors.HpmlError]]:
    """Every error class of the package, base first, in the order of ``errors.__all__``."""
    return [getattr(errors, name) for name in errors.__all__]


def error_reference() -> str:
    """The troubleshooting page's body: one section per error class.

    Raises:
        KeyError: an error class has no entry in :data:`FIXES`.
    """
    missing = [c.__name__ for c in _error_classes() if c.__name__ not in FIXES]
    if missing:
        raise KeyError(f"tools/docs_hooks.py FIXES has no fix for {', '.join(missing)}")
    out = []
    for cls in _error_classes():
        doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        base = cls.__mro__[1].__name__
        out.append(f"### `{cls.__name__}`\n\n*Subclass of `{base}`.* {doc}\n\n**What to do.** {FIXES[cls.__name__]}\n")
    return "\n".join(out)


def _help(parser: argparse.ArgumentParser) -> str:
    saved = parser.formatter_class
    parser.formatter_class = lambda prog: saved(prog, width=100)  # type: ignore[assignment,misc]
    try:
        return parser.format_help()
    finally:
        parser.formatter_class = saved


def cli_reference() -> str:
    """The CLI reference's body: the top-level help, then every command's ``--help``."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parts = ["## hpml-compile\n", "```text", _help(parser).rstrip(), "```\n"]
    for name, p in sub.choices.items():
        parts += [f"## {name}\n", "```text", _help(p).rstrip(), "```\n"]
    return "\n".join(parts)


def results_table() -> str:
    """The README's results table, without its markers."""
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "benchmarks" / "results_table.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    table = mod.render(mod.rows())
    # the README links its details relative to the repository root; the site has the READMEs under benchmarks/
    table = re.sub(r"\(benchmarks/([a-z_]+)/README\.md\)", r"(benchmarks/\1.md)", table)
    return "\n".join(line for line in table.splitlines() if not line.startswith("<!--"))


_MARKERS = {"<!-- cli-reference -->": cli_reference, "<!-- error-reference -->": error_reference,
            "<!-- results-table -->": results_table}


def on_page_markdown(markdown: str, **_: Any) -> str:
    """Replace each marker of :data:`_MARKERS` in a page with its generated text."""
    for marker, make in _MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown


def on_files(files: Any, config: Any) -> Any:
    """Add each benchmark's README to the site as ``benchmarks/<name>.md``."""
    from mkdocs.structure.files import File

    for readme in sorted((ROOT / "benchmarks").glob("*/README.md")):
        text = readme.read_text()
        files.append(File.generated(config, f"benchmarks/{readme.parent.name}.md", content=text))
    return files
