"""Tile-level Triton helpers shared by the attention kernels (``onepass.ops.attention`` and
``onepass.ops.decode_attention``): loading and storing rows of a [S, D] tile, scores in base 2
with the optional softcap, the visibility mask, and the online softmax over a run of key tiles.

Scores are in log2 units (the scale folded into log2 e) so the softmax uses exp2; ``softmax_finish``
returns the natural-log LSE.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # the kernels work in base 2: exp(z) = exp2(z * log2(e))


@triton.jit
def tanh(x):
    # through exp2: runs the same in the interpreter and on sm_90 (no libdevice)
    return 1.0 - 2.0 / (tl.exp2(x * (2 * LOG2E)) + 1.0)


@triton.jit
def scores(qk, scale, softcap, SOFTCAP: tl.constexpr):
    """Scores in log2 units from raw dot products; also tanh(.) for the softcap derivative.
    fp32 whatever the scalars' type (Inductor may pass a symbolic float as float64)."""
    if SOFTCAP:
        t = tanh(qk * (scale / softcap)).to(tl.float32)
        s = (t * (softcap * LOG2E)).to(tl.float32)
    else:
        t = qk
        s = (qk * (scale * LOG2E)).to(tl.float32)
    return s, t


@triton.jit
def visible(qi, kj, seqlen_q, seqlen_k, offset, before, after,
            BOUND_BEFORE: tl.constexpr, BOUND_AFTER: tl.constexpr):
    """Which (query, key) pairs attend; qi and kj broadcast against each other."""
    ok = (qi < seqlen_q) & (kj < seqlen_k)
    if BOUND_BEFORE:
        ok &= kj >= qi + offset - before
    if BOUND_AFTER:
        ok &= kj <= qi + offset + after
    return ok


@triton.jit
def row_offsets(n: tl.constexpr, LONG: tl.constexpr):
    """Row offsets inside one sequence: int32 (half the registers of the tile pointers' math)
    unless a sequence spans 2**31 elements; the base pointers are always int64."""
    offs = tl.arange(0, n)
    if LONG:
        offs = offs.to(tl.int64)
    return offs


@triton.jit
def load_rows(base, rows, row_stride, offs_d, n_rows, CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """A [rows, BLOCK_D] tile (rows: indices from the sequence start); zero outside."""
    ptrs = base + rows[:, None] * row_stride + offs_d[None, :]
    if CHECK_ROWS:
        return tl.load(ptrs, mask=(rows < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    elif HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def tile_rows(src, b, h, start, rows, row_stride, offs_d, n_rows, CHECK_ROWS: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """Rows [start, start + BLOCK) of the sequence of (b, h): through a [B, H, S, D] tensor descriptor (TMA, never
    varlen: zero past the tensor's edges) or, src that sequence's first row, a pointer tile."""
    if TMA:
        tile = src.load([b, h, start, 0]).reshape(BLOCK, BLOCK_D)
    else:
        tile = load_rows(src, rows, row_stride, offs_d, n_rows, CHECK_ROWS, HEAD_DIM, BLOCK_D)
    return tile


@triton.jit
def store_rows(base, rows, row_stride, offs_d, n_rows, value, HEAD_DIM: tl.constexpr):
    mask = (rows < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(base + rows[:, None] * row_stride + offs_d[None, :], value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def online_softmax_tiles(
    acc, l_i, m_i, q, k_src, v_src, b, hk, k_row_stride, v_row_stride, start, end, q_idx, offs_n, offs_d,
    seqlen_q, seqlen_k, offset, before, after, scale, softcap,
    MASKED: tl.constexpr, BOUND_BEFORE: tl.constexpr, BOUND_AFTER: tl.constexpr, SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Online softmax over the key tiles [start, end): rescale acc, l, m per tile (K and V by tile_rows)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k = tile_rows(k_src, b, hk, start_n, cols, k_row_stride, offs_d, seqlen_k, MASKED, HEAD_DIM,
                      BLOCK_N, BLOCK_D, TMA)
        s, _ = scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), scale, softcap, SOFTCAP)
        if MASKED:
            ok = visible(q_idx[:, None], cols[None, :], seqlen_q, seqlen_k, offset, before, after,
                         BOUND_BEFORE, BOUND_AFTER)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:  # a row with nothing visible yet keeps m = -inf: subtract 0 instead
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tile_rows(v_src, b, hk, start_n, cols, v_row_stride, offs_d, seqlen_k, MASKED, HEAD_DIM,
                      BLOCK_N, BLOCK_D, TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def softmax_finish(acc, l_i, m_i):
    """(output, natural-log LSE) of the online softmax; a row that saw no key gets 0 and -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) / LOG2E)
    return acc / l_safe[:, None], lse
