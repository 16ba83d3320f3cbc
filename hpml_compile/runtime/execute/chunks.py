"""A rank that holds several stages: an interleaved plan's chunks, each a generated stage of its own.

Under interleaved 1F1B (Narayanan et al., SC 2021; Megatron-LM's virtual
pipeline) a plan of ``S`` device groups and ``v`` chunks has ``S * v`` stages
in model order, and stage ``k`` runs on the ranks of stage ``k % S``
(:attr:`hpml_compile.plan.Plan.chunks`). Nothing about a stage changes: codegen
writes each chunk's ``stage_<k>.py`` as for any plan, the lowered list of a rank
holds the tokens of all its stages (``0F1``, ``2RECV1:1``, ``ALLREDUCE.shm(2)``),
and the executor runs each token on the stage it names. What this module adds:

- :func:`held_stages`: the stages of a rank, from its first;
- :func:`rank_module`: one module of every tensor the rank's stages bind,
  under the model's names, so that a checkpoint of a rank holds its stages'
  parameters alone and loads under any plan (the one-stage rank's module is
  its stage);
- :func:`interleave_refusal`: what the runtime does not run with several
  stages on a rank yet, said before any process group forms.

Neighbouring stages are always on different device groups (a plan has at
least two, :func:`hpml_compile.plan.check_chunks`), so every boundary is a
message between two ranks, the wrap from the last group to the first
included; point-to-point tags name the sending stage, so the messages of
different chunks between the same two ranks never meet
(:meth:`hpml_compile.runtime.sync.comm.DistComm._tag`).

Example:
    >>> import torch
    >>> from hpml_compile.codegen.stage import RegionModule
    >>> class First(RegionModule):
    ...     TARGETS = ("0",)
    >>> class Third(RegionModule):
    ...     TARGETS = ("2",)
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> held = rank_module([First(model), Third(model)])  # two stages of one rank, bound by name
    >>> sorted(held.state_dict()), held.get_parameter("2.weight") is model[2].weight
    (['0.bias', '0.weight', '2.bias', '2.weight'], True)
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from ...plan import Plan

__all__ = ["held_stages", "rank_module", "interleave_refusal"]


def held_stages(plan: Plan, first: int) -> list[int]:
    """The stages a rank holds, ``first`` being its first: ``first, first + S, ...`` (``S`` the device groups).

    Example:
        >>> from hpml_compile.cluster import load_cluster
        >>> from hpml_compile.plan import Schedule, Stage
        >>> st = tuple(Stage(k, (f"cpu{k % 2}",), (f"n{k}",)) for k in range(4))
        >>> held_stages(Plan("m", load_cluster("local-cpu-2"), Schedule.INTERLEAVED, 4, st, chunks=2), 1)
        [1, 3]
    """
    groups = len(plan.stages) // plan.chunks
    return list(range(first, len(plan.stages), groups))


def rank_module(stages: Iterable[nn.Module]) -> nn.Module:
    """One module holding every parameter and buffer that ``stages`` bind, at the names they bind them under.

    A stage binds the model's own objects by qualified name (:mod:`hpml_compile.codegen.stage`), so its state
    dict is keyed by the model's names; this module merges several of them (a tensor two stages share, a tied
    weight, once), keeping each buffer's persistence, for what reads a rank's state by name (checkpoints).

    Args:
        stages: the stage modules of one rank.

    Returns:
        A plain module whose ``state_dict()`` and ``named_parameters()`` are the stages' together.
    """
    holder = nn.Module()
    for stage in stages:
        for path, mod in stage.named_modules(remove_duplicate=False):
            here = holder
            for part in [p for p in path.split(".") if p]:
                if part not in here._modules:
                    here.add_module(part, nn.Module())
                nxt = here._modules[part]
                assert nxt is not None
                here = nxt
            for name, p in mod._parameters.items():
                if p is not None and name not in here._parameters:
                    here.register_parameter(name, p)
            for name, b in mod._buffers.items():
                if b is not None and name not in here._buffers:
                    here.register_buffer(name, b, persistent=name not in mod._non_persistent_buffers_set)
    return holder


def interleave_refusal(plan: Plan, *, live: bool = False, join: bool = False) -> str | None:
    """Why the runtime does not run ``plan`` (several stages on a rank) with these options; None where it does.

    Args:
        plan: the plan to run.
        live: the run answers a lost rank in place.
        join: this process joins a running job.

    Returns:
        One sentence naming what is not combined with interleaving and what to do instead, or None (also for a
        plan of one stage per rank).
    """
    if plan.chunks == 1:
        return None
    fix = "compile the plan with schedule 1f1b (one stage per rank), or run without it"
    if live or join:
        return (f"a rank {'joining' if join else 'lost'} in place is not combined with an interleaved plan "
                f"({plan.chunks} chunks per rank): restart from the last checkpoint instead (run without live/join)")
    for st in plan.stages:
        what = ("optimizer offload" if st.offload_optimizer else "activation swap" if st.swap else
                "gradient compression" if st.compress else None)
        if what is not None:
            return f"stage {st.index} uses {what}, which the runtime does not combine with {plan.chunks} chunks per " \
                   f"rank (schedule {plan.schedule.value}): {fix}"
    if plan.sync_every > 1:
        return f"local SGD (sync_every {plan.sync_every}) is not combined with {plan.chunks} chunks per rank: {fix}"
    return None
