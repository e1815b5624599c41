"""Attention's forward on Hopper (sm_90), written in Gluon: FlashAttention-3's structure, for the calls it covers.

Why a second forward: Triton's ``tl`` language leaves the wgmma waits and the warps' roles to the compiler,
which waits for each q k^T as soon as it is issued and runs every warp in lockstep, so the exponentials and
the tensor cores take turns (a loop issuing the next tile's q k^T early compiled to the same waits and ran
slower: results/h200/attention_gluon_fwd.log). Gluon (``triton.experimental.gluon``) states both:

- one program a (batch, head, block of 128 queries), in three partitions (``gl.warp_specialize``): a producer
  warp that loads the Q tile and a ring of STAGES K and V tiles through TMA, and two consumer warpgroups, for
  query rows [0, 64) and [64, 128), each releasing a K/V stage when done with it;
- a consumer issues tile j's q k^T before tile j-1's P V and waits for the q k^T alone (one wgmma group left
  outstanding), so tile j's softmax runs while P V does; the two consumers, separate partitions, never wait
  for each other, and one's softmax runs under the other's matmuls (one partition of 8 warps, in lockstep, gained
  much less: the log).

The output and the natural-log LSE are the portable kernel's, so its backward is unchanged. Calls covered
(attention's launcher, then ``forward``): a CUDA device of compute capability 9 with a Triton of
attention.GLUON_TRITONS, 16-bit q/k/v, a head dim and mask in GLUON_FWD, no window, softcap or varlen, as many
queries as keys, sequences of whole BLOCK tiles, untraced (torch can't capture the host tensor descriptors), at
least attention.TMA_MIN_FLOPS, and q, k, v whose [S, D] rows lie as TMA can address them (``rows_2d``).
Gluon kernels do not run in Triton's interpreter: CI compiles this one for sm_90 (tests/ops/_compile_sm90.py),
and tests/ops/test_attention.py checks it against the float64 reference and the portable kernel on a GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from onepass.ops.dispatch import launch

# (head dim, causal) pairs this forward runs: where it beat the portable kernel (attention_gluon_fwd.log); at head
# dim 64 under a causal mask it was slower (S 2048: most query blocks see few key tiles).
GLUON_FWD = {(64, False), (128, False), (128, True)}
BLOCK = 128  # queries a program (64 a consumer warpgroup) and keys a tile
STAGES = 3  # K/V tiles in flight; 3 of [128, 128] 16-bit K and V tiles and Q fill 224 KiB of shared memory
CONSUMER_REGS = 232  # a consumer warp's registers (setmaxnreg); the producer warp takes 24
LOG2E = gl.constexpr(1.4426950408889634)
# a barrier of the calling partition's warps: gl.thread_barrier in Triton 3.6, gl.barrier from 3.7
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, q_row, q_col, kv_row,
              kv_col, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem)
    for t in range(n_tiles):
        stage = t % STAGES
        # the stage's previous tile (t - STAGES) released by both consumers
        mbarrier.wait(kv_empty.index(stage), ((t // STAGES) - 1) & 1, pred=t >= STAGES)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + t * BLOCK_N, kv_col], k_ready.index(stage),
                                        k_smem.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + t * BLOCK_N, kv_col], v_ready.index(stage),
                                        v_smem.index(stage))


@gluon.jit
def _softmax_tile(s, m_i, l_i, qk_scale, rows, tile_start, MASK: gl.constexpr, BLOCK_N: gl.constexpr,
                  s_layout: gl.constexpr):
    """One tile's online-softmax step in base 2: (p, new row max, new row sum, rescale of the old sums)."""
    s = s * qk_scale
    if MASK:  # causal, queries aligned to keys: a row keeps the keys at or before its position
        cols = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _step(j, q_smem, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, o, p_op, m_i, l_i, rows, qk_scale,
          MASK: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
          o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Tile j's q k^T, issued before tile j-1's P V; tile j's softmax while P V runs; then tile j-1's stage
    released."""
    stage = j % STAGES
    mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    prev = (j - 1) % STAGES
    mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p_op, v_smem.index(prev), o, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, rows, j * BLOCK_N, MASK, BLOCK_N, s_layout)
    o = warpgroup_mma_wait(0, deps=(o_tok, ))
    _barrier()  # the warpgroup's 4 warps are done with tile j-1's K and V: one arrival for all
    mbarrier.arrive(kv_empty.index(prev))
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return o, gl.convert_layout(p.to(p_op.dtype), p_layout), m_i, l_i


@gluon.jit
def _consumer(o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, o_row, o_col, lse_row,
              m_block, n_tiles, qk_scale, HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """Query rows [HALF * BLOCK_M / 2, ...) of the block: the online softmax over its key tiles, then O and LSE."""
    WG_M: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    my_q = q_smem.slice(HALF * WG_M, WG_M)
    rows = m_block * BLOCK_M + HALF * WG_M + gl.arange(0, WG_M, layout=row_layout)
    m_i = gl.full([WG_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([WG_M], gl.float32, layout=row_layout)
    o = gl.zeros([WG_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=s_layout)
    if CAUSAL:  # tiles [0, n_full) lie wholly before these rows: no mask
        n_full = (m_block * BLOCK_M + HALF * WG_M) // BLOCK_N
    else:
        n_full = n_tiles

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(my_q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    if n_full == 0:
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, rows, 0, True, BLOCK_N, s_layout)
    else:
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, rows, 0, False, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    for j in range(1, n_full):
        o, p_op, m_i, l_i = _step(j, my_q, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, o, p_op, m_i, l_i,
                                  rows, qk_scale, False, BLOCK_N, STAGES, s_layout, o_layout, p_layout)
    if CAUSAL:  # (separate loops: the mask's registers stay out of the unmasked one)
        for j in range(gl.maximum(n_full, 1), n_tiles):
            o, p_op, m_i, l_i = _step(j, my_q, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, o, p_op, m_i,
                                      l_i, rows, qk_scale, True, BLOCK_N, STAGES, s_layout, o_layout, p_layout)
    last = n_tiles - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    o_tok = warpgroup_mma(p_op, v_smem.index(last % STAGES), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o_tok, ))

    o = o / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    my_q.store(o.to(dtype))  # (this warpgroup's Q rows, read by its own finished matmuls only)
    fence_async_shared()
    _barrier()
    tma.async_copy_shared_to_global(o_desc, [o_row + HALF * WG_M, o_col], my_q)
    gl.store(lse_ptr + lse_row + rows, (m_i + gl.log2(l_i)) / LOG2E)
    tma.store_wait(0)


@gluon.jit
def _attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, seqlen, n_heads, group, qk_scale,
                     q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, o_rb, o_rh, o_ch,
                     HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    n_blocks = seqlen // BLOCK
    if CAUSAL:  # grid (heads, blocks): every head's heaviest (last) block first
        bh = gl.program_id(0)
        m_block = n_blocks - 1 - gl.program_id(1)
        n_tiles = m_block + 1
    else:
        m_block = gl.program_id(0)
        bh = gl.program_id(1)
        n_tiles = n_blocks
    b = bh // n_heads
    h = bh % n_heads
    hk = h // group
    # a tile of (b, h, rows s...) sits at row b * rb + h * rh + s, column h * ch of its tensor's 2-D view (rows_2d)
    start = m_block * BLOCK
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # one arrival a consumer warpgroup
    o_row = b * o_rb + h * o_rh + start
    gl.warp_specialize([
        (_consumer, (o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, o_row, h * o_ch,
                     bh * seqlen, m_block, n_tiles, qk_scale, 0, HEAD_DIM, BLOCK, BLOCK, STAGES, CAUSAL)),
        (_consumer, (o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, o_row, h * o_ch,
                     bh * seqlen, m_block, n_tiles, qk_scale, 1, HEAD_DIM, BLOCK, BLOCK, STAGES, CAUSAL)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                     b * q_rb + h * q_rh + start, h * q_ch, b * k_rb + hk * k_rh, hk * k_ch, n_tiles, BLOCK, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


def rows_2d(t: Tensor) -> tuple[Tensor, int, int, int] | None:
    """``t`` (a [B, H, S, D] view, unit stride along D) as the 2-D tensor TMA reads, with where (b, h, s) lies in
    it: (view, rb, rh, ch), row b * rb + h * rh + s and column h * ch. Rows of (b, h, s) evenly spaced ([B, H, S, D]
    memory) make [B*H*S, D]; rows of (b, s) holding every head ([B, S, H, D] memory: a "bshd" call, the transposed
    projections a transformer layer passes, a slice of a fused q/k/v projection) make [B*S, ...]. None for other
    strides, and where TMA cannot address the rows (16-byte aligned base and row stride)."""
    B, H, S, D = t.shape
    sb, sh, ss, sd = t.stride()
    if sd != 1 or t.data_ptr() % 16 or ss * t.element_size() % 16:
        return None
    if sh == S * ss and ss >= D and (B == 1 or sb == H * sh):
        return t.as_strided((B * H * S, D), (ss, 1)), H * S, S, 0
    if sh >= D and (H - 1) * sh + D <= ss and (B == 1 or sb == S * ss):
        return t.as_strided((B * S, (H - 1) * sh + D), (ss, 1)), S, 0, sh
    return None


def forward(views: tuple[Tensor, ...], o: Tensor, lse: Tensor, scale: float, causal: bool) -> bool:
    """Write o ([B, H, S, D] view of a new output) and lse [B, H, S] from the [B, H, S, D] views of q, k, v, and
    return True, for a call this forward covers beyond what attention's launcher checked (device, dtype, mask,
    varlen, size, tracing): the head dim and mask, whole tiles, as many queries as keys, the views' strides, k and v
    laid out alike (one set of coordinates). Else False, nothing written."""
    q, k, v = views
    B, H, S, D = q.shape
    if (D, causal) not in GLUON_FWD or S % BLOCK or k.shape[2] != S:
        return False
    at = [rows_2d(t) for t in (q, k, v, o)]
    if None in at or at[1][1:] != at[2][1:]:
        return False
    (q2, *q_at), (k2, *k_at), (v2, _, _, _), (o2, *o_at) = at
    element = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK, D], element)
    half = gl.NVMMASharedLayout.get_default_for([BLOCK // 2, D], element)
    descriptors = [TensorDescriptor(t, list(t.shape), list(t.stride()), [BLOCK, D], layout) for t in (q2, k2, v2)]
    descriptors.append(TensorDescriptor(o2, list(o2.shape), list(o2.stride()), [BLOCK // 2, D], half))
    grid = (B * H, S // BLOCK) if causal else (S // BLOCK, B * H)
    launch(_attn_fwd_hopper_kernel, grid, *descriptors, lse, S, H, H // k.shape[1], scale * LOG2E.value, *q_at, *k_at,
           *o_at, HEAD_DIM=D, BLOCK=BLOCK, STAGES=STAGES, CAUSAL=causal, CONSUMER_REGS=CONSUMER_REGS, num_warps=4)
    return True
