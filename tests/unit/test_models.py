"""Unit tests for the model zoo and MODEL-string resolution (hpml_compile.models)."""

from __future__ import annotations

import resource
import socket
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from hpml_compile.errors import ModelError
from hpml_compile.models import Family, LoadedModel, get, load, names
from hpml_compile.models.gpt import GPT, GPTConfig, MLPKind, Norm, PosEncoding

TINY = ["gpt-tiny", "mlp-tiny", "resnet-tiny"]
TINY_HF_GPT2 = "hf:gpt2?n_layer=2,n_embd=64,n_head=2"
TINY_HF_BERT = "hf:bert?num_hidden_layers=2,hidden_size=64,num_attention_heads=2,intermediate_size=128"


def _n_params(module: nn.Module) -> int:
    # parameters() yields a tied weight once, which is how parameter counts are quoted.
    return sum(p.numel() for p in module.parameters())


def _expected_shape(m: LoadedModel) -> tuple[int, ...]:
    spec = get(m.name)
    if spec.family is Family.GPT:
        return (m.batch_size, m.seq_len, m.module.config.vocab_size)
    return (m.batch_size, m.module.config.n_classes)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any attempt to open a connection, and tell huggingface_hub it is offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_names_cover_the_zoo() -> None:
    assert set(names()) == {
        "gpt-tiny", "gpt-mini", "gpt2-small", "gpt2-medium", "gpt2-xl", "llama-7b", "llama-70b",
        "mlp", "mlp-tiny", "resnet50", "resnet-tiny",
    }
    assert get("gpt") is get("gpt2-small")
    assert (get("gpt-tiny").default_batch_size, get("gpt-tiny").default_seq_len) == (4, 32)
    assert (get("gpt2-medium").default_batch_size, get("gpt2-medium").default_seq_len) == (8, 128)
    assert (get("llama-70b").default_batch_size, get("llama-70b").default_seq_len) == (1, 2048)


@pytest.mark.parametrize("name", names())
def test_meta_build_allocates_nothing_and_forward_has_right_shape(name: str) -> None:
    m = load(name, device="meta")
    tensors = [*m.module.parameters(), *m.module.buffers(), *m.example_inputs, m.example_targets]
    assert all(t.is_meta for t in tensors), [t.device for t in tensors if not t.is_meta]
    assert sum(t.untyped_storage().nbytes() for t in tensors if not t.is_meta) == 0
    out = m.module(*m.example_inputs)
    assert out.is_meta and tuple(out.shape) == _expected_shape(m)
    assert m.loss_fn(out, m.example_targets).shape == ()


def test_meta_build_of_70b_does_not_grow_memory() -> None:
    # 69B float32 weights are 276 GB; any real allocation would show in peak RSS (KiB on Linux).
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    m = load("llama-70b", device="meta")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert _n_params(m.module) > 60e9
    assert after - before < 512 * 1024


@pytest.mark.parametrize(
    ("name", "expected", "rel"),
    [
        ("gpt2-small", 124.44e6, 0.01),
        ("gpt2-medium", 354.8e6, 0.01),
        ("gpt2-xl", 1.558e9, 0.02),
        ("llama-7b", 6.738e9, 0.02),
        ("llama-70b", 68.98e9, 0.02),
        ("resnet50", 25.557e6, 0.01),
    ],
)
def test_parameter_counts(name: str, expected: float, rel: float) -> None:
    assert _n_params(load(name, device="meta").module) == pytest.approx(expected, rel=rel)


def test_tied_embeddings_are_shared_and_untied_are_not() -> None:
    gpt2 = load("gpt2-small", device="meta").module
    llama = load("llama-7b", device="meta").module
    assert gpt2.lm_head.weight is gpt2.wte.weight
    assert llama.lm_head.weight is not llama.wte.weight


