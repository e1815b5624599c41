"""A decode step's append to a static KV cache, in one launch.

transformers' ``StaticLayer.update`` appends the new keys and values at its device-side
length in five kernels (an arange, an add for the positions, the length's increment, an
``index_copy_`` each for k and v: ~7.8 us a layer in the H200 profile of a Llama-3.2-1B decode
step). Here one program reads the length, copies k and v [B, Hk, T, D] to positions
[length, length + T) of the caches [B, Hk, L, D] and stores length + T: a single program
because every copy must read the length before it grows. Sized for decode steps (a few
thousand values); positions past the cache are not written (the caller bounds the length,
as ``onepass.Decoder`` does).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from onepass.ops._launch import launch, next_power_of_2

BLOCK_VALUES = 4096  # values of k (and of v) copied a loop step


@triton.jit
def _append_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, length_ptr,
    n_rows, n_heads, n_new, head_dim, cache_len,
    k_sb, k_sh, k_st, v_sb, v_sh, v_st, kc_sb, kc_sh, kc_st, vc_sb, vc_sh, vc_st,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    start = tl.load(length_ptr)
    d = tl.arange(0, BLOCK_D)
    for first in range(0, n_rows, BLOCK_ROWS):
        r = (first + tl.arange(0, BLOCK_ROWS)).to(tl.int64)  # rows of k: (batch, head, new token)
        t = r % n_new
        b = r // n_new // n_heads
        h = r // n_new % n_heads
        pos = start + t
        mask = ((r < n_rows) & (pos < cache_len))[:, None] & (d < head_dim)[None, :]
        k = tl.load(k_ptr + (b * k_sb + h * k_sh + t * k_st)[:, None] + d[None, :], mask=mask)
        v = tl.load(v_ptr + (b * v_sb + h * v_sh + t * v_st)[:, None] + d[None, :], mask=mask)
        tl.store(k_cache_ptr + (b * kc_sb + h * kc_sh + pos * kc_st)[:, None] + d[None, :], k, mask=mask)
        tl.store(v_cache_ptr + (b * vc_sb + h * vc_sh + pos * vc_st)[:, None] + d[None, :], v, mask=mask)
    tl.store(length_ptr, start + n_new)


def append_to_cache(k_cache: Tensor, v_cache: Tensor, length: Tensor, k: Tensor, v: Tensor) -> None:
    """``k_cache[:, :, length:length + T] = k`` (and v), then ``length += T``, in one launch.

    k_cache, v_cache [B, Hk, L, D]; k, v [B, Hk, T, D] of the caches' dtype (any strides with
    a unit last one); ``length``: a one-element int64 device tensor (transformers'
    ``cumulative_length``). The caller checks shapes and dtypes (onepass's attention does).
    """
    batch, heads, n_new, head_dim = k.shape
    block_d = next_power_of_2(head_dim)
    launch(_append_kv_kernel, (1,),
           k, v, k_cache, v_cache, length, batch * heads * n_new, heads, n_new, head_dim, k_cache.shape[2],
           *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
           BLOCK_ROWS=max(1, BLOCK_VALUES // block_d), BLOCK_D=block_d, num_warps=4)
