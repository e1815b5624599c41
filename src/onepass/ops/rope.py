"""Rotary position embedding on q and k in one launch (Llama / NeoX rotate-half, GPT-J interleaved).

Math, per token and head, on the first R = cos.shape[-1] dims of x (q or k); dims past R
pass through (partial rotary). Each rotated pair (x1, x2) is (x[i], x[i + R/2]) in the
"half" style and (x[2i], x[2i+1]) in the "interleaved" style; c1, s1 and c2, s2 are the
table entries at the pair's first and second positions:

    forward:   o1 = x1 * c1 - x2 * s1          (= x * cos + rotate(x) * sin, HF's formula)
               o2 = x2 * c2 + x1 * s2
    backward:  the transpose, i.e. the same kernel with (s1, s2) -> (-s2, -s1):
               dx1 = do1 * c1 + do2 * s2,   dx2 = do2 * c2 - do1 * s1

With the tables HF builds (each frequency twice, c1 = c2, s1 = s2) the backward is the
rotation by the negated angle. Nothing is saved for backward besides cos/sin (and the
position ids).

Byte budget (q and k of Nq + Nk elements of size s; cos/sin are [B or 1, S, R], read once
per token from L2 for all its heads, small beside q and k):

    op     unfused PyTorch (HF apply_rotary_pos_emb)          fused minimum
    fwd    per tensor: x*cos (r,w), rotate_half (r, w 2x),     read q, k; write q', k'   2 (Nq+Nk) s
           *sin (r,w), + (r 2x, w): ~10 passes
    bwd    about the same                                       read dq', dk'; write dq, dk  2 (Nq+Nk) s

Grid, token-major: one program per (token, block of BLOCK_H heads); the head blocks of q come
first, then those of k, so grouped-query k (fewer heads) costs only its own blocks. Programs
run token by token within each head block, or, for per-batch tables, in tiles of tokens that
take every head block in turn (TOKEN_TILE), so the tables are read from HBM once. Head-major,
where a head's tokens are contiguous (bhsd) and its rows short: one program per block of
HEAD_MAJOR_TOKENS tokens of one (sequence, head), the table rows re-read from L2 by each head. At a
head dim that is no power of two (rotate-half over the whole head, no position ids, out of place), the
blocks are FLAT_BLOCK // head dim tokens, each block's values one flat run (_rope_flat_kernel).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from onepass import reference
from onepass.ops.dispatch import (
    FLOAT_DTYPES,
    cdiv,
    check_float,
    check_same_device,
    dependent_launch,
    eager_autograd,
    empty_output,
    first_order_only,
    launch,
    launch_next_kernel,
    next_power_of_2,
    route,
    triton_op,
    unit_stride,
    use_triton,
    wait_for_previous_kernel,
)

# A program rotates about TILE_ELEMENTS values (BLOCK_H heads x R dims) with NUM_WARPS warps; TOKEN_TILE: tokens
# a tile when cos/sin are per batch row (see the kernel's program order). Evidence: benchmarks/tune_rope_layer_norm.py
# rope, results/h200/tune_rope_layer_norm.log ("token-major" rows); the first sweep's numbers are in CHANGELOG.md.
TILE_ELEMENTS = 1024
NUM_WARPS = 1
TOKEN_TILE = 1024
# Head-major order (HEAD_MAJOR_TOKENS tokens of one head a program, HEAD_MAJOR_WARPS warps) where a head's tokens
# are contiguous and its rows short: the token-major program reads its heads' rows of under 256 bytes from places
# a head apart (2.6 MB at S 16384, d 80), the head-major one a contiguous run. H200: faster than token-major at
# d 64/80/96, slower at d 128 (256-byte rows) (tune_rope_layer_norm.py rope-dims, h200/tune_rope_layer_norm.log).
HEAD_MAJOR_TOKENS, HEAD_MAJOR_WARPS, HEAD_MAJOR_ROW_BYTES = 16, 2, 256
# Tokens of a sequence a head-major tile (each head in turn): its table rows (5 MiB of bf16 at d 80) stay in L2 for the
# next head, while each head's run stays long.
HEAD_MAJOR_TILE = 16384
# Head-major as flat runs of values (_rope_flat_kernel, FLAT_BLOCK lanes) where the head dim is no power of two (whole
# heads, rotate-half, the tables' rows as long as a head's, out of place): there the padded pairs of half-rows leave
# lanes idle. FLAT_VALUES_PER_THREAD by direction: the backward makes one more load a value
# (results/h200/rope_flat.log has the sweep of lanes and warps)
FLAT_BLOCK, FLAT_VALUES_PER_THREAD = 2048, {False: 8, True: 16}
TABLE_ELEMENTS = 2048  # angles a program of rope_tables computes (a decode step: one program)

LAYOUTS = ("bhsd", "bshd")
STYLES = ("half", "interleaved")

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _load_pairs(rows, rows_ok, ROT: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_HALF: tl.constexpr):
    """(first, second) elements of each rotated pair of BLOCK_R rows, [BLOCK_R, BLOCK_HALF] in fp32.

    Interleaved pairs are loaded as one contiguous row and split in registers: strided
    loads of the even and odd elements compile to scalar 2-byte loads on sm_90 (PTX).
    """
    if INTERLEAVED:
        d = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        # rows_ok may be a scalar: joined through tl.where, not & (see norm.py's _norm_bwd_kernel)
        x = tl.load(rows + d, mask=tl.where(rows_ok, d < ROT, False), other=0.0).to(tl.float32)
        return tl.split(tl.reshape(x, [BLOCK_R, BLOCK_HALF, 2]))
    i = tl.arange(0, BLOCK_HALF)[None, :]
    ok = tl.where(rows_ok, i < ROT // 2, False)
    return (tl.load(rows + i, mask=ok, other=0.0).to(tl.float32),
            tl.load(rows + i + ROT // 2, mask=ok, other=0.0).to(tl.float32))


@triton.jit
def _store_pairs(rows, rows_ok, o1, o2, ROT: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    """The inverse of _load_pairs: write (first, second) back to their places, in the output's dtype."""
    dtype = rows.dtype.element_ty
    if INTERLEAVED:
        d = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        o = tl.reshape(tl.join(o1, o2), [BLOCK_R, 2 * BLOCK_HALF])
        tl.store(rows + d, o.to(dtype), mask=rows_ok & (d < ROT))
    else:
        i = tl.arange(0, BLOCK_HALF)[None, :]
        ok = rows_ok & (i < ROT // 2)
        tl.store(rows + i, o1.to(dtype), mask=ok)
        tl.store(rows + i + ROT // 2, o2.to(dtype), mask=ok)


@triton.jit
def _rope_rows(x_rows, o_rows, rows_ok, c1, c2, s1, s2, ROT: tl.constexpr, HEAD_DIM: tl.constexpr,
               INTERLEAVED: tl.constexpr, COPY_REST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
               BLOCK_REST: tl.constexpr):
    """Rotate BLOCK_R rows (pointers [BLOCK_R, 1]: heads of one token, or tokens of one head)."""
    x1, x2 = _load_pairs(x_rows, rows_ok, ROT, INTERLEAVED, BLOCK_R, BLOCK_HALF)
    _store_pairs(o_rows, rows_ok, x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, ROT, INTERLEAVED, BLOCK_R, BLOCK_HALF)
    if COPY_REST:  # out of place with partial rotary: the dims past ROT pass through
        rest = ROT + tl.arange(0, BLOCK_REST)[None, :]
        rest_ok = rows_ok & (rest < HEAD_DIM)
        tl.store(o_rows + rest, tl.load(x_rows + rest, mask=rest_ok), mask=rest_ok)


@triton.jit
def _table_rows(cos_ptr, sin_ptr, pos_ptr, b, s, s_ok, table_rows, cos_batch_stride, cos_row_stride,
                pos_batch_stride, pos_seq_stride, ROT: tl.constexpr, INTERLEAVED: tl.constexpr,
                BACKWARD: tl.constexpr, HAS_POS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """(c1, c2, s1, s2) of the tokens (b, s) (scalars, or [BLOCK_R, 1] vectors), each [BLOCK_R, BLOCK_HALF]:
    their table rows, gathered through position_ids or their own (batch, seq) rows."""
    if HAS_POS:
        row = tl.load(pos_ptr + b * pos_batch_stride + s * pos_seq_stride, mask=s_ok, other=0).to(tl.int64)
        row_ok = s_ok & (row >= 0) & (row < table_rows)  # never read outside the table
        table = row * cos_row_stride
    else:
        row_ok = s_ok
        table = b * cos_batch_stride + s * cos_row_stride
    c1, c2 = _load_pairs(cos_ptr + table, row_ok, ROT, INTERLEAVED, BLOCK_R, BLOCK_HALF)
    s1, s2 = _load_pairs(sin_ptr + table, row_ok, ROT, INTERLEAVED, BLOCK_R, BLOCK_HALF)
    if BACKWARD:
        return c1, c2, -s2, -s1
    return c1, c2, s1, s2


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr,
    seq, n_tokens, n_q_heads, n_k_heads, q_head_blocks, n_blocks, table_rows, tile_blocks, n_tiles,
    q_batch_stride, q_seq_stride, q_head_stride, k_batch_stride, k_seq_stride, k_head_stride,
    qo_batch_stride, qo_seq_stride, qo_head_stride, ko_batch_stride, ko_seq_stride, ko_head_stride,
    cos_batch_stride, cos_row_stride, pos_batch_stride, pos_seq_stride,
    ROT: tl.constexpr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
    HAS_POS: tl.constexpr, COPY_REST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    TOKEN_TILE: tl.constexpr,
):
    if BLOCK_T > 1:
        # Head-major: BLOCK_T tokens of one (sequence, head) a program, each reading one contiguous run of
        # its head's rows. Tiles of tile_blocks such blocks of a sequence (at most HEAD_MAJOR_TILE tokens)
        # take each head in turn (q's heads, then k's), its tokens fastest: the heads re-read a tile's table
        # rows from L2. The grid is (block in tile, head, sequence x tile), so that a program finds its place
        # without divisions by runtime values (n_tiles is 1 up to a tile's length: specialized away): a flat
        # grid's put a long chain of them before the first load, and lost the order's gain (same log). No early
        # return for a partial block either: it cost the sm_90 build registers, and occupancy with them.
        head = tl.program_id(1)
        b = (tl.program_id(2) // n_tiles).to(tl.int64)
        first = ((tl.program_id(2) % n_tiles) * tile_blocks + tl.program_id(0)) * BLOCK_T
        s = (first + tl.arange(0, BLOCK_T))[:, None]
        s_ok = s < seq
        s = s.to(tl.int64)
        # the head's first rows in and out, chosen as scalars (offsets in int64: heads x a long sequence pass
        # 2^31 elements); its tokens are HEAD_DIM apart in every tensor (_head_major), so one offset vector
        # serves both (fewer registers: a thread holds 16 values a tensor)
        if head < n_q_heads:
            x_head = q_ptr + b * q_batch_stride + head.to(tl.int64) * q_head_stride
            o_head = qo_ptr + b * qo_batch_stride + head.to(tl.int64) * qo_head_stride
        else:
            x_head = k_ptr + b * k_batch_stride + (head - n_q_heads).to(tl.int64) * k_head_stride
            o_head = ko_ptr + b * ko_batch_stride + (head - n_q_heads).to(tl.int64) * ko_head_stride
        c1, c2, s1, s2 = _table_rows(cos_ptr, sin_ptr, pos_ptr, b, s, s_ok, table_rows, cos_batch_stride,
                                     cos_row_stride, pos_batch_stride, pos_seq_stride, ROT, INTERLEAVED, BACKWARD,
                                     HAS_POS, BLOCK_T, BLOCK_HALF)
        rows = s * HEAD_DIM
        _rope_rows(x_head + rows, o_head + rows, s_ok, c1, c2, s1, s2, ROT, HEAD_DIM, INTERLEAVED, COPY_REST,
                   BLOCK_T, BLOCK_HALF, BLOCK_REST)
    else:  # (an else, not a return: the compiler would type the code after a static if's return too)
        # Token-major: one token's block of BLOCK_H heads a program. With TOKEN_TILE = 0, every token for
        # head block 0, then for block 1, ...; else tiles of TOKEN_TILE tokens, each taking all head blocks in
        # turn, so its table rows are reused from L2 by every block instead of streamed once a block.
        pid = tl.program_id(0).to(tl.int64)
        if TOKEN_TILE == 0:
            block = (pid // n_tokens).to(tl.int32)
            token = pid % n_tokens
        else:
            tile, within = pid // (n_blocks * TOKEN_TILE), pid % (n_blocks * TOKEN_TILE)
            block = (within // TOKEN_TILE).to(tl.int32)
            token = tile * TOKEN_TILE + within % TOKEN_TILE
            if token >= n_tokens:
                return
        b, s = token // seq, token % seq
        c1, c2, s1, s2 = _table_rows(cos_ptr, sin_ptr, pos_ptr, b, s, s < seq, table_rows, cos_batch_stride,
                                     cos_row_stride, pos_batch_stride, pos_seq_stride, ROT, INTERLEAVED, BACKWARD,
                                     HAS_POS, 1, BLOCK_HALF)
        heads = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
        if block < q_head_blocks:
            heads += block * BLOCK_H
            x_rows = q_ptr + b * q_batch_stride + s * q_seq_stride + heads * q_head_stride
            o_rows = qo_ptr + b * qo_batch_stride + s * qo_seq_stride + heads * qo_head_stride
            heads_ok = heads < n_q_heads
        else:
            heads += (block - q_head_blocks) * BLOCK_H
            x_rows = k_ptr + b * k_batch_stride + s * k_seq_stride + heads * k_head_stride
            o_rows = ko_ptr + b * ko_batch_stride + s * ko_seq_stride + heads * ko_head_stride
            heads_ok = heads < n_k_heads
        _rope_rows(x_rows, o_rows, heads_ok, c1, c2, s1, s2, ROT, HEAD_DIM, INTERLEAVED, COPY_REST, BLOCK_H,
                   BLOCK_HALF, BLOCK_REST)


@triton.jit
def _rope_flat_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, seq, n_q_heads, tile_blocks, n_tiles,
    q_batch_stride, q_head_stride, k_batch_stride, k_head_stride, qo_batch_stride, qo_head_stride,
    ko_batch_stride, ko_head_stride, cos_batch_stride,
    HEAD_DIM: tl.constexpr, BACKWARD: tl.constexpr, BLOCK: tl.constexpr,
):
    """Head-major rotate-half over whole heads (the grid of _rope_kernel's head-major order): each program
    the values of BLOCK // HEAD_DIM tokens of one head as one flat run, every lane busy where pairs of
    half-rows leave lanes idle at a head dim that is no power of two (80: 2 x 40 values in 2 x 64 lanes).
    Value i of a row pairs with i + HEAD_DIM/2 (first half) or i - HEAD_DIM/2, a neighbour in the same run
    (from L1); a token's table values lie as its values do (rows HEAD_DIM apart), so they load as a run too."""
    tokens: tl.constexpr = BLOCK // HEAD_DIM
    half: tl.constexpr = HEAD_DIM // 2
    head = tl.program_id(1)
    b = (tl.program_id(2) // n_tiles).to(tl.int64)
    first = ((tl.program_id(2) % n_tiles) * tile_blocks + tl.program_id(0)) * (tokens * HEAD_DIM)
    lane = tl.arange(0, BLOCK)
    at = first + lane  # of the head's values (int32: _flat bounds the blocks' span)
    ok = (lane < tokens * HEAD_DIM) & (at < seq * HEAD_DIM)
    lower = at % HEAD_DIM < half
    upper_ok, lower_ok = ok & ~lower, ok & lower
    # (as in _rope_kernel, written out: a jit helper given these pointers would read, to torch's analysis of a
    # traced kernel, as writing all of them, q and k included: see dispatch.triton_op)
    if head < n_q_heads:
        x_head = q_ptr + b * q_batch_stride + head.to(tl.int64) * q_head_stride
        o_head = qo_ptr + b * qo_batch_stride + head.to(tl.int64) * qo_head_stride
    else:
        x_head = k_ptr + b * k_batch_stride + (head - n_q_heads).to(tl.int64) * k_head_stride
        o_head = ko_ptr + b * ko_batch_stride + (head - n_q_heads).to(tl.int64) * ko_head_stride
    # partners as two loads at fixed offsets (each a run the compiler vectorizes; one load through a select
    # of offsets would not be)
    x = tl.load(x_head + at, mask=ok, other=0.0).to(tl.float32)
    partner = tl.where(lower, tl.load(x_head + at + half, mask=lower_ok, other=0.0),
                       tl.load(x_head + at - half, mask=upper_ok, other=0.0)).to(tl.float32)
    table = b * cos_batch_stride + at
    c = tl.load(cos_ptr + table, mask=ok, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose (see the module docstring): the partner's sine, the signs swapped
        s = tl.where(lower, tl.load(sin_ptr + table + half, mask=lower_ok, other=0.0),
                     tl.load(sin_ptr + table - half, mask=upper_ok, other=0.0)).to(tl.float32)
        sign = tl.where(lower, 1.0, -1.0)
    else:
        s = tl.load(sin_ptr + table, mask=ok, other=0.0).to(tl.float32)
        sign = tl.where(lower, -1.0, 1.0)
    tl.store(o_head + at, (x * c + sign * partner * s).to(o_head.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------- launchers


@triton.jit
def _tables_kernel(pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, n_rows, seq_len, pos_batch_stride, pos_seq_stride,
                   half, scaling, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    launch_next_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (batch, token) pairs
    freqs = tl.arange(0, BLOCK_F)
    row_ok, freq_ok = rows < n_rows, freqs < half
    pos = tl.load(pos_ptr + (rows // seq_len).to(tl.int64) * pos_batch_stride + (rows % seq_len) * pos_seq_stride,
                  mask=row_ok, other=0).to(tl.float32)
    angle = pos[:, None] * tl.load(inv_freq_ptr + freqs, mask=freq_ok, other=0.0).to(tl.float32)[None, :]
    at = rows.to(tl.int64)[:, None] * (2 * half) + freqs[None, :]
    ok = row_ok[:, None] & freq_ok[None, :]
    c = (tl.cos(angle) * scaling).to(cos_ptr.dtype.element_ty)
    s = (tl.sin(angle) * scaling).to(sin_ptr.dtype.element_ty)
    for offset in tl.static_range(2):  # each frequency twice: [freqs, freqs]
        tl.store(cos_ptr + at + offset * half, c, mask=ok)
        tl.store(sin_ptr + at + offset * half, s, mask=ok)


def _bsh_strides(x: Tensor, layout: str) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a 4-D q or k in the given layout."""
    return (x.stride(0), x.stride(2), x.stride(1)) if layout == "bhsd" else (x.stride(0), x.stride(1), x.stride(2))


def _tables(cos: Tensor, sin: Tensor, position_ids: Optional[Tensor], layout: str):
    """cos/sin as [B or 1, rows, R] with a batch stride (0 when shared), and position_ids as [B or 1, S]."""
    if cos.dim() == 4:
        head_dim = 1 if layout == "bhsd" else 2
        cos, sin = cos.squeeze(head_dim), sin.squeeze(head_dim)
    if cos.dim() != 3:
        cos, sin = cos.reshape(-1, *cos.shape[-2:]), sin.reshape(-1, *sin.shape[-2:])
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:  # the kernel steps both with cos's strides
        cos, sin = cos.contiguous(), sin.contiguous()
    if position_ids is None:
        return cos, sin, (cos.stride(0) if cos.shape[0] > 1 else 0), None, 0, 0
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    return cos, sin, 0, pos, (pos.stride(0) if pos.shape[0] > 1 else 0), pos.stride(1)


def _settings(rot: int, head_dim: int, n_heads: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_HALF, BLOCK_REST) of the token-major order."""
    block_half = next_power_of_2(rot // 2)
    block_h = min(next_power_of_2(n_heads), max(1, TILE_ELEMENTS // (2 * block_half)))
    return block_h, block_half, next_power_of_2(max(head_dim - rot, 1))


def _head_major(tensors: tuple[Tensor, ...], layout: str, seq: int) -> bool:
    """Whether the head-major order runs: where each tensor's tokens of one head are one contiguous run and
    its head rows are shorter than HEAD_MAJOR_ROW_BYTES (and its grid's second and third dims, q's and k's
    heads together and sequences x tiles, fit CUDA's limit of 65535)."""
    return (seq >= HEAD_MAJOR_TOKENS and tensors[0].shape[0] * cdiv(seq, HEAD_MAJOR_TILE) < 2**16
            and sum(_heads_seq(t, layout)[0] for t in tensors[:2]) < 2**16 and all(
                t.shape[-1] * t.element_size() < HEAD_MAJOR_ROW_BYTES and _bsh_strides(t, layout)[1] == t.shape[-1]
                for t in tensors))


def _head_major_tiles(seq: int, block_tokens: int) -> tuple[int, int]:
    """(blocks a tile, tiles) of a head-major grid: even tiles of at most HEAD_MAJOR_TILE tokens, in blocks of
    ``block_tokens`` (a partial block or so a tile to spare)."""
    n_tiles = cdiv(seq, HEAD_MAJOR_TILE)
    return cdiv(cdiv(seq, n_tiles), block_tokens), n_tiles


def _flat(d: int, rot: int, interleaved: bool, pos: Optional[Tensor], cos: Tensor, seq: int, inplace: bool
          ) -> tuple[int, int] | None:
    """The flat grid's (blocks a tile, tiles) where the head-major order runs as flat runs (_rope_flat_kernel),
    else None: a head dim that is no power of two, rotated whole in the half style, the tables' rows as long as a
    head's and read in token order (no position ids), out of place (a program's threads read values others write:
    in place would race), and the values a head's blocks span, the grid's spare blocks past the sequence
    included, fit int32 offsets."""
    if not (d & (d - 1) != 0 and rot == d and not interleaved and pos is None and cos.stride(-2) == d
            and not inplace):
        return None
    tile_blocks, n_tiles = _head_major_tiles(seq, FLAT_BLOCK // d)
    return (tile_blocks, n_tiles) if n_tiles * tile_blocks * (FLAT_BLOCK // d) * d < 2**31 else None


def _rope_launch(q, k, cos, sin, position_ids, layout, interleaved, backward, q_out, k_out):
    """Rotate q into q_out and k into k_out (they may be q and k themselves: in place)."""
    b, s, d = q.shape[0], q.shape[2] if layout == "bhsd" else q.shape[1], q.shape[-1]
    hq, hk = q.shape[1 if layout == "bhsd" else 2], k.shape[1 if layout == "bhsd" else 2]
    if b * s == 0 or hq + hk == 0 or d == 0:
        return
    cos, sin, cos_batch_stride, pos, pos_batch_stride, pos_seq_stride = _tables(cos, sin, position_ids, layout)
    rot = cos.shape[-1]
    block_h, block_half, block_rest = _settings(rot, d, max(hq, hk))
    q_blocks = cdiv(hq, block_h)
    n_blocks = q_blocks + cdiv(hk, block_h)
    block_t, num_warps = ((HEAD_MAJOR_TOKENS, HEAD_MAJOR_WARPS) if _head_major((q, k, q_out, k_out), layout, s)
                          else (1, NUM_WARPS))
    flat = _flat(d, rot, interleaved, pos, cos, s, q_out is q) if block_t > 1 else None
    if flat:
        tile_blocks, n_tiles = flat
        launch(_rope_flat_kernel, (tile_blocks, hq + hk, b * n_tiles),
               q, k, q_out, k_out, cos, sin, s, hq, tile_blocks, n_tiles,
               *(v for x in (q, k, q_out, k_out) for v in (x.stride(0), _bsh_strides(x, layout)[2])),
               cos_batch_stride, HEAD_DIM=d, BACKWARD=backward, BLOCK=FLAT_BLOCK,
               num_warps=max(1, FLAT_BLOCK // (32 * FLAT_VALUES_PER_THREAD[backward])))
        return
    if block_t > 1:
        tile_blocks, n_tiles = _head_major_tiles(s, block_t)
        grid = (tile_blocks, hq + hk, b * n_tiles)
        tile = 0
    else:
        tile_blocks = n_tiles = 0
        # tiles for per-batch tables ([B, S, R], 2 x 4 MiB in the benchmark); a shared or gathered
        # table stays in L2 anyway, and tokens in order read q and k in longer runs. At most one
        # tile of tokens is that order already, without a tile's spare programs (thousands for a
        # short prompt's few tokens)
        tile = TOKEN_TILE if cos_batch_stride and b * s > TOKEN_TILE else 0
        grid = (cdiv(b * s, tile) * n_blocks * tile if tile else b * s * n_blocks,)
    launch(_rope_kernel, grid,
        q, k, q_out, k_out, cos, sin, pos if pos is not None else cos,
        s, b * s, hq, hk, q_blocks, n_blocks, cos.shape[-2], tile_blocks, n_tiles,
        *_bsh_strides(q, layout), *_bsh_strides(k, layout), *_bsh_strides(q_out, layout), *_bsh_strides(k_out, layout),
        cos_batch_stride, cos.stride(-2), pos_batch_stride, pos_seq_stride,
        ROT=rot, HEAD_DIM=d, INTERLEAVED=interleaved, BACKWARD=backward, HAS_POS=pos is not None,
        COPY_REST=rot < d and q_out is not q, BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_HALF=block_half,
        BLOCK_REST=block_rest, TOKEN_TILE=tile, num_warps=num_warps,
    )


# ------------------------------------------------------------------ registered ops


def _rope_out_of_place(q, k, cos, sin, position_ids, layout, interleaved, backward):
    q, k = unit_stride(q), unit_stride(k)
    q_out = empty_output(q)
    k_out = empty_output(k)
    _rope_launch(q, k, cos, sin, position_ids, layout, interleaved, backward, q_out, k_out)
    return q_out, k_out


@triton_op("onepass::rope", mutates_args=())
def _rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor], layout: str,
          interleaved: bool, backward: bool) -> tuple[Tensor, Tensor]:
    """(q', k') rotated (by the negated angle, transposed, with backward=True); contiguous outputs."""
    return _rope_out_of_place(q, k, cos, sin, position_ids, layout, interleaved, backward)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, position_ids, layout, interleaved, backward = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.layout, ctx.interleaved, ctx.backward = layout, interleaved, backward


def _backward(ctx, dq_out, dk_out):
    first_order_only("rope")
    cos, sin, position_ids = ctx.saved_tensors
    dq, dk = route(_rope, _rope_out_of_place, dq_out)(dq_out, dk_out, cos, sin, position_ids, ctx.layout,
                                                      ctx.interleaved, not ctx.backward)
    return dq, dk, None, None, None, None, None, None


_rope.register_autograd(_backward, setup_context=_setup_context)
_rope_eager = eager_autograd(_rope_out_of_place, _setup_context, _backward)


@triton_op("onepass::rope_", mutates_args=("q", "k"))
def _rope_inplace(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor], layout: str,
                  interleaved: bool) -> None:
    """Rotate q and k in place (no autograd: the public function refuses it when a gradient is needed)."""
    _rope_launch(q, k, cos, sin, position_ids, layout, interleaved, False, q, k)


# ---------------------------------------------------------------- public function


def _heads_seq(x: Tensor, layout: str) -> tuple[int, int]:
    return (x.shape[1], x.shape[2]) if layout == "bhsd" else (x.shape[2], x.shape[1])


def _check(q, k, cos, sin, position_ids, layout, style, inplace):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, t)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D ({layout}), got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    b, (_, s), d = q.shape[0], _heads_seq(q, layout), q.shape[-1]
    if k.shape[0] != b or _heads_seq(k, layout)[1] != s or k.shape[-1] != d:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, sequence and head dim ({layout})")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    r = cos.shape[-1] if cos.dim() else 0
    if r % 2 or not 2 <= r <= d:
        raise ValueError(f"cos/sin last dim (the rotated dims) must be even and in [2, {d}], got {r}")
    if position_ids is None:
        heads_seq = (1, s) if layout == "bhsd" else (s, 1)
        if tuple(cos.shape) not in ((s, r), (1, s, r), (b, s, r), (1, *heads_seq, r), (b, *heads_seq, r)):
            raise ValueError(f"cos/sin must be [S, R], [B or 1, S, R] or HF's unsqueezed 4-D form with S={s}, "
                             f"B={b}, R<={d}, got {tuple(cos.shape)}")
    else:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError("position_ids must be an int32 or int64 tensor")
        if tuple(position_ids.shape) not in {(s,), (1, s), (b, s)}:
            raise ValueError(f"position_ids must be [S], [1, S] or [B, S] with S={s}, B={b}, "
                             f"got {tuple(position_ids.shape)}")
        if cos.dim() not in (2, 3) or (cos.dim() == 3 and cos.shape[0] != 1):
            raise ValueError(f"with position_ids, cos/sin must be a [max_positions, R] table, got {tuple(cos.shape)}")
        if not torch.compiler.is_compiling() and position_ids.numel():
            # one device sync in eager; under torch.compile the kernel masks out-of-range rows instead
            lo, hi = int(position_ids.min()), int(position_ids.max())
            if lo < 0 or hi >= cos.shape[-2]:
                raise ValueError(f"position_ids must lie in [0, {cos.shape[-2]}), got values in [{lo}, {hi}]")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("rope does not differentiate through cos/sin: build them without grad (as HF does)")
    if inplace:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            raise ValueError("inplace=True is for inference: q and k must not require grad (use inplace=False)")
        if q.stride(-1) != 1 or k.stride(-1) != 1:
            raise ValueError("inplace=True needs q and k with a unit stride along the head dim")
        if q is k or (not torch.compiler.is_compiling() and q.device.type != "meta" and q.numel() and k.numel()
                      and q.data_ptr() == k.data_ptr()):  # (a traced or meta tensor has no address)
            raise ValueError("inplace=True needs q and k in separate memory: one tensor passed as both would be "
                             "rotated twice")
    check_same_device(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None = None,
         layout: str = "bhsd", style: str = "half", inplace: bool = False) -> tuple[Tensor, Tensor]:
    """Rotary embedding of q and k in one launch: HF's ``apply_rotary_pos_emb(q, k, cos, sin)``.

    ``layout``: "bhsd" ([batch, heads, seq, head_dim], HF's after the transpose) or "bshd"
    ([batch, seq, heads, head_dim], straight from the projection). k may have fewer heads
    than q (grouped-query attention). ``style``: "half" (Llama, NeoX: ``rotate_half``) or
    "interleaved" (GPT-J, Cohere: pairs (x[2i], x[2i+1])).

    cos/sin as Hugging Face's rotary embedding returns them: [B, S, R] (or [1, S, R],
    [S, R], or already unsqueezed at the heads dim), in any float dtype; or, with
    ``position_ids`` ([B, S], [1, S] or [S]), a [max_positions, R] table whose rows are
    gathered in the kernel (eager checks the ids' range on the host: one device sync).
    R = cos.shape[-1] may be less than head_dim (partial rotary): the rest passes through.
    The "interleaved" style takes full-width tables, each angle at 2i and 2i+1 (GPT-J's
    half-width tables: ``cos.repeat_interleave(2, -1)``).

    Returns (q', k') in q's and k's dtypes, computed in fp32. ``inplace=True`` writes into
    q and k and returns them; it is for inference and refuses inputs that require grad
    (autograd would need the overwritten q and k: use the out-of-place form to train).
    cos/sin get no gradient.
    """
    _check(q, k, cos, sin, position_ids, layout, style, inplace)
    interleaved = style == "interleaved"
    if not use_triton(q):
        q_out, k_out = reference.rope(q, k, cos, sin, position_ids, layout, style)
        return (q.copy_(q_out), k.copy_(k_out)) if inplace else (q_out, k_out)
    if inplace:
        _rope_inplace(q, k, cos, sin, position_ids, layout, interleaved)
        return q, k
    return route(_rope, _rope_out_of_place, q, k, autograd=_rope_eager)(q, k, cos, sin, position_ids, layout,
                                                                        interleaved, False)


# ------------------------------------------------------------------ the rotary tables


def _tables_launch(position_ids: Tensor, inv_freq: Tensor, scaling: float, dtype: torch.dtype):
    batch, seq_len = position_ids.shape
    half = inv_freq.shape[0]
    cos = torch.empty(batch, seq_len, 2 * half, dtype=dtype, device=position_ids.device)
    sin = torch.empty_like(cos)
    if cos.numel() == 0:
        return cos, sin
    block_f = next_power_of_2(half)
    block_t = max(1, TABLE_ELEMENTS // block_f)
    launch(_tables_kernel, (cdiv(batch * seq_len, block_t),), position_ids, inv_freq, cos, sin, batch * seq_len,
           seq_len, *position_ids.stride(), half, scaling, BLOCK_T=block_t, BLOCK_F=block_f,
           PDL=dependent_launch(cos), num_warps=4)
    return cos, sin


@triton_op("onepass::rope_tables", mutates_args=())
def _rope_tables(position_ids: Tensor, inv_freq: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _tables_launch(position_ids, inv_freq, scaling, dtype)


def rope_tables(position_ids: Tensor, inv_freq: Tensor, scaling: float = 1.0,
                dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """HF's rotary tables (cos, sin) [B, S, 2 * F] in ``dtype``, in one launch: with the angles
    ``position_ids[b, s] * inv_freq[f]`` in fp32, ``cos = cat(cos(angles), cos(angles)) * scaling``
    (sin the same), as a transformers rotary embedding's forward computes them (F = head_dim / 2
    frequencies). position_ids: integer [B, S]; inv_freq: float [F] (fp32 or a cast of it)."""
    if not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or position_ids.is_floating_point():
        raise ValueError(f"position_ids must be an integer tensor [batch, seq], got "
                         f"{tuple(position_ids.shape) if isinstance(position_ids, Tensor) else type(position_ids)}")
    check_float("inv_freq", inv_freq)
    if dtype not in (*FLOAT_DTYPES, torch.float64):
        raise TypeError(f"dtype must be a float dtype (float32, float16, bfloat16 or float64), got {dtype}")
    if inv_freq.dim() != 1:
        raise ValueError(f"inv_freq must be 1-D [head_dim / 2], got shape {tuple(inv_freq.shape)}")
    check_same_device(position_ids=position_ids, inv_freq=inv_freq)
    if not use_triton(position_ids):
        return reference.rope_tables(position_ids, inv_freq, scaling, dtype)
    inv_freq = inv_freq.contiguous()
    return route(_rope_tables, _tables_launch, inv_freq)(position_ids, inv_freq, float(scaling), dtype)
