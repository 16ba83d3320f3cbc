"""The Python calls behind ``compile --inference``, ``generate``, ``infer`` and ``serve``.

An inference build is a folder holding ``plan.json`` (an
:class:`~hpml_compile.infer.plan.InferencePlan`, which names the model and
its seed): no weights and no code, so nothing in it runs when it is read.

Example:
    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp()) / "build"
    >>> plan = compile_inference("gpt-tiny", "local-cpu-1", out, batch=2, prompt_len=4, new_tokens=4)
    >>> generate(out, ["hi"], max_new_tokens=2).tokens[0].__len__()
    2
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from ..cluster import load_cluster
from ..errors import HpmlError, ModelError
from ..ir import Cluster
from ..models.gpt import PRESETS
from ..publish import publish_dir
from .batch import encode_item
from .cost import DecoderShape, Objective, Workload
from .engine import Generated, Generator
from .place import place
from .timing import time_block, timed_specs
from .plan import InferencePlan, is_inference_plan, load_inference_plan, save_inference_plan

__all__ = ["plan_for", "compile_inference", "open_build", "generate"]


def _shape(model: str, seed: int) -> DecoderShape:
    from .. import models
    from ..models.gpt import GPT

    if model in PRESETS:
        return DecoderShape.from_config(PRESETS[model])
    try:
        module = models.load(model, device="meta", seed=seed).module  # no weights allocated
    except ModelError:  # a file whose example data cannot be made on meta: build it for real
        module = models.load(model, seed=seed).module
    if isinstance(module, GPT):
        return DecoderShape.from_config(module.config)
    from .hf import hf_shape

    return hf_shape(module)  # a Hugging Face Llama, or an error naming what is supported


def plan_for(model: str, cluster: Cluster | str, *, batch: int = 8, prompt_len: int = 128, new_tokens: int = 128,
             dtype: str = "float32", objective: Objective | str = Objective.THROUGHPUT,
             latency_bound_ms: float | None = None, seed: int = 0, weights: str | Path | None = None,
             threads: int | None = None) -> InferencePlan:
    """An inference plan for a zoo decoder on a cluster (see :func:`hpml_compile.infer.place.place`).

    Args:
        model: a zoo decoder's name (``gpt-mini``, ``llama-7b``, ...).
        cluster: a cluster or its name / cluster.json path.
        batch: sequences in flight.
        prompt_len: prompt tokens per sequence the plan is priced for.
        new_tokens: tokens generated per sequence.
        dtype: the serving dtype (``float32``, ``bfloat16``, ``float16``).
        objective: ``throughput`` or ``latency``.
        latency_bound_ms: with ``throughput``, the most a decode step may take.
        seed: the weights' seed, recorded for the ranks.
        weights: a safetensors file of the model's state (``safetensors.torch.save_model``), which each rank
            reads its stage from instead of the seed's weights; recorded as an absolute path.
        threads: torch threads of each CPU rank, at which a block of a zoo preset is timed here to price the
            CPU stages (recorded; the generator runs at it). Default: this machine's cores over its CPUs.

    Returns:
        The plan.

    Raises:
        HpmlError: for a model that is not a decoder, bad sizes, or a model that fits nowhere.
    """
    shape = _shape(model, seed)
    if weights is not None and not Path(weights).is_file():
        raise HpmlError(f"inference plan: weights {weights}: no such file")
    if prompt_len + new_tokens > shape.max_seq_len:
        raise HpmlError(f"inference plan: prompt_len {prompt_len} + new_tokens {new_tokens} exceeds {model}'s "
                        f"context of {shape.max_seq_len}")
    cl = load_cluster(cluster) if isinstance(cluster, str) else cluster
    work = Workload(batch, prompt_len, new_tokens, 1, dtype)
    plan = place(shape, cl, work, objective=objective, latency_bound_ms=latency_bound_ms, model=model)
    cpus = sum(d.is_cpu for d in cl.devices)
    if cpus and model in PRESETS:  # price this host's CPU from a block of the model timed here, at the plan's rows
        timing = time_block(PRESETS[model], plan.workload, threads or max(1, (os.cpu_count() or 1) // cpus))
        plan = replace(place(shape, cl, work, objective=objective, latency_bound_ms=latency_bound_ms, model=model,
                             specs=timed_specs(shape, timing, dtype)), cpu_timing=timing)
    return plan.with_model(model, seed, str(Path(weights).resolve()) if weights is not None else None)


def _made_by(folder: Path) -> set[str] | None:
    from ..schema import read_json

    try:
        return {"plan.json"} if is_inference_plan(read_json(folder / "plan.json")) else None
    except Exception:  # noqa: BLE001 - anything unreadable is not our build
        return None


def compile_inference(model: str, cluster: Cluster | str, out_dir: str | Path, **kwargs: object) -> InferencePlan:
    """:func:`plan_for`, written as a build folder (``plan.json``), published whole.

    Raises:
        HpmlError: as :func:`plan_for`; OutputError if ``out_dir`` holds something else.
    """
    plan = plan_for(model, cluster, **kwargs)  # type: ignore[arg-type]
    publish_dir(out_dir, lambda d: save_inference_plan(plan, d / "plan.json"), made_by=_made_by,
                what="inference build")
    return plan


def open_build(build: str | Path, **kwargs: object) -> Generator:
    """A :class:`Generator` for an inference build (folder or plan.json); close it (or use ``with``)."""
    return Generator(load_inference_plan(build), **kwargs)  # type: ignore[arg-type]


def generate(build: str | Path, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> Generated:
    """Greedy generation from a build: prompts as text (byte-level tokens) or token id lists."""
    ids = [encode_item({"prompt": p} if isinstance(p, str) else {"tokens": list(p)}, i, where="prompt")
           for i, p in enumerate(prompts)]
    with open_build(build) as g:
        return g.generate(ids, max_new_tokens)
