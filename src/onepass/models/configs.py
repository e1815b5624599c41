"""Built-in model configurations: Hugging Face models with random weights, nothing downloaded.

``CONFIGS`` maps a name to a function returning a transformers config; ``build`` turns a
name into the model, on the ``meta`` device (no memory: the analyzer's default, a
billion-parameter model costs nothing) or on the CPU/GPU with randomly initialised weights.

    llama-1b        Llama-3.2-1B-shaped: hidden 2048, 16 layers, 32 query / 8 key-value
                    heads, intermediate 8192, vocab 128256, tied embeddings, rope_theta 5e5
    llama-3b        Llama-3.2-3B-shaped: hidden 3072, 28 layers, 24 / 8 heads of 128,
                    intermediate 8192, vocab 128256, tied embeddings
    llama-8b        Llama-3.1-8B-shaped: hidden 4096, 32 layers, 32 / 8 heads of 128,
                    intermediate 14336, vocab 128256, untied LM head
    qwen2-1.5b      Qwen2-1.5B-shaped: hidden 1536, 28 layers, 12 / 2 heads of 128, intermediate
                    8960, vocab 151936, tied embeddings
    gemma2-2b       Gemma-2-2B-shaped: hidden 2304, 26 layers, 8 / 4 heads of 256, intermediate
                    9216, vocab 256000, sliding window 4096 on every other layer, logit softcaps
    gpt2            GPT-2 small: 768 hidden, 12 layers, 12 heads, vocab 50257
    qwen3-moe-8l    Qwen3-30B-A3B-shaped, 8 of its 48 layers: hidden 2048, 32 / 4 heads of 128,
                    128 experts of intermediate 768, top-8, vocab 151936, untied LM head
    llama-tiny      the Llama layout at toy size (tests, quick CPU runs)
    llama-tiny-untied  the same with its own LM head (llama-8b's layout)
    gpt2-tiny       the GPT-2 layout at toy size
"""

from __future__ import annotations

from typing import Callable

import torch


def _llama(**overrides):
    from transformers import LlamaConfig

    settings = dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
        max_position_embeddings=131072, rms_norm_eps=1e-5, head_dim=64,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def _gpt2(**overrides):
    from transformers import GPT2Config

    settings = dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)
    settings.update(overrides)
    return GPT2Config(**settings)


def _qwen2(**overrides):
    from transformers import Qwen2Config

    settings = dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
        vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    )
    settings.update(overrides)
    return Qwen2Config(**settings)


def _gemma2(**overrides):
    from transformers import Gemma2Config

    settings = dict(
        hidden_size=2304, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        intermediate_size=9216, vocab_size=256000, sliding_window=4096, query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192,
        attn_implementation="eager",  # SDPA has no softcap: transformers refuses it for Gemma 2
    )
    settings.update(overrides)
    return Gemma2Config(**settings)


def _qwen3_moe(**overrides):
    from transformers import Qwen3MoeConfig

    settings = dict(
        hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False, rope_theta=1000000.0,
        max_position_embeddings=40960, rms_norm_eps=1e-6,
    )
    settings.update(overrides)
    return Qwen3MoeConfig(**settings)


_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=256, head_dim=16, max_position_embeddings=256)

CONFIGS: dict[str, Callable[[], object]] = {
    "llama-1b": _llama,
    "llama-3b": lambda: _llama(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128),
    "llama-8b": lambda: _llama(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, head_dim=128,
                               intermediate_size=14336, tie_word_embeddings=False),
    "qwen2-1.5b": _qwen2,
    "gemma2-2b": _gemma2,
    "gpt2": _gpt2,
    "qwen3-moe-8l": _qwen3_moe,
    "llama-tiny": lambda: _llama(**_TINY),
    "llama-tiny-untied": lambda: _llama(**_TINY, tie_word_embeddings=False),
    "gpt2-tiny": lambda: _gpt2(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=256,
                               bos_token_id=255, eos_token_id=255),
}


def build(name: str, device: str | torch.device = "meta", dtype: torch.dtype = torch.bfloat16):
    """The Hugging Face causal-LM model for ``name`` (a key of ``CONFIGS``), in eval mode.

    On ``meta`` nothing is allocated; elsewhere the weights are random (seeded by the caller).
    """
    if name not in CONFIGS:
        raise ValueError(f"model: unknown name {name!r}; expected one of {sorted(CONFIGS)}")
    from transformers import AutoModelForCausalLM

    config = CONFIGS[name]()
    config._attn_implementation = config._attn_implementation or "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
