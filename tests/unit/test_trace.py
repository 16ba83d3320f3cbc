"""trace: shapes equal the real ones, meta models allocate nothing, untraceable models are explained."""

from __future__ import annotations

import os

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from hpml_compile import models
from hpml_compile.errors import TraceError
from hpml_compile.ir import FrontEnd
from hpml_compile.trace import node_info, output_structure, trace


class _Real(fx.Interpreter):
    """Records each node's real output."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, object] = {}

    def run_node(self, n: fx.Node) -> object:
        out = super().run_node(n)
        self.values[n.name] = out
        return out


@pytest.mark.parametrize("name", ["gpt-tiny", "mlp-tiny", "resnet-tiny"])
def test_traced_shapes_equal_real_shapes(name: str) -> None:
    m = models.load(name)
    gm = trace(m.module, m.example_inputs)
    real = _Real(gm)
    with torch.no_grad():
        real.run(*m.example_inputs)
    checked = 0
    for node in gm.graph.nodes:
        value, info = real.values[node.name], node_info(node)
        if isinstance(value, torch.Tensor):
            assert info.shape == tuple(value.shape), node.format_node()
            assert info.dtype == str(value.dtype).removeprefix("torch.")
            assert info.output_bytes == value.numel() * value.element_size()
            checked += 1
    assert checked >= 8


def test_scopes_name_the_module_path() -> None:
    m = models.load("gpt-tiny")
    gm = trace(m.module, m.example_inputs)
    scopes = {node_info(n).scope for n in gm.graph.nodes}
    assert any(s.startswith("layers.0.") for s in scopes) and any(s.startswith("layers.1.") for s in scopes)


def test_meta_model_traces_without_weights() -> None:
    m = models.load("llama-7b", device="meta")
    gm = trace(m.module, m.example_inputs)
    assert all(p.is_meta for p in gm.parameters())
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert node_info(out).shape == (1, 2048, 32000)
    assert node_info(out).output_bytes == 1 * 2048 * 32000 * 4


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x)
        return -x


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.branchy = _Branchy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.branchy(self.pre(x))


def test_untraceable_model_names_module_line_and_leaf() -> None:
    with pytest.raises(TraceError) as err:
        trace(_Outer(), (torch.randn(2, 4),), front_end="fx")
    msg = str(err.value)
    assert "module 'branchy' (_Branchy)" in msg
    assert f"{os.path.basename(__file__)}:" in msg and "if x.sum() > 0" in msg
    assert "leaf_modules=[_Branchy]" in msg and "--leaf _Branchy" in msg


@pytest.mark.parametrize("leaf", [_Branchy, "_Branchy", "branchy"])
def test_leaf_module_makes_it_traceable(leaf: type | str) -> None:
    gm = trace(_Outer(), (torch.randn(2, 4),), leaf_modules=[leaf], front_end="fx")
    node = next(n for n in gm.graph.nodes if n.target == "branchy")
    assert node.op == "call_module" and node_info(node).shape == (2, 4)


def test_bad_leaf_entry_is_explained() -> None:
    with pytest.raises(TraceError, match="nn.Module classes or names"):
        trace(_Outer(), (torch.randn(2, 4),), leaf_modules=[42])  # type: ignore[list-item]


def test_export_front_end_can_be_forced() -> None:
    m = models.load("mlp-tiny")
    gm = trace(m.module, m.example_inputs, front_end="export")
    assert gm.meta["hpml_front_end"] is FrontEnd.EXPORT
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("aten" in t for t in targets)
    assert gm.meta["hpml_dynamic_batch"]  # one graph for every row count
    with torch.no_grad():
        torch.testing.assert_close(output_structure(gm, gm(*m.example_inputs)), m.module(*m.example_inputs))
        fewer = tuple(x[:3] for x in m.example_inputs)
        torch.testing.assert_close(output_structure(gm, gm(*fewer)), m.module(*fewer))


def test_hf_gpt2_falls_back_to_export(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = models.load("hf:gpt2?n_layer=2,n_embd=64,n_head=2", batch_size=2, seq_len=16)
    m.module.eval()
    gm = trace(m.module, m.example_inputs)
    assert gm.meta["hpml_front_end"] is FrontEnd.EXPORT
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with torch.no_grad():
        expected = m.module(*m.example_inputs).logits
    shapes = [node_info(n).shape for n in gm.graph.nodes]
    assert tuple(expected.shape) in shapes, "the logits' shape is in the traced graph"
    assert out is not None


def test_not_a_module_is_refused() -> None:
    with pytest.raises(TraceError, match="needs an nn.Module"):
        trace(lambda x: x, (torch.randn(1),))  # type: ignore[arg-type]


def test_wrong_example_input_shape_is_explained() -> None:
    with pytest.raises(TraceError, match="example inputs"):
        trace(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 5),))
