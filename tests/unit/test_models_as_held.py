"""Models as their users hold them: keyword batches, the model's own loss, lifted constants, long names.

The export front end keeps the batch symbolic, so one graph serves every microbatch and replica; tensors
the graph lifts out of ``forward`` travel with the build as data; a dict dataset feeds the model by its
``forward``'s parameter names; a model that computes its own loss is trained on it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import hpml_compile
from hpml_compile import TrainSpec, driver, models
from hpml_compile.codegen import generate, load_build
from hpml_compile.codegen.constants import CONSTANTS_FILE
from hpml_compile.codegen.testing import max_grad_diff, split_plan
from hpml_compile.errors import BuildMismatchError, ModelError, TraceError
from hpml_compile.runtime import step_local
from hpml_compile.runtime.weights import load_stage_weights
from hpml_compile.trace import repeated_blocks, trace
from hpml_compile.trainspec import first_batch, model_loss


class Scaled(nn.Module):
    """A tensor made inside ``forward`` (export lifts it as a constant the model does not hold)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        scale = torch.tensor([0.5, 2.0, 1.0, 1.0, 0.25, 1.0, 3.0, 1.0])
        for b in self.blocks:
            x = torch.tanh(b(x) * scale)
        return {"logits": self.head(x), "hidden": x}


