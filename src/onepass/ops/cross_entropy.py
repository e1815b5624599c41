"""Cross-entropy over a vocabulary: loss, log-sum-exp, prediction and gradient in one pass.

Math, per row of V logits x with target t (eps = label_smoothing, c = softcap):

    z     = c * tanh(x / c)                          (softcap; z = x without it)
    lse   = log(sum_j exp(z_j))
    loss  = (1 - eps) * (lse - z_t) + eps * (lse - mean_j z_j) + z_loss * lse^2
    dz_j  = p_j * (1 + 2 * z_loss * lse) - eps / V - (1 - eps) * [j == t],   p = exp(z - lse)
    dx_j  = dz_j * (1 - (z_j / c)^2)                 (softcap chain rule)
    pred  = argmax_j z_j

Rows whose target is ``ignore_index`` give loss 0 and gradient 0; ``mean`` divides by
the number of the others (PyTorch's rule, label smoothing included), so a batch whose
every target is ignored gives nan, as F.cross_entropy does.

Byte budget (R rows of V logits, element size s), forward and backward together:

    unfused PyTorch (HF: logits.float(), F.cross_entropy)   fused minimum
    upcast copy: read R*V*s, write 4RV                       read logits   RVs
    log_softmax: read 4RV, write 4RV; nll/smoothing: read    write grad    RVs
    backward: read 4RV, write 4RV (softmax grad), cast RVs
    ~10 passes and three [R, V] float32 buffers              2 RVs

One kernel reads each row twice: pass 1 keeps the row's running max and sum-exp (one
exp an element, block reductions), the sum of z (smoothing) and the argmax; pass 2 walks
the row backwards, so the blocks pass 1 read last are still in L2, and writes the
gradient, in about the time of those three passes at the copy bandwidth (benchmarks/results/h200/loss.md).
Alternatives measured slower and dropped (per-lane statistics, a row held in registers, a row split
over a team of programs, programs looping over rows, cache hints) are listed in CHANGELOG.md.

The gradient is computed in the forward as if the loss's upstream gradient were 1
(Liger's trick: the logits are not read again in backward); the backward multiplies it
in place by the real upstream gradient, in a kernel whose programs skip every row whose
factor is exactly 1.0 (read on the device, no host sync), so ``loss.backward()`` costs
no extra pass. Consequences: the gradient is one [R, V] tensor of the logits' dtype held
from forward to backward (none with ``inplace_grad``, which writes it over the logits),
and a second backward through the same graph (``retain_graph=True``) raises. Rows with
an ignored target are not read at all unless lse or pred is requested.

Targets are checked without a host sync on CUDA: a small kernel counts the valid and
the out-of-range targets on the device (the count is also mean's divisor) and fails a
device assertion if any target is out of range; like PyTorch's own loss, the error then
surfaces at the next synchronisation as a device-side assertion (and the rows concerned
get a nan loss). On the CPU the check is free and raises a ValueError at once. The
reduction over rows is one more small kernel: the eager forward is three launches and the
buffers' allocations, where torch ops for the count's check, the sum, the division and the
cast cost a launch each (host time: benchmarks/host_overhead.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from onepass import reference
from onepass.ops.dispatch import (
    as_rows,
    cdiv,
    check_float,
    check_same_device,
    check_softcap,
    device_setting,
    eager_autograd,
    empty_output,
    first_order_only,
    flat,
    is_int,
    is_number,
    launch,
    next_power_of_2,
    num_programs_for,
    route,
    tracing,
    triton_op,
    use_triton,
)

REDUCTIONS = ("mean", "sum", "none")

# Columns of a row a program handles per step (one warp a 512), with the gradient written (two reads and a write
# a row) and without (one read); they depend on the row length and the GPU. Swept by benchmarks/tune_loss.py ce
# (H200 numbers in CHANGELOG.md, H100's in results/h100-80gb-hbm3/tune_ce.log).
CE_MAX_BLOCK = 8192
CE_MAX_BLOCK_NO_GRAD = 4096
CE_MAX_WARPS = 16
# With the gradient the best (max block, max warps) differs between Hopper GPUs, so it is looked up by GPU name (the
# defaults above elsewhere): benchmarks/tune_loss.py ce, results/h100-80gb-hbm3/tune_ce.log; checked against the
# default by benchmarks/check_ce_settings.py, results/h100-80gb-hbm3/check_ce_settings.log.
CE_GRAD_BY_DEVICE = {"H100": (32768, 32)}
TARGET_BLOCK = 1024  # targets counted a step by the check kernel
REDUCE_BLOCK = 1024  # per-row losses summed a step by the reduction kernel


def ce_settings(n_cols: int, with_grad: bool = True, device: torch.device | None = None) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for the cross-entropy kernels (on ``device``, if given)."""
    if with_grad:
        max_block, max_warps = device_setting(device, CE_GRAD_BY_DEVICE, (CE_MAX_BLOCK, CE_MAX_WARPS))
    else:
        max_block, max_warps = CE_MAX_BLOCK_NO_GRAD, CE_MAX_WARPS
    block = min(next_power_of_2(max(n_cols, 1)), max_block)
    return block, max(1, min(max_warps, block // 512))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _targets_kernel(target_ptr, counts_ptr, n_rows, n_cols, ignore_index, BLOCK: tl.constexpr):
    """counts = [non-ignored targets, those outside [0, V)], by one program (no zero-filled
    buffer to add into); with ``debug=True`` a target outside [0, V) fails a device assertion."""
    valid = tl.zeros([BLOCK], tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_rows, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        t = tl.load(target_ptr + offs, mask=offs < n_rows, other=ignore_index).to(tl.int64)
        ok = t != ignore_index
        valid += ok.to(tl.int32)
        bad += (ok & ((t < 0) | (t >= n_cols))).to(tl.int32)
    n_bad = tl.sum(bad, axis=0)
    tl.device_assert(n_bad == 0, "a target class index or token id is outside [0, V) and is not ignore_index")
    tl.store(counts_ptr, tl.sum(valid, axis=0))
    tl.store(counts_ptr + 1, n_bad)


@triton.jit
def _reduce_loss_kernel(rows_ptr, counts_ptr, out_ptr, n_rows, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """out = the sum of the float32 per-row losses (over the count counts[0] for mean), in out's
    dtype: one program, a fixed order (deterministic), one launch for what took four torch ops."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_rows, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(rows_ptr + offs, mask=offs < n_rows, other=0.0)
    total = tl.sum(acc, axis=0)
    if MEAN:
        total = total / tl.load(counts_ptr).to(tl.float32)
    tl.store(out_ptr, total.to(out_ptr.dtype.element_ty))


@triton.jit
def _capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        # tanh(y) = 1 - 2 / (exp(2y) + 1): one exp, exact limits at +-inf (libdevice's
        # tanh is unavailable in the interpreter)
        x = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))
    return x


@triton.jit
def _fold(x, a, ok, m, s, z_sum, arg, first_nan, softcap, HAS_SOFTCAP: tl.constexpr, WRITE_PRED: tl.constexpr,
          HAS_SMOOTHING: tl.constexpr):
    """Fold the logits x at positions a (where ok; after all earlier ones) into the row's
    running max m, sum of exp(z - m), sum of z, first position of the maximum and first
    position of a NaN (torch.argmax's answer where there is one)."""
    z = tl.where(ok, _capped(x.to(tl.float32), softcap, HAS_SOFTCAP), float("-inf"))
    m_block = tl.max(z, axis=0)
    if WRITE_PRED:
        arg = tl.where(m_block > m, tl.min(tl.where(z == m_block, a, 2**31 - 1), axis=0), arg)
        is_nan = z != z  # noqa: PLR0124 (the NaN test that runs the same in the interpreter)
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan, a, 2**31 - 1), axis=0))
    m_new = tl.maximum(m, m_block)
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
    if HAS_SMOOTHING:
        z_sum += tl.sum(tl.where(ok, z, 0.0), axis=0)
    return m_new, s, z_sum, arg, first_nan


@triton.jit
def _write_grad(x, a, ptrs, ok, a_t, lse, p_coef, smooth, hit, softcap, HAS_SOFTCAP: tl.constexpr):
    """Store d loss / d x of the logits x at positions a, the target's at a_t (before the
    upstream gradient)."""
    z = _capped(x.to(tl.float32), softcap, HAS_SOFTCAP)
    g = tl.exp(z - lse) * p_coef - smooth - tl.where(a == a_t, hit, 0.0)
    if HAS_SOFTCAP:
        tanh = z / softcap
        g *= 1.0 - tanh * tanh
    tl.store(ptrs, g.to(ptrs.dtype.element_ty), mask=ok)


@triton.jit
def _cross_entropy_fwd_kernel(
    x_ptr, target_ptr, grad_ptr, loss_ptr, lse_ptr, pred_ptr, counts_ptr, scale_ptr,
    x_row_stride, grad_row_stride, scale_stride,
    n_cols, ignore_index, label_smoothing, z_loss, softcap,
    MEAN: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    SCALED: tl.constexpr, WRITE_GRAD: tl.constexpr, WRITE_PRED: tl.constexpr, ALL_ROWS: tl.constexpr,
    ALIGN: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    t = tl.load(target_ptr + row).to(tl.int64)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < n_cols)
    # An ignored row is not read unless its lse or pred is wanted.
    reads = ALL_ROWS or valid

    # 16-byte loads and stores need 16-byte-aligned addresses and masks that hold for whole
    # groups of ALIGN elements. Positions a count from the ALIGN-aligned address at or before
    # the row's start, which is column c = a - lead; the row is cut into a head [lead, H
    # ALIGN), whole groups [H ALIGN, G ALIGN) and a tail [max(G, H) ALIGN, lead + n_cols).
    # Head and tail (under ALIGN elements each) take element-wise masks; the groups stream
    # in blocks. ALIGN is 1 where the rows cannot be aligned (then head and tail are empty).
    x_al = x_ptr + row * x_row_stride // ALIGN * ALIGN
    lead = (row * x_row_stride % ALIGN).to(tl.int32)
    H = tl.cdiv(lead, ALIGN)
    G = (lead + n_cols) // ALIGN
    edge = tl.arange(0, ALIGN)
    group_end = tl.where(reads, G * ALIGN, 0)

    # Pass 1: running max m and sum of exp(z - m) of the row (one exp an element, two
    # block reductions a block). The next block's load is issued before this block's math
    # (hand pipelining: the loop-carried max would otherwise leave one load in flight).
    cols = tl.arange(0, BLOCK_N)
    m = tl.full((), -3.0e38, tl.float32)
    s = tl.zeros((), tl.float32)
    z_sum = tl.zeros((), tl.float32)
    arg = lead + tl.zeros((), tl.int32)  # column 0 (as torch.argmax) when no logit beats the start (all -inf)
    first_nan = tl.full((), 2**31 - 1, tl.int32)
    x_next = tl.load(x_al + H * ALIGN + cols, mask=H * ALIGN + cols < group_end, other=0.0)
    head_ok = (edge >= lead) & (edge < H * ALIGN) & (edge < lead + n_cols)
    if ALIGN > 1:  # (empty otherwise: no reductions spent on them)
        head_reads = tl.where(reads, head_ok, False)  # not &: see norm.py's _norm_bwd_kernel
        m, s, z_sum, arg, first_nan = _fold(tl.load(x_al + edge, mask=head_reads, other=0.0), edge,
                                            head_reads, m, s, z_sum, arg, first_nan, softcap, HAS_SOFTCAP,
                                            WRITE_PRED, HAS_SMOOTHING)
    for start in range(H * ALIGN, group_end, BLOCK_N):
        a = start + cols
        x_block = x_next
        x_next = tl.load(x_al + a + BLOCK_N, mask=a + BLOCK_N < group_end, other=0.0)
        m, s, z_sum, arg, first_nan = _fold(x_block, a, a < group_end, m, s, z_sum, arg, first_nan, softcap,
                                            HAS_SOFTCAP, WRITE_PRED, HAS_SMOOTHING)
    tail = tl.maximum(G, H) * ALIGN + edge
    tail_ok = tail < lead + n_cols
    if ALIGN > 1:
        tail_reads = tl.where(reads, tail_ok, False)
        m, s, z_sum, arg, first_nan = _fold(tl.load(x_al + tail, mask=tail_reads, other=0.0), tail,
                                            tail_reads, m, s, z_sum, arg, first_nan, softcap, HAS_SOFTCAP,
                                            WRITE_PRED, HAS_SMOOTHING)
    # a row with nothing summed (ignored, not read; or all -inf) gets -inf without a log(0)
    lse = tl.where(s == 0.0, float("-inf"), m + tl.log(tl.where(s == 0.0, 1.0, s)))
    if WRITE_PRED:
        tl.store(pred_ptr + row, (tl.where(first_nan < 2**31 - 1, first_nan, arg) - lead).to(tl.int64))
    z_t = _capped(tl.load(x_row + tl.where(in_range, t, 0)).to(tl.float32), softcap, HAS_SOFTCAP)
    loss = lse - (1.0 - label_smoothing) * z_t
    if HAS_SMOOTHING:
        loss -= label_smoothing * z_sum / n_cols
    if HAS_Z_LOSS:
        loss += z_loss * lse * lse
    loss = tl.where(in_range, loss, float("nan"))
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    tl.store(lse_ptr + row, lse)

    if WRITE_GRAD:
        # Pass 2, backwards through the row (its last blocks are the likeliest still in
        # L2); in place when grad_ptr is x_ptr: each block is read before it is written.
        # Neither a load ahead nor evict_first pays here (measured slower: CHANGELOG.md). The gradient
        # rows have x's stride (ALIGN is 1 otherwise), so the same positions address them.
        g_al = grad_ptr + row * grad_row_stride // ALIGN * ALIGN
        scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32) if SCALED else 1.0
        if MEAN:
            scale = scale / tl.load(counts_ptr).to(tl.float32)
        p_coef = scale * (1.0 + 2.0 * z_loss * lse) if HAS_Z_LOSS else scale
        smooth = scale * label_smoothing / n_cols
        hit = scale * (1.0 - label_smoothing)
        group_end = tl.where(valid, G * ALIGN, 0)
        a_t = tl.where(in_range, t + lead, -1).to(tl.int32)  # the target's position (int32: fewer registers)
        n_blocks = tl.cdiv(tl.maximum(group_end - H * ALIGN, 0), BLOCK_N)
        for i in range(0, n_blocks):
            a = H * ALIGN + (n_blocks - 1 - i) * BLOCK_N + cols
            ok = a < group_end
            _write_grad(tl.load(x_al + a, mask=ok, other=0.0), a, g_al + a, ok, a_t, lse, p_coef, smooth, hit, softcap,
                        HAS_SOFTCAP)
        if ALIGN > 1:
            head_ok = tl.where(valid, head_ok, False)
            _write_grad(tl.load(x_al + edge, mask=head_ok, other=0.0), edge, g_al + edge, head_ok, a_t, lse, p_coef,
                        smooth, hit, softcap, HAS_SOFTCAP)
            tail_ok = tl.where(valid, tail_ok, False)
            _write_grad(tl.load(x_al + tail, mask=tail_ok, other=0.0), tail, g_al + tail, tail_ok, a_t, lse, p_coef,
                        smooth, hit, softcap, HAS_SOFTCAP)
        # an ignored row's gradient is zero: written without reading the row
        g_row = grad_ptr + row * grad_row_stride
        for start in range(tl.where(valid, n_cols, 0), n_cols, BLOCK_N):
            c = start + cols
            tl.store(g_row + c, tl.zeros([BLOCK_N], tl.float32).to(grad_ptr.dtype.element_ty), mask=c < n_cols)


@triton.jit
def _cross_entropy_bwd_kernel(grad_ptr, dloss_ptr, grad_row_stride, dloss_stride, n_rows, n_cols, rows_per_program,
                              BLOCK_N: tl.constexpr):
    """grad[row] *= dloss[row] in place; rows whose factor is exactly 1.0 are not touched."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    row_start = pid.to(tl.int64) * rows_per_program
    n_mine = tl.minimum(rows_per_program, n_rows - row_start)
    for i in range(0, n_mine):
        row = row_start + i
        g = tl.load(dloss_ptr + row * dloss_stride).to(tl.float32)
        for start in range(0, tl.where(g != 1.0, n_cols, 0), BLOCK_N):
            c = start + cols
            mask = c < n_cols
            ptr = grad_ptr + row * grad_row_stride + c
            x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptr, (x * g).to(grad_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------- launchers


def out_of_range_message(n_cols: int, ignore_index: int) -> str:
    """The error of a target outside [0, n_cols): every loss over class indices or token ids raises it (the GRPO
    and distillation losses too)."""
    return f"a target class index or token id is outside [0, {n_cols}) and is not ignore_index={ignore_index}"


def count_targets(target: Tensor, n_cols: int, ignore_index: int) -> Tensor:
    """int32 [valid, out of range] counts of a flat target, on its device; raises (CPU) or
    fails on the device (CUDA, no sync) if a target is outside [0, n_cols)."""
    counts = torch.empty(2, dtype=torch.int32, device=target.device)
    traced = tracing(counts)
    # In eager on a GPU the kernel asserts itself (compiled with debug=True: its device_assert is
    # kept), a launch less than torch._assert_async on the counts; traced, Inductor's own
    # assertion stands in (it launches the kernel without Triton's debug option).
    device_check = target.is_cuda and not traced
    launch(_targets_kernel, (1,), target, counts, target.numel(), n_cols, ignore_index, BLOCK=TARGET_BLOCK,
           **({"debug": True} if device_check else {}))
    message = out_of_range_message(n_cols, ignore_index)
    if target.is_cuda and traced:
        torch._assert_async(counts[1] == 0, message)
    elif not target.is_cuda and not traced and counts[1].item():  # (traced: no values to check; the run checks them)
        raise ValueError(message)
    return counts


def ce_rows(x2, t, grad2, loss, lse, pred, counts, scale, ignore_index, reduction, label_smoothing, z_loss, softcap,
            all_rows):
    """Run the loss kernel over the rows of x2 [R, V] (unit column stride).

    Writes per-row loss (0 where ignored), lse (float32), pred (if not None) and, if
    grad2 is not None, the gradient scaled by ``scale`` (None: 1; a float32 scalar, or one
    value a row) and by 1 / counts[0] for ``mean``; grad2 may be x2 itself.
    """
    rows, n_cols = x2.shape
    if rows == 0:
        return
    write_grad = grad2 is not None
    # 16-byte loads and stores: Triton sees them itself when the row length and strides are
    # multiples of 16 (it specializes such integers); other rows take the kernel's head /
    # groups / tail split, which needs 16-byte-aligned tensors and one stride for x and the
    # gradient. Rows that Triton already sees aligned (128256) take ALIGN = 1: the split's registers would slow them
    # (numbers in CHANGELOG.md).
    rows_of = (x2, grad2) if write_grad else (x2,)
    seen_by_triton = n_cols % 16 == 0 and all(r.stride(0) % 16 == 0 for r in rows_of)
    # (traced, the tensors have no addresses yet: such rows take the whole-row path there)
    splittable = (not write_grad or grad2.stride(0) == x2.stride(0)) and not tracing(x2) and all(
        r.data_ptr() % 16 == 0 for r in rows_of)
    align = 16 // x2.element_size() if splittable and not seen_by_triton else 1
    # the GPU's own setting for whole rows only: with the split's registers it was slower (numbers in CHANGELOG.md);
    # benchmarks/check_ce_settings.py checks both kinds of row (results/h100-80gb-hbm3/check_ce_settings.log)
    block, num_warps = ce_settings(n_cols, write_grad, x2.device if align == 1 else None)
    launch(_cross_entropy_fwd_kernel, (rows,),
        x2, t, grad2 if write_grad else x2, loss, lse, pred if pred is not None else x2, counts,
        scale if scale is not None else t,  # (a placeholder that is an input: see dispatch.triton_op)
        x2.stride(0), grad2.stride(0) if write_grad else 0, scale.stride(0) if scale is not None and scale.dim() else 0,
        n_cols, ignore_index, label_smoothing, z_loss, softcap or 1.0,
        MEAN=reduction == "mean", HAS_SMOOTHING=label_smoothing > 0, HAS_Z_LOSS=z_loss != 0,
        HAS_SOFTCAP=softcap is not None, SCALED=scale is not None, WRITE_GRAD=write_grad, WRITE_PRED=pred is not None,
        ALL_ROWS=all_rows, ALIGN=align, BLOCK_N=block, num_warps=num_warps,
    )


def reduce_loss(loss_rows: Tensor, counts: Tensor, reduction: str, shape, dtype: torch.dtype) -> Tensor:
    """Per-row float32 losses -> the reduced loss, in ``dtype`` (deterministic: no atomics)."""
    if reduction == "none":
        return loss_rows.view(shape).to(dtype)
    if loss_rows.requires_grad:  # (memory="low" differentiates its rows: torch's ops, which autograd knows)
        total = loss_rows.sum()
        return (total / counts[0] if reduction == "mean" else total).to(dtype)
    loss = torch.empty((), dtype=dtype, device=loss_rows.device)
    launch(_reduce_loss_kernel, (1,), loss_rows, counts, loss, loss_rows.numel(), MEAN=reduction == "mean",
           BLOCK=REDUCE_BLOCK)
    return loss


def _fwd_launch(x, target, grad_buffer, ignore_index, reduction, label_smoothing, z_loss, softcap, return_pred,
                all_rows):
    n_cols = x.shape[-1]
    x2 = as_rows(x)
    t = flat(target)
    rows = t.numel()
    counts = count_targets(t, n_cols, ignore_index)
    loss_rows = torch.empty(rows, dtype=torch.float32, device=x.device)
    lse = torch.empty(target.shape, dtype=torch.float32, device=x.device)
    pred = torch.empty(target.shape if return_pred else 0, dtype=torch.int64, device=x.device)
    grad2 = grad_buffer.view(rows, n_cols) if grad_buffer is not None else None
    ce_rows(x2, t, grad2, loss_rows, lse, pred if return_pred else None, counts, None, ignore_index, reduction,
            label_smoothing, z_loss, softcap, all_rows)
    return reduce_loss(loss_rows, counts, reduction, target.shape, x.dtype), lse, pred


def scale_rows_(grad2: Tensor, dloss: Tensor) -> None:
    """grad2 [R, C] *= dloss (a scalar, or one value a row), in place; skips factors of 1.0."""
    rows, n_cols = grad2.shape
    if rows == 0 or n_cols == 0:
        return
    dloss = dloss.reshape(-1 if dloss.dim() else 1)
    if dloss.numel() > 1:
        dloss = dloss.contiguous()
    elif grad2.is_contiguous():
        # One factor for all: regroup g rows into one whose length is a multiple of 16
        # elements, so Triton sees aligned rows and moves them in 16-byte vectors (a
        # vocabulary like GPT-2's 50257 otherwise goes element by element).
        g = 16 // math.gcd(n_cols, 16)
        if rows % g == 0:
            rows, n_cols = rows // g, n_cols * g
            grad2 = grad2.view(rows, n_cols)
    programs = max(1, min(rows, num_programs_for(grad2.device) * 4))
    block, num_warps = ce_settings(n_cols)
    launch(_cross_entropy_bwd_kernel, (programs,),
        grad2, dloss, grad2.stride(0), 1 if dloss.numel() > 1 else 0, rows, n_cols, cdiv(rows, programs),
        BLOCK_N=block, num_warps=num_warps,
    )


# ------------------------------------------------------------------ registered ops


def _cross_entropy_fwd_launch(
    logits: Tensor, target: Tensor, ignore_index: int, reduction: str, label_smoothing: float, z_loss: float,
    softcap: Optional[float], compute_grad: bool, return_pred: bool, all_rows: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (loss, lse, pred, grad); grad (d loss / d logits for an upstream gradient
    of 1) is empty unless compute_grad, pred is empty unless return_pred."""
    grad = empty_output(logits) if compute_grad else logits.new_empty(0)
    loss, lse, pred = _fwd_launch(logits, target, grad if compute_grad else None, ignore_index, reduction,
                                  label_smoothing, z_loss, softcap, return_pred, all_rows)
    return loss, lse, pred, grad


_cross_entropy_fwd = triton_op("onepass::cross_entropy_fwd")(_cross_entropy_fwd_launch)


def _cross_entropy_fwd_inplace_launch(
    logits: Tensor, target: Tensor, ignore_index: int, reduction: str, label_smoothing: float, z_loss: float,
    softcap: Optional[float], return_pred: bool, all_rows: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Like cross_entropy_fwd with compute_grad, but the gradient overwrites the logits."""
    return _fwd_launch(logits, target, logits, ignore_index, reduction, label_smoothing, z_loss, softcap, return_pred,
                       all_rows)


_cross_entropy_fwd_inplace = triton_op("onepass::cross_entropy_fwd_inplace", mutates_args=("logits",))(
    _cross_entropy_fwd_inplace_launch)


def scaled_grad(grad: Tensor, dloss: Tensor) -> Tensor:
    """The saved forward gradient times the upstream one: in place in eager (free when the
    upstream gradient is 1); a plain multiply while traced (torch.compile, AOT), whose graph
    owns memory and may not mutate a saved forward output."""
    if torch.compiler.is_compiling() or is_fake(grad):
        return grad * (dloss.unsqueeze(-1) if dloss.dim() else dloss)
    if grad.numel():  # (an empty grad has nothing to scale, and view(-1, 0) is ambiguous)
        scale_rows_(grad.view(-1, grad.shape[-1]) if grad.dim() > 1 else grad.view(1, -1), dloss)
    return grad


def consume_forward_grad(ctx):
    if getattr(ctx, "grad_consumed", False):
        raise RuntimeError("onepass cross_entropy: the gradient computed in the forward was already used by a first "
                           "backward; a second backward through the same graph (retain_graph=True) is not supported")
    ctx.grad_consumed = True


def _setup_context(ctx, inputs, output):
    loss, lse, pred, grad = output
    ctx.save_for_backward(grad)
    ctx.mark_non_differentiable(lse, pred, grad)
    # no zero-filled gradients for the outputs nobody differentiates (a gradient-sized
    # zeros tensor for the saved gradients otherwise: twice the gradients' memory)
    ctx.set_materialize_grads(False)


def _backward(ctx, dloss, _dlse, _dpred, _dgrad):
    if dloss is None:  # only lse or pred was used
        return (None,) * 10
    first_order_only("cross_entropy")
    consume_forward_grad(ctx)
    (grad,) = ctx.saved_tensors
    return (scaled_grad(grad, dloss),) + (None,) * 9


_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)
_cross_entropy_fwd_eager = eager_autograd(_cross_entropy_fwd_launch, _setup_context, _backward)


class _InplaceGradCrossEntropy(torch.autograd.Function):
    """The logits' storage receives their gradient in the forward; backward hands it on."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, label_smoothing, z_loss, softcap, return_pred, all_rows):
        op = route(_cross_entropy_fwd_inplace, _cross_entropy_fwd_inplace_launch, logits)
        loss, lse, pred = op(logits, target, ignore_index, reduction, label_smoothing, z_loss,
                                                     softcap, return_pred, all_rows)
        # saved after the write (it now holds the gradient), as a detached alias so that
        # autograd may hand the storage to a leaf's .grad instead of cloning it
        ctx.save_for_backward(logits.detach())
        ctx.mark_non_differentiable(lse, pred)
        return loss, lse, pred

    @staticmethod
    def backward(ctx, dloss, _dlse, _dpred):
        first_order_only("cross_entropy")
        consume_forward_grad(ctx)
        (grad,) = ctx.saved_tensors
        return (scaled_grad(grad, dloss),) + (None,) * 8


# ---------------------------------------------------------------- public functions


def check_target(target, target_shape, whose: str = "the input's") -> None:
    """Class indices (int64 or int32) of the input's shape without its last dim."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be int64 or int32 class indices, got {target.dtype}")
    if target.shape != target_shape:
        raise ValueError(f"target must have shape {tuple(target_shape)} ({whose} without its last dim), "
                         f"got {tuple(target.shape)}")


def check_loss_options(target, n_cols, ignore_index, reduction, label_smoothing, z_loss, softcap, target_shape):
    check_target(target, target_shape)
    if n_cols == 0:
        raise ValueError("the class (last) dim must not be empty")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (is_number(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    check_softcap(softcap)
    if not is_int(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None, *,
                  inplace_grad: bool = False, return_lse: bool = False, return_pred: bool = False):
    """Cross-entropy of ``logits`` [*, V] against class indices ``target`` [*].

    Like ``F.cross_entropy(logits, target, ignore_index=..., reduction=...,
    label_smoothing=...)`` for 2-D logits, with these differences:

    - the class dim is the last one for any rank (PyTorch puts it at dim 1);
    - the third positional argument is ``ignore_index``, where PyTorch's is the class
      ``weight``, which this op does not take (a tensor there is refused as ``ignore_index``);
      the loss is returned in the logits' dtype (as PyTorch does),
      but computed and reduced in float32;
    - ``z_loss`` adds ``z_loss * lse^2`` per non-ignored row (PaLM's z-loss);
    - ``softcap`` caps the logits first, ``softcap * tanh(logits / softcap)`` (Gemma 2);
    - ``inplace_grad=True`` writes the gradient over the logits in the forward (when a
      gradient is needed): no [*, V] buffer is allocated, and the logits' values are gone
      afterwards (autograd's version counter flags any other use of them in backward);
      the logits must then be viewable as [rows, V];
    - out-of-range targets: see the module docstring (no host sync on CUDA).

    Returns the loss; with ``return_lse`` or ``return_pred``, ``(loss, lse, pred)`` where
    lse is the float32 log-sum-exp of each row (of the softcapped logits) and pred the
    argmax, each [*] and None unless requested. Neither carries a gradient.
    """
    check_float("logits", logits)
    if logits.dim() == 0:
        raise ValueError("logits must have at least one dimension (the classes)")
    check_loss_options(target, logits.shape[-1], ignore_index, reduction, label_smoothing, z_loss, softcap,
                       logits.shape[:-1])
    check_same_device(logits=logits, target=target)
    if softcap is not None:
        softcap = float(softcap)
    args = (ignore_index, reduction, float(label_smoothing), float(z_loss), softcap)
    if not use_triton(logits):
        loss = reference.cross_entropy(logits, target, *args)
        if not (return_lse or return_pred):
            return loss
        lse, pred = reference.logsumexp_argmax(logits.detach(), softcap)
        return loss, (lse if return_lse else None), (pred if return_pred else None)

    all_rows = return_lse or return_pred
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    if need_grad and inplace_grad:
        if logits.stride(-1) != 1:
            raise ValueError("inplace_grad needs logits with unit stride in the last dim")
        try:
            rows = logits.view(-1, logits.shape[-1])
        except RuntimeError as err:
            raise ValueError("inplace_grad needs logits viewable as [rows, V] without a copy") from err
        if rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]:  # (an expanded tensor, ...)
            raise ValueError("inplace_grad needs logits whose rows do not share memory (a row's gradient "
                             "would overwrite logits another row still reads); pass inplace_grad=False")
        loss, lse, pred = _InplaceGradCrossEntropy.apply(logits, target, *args, return_pred, all_rows)
    else:
        op = route(_cross_entropy_fwd, _cross_entropy_fwd_launch, logits, autograd=_cross_entropy_fwd_eager)
        loss, lse, pred, _ = op(logits, target, *args, need_grad, return_pred, all_rows)
    if not (return_lse or return_pred):
        return loss
    return loss, (lse if return_lse else None), (pred if return_pred else None)