def test_gqa_shapes_of_llama_70b() -> None:
    attn = load("llama-70b", device="meta").module.layers[0].attn
    assert attn.q_proj.weight.shape == (8192, 8192)
    assert attn.k_proj.weight.shape == (8 * 128, 8192)


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_run_forward_and_backward_on_cpu(name: str) -> None:
    m = load(name)
    loss = m.loss_fn(m.module(*m.example_inputs), m.example_targets)
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in m.module.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("name", names())
def test_every_zoo_model_traces_with_plain_fx(name: str) -> None:
    m = load(name, device="meta")
    gm = torch.fx.symbolic_trace(m.module)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    scope = {Family.GPT: "layers.1.attn.q_proj", Family.MLP: "layers.1.fc", Family.RESNET: "layer2.0.conv1"}
    assert scope[get(name).family] in targets
    assert tuple(gm(*m.example_inputs).shape) == _expected_shape(m)


@pytest.mark.parametrize("name", TINY)
def test_traced_tiny_model_matches_eager(name: str) -> None:
    m = load(name)
    m.module.eval()  # BatchNorm: use running stats, so no call changes state
    gm = torch.fx.symbolic_trace(m.module)
    torch.testing.assert_close(gm(*m.example_inputs), m.module(*m.example_inputs), rtol=0, atol=0)


def test_rope_gqa_variant_traces_and_matches_eager() -> None:
    config = GPTConfig(
        vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48, max_seq_len=16,
        norm=Norm.RMSNORM, mlp=MLPKind.SWIGLU, pos=PosEncoding.ROPE, bias=False, tie_embeddings=False,
    )
    torch.manual_seed(0)
    model = GPT(config)
    idx = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(torch.fx.symbolic_trace(model)(idx), model(idx), rtol=0, atol=0)
    # Causality: changing a later token must not change earlier logits.
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % 64
    torch.testing.assert_close(model(idx2)[:, :-1], model(idx)[:, :-1])
    assert not torch.equal(model(idx2)[:, -1], model(idx)[:, -1])


def test_seed_determinism_and_caller_rng_untouched() -> None:
    state = torch.get_rng_state()
    a, b, c = load("gpt-tiny", seed=3), load("gpt-tiny", seed=3), load("gpt-tiny", seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    sa, sb, sc = a.module.state_dict(), b.module.state_dict(), c.module.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a.example_inputs[0], b.example_inputs[0])
    assert torch.equal(a.example_targets, b.example_targets)
    assert not torch.equal(sa["wte.weight"], sc["wte.weight"])
    assert not torch.equal(a.example_inputs[0], c.example_inputs[0])


def test_batch_and_seq_overrides() -> None:
    m = load("gpt-tiny", batch_size=2, seq_len=8)
    assert m.example_inputs[0].shape == (2, 8) and m.module(*m.example_inputs).shape == (2, 8, 256)
    assert load("resnet-tiny", batch_size=3).example_inputs[0].shape == (3, 3, 32, 32)
    with pytest.raises(ModelError, match="seq_len must be an int in 1..32"):
        load("gpt-tiny", seq_len=33)
    with pytest.raises(ModelError, match="batch_size must be a positive int"):
        load("gpt-tiny", batch_size=0)


def test_unknown_name_lists_known_names_and_forms() -> None:
    with pytest.raises(ModelError) as err:
        load("gpt2_small")
    msg = str(err.value)
    assert "'gpt2_small'" in msg and "did you mean gpt2-small" in msg
    assert all(n in msg for n in names())
    assert "hf:<model_type>" in msg and "file.py:factory" in msg


@pytest.mark.usefixtures("no_network")
def test_hf_gpt2_small_config_offline() -> None:
    pytest.importorskip("transformers", reason="hf: models need the transformers test dependency")
    m = load(TINY_HF_GPT2, batch_size=2, seq_len=16)
    assert m.is_hf and type(m.module).__name__ == "GPT2LMHeadModel"
    assert m.module.config.n_layer == 2 and m.module.config.use_cache is False
    assert m.example_inputs[0].dtype == torch.int64 and m.example_inputs[0].shape == (2, 16)
    out = m.module(*m.example_inputs)
    assert out.logits.shape == (2, 16, 50257)
    m.loss_fn(out, m.example_targets).backward()
    again = load(TINY_HF_GPT2, batch_size=2, seq_len=16)
    assert torch.equal(m.module.lm_head.weight, again.module.lm_head.weight)


