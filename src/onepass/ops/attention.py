"""Fused attention (FlashAttention-2 style), forward and backward.

Math, per (batch, q head h, query i), with kv head h // group (grouped-query):

    s_ij  = scale * q_i . k_j                 (softcap c: s_ij = c * tanh(scale * q_i . k_j / c))
    s_ij  = -inf where key j is not visible   (causal / sliding window / sequence end)
    lse_i = log sum_j exp(s_ij),   p_ij = exp(s_ij - lse_i),   o_i = sum_j p_ij v_j

Backward (dO given; dLSE too when the caller used the returned LSE):

    delta_i = sum_d dO_id * o_id - dLSE_i
    dv_j    = sum_i p_ij dO_i           dp_ij = dO_i . v_j
    ds_ij   = p_ij (dp_ij - delta_i)    (softcap: ds_ij *= 1 - (s_ij / c)^2)
    dq_i    = scale * sum_j ds_ij k_j   dk_j  = scale * sum_i ds_ij q_i

Visibility (see ``onepass.reference.attention``): queries are aligned to the end of the
keys, so query i is at key position p = i + S_k - S_q and sees keys p - before ... p + after
(-1 = unbounded; causal means after = 0).

Byte budget (B batch, H q heads, Hk kv heads, S_q, S_k, head dim D, element size e):

    pass              unfused PyTorch (HF eager)                    fused minimum
    forward           q,k,v + repeat_kv copies + 4-5 passes over     read q, k, v; write o, lse
                      the B*H*S_q*S_k scores (fp32)                  e*D*(2*B*H*S_q + 2*B*Hk*S_k)
    backward          autograd keeps the S_q*S_k probabilities       read q,k,v,o,dO; write dq,dk,dv
    memory            O(S_q * S_k) per head                          O(S) (lse, delta: 4 bytes/row)

The FLOPs dominate (4*B*H*S_q*S_k*D forward, x2.5 backward, halved by causal), so the
benchmark reports TFLOP/s.

Forward: one program a (batch, head, query block). Online softmax in fp32 with exp2 (the
scale folded into log2 e). The key tiles a query block sees split into at most three runs:
masked tiles before (sliding window), unmasked tiles in the middle, masked tiles at the end
(diagonal / window / sequence end); only the masked runs evaluate the mask, and tiles no
query sees are never visited. A run that holds no tile for the call is not compiled at all:
the leading one without a bound on its side, the trailing one without a bound on its side
when the looped axis is whole tiles (``WHOLE_TILES``: not varlen, a multiple of the tile;
the dK/dV kernel loops over queries, so there the forward's bounds swap sides); fewer
spills, outputs bit-identical (benchmarks/results/h200/attention_empty_runs.log).

Program order (every kernel): chunks of heads whose re-read tiles fit in L2; inside a chunk,
block by block across its heads, the heaviest blocks first (causal: the last query blocks,
the first key blocks), so the short ones fill the tail (faster than one head's blocks after
another in every kernel; the A/B is in CHANGELOG.md, "Measurement history moved from src/ comments").

Backward (FA2, no atomics), two kernels: one over query blocks accumulates dQ, and first
computes its block's delta (read of O and dO it mostly has in hand) and stores it; then one
over key blocks accumulates dK and dV in registers, looping over the query blocks and over
all q heads of its kv group (so GQA needs no per-q-head dK/dV copies and no reduction
afterwards), reading that delta. This saves FlashAttention's separate preprocess kernel for
delta (benchmarks/results/h200/attention_bwd_delta.log).

Loads: the K and V tiles the forward and dQ kernels stream come through tensor descriptors (TMA:
the hardware copies a tile to shared memory, with zeros past the tensor's edges; no address or
mask registers) at the head dims where that was faster (FWD_TMA_ROWS, DQ_TMA_ROWS) and calls large
enough to pay for the descriptors' host time (TMA_MIN_FLOPS), else as pointer tiles, as always for
fp32, varlen, unaligned tensors and traced calls (kv_descriptors).

Hopper: on a GPU of compute capability 9, 16-bit calls of head dim 64 or 128 (full, causal, or a causal window;
softcap or not) over whole 128-row tiles run the Gluon forward of ``attention_hopper`` instead (FlashAttention-3's
structure: a producer warp, two consumer warpgroups, each tile's q k^T issued before the previous tile's P V), which
writes the same O and LSE (calls of at least TMA_MIN_FLOPS); at head dim 128 (and 64 on small grids) its backward
too: dQ (and delta), then dK/dV, in the same structure (calls of at least GLUON_BWD_MIN_FLOPS, after either forward).

Variable length: q, k, v packed as [total, H, D] with cumulative lengths ``cu_seqlens``
(int32, [n + 1]). The grid covers cdiv(total, BLOCK) + n blocks (an upper bound known
without reading cu_seqlens, so no device sync); each program finds its sequence by a
prefix sum of the per-sequence block counts, and spare programs do nothing.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from onepass import reference
from onepass.ops.attention_tiles import (
    LOG2E,
    load_rows,
    online_softmax_tiles,
    row_offsets,
    scores,
    softmax_finish,
    store_rows,
    tile_rows,
    visible,
)
from onepass.ops.dispatch import (
    cdiv,
    check_float,
    check_same_device,
    check_scale,
    check_softcap,
    eager_autograd,
    empty_output,
    first_order_only,
    interpreting,
    is_int,
    launch,
    next_power_of_2,
    num_programs_for,
    route,
    tracing,
    triton_op,
    unit_stride,
    use_triton_dot,
)
from onepass.reference.attention import window_bounds

MAX_HEAD_DIM = 256
# Heads run in chunks whose re-read tiles (K, V for fwd and dQ; Q, dO for dK/dV) fit in L2_CHUNK_BYTES of L2;
# causal chunks (unequal programs) hold at least CHUNK_WAVES programs an SM, so short blocks fill the tail.
# Depends on the L2 size and SM count; the sweep's script is not in the tree, its numbers are in CHANGELOG.md.
L2_CHUNK_BYTES = 8 * 2**20
CHUNK_WAVES = 4

# (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages) per kernel and padded head dim (up to 64: the 64 row).
# The fastest candidate of each kernel at every shape timed (benchmarks/tune_attention.py; results and numbers:
# CHANGELOG.md), but the head-dim-128 forward keeps (128, 64, 8, 3): the smaller tile won only inside a training
# step (warm L2) and lost alone (results/h100-80gb-hbm3/attention_tma.log).
CONFIGS = {
    "fwd": {64: (64, 64, 4, 3), 128: (128, 64, 8, 3), 256: (128, 64, 8, 2)},
    "dkdv": {64: (32, 128, 4, 3), 128: (64, 128, 8, 3)},
    "dv": {256: (32, 64, 4, 2)},
    "dk": {256: (32, 128, 8, 3)},
    "dq": {64: (64, 64, 4, 3), 128: (128, 64, 8, 3), 256: (128, 64, 8, 1)},
}
# dK and dV: one kernel ("dkdv") where a key block's two fp32 accumulators and its tiles fit in registers; at
# head dim 256 they do not (they spill: results/attention_d256_spills.log), and dV then dK run as two passes of
# the kernel, one accumulator each: the scores computed twice cost less than the spills there, more at head dims
# 64 and 128 (results/h200/attention_d256_two_pass.log).
# dQ has its own kernel over query blocks (it recomputes the scores and dP, no atomics): faster than
# FlashAttention-2's atomic dQ inside the dK/dV kernel at every shape timed (numbers in CHANGELOG.md).
# Head dims (rows of CONFIGS) whose forward and dQ kernels load their K and V tiles through tensor descriptors
# (TMA) where the tensors allow (kv_descriptors), instead of pointer tiles: where each was faster at its default
# setting (results/h200/attention_kv_tma.log); the dK/dV kernel's Q and dO tiles made the whole step slower at every
# shape timed (results/h200/attention_dkdv_tma.log).
FWD_TMA_ROWS = {256}
DQ_TMA_ROWS = {64, 128}
# Building two descriptors costs a launch host time (results/host_kv_descriptors.log) that a small call's few percent
# of GPU time would not pay back: only calls of at least TMA_MIN_FLOPS (the forward's count) take them, a bound below
# the smallest shape timed (attention_kv_tma.log's d64; the numbers in CHANGELOG.md).
TMA_MIN_FLOPS = 1e11
# The Gluon backward (attention_hopper) runs faster than the portable one at head dim 128 down to the smallest calls
# timed, saving more GPU time than its 9 descriptors cost on the host from about 4e9 forward FLOPs
# (results/h200/attention_gluon_threshold.log, results/host_attention_gluon_bwd.log), far below the forward's bound.
# Its price is host time (results/h200/host_attention_launch_split.log), which a training step pays only where it is
# host-bound; GPU-bound steps were faster with this bound than with the forward's
# (results/h200/train_attention_routing.log).
GLUON_BWD_MIN_FLOPS = 4e9
# Triton releases whose Gluon API (experimental, renamed between releases) the Hopper forward is written for: 3.6 run
# on a GPU (results/h200/attention_gluon_fwd.log), 3.7 compiled for sm_90 by tests/ops/_compile_sm90.py on a CPU, not
# run on a GPU. Others take the portable forward.
GLUON_TRITONS = ("3.6.", "3.7.")
# fp32 inputs (tests on a GPU): full-fp32 dots run on FMA units, not wgmma; small tiles and no
# pipelining keep shared memory in bounds at every head dim.
FP32_CONFIGS = {"fwd": (64, 32, 4, 1), "dq": (64, 32, 4, 1)} | dict.fromkeys(("dkdv", "dv", "dk"), (32, 64, 4, 1))
# The interpreter: small tiles (so short test sequences cross tile edges), M != N on purpose.
INTERPRETER_CONFIGS = {"fwd": (32, 16, 1, 1), "dq": (32, 16, 1, 1)} | dict.fromkeys(("dkdv", "dv", "dk"),
                                                                                     (16, 32, 1, 1))

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _tile_runs(start, n_other, offset, before, after, BLOCK_OWN: tl.constexpr, BLOCK_OTHER: tl.constexpr,
               BOUND_BEFORE: tl.constexpr, BOUND_AFTER: tl.constexpr):
    """Tiles of the other axis seen by own rows [start, start + BLOCK_OWN), where own row r
    sees other index c iff r + offset - before <= c <= r + offset + after and c < n_other.

    Returns (lo, full_lo, full_hi, hi): tiles from lo step BLOCK_OTHER; [lo, full_lo) and
    [full_hi, hi) need the mask, [full_lo, full_hi) is seen by every own row.
    """
    lo = start * 0
    full_lo = lo
    hi = start * 0 + n_other
    full_hi = hi
    if BOUND_BEFORE:
        lo = tl.maximum(start + offset - before, 0) // BLOCK_OTHER * BLOCK_OTHER
        # first index the last own row sees, rounded up to a tile edge
        full_lo = lo + tl.cdiv(tl.maximum(start + BLOCK_OWN - 1 + offset - before - lo, 0), BLOCK_OTHER) * BLOCK_OTHER
    if BOUND_AFTER:
        hi = tl.minimum(start + BLOCK_OWN + offset + after, n_other)
        full_hi = tl.minimum(start + offset + after + 1, n_other)  # end of what the first own row sees
    full_hi = lo + tl.maximum(full_hi - lo, 0) // BLOCK_OTHER * BLOCK_OTHER
    full_lo = tl.minimum(full_lo, lo + tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_OTHER) * BLOCK_OTHER)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _locate(n_heads, cu_starts, cu_ends, total, seqlen, n_blocks, chunk_heads, BLOCK: tl.constexpr,
            VARLEN: tl.constexpr, HEAVY_LAST: tl.constexpr):
    """(sequence, head, block of that sequence, first row of the sequence, its length) of this program.

    A 1-D grid of (batch * heads) x n_blocks programs (varlen: heads x n_blocks), in chunks
    of ``chunk_heads`` heads (``chunk_heads``; the Gluon kernels' causal order is the same:
    attention_hopper._causal_item) whose re-read tensors fit in L2 together; inside a chunk the
    programs go block by block across its heads, so the heaviest blocks start first and the
    short ones fill the tail (HEAVY_LAST: causal, where the last query blocks see the most
    keys, reverses the blocks). Varlen: the program finds its sequence from the prefix sum
    of per-sequence block counts (spare programs get length 0). The caller loads the offsets
    (``cu_starts``, ``cu_ends``: the sequences' first and one-past-last rows, masked to the
    n_seqs sequences): torch's analysis of a traced launch takes every pointer passed into a
    called function whose results address a store as written, and a placeholder taken as
    written is a mutation of the tensor standing in for it (see dispatch.triton_op).
    """
    pid = tl.program_id(0)
    chunk = pid // (chunk_heads * n_blocks)
    first_head = chunk * chunk_heads
    heads_here = tl.minimum(chunk_heads, tl.num_programs(0) // n_blocks - first_head)
    r = pid - first_head * n_blocks
    pid_head = first_head + r % heads_here
    pid_block = r // heads_here
    if HEAVY_LAST:
        pid_block = n_blocks - 1 - pid_block
    if VARLEN:
        idx = tl.arange(0, cu_starts.shape[0])
        starts = tl.minimum(tl.maximum(cu_starts, 0), total)
        ends = tl.minimum(tl.maximum(cu_ends, starts), total)
        blocks = (ends - starts + BLOCK - 1) // BLOCK
        cum = tl.cumsum(blocks, 0)
        seq = tl.sum((cum <= pid_block).to(tl.int32), 0)
        mine = idx == seq
        block = pid_block - tl.sum(tl.where(mine, cum - blocks, 0), 0)
        row_start = tl.sum(tl.where(mine, starts, 0), 0)
        length = tl.sum(tl.where(mine, ends - starts, 0), 0)
        head = pid_head
    else:
        seq = pid_head // n_heads
        head = pid_head % n_heads
        block = pid_block
        row_start = pid_block * 0
        length = pid_block * 0 + seqlen
    return seq, head, block, row_start, length


@triton.jit
def _kv_sources(k_ptr, v_ptr, b64, hk64, row64, k_stride_b, k_stride_h, k_stride_s, v_stride_b, v_stride_h, v_stride_s,
                TMA: tl.constexpr):
    """What tile_rows reads K and V of this program's (batch, kv head, sequence) from: the [B, H, S, D] tensor
    descriptors themselves (TMA), or the sequence's first rows."""
    if TMA:
        k_src = k_ptr
        v_src = v_ptr
    else:
        k_src = k_ptr + b64 * k_stride_b + hk64 * k_stride_h + row64 * k_stride_s
        v_src = v_ptr + b64 * v_stride_b + hk64 * v_stride_h + row64 * v_stride_s
    return k_src, v_src


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_seqlens_ptr,
    q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h, k_stride_s,
    v_stride_b, v_stride_h, v_stride_s, o_stride_b, o_stride_h, o_stride_s, lse_stride_b, lse_stride_h,
    seqlen_q, seqlen_k, n_heads, group, n_seqs, total, n_blocks, chunk_heads, scale, softcap, before, after,
    BOUND_BEFORE: tl.constexpr, BOUND_AFTER: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
    WHOLE_TILES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SEQS: tl.constexpr, LONG: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    seqs = tl.arange(0, BLOCK_SEQS)  # (loaded here: see _locate)
    cu_starts = tl.load(cu_seqlens_ptr + seqs, mask=(seqs < n_seqs) & VARLEN, other=0)
    cu_ends = tl.load(cu_seqlens_ptr + seqs + 1, mask=(seqs < n_seqs) & VARLEN, other=0)
    b, h, m_block, row_start, length = _locate(n_heads, cu_starts, cu_ends, total, seqlen_q, n_blocks,
                                               chunk_heads, BLOCK_M, VARLEN, BOUND_AFTER)
    if VARLEN:
        seqlen_q = length
        seqlen_k = length
    offset = seqlen_k - seqlen_q
    hk = h // group
    b64, h64, hk64, row64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64), row_start.to(tl.int64)
    start_m = m_block * BLOCK_M
    offs_m = start_m + row_offsets(BLOCK_M, LONG)
    offs_n = row_offsets(BLOCK_N, LONG)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = q_ptr + b64 * q_stride_b + h64 * q_stride_h + row64 * q_stride_s
    k_src, v_src = _kv_sources(k_ptr, v_ptr, b64, hk64, row64, k_stride_b, k_stride_h, k_stride_s, v_stride_b,
                               v_stride_h, v_stride_s, TMA)
    q = load_rows(q_base, offs_m, q_stride_s, offs_d, seqlen_q, True, HEAD_DIM, BLOCK_D)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lo, full_lo, full_hi, hi = _tile_runs(start_m, seqlen_k, offset, before, after, BLOCK_M, BLOCK_N,
                                          BOUND_BEFORE, BOUND_AFTER)
    if BOUND_BEFORE:  # (else no key tile lies before the unmasked run: see _tile_runs)
        acc, l_i, m_i = online_softmax_tiles(
            acc, l_i, m_i, q, k_src, v_src, b, hk, k_stride_s, v_stride_s, lo, full_lo, offs_m, offs_n, offs_d,
            seqlen_q, seqlen_k, offset, before, after, scale, softcap,
            True, BOUND_BEFORE, BOUND_AFTER, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, TMA)
    acc, l_i, m_i = online_softmax_tiles(
        acc, l_i, m_i, q, k_src, v_src, b, hk, k_stride_s, v_stride_s, full_lo, full_hi, offs_m, offs_n, offs_d,
        seqlen_q, seqlen_k, offset, before, after, scale, softcap,
        False, BOUND_BEFORE, BOUND_AFTER, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, TMA)
    if BOUND_AFTER or not WHOLE_TILES:  # (else the unmasked run reaches the last key)
        acc, l_i, m_i = online_softmax_tiles(
            acc, l_i, m_i, q, k_src, v_src, b, hk, k_stride_s, v_stride_s, full_hi, hi, offs_m, offs_n, offs_d,
            seqlen_q, seqlen_k, offset, before, after, scale, softcap,
            True, BOUND_BEFORE, BOUND_AFTER, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, TMA)

    o, lse = softmax_finish(acc, l_i, m_i)
    o_base = o_ptr + b64 * o_stride_b + h64 * o_stride_h + row64 * o_stride_s
    store_rows(o_base, offs_m, o_stride_s, offs_d, seqlen_q, o, HEAD_DIM)
    tl.store(lse_ptr + b64 * lse_stride_b + h64 * lse_stride_h + row64 + offs_m, lse, mask=offs_m < seqlen_q)


