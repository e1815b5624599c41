"""Linear layers of a decode step: a few rows against several weights, in one launch.

Math (x [M, K] with M <= MAX_ROWS, weights W_i [N_i, K], biases b_i [N_i]):

    decode_linear:        y_i = x W_i^T + b_i                for i = 1..3 (q, k, v)
                          y   = x W^T + b + r                (one weight and a residual r: down_proj)
    decode_gated_linear:  y   = act(x W_g^T + b_g) * (x W_u^T + b_u)   (gate, up)

At a few rows a linear layer is a matrix-vector product: its time is the read of the
weights. Byte budget (element size s):

    op                     unfused (HF, cuBLAS)                    fused minimum
    q, k, v projections    3 launches, read W_q, W_k, W_v          1 launch, read the weights once
    gated MLP input        2 GEMVs + write/read gate, up + act     1 launch, read W_g, W_u; write y
    down_proj + residual   GEMV, write y, then read y, r; write    1 launch, read W, r; write y

cuBLAS's matrix-vector kernels read small weights well below the copy bandwidth, the
smaller the further (benchmarks/results/h200/decode_linear.md). Here each program owns BLOCK_N output
features of one weight (the q, k and v tiles are one grid) and streams their rows over K
with ``tl.dot`` on the rows padded to BLOCK_M, so the tensor cores do the arithmetic and
the loads are all there is; the gated form owns the same features of both weights and
applies the activation and product before its one store; a residual is added the same way.

Narrow outputs over long inputs (a small model's down_proj: 1536 or 2048 features from
8960 or 8192; launched as programmatic dependents, its o_proj and q/k/v too) give too few
tiles to keep HBM busy: there the K loop is split in SPLIT_K
programs per tile, each storing its fp32 sums; the tile's last split to finish (a counter
per tile, zeroed again by that split) adds them up in split order, so the result does not
depend on which finished first, and applies the bias and residual. Such launches with the
same weights share the counters, so they must not run at once: one model's decode steps on
two streams at a time (two CUDA graphs replayed together on two streams) would mix them up.

The layer's RMSNorm is not folded into this launch: the per-tile reduction and re-layout of x
in the K loop cost more than the separate norm launch (benchmarks/results/h200/decode_norm_fold.log).

Inference only: no autograd formula (a call that would need one raises). Rows above
MAX_ROWS run cuBLAS (``F.linear``), which wins once the product is no longer a read of
the weights.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from onepass import reference
from onepass.ops.activation import GATED_ACTIVATIONS, act_and_grad
from onepass.ops.attention import precision_for
from onepass.ops.dispatch import (
    as_rows,
    cdiv,
    check_float,
    check_linear,
    check_same_device,
    check_tensor_lists,
    dependent_launch,
    interpreting,
    launch,
    launch_next_kernel,
    next_power_of_2,
    num_programs_for,
    route,
    tracing,
    triton_op,
    use_triton_dot,
    wait_for_previous_kernel,
)

# the M side of one program's tl.dot; more rows run cuBLAS. Alone, the gated pair lost to cuBLAS at 64 rows, but a
# whole decode step of 48-64 rows is faster with these launches (q/k/v in one, the residual added, PDL): the
# numbers are in decode_max_rows.log and CHANGELOG.md
MAX_ROWS = 64
MAX_WEIGHTS = 3
# BLOCK_N: the widest of 64/32/16 that still gives every 2 SMs a program (by SM count); BLOCK_K: 16 KB of weight
# a stage (numbers in CHANGELOG.md; against cuBLAS: `onepass bench ops --suite decode_linear`). The gated pair:
# 32 features, BLOCK_K 128, 3 stages, the best or near it at every shape timed, where the plain rule's widest
# tiles left the gate/up pair slower (benchmarks/tune_decode_linear.py; numbers in CHANGELOG.md).
BLOCK_K = {16: 512, 32: 256, 64: 256}
GATED_CONFIG = (32, 128, 4, 3, 1)
NUM_WARPS, NUM_STAGES = 4, 4
INTERPRETER_CONFIG = (16, 64, 1, 1, 1)
# Where the rule above would take 16 features over at least SPLIT_K_MIN_INPUTS inputs (the second: launched as
# a programmatic dependent, whose wait hides the splits' last adds): 32 features, K split in 4. H100 decode
# steps: results/h100-80gb-hbm3/decode_linear_split_k.log (one layer) and decode_step_variants.log
SPLIT_K_MIN_INPUTS, SPLIT_K_CONFIG = (4096, 1024), (32, 128, 4, 4, 4)
SHARED_MEMORY = 160 * 1024  # bytes of pipelined tiles a program may hold (sm_90's limit: 227 KiB a block)

# ----------------------------------------------------------------------------- kernel


@triton.jit
def _select(in1, in2, a, b, c):
    """a for the tiles of weight 0, b for weight 1's, c for weight 2's."""
    return tl.where(in2, c, tl.where(in1, b, a))


@triton.jit
def _decode_linear_kernel(
    x_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, y0_ptr, y1_ptr, y2_ptr, r_ptr, part_ptr, count_ptr,
    n_rows, n_in, n0, n1, n2, x_row_stride, r_row_stride, tiles0, tiles1,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    split = tl.program_id(0) % SPLIT_K  # the splits of one tile are neighbours in the grid
    pid = tl.program_id(0) // SPLIT_K
    if GATED:  # every program: the same features of the gate (w0) and up (w1) weights
        w_ptr, b_ptr, y_ptr, n_out, tile = w0_ptr, b0_ptr, y0_ptr, n0, pid
    else:  # the grid runs the feature tiles of weight 0, then weight 1's, then weight 2's
        in1, in2 = pid >= tiles0, pid >= tiles0 + tiles1
        w_ptr, b_ptr, y_ptr = _select(in1, in2, w0_ptr, w1_ptr, w2_ptr), _select(in1, in2, b0_ptr, b1_ptr, b2_ptr), \
            _select(in1, in2, y0_ptr, y1_ptr, y2_ptr)
        n_out, tile = _select(in1, in2, n0, n1, n2), pid - _select(in1, in2, 0, tiles0, tiles0 + tiles1)
    rows = tl.arange(0, BLOCK_M)
    feats = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, feat_ok = rows < n_rows, feats < n_out
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    w_rows = feats.to(tl.int64)[:, None] * n_in  # weights are contiguous [N, K]
    # The epilogue's bias and residual asked for now, under the weights' stream: loaded in the epilogue, their round
    # trip would follow the weights' (and a split tile's count) at every program's end
    # (results/h200/decode_linear_epilogue_loads.log)
    if HAS_BIAS:
        bias = tl.load(b_ptr + feats, mask=feat_ok, other=0.0).to(tl.float32)
        if GATED:
            bias_up = tl.load(b1_ptr + feats, mask=feat_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # one weight only
        res = tl.load(r_ptr + rows.to(tl.int64)[:, None] * r_row_stride + feats[None, :],
                      mask=row_ok[:, None] & feat_ok[None, :], other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    chunk = tl.cdiv(tl.cdiv(n_in, SPLIT_K), BLOCK_K) * BLOCK_K  # of K, a split's
    k_lo = split * chunk
    k_hi = tl.minimum(k_lo + chunk, n_in)
    for k in range(k_lo, k_hi, BLOCK_K):
        k_ok = k + ks < k_hi
        x = tl.load(x_rows + (k + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = feat_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + w_rows + (k + ks)[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if GATED:
            u = tl.load(w1_ptr + w_rows + (k + ks)[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(x, tl.trans(u), acc_up, input_precision=PRECISION)
    launch_next_kernel(PDL)  # not before the loop: see launch_next_kernel
    if SPLIT_K > 1:  # each split stores its sums; the tile's last split to finish adds them up, in split order
        cell = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        slot_len: tl.constexpr = (1 + GATED) * BLOCK_M * BLOCK_N  # a split's sums: one tile, or the gated pair
        slot = part_ptr + (pid * SPLIT_K + split) * slot_len
        tl.store(slot + cell, acc, mask=row_ok[:, None])
        if GATED:
            tl.store(slot + BLOCK_M * BLOCK_N + cell, acc_up, mask=row_ok[:, None])
        tl.debug_barrier()  # every thread's sums stored before the count that releases them
        if tl.atomic_add(count_ptr + pid, 1, sem="acq_rel") < SPLIT_K - 1:
            return
        tl.store(count_ptr + pid, 0)  # zero again for the next launch: every split has counted
        first = part_ptr + pid * SPLIT_K * slot_len
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # (from L2: the other splits' stores are not in this SM's L1)
            acc += tl.load(first + s * slot_len + cell, mask=row_ok[:, None], other=0.0,
                           cache_modifier=".cg")
            if GATED:
                acc_up += tl.load(first + s * slot_len + BLOCK_M * BLOCK_N + cell,
                                  mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        acc += bias[None, :]
        if GATED:
            acc_up += bias_up[None, :]
    if GATED:
        acc, _ = act_and_grad(acc, ACT, False)
        acc = acc * acc_up
    if HAS_RESIDUAL:
        acc += res
    y = y_ptr + rows[:, None] * n_out + feats[None, :]  # outputs are contiguous [n_rows, n_out]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & feat_ok[None, :])


# ---------------------------------------------------------------------------- launcher


def _config(x: Tensor, block_m: int, n_in: int, n_features: int, gated: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) for ``n_features`` outputs in all (see BLOCK_K)."""
    if interpreting():
        return INTERPRETER_CONFIG
    if gated:
        return GATED_CONFIG
    half_the_sms = num_programs_for(x.device) // 2
    block_n = next((n for n in (64, 32) if cdiv(n_features, n) >= half_the_sms), 16)
    if block_n == 16 and n_in >= SPLIT_K_MIN_INPUTS[dependent_launch(x)]:
        return SPLIT_K_CONFIG
    block_k = BLOCK_K[block_n]
    per_stage = (block_m + block_n) * block_k * x.element_size()
    return block_n, block_k, NUM_WARPS, max(1, min(NUM_STAGES, SHARED_MEMORY // per_stage)), 1


# (device, first weight's address) -> int32 counters of a split-K launch's tiles, zero between launches (each
# tile's last split zeroes its own). Not per stream: a CUDA graph captured after an eager call reuses them, with
# no fill in the graph. Two launches that share counters must not run at once (see the module's docstring).
_split_counts: dict = {}


def _counters(x: Tensor, weight: Tensor, n_tiles: int) -> Tensor:
    key = (x.device, weight.data_ptr())
    counts = _split_counts.get(key)
    if counts is None or counts.numel() < n_tiles:
        counts = _split_counts[key] = torch.zeros(n_tiles, dtype=torch.int32, device=x.device)
    return counts


def _decode_linear_launch(x: Tensor, weights: list[Tensor], biases: list[Tensor | None], act: int,
                          residual: Tensor | None = None) -> list[Tensor]:
    """act < 0: one output per weight (plus ``residual``, with one weight); else the gated
    product of weights[0] (gate) and [1] (up)."""
    gated = act >= 0
    x2 = as_rows(x)
    n_rows, n_in = x2.shape
    outs = [torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype, device=x.device)
            for w in weights[:1 if gated else None]]
    if n_rows == 0:
        return outs
    block_m = max(16, next_power_of_2(n_rows))
    block_n, block_k, num_warps, num_stages, split_k = _config(x, block_m, n_in, sum(o.shape[-1] for o in outs), gated)
    ws = [w.contiguous() for w in weights] + [weights[0]] * (MAX_WEIGHTS - len(weights))
    has_bias = any(b is not None for b in biases)
    bs = ([b.contiguous() if b is not None else x.new_zeros(w.shape[0]) for b, w in zip(biases, weights)]
          if has_bias else [])  # the kernel reads a bias at unit stride
    bs += [ws[0]] * (MAX_WEIGHTS - len(bs))
    # Absent outputs' placeholders: the input (see dispatch.triton_op); traced, a scratch value of this op's own, since
    # torch's analysis takes the output pointer the kernel selects at run time as written, all three (the input would
    # be cloned and copied back each call)
    spare = x2.new_empty(1) if tracing(x2) and len(outs) < MAX_WEIGHTS else x2
    ys = outs + [spare] * (MAX_WEIGHTS - len(outs))
    r2 = as_rows(residual) if residual is not None else x2
    ns = [w.shape[0] for w in weights] + [0] * (MAX_WEIGHTS - len(weights))
    tiles = [cdiv(n, block_n) for n in ns]
    n_tiles = tiles[0] if gated else sum(tiles)
    split_k = 1 if tracing(x2) else max(1, min(split_k, cdiv(n_in, block_k)))
    slot_len = (1 + gated) * block_m * block_n
    parts, counts = ((torch.empty(n_tiles * split_k * slot_len, dtype=torch.float32, device=x.device),
                      _counters(x2, ws[0], n_tiles)) if split_k > 1 else (x2, x2))
    launch(_decode_linear_kernel, (n_tiles * split_k,),
           x2, *ws, *bs, *ys, r2, parts, counts, n_rows, n_in, *ns, x2.stride(0), r2.stride(0), tiles[0], tiles[1],
           GATED=gated, ACT=max(act, 0), HAS_BIAS=has_bias, HAS_RESIDUAL=residual is not None,
           PRECISION=precision_for(x.dtype), SPLIT_K=split_k,
           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PDL=dependent_launch(x2), num_warps=num_warps,
           num_stages=num_stages)
    return outs


@triton_op("onepass::decode_linear", mutates_args=())
def _decode_linear(x: Tensor, weights: list[Tensor], biases: list[Optional[Tensor]], act: int,
                   residual: Optional[Tensor] = None) -> list[Tensor]:
    return _decode_linear_launch(x, weights, biases, act, residual)


# ---------------------------------------------------------------- public functions


def _check(x: Tensor, weights: list[Tensor], biases: list[Tensor | None] | None,
           residual: Tensor | None = None) -> list[Tensor | None]:
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the input features)")
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"weights must be 1 to {MAX_WEIGHTS} tensors, got {len(weights)}")
    biases = list(biases) if biases is not None else [None] * len(weights)
    if len(biases) != len(weights):
        raise ValueError(f"biases must be one per weight ({len(weights)}), got {len(biases)}")
    for i, (w, b) in enumerate(zip(weights, biases)):
        check_linear("x", x, f"weights[{i}]", w, f"biases[{i}]", b)
    if residual is not None:
        if len(weights) != 1:
            raise ValueError(f"residual needs exactly one weight, got {len(weights)}")
        out_shape = (*x.shape[:-1], weights[0].shape[0])
        if tuple(residual.shape) != out_shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must be the output's shape {out_shape} and x's dtype {x.dtype}, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
    check_same_device(x=x, **{f"weights[{i}]": w for i, w in enumerate(weights)},
                      **{f"biases[{i}]": b for i, b in enumerate(biases)}, residual=residual)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, *weights, *biases, residual)):
        raise ValueError("decode_linear and decode_gated_linear are inference only (no autograd): call them under "
                         "torch.no_grad() or on tensors that do not require grad; use F.linear for training")
    return biases


