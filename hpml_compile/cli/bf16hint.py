"""The bf16 hint: on a cluster whose every device is a GPU with bf16 units, what bf16 would predict.

Profiles and plans default to fp32, which on such GPUs prices matmuls at a fraction of the hardware
(an H100's dense bf16 rate is 15x its fp32 one). Where the user did not choose a precision, ``compile``
and ``plan`` say so in one line: the bf16 plan's predicted step beside the fp32 one, and how to ask for it
(``--precision bf16``). Nothing changes by itself: fp32 stays the default (and on CPUs, whose bf16 is
emulated and slower, nothing is said).

The bf16 figure comes from a profile of the same model predicted for the cluster's GPU kinds under bf16
(:func:`hpml_compile.profile.profile` with only those kinds: the roofline of the catalog, nothing timed,
about a second for gpt-mini), planned with the same options. ``plan`` reads only profile.json, so it can
price bf16 only where the profile names a model of the zoo (:mod:`hpml_compile.models`) at its batch;
otherwise its line says how to get the figure.

Example:
    >>> from hpml_compile.cluster import load_cluster
    >>> bf16_gpus(load_cluster("dgx-h100-8")), bf16_gpus(load_cluster("local-cpu-2"))
    (['H100-80GB'], [])
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

from cost_models.catalog import DeviceCategory, get_device

from ..ir import Cluster, Precision, Profile

__all__ = ["bf16_gpus", "hint_line", "bf16_profile_of"]


def bf16_gpus(cluster: Cluster) -> list[str]:
    """The cluster's device kinds when every one is a GPU with a bf16 rate in the catalog, else ``[]``."""
    kinds = sorted({d.kind for d in cluster.devices})
    try:
        specs = [get_device(k) for k in kinds]
    except Exception:  # noqa: BLE001 -- a kind the catalog does not know: say nothing
        return []
    if not specs or any(s.category is not DeviceCategory.GPU or "bfloat16" not in s.peak_flops for s in specs):
        return []
    return kinds


def bf16_profile_of(model: Any, example_inputs: Sequence[Any], cluster: Cluster, *, name: str | None = None,
                    batch_size: int | None = None, seq_len: int | None = None) -> Profile:
    """A bf16 profile of ``model`` (a module, or its traced graph) predicted for the cluster's GPU kinds."""
    from ..profile import profile

    return profile(model, tuple(example_inputs), name=name, device_kinds=tuple(bf16_gpus(cluster)),
                   batch_size=batch_size, seq_len=seq_len, repeats=1, warmup=0, progress=False,
                   precision=Precision.BF16)


def hint_line(fp32_step_ms: float, cluster: Cluster, bf16_step: Callable[[], float] | None) -> str:
    """The one line: the bf16 plan's predicted step beside the fp32 one (where ``bf16_step`` can price it).

    Args:
        fp32_step_ms: the fp32 plan's predicted step.
        cluster: the cluster (its GPU kinds are named).
        bf16_step: plans the model in bf16 and returns its predicted step; None where it cannot be priced.
    """
    kinds = ", ".join(bf16_gpus(cluster))
    if bf16_step is None:
        return (f"bf16: every device of {cluster.name} ({kinds}) has bf16 units and this plan trains in fp32 "
                f"({fp32_step_ms:.4g} ms a step predicted); profile and plan with --precision bf16 to price it "
                "in bf16 (mixed precision, fp32 master weights)")
    try:
        bf = bf16_step()
    except Exception as e:  # noqa: BLE001 -- a hint never fails the command: say why there is no figure
        return (f"bf16: every device of {cluster.name} ({kinds}) has bf16 units, but the bf16 plan could not be "
                f"priced ({str(e).splitlines()[0][:160]}); try --precision bf16")
    return (f"bf16: every device of {cluster.name} ({kinds}) has bf16 units: the bf16 plan's step is predicted "
            f"{bf:.4g} ms against {fp32_step_ms:.4g} ms in fp32 ({bf / fp32_step_ms:.0%} of it); ask for it "
            "with --precision bf16 (mixed precision, fp32 master weights)")


def zoo_profile(prof: Profile, cluster: Cluster) -> Profile | None:
    """The bf16 profile of the zoo model ``prof`` names, at its batch (None: not a zoo model, or another batch)."""
    from .. import models

    try:
        loaded = models.load(prof.model, batch_size=prof.batch_size, seq_len=prof.seq_len, device="meta")
    except Exception:  # noqa: BLE001 -- not a zoo name, or not at this batch: no figure
        return None
    out = bf16_profile_of(loaded.module, loaded.example_inputs, cluster, name=prof.model,
                          batch_size=prof.batch_size, seq_len=prof.seq_len)
    return out if len(out.nodes) == len(prof.nodes) else None


def plan_hint(prof: Profile, cluster: Cluster, fp32_step_ms: float, opts: Any, *,
              bf16_prof: Callable[[], Profile | None] | None = None) -> str | None:
    """``plan``/``compile``'s line where it applies (every device a GPU with bf16 units, fp32 not chosen), else None.

    Args:
        prof: the fp32 profile planned from.
        cluster: the cluster.
        fp32_step_ms: the fp32 plan's predicted step.
        opts: the :class:`~hpml_compile.driver.Options` used (their precision must be unset).
        bf16_prof: makes the bf16 profile (default: the zoo model ``prof`` names, where it is one).
    """
    from .. import driver

    if opts.precision is not None or prof.precision is not Precision.FP32 or not bf16_gpus(cluster):
        return None
    made = (bf16_prof or (lambda: zoo_profile(prof, cluster)))()
    if made is None:
        return hint_line(fp32_step_ms, cluster, None)
    bf_opts = replace(opts, precision=Precision.BF16)
    return hint_line(fp32_step_ms, cluster, lambda: driver.plan(made, cluster, bf_opts).predicted.step_ms)
