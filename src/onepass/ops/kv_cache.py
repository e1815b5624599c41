"""A decode step's append to a static KV cache, in one launch, with RoPE on the way.

transformers' ``StaticLayer.update`` appends the new keys and values at its device-side
length in five kernels (an arange, an add for the positions, the length's increment, an
``index_copy_`` each for k and v), small launches whose cost is mostly launch overhead in a
decode step. Here one program reads the length, copies k and v [B, Hk, T, D] to positions
[length, length + T) of the caches [B, Hk, L, D] and stores length + T: a single program
because every copy must read the length before it grows. Sized for decode steps (a few
thousand values); positions past the cache are not written (the caller bounds the length,
as ``onepass.Decoder`` does).

Given the rotary tables, the same launch also applies RoPE (rotate-half, HF's
``apply_rotary_pos_emb`` on the whole head): that program to k before storing it, and more
programs of the grid, which need no length, to blocks of q's rows, into a new tensor (one
program for all of q made the decode step slower than rope apart; spread, faster: the A/B is in
CHANGELOG.md). The decode step's rope launch is thus folded into the append's. (Under attn_implementation
"onepass" a decode step's append runs in decode attention's own launch instead: ``decode_attention``'s
``k_new``; this launch serves other attention functions and that one's fallbacks.) Per row of x and each dim i < D, with
the partner x[(i + D/2) mod D] and the table entries at i:

    out[i] = x[i] * cos[i] - partner * sin[i]     (i < D/2)
    out[i] = x[i] * cos[i] + partner * sin[i]     (i >= D/2)
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from onepass.ops.dispatch import (
    cdiv,
    dependent_launch,
    empty_output,
    launch,
    launch_next_kernel,
    next_power_of_2,
    wait_for_previous_kernel,
)

BLOCK_VALUES = 4096  # values of k (and of v) copied a loop step


@triton.jit
def _rows(ptr, sb, sh, st, r, n_heads, n_new, d, mask):
    """The [rows, BLOCK_D] tile of rows r (batch, head, token) of a [B, H, T, D] tensor, and its
    (batch, head, token) indices."""
    t = r % n_new
    b = r // n_new // n_heads
    h = r // n_new % n_heads
    return tl.load(ptr + (b * sb + h * sh + t * st)[:, None] + d[None, :], mask=mask), b, h, t


@triton.jit
def _rotated(x, ptr, sb, sh, st, r, n_heads, n_new, d, head_dim, mask, cos_ptr, sin_ptr, cos_sb, cos_st,
             BLOCK_D: tl.constexpr):
    """x (rows r of ptr's tensor) rotated by the tables' rows at its (batch, token), in x's dtype."""
    partner, b, _, t = _rows(ptr, sb, sh, st, r, n_heads, n_new, (d + head_dim // 2) % head_dim, mask)
    at = (b * cos_sb + t * cos_st)[:, None] + d[None, :]
    c = tl.load(cos_ptr + at, mask=mask).to(tl.float32)
    s = tl.load(sin_ptr + at, mask=mask).to(tl.float32)
    sign = tl.where(d < head_dim // 2, -1.0, 1.0)[None, :]
    return (x.to(tl.float32) * c + sign * partner.to(tl.float32) * s).to(x.dtype)


@triton.jit
def _append_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, length_ptr, q_ptr, q_out_ptr, cos_ptr, sin_ptr,
    n_rows, n_heads, n_new, head_dim, cache_len, n_q_rows, n_q_heads,
    k_sb, k_sh, k_st, v_sb, v_sh, v_st, kc_sb, kc_sh, kc_st, vc_sb, vc_sh, vc_st,
    q_sb, q_sh, q_st, qo_sb, qo_sh, qo_st, cos_sb, cos_st,
    ROPE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    launch_next_kernel(PDL)
    d = tl.arange(0, BLOCK_D)
    d_ok = (d < head_dim)[None, :]
    pid = tl.program_id(0)
    if pid > 0:  # a block of q's rows (ROPE only)
        r = ((pid - 1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        mask = (r < n_q_rows)[:, None] & d_ok
        q, b, h, t = _rows(q_ptr, q_sb, q_sh, q_st, r, n_q_heads, n_new, d, mask)
        q = _rotated(q, q_ptr, q_sb, q_sh, q_st, r, n_q_heads, n_new, d, head_dim, mask, cos_ptr, sin_ptr, cos_sb,
                     cos_st, BLOCK_D)
        tl.store(q_out_ptr + (b * qo_sb + h * qo_sh + t * qo_st)[:, None] + d[None, :], q, mask=mask)
        return
    start = tl.load(length_ptr)
    for first in range(0, n_rows, BLOCK_ROWS):
        r = (first + tl.arange(0, BLOCK_ROWS)).to(tl.int64)  # rows of k: (batch, head, new token)
        pos = start + r % n_new
        mask = ((r < n_rows) & (pos < cache_len))[:, None] & d_ok
        k, b, h, _ = _rows(k_ptr, k_sb, k_sh, k_st, r, n_heads, n_new, d, mask)
        if ROPE:
            k = _rotated(k, k_ptr, k_sb, k_sh, k_st, r, n_heads, n_new, d, head_dim, mask, cos_ptr, sin_ptr, cos_sb,
                         cos_st, BLOCK_D)
        v, _, _, _ = _rows(v_ptr, v_sb, v_sh, v_st, r, n_heads, n_new, d, mask)
        tl.store(k_cache_ptr + (b * kc_sb + h * kc_sh + pos * kc_st)[:, None] + d[None, :], k, mask=mask)
        tl.store(v_cache_ptr + (b * vc_sb + h * vc_sh + pos * vc_st)[:, None] + d[None, :], v, mask=mask)
    tl.store(length_ptr, start + n_new)


def append_to_cache(k_cache: Tensor, v_cache: Tensor, length: Tensor, k: Tensor, v: Tensor, q: Tensor | None = None,
                    cos: Tensor | None = None, sin: Tensor | None = None) -> Tensor | None:
    """``k_cache[:, :, length:length + T] = k`` (and v), then ``length += T``, in one launch.

    k_cache, v_cache [B, Hk, L, D]; k, v [B, Hk, T, D] of the caches' dtype (any strides with
    a unit last one); ``length``: a one-element int64 device tensor (transformers'
    ``cumulative_length``). With ``q`` [B, Hq, T, D] and the rotary tables ``cos``, ``sin``
    [B or 1, T, D] (HF's, unit last stride): k is stored rotated and the rotated q is returned
    (a new [B, Hq, T, D] tensor); else ``q`` as given. The caller checks shapes and dtypes (onepass's
    attention does).
    """
    batch, heads, n_new, head_dim = k.shape
    block_d = next_power_of_2(head_dim)
    rope = cos is not None
    q_out = empty_output(q) if rope else None
    qs = (q, q_out, cos, sin) if rope else (k, k, k, k)
    cos_strides = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1)) if rope else (0, 0)
    block_rows = max(1, BLOCK_VALUES // block_d)
    n_q_rows = q.shape[0] * q.shape[1] * n_new if rope else 0
    launch(_append_kv_kernel, (1 + cdiv(n_q_rows, block_rows),),
           k, v, k_cache, v_cache, length, *qs, batch * heads * n_new, heads, n_new, head_dim, k_cache.shape[2],
           n_q_rows, q.shape[1] if rope else 1,
           *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
           *(q.stride()[:3] if rope else (0, 0, 0)), *(q_out.stride()[:3] if rope else (0, 0, 0)), *cos_strides,
           ROPE=rope, BLOCK_ROWS=block_rows, BLOCK_D=block_d, PDL=dependent_launch(k), num_warps=4)
    return q_out if rope else q
