"""onepass_attention in a decode step that cannot run decode attention's launch (attention weights
asked for; attention dropout takes the same branch): the fallback sees each row's valid keys only
(a static cache's slots past a row's length are empty, not keys), and a handed append runs first."""

from types import SimpleNamespace

import pytest
import torch

from onepass.models.attention import onepass_attention
from onepass.testing import assert_close

pytest.importorskip("transformers")


def _decode_step(device):
    batch, heads, kv_heads, cache_len, head_dim = 2, 4, 2, 24, 16
    q = torch.randn(batch, heads, 1, head_dim, device=device)
    k, v = (torch.randn(batch, kv_heads, cache_len, head_dim, device=device) for _ in range(2))
    k[1, :, 9:], v[1, :, 9:] = 30.0, 30.0  # row 1's empty slots: seen, they would take all the weight
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False, is_causal=True, head_dim=16)
    return module, q, k, v, torch.tensor([24, 9], dtype=torch.int32, device=device)


@pytest.mark.parametrize("window, softcap", [(None, None), (5, 2.0)])
def test_weights_path_sees_the_valid_keys_only(window, softcap, device):
    module, q, k, v, lengths = _decode_step(device)
    kw = dict(scaling=0.25, sliding_window=window, softcap=softcap, cache_seqlens=lengths)
    fused, _ = onepass_attention(module, q, k, v, None, **kw)
    out, weights = onepass_attention(module, q, k, v, None, output_attentions=True, **kw)
    assert_close(out, fused, torch.float32)
    assert weights[1, :, :, 9:].abs().max() == 0  # no weight on an empty slot


def test_a_handed_append_runs_before_the_fallback(device):
    """decode_append (new k and v, rotary tables, the layer's count) with weights asked for: the append in
    its own launch, then the fallback; the same output, caches and count as decode attention's launch. (The
    append in its own launch stores at the count, decode attention's at each row's length - 1: in a decode
    step of a static cache they agree, every row 9 long after 8 cached.)"""
    module, q, k, v, lengths = _decode_step(device)
    lengths[0] = 9
    k_new, v_new = torch.randn(2, 2, 1, 16, device=device), torch.randn(2, 2, 1, 16, device=device)
    angles = torch.randn(2, 1, 16, device=device)
    runs = []
    for weights in (False, True):
        caches, count = (k.clone(), v.clone()), torch.full((1,), 8, dtype=torch.int64, device=device)
        append = (k_new, v_new, angles.cos(), angles.sin(), count)
        out, _ = onepass_attention(module, q, *caches, None, scaling=0.25, cache_seqlens=lengths,
                                   decode_append=append, output_attentions=weights)
        runs.append((out, *caches, count.item()))
    (fused, k_fused, v_fused, count_fused), (out, k_out, v_out, count_out) = runs
    assert_close(out, fused, torch.float32)
    assert_close(k_out, k_fused, torch.float32, "k_cache")
    assert torch.equal(v_out, v_fused) and count_out == count_fused == 9
    assert torch.equal(v_out[1, :, 8], v_new[1, :, 0])  # row 1's token at its length - 1
