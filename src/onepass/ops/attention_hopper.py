"""Attention on Hopper (sm_90), written in Gluon: FlashAttention-3's structure, for the calls it covers.

Why second kernels: Triton's ``tl`` language leaves the wgmma waits and the warps' roles to the compiler,
which waits for each q k^T as soon as it is issued and runs every warp in lockstep, so the exponentials and
the tensor cores take turns (a loop issuing the next tile's q k^T early compiled to the same waits and ran
slower: results/h200/attention_gluon_fwd.log). Gluon (``triton.experimental.gluon``) states both:

- forward: one program a (batch, head, block of 128 queries), or one an SM taking such items from a counter
  (PERSISTENT_TILES), in three partitions (``gl.warp_specialize``): a producer warp that loads the Q tile and a
  ring of STAGES K and V tiles through TMA, and two consumer warpgroups, for query rows [0, 64) and [64, 128), each
  releasing a K/V stage when done with it;
- a consumer issues tile j's q k^T before tile j-1's P V and waits for the q k^T alone (one wgmma group left
  outstanding), so tile j's softmax runs while P V does; the two consumers, separate partitions, never wait
  for each other, and one's softmax runs under the other's matmuls (one partition of 8 warps, in lockstep, gained
  much less: the log);
- backward, the portable kernels' split (no atomics): a dQ kernel over query blocks (Q and dO loaded once, a ring
  of K/V tiles), which first stores delta = rowsum(dO * O) - dLSE, then a dK/dV kernel over key blocks (K and V
  loaded once, a ring of Q/dO tiles of every q head of the kv group); each the forward's partitions, a tile's two
  score-shaped matmuls issued together and the softmax terms of the first computed while the second runs
  (results/h200/attention_gluon_bwd.log).

Under a causal mask every kernel's programs run in the portable kernels' order: chunks of heads whose tiles fit in
L2 together, in a chunk the heaviest blocks first (_causal_item).
The output and the natural-log LSE are the portable kernel's: either backward follows either forward. Calls covered
(attention's launcher, then ``forward``/``backward``): a CUDA device of compute capability 9 with a Triton of
attention.GLUON_TRITONS, 16-bit q/k/v, a head dim and mask in GLUON_FWD (GLUON_BWD), the causal mask with or without
a window (a query sees its own key and the ``before`` keys before it: Mistral's, Gemma's), with or without a
softcap, no varlen, as many queries as keys, sequences of whole BLOCK tiles, untraced (torch can't capture the host
tensor descriptors), at least attention.TMA_MIN_FLOPS (the backward: GLUON_BWD_MIN_FLOPS), and tensors whose [S, D]
rows lie as TMA can address them (``rows_2d``).
Gluon kernels do not run in Triton's interpreter: CI compiles them for sm_90 (tests/ops/_compile_sm90.py),
and tests/ops/test_attention.py checks them against the float64 reference and the portable kernel on a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
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

from onepass.ops.attention import chunk_heads
from onepass.ops.dispatch import cdiv, launch, num_programs_for

# (head dim, causal) pairs this forward runs: where it beat the portable kernel or tied (attention_gluon_fwd.log; at
# head dim 64 under a causal mask only since its programs are persistent, run 5).
GLUON_FWD = {(64, False), (64, True), (128, False), (128, True)}
# Causal windows (a query and the keys before it) of fewer keys than this run the portable forward: at head dim 64 its
# smaller key tiles waste less of a narrow window's two masked edges; from this width on the Gluon forward led, and at
# head dim 128 at every width timed (results/h200/attention_gluon_window.log, runs 1-3).
GLUON_MIN_WINDOW = {64: 384}
BLOCK = 128  # queries a program (64 a consumer warpgroup) and keys a tile
# The forward's (K/V stages, Q buffers) by head dim: at 128, 3 stages of [128, 128] 16-bit K and V tiles and one Q
# tile fill 224 KiB of shared memory; at 64 a second Q buffer fits, and an item's Q loads while the last one's O is
# stored out of the other.
FWD_BUFFERS = {64: (3, 2), 128: (3, 1)}
# The forward's programs loop over work items, one program an SM (persistent), where two Q buffers fit or an item's
# mean key tiles are at most PERSISTENT_TILES: an item's first loads then overlap the last one's epilogue, which short
# items pay for most. Longer ones with one Q buffer gained nothing consistent from it; up to this bound
# persistent programs win once items come from a counter (before, a fixed order balanced uneven causal items worse
# than the hardware's scheduler): results/h200/attention_fwd_persistent.log.
PERSISTENT_TILES = 32
CONSUMER_REGS = 232  # a consumer warp's registers (setmaxnreg); the producer warp takes 24
# (head dim, causal) pairs the backward runs, and its kernels' (BLOCK_M queries, BLOCK_N keys, STAGES): the fastest
# of a sweep at every shape timed but one (attention_gluon_bwd.log). At head dim 64 they were slower than the
# portable kernels but on small grids (SMALL_GRID_BWD).
GLUON_BWD = {(128, False), (128, True)}
# Head dims whose backward runs here only where the dK/dV grid has under two programs an SM (group_shares splits it;
# the portable kernels' grid is as short there): at 64, 1.5-2x faster there than the portable kernels, 1-7% slower
# on larger grids (results/h200/attention_d64_gluon_bwd.log).
SMALL_GRID_BWD = {64}
DQ_SETTING = (128, 128, 2)
DKDV_SETTING = (64, 128, 2)
# A grid of few dK/dV programs splits each kv group's q heads between programs (group_shares), which store fp32
# partial sums that a second launch adds (SUM_ROWS rows a program). The cost model weighs their traffic at the H200's
# bf16 matmul rate over its copy bandwidth (709 TFLOP/s / 4.2 TB/s, results/h200/attention.md).
MATMUL_FLOPS_PER_BYTE = 170
SUM_ROWS = 16
LOG2E = gl.constexpr(1.4426950408889634)
# a barrier of the calling partition's warps: gl.thread_barrier in Triton 3.6, gl.barrier from 3.7
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.constexpr_function
def _wgmma_layout(n):
    """The registers of a warpgroup's [64, n] fp32 wgmma result (its 4 warps along the rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _operand_layout(acc_layout):
    """A 16-bit wgmma A operand held in registers, for a result of ``acc_layout``."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)


@gluon.jit
def _causal_item(w, n_bh, n_blocks, chunk_heads, HEAVY_FIRST_BLOCK: gl.constexpr):
    """Item w's (batch * heads index, block) under a causal mask, in the portable kernels' order (attention._locate):
    chunks of ``chunk_heads`` heads (attention.chunk_heads), and in a chunk block by block across its heads, each
    head's heaviest block (the last query block; for a key block, the first) first. The programs that run together
    then share the tiles of a chunk's heads in L2, not one head's each."""
    first = w // (chunk_heads * n_blocks) * chunk_heads
    heads = gl.minimum(chunk_heads, n_bh - first)
    i = w - first * n_blocks
    block = i // heads
    if not HEAVY_FIRST_BLOCK:
        block = n_blocks - 1 - block
    return first + i % heads, block


@gluon.jit
def _work_item(w, n_bh, n_blocks, chunk_heads, CAUSAL: gl.constexpr):
    """Work item w's (batch * heads index, query block): causal, _causal_item; full, one head's blocks in a row (its
    K and V stay in L2)."""
    if CAUSAL:
        bh, m_block = _causal_item(w, n_bh, n_blocks, chunk_heads, False)
    else:
        bh = w // n_blocks
        m_block = w % n_blocks
    return bh, m_block


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, item_smem, q_ready, q_empty, k_ready, v_ready,
              kv_empty, next_item, n_items, n_bh, chunk_heads, n_heads, group, seqlen, before, q_rb, q_rh, q_ch, k_rb,
              k_rh, k_ch, BLOCK: gl.constexpr, STAGES: gl.constexpr, Q_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr,
              WINDOW: gl.constexpr, PERSISTENT: gl.constexpr):
    """This program's items in turn (its first the program's index; persistent, each next one taken from the
    ``next_item`` counter as the last one's tiles are issued, so programs that drew light items take more): each
    one's index and Q tile, into a buffer its consumers have stored the O of an earlier item from, and its K/V tiles
    into the ring, which runs on across items (the next item's first tiles load while the consumers finish the
    last). With one Q buffer, Q is loaded after the item's first STAGES K/V tiles: the consumers free it only once
    the previous item's O is stored. Then an index past the items, which ends the consumers' loops."""
    n_blocks = seqlen // BLOCK
    t = 0  # the ring's position: K/V tiles loaded so far
    n = 0  # items so far
    w = gl.program_id(0)
    while w < n_items:
        bh, m_block = _work_item(w, n_bh, n_blocks, chunk_heads, CAUSAL)
        b = bh // n_heads
        h = bh % n_heads
        hk = h // group
        if CAUSAL:
            n_tiles = m_block + 1
        else:
            n_tiles = n_blocks
        lo = _first_tile(m_block * BLOCK, before, BLOCK, WINDOW)
        if Q_BUFFERS == 1:  # K/V tiles loaded before Q
            q_at = gl.minimum(lo + STAGES, n_tiles)
        else:
            q_at = lo
        for j in range(lo, n_tiles):
            if j == q_at:
                _load_q(q_desc, q_smem, item_smem, q_ready, q_empty, n, w, b * q_rb + h * q_rh + m_block * BLOCK,
                        h * q_ch, Q_BUFFERS)
            stage = t % STAGES
            # the stage's previous tile (t - STAGES) released by both consumers
            mbarrier.wait(kv_empty.index(stage), ((t // STAGES) - 1) & 1, pred=t >= STAGES)
            row = b * k_rb + hk * k_rh + j * BLOCK
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, hk * k_ch], k_ready.index(stage), k_smem.index(stage))
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, hk * k_ch], v_ready.index(stage), v_smem.index(stage))
            t += 1
        if q_at == n_tiles:
            _load_q(q_desc, q_smem, item_smem, q_ready, q_empty, n, w, b * q_rb + h * q_rh + m_block * BLOCK,
                    h * q_ch, Q_BUFFERS)
        n += 1
        if PERSISTENT:
            w = gl.num_programs(0) + gl.atomic_add(next_item, 1, sem="relaxed")
        else:
            w += gl.num_programs(0)
    _put_item(item_smem, q_empty, n, w, Q_BUFFERS)
    mbarrier.arrive(q_ready.index(n % Q_BUFFERS))


@gluon.jit
def _put_item(item_smem, q_empty, n, w, Q_BUFFERS: gl.constexpr):
    """Item n's index w into its Q buffer's slot, once the buffer's previous item (n - Q_BUFFERS) has had its O
    stored (its consumers read the slot at that item's start)."""
    buf = n % Q_BUFFERS
    mbarrier.wait(q_empty.index(buf), ((n // Q_BUFFERS) - 1) & 1, pred=n >= Q_BUFFERS)
    item_smem.index(buf).store(gl.full([1], w, gl.int32, layout=gl.BlockedLayout([1], [32], [1], [0])))


@gluon.jit
def _load_q(q_desc, q_smem, item_smem, q_ready, q_empty, n, w, row, col, Q_BUFFERS: gl.constexpr):
    """Item n's index w and Q tile (_put_item), seen by the consumers together on the buffer's q_ready."""
    _put_item(item_smem, q_empty, n, w, Q_BUFFERS)
    buf = n % Q_BUFFERS
    mbarrier.expect(q_ready.index(buf), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(buf), q_smem.index(buf))


@gluon.jit
def _take_item(item_smem, q_ready, n, Q_BUFFERS: gl.constexpr):
    """A consumer's item n: its index, once its Q tile is in (or an index past the items, the end)."""
    buf = n % Q_BUFFERS
    mbarrier.wait(q_ready.index(buf), (n // Q_BUFFERS) & 1)
    return gl.max(item_smem.index(buf).load(gl.BlockedLayout([1], [32], [4], [0])), axis=0)


@gluon.jit
def _seen(queries, keys, before, WINDOW: gl.constexpr):
    """Whether a query sees a key, queries aligned to keys: causal, and with WINDOW only the ``before`` keys before
    the query's own (attention's (before, 0) window)."""
    seen = keys <= queries
    if WINDOW:
        seen = seen & (keys >= queries - before)
    return seen


@gluon.jit
def _first_tile(first_query, before, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr):
    """The first key tile a block of queries from ``first_query`` on sees: 0, or with WINDOW the first holding a key
    of its first query's window."""
    if WINDOW:
        return gl.maximum(first_query - before, 0) // BLOCK_N
    else:
        return 0


@gluon.jit
def _window_full(last_query, before, n_tiles, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr):
    """With WINDOW, the first key tile (at most n_tiles) none of whose keys lie before the window of a query up to
    ``last_query``: the tiles before it need the mask. Else 0."""
    if WINDOW:
        return gl.minimum((gl.maximum(last_query - before, 0) + BLOCK_N - 1) // BLOCK_N, n_tiles)
    else:
        return 0


@gluon.jit
def _scores(s, qk_scale, cap, SOFTCAP: gl.constexpr):
    """Raw q k^T products as scores in log2 units, and what the backward's softcap term needs: s * qk_scale; with
    SOFTCAP cap * tanh(s * qk_scale) and the tanh (the host passes qk_scale = scale / softcap, cap = softcap * log2 e).
    The tanh is the hardware's approximation (one MUFU operation, relative error about 2^-11, FlashAttention-3's
    choice), not the portable kernels' exp2 and division, which left the softcapped forward MUFU-bound
    (results/h200/attention_gluon_window.log, runs 4-5); forward and backward compute it alike, so the backward's P
    matches the forward's LSE."""
    if SOFTCAP:
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [s * qk_scale], dtype=gl.float32,
                                      is_pure=True, pack=1)
        return t * cap, t
    else:
        return s * qk_scale, s


@gluon.jit
def _softmax_tile(s, m_i, l_i, qk_scale, cap, rows, tile_start, before, MASK: gl.constexpr, WINDOW: gl.constexpr,
                  SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One tile's online-softmax step in base 2: (p, new row max, new row sum, rescale of the old sums)."""
    s, _ = _scores(s, qk_scale, cap, SOFTCAP)
    if MASK:
        cols = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(_seen(gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), before, WINDOW), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    if MASK and WINDOW:  # a row may have seen no key yet (its window starts in a later tile): no -inf - -inf
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(s - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _step(r, j, q_smem, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, o, p_op, m_i, l_i, rows, qk_scale, cap,
          before, MASK: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Tile j's (the ring's tile r) q k^T, issued before tile j-1's P V; tile j's softmax while P V runs; then tile
    j-1's stage released."""
    stage = r % STAGES
    mbarrier.wait(k_ready.index(stage), (r // STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    prev = (r - 1) % STAGES
    mbarrier.wait(v_ready.index(prev), ((r - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p_op, v_smem.index(prev), o, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, cap, rows, j * BLOCK_N, before, MASK, WINDOW, SOFTCAP,
                                       BLOCK_N, s_layout)
    o = warpgroup_mma_wait(0, deps=(o_tok, ))
    _barrier()  # the warpgroup's 4 warps are done with tile j-1's K and V: one arrival for all
    mbarrier.arrive(kv_empty.index(prev))
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return o, gl.convert_layout(p.to(p_op.dtype), p_layout), m_i, l_i


@gluon.jit
def _consumer(o_desc, lse_ptr, q_smem, k_smem, v_smem, item_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
              n_items, n_bh, chunk_heads, n_heads, seqlen, before, qk_scale, cap, o_rb, o_rh, o_ch, HALF: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              Q_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr):
    """Query rows [HALF * BLOCK_M / 2, ...) of each of this program's items: the online softmax over the item's key
    tiles, then O and LSE."""
    WG_M: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = _operand_layout(o_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_zero = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=s_layout)
    n_blocks = seqlen // BLOCK_M
    t = 0  # the ring's position of the item's first tile
    n = 0  # items so far
    w = _take_item(item_smem, q_ready, 0, Q_BUFFERS)
    while w < n_items:
        bh, m_block = _work_item(w, n_bh, n_blocks, chunk_heads, CAUSAL)
        b = bh // n_heads
        h = bh % n_heads
        first = m_block * BLOCK_M + HALF * WG_M
        if CAUSAL:  # tiles before n_full lie wholly before these rows
            n_tiles = m_block + 1
            n_full = first // BLOCK_N
        else:
            n_tiles = n_blocks
            n_full = n_blocks
        # the item's tiles [lo, n_tiles); those before lower_full hold a key before some of these rows' windows
        lo = _first_tile(m_block * BLOCK_M, before, BLOCK_N, WINDOW)
        lower_full = _window_full(first + WG_M - 1, before, n_tiles, BLOCK_N, WINDOW)
        buf = n % Q_BUFFERS
        my_q = q_smem.index(buf).slice(HALF * WG_M, WG_M)
        rows = first + gl.arange(0, WG_M, layout=row_layout)
        m_i = gl.full([WG_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([WG_M], gl.float32, layout=row_layout)
        o = gl.zeros([WG_M, HEAD_DIM], gl.float32, layout=o_layout)

        mbarrier.wait(k_ready.index(t % STAGES), (t // STAGES) & 1)
        s = warpgroup_mma(my_q, k_smem.index(t % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        if CAUSAL and ((lo < lower_full) | (lo >= n_full)):
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, cap, rows, lo * BLOCK_N, before, True, WINDOW,
                                               SOFTCAP, BLOCK_N, s_layout)
        else:
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, cap, rows, lo * BLOCK_N, before, False, WINDOW,
                                               SOFTCAP, BLOCK_N, s_layout)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        # (separate loops: the mask's registers stay out of the unmasked one; ring position t + j - lo)
        if WINDOW:
            for j in range(lo + 1, lower_full):
                o, p_op, m_i, l_i = _step(t + j - lo, j, my_q, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, o,
                                          p_op, m_i, l_i, rows, qk_scale, cap, before, True, WINDOW, SOFTCAP, BLOCK_N,
                                          STAGES, s_layout, o_layout, p_layout)
        for j in range(gl.maximum(lo + 1, lower_full), n_full):
            o, p_op, m_i, l_i = _step(t + j - lo, j, my_q, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, o,
                                      p_op, m_i, l_i, rows, qk_scale, cap, before, False, WINDOW, SOFTCAP, BLOCK_N,
                                      STAGES, s_layout, o_layout, p_layout)
        if CAUSAL:
            for j in range(gl.maximum(gl.maximum(n_full, lower_full), lo + 1), n_tiles):
                o, p_op, m_i, l_i = _step(t + j - lo, j, my_q, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, o,
                                          p_op, m_i, l_i, rows, qk_scale, cap, before, True, WINDOW, SOFTCAP, BLOCK_N,
                                          STAGES, s_layout, o_layout, p_layout)
        n_seen = n_tiles - lo
        last = (t + n_seen - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((t + n_seen - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(last), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=(o_tok, ))
        _barrier()
        mbarrier.arrive(kv_empty.index(last))

        o = o / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
        my_q.store(o.to(dtype))  # (this warpgroup's Q rows, read by its own finished matmuls only)
        fence_async_shared()
        _barrier()
        tma.async_copy_shared_to_global(o_desc, [b * o_rb + h * o_rh + m_block * BLOCK_M + HALF * WG_M, h * o_ch],
                                        my_q)
        gl.store(lse_ptr + bh * seqlen + rows, (m_i + gl.log2(l_i)) / LOG2E)
        tma.store_wait(0)
        _barrier()  # the O tile is read out of the Q buffer: one arrival for the warpgroup
        mbarrier.arrive(q_empty.index(buf))
        t += n_seen
        n += 1
        w = _take_item(item_smem, q_ready, n, Q_BUFFERS)


@gluon.jit
def _attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, next_item, seqlen, n_heads, group, before,
                            qk_scale, cap, n_items, chunk_heads, q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, o_rb, o_rh, o_ch,
                            HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr,
                            Q_BUFFERS: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                            SOFTCAP: gl.constexpr, PERSISTENT: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Each program takes work items (batch, head, block of BLOCK queries): one, or PERSISTENT (PERSISTENT_TILES),
    its index's and then each one the ``next_item`` counter (zero at the launch) hands out, past the programs'
    first.
    A tile of (b, h, rows s...) sits at row b * rb + h * rh + s, column h * ch of its tensor's 2-D view (rows_2d)."""
    dtype: gl.constexpr = q_desc.dtype
    n_bh = n_items // (seqlen // BLOCK)
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFFERS, BLOCK, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    item_smem = gl.allocate_shared_memory(gl.int32, [Q_BUFFERS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival a consumer warpgroup
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    gl.warp_specialize([
        (_consumer, (o_desc, lse_ptr, q_smem, k_smem, v_smem, item_smem, q_ready, q_empty, k_ready, v_ready,
                     kv_empty, n_items, n_bh, chunk_heads, n_heads, seqlen, before, qk_scale, cap, o_rb, o_rh, o_ch,
                     0, HEAD_DIM, BLOCK, BLOCK, STAGES, Q_BUFFERS, CAUSAL, WINDOW, SOFTCAP)),
        (_consumer, (o_desc, lse_ptr, q_smem, k_smem, v_smem, item_smem, q_ready, q_empty, k_ready, v_ready,
                     kv_empty, n_items, n_bh, chunk_heads, n_heads, seqlen, before, qk_scale, cap, o_rb, o_rh, o_ch,
                     1, HEAD_DIM, BLOCK, BLOCK, STAGES, Q_BUFFERS, CAUSAL, WINDOW, SOFTCAP)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, item_smem, q_ready, q_empty, k_ready, v_ready,
                     kv_empty, next_item, n_items, n_bh, chunk_heads, n_heads, group, seqlen, before, q_rb, q_rh, q_ch,
                     k_rb, k_rh, k_ch, BLOCK, STAGES, Q_BUFFERS, CAUSAL, WINDOW, PERSISTENT)),
    ], [4, 1], [CONSUMER_REGS, 24])


@gluon.jit
def _program_block(n_blocks, chunk_heads, CAUSAL: gl.constexpr, HEAVY_FIRST_BLOCK: gl.constexpr):
    """(batch * heads index, block) of this program. Causal: grid (heads, blocks) read as a line, x first, in
    _causal_item's order; else grid (blocks, heads), one head's blocks in a row."""
    if CAUSAL:
        bh, block = _causal_item(gl.program_id(1) * gl.num_programs(0) + gl.program_id(0), gl.num_programs(0),
                                 n_blocks, chunk_heads, HEAVY_FIRST_BLOCK)
    else:
        bh = gl.program_id(1)
        block = gl.program_id(0)
    return bh, block


@gluon.jit
def _pair_buffers(a_desc, b_desc, c_desc, d_desc, FIXED_ROWS: gl.constexpr, RING_ROWS: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """_pair_producer's shared memory: tiles a and b, STAGES (c, d) pairs, and their barriers, initialized."""
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [FIXED_ROWS, HEAD_DIM], a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [FIXED_ROWS, HEAD_DIM], b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [STAGES, RING_ROWS, HEAD_DIM], c_desc.layout)
    d_smem = gl.allocate_shared_memory(dtype, [STAGES, RING_ROWS, HEAD_DIM], d_desc.layout)
    fixed_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(fixed_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival a consumer warpgroup
    return a_smem, b_smem, c_smem, d_smem, fixed_bar, ready, empty


@gluon.jit
def _pair_producer(a_desc, b_desc, c_desc, d_desc, a_smem, b_smem, c_smem, d_smem, fixed_bar, ready, empty,
                   a_row, a_col, b_row, b_col, c_row, c_col, c_round_row, c_round_col, d_row, d_col, d_round_row,
                   d_round_col, n_rounds, lo, hi, BLOCK_RING: gl.constexpr, STAGES: gl.constexpr):
    """The backward's loads: tiles a and b once (fixed_bar), then a ring of STAGES (c, d) tile pairs, for each round
    r < n_rounds (a kv group's q heads) and tile i in [lo, hi), from (row + r * round_row + i * BLOCK_RING,
    col + r * round_col)."""
    mbarrier.expect(fixed_bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [a_row, a_col], fixed_bar, a_smem)
    tma.async_copy_global_to_shared(b_desc, [b_row, b_col], fixed_bar, b_smem)
    t = 0
    for r in range(n_rounds):
        for i in range(lo, hi):
            stage = t % STAGES
            mbarrier.wait(empty.index(stage), ((t // STAGES) - 1) & 1, pred=t >= STAGES)
            mbarrier.expect(ready.index(stage), c_desc.block_type.nbytes + d_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(c_desc, [c_row + r * c_round_row + i * BLOCK_RING, c_col + r * c_round_col],
                                            ready.index(stage), c_smem.index(stage))
            tma.async_copy_global_to_shared(d_desc, [d_row + r * d_round_row + i * BLOCK_RING, d_col + r * d_round_col],
                                            ready.index(stage), d_smem.index(stage))
            t += 1


@gluon.jit
def _dq_tile(r, j, q_wg, do_wg, k_smem, v_smem, ready, empty, dq, rows, lse, delta, qk_scale, cap, before,
             MASK: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, WG_M: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr):
    """Key tile j's (the ring's tile r) share of the warpgroup's dQ: s = q k^T and dp = dO v^T issued together, p
    while dp runs."""
    stage = r % STAGES
    mbarrier.wait(ready.index(stage), (r // STAGES) & 1)
    k_tile = k_smem.index(stage)
    zero = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=s_layout)
    s_tok = warpgroup_mma(q_wg, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do_wg, v_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    s, tanh_s = _scores(s, qk_scale, cap, SOFTCAP)
    s = s - gl.expand_dims(lse, 1)
    if MASK:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(_seen(gl.expand_dims(rows, 1), gl.expand_dims(cols, 0), before, WINDOW), s, float("-inf"))
    p = gl.exp2(s)
    dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
    ds = p * (dp - gl.expand_dims(delta, 1))
    if SOFTCAP:
        ds *= 1.0 - tanh_s * tanh_s  # d(softcap tanh(scale x / softcap)) / dx, over the scale applied at the end
    dq_tok = warpgroup_mma(gl.convert_layout(ds.to(k_tile.dtype), op_layout), k_tile, dq, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
    _barrier()  # the warpgroup's 4 warps are done with the stage's K and V: one arrival for all
    mbarrier.arrive(empty.index(stage))
    return dq


@gluon.jit
def _dq_consumer(dq_desc, o_ptr, lse_ptr, dlse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, fixed_bar, ready,
                 empty, dq_row, dq_col, o_base, o_ss, stats_row, m_block, lo, n_tiles, before, qk_scale, cap, scale,
                 HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
                 HAS_DLSE: gl.constexpr):
    """Query rows [HALF * BLOCK_M / 2, ...) of the block: their delta = rowsum(dO * O) - dLSE (stored for the dK/dV
    kernel), then dQ over their key tiles."""
    WG_M: gl.constexpr = BLOCK_M // 2
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    op_layout: gl.constexpr = _operand_layout(acc_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_wg = q_smem.slice(HALF * WG_M, WG_M)
    do_wg = do_smem.slice(HALF * WG_M, WG_M)
    first = m_block * BLOCK_M + HALF * WG_M
    rows = first + gl.arange(0, WG_M, layout=row_layout)
    lse = gl.load(lse_ptr + stats_row + rows) * LOG2E
    acc_rows = first + gl.arange(0, WG_M, layout=gl.SliceLayout(1, acc_layout))
    d_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    o = gl.load(o_ptr + o_base + gl.expand_dims(acc_rows.to(gl.int64) * o_ss, 1) + gl.expand_dims(d_cols, 0))
    mbarrier.wait(fixed_bar, 0)
    delta = gl.sum(o.to(gl.float32) * do_wg.load(acc_layout).to(gl.float32), 1)
    if HAS_DLSE:
        delta -= gl.load(dlse_ptr + stats_row + acc_rows)
    gl.store(delta_ptr + stats_row + acc_rows, delta)
    delta = gl.convert_layout(delta, row_layout)
    dq = gl.zeros([WG_M, HEAD_DIM], gl.float32, layout=acc_layout)
    if CAUSAL:  # key tiles from n_full on hold a key after some of these rows
        n_full = first // BLOCK_N
    else:
        n_full = n_tiles
    # the block's tiles [lo, n_tiles); those before lower_full hold a key before some of these rows' windows
    lower_full = _window_full(first + WG_M - 1, before, n_tiles, BLOCK_N, WINDOW)
    # (separate loops: the mask's registers stay out of the unmasked one; ring position j - lo)
    if WINDOW:
        for j in range(lo, lower_full):
            dq = _dq_tile(j - lo, j, q_wg, do_wg, k_smem, v_smem, ready, empty, dq, rows, lse, delta, qk_scale, cap,
                          before, True, WINDOW, SOFTCAP, WG_M, BLOCK_N, STAGES, s_layout, op_layout)
    for j in range(gl.maximum(lo, lower_full), n_full):
        dq = _dq_tile(j - lo, j, q_wg, do_wg, k_smem, v_smem, ready, empty, dq, rows, lse, delta, qk_scale, cap, before,
                      False, WINDOW, SOFTCAP, WG_M, BLOCK_N, STAGES, s_layout, op_layout)
    if CAUSAL:
        for j in range(gl.maximum(gl.maximum(n_full, lower_full), lo), n_tiles):
            dq = _dq_tile(j - lo, j, q_wg, do_wg, k_smem, v_smem, ready, empty, dq, rows, lse, delta, qk_scale, cap,
                          before, True, WINDOW, SOFTCAP, WG_M, BLOCK_N, STAGES, s_layout, op_layout)
    q_wg.store((dq * scale).to(q_wg.dtype))  # (this warpgroup's Q rows, read by its own finished matmuls only)
    fence_async_shared()
    _barrier()
    tma.async_copy_shared_to_global(dq_desc, [dq_row + HALF * WG_M, dq_col], q_wg)
    tma.store_wait(0)


@gluon.jit
def _attn_dq_hopper_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, o_ptr, lse_ptr, dlse_ptr, delta_ptr, seqlen,
                           chunk_heads, n_heads, group, before, qk_scale, cap, scale, q_rb, q_rh, q_ch, do_rb, do_rh,
                           do_ch, k_rb, k_rh, k_ch, dq_rb, dq_rh, dq_ch, o_sb, o_sh, o_ss, HEAD_DIM: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                           WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, HAS_DLSE: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr):
    """dQ (and delta) of one (batch, head, block of BLOCK_M queries): Q and dO loaded once, a ring of K/V tiles."""
    bh, m_block = _program_block(seqlen // BLOCK_M, chunk_heads, CAUSAL, False)
    b = bh // n_heads
    h = bh % n_heads
    hk = h // group
    if CAUSAL:
        n_tiles = (m_block + 1) * BLOCK_M // BLOCK_N
    else:
        n_tiles = seqlen // BLOCK_N
    start = m_block * BLOCK_M
    lo = _first_tile(start, before, BLOCK_N, WINDOW)
    q_smem, do_smem, k_smem, v_smem, fixed_bar, ready, empty = _pair_buffers(q_desc, do_desc, k_desc, v_desc,
                                                                               BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)
    o_base = b.to(gl.int64) * o_sb + h.to(gl.int64) * o_sh
    kv_row = b * k_rb + hk * k_rh
    dq_row = b * dq_rb + h * dq_rh + start
    gl.warp_specialize([
        (_dq_consumer, (dq_desc, o_ptr, lse_ptr, dlse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, fixed_bar,
                        ready, empty, dq_row, h * dq_ch, o_base, o_ss, bh * seqlen, m_block, lo, n_tiles, before,
                        qk_scale, cap, scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW, SOFTCAP,
                        HAS_DLSE)),
        (_dq_consumer, (dq_desc, o_ptr, lse_ptr, dlse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, fixed_bar,
                        ready, empty, dq_row, h * dq_ch, o_base, o_ss, bh * seqlen, m_block, lo, n_tiles, before,
                        qk_scale, cap, scale, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW, SOFTCAP,
                        HAS_DLSE)),
        (_pair_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, fixed_bar, ready, empty,
                          b * q_rb + h * q_rh + start, h * q_ch, b * do_rb + h * do_rh + start, h * do_ch,
                          kv_row, hk * k_ch, 0, 0, kv_row, hk * k_ch, 0, 0, 1, lo, n_tiles, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


@gluon.jit
def _dkdv_tile(t, i, stats_row, k_wg, v_wg, q_smem, do_smem, ready, empty, lse_ptr, delta_ptr, dk, dv, keys, qk_scale,
               cap, before, MASK: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, WG_N: gl.constexpr,
               BLOCK_M: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr):
    """Query tile i's share of the warpgroup's dK and dV, keys as rows: sT = k q^T and dpT = v dO^T issued together,
    pT while dpT runs, then dV += pT dO and dK += dsT q together."""
    stage = t % STAGES
    mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
    q_tile = q_smem.index(stage)
    do_tile = do_smem.index(stage)
    zero = gl.zeros([WG_N, BLOCK_M], gl.float32, layout=s_layout)
    s_tok = warpgroup_mma(k_wg, q_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(v_wg, do_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    queries = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    lse = gl.load(lse_ptr + stats_row + queries) * LOG2E
    delta = gl.load(delta_ptr + stats_row + queries)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    s, tanh_s = _scores(s, qk_scale, cap, SOFTCAP)
    s = s - gl.expand_dims(lse, 0)
    if MASK:
        s = gl.where(_seen(gl.expand_dims(queries, 0), gl.expand_dims(keys, 1), before, WINDOW), s, float("-inf"))
    p = gl.exp2(s)
    dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
    dv_tok = warpgroup_mma(gl.convert_layout(p.to(q_tile.dtype), op_layout), do_tile, dv, is_async=True)
    ds = p * (dp - gl.expand_dims(delta, 0))
    if SOFTCAP:
        ds *= 1.0 - tanh_s * tanh_s  # d(softcap tanh(scale x / softcap)) / dx, over the scale applied at the end
    dk_tok = warpgroup_mma(gl.convert_layout(ds.to(q_tile.dtype), op_layout), q_tile, dk, is_async=True)
    dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
    _barrier()  # the warpgroup's 4 warps are done with the stage's Q and dO: one arrival for all
    mbarrier.arrive(empty.index(stage))
    return dk, dv


@gluon.jit
def _dkdv_consumer(dk_desc, dv_desc, part_ptr, lse_ptr, delta_ptr, k_smem, v_smem, q_smem, do_smem, fixed_bar, ready,
                   empty, out_row, out_col, part_row, part_size, stats_row, seqlen, heads, n_block, tile_lo, n_tiles,
                   before, qk_scale, cap, scale, HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                   SOFTCAP: gl.constexpr, PARTIAL: gl.constexpr):
    """Key rows [HALF * BLOCK_N / 2, ...) of the block: dK and dV over the query tiles of ``heads`` q heads of the kv
    group, stored (PARTIAL) as fp32 rows part_row... of part_ptr's dK and, part_size elements on, dV, else as dk and
    dv."""
    WG_N: gl.constexpr = BLOCK_N // 2
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    op_layout: gl.constexpr = _operand_layout(acc_layout)
    k_wg = k_smem.slice(HALF * WG_N, WG_N)
    v_wg = v_smem.slice(HALF * WG_N, WG_N)
    first_key = n_block * BLOCK_N + HALF * WG_N
    keys = first_key + gl.arange(0, WG_N, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([WG_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([WG_N, HEAD_DIM], gl.float32, layout=acc_layout)
    if CAUSAL:  # query tiles before unmasked_lo hold a query before some of these keys
        unmasked_lo = gl.minimum(gl.maximum((first_key + WG_N - 1 + BLOCK_M - 1) // BLOCK_M, tile_lo), n_tiles)
    else:
        unmasked_lo = tile_lo
    if WINDOW:  # query tiles from unmasked_hi on hold a query past some of these keys' windows
        unmasked_hi = gl.maximum(gl.minimum((first_key + before + 1) // BLOCK_M, n_tiles), unmasked_lo)
    else:
        unmasked_hi = n_tiles
    mbarrier.wait(fixed_bar, 0)
    t = 0
    for g in range(heads):  # every q head of the program's share of the group adds into the same registers
        for i in range(tile_lo, unmasked_lo):
            dk, dv = _dkdv_tile(t, i, stats_row + g * seqlen, k_wg, v_wg, q_smem, do_smem, ready, empty, lse_ptr,
                                delta_ptr, dk, dv, keys, qk_scale, cap, before, True, WINDOW, SOFTCAP, WG_N, BLOCK_M,
                                STAGES, s_layout, op_layout)
            t += 1
        for i in range(unmasked_lo, unmasked_hi):
            dk, dv = _dkdv_tile(t, i, stats_row + g * seqlen, k_wg, v_wg, q_smem, do_smem, ready, empty, lse_ptr,
                                delta_ptr, dk, dv, keys, qk_scale, cap, before, False, WINDOW, SOFTCAP, WG_N, BLOCK_M,
                                STAGES, s_layout, op_layout)
            t += 1
        if WINDOW:
            for i in range(unmasked_hi, n_tiles):
                dk, dv = _dkdv_tile(t, i, stats_row + g * seqlen, k_wg, v_wg, q_smem, do_smem, ready, empty, lse_ptr,
                                    delta_ptr, dk, dv, keys, qk_scale, cap, before, True, WINDOW, SOFTCAP, WG_N,
                                    BLOCK_M, STAGES, s_layout, op_layout)
                t += 1
    if PARTIAL:  # summed with the group's other shares by _sum_group_shares
        rows = part_row + HALF * WG_N + gl.arange(0, WG_N, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
        at = gl.expand_dims(rows, 1) * HEAD_DIM + gl.expand_dims(cols, 0)
        gl.store(part_ptr + at, dk * scale)
        gl.store(part_ptr + part_size + at, dv)
    else:  # this warpgroup's K and V rows, read by its own finished matmuls only, take its dK and dV
        k_wg.store((dk * scale).to(k_wg.dtype))
        v_wg.store(dv.to(v_wg.dtype))
        fence_async_shared()
        _barrier()
        tma.async_copy_shared_to_global(dk_desc, [out_row + HALF * WG_N, out_col], k_wg)
        tma.async_copy_shared_to_global(dv_desc, [out_row + HALF * WG_N, out_col], v_wg)
        tma.store_wait(0)


@gluon.jit
def _attn_dkdv_hopper_kernel(k_desc, v_desc, q_desc, do_desc, dk_desc, dv_desc, part_ptr, lse_ptr, delta_ptr, seqlen,
                             chunk_heads, n_kv_heads, group, shares, before, qk_scale, cap, scale, k_rb, k_rh, k_ch,
                             q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, dk_rb, dk_rh, dk_ch, HEAD_DIM: gl.constexpr,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                             WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, PARTIAL: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr):
    """dK and dV of one (batch, kv head, block of BLOCK_N keys, share of the kv group's q heads): K and V loaded once,
    a ring of (Q, dO) tiles of the share's q heads. One share (the group's every head) stores dK and dV; more
    (PARTIAL) store fp32 partial sums, share-major rows of [B * kv heads * S, HEAD_DIM], for _sum_group_shares."""
    bhk_share, n_block = _program_block(seqlen // BLOCK_N, chunk_heads, CAUSAL, True)
    bhk = bhk_share // shares
    share = bhk_share % shares
    b = bhk // n_kv_heads
    hk = bhk % n_kv_heads
    heads = group // shares
    h0 = hk * group + share * heads  # the share's first q head
    n_tiles = seqlen // BLOCK_M
    start = n_block * BLOCK_N
    if CAUSAL:  # the first query tile that sees a key of the block
        tile_lo = start // BLOCK_M
    else:
        tile_lo = 0
    if WINDOW:  # one past the last query tile that sees a key of the block
        n_tiles = gl.minimum((start + BLOCK_N - 1 + before) // BLOCK_M + 1, n_tiles)
    k_smem, v_smem, q_smem, do_smem, fixed_bar, ready, empty = _pair_buffers(k_desc, v_desc, q_desc, do_desc,
                                                                               BLOCK_N, BLOCK_M, HEAD_DIM, STAGES)
    kv_row = b * k_rb + hk * k_rh + start
    out_row = b * dk_rb + hk * dk_rh + start
    stats_row = (b * group * n_kv_heads + h0) * seqlen
    if CAUSAL:  # the grid's (batch, kv head, share) axis: _grid
        n_bhk_shares = gl.num_programs(0)
    else:
        n_bhk_shares = gl.num_programs(1)
    part_size = n_bhk_shares * seqlen * HEAD_DIM  # the elements of dK's partial sums; dV's follow
    part_row = (share * (n_bhk_shares // shares) + bhk) * seqlen + start
    gl.warp_specialize([
        (_dkdv_consumer, (dk_desc, dv_desc, part_ptr, lse_ptr, delta_ptr, k_smem, v_smem, q_smem, do_smem, fixed_bar,
                          ready, empty, out_row, hk * dk_ch, part_row, part_size, stats_row, seqlen, heads, n_block,
                          tile_lo, n_tiles, before, qk_scale, cap, scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                          WINDOW, SOFTCAP, PARTIAL)),
        (_dkdv_consumer, (dk_desc, dv_desc, part_ptr, lse_ptr, delta_ptr, k_smem, v_smem, q_smem, do_smem, fixed_bar,
                          ready, empty, out_row, hk * dk_ch, part_row, part_size, stats_row, seqlen, heads, n_block,
                          tile_lo, n_tiles, before, qk_scale, cap, scale, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                          WINDOW, SOFTCAP, PARTIAL)),
        (_pair_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, fixed_bar, ready, empty,
                          kv_row, hk * k_ch, kv_row, hk * k_ch, b * q_rb + h0 * q_rh, h0 * q_ch, q_rh, q_ch,
                          b * do_rb + h0 * do_rh, h0 * do_ch, do_rh, do_ch, heads, tile_lo, n_tiles, BLOCK_M,
                          STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


@triton.jit
def _sum_group_shares(part_ptr, dk_ptr, dv_ptr, shares, rows, n_kv_heads, seqlen, dk_sb, dk_sh, dk_ss, dv_sb, dv_sh,
                      dv_ss, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    """dK (programs (i, 0)) or dV (i, 1) of rows [i * BLOCK_R, ...) of [B * kv heads * S]: the sum of the dK/dV
    kernel's partial sums over the kv group's shares, stored into the [B, kv heads, S, HEAD_DIM] view."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, HEAD_DIM)
    at = r[:, None] * HEAD_DIM + d[None, :]
    part_ptr += tl.program_id(1) * shares * rows * HEAD_DIM
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    for share in range(shares):
        acc += tl.load(part_ptr + share * rows * HEAD_DIM + at)
    b = r // (n_kv_heads * seqlen)
    h = r // seqlen % n_kv_heads
    s = r % seqlen
    if tl.program_id(1) == 0:
        tl.store(dk_ptr + (b * dk_sb + h * dk_sh + s * dk_ss)[:, None] + d[None, :], acc.to(dk_ptr.dtype.element_ty))
    else:
        tl.store(dv_ptr + (b * dv_sb + h * dv_sh + s * dv_ss)[:, None] + d[None, :], acc.to(dv_ptr.dtype.element_ty))


def rows_2d(t: Tensor) -> tuple[tuple, int, int, int] | None:
    """``t`` (a [B, H, S, D] view, unit stride along D) as the 2-D tensor TMA reads, with where (b, h, s) lies in
    it: ((t, [rows, columns], row stride), rb, rh, ch), row b * rb + h * rh + s and column h * ch. Rows of (b, h, s)
    evenly spaced ([B, H, S, D] memory) make [B*H*S, D]; rows of (b, s) holding every head ([B, S, H, D] memory: a
    "bshd" call, the transposed projections a transformer layer passes, a slice of a fused q/k/v projection) make
    [B*S, ...]. None for other strides, and where TMA cannot address the rows (16-byte aligned base and row stride)."""
    B, H, S, D = t.shape
    sb, sh, ss, sd = t.stride()
    if sd != 1 or t.data_ptr() % 16 or ss * t.element_size() % 16:
        return None
    if sh == S * ss and ss >= D and (B == 1 or sb == H * sh):
        return (t, [B * H * S, D], ss), H * S, S, 0
    if sh >= D and (H - 1) * sh + D <= ss and (B == 1 or sb == S * ss):
        return (t, [B * S, (H - 1) * sh + D], ss), S, 0, sh
    return None


def _descriptor(rows_2d_tensor: tuple, rows: int, head_dim: int) -> TensorDescriptor:
    """A host tensor descriptor of a ``rows_2d`` 2-D tensor for [rows, head_dim] tiles: a copy of one built by
    Triton's constructor, with this tensor's base, shape and row stride put in: the constructor re-checks every
    field each call, a host cost each launch pays (results/h200/host_attention_launch_split.log), where only what
    rows_2d already checked (alignment, unit stride) differs between calls."""
    base, shape, row_stride = rows_2d_tensor
    descriptor = object.__new__(TensorDescriptor)
    descriptor.__dict__.update(_checked_descriptor(rows, head_dim, base.dtype).__dict__)
    descriptor.base, descriptor.shape, descriptor.strides = base, shape, [row_stride, 1]
    return descriptor


@functools.cache
def _checked_descriptor(rows: int, head_dim: int, dtype: torch.dtype) -> TensorDescriptor:
    """A descriptor of [rows, head_dim] tiles of ``dtype`` from Triton's constructor (over a placeholder tensor),
    whose fields _descriptor copies; built once: its shared-memory layout (Triton's get_default_for) was most of a
    descriptor's host time (results/host_attention_descriptors.log)."""
    layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16 if dtype == torch.bfloat16
                                                  else gl.float16)
    return TensorDescriptor(torch.empty(rows, head_dim, dtype=dtype), [rows, head_dim], [head_dim, 1],
                            [rows, head_dim], layout)


def _score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """The kernels' (qk_scale, cap) for _scores."""
    return (scale / softcap, softcap * LOG2E.value) if softcap else (scale * LOG2E.value, 1.0)


def _grid(heads: int, n_blocks: int, causal: bool) -> tuple[int, int]:
    """The grid _program_block reads: heads first under a causal mask (each block's weight known: heaviest first)."""
    return (heads, n_blocks) if causal else (n_blocks, heads)


def forward(views: tuple[Tensor, ...], o: Tensor, lse: Tensor, scale: float, causal: bool, before: int,
            softcap: float) -> bool:
    """Write o ([B, H, S, D] view of a new output) and lse [B, H, S] from the [B, H, S, D] views of q, k, v, and
    return True, for a call this forward covers beyond what attention's launcher checked (device, dtype, mask,
    varlen, size, tracing): the head dim and mask, whole tiles, as many queries as keys, the views' strides, k and v
    laid out alike (one set of coordinates). Else False, nothing written. ``before`` >= 0 (causal only): a query
    sees its own key and the ``before`` keys before it (attention's sliding window); ``softcap`` (0: none): scores
    softcap * tanh(scale q k / softcap)."""
    q, k, v = views
    B, H, S, D = q.shape
    if (D, causal) not in GLUON_FWD or S % BLOCK or k.shape[2] != S or before >= 0 and (
            not causal or before + 1 < GLUON_MIN_WINDOW.get(D, 0)):
        return False
    at = [rows_2d(t) for t in (q, k, v, o)]
    if None in at or at[1][1:] != at[2][1:]:
        return False
    (q2, *q_at), (k2, *k_at), (v2, _, _, _), (o2, *o_at) = at
    descriptors = [_descriptor(t, BLOCK, D) for t in (q2, k2, v2)] + [_descriptor(o2, BLOCK // 2, D)]
    n_items = B * H * (S // BLOCK)
    mean_tiles = (S // BLOCK + 1) / 2 if causal else S // BLOCK
    if before >= 0:  # a window's tiles, one more where it starts inside a tile
        mean_tiles = min(mean_tiles, before // BLOCK + 2)
    stages, q_buffers = FWD_BUFFERS[D]
    persistent = q_buffers == 2 or mean_tiles <= PERSISTENT_TILES
    sms, group = num_programs_for(q.device), H // k.shape[1]
    programs = min(n_items, sms) if persistent else n_items
    chunk = chunk_heads(B * H, S // BLOCK, 2 * S * D * k.element_size() // group, causal, sms)  # a q head's K, V share
    next_item = torch.zeros(1, dtype=torch.int32, device=q.device) if persistent else lse  # (unread: a placeholder)
    launch(_attn_fwd_hopper_kernel, (programs, ), *descriptors, lse, next_item, S, H, group, before,
           *_score_scales(scale, softcap), n_items, chunk, *q_at, *k_at, *o_at, HEAD_DIM=D, BLOCK=BLOCK,
           STAGES=stages, Q_BUFFERS=q_buffers, CAUSAL=causal, WINDOW=before >= 0, SOFTCAP=bool(softcap),
           PERSISTENT=persistent, CONSUMER_REGS=CONSUMER_REGS, num_warps=4)
    return True


def backward(views: tuple[Tensor, ...], lse: Tensor, dlse: Tensor | None, delta: Tensor, scale: float,
             causal: bool, before: int, softcap: float) -> bool:
    """Write dq, dk, dv and delta ([B, H, S] fp32) from the [B, H, S, D] views (q, k, v, o, do, dq, dk, dv), lse
    and dlse ([B, H, S] fp32, contiguous; dlse may be None), and return True, for a call the backward covers (as
    ``forward``, with GLUON_BWD's head dims and masks, k and v alike, dk and dv alike; ``before``, ``softcap`` as
    there; SMALL_GRID_BWD's head dims where the dK/dV grid has under two programs an SM). Else False, nothing written.
    Two kernels: dQ, which also stores delta = rowsum(dO * O) - dLSE, then dK/dV, which reads it (and a third that
    adds dK/dV's partial sums where group_shares splits its kv groups)."""
    q, k, v, o, do, dq, dk, dv = views
    B, H, S, D = q.shape
    kv_heads, sms = k.shape[1], num_programs_for(q.device)
    group = H // kv_heads
    small_grid = small_dkdv_grid(B * kv_heads, S, sms)
    if (D, causal) not in GLUON_BWD and not (D in SMALL_GRID_BWD and small_grid) or S % BLOCK or k.shape[2] != S \
            or not lse.is_contiguous() or before >= 0 and not causal:
        return False
    at = [rows_2d(t) for t in (q, k, v, do, dq, dk, dv)]
    if None in at or at[1][1:] != at[2][1:] or at[5][1:] != at[6][1:] or o.stride(-1) != 1:
        return False
    (q2, *q_at), (k2, *k_at), (v2, _, _, _), (do2, *do_at), (dq2, *dq_at), (dk2, *dk_at), (dv2, _, _, _) = at
    meta = dict(HEAD_DIM=D, CAUSAL=causal, WINDOW=before >= 0, SOFTCAP=bool(softcap), CONSUMER_REGS=CONSUMER_REGS,
                num_warps=4)
    scales = _score_scales(scale, softcap)
    made = {}

    def descriptor(t2, rows):  # one a (tensor, tile rows): the two kernels' K and V tiles match at the kept settings
        if (id(t2[0]), rows) not in made:
            made[id(t2[0]), rows] = _descriptor(t2, rows, D)
        return made[id(t2[0]), rows]

    block_m, block_n, stages = DQ_SETTING
    head_bytes = 2 * S * D * q.element_size()  # a head's K and V, or Q and dO
    dq_chunk = chunk_heads(B * H, S // block_m, head_bytes // group, causal, sms)
    launch(_attn_dq_hopper_kernel, _grid(B * H, S // block_m, causal), descriptor(q2, block_m),
           descriptor(do2, block_m), descriptor(k2, block_n), descriptor(v2, block_n), descriptor(dq2, block_m // 2),
           o, lse, lse if dlse is None else dlse, delta, S, dq_chunk, H, group, before, *scales, scale, *q_at,
           *do_at, *k_at, *dq_at, *o.stride()[:3], BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
           HAS_DLSE=dlse is not None, **meta)
    block_m, block_n, stages = DKDV_SETTING
    shares = group_shares(B * kv_heads, S, group, block_m, block_n, D, causal, before, sms)
    rows = B * kv_heads * S
    dkdv_chunk = chunk_heads(B * kv_heads * shares, S // block_n, head_bytes * group // shares, causal, sms)
    part = torch.empty((2, shares, rows, D), dtype=torch.float32, device=q.device) if shares > 1 else delta
    launch(_attn_dkdv_hopper_kernel, _grid(B * kv_heads * shares, S // block_n, causal), descriptor(k2, block_n),
           descriptor(v2, block_n), descriptor(q2, block_m), descriptor(do2, block_m), descriptor(dk2, block_n // 2),
           descriptor(dv2, block_n // 2), part, lse, delta, S, dkdv_chunk, kv_heads, group, shares, before, *scales,
           scale, *k_at, *q_at, *do_at, *dk_at, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, PARTIAL=shares > 1,
           **meta)
    if shares > 1:
        launch(_sum_group_shares, (cdiv(rows, SUM_ROWS), 2), part, dk, dv, shares, rows, kv_heads, S,
               *dk.stride()[:3], *dv.stride()[:3], HEAD_DIM=D, BLOCK_R=SUM_ROWS, num_warps=4)
    return True


def small_dkdv_grid(n_bhk: int, seqlen: int, sms: int) -> bool:
    """Whether the dK/dV kernel's grid, one program a (batch, kv head, key block), has under two programs an SM."""
    return n_bhk * (seqlen // DKDV_SETTING[1]) < 2 * sms


@functools.cache
def group_shares(n_bhk: int, seqlen: int, group: int, block_m: int, block_n: int, head_dim: int, causal: bool,
                 before: int, sms: int) -> int:
    """How many dK/dV programs share a (batch, kv head, key block)'s q heads: the divisor of ``group`` with the least
    estimated time, a program's tiles of its heaviest program or an SM's mean, whichever is longer (the scheduler
    starts the heaviest first), plus the partial sums' extra traffic at MATMUL_FLOPS_PER_BYTE. One (no partials)
    unless the grid has fewer than two programs an SM: a causal mask's first key blocks then outlast the rest, and a
    short sequence's few programs leave SMs idle."""
    if not small_dkdv_grid(n_bhk, seqlen, sms):
        return 1
    n_blocks, n_tiles = seqlen // block_n, seqlen // block_m
    tiles = []  # query tiles a key block's program runs a q head
    for n in range(n_blocks):
        hi = min((n * block_n + block_n - 1 + before) // block_m + 1, n_tiles) if before >= 0 else n_tiles
        tiles.append(hi - (n * block_n // block_m if causal else 0))
    tile_flops = 8 * block_m * block_n * head_dim  # a tile's four matmuls
    elements = n_bhk * seqlen * head_dim  # of dK, and of dV

    def cost(shares):
        busiest = max(max(tiles) * group // shares, n_bhk * group * sum(tiles) / sms)
        partials = 16 * shares * elements if shares > 1 else 0  # fp32 dK and dV partials written and read
        return busiest * tile_flops + partials / sms * MATMUL_FLOPS_PER_BYTE

    return min((s for s in range(1, group + 1) if group % s == 0), key=cost)
