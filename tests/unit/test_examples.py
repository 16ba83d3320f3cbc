"""The TrainSpec examples load, their doctests pass, and the stdlib LM's baseline is what the demo prints."""

from __future__ import annotations

import doctest
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from hpml_compile.cli.demo import EXAMPLE, options
from hpml_compile.models import load

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["stdlib_lm", "digits_cnn", "hf_causal_lm"])
def test_example_doctests_pass_and_the_spec_loads(name: str) -> None:
    result = doctest.testmod(_module(name))
    assert result.attempted > 0 and result.failed == 0
    loaded = load(f"{EXAMPLES / name}.py:spec")
    assert loaded.train is not None and loaded.train.val_dataset is not None
    assert loaded.example_inputs[0].shape[0] == loaded.batch_size
    if name == "hf_causal_lm":  # a dict dataset: the model's inputs by its forward's names, its own loss
        assert loaded.input_names == ("input_ids", "attention_mask", "labels")
        assert loaded.example_targets is None


def test_the_demo_trains_the_stdlib_example_and_its_baseline_is_the_byte_entropy() -> None:
    import argparse
    import math

    import torch

    assert options(argparse.Namespace())["spec"] == EXAMPLE == EXAMPLES / "stdlib_lm.py"
    lm = _module("stdlib_lm")
    train, val = lm.stdlib_bytes()
    assert len(train) > 1_000_000 and len(val) > 100_000
    counts = torch.bincount(train.long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    assert lm.byte_entropy() == pytest.approx(-(p * p.log()).sum().item()) and lm.byte_entropy() < math.log(256)
