"""Tiny Hugging Face models (no downloads): ``FAMILIES`` init weights with ``trunc_normal_``; ``"llama"``
(a decoder with rotary buffers computed in ``__init__``) is built on request."""

from __future__ import annotations

from torch import nn


def build(family: str) -> nn.Module:
    """A randomly initialized model of ``family`` ("vit", "modernbert", "dinov2" or "llama"), a few KB."""
    import transformers as tf

    if family == "llama":
        config = tf.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32,
        )  # fmt: skip
        return tf.LlamaForCausalLM(config)

    if family == "vit":
        config = tf.ViTConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            image_size=8, patch_size=4, num_channels=3,
        )  # fmt: skip
        return tf.ViTModel(config)
    if family == "modernbert":
        config = tf.ModernBertConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=32, global_attn_every_n_layers=2, local_attention=8, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        )  # fmt: skip
        return tf.ModernBertForMaskedLM(config)
    config = tf.Dinov2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=8, patch_size=4,
        num_channels=3,
    )  # fmt: skip
    return tf.Dinov2Model(config)


FAMILIES = ("vit", "modernbert", "dinov2")
