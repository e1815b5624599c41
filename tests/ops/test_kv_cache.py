import pytest
import torch

from onepass import reference
from onepass.ops.kv_cache import append_to_cache
from onepass.testing import assert_close


@pytest.mark.parametrize("batch, heads, n_new, head_dim", [(2, 3, 1, 16), (1, 2, 3, 40), (3, 1, 2, 64)])
def test_append_matches_static_layer_update(batch, heads, n_new, head_dim, device):
    """As transformers' StaticLayer.update: k and v at positions [length, length + T), then
    length += T; k and v as the attention hands them ([B, T, H, D] projections transposed)."""
    cache_len, start = 9, 4
    k_cache = torch.randn(batch, heads, cache_len, head_dim, device=device)
    v_cache = torch.randn(batch, heads, cache_len, head_dim, device=device)
    k = torch.randn(batch, n_new, heads, head_dim, device=device).transpose(1, 2)
    v = torch.randn(batch, n_new, heads, head_dim, device=device).transpose(1, 2)
    length = torch.tensor(start, device=device)
    positions = torch.arange(n_new, device=device) + start
    want_k = k_cache.clone().index_copy_(2, positions, k)
    want_v = v_cache.clone().index_copy_(2, positions, v)
    append_to_cache(k_cache, v_cache, length, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert length.item() == start + n_new


def test_many_rows_loop(device):
    """More rows than one loop step holds (4096 values: 64 rows of 64)."""
    k_cache, v_cache = torch.zeros(2, 2, 200, 64, device=device), torch.zeros(2, 2, 200, 64, device=device)
    k, v = torch.randn(2, 2, 40, 64, device=device), torch.randn(2, 2, 40, 64, device=device)
    length = torch.tensor(150, device=device)
    append_to_cache(k_cache, v_cache, length, k, v)
    assert torch.equal(k_cache[:, :, 150:190], k) and torch.equal(v_cache[:, :, 150:190], v)
    assert k_cache[:, :, :150].abs().sum() == 0 and k_cache[:, :, 190:].abs().sum() == 0
    assert length.item() == 190


@pytest.mark.parametrize("batch, q_heads, heads, n_new, head_dim, table_batch", [
    (2, 6, 3, 1, 16, 2), (1, 4, 2, 3, 40, 1), (3, 2, 1, 2, 64, 3),
    (4, 24, 2, 1, 64, 1),  # q's 96 rows over two programs of 64
])
def test_append_with_rope_matches_rope_then_append(batch, q_heads, heads, n_new, head_dim, table_batch, device):
    """With the rotary tables, k is stored rotated and q comes back rotated, as HF's
    apply_rotary_pos_emb (the reference rope) followed by the plain append; k, q and v as the
    attention hands them ([B, T, H, D] projections transposed), tables per batch row or shared."""
    cache_len, start = 9, 4
    k_cache, v_cache = (torch.randn(batch, heads, cache_len, head_dim, device=device) for _ in range(2))
    q = torch.randn(batch, n_new, q_heads, head_dim, device=device).transpose(1, 2)
    k, v = (torch.randn(batch, n_new, heads, head_dim, device=device).transpose(1, 2) for _ in range(2))
    angles = torch.randn(table_batch, n_new, head_dim // 2, device=device).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    want_q, want_k = reference.rope(q, k, cos, sin)
    want_k_cache, want_v_cache, want_length = k_cache.clone(), v_cache.clone(), torch.tensor(start, device=device)
    append_to_cache(want_k_cache, want_v_cache, want_length, want_k, v)
    length = torch.tensor(start, device=device)
    q_out = append_to_cache(k_cache, v_cache, length, k, v, q, cos, sin)
    assert q_out.shape == q.shape
    assert_close(q_out, want_q, torch.float32, "q")
    assert_close(k_cache, want_k_cache, torch.float32, "k cache")
    assert torch.equal(v_cache, want_v_cache) and length.item() == want_length.item() == start + n_new