def rows_fit(x: Tensor) -> bool:
    """Whether x [*, K] has at most MAX_ROWS rows, the kernel's case."""
    return x.shape[-1] == 0 or x.numel() // x.shape[-1] <= MAX_ROWS


def _kernel_runs(x: Tensor) -> bool:
    return use_triton_dot(x) and rows_fit(x)


def decode_linear(x: Tensor, weights: list[Tensor], biases: list[Tensor | None] | None = None,
                  residual: Tensor | None = None) -> tuple[Tensor, ...]:
    """``tuple(F.linear(x, w, b) for w, b in zip(weights, biases))`` in one launch (inference).

    x [*, K]; 1 to 3 weights [N_i, K] of x's dtype (e.g. the q, k and v projections);
    ``biases``: None or one optional [N_i] bias per weight. ``residual`` (one weight only):
    a tensor of the output's shape and x's dtype added before the one store, so
    ``(residual + F.linear(x, w, b),)`` (a decoder layer's down projection and the residual
    add after it), summed in fp32 and rounded once. For at most MAX_ROWS rows of x (a decode
    step); more rows run ``F.linear`` per weight.
    """
    check_tensor_lists(weights=weights, biases=biases)
    weights = list(weights)  # (once: an iterator would be empty the second time)
    biases = _check(x, weights, biases, residual)
    if not _kernel_runs(x):
        return reference.decode_linear(x, weights, biases, residual)
    return tuple(route(_decode_linear, _decode_linear_launch, x)(x, weights, biases, -1, residual))


