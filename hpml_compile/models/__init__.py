"""The built-in model zoo and the resolution of a MODEL string.

A MODEL string is one of:

- a zoo name (``names()``): ``gpt-tiny``, ``gpt2-small`` (alias ``gpt``),
  ``gpt2-medium``, ``gpt2-xl``, ``llama-7b``, ``llama-70b``, ``mlp``,
  ``mlp-tiny``, ``resnet50``, ``resnet-tiny``;
- ``hf:<model_type>[?key=value,...]``: a random-initialised transformers model
  (see ``external``);
- ``path/to/file.py:factory``: a user factory returning
  ``(module, example_inputs_tuple)`` (see ``external``).

``load`` builds any of them under ``torch.device(device)`` with a fixed seed:
on ``"meta"`` no weights are allocated (a 70B model loads on a laptop), and
on cpu the same seed gives the same weights and inputs. The caller's RNG
state is left as it was.

Example:
    >>> from hpml_compile.models import load
    >>> m = load("gpt-tiny")
    >>> logits = m.module(*m.example_inputs)
    >>> m.loss_fn(logits, m.example_targets).backward()
    >>> load("llama-70b", device="meta").module.layers[0].attn.k_proj.weight.shape
    torch.Size([1024, 8192])
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import functools
from dataclasses import dataclass
from itertools import chain
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from hpml_compile.errors import ModelError
from hpml_compile.trainspec import TrainSpec
from hpml_compile.models import gpt, mlp, resnet

__all__ = ["Family", "ModelSpec", "LoadedModel", "names", "get", "load"]


class Family(enum.Enum):
    """Which hand-written architecture a zoo entry is."""

    GPT = "gpt"
    MLP = "mlp"
    RESNET = "resnet"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A zoo entry: how to build the model, its example batch and its loss.

    Args:
        name: the zoo name.
        family: the architecture.
        description: one line for listings.
        default_batch_size: B used when ``load`` is given none.
        default_seq_len: T used when ``load`` is given none; None for models
            without a sequence axis.
        build: makes the module (weights go to the current ``torch.device``
            context and come from torch's global RNG).
        example_inputs: ``(batch_size, seq_len, device)`` -> positional inputs.
        example_targets: ``(batch_size, seq_len, device)`` -> targets for ``loss_fn``.
        loss_fn: ``(output, targets)`` -> scalar loss.
    """

    name: str
    family: Family
    description: str
    default_batch_size: int
    default_seq_len: int | None
    build: Callable[[], nn.Module]
    example_inputs: Callable[[int, int | None, torch.device | str], tuple[Tensor, ...]]
    example_targets: Callable[[int, int | None, torch.device | str], Tensor]
    loss_fn: Callable[[Any, Tensor], Tensor]


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: comparing tensors elementwise is meaningless here
class LoadedModel:
    """A built model with an example batch, ready to trace, profile or train.

    Args:
        name: the zoo name, or the MODEL string for ``hf:`` and file models.
        module: the model.
        example_inputs: positional inputs for ``module``.
        example_targets: targets for ``loss_fn``; None where the model has none.
        loss_fn: ``(module output, example_targets)`` -> scalar loss.
        batch_size: B of the example inputs.
        seq_len: T of the example inputs; None without a sequence axis.
        is_hf: whether ``module`` is a transformers model (plain fx cannot
            trace those; use torch.export).
        train: the user's training spec where the MODEL string named one
            (``file.py:NAME`` giving a :class:`~hpml_compile.trainspec.TrainSpec`):
            the example batch is its dataset's first batch.
        input_names: the names the inputs go to the model under, by keyword (a dict dataset); ``()``: positional.
    """

    name: str
    module: nn.Module
    example_inputs: tuple[Tensor, ...]
    example_targets: Tensor | None
    loss_fn: Callable[[Any, Tensor | None], Tensor]
    batch_size: int
    seq_len: int | None
    is_hf: bool
    train: TrainSpec | None = None
    input_names: tuple[str, ...] = ()


_DESCRIPTIONS: Mapping[str, str] = MappingProxyType({
    "gpt-tiny": "2-layer GPT, d_model 64, vocab 256 (fast tests)",
    "gpt-mini": "6-layer GPT, d_model 256, vocab 4096 (the demo)",
    "gpt2-small": "GPT-2 small, 124M parameters",
    "gpt2-medium": "GPT-2 medium, 355M parameters",
    "gpt2-xl": "GPT-2 XL, 1.56B parameters",
    "llama-7b": "Llama-2 7B shape: RMSNorm, SwiGLU, RoPE",
    "llama-70b": "Llama-2 70B shape: grouped-query attention with 8 KV heads",
    "mlp": "8 x (Linear 1024 + GELU) classifier, 512 inputs, 10 classes, cross-entropy",
    "mlp-tiny": "3 x (Linear 32 + GELU) classifier, 32 inputs, 10 classes, cross-entropy",
    "resnet50": "ResNet-50 (Bottleneck, BatchNorm), 224x224, 1000 classes, 25.6M parameters",
    "resnet-tiny": "narrow ResNet, one Bottleneck per stage, 32x32, 10 classes",
})
_ALIASES: Mapping[str, str] = MappingProxyType({"gpt": "gpt2-small"})
_FORMS = "hf:<model_type>[?key=value,...] (e.g. hf:gpt2?n_layer=2) or path/to/file.py:factory"


