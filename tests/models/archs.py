"""Tiny configurations of real transformers architectures and a batch for each (nothing is downloaded).

Each :class:`Arch` builds a random-initialised model with the class a user would (``AutoModelFor...``
equivalents) and a dict batch such as a tokenizer or feature extractor gives, ``labels`` included, so
the model computes its own loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers as tf

from hpml_compile import TrainSpec

B, T, V = 4, 12, 96  # rows, tokens, vocabulary
TEXT = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64)
NO_DROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@dataclass(frozen=True)
class Arch:
    """A model class, its tiny config and its batch."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], dict[str, torch.Tensor]]


def _tokens(g: torch.Generator, labels: str = "tokens", classes: int = 3) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, V, (B, T), generator=g)
    out = {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long)}
    out["labels"] = ids.clone() if labels == "tokens" else torch.randint(0, classes, (B,), generator=g)
    return out


def _images(g: torch.Generator, size: int = 16) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(B, 3, size, size, generator=g), "labels": torch.randint(0, 3, (B,), generator=g)}


def _seq2seq(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, V, (B, T), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long),
            "labels": torch.randint(3, V, (B, T // 2), generator=g)}


def _speech(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_features": torch.randn(B, 8, 32, generator=g), "labels": torch.randint(3, V, (B, 6), generator=g)}


def _audio(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_values": torch.randn(B, 400, generator=g), "labels": torch.randint(0, 3, (B,), generator=g)}


def _bert(cls: Any) -> Callable[[], torch.nn.Module]:
    return lambda: cls(tf.BertConfig(**TEXT, **NO_DROP, num_labels=3))


ARCHS = {a.name: a for a in [
    Arch("gpt2", lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                                          resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)),
         _tokens),
    Arch("llama", lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**TEXT, num_key_value_heads=1)), _tokens),
    Arch("mistral", lambda: tf.MistralForCausalLM(tf.MistralConfig(**TEXT, num_key_value_heads=1)), _tokens),
    Arch("qwen2", lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**TEXT, num_key_value_heads=1)), _tokens),
    Arch("phi3", lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**TEXT, num_key_value_heads=1, pad_token_id=0,
                                                          resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
         _tokens),
    Arch("gpt_neox", lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**TEXT, hidden_dropout=0.0, attention_dropout=0.0)),
         _tokens),
    Arch("opt", lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                                       num_attention_heads=2, max_position_embeddings=64,
                                                       word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                                                       layerdrop=0.0)),
         _tokens),
    Arch("bert_cls", _bert(tf.BertForSequenceClassification), lambda g: _tokens(g, "class")),
    Arch("bert_mlm", _bert(tf.BertForMaskedLM), _tokens),
    Arch("roberta", lambda: tf.RobertaForMaskedLM(tf.RobertaConfig(**{**TEXT, "max_position_embeddings": 80}, **NO_DROP,
                                                                   pad_token_id=1)),
         _tokens),
    Arch("distilbert", lambda: tf.DistilBertForSequenceClassification(tf.DistilBertConfig(
        vocab_size=V, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=3)),
         lambda g: _tokens(g, "class")),
    Arch("t5", lambda: tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                                                 num_heads=2, dropout_rate=0.0, decoder_start_token_id=0,
                                                                 pad_token_id=0)),
         _seq2seq),
    Arch("vit", lambda: tf.ViTForImageClassification(tf.ViTConfig(image_size=16, patch_size=4, hidden_size=32,
                                                                  num_hidden_layers=2, num_attention_heads=2,
                                                                  intermediate_size=64, num_labels=3, **NO_DROP)),
         _images),
    Arch("convnext", lambda: tf.ConvNextForImageClassification(tf.ConvNextConfig(
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3, image_size=16)),
         _images),
    Arch("wav2vec2", lambda: tf.Wav2Vec2ForSequenceClassification(tf.Wav2Vec2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, num_labels=3, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0, final_dropout=0.0, mask_time_prob=0.0,
        do_stable_layer_norm=True, feat_extract_norm="layer", apply_spec_augment=False)),
         _audio),
    Arch("swin", lambda: tf.SwinForImageClassification(tf.SwinConfig(
        image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)), _images),
    Arch("resnet", lambda: tf.ResNetForImageClassification(tf.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)), _images),
    Arch("whisper", lambda: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=V, num_mel_bins=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2,
        dropout=0.0)), _speech),
]}


def make(name: str, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model (seeded, in eval mode: no dropout) and its batch."""
    torch.manual_seed(seed)
    model = ARCHS[name].build().eval()
    return model, ARCHS[name].batch(torch.Generator().manual_seed(seed))


ITEMS = 32


class Items(torch.utils.data.Dataset):
    """``ITEMS`` dict items of an architecture's batches (what a tokenizer or feature extractor gives, per row)."""

    def __init__(self, name: str) -> None:
        batches = [ARCHS[name].batch(torch.Generator().manual_seed(100 + i)) for i in range(ITEMS // B)]
        self.rows = [{k: v[r] for k, v in b.items()} for b in batches for r in range(B)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def spec(name: str) -> TrainSpec:
    """The architecture as a user trains it: no wrapper, no loss_fn, a dict dataset, SGD."""
    model, _ = make(name)
    return TrainSpec(model, Items(name), batch_size=B, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05))


def __getattr__(name: str) -> TrainSpec:
    """``hpml-compile compile tests/models/archs.py:<arch>_spec`` (``gpt2_spec``, ``t5_spec``...): the arch's spec."""
    arch = name.removesuffix("_spec")
    if name.endswith("_spec") and arch in ARCHS:
        return spec(arch)
    raise AttributeError(name)
