"""Split-KV decode attention (flash-decoding): a few new query tokens against a KV cache.

Math, per (batch b, q head h, new token t) with L = cache_seqlens[b] and Tq new tokens
(the last Tq of the L cached positions, causal among themselves):

    o = softmax_j(scale * q . k_j  [softcapped])  v_j   over keys j <= L - Tq + t

and, with a sliding window W, only keys j > L - Tq + t - W (``ops.attention``'s ``window``:
the query and the W - 1 keys before it).

Split: each sequence's visible cache positions [lo, L) (lo = max(0, L - Tq - W + 1) with a
window, else 0) are cut into chunks, ``splits`` each; where SHARED_MIN_CACHE positions are visible
the B * ``splits`` programs of a kv head are shared among the batch's sequences by their
visible positions instead (a ragged batch's long sequences take more chunks than its short
ones, at most SPREAD times ``splits``; equal lengths take ``splits`` each). Sequence b takes

    c_b = ceil(V_b * (B * (splits - 1) + 1) / sum V)     (V: visible positions)

chunks, which sum to at most B * splits; each program finds its sequence and chunk from the
lengths on the GPU (a cumulative sum of c over the batch, no host sync). Program (chunk, kv
head) runs the online softmax of ``onepass.ops.attention`` over its chunk for ALL q heads
of the kv group and all Tq tokens at once (group * Tq rows, padded to 16, are the M side
of tl.dot), so each K/V byte is read once per kv head, not once per q head. It writes a
partial output and LSE per row and chunk (fp32); a second kernel merges the chunks:

    o = sum_s exp(lse_s - max lse) o_s / sum_s exp(lse_s - max lse)

With one split the program writes o itself and there is no second launch
(benchmarks/results/h200/decode_attention_splits.log).

Byte budget (B batch, Hk kv heads, L valid positions (within a window: at most W + Tq - 1),
head dim D, element size e):

    unfused PyTorch (SDPA on the cache, repeated kv)   fused minimum
    reads K and V of L_max (padding too), plus the      read K and V once: 2*B*Hk*L*D*e
    repeat_kv copies: 2*B*H*L_max*D*e and more          (+ the tiny q, o and partials)

The number of splits makes B * Hk * splits about twice the SM count, so batch 1 fills
the GPU; each split keeps at least 64 to 256 positions of the visible range, fewer where few
sequences x kv heads leave SMs idle (with a window W: at most W + Tq - 1 positions, however
long the cache).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from onepass import reference
from onepass.ops.attention import MAX_HEAD_DIM, block_d_for, config_row, precision_for
from onepass.ops.attention_tiles import online_softmax_tiles, row_offsets, softmax_finish
from onepass.ops.dispatch import (
    cdiv,
    check_float,
    check_same_device,
    check_scale,
    check_softcap,
    dependent_launch,
    empty_output,
    interpreting,
    is_int,
    launch,
    launch_next_kernel,
    next_power_of_2,
    num_programs_for,
    route,
    triton_op,
    unit_stride,
    use_triton,
    wait_for_previous_kernel,
)

# (BLOCK_N, num_warps, num_stages) per padded head dim (up to 64: the 64 row): untimed starting points that
# no script in benchmarks/ sweeps yet (`onepass bench ops --suite attention` times the decode shapes).
DECODE_CONFIGS = {64: (64, 4, 3), 128: (64, 4, 3), 256: (32, 4, 2)}
FP32_CONFIG = (32, 4, 2)  # fp32 inputs (tests on a GPU): FMA dots, shared memory in bounds at D = 256
INTERPRETER_CONFIG = (16, 1, 1)
# Fewest cache positions a split takes: SPLIT_VALUES_PER_ROW / head dim per (sequence, kv head) of the batch (32
# at head dim 128), within SPLIT_TOKENS_RANGE: shorter splits cost more in merging than they add in parallelism,
# except where few kv heads leave most SMs idle (H100 decode step, 512 and 4096 cached:
# results/h100-80gb-hbm3/decode_split_tokens.log; head dim 256: decode_split_head_dim.log)
SPLIT_VALUES_PER_ROW, SPLIT_TOKENS_RANGE = 4096, (64, 256)
MAX_SPLITS = 64
MAX_ROWS = 128  # q heads per kv head x new tokens: the M side of one program's tl.dot
# Chunks shared by positions where SHARED_MIN_CACHE positions are visible (below, the plan a program computes
# first costs more than the balance it buys; a decode step of a short cache keeps equal splits), a sequence's at
# most SPREAD times the even share (`splits`): results/h100-80gb-hbm3/decode_attention_ragged.log
SHARED_MIN_CACHE, SPREAD = 16384, 4
MERGE_WARPS = 4

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _chunks(seqlens_ptr, n_batch, n_tokens, cache_len, window, spread, n_slots, WINDOW: tl.constexpr,
            BLOCK_B: tl.constexpr):
    """Per sequence of the batch (a [BLOCK_B] vector each): its chunks c_b (see the module docstring; at most
    n_slots), their cumulative sum, and its length (within the cache)."""
    bs = tl.arange(0, BLOCK_B)
    lengths = tl.minimum(tl.load(seqlens_ptr + bs, mask=bs < n_batch, other=0), cache_len)
    visible = tl.maximum(lengths, 0).to(tl.int64)
    if WINDOW:
        visible = tl.minimum(visible, window + n_tokens - 1)
    chunks = tl.minimum(tl.cdiv(visible * spread, tl.maximum(tl.sum(visible, 0), 1)), n_slots).to(tl.int32)
    return chunks, tl.cumsum(chunks, 0), lengths


@triton.jit
def _at(values, bs, b):
    """values[b] of a [BLOCK_B] vector."""
    return tl.sum(tl.where(bs == b, values, 0), 0)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, seqlens_ptr, o_part_ptr, lse_part_ptr, o_ptr, kn_ptr, vn_ptr, cos_ptr, sin_ptr, count_ptr,
    q_stride_b, q_stride_h, q_stride_t, k_stride_b, k_stride_h, k_stride_s, v_stride_b, v_stride_h, v_stride_s,
    o_stride_b, o_stride_h, o_stride_t, kn_stride_b, kn_stride_h, kn_stride_t, vn_stride_b, vn_stride_h, vn_stride_t,
    cos_stride_b, cos_stride_t, n_batch, n_kv_heads, group, n_tokens, cache_len, spread, n_slots, scale, softcap,
    window,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, LONG: tl.constexpr, PRECISION: tl.constexpr,
    SHARED: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr, APPEND: tl.constexpr, ROPE: tl.constexpr,
    COUNT: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    launch_next_kernel(PDL)
    pid = tl.program_id(0)  # a 1-D grid: batch * kv heads is not bound by grid axis 1's 65535
    if COUNT:  # the caller's count of cached tokens (transformers' cumulative_length) advanced by one program
        if pid == 0:
            tl.store(count_ptr, tl.load(count_ptr) + n_tokens)
    if SHARED:  # chunks shared by positions: program (i-th chunk of the batch's, kv head), kv heads fastest
        hk = pid % n_kv_heads
        i = pid // n_kv_heads
        chunks, ends, lengths = _chunks(seqlens_ptr, n_batch, n_tokens, cache_len, window, spread, n_slots, WINDOW,
                                        BLOCK_B)
        bs = tl.arange(0, BLOCK_B)
        b = tl.sum((ends <= i).to(tl.int32), 0)
        if b >= n_batch:  # past the batch's chunks (a ragged batch's sum to fewer than B * splits)
            return
        n_chunks = _at(chunks, bs, b)
        split = i - (_at(ends, bs, b) - n_chunks)
        seqlen = _at(lengths, bs, b)
    else:  # n_slots chunks a sequence: program (split, kv head, sequence), splits fastest
        split = pid % n_slots
        hk = pid // n_slots % n_kv_heads
        b = pid // n_slots // n_kv_heads
        n_chunks = n_slots
        seqlen = tl.minimum(tl.load(seqlens_ptr + b), cache_len)  # never read past the cache
    b64, hk64 = b.to(tl.int64), hk.to(tl.int64)
    # row r = (q head hk * group + r // Tq, new token r % Tq)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < group * n_tokens
    h64 = hk64 * group + rows // n_tokens
    t = rows % n_tokens
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_rows = q_ptr + b64 * q_stride_b + h64[:, None] * q_stride_h + t[:, None] * q_stride_t
    q = tl.load(q_rows + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if ROPE:  # q rotated here (rotate-half on the whole head), by the table row of its sequence and token
        partner_d = (offs_d + HEAD_DIM // 2) % HEAD_DIM
        sign = tl.where(offs_d < HEAD_DIM // 2, -1.0, 1.0)
        q_at = b64 * cos_stride_b + t[:, None] * cos_stride_t + offs_d[None, :]
        q_ok = row_ok[:, None] & d_ok[None, :]
        c = tl.load(cos_ptr + q_at, mask=q_ok, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + q_at, mask=q_ok, other=0.0).to(tl.float32)
        q_partner = tl.load(q_rows + partner_d[None, :], mask=q_ok, other=0.0).to(tl.float32)
        q = (q.to(tl.float32) * c + sign[None, :] * sn * q_partner).to(q.dtype)

    start = 0
    if WINDOW:  # the first token's window starts there: the splits share only the visible keys
        start = tl.maximum(seqlen - n_tokens - window + 1, 0)
    chunk = tl.cdiv(tl.cdiv(seqlen - start, n_chunks), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, seqlen)
    if APPEND:  # the new tokens' keys and values stored first, each by the program whose chunk holds its position
        new_lo = tl.load(seqlens_ptr + b) - n_tokens  # (unclamped: a position past the cache is in no chunk)
        for tn in range(0, n_tokens):
            at = new_lo + tn
            if (lo <= at) & (at < hi):
                kn_row = kn_ptr + b64 * kn_stride_b + hk64 * kn_stride_h + tn * kn_stride_t
                kn = tl.load(kn_row + offs_d, mask=d_ok, other=0.0)
                if ROPE:
                    kn_at = b64 * cos_stride_b + tn * cos_stride_t + offs_d
                    kc = tl.load(cos_ptr + kn_at, mask=d_ok, other=0.0).to(tl.float32)
                    ks = tl.load(sin_ptr + kn_at, mask=d_ok, other=0.0).to(tl.float32)
                    kn_partner = tl.load(kn_row + partner_d, mask=d_ok, other=0.0).to(tl.float32)
                    kn = kn.to(tl.float32) * kc + sign * ks * kn_partner
                vn = tl.load(vn_ptr + b64 * vn_stride_b + hk64 * vn_stride_h + tn * vn_stride_t + offs_d, mask=d_ok,
                             other=0.0)
                at64 = at.to(tl.int64)
                tl.store(k_ptr + b64 * k_stride_b + hk64 * k_stride_h + at64 * k_stride_s + offs_d,
                         kn.to(k_ptr.dtype.element_ty), mask=d_ok)
                tl.store(v_ptr + b64 * v_stride_b + hk64 * v_stride_h + at64 * v_stride_s + offs_d,
                         vn.to(v_ptr.dtype.element_ty), mask=d_ok)
        tl.debug_barrier()  # the stores seen by this program's own loads of its tiles
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # token t sits at position seqlen - Tq + t: attention's bottom-right causal mask with S_q = Tq,
    # bounded before by the window
    acc, l_i, m_i = online_softmax_tiles(
        acc, l_i, m_i, q, k_ptr + b64 * k_stride_b + hk64 * k_stride_h, v_ptr + b64 * v_stride_b + hk64 * v_stride_h,
        0, 0, k_stride_s, v_stride_s, lo, hi, t, row_offsets(BLOCK_N, LONG), offs_d, n_tokens, seqlen,
        seqlen - n_tokens, window - 1, 0, scale, softcap, True, WINDOW, True, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D,
        PRECISION, False)  # (pointer tiles: no descriptor coordinates)
    o, lse = softmax_finish(acc, l_i, m_i)
    if DIRECT:  # one split: o is the output
        tl.store(o_ptr + b64 * o_stride_b + h64[:, None] * o_stride_h + t[:, None] * o_stride_t + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        return
    part = (b64 * n_kv_heads * group + h64) * n_tokens + t  # row of [B * H * Tq, n_slots, D]
    at = part * n_slots + split
    tl.store(o_part_ptr + at[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_part_ptr + at, lse, mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    o_part_ptr, lse_part_ptr, o_ptr, seqlens_ptr, n_batch, n_heads, n_tokens, cache_len, spread, n_slots, window,
    o_stride_b, o_stride_h, o_stride_t,
    WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    launch_next_kernel(PDL)
    part = tl.program_id(0).to(tl.int64)
    b = part // (n_heads * n_tokens)
    h = part // n_tokens % n_heads
    t = part % n_tokens
    splits = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    # every slot loaded; with shared chunks, those past the row's (never written) dropped after: the loads need
    # not wait for the chunk count
    in_slots = splits < n_slots
    lse = tl.load(lse_part_ptr + part * n_slots + splits, mask=in_slots, other=float("-inf"))
    o = tl.load(o_part_ptr + (part * n_slots + splits)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=in_slots[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    if SHARED:
        chunks, _, _ = _chunks(seqlens_ptr, n_batch, n_tokens, cache_len, window, spread, n_slots, WINDOW, BLOCK_B)
        s_ok = splits < _at(chunks, tl.arange(0, BLOCK_B), b)
        lse = tl.where(s_ok, lse, float("-inf"))
        o = tl.where(s_ok[:, None], o, 0.0)
    m = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m))  # empty chunks weigh 0
    total = tl.sum(w, 0)
    o = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + b * o_stride_b + h * o_stride_h + t * o_stride_t + offs_d, o.to(o_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


# ---------------------------------------------------------------------------- launchers


def default_num_splits(device: torch.device, batch: int, kv_heads: int, cache_len: int, head_dim: int) -> int:
    """Splits so that batch * kv_heads * splits is at most twice the SM count: one more
    would start a third, mostly idle wave (benchmarks/tune_decode.py checks it against the
    best split count), each of at least the positions SPLIT_VALUES_PER_ROW gives (a position's
    cost grows with the head dim)."""
    want = max(1, 2 * num_programs_for(device) // max(1, batch * kv_heads))
    per_row = SPLIT_VALUES_PER_ROW // max(1, head_dim)
    fewest = min(max(per_row * batch * kv_heads, SPLIT_TOKENS_RANGE[0]), SPLIT_TOKENS_RANGE[1])
    return max(1, min(want, cdiv(cache_len, fewest), MAX_SPLITS))


def _bhsd(t: Tensor, layout: str) -> Tensor:
    return unit_stride(t.transpose(1, 2) if layout == "bshd" else t)


def _tables(cos: Tensor) -> tuple[Tensor, int, int]:
    """A rotary table [B or 1, Tq, D] or [Tq, D] at unit last stride, and its (batch, token) strides."""
    cos = unit_stride(cos)
    return cos, (cos.stride(0) if cos.dim() == 3 and cos.shape[0] > 1 else 0), cos.stride(-2)


def _decode_launch(q, k_cache, v_cache, cache_seqlens, scale, softcap, layout, num_splits, window, k_new=None,
                   v_new=None, cos=None, sin=None, cache_length=None):
    cache_seqlens = cache_seqlens.contiguous()  # the kernels index it densely
    out = empty_output(q)
    qv, kv, vv, ov = (_bhsd(t, layout) for t in (q, k_cache, v_cache, out))
    # the append's tensors; absent, placeholders the kernel never reads or writes
    append, rope, count = k_new is not None, cos is not None, cache_length is not None
    knv, vnv = (_bhsd(k_new, layout), _bhsd(v_new, layout)) if append else (qv, qv)
    if rope and cos.stride() != sin.stride():  # the kernel reads both tables at one set of strides
        cos, sin = cos.contiguous(), sin.contiguous()
    (cos, cos_sb, cos_st), (sin, _, _) = (_tables(cos), _tables(sin)) if rope else ((qv, 0, 0), (qv, 0, 0))
    batch, heads, n_tokens, head_dim = qv.shape
    kv_heads, cache_len = kv.shape[1], kv.shape[2]
    if q.numel() == 0:  # no sequence or no new token: nothing to attend or store, the count advanced all the same
        if count:
            cache_length.add_(n_tokens)
        return out
    group = heads // kv_heads
    visible = min(cache_len, window + n_tokens - 1) if window else cache_len  # keys one sequence's tokens see
    splits = num_splits or default_num_splits(q.device, batch, kv_heads, visible, head_dim)
    if interpreting():
        block_n, num_warps, num_stages = INTERPRETER_CONFIG
    elif q.dtype == torch.float32:
        block_n, num_warps, num_stages = FP32_CONFIG
    else:
        block_n, num_warps, num_stages = DECODE_CONFIGS[config_row(head_dim)]
    block_d = block_d_for(head_dim)
    rows = batch * heads * n_tokens
    direct = splits == 1
    shared = not direct and visible >= SHARED_MIN_CACHE
    n_slots = max(splits, min(batch * splits, SPREAD * splits, MAX_SPLITS)) if shared else splits  # a row's chunks
    spread = batch * (splits - 1) + 1
    pdl = dependent_launch(qv)
    o_part = ov if direct else torch.empty((rows, n_slots, head_dim), dtype=torch.float32, device=q.device)
    lse_part = ov if direct else torch.empty((rows, n_slots), dtype=torch.float32, device=q.device)
    block_b = next_power_of_2(batch)
    launch(_decode_split_kernel, (splits * batch * kv_heads,),
        qv, kv, vv, cache_seqlens, o_part, lse_part, ov, knv, vnv, cos, sin, cache_length if count else cache_seqlens,
        *qv.stride()[:3], *kv.stride()[:3], *vv.stride()[:3], *ov.stride()[:3], *knv.stride()[:3], *vnv.stride()[:3],
        cos_sb, cos_st, batch, kv_heads, group, n_tokens, cache_len, spread, n_slots, scale, softcap or 1.0,
        window or 1,
        WINDOW=bool(window), SOFTCAP=bool(softcap), HEAD_DIM=head_dim,
        BLOCK_M=max(16, next_power_of_2(group * n_tokens)),
        BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_B=block_b,
        LONG=cache_len * max(kv.stride(2), vv.stride(2)) >= 2**31 - 2**16,
        PRECISION=precision_for(q.dtype), num_warps=num_warps, num_stages=num_stages, SHARED=shared, DIRECT=direct,
        PDL=pdl, APPEND=append, ROPE=rope, COUNT=count,
    )
    if direct:
        return out
    launch(_decode_merge_kernel, (rows,),
        o_part, lse_part, ov, cache_seqlens, batch, heads, n_tokens, cache_len, spread, n_slots, window or 1,
        *ov.stride()[:3],
        WINDOW=bool(window), HEAD_DIM=head_dim, BLOCK_S=next_power_of_2(n_slots), BLOCK_D=block_d, BLOCK_B=block_b,
        SHARED=shared, PDL=pdl, num_warps=MERGE_WARPS,
    )
    return out


@triton_op("onepass::decode_attention", mutates_args=())
def _decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float,
                      softcap: float, layout: str, num_splits: int, window: int) -> Tensor:
    return _decode_launch(q, k_cache, v_cache, cache_seqlens, scale, softcap, layout, num_splits, window)


def _decode_append_launch(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cos, sin, cache_length, scale, softcap,
                          layout, num_splits, window):
    return _decode_launch(q, k_cache, v_cache, cache_seqlens, scale, softcap, layout, num_splits, window, k_new, v_new,
                          cos, sin, cache_length)


@triton_op("onepass::decode_attention_append", mutates_args=("k_cache", "v_cache", "cache_length"))
def _decode_attention_append(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, k_new: Tensor,
                             v_new: Tensor, cos: Optional[Tensor], sin: Optional[Tensor],
                             cache_length: Optional[Tensor], scale: float, softcap: float, layout: str,
                             num_splits: int, window: int) -> Tensor:
    return _decode_append_launch(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cos, sin, cache_length, scale,
                                 softcap, layout, num_splits, window)


# ---------------------------------------------------------------- public function


def _check(q, k_cache, v_cache, cache_seqlens, scale, softcap, layout, num_splits, window):
    # types first: the checks below read every tensor's device and shape
    if not isinstance(cache_seqlens, Tensor) or cache_seqlens.dtype != torch.int32:
        got = cache_seqlens.dtype if isinstance(cache_seqlens, Tensor) else type(cache_seqlens).__name__
        raise TypeError(f"cache_seqlens must be an int32 torch.Tensor [batch] (the valid length of each sequence), "
                        f"got {got}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({layout}), got shape {tuple(t.shape)}")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise TypeError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, "
                        f"{v_cache.dtype}")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    h_axis = 2 if layout == "bshd" else 1
    batch, heads, kv_heads = q.shape[0], q.shape[h_axis], k_cache.shape[h_axis]
    n_tokens = q.shape[3 - h_axis]
    if k_cache.shape[0] != batch or q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and the caches {tuple(k_cache.shape)} must agree on batch and head dim")
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be 1 to {MAX_HEAD_DIM}, got {q.shape[-1]}")
    if kv_heads == 0 or heads == 0 or heads % kv_heads:
        raise ValueError(f"the number of q heads ({heads}) must be a positive multiple of the number of kv heads "
                         f"({kv_heads})")
    if heads // kv_heads * n_tokens > MAX_ROWS:
        raise ValueError(f"q heads per kv head x new tokens must be at most {MAX_ROWS}, got "
                         f"{heads // kv_heads} x {n_tokens}: use attention() for prefill")
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must have shape ({batch},) (q's batch: the valid length of each sequence), "
                         f"got {tuple(cache_seqlens.shape)}")
    check_scale(scale)
    check_softcap(softcap)
    if num_splits is not None and not (is_int(num_splits) and 1 <= num_splits <= 1024):
        raise ValueError(f"num_splits must be an int from 1 to 1024, got {num_splits!r}")
    if window is not None and not (is_int(window) and 1 <= window < 2**31):
        raise ValueError(f"window must be an int >= 1 (the query and the window - 1 keys before it) or None, "
                         f"got {window!r}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise ValueError("decode_attention is inference only (no autograd): call it under torch.no_grad() or on "
                         "tensors that do not require grad; use attention() for training")


def _check_append(q, k_cache, v_cache, cache_seqlens, layout, k_new, v_new, cos, sin, cache_length):
    if k_new is None or v_new is None:
        if k_new is not None or v_new is not None or cos is not None or sin is not None or cache_length is not None:
            raise ValueError("k_new and v_new come together; cos, sin and cache_length need them (the append)")
        return
    heads_axis = 2 if layout == "bshd" else 1
    tokens_axis = 3 - heads_axis
    want = list(q.shape)
    want[heads_axis] = k_cache.shape[heads_axis]
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        check_float(name, t)
        if list(t.shape) != want:
            raise ValueError(f"{name} must be q's shape with the caches' kv heads {tuple(want)} (the new tokens' keys "
                             f"or values, {layout}), got {tuple(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} must have the caches' dtype {k_cache.dtype}, got {t.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride to be written in place, got strides {t.stride()}")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin come together (the rotary tables)")
    n_tokens, head_dim = q.shape[tokens_axis], q.shape[-1]
    if cos is not None:
        for name, t in (("cos", cos), ("sin", sin)):
            check_float(name, t)
            if t.dim() not in (2, 3) or tuple(t.shape[-2:]) != (n_tokens, head_dim) or (
                    t.dim() == 3 and t.shape[0] not in (1, q.shape[0])):
                raise ValueError(f"{name} must be [batch or 1, {n_tokens}, {head_dim}] or [{n_tokens}, {head_dim}] "
                                 f"(a table row per new token, the whole head), got {tuple(t.shape)}")
        if cos.shape != sin.shape:
            raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
        if head_dim % 2:
            raise ValueError(f"rotate-half RoPE needs an even head dim, got {head_dim}")
    if cache_length is not None:
        if (not isinstance(cache_length, Tensor) or cache_length.numel() != 1
                or cache_length.dtype not in (torch.int32, torch.int64)):
            raise TypeError("cache_length must be a one-element int32 or int64 torch.Tensor (a count of cached "
                            "tokens)")
        if not torch.compiler.is_compiling() and any(  # (dynamo traces no storage address)
                cache_length.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                for t in (cache_seqlens, k_cache, v_cache)):
            raise ValueError("cache_length must not share memory with cache_seqlens or the caches (the kernel "
                             "advances it while it reads them)")
    check_same_device(q=q, k_new=k_new, v_new=v_new, cos=cos, sin=sin, cache_length=cache_length)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (k_new, v_new, cos, sin)):
        raise ValueError("decode_attention is inference only (no autograd): call it under torch.no_grad()")


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                     scale: float | None = None, softcap: float | None = None, layout: str = "bhsd", *,
                     window: int | None = None, num_splits: int | None = None, k_new: Tensor | None = None,
                     v_new: Tensor | None = None, cos: Tensor | None = None, sin: Tensor | None = None,
                     cache_length: Tensor | None = None) -> Tensor:
    """Attention of a few new tokens per sequence over a KV cache (inference, no autograd).

    q: [B, H, Tq, D]; k_cache, v_cache: [B, Hk, L_max, D] (``layout="bshd"``: [B, Tq, H, D]
    and [B, L_max, Hk, D]); H a multiple of Hk. ``cache_seqlens`` (int32 [B]) is the valid
    length of each sequence, the new tokens included: they are its last Tq positions,
    causal among themselves (lengths are clamped to [0, L_max]; 0: no key, zeros). ``window``
    (``attention``'s int window, Mistral / Gemma's ``sliding_window``): the token at position
    p sees keys p - window + 1 .. p only. ``num_splits`` overrides the chunks a sequence's visible
    keys are cut into (default: enough to fill the GPU twice; where a ragged batch's chunks are
    shared by positions, B * num_splits chunks a kv head, more for the long sequences).

    Appending in the same launch (a decode step's cache update, as FlashAttention's
    ``flash_attn_with_kvcache`` does, whose ``cache_seqlens`` though counts the cache before the
    new tokens): ``k_new``, ``v_new`` (q's shape with Hk heads, the caches' dtype) are the new
    tokens' keys and values, written into k_cache and v_cache in place at each sequence's last Tq
    positions (``cache_seqlens[b] - Tq`` on; positions outside the cache are not written) before
    they are attended. With the rotary tables ``cos``, ``sin`` ([B or 1, Tq, D] or [Tq, D]: HF's,
    rotate-half over the whole head), q and the new keys are rotated first (the keys stored
    rotated; q itself is not written). ``cache_length``, a one-element integer tensor
    (transformers' ``StaticLayer.cumulative_length``), is advanced by Tq; it places nothing (the
    positions come from ``cache_seqlens``).
    """
    _check(q, k_cache, v_cache, cache_seqlens, scale, softcap, layout, num_splits, window)
    _check_append(q, k_cache, v_cache, cache_seqlens, layout, k_new, v_new, cos, sin, cache_length)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not use_triton(q):
        if k_new is not None:
            q = reference.decode_append(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cos, sin, cache_length,
                                        layout)
        return reference.decode_attention(q, k_cache, v_cache, cache_seqlens, scale, softcap, layout, window)
    options = (scale, float(softcap or 0.0), layout, int(num_splits or 0), int(window or 0))
    if k_new is None:
        return route(_decode_attention, _decode_launch, q)(q, k_cache, v_cache, cache_seqlens, *options)
    return route(_decode_attention_append, _decode_append_launch, q)(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                                                     cos, sin, cache_length, *options)
