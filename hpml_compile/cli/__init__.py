"""The ``hpml-compile`` command line: :func:`main` and the small commands (profile, devices, models, demo).

Each sub-command is a thin shell over the Python API; errors meant for the
user (:class:`~hpml_compile.errors.HpmlError`) print as one message and exit
with status 2, never as a traceback. The larger commands have a module each
(:mod:`.compile`, :mod:`.plan`, :mod:`.show`, :mod:`.run` with ``report``,
:mod:`.replan`, :mod:`.demo`), imported only when the parser is built, so
that the package holds the commands and nothing a library caller needs.

Example:
    $ hpml-compile profile gpt2-small --batch-size 8 --seq-len 128 --device-kinds cpu,A100-80GB -o profile.json
    $ hpml-compile profile llama-7b --meta --device-kinds A100-80GB,H100-80GB -o p.json
    $ hpml-compile demo
"""

from __future__ import annotations

from dataclasses import replace

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable, Sequence

from ..errors import HpmlError

__all__ = ["main", "build_parser"]

_EPILOG = """\
MODEL is a zoo name (see `hpml-compile models`), hf:<model_type>[?key=value,...]
(a transformers model randomly initialised from its config, nothing downloaded,
e.g. hf:gpt2?n_layer=2), or path/to/file.py:factory (factory returns
(module, example_inputs)).
"""


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds:
        raise argparse.ArgumentTypeError("expected a comma-separated list of device kinds, e.g. cpu,A100-80GB")
    return kinds


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="trace a model and write its per-node costs (profile.json)",
        description="Trace MODEL with torch.fx (or torch.export), time every node's forward and backward on "
                    "the devices present here (the CPU, a CUDA GPU), predict the other device kinds with "
                    "cost_models, and write profile.json.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--batch-size", type=int, help="batch size (default: the model's)")
    p.add_argument("--seq-len", type=int, help="sequence length for language models (default: the model's)")
    p.add_argument("--device-kinds", type=_kinds, default=["cpu"],
                   help="comma-separated device kinds to cost (default: cpu); see `hpml-compile devices`")
    p.add_argument("--meta", action="store_true",
                   help="build the model on the meta device: no weights allocated, nothing measured, "
                        "every cost predicted (for models too big for this machine)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per node, median kept (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per node first (default 2)")
    p.add_argument("--leaf", action="append", default=[], metavar="MODULE",
                   help="keep a module (class name or qualified name) as one opaque node; repeatable")
    p.add_argument("--front-end", choices=["auto", "fx", "export"], default="auto",
                   help="tracer: torch.fx symbolic_trace, torch.export, or fx then export (default)")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads to measure the CPU with (default: this process's); to plan for local-cpu-N "
                        "ranks use what each will have, cores // N (recorded in the profile, checked by `plan`)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="time every node under torch.autocast to this dtype (default fp32); recorded in the file")
    p.add_argument("--gpu-op-us", type=float, default=None, dest="gpu_op_us", metavar="US",
                   help="the host's work per op of the GPU kinds predicted here, in microseconds (default: the "
                        "catalog's eager 70); e.g. 5 for stages that run compiled, an assumption the plan lists")
    p.add_argument("--compiled", action="store_true",
                   help="also time each kind of block compiled by torch.compile (inductor) on the CPU, for stages "
                        "that will run compiled: `plan --compile-stages on` prices them at those times")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    p.add_argument("--no-measure-links", dest="measure_links", action="store_false",
                   help="do not time the gloo link between two processes of this host (by default it is timed "
                        "after the nodes, a few seconds, and recorded in the profile: plans for CPU devices of one "
                        "host then use it where their cluster names no link)")
    p.add_argument("-o", "--output", type=Path, default=Path("profile.json"), help="where to write (profile.json)")
    p.set_defaults(run=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    from .. import models
    from ..profile import check_known_kinds, local_kinds, profile, save_profile
    from ..report import profile_summary

    check_known_kinds(args.device_kinds, known=list(local_kinds()), where="this machine's devices")  # before any work
    loaded = models.load(args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                         device="meta" if args.meta else "cpu", seed=args.seed)
    prof = profile(loaded.module, loaded.example_inputs, name=loaded.name, device_kinds=args.device_kinds,
                   batch_size=loaded.batch_size, seq_len=loaded.seq_len, repeats=args.repeats, warmup=args.warmup,
                   leaf_modules=args.leaf, front_end=args.front_end, progress=not args.quiet,
                   loss_fn=loaded.loss_fn if loaded.example_targets is not None else None,
                   targets=loaded.example_targets, threads=args.threads, precision=args.precision,
                   gpu_op_us=args.gpu_op_us, compiled=args.compiled,
                   say=print if args.compiled and not args.quiet else None)
    if args.measure_links and not args.meta:  # after the nodes: the probe's processes must not disturb their timing
        from ..driver import with_link
        from ..profile.process import this_host, with_process

        host = this_host(log=(lambda line: None) if args.quiet else print)  # cached per host: measured once
        if "link" in host:
            prof = with_link(prof, host["link"])
        if "process" in host:
            prof = with_process(prof, host["process"])
    path = save_profile(prof, args.output)
    if not args.quiet:
        print(profile_summary(prof))
    print(f"wrote {path}")
    return 0


def _add_devices(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("devices", help="list this machine's devices and the device kinds cost_models knows",
                       description="Discover the local devices (NVML for GPUs; CPU otherwise) as a cluster "
                                   "description, and list the catalog's device kinds and links.")
    p.add_argument("-o", "--output", type=Path,
                   help="also write the local devices as cluster.json (with --measure: default cluster.json)")
    p.add_argument("--measure", action="store_true",
                   help="time send/recv and all-reduce between processes of this host (gloo between CPU ranks, "
                        "NCCL between two GPUs, host<->GPU copies) and record the fitted links in the cluster file, "
                        "so that plans for this machine use its own links (~10-30 s)")
    p.add_argument("--cpu-ranks", type=int, default=2, dest="cpu_ranks",
                   help="with --measure: CPU devices cpu0..cpuN-1 sharing this host's memory, as local-cpu-N "
                        "(default 2); the links between them are the measured gloo link")
    p.set_defaults(run=_run_devices)


def _run_devices(args: argparse.Namespace) -> int:
    import cost_models

    from ..cluster import discover
    from ..schema import write_json_atomic

    cluster = discover()
    if args.measure:
        from ..errors import HpmlError
        from ..ir import Cluster
        from ..profile.links import measure_cluster

        if args.cpu_ranks < 1:
            raise HpmlError(f"--cpu-ranks must be at least 1 (CPU processes the plan may use), got {args.cpu_ranks}")
        cpu = next(d for d in cluster.devices if d.is_cpu)
        cpus = tuple(replace(cpu, name=f"cpu{i}", memory_gib=round(cpu.memory_gib / args.cpu_ranks, 3))
                     for i in range(args.cpu_ranks))
        cluster = Cluster(devices=(*(d for d in cluster.devices if not d.is_cpu), *cpus), name=cluster.name)
        cluster, _ = measure_cluster(cluster)
        args.output = args.output or Path("cluster.json")
    print("this machine:")
    for d in cluster.devices:
        print(f"  {d.name:8s} {d.kind:14s} {d.memory_gib:8.1f} GiB  host {d.host}")
    print("known device kinds:")
    for kind in cost_models.known_kinds():
        spec = cost_models.get_device(kind) if kind != "cpu" else None
        if spec is None:
            print(f"  {'cpu':14s} the host CPU, measured at start-up")
            continue
        peak = spec.peak_flops.get("bfloat16") or spec.peak_flops.get("float16") or spec.peak_flops["float32"]
        print(f"  {kind:14s} {spec.memory_bytes / 2**30:6.0f} GiB  {spec.mem_bw / 1e9:6.0f} GB/s  "
              f"{peak / 1e12:6.0f} TFLOP/s (16-bit)")
    print("links: " + ", ".join(cost_models.known_links()))
    for x in cluster.links:
        print(f"  link {x.a}-{x.b}: {x.gbps:g} GB/s, {x.latency_us:g} us{' (shared)' if x.shared else ''}")
    if args.output:
        print(f"wrote {write_json_atomic(cluster.to_dict(), args.output)}")
    return 0


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the built-in model zoo")
    p.set_defaults(run=_run_models)


def _run_models(args: argparse.Namespace) -> int:
    from .. import models

    for name in models.names():
        spec = models.get(name)
        seq = f" seq {spec.default_seq_len}" if spec.default_seq_len else ""
        print(f"  {name:12s} batch {spec.default_batch_size}{seq:9s}  {spec.description}")
    print(_EPILOG)
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="compile a byte GPT for 2 CPU ranks, train it on real text, compare with the plan",
                       description="Runs the tool end to end, with nothing to download: compiles "
                                   "examples/stdlib_lm.py (a byte-level GPT on the source of Python's standard "
                                   "library) onto local-cpu-2, prints the plan and writes its pictures, trains it "
                                   "on 2 torchrun ranks with the training and validation losses as it goes, and "
                                   "prints measured against predicted and the loss against the byte-entropy "
                                   "baseline.")
    p.add_argument("-o", "--output", type=Path, default=Path("out/demo"), help="output folder (out/demo)")
    p.add_argument("--steps", type=int, default=None, help="training steps (300)")
    p.add_argument("--spec", type=Path, default=None, help="the example file (the repository's examples/stdlib_lm.py)")
    p.add_argument("--no-measure-links", dest="measure_links", action="store_false",
                   help="plan with the catalog's gloo link instead of timing this host's (a few seconds)")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from .plan import add_parsers

    add_parsers(sub)


def _add_compile(sub: argparse._SubParsersAction) -> None:
    from .compile import add_parsers

    add_parsers(sub)


def _add_run(sub: argparse._SubParsersAction) -> None:
    from .run import add_parsers

    add_parsers(sub)


def _add_replan(sub: argparse._SubParsersAction) -> None:
    from .replan import add_parsers

    add_parsers(sub)


def _add_show(sub: argparse._SubParsersAction) -> None:
    from .show import add_parsers

    add_parsers(sub)


def _add_infer(sub: argparse._SubParsersAction) -> None:
    from .infer import add_parsers

    add_parsers(sub)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run your own training script on N ranks (on one host or several), restarting "
                                      "it after failures",
                       description="Start SCRIPT on --nproc local ranks with torchrun; when a rank fails, start it "
                                   "again, on as many ranks, to resume from its checkpoint. With --adapt, a rank "
                                   "that died (killed) loses its device: the next start has one rank fewer and "
                                   "HPML_CLUSTER names the devices left, so the script's compile() re-plans for "
                                   "them. Across hosts (--adapt --nnodes N --node-rank R --rdzv-endpoint HOST:PORT "
                                   "--run-dir DIR on each host, DIR on a file system every host mounts), as run "
                                   "--adapt: host 0 holds the job's store at the endpoint and decides; a host that "
                                   "falls silent for --host-timeout seconds is lost, its ranks dropped, and the "
                                   "script restarts on the hosts left with HPML_CLUSTER naming their devices (a "
                                   "lost host 0 is taken over by the next). --adapt does NOT re-plan on a measured "
                                   "imbalance under launch (run --adapt does, for builds). The script finds "
                                   "HPML_CLUSTER, HPML_CHECKPOINT_DIR, HPML_RUN_DIR and HPML_SEGMENT in its "
                                   "environment (examples/own_loop.py is one); starts and failures go to "
                                   "RUN_DIR/events.jsonl. Every rank ends with the launch, even one killed with "
                                   "SIGKILL.")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the first start, on each host (default 2)")
    p.add_argument("--run-dir", type=Path, default=None, dest="run_dir",
                   help="segments go here (default out/launch; across hosts: required, the same shared DIR on every "
                        "host)")
    p.add_argument("--checkpoint-dir", type=Path, default=None, dest="checkpoint_dir",
                   help="told to the script as HPML_CHECKPOINT_DIR (default RUN_DIR/checkpoints; across hosts: "
                        "shared too)")
    p.add_argument("--adapt", action="store_true",
                   help="drop a dead rank's device (across hosts: a lost host's) and restart on the devices left "
                        "(HPML_CLUSTER names them: the script's compile() re-plans); failure recovery only, no "
                        "re-planning on imbalance")
    p.add_argument("--max-failures", type=int, default=2, dest="max_failures",
                   help="restarts after failures (with --adapt: failures that killed no rank) (default 2)")
    p.add_argument("--nnodes", type=int, default=1, help="hosts taking part (default 1; more needs --adapt)")
    p.add_argument("--node-rank", type=int, default=None, dest="node_rank",
                   help="across hosts: this host's rank 0..nnodes-1 (host 0 listens at --rdzv-endpoint and decides)")
    p.add_argument("--rdzv-endpoint", default=None, dest="rdzv_endpoint", metavar="HOST:PORT",
                   help="across hosts: host 0's address and a free port, the same on every host")
    p.add_argument("--host-timeout", type=float, default=None, dest="host_timeout", metavar="S",
                   help="across hosts: a host silent for S seconds is lost, its ranks dropped (default 3)")
    p.add_argument("script", type=Path, metavar="SCRIPT",
                   help="your training script, run on every rank as `python SCRIPT ARGS` (RANK, WORLD_SIZE and the "
                        "HPML_* variables above in its environment)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="the script's own arguments: everything after SCRIPT goes to it")
    p.set_defaults(run=_run_launch)


def _check_launch(args: argparse.Namespace) -> None:
    """Refuse ``launch`` options that do not go together, before anything starts.

    Raises:
        OptionError: naming the option, what it needs and the fix.
        LaunchError: a ``--rdzv-endpoint`` that is not ``HOST:PORT``.
    """
    from ..errors import OptionError
    from ..runtime.job.launcher import parse_endpoint

    for option, value, low in (("--nproc", args.nproc, 1), ("--nnodes", args.nnodes, 1),
                               ("--max-failures", args.max_failures, 0)):
        if value < low:
            raise OptionError(f"launch {option} {value}: expected a whole number, {low} or more")
    if args.host_timeout is not None and not (math.isfinite(args.host_timeout) and args.host_timeout > 0):
        raise OptionError(f"launch --host-timeout {args.host_timeout}: expected seconds above 0, e.g. 3")
    if args.nnodes == 1:
        for option, value in (("--node-rank", args.node_rank), ("--rdzv-endpoint", args.rdzv_endpoint),
                              ("--host-timeout", args.host_timeout)):
            if value is not None:
                raise OptionError(f"launch {option} is for a job across hosts: add --adapt --nnodes N (2 or more), "
                                  f"or drop {option}")
        return
    if not args.adapt:
        raise OptionError(f"launch --nnodes {args.nnodes} runs under --adapt (a lost host's ranks are dropped and the "
                          "script restarts on the hosts left): add --adapt")
    if args.node_rank is None or args.rdzv_endpoint is None or args.run_dir is None:
        raise OptionError(f"launch --adapt --nnodes {args.nnodes} needs --node-rank R (0 on the host at the endpoint, "
                          "which decides), --rdzv-endpoint HOST:PORT (the same on every host) and --run-dir DIR, the "
                          "same DIR on every host (a shared file system: the hosts left resume from the checkpoints "
                          "there)")
    if not 0 <= args.node_rank < args.nnodes:
        raise OptionError(f"launch --node-rank {args.node_rank}: expected this host's rank among --nnodes "
                          f"{args.nnodes}, 0..{args.nnodes - 1} (each host its own, 0 the one at --rdzv-endpoint)")
    parse_endpoint(args.rdzv_endpoint)


def _run_launch(args: argparse.Namespace) -> int:
    from ..runtime.job.hosts import LOST_AFTER_S
    from ..runtime.job.scriptlaunch import launch_hosts, launch_script

    _check_launch(args)
    run_dir = args.run_dir or Path("out/launch")
    checkpoint_dir = args.checkpoint_dir or run_dir / "checkpoints"

    def say(line: str) -> None:
        print(line, flush=True)

    if args.nnodes == 1:
        launch_script(args.script, args.script_args, nproc=args.nproc, run_dir=run_dir, checkpoint_dir=checkpoint_dir,
                      max_failures=args.max_failures, adapt=args.adapt, log=say)
        return 0
    print(f"launch --adapt: host {args.node_rank} of {args.nnodes}, {args.nproc} rank(s) here, {args.script} -> "
          f"{run_dir} (the job's store at {args.rdzv_endpoint})", flush=True)
    events = launch_hosts(args.script, args.script_args, nproc=args.nproc, run_dir=run_dir,
                          checkpoint_dir=checkpoint_dir, host=args.node_rank, nnodes=args.nnodes,
                          endpoint=args.rdzv_endpoint, max_failures=args.max_failures,
                          lost_after_s=args.host_timeout if args.host_timeout is not None else LOST_AFTER_S, log=say)
    if not events:
        print(f"done: host {args.node_rank}'s part finished; the job's events are in {run_dir / 'events.jsonl'}")
    return 0


#: One worked example per command, printed at the end of its ``--help`` (a test checks that every command has one).
EXAMPLES: dict[str, str] = {
    "demo": "hpml-compile demo -o out/demo",
    "compile": "hpml-compile compile examples/digits_cnn.py:spec --cluster local-cpu-2 -o build/\n"
               "  hpml-compile compile mlp-tiny --cluster local-cpu-1 --compile-stages on -o build/   # stages "
               "compiled: profiled, planned and run so",
    "run": "hpml-compile run build/ --epochs 2 --checkpoint-dir ck --checkpoint-every 20\n"
           "  hpml-compile run build/ --steps 50 --adapt --slow 1:3:10     # a drill: rank 1 three times slower\n"
           "  hpml-compile run build/ --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29400 --run-dir /shared/run"
           "   # on host0; host1 the same with --node-rank 1",
    "report": "hpml-compile report out/runs/a\n"
              "  hpml-compile report out/runs/a --html report.html --trace trace.json   # also a page and a trace",
    "launch": "hpml-compile launch --nproc 2 examples/own_loop.py --steps 12   # restarted after a failure\n"
              "  hpml-compile launch --adapt --nproc 2 --run-dir out/own examples/own_loop.py --steps 12\n"
              "  hpml-compile launch --adapt --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29400 --nproc 2 "
              "--run-dir /shared/own examples/own_loop.py --steps 40   # on host0; host1 the same with --node-rank 1",
    "profile": "hpml-compile profile gpt2-small --batch-size 8 --seq-len 128 --device-kinds cpu,A100-80GB "
               "-o profile.json",
    "plan": "hpml-compile plan profile.json --cluster hetero-4 -o plan.json",
    "show": "hpml-compile show plan.json -o pics/",
    "replan": "hpml-compile replan build/plan.json --profile out/runs/a/profile.json -o build2/",
    "devices": "hpml-compile devices --measure -o cluster.json",
    "models": "hpml-compile models",
    "generate": "hpml-compile generate build/ --prompt 'def main(' --max-new-tokens 32",
    "infer": "hpml-compile infer build/ --data prompts.jsonl -o answers.jsonl --batch-size 8",
    "serve": "hpml-compile serve build/ --port 8000 --max-batch 16",
}


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that text already broken into lines (an epilog's examples) is kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _add_examples(sub: argparse._SubParsersAction) -> None:
    """End each command's ``--help`` with its example from :data:`EXAMPLES`, after any epilog it has."""
    for name, p in sub.choices.items():
        example = f"example:\n  {EXAMPLES[name]}\n" if name in EXAMPLES else ""
        p.epilog = (p.epilog.rstrip("\n") + "\n\n" + example) if p.epilog else example
        p.formatter_class = _HelpFormatter


_ADDERS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_demo, _add_compile, _add_run, _add_launch, _add_profile, _add_plan, _add_show, _add_replan, _add_devices,
    _add_models, _add_infer,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``hpml-compile`` parser with every sub-command registered.

    Returns:
        The parser; each sub-command sets ``run`` (its handler) on the parsed namespace.
    """
    parser = argparse.ArgumentParser(
        prog="hpml-compile",
        description="Compile a PyTorch model for many devices: trace it, profile every node, plan the "
                    "placement, generate the pipelined program. Start with `hpml-compile demo`.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _ADDERS:
        add(sub)
    _add_examples(sub)
    return parser


def _version() -> str:
    """The installed package's version (its metadata), or a marker when it runs from a tree never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hpml-compile")
    except PackageNotFoundError:
        return "0+unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: the command's (0 on success), 2 for bad input (a one-line message on stderr,
        no traceback), 130 when interrupted.
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except HpmlError as e:
        print(f"hpml-compile {args.command}: error: {e}", file=sys.stderr)
        return 2
    except LookupError as e:  # cost_models' UnknownDeviceKind / UnknownLink carry a full message
        if type(e).__module__.startswith("cost_models"):
            print(f"hpml-compile {args.command}: error: {e.args[0] if e.args else e}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