def _gpt_defaults(name: str) -> tuple[int, int]:
    if name == "gpt-tiny":
        return 4, 32
    if name == "gpt-mini":
        return 8, 128
    return (1, 2048) if name.startswith("llama") else (8, 128)


def _zoo() -> Mapping[str, ModelSpec]:
    specs: list[ModelSpec] = []
    for name, config in gpt.PRESETS.items():
        batch, seq = _gpt_defaults(name)
        specs.append(ModelSpec(
            name, Family.GPT, _DESCRIPTIONS[name], batch, seq, functools.partial(gpt.GPT, config),
            functools.partial(gpt.example_inputs, config), functools.partial(gpt.example_targets, config), gpt.loss,
        ))
    for name, mconfig in mlp.PRESETS.items():
        specs.append(ModelSpec(
            name, Family.MLP, _DESCRIPTIONS[name], 64 if name == "mlp" else 8, None,
            functools.partial(mlp.MLP, mconfig), functools.partial(mlp.example_inputs, mconfig),
            functools.partial(mlp.example_targets, mconfig), mlp.loss,
        ))
    for name, rconfig in resnet.PRESETS.items():
        specs.append(ModelSpec(
            name, Family.RESNET, _DESCRIPTIONS[name], 8 if name == "resnet50" else 4, None,
            functools.partial(resnet.ResNet, rconfig), functools.partial(resnet.example_inputs, rconfig),
            functools.partial(resnet.example_targets, rconfig), resnet.loss,
        ))
    return MappingProxyType({s.name: s for s in specs})


_ZOO = _zoo()  # read-only: built once from the frozen presets


def names() -> list[str]:
    """The zoo's model names (aliases such as ``gpt`` are accepted by ``get`` but not listed).

    Returns:
        Names in family order, smallest first within a family.
    """
    return list(_ZOO)


def get(name: str) -> ModelSpec:
    """Look up a zoo entry.

    Args:
        name: a zoo name or alias.

    Returns:
        Its spec.

    Raises:
        ModelError: if there is no such name (lists the known names and the
            ``hf:`` / ``file.py:factory`` forms).
    """
    spec = _ZOO.get(_ALIASES.get(name, name))
    if spec is None:
        close = difflib.get_close_matches(name, [*_ZOO, *_ALIASES], n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ModelError(f"unknown model {name!r}; {hint}expected one of {', '.join(_ZOO)}, or {_FORMS}")
    return spec


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    # fork_rng restores the caller's RNG on exit; seeding only the generator of
    # the device in use (not torch.manual_seed, which seeds every CUDA device)
    # keeps other devices' streams untouched.
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        yield


def _check_meta(model: str, loaded: LoadedModel) -> None:
    tensors = chain(loaded.module.named_parameters(), loaded.module.named_buffers(),
                    (("example_inputs", t) for t in loaded.example_inputs))
    real = [name for name, t in tensors if not t.is_meta]
    if real:
        raise ModelError(
            f"{model!r}: device='meta' must allocate no weights, but {', '.join(real[:5])} "
            f"{'are' if len(real) > 1 else 'is'} not on meta; create tensors without an explicit device "
            "(load() builds under `with torch.device('meta')`) or use the factory's device argument"
        )


def _load_zoo(spec: ModelSpec, batch_size: int | None, seq_len: int | None, device: torch.device) -> LoadedModel:
    batch = spec.default_batch_size if batch_size is None else batch_size
    seq = spec.default_seq_len if seq_len is None else seq_len
    module = spec.build()
    inputs = spec.example_inputs(batch, seq, device)
    targets = spec.example_targets(batch, seq, device)
    return LoadedModel(spec.name, module, inputs, targets, spec.loss_fn, batch, seq, is_hf=False)


def load(
    model: str,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """Build a model and an example batch from a MODEL string.

    Args:
        model: a zoo name, ``hf:<model_type>[?key=value,...]`` or
            ``path/to/file.py:factory``.
        batch_size: B; None takes the model's default.
        seq_len: T; None takes the model's default (ignored by models without
            a sequence axis).
        device: where weights and inputs go; ``"meta"`` allocates nothing.
        seed: seeds weights and example batch (bit-identical on cpu); the
            caller's RNG state is restored afterwards.

    Returns:
        The loaded model.

    Raises:
        ModelError: unknown name, bad ``hf:`` type or key, bad factory file or
            return value, bad batch/sequence size, or weights allocated off
            meta when ``device="meta"``.
    """
    from hpml_compile.models import external  # external imports LoadedModel from here

    for arg, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ModelError(f"{arg} must be a positive int or None (the model's default), got {value!r}")
    dev = torch.device(device)
    with _seeded(seed, dev), dev:
        if model.startswith("hf:"):
            loaded = external.load_hf(model, batch_size, seq_len, dev)
        elif external.is_file_spec(model):
            loaded = external.load_file(model, batch_size, seq_len, dev)
        else:
            loaded = _load_zoo(get(model), batch_size, seq_len, dev)
    if dev.type == "meta":
        _check_meta(model, loaded)
    return loaded
