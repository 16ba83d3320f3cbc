"""Models from outside the zoo: Hugging Face configs and user factory files.

Two MODEL string forms resolve here (``hpml_compile.models.load`` dispatches):

- ``hf:<model_type>[?key=value,...]``: a transformers model random-initialised
  from ``AutoConfig.for_model(model_type, **overrides)``. Nothing is
  downloaded. The head is a causal LM where the type has one, except for
  encoders that also have a masked-LM head (bert, roberta, ...), which get the
  masked LM they were made for; types with neither get the bare ``AutoModel``.
- ``path/to/file.py:factory``: ``factory(**kw)`` returns
  ``(module, example_inputs_tuple)``; ``kw`` holds those of ``batch_size``,
  ``seq_len`` and ``device`` that the factory's signature accepts.
- ``path/to/train.py:NAME``: NAME is an :class:`hpml_compile.TrainSpec` (or
  a function returning one, called like a factory): the model, the dataset
  and the loss; the example batch is the dataset's first batch, in order.

The functions here build under whatever ``torch.device`` context and RNG seed
the caller set; ``load`` sets both.

Example:
    >>> import os; os.environ["HF_HUB_OFFLINE"] = "1"
    >>> from hpml_compile.models import load
    >>> m = load("hf:gpt2?n_layer=2,n_embd=64,n_head=2", batch_size=2, seq_len=16)
    >>> m.module(*m.example_inputs).logits.shape
    torch.Size([2, 16, 50257])
"""

from __future__ import annotations

import difflib
import enum
import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hpml_compile.errors import ModelError
from hpml_compile.models import LoadedModel
from hpml_compile.trainspec import TrainSpec, batch_input_names, first_batch

__all__ = ["HFHead", "parse_hf", "load_hf", "is_file_spec", "load_file", "hf_loss", "surrogate_loss"]

HF_FORM = "hf:<model_type>[?key=value,...] (e.g. hf:gpt2?n_layer=2,n_embd=64,n_head=2)"
FILE_FORM = ("path/to/file.py:factory, where factory(batch_size=, seq_len=, device=) returns (module, "
             "example_inputs_tuple) or an hpml_compile.TrainSpec (or NAME is a TrainSpec itself)")
_HF_DEFAULT_BATCH = 2
_HF_DEFAULT_SEQ = 128


class HFHead(enum.Enum):
    """Which AutoModel class builds an ``hf:`` model."""

    CAUSAL_LM = "causal_lm"
    MASKED_LM = "masked_lm"
    BASE = "base"  # no LM head: the loss is a surrogate on the hidden states


def _parse_value(text: str) -> Any:
    # Config values are ints, floats, bools or strings; try them in that order.
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_hf(model: str) -> tuple[str, dict[str, Any]]:
    """Split ``hf:gpt2?n_layer=2,n_head=2`` into ``("gpt2", {"n_layer": 2, "n_head": 2})``.

    Args:
        model: the MODEL string, with its ``hf:`` prefix.

    Returns:
        The transformers model type and the config overrides (values parsed
        as bool, None, int, float or else kept as strings).

    Raises:
        ModelError: if the string is not of the form ``hf:<model_type>[?key=value,...]``.
    """
    body = model.removeprefix("hf:")
    model_type, _, query = body.partition("?")
    if not model_type:
        raise ModelError(f"{model!r} names no model type; expected {HF_FORM}")
    overrides: dict[str, Any] = {}
    for item in filter(None, query.split(",")):
        key, eq, value = item.partition("=")
        if not (eq and key.strip().isidentifier() and value.strip()):
            raise ModelError(f"{model!r}: {item!r} is not key=value; expected {HF_FORM}")
        overrides[key.strip()] = _parse_value(value.strip())
    return model_type, overrides


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ModelError("hf: models need transformers; install it with `pip install hpml-compile[hf]`") from e
    return transformers