def decode_gated_linear(x: Tensor, gate_weight: Tensor, up_weight: Tensor, activation: str = "silu",
                        gate_bias: Tensor | None = None, up_bias: Tensor | None = None) -> Tensor:
    """``act(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias)`` in one
    launch (inference): a gated MLP's input side. ``activation``: "silu" (SwiGLU),
    "gelu_tanh" or "gelu" (GeGLU, tanh-approximated or exact); rows as in ``decode_linear``."""
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(GATED_ACTIVATIONS)}, got {activation!r}")
    return decode_gated(x, gate_weight, up_weight, GATED_ACTIVATIONS[activation], gate_bias, up_bias)


def decode_gated(x: Tensor, gate_weight: Tensor, up_weight: Tensor, act: int, gate_bias: Tensor | None = None,
                 up_bias: Tensor | None = None) -> Tensor:
    """``decode_gated_linear`` for an activation id (activation.SILU, GELU_TANH, GELU_ERF), for
    callers that pick the activation by id."""
    biases = _check(x, [gate_weight, up_weight], [gate_bias, up_bias])
    if gate_weight.shape != up_weight.shape:
        raise ValueError(f"up_weight must have gate_weight's shape {tuple(gate_weight.shape)}, "
                         f"got {tuple(up_weight.shape)}")
    if not _kernel_runs(x):
        name = next(k for k, v in GATED_ACTIVATIONS.items() if v == act)
        return reference.decode_gated_linear(x, gate_weight, up_weight, name, gate_bias, up_bias)
    return route(_decode_linear, _decode_linear_launch, x)(x, [gate_weight, up_weight], biases, act)[0]
