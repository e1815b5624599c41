"""Tiny random configs of every family optimize() knows (hidden 32-64, 2 layers), fp32."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 256  # byte-level: the shipped corpus needs no tokenizer

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=128)
_GATED = dict(_COMMON, intermediate_size=64, num_key_value_heads=2)

CONFIGS = {
    "llama": lambda: tf.LlamaConfig(**_GATED),
    # a sliding window shorter than the test sequences, so the window matters
    "mistral": lambda: tf.MistralConfig(**_GATED, sliding_window=5),
    "qwen2": lambda: tf.Qwen2Config(**_GATED, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3": lambda: tf.Qwen3Config(**_GATED, head_dim=16),
    "gemma2": lambda: tf.Gemma2Config(**_GATED, head_dim=16, sliding_window=5, query_pre_attn_scalar=16,
                                      attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**_GATED, head_dim=16, sliding_window=5, query_pre_attn_scalar=16,
                                               final_logit_softcapping=3.0),
    "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0),
}


_MOE = dict(num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_GRANITE = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0)

# Families optimize recognises by their parts, tested for parity and their report only (test_families.py)
MORE_CONFIGS = {
    "mixtral": lambda: tf.MixtralConfig(**_GATED, **_MOE, num_local_experts=4, sliding_window=None),
    # layer 1 dense (mlp_only_layers), layer 0 sparse with a gated shared expert; a window size in the
    # config that its full-attention layers do not apply
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(**_GATED, **_MOE, num_experts=4, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                           sliding_window=5, use_sliding_window=False),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**_GATED, **_MOE, head_dim=16, num_experts=4, moe_intermediate_size=32),
    "olmoe": lambda: tf.OlmoeConfig(**_GATED, **_MOE, num_experts=4),
    "granitemoe": lambda: tf.GraniteMoeConfig(**_GATED, **_MOE, **_GRANITE, num_local_experts=4),
    "gemma": lambda: tf.GemmaConfig(**_GATED, head_dim=16, bos_token_id=0, eos_token_id=0, pad_token_id=0),
    "phi3": lambda: tf.Phi3Config(**_GATED, bos_token_id=0, eos_token_id=0, pad_token_id=0, resid_pdrop=0.0,
                                  embd_pdrop=0.0),
    "olmo2": lambda: tf.Olmo2Config(**_GATED, bos_token_id=0, eos_token_id=0, pad_token_id=0),
    "granite": lambda: tf.GraniteConfig(**_GATED, **_GRANITE),
    "starcoder2": lambda: tf.Starcoder2Config(**_GATED, residual_dropout=0.0, embedding_dropout=0.0),
    "cohere": lambda: tf.CohereConfig(**_GATED, logit_scale=0.5, use_qk_norm=True, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0),
}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """A causal LM of ``family`` with random weights (norm weights too, so they matter)."""
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config({**CONFIGS, **MORE_CONFIGS}[family]())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.float()