def _hf_config(transformers: Any, model: str, model_type: str, overrides: dict[str, Any]) -> Any:
    mapping = transformers.CONFIG_MAPPING
    if model_type not in mapping:
        close = difflib.get_close_matches(model_type, list(mapping.keys()), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ModelError(
            f"{model!r}: {model_type!r} is not a transformers model type{hint}; expected {HF_FORM} "
            "with a key of transformers.CONFIG_MAPPING such as gpt2, bert, llama, mistral"
        )
    # for_model() accepts any keyword and stores it, so a typo would pass silently;
    # check each key against the defaults (hasattr also honours attribute_map aliases).
    defaults = mapping[model_type]()
    for key in overrides:
        if not hasattr(defaults, key):
            generic = set(transformers.PretrainedConfig().to_dict())
            known = sorted((set(defaults.to_dict()) - generic) | set(getattr(defaults, "attribute_map", {})))
            close = difflib.get_close_matches(key, known, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ModelError(
                f"{model!r}: {type(defaults).__name__} has no key {key!r}; {hint}"
                f"expected {HF_FORM} with keys such as: {', '.join(known)}"
            )
    try:
        config = transformers.AutoConfig.for_model(model_type, **overrides)
    except Exception as e:  # transformers raises ValueError/TypeError/AssertionError alike
        raise ModelError(f"{model!r}: transformers rejected the overrides {overrides}: {e}") from e
    if hasattr(config, "use_cache"):
        config.use_cache = False  # a KV cache only adds outputs that tracing and pipelining must carry
    if not isinstance(getattr(config, "vocab_size", None), int):
        raise ModelError(
            f"{model!r}: {model_type} has no vocab_size, so random token ids cannot be made; "
            "hf: supports text models, wrap others in a file.py:factory"
        )
    return config


def _hf_head(transformers: Any, config: Any) -> HFHead:
    causal = type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    masked = type(config) in transformers.MODEL_FOR_MASKED_LM_MAPPING
    # bert & co. are listed for causal LM too, as decoders; as configured (not
    # is_decoder) their natural head is the masked LM.
    if masked and not (causal and getattr(config, "is_decoder", False)):
        return HFHead.MASKED_LM
    if causal:
        return HFHead.CAUSAL_LM
    return HFHead.BASE


def load_hf(model: str, batch_size: int | None, seq_len: int | None, device: torch.device) -> LoadedModel:
    """Build a random-initialised transformers model from an ``hf:`` MODEL string.

    Args:
        model: ``hf:<model_type>[?key=value,...]``.
        batch_size: B of the example inputs (default 2).
        seq_len: T of the example inputs (default 128, capped at the model's
            maximum positions).
        device: where the example inputs go; weights go where the caller's
            ``torch.device`` context puts them.

    Returns:
        The model with inputs ``(input_ids,)`` int64 [B, T], random targets of
        the same shape, and ``hf_loss`` (a surrogate for ``HFHead.BASE``).

    Raises:
        ModelError: unknown model type or key, rejected values, too long a
            sequence, or transformers missing.
    """
    transformers = _import_transformers()
    model_type, overrides = parse_hf(model)
    config = _hf_config(transformers, model, model_type, overrides)
    head = _hf_head(transformers, config)
    auto = {
        HFHead.CAUSAL_LM: transformers.AutoModelForCausalLM,
        HFHead.MASKED_LM: transformers.AutoModelForMaskedLM,
        HFHead.BASE: transformers.AutoModel,
    }[head]
    try:
        module = auto.from_config(config)
    except Exception as e:  # e.g. a width not divisible by the head count
        raise ModelError(f"{model!r}: {auto.__name__}.from_config failed with overrides {overrides}: {e}") from e
    max_pos = getattr(config, "max_position_embeddings", None)
    batch = _HF_DEFAULT_BATCH if batch_size is None else batch_size
    seq = seq_len if seq_len is not None else min(_HF_DEFAULT_SEQ, max_pos or _HF_DEFAULT_SEQ)
    if isinstance(max_pos, int) and seq > max_pos:
        raise ModelError(f"{model!r}: seq_len={seq} exceeds max_position_embeddings={max_pos}; use seq_len <= {max_pos}")
    shape = (batch, seq)
    inputs = (torch.randint(0, config.vocab_size, shape, device=device),)
    targets = None if head is HFHead.BASE else torch.randint(0, config.vocab_size, shape, device=device)
    loss = surrogate_loss if head is HFHead.BASE else hf_loss
    return LoadedModel(model, module, inputs, targets, loss, batch, seq, is_hf=True)


def _first_tensor(output: Any) -> Tensor:
    # transformers returns ModelOutput (a dict subclass), or a tuple with
    # return_dict=False; fx/export pipelines may flatten either.
    if isinstance(output, Tensor):
        return output
    if hasattr(output, "logits") and isinstance(output.logits, Tensor):
        return output.logits
    values = list(output.values()) if isinstance(output, dict) else list(output)
    for value in values:
        if isinstance(value, Tensor):
            return value
    raise ModelError(f"model output {type(output).__name__} holds no tensor to compute a loss on")


def hf_loss(output: Any, targets: Tensor) -> Tensor:
    """Token-level cross-entropy of a transformers output's logits [B, T, V] against targets [B, T]."""
    logits = _first_tensor(output)
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def surrogate_loss(output: Any, targets: Tensor | None) -> Tensor:
    """Mean square of the first output tensor; ``targets`` is ignored.

    A stand-in for models that bring no loss of their own (file factories, bare
    ``AutoModel``s) so that a backward pass can still be run and profiled.
    """
    return _first_tensor(output).float().pow(2).mean()


def is_file_spec(model: str) -> bool:
    """Whether ``model`` is meant as the ``path/to/file.py:factory`` form (even a malformed one)."""
    return model.rpartition(":")[0].endswith(".py") or model.endswith(".py")


def _import_file(model: str, path: Path) -> Any:
    # The importlib "import a source file directly" recipe; registering the
    # module lets dataclasses and pickling inside the file resolve it by name.
    name = "_hpml_user_model_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelError(f"{model!r}: cannot import {path} as Python; expected {FILE_FORM}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ModelError(f"{model!r}: importing {path} raised {type(e).__name__}: {e}") from e
    return module


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def load_file(model: str, batch_size: int | None, seq_len: int | None, device: torch.device) -> LoadedModel:
    """Call a user factory named by ``path/to/file.py:factory``.

    Args:
        model: the MODEL string.
        batch_size: passed as ``batch_size=`` when given and accepted; else
            read back from the first input's leading dimension.
        seq_len: passed as ``seq_len=`` when given and accepted.
        device: passed as ``device=`` when accepted (the caller's device
            context applies either way).

    Returns:
        The factory's module and inputs, no targets, and ``surrogate_loss``.

    Raises:
        ModelError: missing file, no such function, an argument the factory
            needs that was not given, the factory raising, or a return value
            other than ``(nn.Module, tuple[Tensor, ...])``.
    """
    path_text, _, factory_name = model.rpartition(":")
    if not path_text.endswith(".py") or not factory_name.isidentifier():
        raise ModelError(f"{model!r} does not name a factory function; expected {FILE_FORM}")
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ModelError(f"{model!r}: file {path} does not exist; expected {FILE_FORM} (relative paths start at {Path.cwd()})")
    module = _import_file(model, path)
    factory = getattr(module, factory_name, None)
    if isinstance(factory, TrainSpec):  # NAME is a spec itself, not a function making one
        return _from_spec(model, factory, batch_size)
    if not callable(factory):
        found = [n for n, v in vars(module).items()
                 if (inspect.isfunction(v) and v.__module__ == module.__name__) or isinstance(v, TrainSpec)]
        raise ModelError(
            f"{model!r}: {path.name} defines no function {factory_name!r} (functions there: "
            f"{', '.join(found) or 'none'}); expected {FILE_FORM}"
        )
    offered = {"batch_size": batch_size, "seq_len": seq_len, "device": device}
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if v is not None and (takes_any or k in params)}
    for name, p in params.items():
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in kwargs:
            need = f"pass {name}=..." if name in offered else f"give {name} a default (only batch_size, seq_len, device are passed)"
            raise ModelError(f"{model!r}: {factory_name}() requires {name!r}; {need}")
    try:
        result = factory(**kwargs)
    except Exception as e:
        raise ModelError(f"{model!r}: {factory_name}(**{kwargs}) raised {type(e).__name__}: {e}") from e
    if isinstance(result, TrainSpec):
        return _from_spec(model, result, batch_size)
    ok = (
        isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)
        and isinstance(result[1], tuple) and len(result[1]) > 0 and all(isinstance(t, Tensor) for t in result[1])
    )
    if not ok:
        got = _describe(result)
        if isinstance(result, tuple) and len(result) == 2:
            got = f"({_describe(result[0])}, {_describe(result[1])})"
        raise ModelError(
            f"{model!r}: {factory_name}() returned {got}; expected a pair (module: nn.Module, "
            "example_inputs: a non-empty tuple of Tensors), e.g. `return net, (x,)`, or an hpml_compile.TrainSpec"
        )
    net, inputs = result
    batch = batch_size if batch_size is not None else (int(inputs[0].shape[0]) if inputs[0].dim() else 1)
    return LoadedModel(model, net, inputs, None, surrogate_loss, batch, seq_len, is_hf=False)


def _from_spec(model: str, spec: TrainSpec, batch_size: int | None) -> LoadedModel:
    """A TrainSpec as a loaded model: its first batch is the example batch, its loss the loss.

    Raises:
        ModelError: ``batch_size`` given and not the spec's, or a first batch of the wrong form.
    """
    if batch_size is not None and batch_size != spec.batch_size:
        raise ModelError(f"{model!r}: the TrainSpec's batch_size is {spec.batch_size}, but {batch_size} was "
                         "asked for (--batch-size); drop --batch-size, or accept batch_size= in the function "
                         "and pass it on to the TrainSpec")
    try:
        inputs, target = first_batch(spec)
        names = batch_input_names(spec)
    except ModelError as e:
        raise ModelError(f"{model!r}: {e}") from e
    assert spec.loss_fn is not None  # TrainSpec puts the model's own loss where none was given
    return LoadedModel(model, spec.module, inputs, target, spec.loss_fn, spec.batch_size, None, is_hf=False,
                       train=spec, input_names=names)