@pytest.mark.usefixtures("no_network")
def test_hf_bert_gets_masked_lm_head_and_meta_works() -> None:
    pytest.importorskip("transformers", reason="hf: models need the transformers test dependency")
    m = load(TINY_HF_BERT, batch_size=2, seq_len=8)
    assert type(m.module).__name__ == "BertForMaskedLM"
    assert m.module(*m.example_inputs).logits.shape == (2, 8, 30522)
    meta = load(TINY_HF_BERT, device="meta")
    assert all(p.is_meta for p in meta.module.parameters()) and meta.example_inputs[0].is_meta


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize(
    ("model", "needle"),
    [
        ("hf:gpt3", "did you mean"),
        ("hf:gpt2?n_layers=2", "has no key 'n_layers'; did you mean n_layer"),
        ("hf:gpt2?n_layer", "is not key=value"),
        ("hf:", "names no model type"),
        ("hf:gpt2?n_embd=65", "divisible"),
    ],
)
def test_hf_errors(model: str, needle: str) -> None:
    pytest.importorskip("transformers", reason="hf: models need the transformers test dependency")
    with pytest.raises(ModelError, match="expected|failed") as err:
        load(model)
    assert needle in str(err.value)


FACTORIES = '''
import torch
from torch import nn

def good(batch_size=3, device="cpu"):
    return nn.Linear(4, 2), (torch.randn(batch_size, 4, device=device),)

def not_a_pair():
    return nn.Linear(4, 2)

def bare_tensor():
    return nn.Linear(4, 2), torch.randn(3, 4)

def explicit_cpu():
    return nn.Linear(4, 2, device="cpu"), (torch.randn(3, 4),)

def needs_width(width):
    return nn.Linear(width, 2), (torch.randn(3, width),)
'''


@pytest.fixture
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "factories.py"
    path.write_text(textwrap.dedent(FACTORIES))
    return path


def test_file_factory_loads_and_honours_arguments(factory_file: Path) -> None:
    m = load(f"{factory_file}:good")
    assert isinstance(m.module, nn.Linear) and m.batch_size == 3 and not m.is_hf
    assert m.example_targets is None
    m.loss_fn(m.module(*m.example_inputs), m.example_targets).backward()
    meta = load(f"{factory_file}:good", batch_size=5, device="meta")
    assert meta.batch_size == 5 and meta.example_inputs[0].shape == (5, 4) and meta.module.weight.is_meta


@pytest.mark.parametrize(
    ("suffix", "needle"),
    [
        (":not_a_pair", "returned a Linear; expected a pair (module: nn.Module"),
        (":bare_tensor", "returned (a Linear, a Tensor); expected a pair"),
        (":missing", "defines no function 'missing' (functions there: good,"),
        (":needs_width", "requires 'width'"),
        ("", "does not name a factory function; expected path/to/file.py:factory"),
    ],
)
def test_file_factory_errors(factory_file: Path, suffix: str, needle: str) -> None:
    with pytest.raises(ModelError) as err:
        load(f"{factory_file}{suffix}")
    assert needle in str(err.value)


def test_file_factory_missing_file_and_meta_allocation(factory_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist; expected path/to/file.py:factory"):
        load(f"{tmp_path / 'nowhere.py'}:good")
    with pytest.raises(ModelError, match="device='meta' must allocate no weights, but weight, bias"):
        load(f"{factory_file}:explicit_cpu", device="meta")


def test_bad_configs_are_rejected() -> None:
    with pytest.raises(ModelError, match="divisible by n_head"):
        GPTConfig(
            vocab_size=8, n_layer=1, n_head=3, n_kv_head=3, d_model=8, d_ff=8, max_seq_len=4,
            norm=Norm.LAYERNORM, mlp=MLPKind.GELU, pos=PosEncoding.LEARNED, bias=True, tie_embeddings=True,
        )
    with pytest.raises(ModelError, match=r"GPTConfig.norm must be one of \['layernorm', 'rmsnorm'\]"):
        GPTConfig(
            vocab_size=8, n_layer=1, n_head=2, n_kv_head=2, d_model=8, d_ff=8, max_seq_len=4,
            norm="batchnorm", mlp="gelu", pos="learned", bias=True, tie_embeddings=True,
        )
    assert GPTConfig(
        vocab_size=8, n_layer=1, n_head=2, n_kv_head=1, d_model=8, d_ff=8, max_seq_len=4,
        norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, tie_embeddings=False,
    ).pos is PosEncoding.ROPE