@triton.jit
def _load_lse(lse_ptr, at, rows, n_rows):
    """LSE (log2 units) of some query rows; rows that see nothing get +inf, so p = 0."""
    lse = tl.load(lse_ptr + at, mask=rows < n_rows, other=float("inf")) * LOG2E
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, q_row_stride, do_row_stride, lse_base, delta_base, start, end,
                k_idx, offs_m, offs_d, seqlen_q, seqlen_k, offset, before, after, scale, softcap,
                MASKED: tl.constexpr, BOUND_BEFORE: tl.constexpr, BOUND_AFTER: tl.constexpr, SOFTCAP: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                DK: tl.constexpr, DV: tl.constexpr):
    """dK and/or dV of one key block from the query tiles [start, end), in the transposed
    orientation (keys are rows): sT = k q^T, dv += pT dO, dk += dsT q."""
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m
        q = load_rows(q_base, rows, q_row_stride, offs_d, seqlen_q, MASKED, HEAD_DIM, BLOCK_D)
        do = load_rows(do_base, rows, do_row_stride, offs_d, seqlen_q, MASKED, HEAD_DIM, BLOCK_D)
        lse = _load_lse(lse_base, rows, rows, seqlen_q)
        delta = tl.load(delta_base + rows, mask=rows < seqlen_q, other=0.0)
        sT, tT = scores(tl.dot(k, tl.trans(q), input_precision=PRECISION), scale, softcap, SOFTCAP)
        if MASKED:
            ok = visible(rows[None, :], k_idx[:, None], seqlen_q, seqlen_k, offset, before, after,
                         BOUND_BEFORE, BOUND_AFTER)
            sT = tl.where(ok, sT, float("-inf"))
        pT = tl.exp2(sT - lse[None, :])
        if DV:
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        if DK:
            dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            dsT = pT * (dpT - delta[None, :])
            if SOFTCAP:
                dsT *= 1.0 - tT * tT
            dsT = dsT.to(q.dtype)
            dk = tl.dot(dsT, q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_seqlens_ptr,
    q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h, k_stride_s, v_stride_b, v_stride_h, v_stride_s,
    do_stride_b, do_stride_h, do_stride_s, dk_stride_b, dk_stride_h, dk_stride_s,
    dv_stride_b, dv_stride_h, dv_stride_s, lse_stride_b, lse_stride_h,
    seqlen_q, seqlen_k, n_kv_heads, group, n_seqs, total, n_blocks, chunk_heads, scale, softcap, before, after,
    BOUND_BEFORE: tl.constexpr, BOUND_AFTER: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
    WHOLE_TILES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SEQS: tl.constexpr, LONG: tl.constexpr, PRECISION: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr,
):
    # causal: the first key blocks are seen by the most queries, and start first as they are
    seqs = tl.arange(0, BLOCK_SEQS)  # (loaded here: see _locate)
    cu_starts = tl.load(cu_seqlens_ptr + seqs, mask=(seqs < n_seqs) & VARLEN, other=0)
    cu_ends = tl.load(cu_seqlens_ptr + seqs + 1, mask=(seqs < n_seqs) & VARLEN, other=0)
    b, hk, n_block, row_start, length = _locate(n_kv_heads, cu_starts, cu_ends, total, seqlen_k, n_blocks,
                                                chunk_heads, BLOCK_N, VARLEN, False)
    if VARLEN:
        seqlen_q = length
        seqlen_k = length
    offset = seqlen_k - seqlen_q
    b64, hk64, row64 = b.to(tl.int64), hk.to(tl.int64), row_start.to(tl.int64)
    start_n = n_block * BLOCK_N
    k_idx = start_n + row_offsets(BLOCK_N, LONG)
    offs_m = row_offsets(BLOCK_M, LONG)
    offs_d = tl.arange(0, BLOCK_D)
    k = load_rows(k_ptr + b64 * k_stride_b + hk64 * k_stride_h + row64 * k_stride_s, k_idx,
                  k_stride_s, offs_d, seqlen_k, True, HEAD_DIM, BLOCK_D)
    v = load_rows(v_ptr + b64 * v_stride_b + hk64 * v_stride_h + row64 * v_stride_s, k_idx,
                  v_stride_s, offs_d, seqlen_k, True, HEAD_DIM, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # the queries that see this key block: the forward's bounds with the roles swapped
    lo, full_lo, full_hi, hi = _tile_runs(start_n, seqlen_q, -offset, after, before, BLOCK_N, BLOCK_M,
                                          BOUND_AFTER, BOUND_BEFORE)
    for g in range(0, group):  # every q head of the kv group adds into the same registers
        h64 = hk64 * group + g
        q_base = q_ptr + b64 * q_stride_b + h64 * q_stride_h + row64 * q_stride_s
        do_base = do_ptr + b64 * do_stride_b + h64 * do_stride_h + row64 * do_stride_s
        stats = b64 * lse_stride_b + h64 * lse_stride_h + row64
        if BOUND_AFTER:  # (the roles swapped: the forward's bound after masks the first query tiles)
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, q_stride_s, do_stride_s, lse_ptr + stats,
                                 delta_ptr + stats, lo, full_lo, k_idx, offs_m, offs_d, seqlen_q, seqlen_k, offset,
                                 before, after, scale, softcap, True, BOUND_BEFORE, BOUND_AFTER, SOFTCAP, HEAD_DIM,
                                 BLOCK_M, BLOCK_D, PRECISION, DK, DV)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, q_stride_s, do_stride_s, lse_ptr + stats,
                             delta_ptr + stats, full_lo, full_hi, k_idx, offs_m, offs_d, seqlen_q, seqlen_k, offset,
                             before, after, scale, softcap, False, BOUND_BEFORE, BOUND_AFTER, SOFTCAP, HEAD_DIM,
                             BLOCK_M, BLOCK_D, PRECISION, DK, DV)
        if BOUND_BEFORE or not WHOLE_TILES:
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, q_stride_s, do_stride_s, lse_ptr + stats,
                                 delta_ptr + stats, full_hi, hi, k_idx, offs_m, offs_d, seqlen_q, seqlen_k, offset,
                                 before, after, scale, softcap, True, BOUND_BEFORE, BOUND_AFTER, SOFTCAP, HEAD_DIM,
                                 BLOCK_M, BLOCK_D, PRECISION, DK, DV)
    rows = k_idx
    if DK:
        store_rows(dk_ptr + b64 * dk_stride_b + hk64 * dk_stride_h + row64 * dk_stride_s, rows, dk_stride_s, offs_d,
                   seqlen_k, dk * scale, HEAD_DIM)
    if DV:
        store_rows(dv_ptr + b64 * dv_stride_b + hk64 * dv_stride_h + row64 * dv_stride_s, rows, dv_stride_s, offs_d,
                   seqlen_k, dv, HEAD_DIM)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_src, v_src, b, hk, k_row_stride, v_row_stride, start, end, q_idx,
              offs_n, offs_d, seqlen_q, seqlen_k, offset, before, after, scale, softcap,
              MASKED: tl.constexpr, BOUND_BEFORE: tl.constexpr, BOUND_AFTER: tl.constexpr, SOFTCAP: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
              TMA: tl.constexpr):
    """dQ of one query block from the key tiles [start, end) (K and V by tile_rows)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k = tile_rows(k_src, b, hk, start_n, cols, k_row_stride, offs_d, seqlen_k, MASKED, HEAD_DIM,
                      BLOCK_N, BLOCK_D, TMA)
        v = tile_rows(v_src, b, hk, start_n, cols, v_row_stride, offs_d, seqlen_k, MASKED, HEAD_DIM,
                      BLOCK_N, BLOCK_D, TMA)
        s, t = scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), scale, softcap, SOFTCAP)
        if MASKED:
            ok = visible(q_idx[:, None], cols[None, :], seqlen_q, seqlen_k, offset, before, after,
                         BOUND_BEFORE, BOUND_AFTER)
            s = tl.where(ok, s, float("-inf"))
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds *= 1.0 - t * t
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, delta_ptr, dq_ptr, cu_seqlens_ptr,
    q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h, k_stride_s, v_stride_b, v_stride_h, v_stride_s,
    o_stride_b, o_stride_h, o_stride_s, do_stride_b, do_stride_h, do_stride_s, dq_stride_b, dq_stride_h, dq_stride_s,
    lse_stride_b, lse_stride_h,
    seqlen_q, seqlen_k, n_heads, group, n_seqs, total, n_blocks, chunk_heads, scale, softcap, before, after,
    BOUND_BEFORE: tl.constexpr, BOUND_AFTER: tl.constexpr, SOFTCAP: tl.constexpr, HAS_DLSE: tl.constexpr,
    VARLEN: tl.constexpr, WHOLE_TILES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SEQS: tl.constexpr, LONG: tl.constexpr,
    PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """dQ of one query block; first its delta = rowsum(dO * O) - dLSE, stored for the dK/dV kernel."""
    seqs = tl.arange(0, BLOCK_SEQS)  # (loaded here: see _locate)
    cu_starts = tl.load(cu_seqlens_ptr + seqs, mask=(seqs < n_seqs) & VARLEN, other=0)
    cu_ends = tl.load(cu_seqlens_ptr + seqs + 1, mask=(seqs < n_seqs) & VARLEN, other=0)
    b, h, m_block, row_start, length = _locate(n_heads, cu_starts, cu_ends, total, seqlen_q, n_blocks,
                                               chunk_heads, BLOCK_M, VARLEN, BOUND_AFTER)
    if VARLEN:
        seqlen_q = length
        seqlen_k = length
    offset = seqlen_k - seqlen_q
    hk = h // group
    b64, h64, hk64, row64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64), row_start.to(tl.int64)
    start_m = m_block * BLOCK_M
    q_idx = start_m + row_offsets(BLOCK_M, LONG)
    rows = q_idx
    offs_d = tl.arange(0, BLOCK_D)
    q = load_rows(q_ptr + b64 * q_stride_b + h64 * q_stride_h + row64 * q_stride_s, rows, q_stride_s, offs_d,
                  seqlen_q, True, HEAD_DIM, BLOCK_D)
    do = load_rows(do_ptr + b64 * do_stride_b + h64 * do_stride_h + row64 * do_stride_s, rows, do_stride_s, offs_d,
                   seqlen_q, True, HEAD_DIM, BLOCK_D)
    o = load_rows(o_ptr + b64 * o_stride_b + h64 * o_stride_h + row64 * o_stride_s, rows, o_stride_s, offs_d,
                  seqlen_q, True, HEAD_DIM, BLOCK_D)
    stats = b64 * lse_stride_b + h64 * lse_stride_h + row64 + rows
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + stats, mask=rows < seqlen_q, other=0.0)
    tl.store(delta_ptr + stats, delta, mask=rows < seqlen_q)
    lse = _load_lse(lse_ptr, stats, rows, seqlen_q)
    k_src, v_src = _kv_sources(k_ptr, v_ptr, b64, hk64, row64, k_stride_b, k_stride_h, k_stride_s, v_stride_b,
                               v_stride_h, v_stride_s, TMA)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _tile_runs(start_m, seqlen_k, offset, before, after, BLOCK_M, BLOCK_N,
                                          BOUND_BEFORE, BOUND_AFTER)
    offs_n = row_offsets(BLOCK_N, LONG)
    if BOUND_BEFORE:
        dq = _dq_tiles(dq, q, do, lse, delta, k_src, v_src, b, hk, k_stride_s, v_stride_s, lo, full_lo,
                       q_idx, offs_n, offs_d, seqlen_q, seqlen_k, offset, before, after, scale, softcap, True,
                       BOUND_BEFORE, BOUND_AFTER, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, TMA)
    dq = _dq_tiles(dq, q, do, lse, delta, k_src, v_src, b, hk, k_stride_s, v_stride_s, full_lo, full_hi,
                   q_idx, offs_n, offs_d, seqlen_q, seqlen_k, offset, before, after, scale, softcap, False,
                   BOUND_BEFORE, BOUND_AFTER, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, TMA)
    if BOUND_AFTER or not WHOLE_TILES:
        dq = _dq_tiles(dq, q, do, lse, delta, k_src, v_src, b, hk, k_stride_s, v_stride_s, full_hi, hi,
                       q_idx, offs_n, offs_d, seqlen_q, seqlen_k, offset, before, after, scale, softcap, True,
                       BOUND_BEFORE, BOUND_AFTER, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, PRECISION, TMA)
    store_rows(dq_ptr + b64 * dq_stride_b + h64 * dq_stride_h + row64 * dq_stride_s, rows, dq_stride_s, offs_d,
               seqlen_q, dq * scale, HEAD_DIM)


# ---------------------------------------------------------------------------- launchers


def block_d_for(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def config_row(head_dim: int) -> int:
    """The row of the settings tables (CONFIGS, decode's) a head dim takes: its padded block, 64 at least."""
    return max(64, block_d_for(head_dim))


def launch_config(kernel: str, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for one kernel of this file."""
    if interpreting():
        return INTERPRETER_CONFIGS[kernel]
    if dtype == torch.float32:
        return FP32_CONFIGS[kernel]
    return CONFIGS[kernel][config_row(head_dim)]


def dkdv_kernels(head_dim: int) -> tuple[str, ...]:
    """The dK/dV kernel's passes at this head dim: ("dkdv",), or ("dv", "dk") (see CONFIGS)."""
    return ("dkdv",) if config_row(head_dim) in CONFIGS["dkdv"] else ("dv", "dk")


def _descriptor_call(g: "_Geometry", t: Tensor, before: int, after: int, min_flops: float) -> bool:
    """Whether a call may load through host tensor descriptors (kv_descriptors, the Hopper kernels): not varlen,
    not empty, at least ``min_flops`` (the forward's, counted over the keys a query sees), 16-bit, untraced."""
    flops = g.flops(before, after)
    return not (g.varlen or not flops or flops < min_flops or t.dtype == torch.float32 or tracing(t))


def kv_descriptors(g: "_Geometry", tensors: tuple[Tensor, ...], block: int, head_dims: set, before: int,
                   after: int) -> tuple | None:
    """[B, H, S, D] tensor descriptors of K and V for a kernel that streams their tiles (blocks of ``block``
    rows), or None where it loads pointer tiles: head dims (rows of CONFIGS) off ``head_dims``, empty calls and
    calls under TMA_MIN_FLOPS (counted over the keys a query sees: a window's width, half under a causal mask),
    fp32, varlen (a tile past a sequence's end would read the next sequence instead of zeros), a tensor TMA
    cannot address (16-byte alignment, no zero strides: an expanded tensor), or a traced call (torch 2.11-2.13
    capture host descriptors only when Dynamo traces the launch itself, not an op's body)."""
    if config_row(g.head_dim) not in head_dims or not _descriptor_call(g, tensors[0], before, after, TMA_MIN_FLOPS):
        return None
    views = [g.view(t) for t in tensors]
    size = tensors[0].element_size()
    if any(v.data_ptr() % 16 or any(not st or st * size % 16 for st in v.stride()[:-1]) for v in views):
        return None
    return tuple(TensorDescriptor.from_tensor(v, [1, 1, block, g.block_d]) for v in views)


def precision_for(dtype: torch.dtype) -> str:
    """fp32 inputs (tests) multiply in full fp32, not TF32; 16-bit inputs ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"


def chunk_heads(heads: int, n_blocks: int, reread_per_head: int, uneven: bool, sms: int) -> int:
    """The heads of a chunk of programs (program order, in the module's docstring): those whose re-read tiles fit
    in L2_CHUNK_BYTES together, and where the blocks' work is ``uneven`` (causal) at least CHUNK_WAVES programs an
    SM."""
    in_l2 = L2_CHUNK_BYTES // max(reread_per_head, 1)
    waves = cdiv(CHUNK_WAVES * sms, n_blocks) if uneven else 1
    return min(heads, max(in_l2, waves))


class _Geometry:
    """The [B, H, S, D] strided views the kernels index, and the grid facts of one call."""

    def __init__(self, q, k, layout, cu_seqlens):
        self.varlen = cu_seqlens is not None
        self.layout = layout
        qv, kv = self.view(q), self.view(k)
        self.batch, self.heads, self.seqlen_q, self.head_dim = qv.shape
        self.kv_heads, self.seqlen_k = kv.shape[1], kv.shape[2]
        self.group = self.heads // self.kv_heads
        self.n_seqs = cu_seqlens.numel() - 1 if self.varlen else self.batch
        self.total = self.seqlen_q if self.varlen else 0
        self.block_seqs = next_power_of_2(self.n_seqs + 1) if self.varlen else 1
        self.cu_seqlens = cu_seqlens.contiguous() if self.varlen else None  # the kernels index it densely
        self.block_d = block_d_for(self.head_dim)
        self.sm_count = num_programs_for(q.device)

    def long_offsets(self, *tensors: Tensor) -> bool:
        """Whether a sequence of one of these tensors spans 2**31 elements (int64 tile offsets)."""
        return max(self.view(t).shape[2] * self.view(t).stride(2) for t in tensors) >= 2**31 - 2**16

    def view(self, t: Tensor) -> Tensor:
        if self.varlen:  # [total, H, D] -> [1, H, total, D]
            return t.unsqueeze(0).transpose(1, 2)
        return t.transpose(1, 2) if self.layout == "bshd" else t

    def strides(self, t: Tensor) -> tuple[int, int, int]:
        sb, sh, ss = self.view(t).stride()[:3]
        return (0 if self.varlen else sb), sh, ss  # varlen: the kernel's batch index is the sequence

    def lse_shape(self) -> tuple[int, ...]:
        return (self.heads, self.total) if self.varlen else (self.batch, self.heads, self.seqlen_q)

    def lse_strides(self) -> tuple[int, int]:
        return (0, self.total) if self.varlen else (self.heads * self.seqlen_q, self.seqlen_q)

    def programs(self, block: int, heads: int, seqlen: int, reread_per_head: int,
                 uneven: bool) -> tuple[tuple[int], tuple]:
        """(grid, arguments the kernel's _locate takes) for programs of ``block`` rows over
        ``heads`` heads, each head re-reading ``reread_per_head`` bytes (the other side's
        tiles); ``uneven``: the blocks' work differs (causal), so chunks take CHUNK_WAVES."""
        heads = heads if self.varlen else self.batch * heads
        n_blocks = cdiv(self.total, block) + self.n_seqs if self.varlen else cdiv(seqlen, block)
        return (heads * n_blocks,), (self.n_seqs, self.total, n_blocks,
                                     chunk_heads(heads, n_blocks, reread_per_head, uneven, self.sm_count))

    def flops(self, before: int, after: int) -> float:
        """The forward's FLOPs counted over the keys a query sees: a window's width, half under a causal mask."""
        if before >= 0 and after >= 0:
            keys = min(self.seqlen_k, before + after + 1)
        else:
            keys = self.seqlen_k / (2 if after >= 0 else 1)
        return 4 * self.batch * self.heads * self.seqlen_q * keys * self.head_dim

    def reread_bytes(self, seqlen: int, element_size: int) -> int:
        """Bytes of two [seqlen, D] tiles of one head (varlen: of an average sequence)."""
        rows = cdiv(self.total, self.n_seqs) if self.varlen else seqlen
        return 2 * rows * self.head_dim * element_size

    def whole_tiles(self, seqlen: int, block: int) -> bool:
        """Whether every sequence of that length is whole tiles of ``block`` (varlen: unknown here)."""
        return not self.varlen and seqlen % block == 0

    def cu(self, fallback: Tensor) -> Tensor:
        return self.cu_seqlens if self.varlen else fallback


def _on_hopper(t: Tensor) -> bool:
    """Whether ``t`` lies on a GPU of compute capability 9 (H100, H200), outside Triton's interpreter, with a Triton
    whose Gluon API ``attention_hopper`` is written for (GLUON_TRITONS)."""
    return (t.is_cuda and not interpreting() and triton.__version__.startswith(GLUON_TRITONS)
            and torch.cuda.get_device_capability(t.device)[0] == 9)


def _hopper(g, q, before, after, min_flops):
    """``attention_hopper`` where a call of at least ``min_flops`` may take its Gluon kernels (which then check the
    rest: their docstrings), else None. Imported here, on a Hopper GPU only: Gluon's API is experimental, and a
    Triton without this form of it still imports onepass."""
    # after: -1 all keys, 0 causal
    if not (after <= 0 and _descriptor_call(g, q, before, after, min_flops) and _on_hopper(q)):
        return None
    from onepass.ops import attention_hopper

    return attention_hopper


def _hopper_forward(g, q, k, v, o, lse, scale, before, after, softcap) -> bool:
    """Run the Gluon forward where it covers the call, writing o and lse; False where the portable kernel runs."""
    hopper = _hopper(g, q, before, after, TMA_MIN_FLOPS)
    return hopper is not None and hopper.forward((g.view(q), g.view(k), g.view(v)), g.view(o), lse, scale, after == 0,
                                                 before, softcap)


def _hopper_backward(g, tensors, lse, dlse, delta, scale, before, after, softcap) -> bool:
    """Run the Gluon backward where it covers the call (tensors: q, k, v, o, do, dq, dk, dv), writing dq, dk, dv;
    False where the portable kernels run."""
    hopper = _hopper(g, tensors[0], before, after, GLUON_BWD_MIN_FLOPS)
    return hopper is not None and hopper.backward(tuple(g.view(t) for t in tensors), lse, dlse, delta, scale,
                                                  after == 0, before, softcap)


def _attention_fwd_launch(q, k, v, cu_seqlens, scale, before, after, softcap, layout):
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    g = _Geometry(q, k, layout, cu_seqlens)
    o = empty_output(q)
    lse = torch.empty(g.lse_shape(), dtype=torch.float32, device=q.device)
    if q.numel() == 0 or _hopper_forward(g, q, k, v, o, lse, scale, before, after, softcap):
        return o, lse
    block_m, block_n, num_warps, num_stages = launch_config("fwd", g.head_dim, q.dtype)
    kv_reread = g.reread_bytes(g.seqlen_k, k.element_size()) // g.group  # a q head's share of its K and V
    grid, seq_args = g.programs(block_m, g.heads, g.seqlen_q, kv_reread, uneven=after >= 0)
    descriptors = kv_descriptors(g, (k, v), block_n, FWD_TMA_ROWS, before, after)
    k_src, v_src = descriptors or (k, v)
    launch(_attn_fwd_kernel, grid,
        q, k_src, v_src, o, lse, g.cu(q),  # (a placeholder is an input: see dispatch.triton_op)
        *g.strides(q), *g.strides(k), *g.strides(v), *g.strides(o), *g.lse_strides(),
        g.seqlen_q, g.seqlen_k, g.heads, g.group, *seq_args, scale, softcap or 1.0, before, after,
        BOUND_BEFORE=before >= 0, BOUND_AFTER=after >= 0, SOFTCAP=bool(softcap), VARLEN=g.varlen,
        WHOLE_TILES=g.whole_tiles(g.seqlen_k, block_n), HEAD_DIM=g.head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=g.block_d, BLOCK_SEQS=g.block_seqs,
        LONG=g.long_offsets(q, k, v, o), PRECISION=precision_for(q.dtype), TMA=descriptors is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, lse


def _attention_bwd_launch(do, q, k, v, o, lse, dlse, cu_seqlens, scale, before, after, softcap, layout):
    do, q, k, v, o = (unit_stride(t) for t in (do, q, k, v, o))
    g = _Geometry(q, k, layout, cu_seqlens)
    dq = empty_output(q)
    dk = empty_output(k)
    dv = empty_output(v)
    if q.numel() == 0 or k.numel() == 0:  # nothing attends: zero gradients
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty_like(lse)
    dlse = dlse.contiguous() if dlse is not None else None  # indexed with lse's strides (autograd may expand it)
    if _hopper_backward(g, (q, k, v, o, do, dq, dk, dv), lse, dlse, delta, scale, before, after, softcap):
        return dq, dk, dv
    common = dict(BOUND_BEFORE=before >= 0, BOUND_AFTER=after >= 0, SOFTCAP=bool(softcap), VARLEN=g.varlen,
                  HEAD_DIM=g.head_dim, BLOCK_D=g.block_d, BLOCK_SEQS=g.block_seqs, PRECISION=precision_for(q.dtype),
                  LONG=g.long_offsets(q, k, v, o, do, dq, dk, dv))
    masks = (scale, softcap or 1.0, before, after)

    block_m, block_n, num_warps, num_stages = launch_config("dq", g.head_dim, q.dtype)
    kv_reread = g.reread_bytes(g.seqlen_k, k.element_size()) // g.group
    grid, seq_args = g.programs(block_m, g.heads, g.seqlen_q, kv_reread, uneven=after >= 0)
    descriptors = kv_descriptors(g, (k, v), block_n, DQ_TMA_ROWS, before, after)
    k_src, v_src = descriptors or (k, v)
    launch(_attn_bwd_dq_kernel, grid,
        q, k_src, v_src, o, do, lse, dlse if dlse is not None else lse, delta, dq, g.cu(lse),
        *g.strides(q), *g.strides(k), *g.strides(v), *g.strides(o), *g.strides(do), *g.strides(dq),
        *g.lse_strides(), g.seqlen_q, g.seqlen_k, g.heads, g.group, *seq_args, *masks,
        HAS_DLSE=dlse is not None, WHOLE_TILES=g.whole_tiles(g.seqlen_k, block_n), BLOCK_M=block_m, BLOCK_N=block_n,
        TMA=descriptors is not None, num_warps=num_warps, num_stages=num_stages, **common,
    )
    q_reread = g.reread_bytes(g.seqlen_q, q.element_size()) * g.group  # Q and dO of a kv head's q heads
    for kernel in dkdv_kernels(g.head_dim):
        block_m, block_n, num_warps, num_stages = launch_config(kernel, g.head_dim, q.dtype)
        grid, seq_args = g.programs(block_n, g.kv_heads, g.seqlen_k, q_reread, uneven=after >= 0)
        launch(_attn_bwd_dkdv_kernel, grid,
            q, k, v, do, lse, delta, dk, dv, g.cu(lse),
            *g.strides(q), *g.strides(k), *g.strides(v), *g.strides(do), *g.strides(dk), *g.strides(dv),
            *g.lse_strides(), g.seqlen_q, g.seqlen_k, g.kv_heads, g.group, *seq_args, *masks,
            WHOLE_TILES=g.whole_tiles(g.seqlen_q, block_m), BLOCK_M=block_m, BLOCK_N=block_n,
            DK=kernel != "dv", DV=kernel != "dk", num_warps=num_warps, num_stages=num_stages, **common,
        )
    return dq, dk, dv


# ------------------------------------------------------------------ registered ops


@triton_op("onepass::attention_fwd")
def _attention_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], scale: float, before: int,
                   after: int, softcap: float, layout: str) -> tuple[Tensor, Tensor]:
    """Returns (o, lse): o in q's layout, lse fp32 [B, H, S_q] (varlen: [H, total])."""
    return _attention_fwd_launch(q, k, v, cu_seqlens, scale, before, after, softcap, layout)


@triton_op("onepass::attention_bwd")
def _attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Optional[Tensor],
                   cu_seqlens: Optional[Tensor], scale: float, before: int, after: int, softcap: float,
                   layout: str) -> tuple[Tensor, Tensor, Tensor]:
    return _attention_bwd_launch(do, q, k, v, o, lse, dlse, cu_seqlens, scale, before, after, softcap, layout)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, scale, before, after, softcap, layout = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.args = (scale, before, after, softcap, layout)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dlse):
    first_order_only("attention")
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    if do is None:  # only the LSE was used
        do = torch.zeros_like(o)
    dq, dk, dv = route(_attention_bwd, _attention_bwd_launch, q)(do, q, k, v, o, lse, dlse, cu_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
_attention_fwd_eager = eager_autograd(_attention_fwd_launch, _setup_context, _backward)


# ---------------------------------------------------------------- public function


def _check(q, k, v, scale, window, softcap, layout, cu_seqlens):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    check_same_device(q=q, k=k, v=v, cu_seqlens=cu_seqlens)
    if cu_seqlens is not None:
        if layout != "bshd" or q.dim() != 3:
            raise ValueError("with cu_seqlens, q, k and v are packed [total, heads, head_dim] (layout='bshd'), "
                             f"got layout={layout!r} and q of shape {tuple(q.shape)}")
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
                or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D int32 tensor [n_seqs + 1] of cumulative lengths")
        if not q.shape[0] == k.shape[0] == v.shape[0]:
            raise ValueError(f"packed q, k and v must have one total length, got {q.shape[0]}, {k.shape[0]}, "
                             f"{v.shape[0]}")
        if cu_seqlens.device.type == "cpu" and not tracing(cu_seqlens):  # (on a GPU, reading it would sync)
            offsets = cu_seqlens.tolist()
            if offsets[0] != 0 or offsets[-1] != q.shape[0] or offsets != sorted(offsets):
                raise ValueError(f"cu_seqlens must go from 0 to the total length {q.shape[0]} without decreasing, "
                                 f"got {offsets}")
    elif q.dim() != 4:
        raise ValueError(f"q must be 4-D [{', '.join(layout.upper())}], got shape {tuple(q.shape)}")
    if k.shape != v.shape or k.dim() != q.dim():
        raise ValueError(f"k and v must have one shape of q's rank, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    head_axis = 2 if cu_seqlens is None and layout == "bshd" else 1
    if cu_seqlens is None and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have one batch size, got {q.shape[0]} and {k.shape[0]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k must have one head dim, got {q.shape[-1]} and {k.shape[-1]}")
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be 1 to {MAX_HEAD_DIM}, got {q.shape[-1]}")
    hq, hk = q.shape[head_axis], k.shape[head_axis]
    if hk == 0 or hq % hk:
        raise ValueError(f"the number of q heads ({hq}) must be a multiple of the number of k/v heads ({hk})")
    check_softcap(softcap)
    check_scale(scale)
    if window is not None:
        pair = isinstance(window, (tuple, list)) and len(window) == 2
        sides = (window,) if is_int(window) else tuple(window) if pair else ()
        if is_int(window) and window < 1 or not sides \
                or any(s is not None and (not is_int(s) or s < -1) for s in sides):
            raise ValueError(f"window must be an int >= 1 or a (left, right) pair of ints >= 0 (or None), "
                             f"got {window!r}")


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None,
              window: int | tuple[int | None, int | None] | None = None, softcap: float | None = None,
              layout: str = "bhsd", cu_seqlens: Tensor | None = None, return_lse: bool = False):
    """Fused attention, like ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
    enable_gqa=True)``, without ever writing the [S_q, S_k] scores.

    q: [B, H, S_q, D] (``layout="bshd"``: [B, S_q, H, D]); k, v: the same with H_k heads
    (H a multiple of H_k: grouped- and multi-query attention without repeating k and v)
    and S_k keys. D up to 256; fp16 / bf16 (fp32 too, used by the tests).

    - ``causal``: queries aligned to the END of the keys (FlashAttention's convention;
      equal to SDPA's when S_q == S_k): query i sees keys up to i + S_k - S_q.
    - ``window``: sliding-window attention. ``W`` (int): the query and the W - 1 keys before
      it (and after it, without causal), as Mistral / Gemma's ``sliding_window``;
      ``(left, right)``: FlashAttention's ``window_size`` (None or -1: unbounded side).
    - ``softcap``: logits soft-capping ``c * tanh(s / c)`` (Gemma 2), with its derivative.
    - ``cu_seqlens``: variable-length packed sequences: q, k, v are [total, H, D] and
      sequence i holds rows cu_seqlens[i]:cu_seqlens[i+1] (int32, cu_seqlens[-1] == total),
      each attending only within itself; ``layout`` must be "bshd". Checked on the CPU; a
      GPU tensor is not read on the host (no sync), so offsets that break this there leave
      the rows they do not cover unwritten.
    - ``return_lse``: also return the log-sum-exp of the scores, fp32 [B, H, S_q]
      ([H, total] with cu_seqlens), differentiable too.

    A query that sees no key gets a zero output (LSE -inf). The backward gives dq, dk, dv.
    Unlike SDPA it takes ``causal`` (SDPA's ``is_causal``) and no ``attn_mask`` or dropout:
    masks are the causal, window and cu_seqlens structures above, applied inside the kernel.
    """
    _check(q, k, v, scale, window, softcap, layout, cu_seqlens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not use_triton_dot(q):
        return reference.attention(q, k, v, causal, scale, window, softcap, layout, cu_seqlens, return_lse)
    before, after = window_bounds(causal, window)
    o, lse = route(_attention_fwd, _attention_fwd_launch, q, k, v, autograd=_attention_fwd_eager)(
        q, k, v, cu_seqlens, scale, before, after, float(softcap or 0.0), layout)
    return (o, lse) if return_lse else o
