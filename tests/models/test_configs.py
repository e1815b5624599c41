"""The built-in configurations the decode benchmarks run have the shapes their names promise."""

import pytest
import torch

from onepass.models.configs import CONFIGS, build

# name: (hidden, intermediate, layers, heads, kv heads, head dim, vocab, tied, rope_theta, parameters in billions)
SHAPES = {
    "llama-1b": (2048, 8192, 16, 32, 8, 64, 128256, True, 500000.0, 1.24),
    "llama-8b": (4096, 14336, 32, 32, 8, 128, 128256, False, 500000.0, 8.03),
    "qwen2-1.5b": (1536, 8960, 28, 12, 2, 128, 151936, True, 1000000.0, 1.54),
}


def _rope_theta(config) -> float:
    """rope_theta wherever this transformers keeps it (v5: in rope_parameters)."""
    theta = getattr(config, "rope_theta", None)
    return float(theta if theta is not None else config.rope_parameters["rope_theta"])


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_decode_benchmark_shapes(name):
    hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, tied, theta, billions = SHAPES[name]
    config = CONFIGS[name]()
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size, config.tie_word_embeddings) == (
        hidden, intermediate, layers, heads, kv_heads, vocab, tied)
    assert (getattr(config, "head_dim", None) or hidden // heads) == head_dim
    assert _rope_theta(config) == theta
    model = build(name)  # on meta: nothing allocated
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
    assert next(model.parameters()).dtype == torch.bfloat16