def _loss(out: dict[str, Tensor], y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(out["logits"], y)


def test_lifted_constants_travel_with_the_build(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x, y = Scaled(), torch.randn(6, 8), torch.randint(0, 3, (6,))
    gm = trace(model, (x,), front_end="export")
    assert gm.meta["hpml_constants"], "the scale should be lifted"
    generate(gm, split_plan(gm, "scaled", 2, microbatches=3), tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert CONSTANTS_FILE in manifest["files"]
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    build = load_build(tmp_path, ours)  # re-traced from the model; the constants come from the build's file
    got = step_local(build, (x,), y, _loss)
    want = _loss(ref(x), y)  # the loss receives the dict the model returns
    want.backward()
    assert abs(float(got.loss) - float(want)) < 1e-6
    assert max_grad_diff(ours, ref) < 1e-6
    (tmp_path / CONSTANTS_FILE).write_bytes((tmp_path / CONSTANTS_FILE).read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(BuildMismatchError, match="constants.safetensors was changed"):
        load_build(tmp_path, copy.deepcopy(model))


def test_uneven_replica_rows_share_one_graph(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x, y = Scaled(), torch.randn(8, 8), torch.randint(0, 3, (8,))
    gm = trace(model, (x,), front_end="export")
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    generate(gm, split_plan(gm, "scaled", 2, microbatches=2, rows=[(3, 1), (2, 2)]), tmp_path)
    got = step_local(load_build(tmp_path, ours, graph_module=gm), (x,), y, _loss)
    _loss(ref(x), y).backward()
    assert abs(float(got.loss) - float(_loss(ref(x), y))) < 1e-6
    assert max_grad_diff(ours, ref) < 1e-6


class LongNames(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        inner = nn.Module()
        inner.relative_position_bias_table_of_a_window_attention_block_in_a_hierarchical_vision_transformer = \
            nn.Parameter(torch.randn(4))
        self.encoder_layers_zero_blocks_zero_attention_relative_position_bias = inner
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        holder = self.encoder_layers_zero_blocks_zero_attention_relative_position_bias
        return self.fc(x) + holder.relative_position_bias_table_of_a_window_attention_block_in_a_hierarchical_vision_transformer


def test_a_long_parameter_name_never_breaks_a_stage_file(tmp_path: Path) -> None:
    model, x = LongNames(), torch.randn(4, 4)
    gm = trace(model, (x,))
    generate(gm, split_plan(gm, "long", 1, replicas=[2]), tmp_path)  # the replicas' sync lists every parameter
    source = (tmp_path / "stage_0.py").read_text()
    compile(source, "stage_0.py", "exec")  # a name wrapped inside its quotes would be a SyntaxError
    assert len(load_build(tmp_path, model).stages) == 1


class TokenDicts(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        ids = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long), "labels": ids.clone(),
                "length": torch.tensor(8)}  # not a forward parameter: not a model input


def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_dict_dataset_feeds_forward_by_name_and_trains_the_models_own_loss(tmp_path: Path) -> None:
    spec = TrainSpec(_tiny_llama(), TokenDicts(), batch_size=4)
    assert spec.loss_fn is model_loss
    inputs, target = first_batch(spec)
    assert target is None and len(inputs) == 3  # input_ids, attention_mask, labels; "length" left out
    gm = trace(spec.module, inputs, input_names=("input_ids", "attention_mask", "labels"))
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["input_ids", "attention_mask", "labels"]
    assert repeated_blocks(spec.module)[:2] == ["model.layers.0", "model.layers.1"]
    assert spec.module.config.use_cache is False
    ours, ref = copy.deepcopy(spec.module), copy.deepcopy(spec.module)
    generate(gm, split_plan(gm, "llama", 2, microbatches=2), tmp_path)
    got = step_local(load_build(tmp_path, ours), inputs, None, spec.loss_fn)  # re-traced by keyword
    want = ref(input_ids=inputs[0], attention_mask=inputs[1], labels=inputs[2]).loss
    want.backward()
    assert abs(float(got.loss) - float(want)) < 1e-5
    assert max_grad_diff(ours, ref) < 1e-5


def test_a_loss_fn_takes_the_labels_as_target() -> None:
    spec = TrainSpec(_tiny_llama(), TokenDicts(), lambda out, y: out.logits.float().mean(), batch_size=4)
    inputs, target = first_batch(spec)
    assert len(inputs) == 2 and isinstance(target, Tensor) and target.shape == (4, 8)


def test_own_loss_needs_labels_the_model_takes() -> None:
    class NoLabels(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, Tensor]:
            return {"input_ids": torch.zeros(8, dtype=torch.long)}

    with pytest.raises(ModelError, match="no 'labels'"):
        first_batch(TrainSpec(_tiny_llama(), NoLabels(), batch_size=4))
    with pytest.raises(ModelError, match="carries no .loss"):
        model_loss(torch.zeros(2), None)


def test_keyword_inputs_need_export() -> None:
    with pytest.raises(TraceError, match="keyword inputs need the export front end"):
        trace(nn.Linear(2, 2), (torch.zeros(2, 2),), input_names=("input",), front_end="fx")


def test_hf_model_string_compiles_at_its_default_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # batch 2 on 2 devices: one row per microbatch or replica, which a graph fixed at 2 rows could not run
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = models.load("hf:gpt2?n_layer=2,n_embd=32,n_head=2,vocab_size=64", seq_len=16)
    build, gm = driver.compile(loaded.module, loaded.example_inputs, tmp_path / "b", cluster="local-cpu-2",
                               opts=driver.Options(microbatches=2),
                               prof_opts=driver.ProfileOptions(repeats=1, warmup=0))
    assert gm.meta["hpml_dynamic_batch"] and build.plan.microbatches == 2
    got = step_local(load_build(tmp_path / "b", loaded.module, graph_module=gm), loaded.example_inputs,
                     loaded.example_targets, loaded.loss_fn)
    assert torch.isfinite(got.loss)


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:  # a branch on a tensor's value: no graph holds it
            return self.fc(x)
        return x


def test_an_untraceable_module_is_named_with_its_line_and_the_fix() -> None:
    net = nn.Sequential(Gate(), nn.Linear(4, 2))
    with pytest.raises(TraceError) as err:
        trace(net, (torch.randn(3, 4),), front_end="export")
    text = str(err.value)
    assert "module '0' (Gate)" in text and "if x.sum() > 0:" in text
    assert "--front-end fx --leaf Gate" in text


def test_weights_are_loaded_by_name_into_the_stages_tied_ones_included(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    torch.manual_seed(1)
    saved = transformers.GPT2LMHeadModel(cfg).eval()
    saved.save_pretrained(tmp_path / "w")  # the tied lm_head is saved once, as transformer.wte.weight
    torch.manual_seed(2)
    fresh = transformers.GPT2LMHeadModel(cfg).eval()
    spec = TrainSpec(fresh, TokenDicts(), batch_size=4, weights=tmp_path / "w")
    pipe = hpml_compile.compile(spec, cluster="local-cpu-2", microbatches=2, solver="uniform",
                                out_dir=tmp_path / "b", profile_repeats=1)
    assert len(pipe.plan.stages) == 2  # the head and the input embedding on different stages, one tensor
    inputs, _ = first_batch(spec)
    want = saved(input_ids=inputs[0], attention_mask=inputs[1], labels=inputs[2]).loss
    got = pipe.step(inputs, None, spec.loss_fn)
    assert abs(float(got) - float(want)) < 1e-5
    assert fresh.lm_head.weight is fresh.transformer.wte.weight


def test_weights_of_another_model_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"other.weight": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ModelError, match="not in"):
        load_stage_weights(nn.Linear(2, 2), [nn.Linear(2, 2)], tmp_path / "w.safetensors")


def test_an_exported_graph_profiles_in_place_ops_and_batchnorm_statistics() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn, self.table = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Embedding(8, 4)

        def forward(self, x: Tensor) -> Tensor:
            index = torch.arange(4).unsqueeze(0).repeat(x.shape[0], 1)
            index += 4  # in place: timed again and again, it would run past the table
            return self.bn(self.conv(x)).mean((2, 3)) + self.table(index).mean(1)

    net = Net().eval()  # eval: the running statistics are arguments of the exported batch_norm
    x = torch.randn(4, 3, 8, 8)
    gm = trace(net, (x,), front_end="export")
    prof = hpml_compile.profile(gm, (x,), repeats=3, warmup=2, progress=False)
    assert prof.nodes and all(n.cost["cpu"].fwd_ms >= 0 for n in prof.nodes if "cpu" in n.cost)
