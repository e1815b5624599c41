"""Knowledge distillation through both LM heads (generalized JSD + hard CE), never materialising all the logits.

Math, per token (z = student logits, y = teacher logits, x the student's hidden state; T the
temperature, n the number of tokens whose target is not ignore_index, at least 1):

    p = softmax(z / T),  q = softmax(y / T),  m = (1 - beta) p + beta q
    JSD_beta = beta KL(q || m) + (1 - beta) KL(p || m)      0 < beta < 1
             = KL(q || p)  (forward KL)                      beta = 0
             = KL(p || q)  (reverse KL)                      beta = 1
    loss    = sum over valid tokens of [w_soft JSD_beta + w_hard (lse(z) - z_target)] / n

    d loss / d z = w_soft / (n T) * dJSD + w_hard / n * (softmax(z) - onehot(target)), where
    dJSD = p - q (beta = 0);  p (log p - log q - K), K = KL(p || q) (beta = 1);
           (1 - beta) p (log p - log m - K), K = KL(p || m) (0 < beta < 1)
    dx = dz Ws,  dWs = dz^T x,  dbs = sum over tokens of dz      (the teacher gets no gradient)

Semantics follow TRL's GKD ``generalized_jsd_loss`` (Eq. 1 of arXiv:2306.13649, the mixture
m weighted beta on the teacher), where Liger's LigerFusedLinearJSDLoss agrees with it: the logits
divided by T before both softmaxes, no T^2 factor; beta = 0 and 1 are the forward and reverse
KL (the mixture formula itself tends to 0 at both ends, so both define the limits as these);
the hard CE on the untempered student logits (Liger's). Where they differ, or Liger is unclear:
without a target every token counts and there is no hard loss (TRL's labels=None; Liger needs
labels); the mean divides by the non-ignored count clamped to 1, so an all-ignored batch gives 0
(Liger, and TRL's newer trainers; linear_cross_entropy gives nan there, as F.cross_entropy);
student and teacher vocabularies must match (Liger pads the student's with zero logits, a
silent change of the student's distribution).

Per chunk of C tokens, cuBLAS writes the student's logits [C, V] into one reused buffer and the
teacher's into another (each in its hidden's dtype); one row kernel reads both rows and writes
the row's loss (float32, scaled by its weight / n) and d loss / d z over the student's logits;
then dx, dW as in linear_cross_entropy.py (same chunk rule, dW accumulated in float32 by
default). Gradients are computed in the forward, the backward only scales them.

Row kernel passes over the two rows (fp32 math): 1) running max and sum of exp of z / T, y / T
(and of z when T != 1 with a hard loss); 2) backwards, KL sums (the loss; for beta > 0 also K,
which the gradient needs before any element is written); 3) forwards, the gradient (for beta = 0
and hard-only, pass 2 writes it: 2 passes). Walking the passes in alternating directions keeps
the blocks last read in L2 for the next pass. The mixture's log m is computed as
max(log p, log q) + log(w_big + w_small e^-|log p - log q|): 2 exps and 1 log an element, finite
wherever p or q is, so no 0 * inf where one underflows.

Byte budget per chunk (s, s' the student's and teacher's element sizes), forward + backward:
unfused (F.linear twice, float32 upcasts, two log_softmax, the mixture's logsumexp, kl_div and
their autograd) reads and writes a [C, V] float32 tensor at every one of those steps; the fused minimum is
read both rows once and write the gradient, C V (2 s + s'); the kernel reads them 2 (beta = 0,
hard only) or 3 times. The four GEMMs (6 C V Hs flops for the student's logits, dx and dW,
2 C V Ht for the teacher's logits) dominate at LM-head sizes.

Memory above the inputs and the gradients: the two [C, V] logits buffers (see
linear_cross_entropy.py for the chunk), and with ``accum_dtype=torch.float32`` the float32 dW
accumulator and its cast. Rows whose length is not a multiple of 16 bytes are read element by element (no
head/tail split as in cross_entropy.py: LM vocabularies are padded to such multiples).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from onepass import reference
from onepass.ops.cross_entropy import check_target, consume_forward_grad, count_targets, scaled_grad
from onepass.ops.dispatch import (
    as_rows,
    check_float,
    check_linear,
    check_same_device,
    first_order_only,
    flat,
    is_int,
    is_number,
    launch,
    next_power_of_2,
    triton_op,
    use_triton,
)
from onepass.ops.gemm import aligned_head, backprop_head_chunk
from onepass.ops.linear_cross_entropy import check_accum_dtype, chunk_tokens

# Which divergence: beta = 0, beta = 1, or the mixture in between.
FORWARD_KL = tl.constexpr(0)
REVERSE_KL = tl.constexpr(1)
MIXTURE = tl.constexpr(2)

# Columns a program handles per step: two rows' blocks (and ~3 transcendental temporaries) are
# live, so half cross_entropy's 8192 with 8 values a thread a row (89 registers, no spills, sm_90).
# Not yet swept on a GPU: benchmarks/tune_distillation.py sweeps them (results/<gpu>/tune_distillation.log).
DISTILL_MAX_BLOCK = 4096
DISTILL_VALUES_PER_THREAD = 8


def distill_settings(n_cols: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for the distillation row kernel."""
    block = min(next_power_of_2(max(n_cols, 1)), DISTILL_MAX_BLOCK)
    return block, max(1, min(16, block // (32 * DISTILL_VALUES_PER_THREAD)))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _soft_terms(z, y, lse_s, lse_t, inv_temp, beta, KIND: tl.constexpr):
    """p, q, log p - log m and log q - log m at a block (m = p for the forward KL, q for the reverse)."""
    lp = z * inv_temp - lse_s
    lq = y * inv_temp - lse_t
    if KIND == MIXTURE:
        d = lq - lp
        e = tl.exp(-tl.abs(d))
        q_big = d > 0
        big = tl.maximum(lp, lq)
        log_m = big + tl.log(tl.where(q_big, beta + (1.0 - beta) * e, (1.0 - beta) + beta * e))
        p_big = tl.exp(big)
        p = tl.where(q_big, p_big * e, p_big)
        q = tl.where(q_big, p_big, p_big * e)
    else:
        p = tl.exp(lp)
        q = tl.exp(lq)
        log_m = lp if KIND == FORWARD_KL else lq
    return p, q, lp - log_m, lq - log_m


@triton.jit
def _xlogy_sum(ok, p, g):
    """sum of p g over the block, 0 where p is 0 (g may then be infinite)."""
    return tl.sum(tl.where(ok & (p > 0), p * g, 0.0), axis=0)


@triton.jit
def _row_grad(z, c, p, q, g_p, k, lse_raw, tgt, soft_coef, hard_coef, beta, KIND: tl.constexpr,
              SOFT: tl.constexpr, HARD: tl.constexpr, RAW_LSE: tl.constexpr):
    """d loss / d z at a block (soft_coef includes 1 / T)."""
    g = tl.zeros(z.shape, tl.float32)
    if SOFT:
        if KIND == FORWARD_KL:
            g += soft_coef * (p - q)
        else:
            g_soft = tl.where(p > 0, p * (g_p - k), 0.0)
            g += soft_coef * (g_soft if KIND == REVERSE_KL else (1.0 - beta) * g_soft)
    if HARD:
        p_raw = tl.exp(z - lse_raw) if RAW_LSE else p
        g += hard_coef * (p_raw - tl.where(c == tgt, 1.0, 0.0))
    return g


@triton.jit
def _linear_jsd_kernel(
    z_ptr, y_ptr, target_ptr, loss_ptr, counts_ptr,
    z_row_stride, y_row_stride, n_cols, ignore_index,
    inv_temp, beta, weight_hard, weight_soft,
    KIND: tl.constexpr, HAS_TARGET: tl.constexpr, SOFT: tl.constexpr, HARD: tl.constexpr,
    RAW_LSE: tl.constexpr, THREE_PASSES: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_row_stride
    y_row = y_ptr + row * y_row_stride
    cols = tl.arange(0, BLOCK_N)
    valid = row >= 0  # every row without a target
    tgt = row  # (unused without a hard loss)
    if HAS_TARGET:
        tgt = tl.load(target_ptr + row).to(tl.int64)
        valid = tgt != ignore_index
    row_end = tl.where(valid, n_cols, 0)  # an ignored row is not read
    n_valid = tl.maximum(tl.load(counts_ptr), 1).to(tl.float32)
    soft_coef = weight_soft * inv_temp / n_valid
    hard_coef = weight_hard / n_valid
    loss = tl.zeros((), tl.float32)
    if HARD:
        in_range = (tgt >= 0) & (tgt < n_cols)
        z_t = tl.load(z_row + tl.where(in_range, tgt, 0)).to(tl.float32)  # before the gradient overwrites it

    # Pass 1: running max of z (its tempered max is max * inv_temp, T > 0) and the sums of exp.
    m_z = tl.full((), -3.0e38, tl.float32)
    m_y = tl.full((), -3.0e38, tl.float32)
    d_s = tl.zeros((), tl.float32)
    d_t = tl.zeros((), tl.float32)
    d_raw = tl.zeros((), tl.float32)
    if SOFT or HARD:
        for start in range(0, row_end, BLOCK_N):
            c = start + cols
            ok = c < n_cols
            z = tl.load(z_row + c, mask=ok, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_z, tl.max(z, axis=0))
            if SOFT:
                d_s = d_s * tl.exp((m_z - m_new) * inv_temp) + tl.sum(tl.exp((z - m_new) * inv_temp), axis=0)
                y = tl.load(y_row + c, mask=ok, other=float("-inf")).to(tl.float32)
                m_y_new = tl.maximum(m_y, tl.max(y, axis=0))
                d_t = d_t * tl.exp((m_y - m_y_new) * inv_temp) + tl.sum(tl.exp((y - m_y_new) * inv_temp), axis=0)
                m_y = m_y_new
            if RAW_LSE:
                d_raw = d_raw * tl.exp(m_z - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m_z = m_new
    # (an ignored row sums nothing: log(1) keeps its unused statistics finite)
    lse_s = m_z * inv_temp + tl.log(tl.where(d_s > 0, d_s, 1.0))
    lse_t = m_y * inv_temp + tl.log(tl.where(d_t > 0, d_t, 1.0))
    lse_raw = m_z + tl.log(tl.where(d_raw > 0, d_raw, 1.0)) if RAW_LSE else lse_s

    # Pass 2, backwards: the KL sums; writes the gradient when it needs no row sum (beta = 0, hard only).
    sum_p = tl.zeros((), tl.float32)  # sum of p (log p - log m)
    sum_q = tl.zeros((), tl.float32)  # sum of q (log q - log m)
    n_blocks = tl.cdiv(row_end, BLOCK_N)
    grad_in_pass_2 = WRITE_GRAD and not THREE_PASSES
    if SOFT or grad_in_pass_2:
        for i in range(0, n_blocks):
            c = (n_blocks - 1 - i) * BLOCK_N + cols
            ok = c < n_cols
            z = tl.load(z_row + c, mask=ok, other=0.0).to(tl.float32)
            p = z
            q = z
            g_p = z
            if SOFT:
                y = tl.load(y_row + c, mask=ok, other=0.0).to(tl.float32)
                p, q, g_p, g_q = _soft_terms(z, y, lse_s, lse_t, inv_temp, beta, KIND)
                if KIND != FORWARD_KL:
                    sum_p += _xlogy_sum(ok, p, g_p)
                if KIND != REVERSE_KL:
                    sum_q += _xlogy_sum(ok, q, g_q)
            if grad_in_pass_2:
                g = _row_grad(z, c, p, q, g_p, 0.0, lse_raw, tgt, soft_coef, hard_coef, beta, KIND, SOFT, HARD,
                              RAW_LSE)
                tl.store(z_row + c, g.to(z_ptr.dtype.element_ty), mask=ok)
    if SOFT:
        if KIND == FORWARD_KL:
            loss += weight_soft * sum_q
        elif KIND == REVERSE_KL:
            loss += weight_soft * sum_p
        else:
            loss += weight_soft * (beta * sum_q + (1.0 - beta) * sum_p)
    if HARD:
        loss += weight_hard * tl.where(in_range, lse_raw - z_t, float("nan"))
    tl.store(loss_ptr + row, tl.where(valid, loss / n_valid, 0.0))

    # Pass 3, forwards (the first blocks are the likeliest still in L2): the gradient, given K = sum_p.
    if WRITE_GRAD and THREE_PASSES:
        for start in range(0, row_end, BLOCK_N):
            c = start + cols
            ok = c < n_cols
            z = tl.load(z_row + c, mask=ok, other=0.0).to(tl.float32)
            y = tl.load(y_row + c, mask=ok, other=0.0).to(tl.float32)
            p, q, g_p, g_q = _soft_terms(z, y, lse_s, lse_t, inv_temp, beta, KIND)
            g = _row_grad(z, c, p, q, g_p, sum_p, lse_raw, tgt, soft_coef, hard_coef, beta, KIND, SOFT, HARD,
                          RAW_LSE)
            tl.store(z_row + c, g.to(z_ptr.dtype.element_ty), mask=ok)
    if WRITE_GRAD:
        # an ignored row's gradient is zero: written without reading the row
        for start in range(row_end, n_cols, BLOCK_N):
            c = start + cols
            tl.store(z_row + c, tl.zeros([BLOCK_N], tl.float32).to(z_ptr.dtype.element_ty), mask=c < n_cols)


# ---------------------------------------------------------------------------- launchers


def _kind(beta: float) -> int:
    return 0 if beta == 0 else 1 if beta == 1 else 2


def jsd_rows(z: Tensor, y: Tensor | None, target: Tensor | None, loss: Tensor, counts: Tensor, write_grad: bool,
             weight_hard: float, weight_soft: float, beta: float, ignore_index: int, temperature: float) -> None:
    """Per-row loss of the student logits z [R, V] against the teacher's y [R, V] (None: no soft
    loss) into ``loss`` [R] (float32, already divided by the count counts[0]); with ``write_grad``
    d loss / d z overwrites z. Both have unit column stride."""
    rows, n_cols = z.shape
    if rows == 0:
        return
    soft = y is not None
    hard = target is not None and weight_hard != 0
    kind = _kind(beta)
    block, num_warps = distill_settings(n_cols)
    launch(_linear_jsd_kernel, (rows,),
        z, y if soft else z, target if target is not None else counts, loss, counts,
        z.stride(0), y.stride(0) if soft else 0, n_cols, ignore_index,
        1.0 / temperature, beta, weight_hard, weight_soft,
        KIND=kind, HAS_TARGET=target is not None, SOFT=soft, HARD=hard,
        RAW_LSE=hard and (temperature != 1.0 or not soft), THREE_PASSES=soft and kind != 0,
        WRITE_GRAD=write_grad, BLOCK_N=block, num_warps=num_warps,
    )


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor) -> None:
    if bias is None:
        torch.mm(h, weight.t(), out=out)
    else:
        torch.addmm(bias, h, weight.t(), out=out)


def _jsd_launch(s_hidden, s_weight, t_hidden, t_weight, target, s_bias, t_bias, weight_hard, weight_soft, beta,
                ignore_index, temperature, need_dh, need_dw, need_db, chunk_size, accum_dtype):
    """One pass over the token chunks: (loss, d_hidden, d_weight, d_bias) for an upstream gradient of 1."""
    n_vocab, n_hidden = s_weight.shape
    hs, ht = as_rows(s_hidden), as_rows(t_hidden)
    n_tokens = hs.shape[0]
    dev = hs.device
    t = flat(target) if target is not None else None
    if t is not None:
        counts = count_targets(t, n_vocab, ignore_index)
    else:
        counts = torch.full((1,), n_tokens, dtype=torch.int32, device=dev)
    soft = weight_soft != 0
    loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=dev)
    any_grad = need_dh or need_dw or need_db
    d_hidden = torch.empty((n_tokens, n_hidden), dtype=s_hidden.dtype, device=dev) if need_dh else None
    # the first chunk's GEMM overwrites the accumulator (beta = 0): zero-filled only if there is no chunk
    alloc = torch.empty if n_tokens else torch.zeros
    # the GEMMs run over vocabularies padded to a multiple of 8 with zero rows (gemm.aligned_head): the
    # padded logits stay 0 and are read by no kernel, so they add nothing to dx; their dW / db rows are dropped
    (s_weight, s_bias), (t_weight, t_bias) = aligned_head(s_weight, s_bias), aligned_head(t_weight, t_bias)
    padded = s_weight.shape[0]
    d_weight = alloc((padded, n_hidden), dtype=accum_dtype, device=dev) if need_dw else None
    d_bias = torch.zeros(padded, dtype=torch.float32, device=dev) if need_db else None
    chunk = chunk_tokens(n_tokens, accum_dtype if need_dw else s_weight.dtype, s_weight.shape[1], chunk_size)
    rows = min(chunk, n_tokens)
    z_buf = torch.empty((rows, padded), dtype=s_hidden.dtype, device=dev)
    y_buf = torch.empty((rows, padded), dtype=t_hidden.dtype, device=dev) if soft else None
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        z, h_c = z_buf[: end - start], hs[start:end]
        _logits(h_c, s_weight, s_bias, z)  # write C x V student logits
        y = None
        if soft:
            y = y_buf[: end - start]
            _logits(ht[start:end], t_weight, t_bias, y)  # write C x V teacher logits
        jsd_rows(z[:, :n_vocab], y[:, :n_vocab] if soft else None, t[start:end] if t is not None else None,
                 loss_rows[start:end], counts, any_grad, weight_hard, weight_soft, beta, ignore_index,
                 temperature)  # read z, y; write dz over z
        backprop_head_chunk(z, h_c, s_weight, d_hidden[start:end] if need_dh else None, d_weight, d_bias,
                            start == 0)
    z_buf = y_buf = z = y = None  # the logits buffers are not held through the cast of the dW accumulator below
    return (
        loss_rows.sum(),
        d_hidden.view(s_hidden.shape) if need_dh else s_hidden.new_empty(0),
        d_weight[:n_vocab].to(s_weight.dtype) if need_dw else s_hidden.new_empty(0),
        d_bias[:n_vocab].to(s_bias.dtype) if need_db else s_hidden.new_empty(0),
    )


# ------------------------------------------------------------------ registered op


# opaque: its kernel failed to compile under Inductor on an H100 (CHANGELOG)
@triton_op("onepass::linear_jsd_loss_fwd", traced=False)
def _jsd_fwd(
    student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
    target: Optional[Tensor], student_bias: Optional[Tensor], teacher_bias: Optional[Tensor], weight_hard: float,
    weight_soft: float, beta: float, ignore_index: int, temperature: float, need_dh: bool, need_dw: bool,
    need_db: bool, chunk_size: int, accum_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, d_hidden, d_weight, d_bias), the gradients (for an upstream gradient of 1) only where asked for."""
    return _jsd_launch(student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias,
                       teacher_bias, weight_hard, weight_soft, beta, ignore_index, temperature, need_dh, need_dw,
                       need_db, chunk_size, accum_dtype)


def _setup_context(ctx, inputs, output):
    need_dh, need_dw, need_db = inputs[12:15]
    _, d_hidden, d_weight, d_bias = output
    ctx.mark_non_differentiable(d_hidden, d_weight, d_bias)
    ctx.set_materialize_grads(False)  # (as linear_cross_entropy: no zero-filled gradients for the saved ones)
    ctx.needs = (need_dh, need_dw, need_db)
    ctx.save_for_backward(d_hidden, d_weight, d_bias)


def _backward(ctx, dloss, _ddh, _ddw, _ddb):
    if dloss is None:
        return (None,) * 17
    first_order_only("linear_jsd_loss")
    consume_forward_grad(ctx)
    d_hidden, d_weight, d_bias = (scaled_grad(g, dloss) if need else None
                                  for g, need in zip(ctx.saved_tensors, ctx.needs))
    return (d_hidden, d_weight, None, None, None, d_bias) + (None,) * 11


_jsd_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public function


def _check(s_hidden, s_weight, t_hidden, t_weight, target, s_bias, t_bias, weight_hard, weight_soft, beta,
           ignore_index, temperature, chunk_size, accum_dtype):
    for name, x in (("student_hidden", s_hidden), ("teacher_hidden", t_hidden)):
        check_float(name, x)
        if x.dim() == 0:
            raise ValueError(f"{name} must have at least one dimension (the features)")
    check_linear("student_hidden", s_hidden, "student_weight", s_weight, "student_bias", s_bias, out_name="vocab")
    check_linear("teacher_hidden", t_hidden, "teacher_weight", t_weight, "teacher_bias", t_bias, out_name="vocab")
    if t_weight.shape[0] != s_weight.shape[0]:
        raise ValueError(f"student_weight and teacher_weight must have one vocabulary size, got {s_weight.shape[0]} "
                         f"and {t_weight.shape[0]}")
    if s_weight.shape[0] == 0:
        raise ValueError("the vocabulary (the weights' first dim) must not be empty")
    tokens = s_hidden.shape[:-1]
    if t_hidden.shape[:-1] != tokens:
        raise ValueError(f"teacher_hidden must have student_hidden's token dims {tuple(tokens)}, "
                         f"got {tuple(t_hidden.shape[:-1])}")
    if target is not None:
        check_target(target, tokens, "student_hidden's")
    for name, value in (("weight_hard_loss", weight_hard), ("weight_soft_loss", weight_soft)):
        if not is_number(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not (is_number(beta) and 0 <= beta <= 1):
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    if not (is_number(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not is_int(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    check_accum_dtype(accum_dtype, s_weight, "the student weight's")
    if chunk_size is not None and not (is_int(chunk_size) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    check_same_device(student_hidden=s_hidden, student_weight=s_weight, teacher_hidden=t_hidden,
                      teacher_weight=t_weight, target=target, student_bias=s_bias, teacher_bias=t_bias)


def linear_jsd_loss(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
                    target: Tensor | None = None, student_bias: Tensor | None = None,
                    teacher_bias: Tensor | None = None, *, weight_hard_loss: float = 0.5,
                    weight_soft_loss: float = 0.5, beta: float = 0.5, ignore_index: int = -100,
                    temperature: float = 1.0, chunk_size: int | None = None,
                    accum_dtype: torch.dtype | None = None) -> Tensor:
    """Distillation loss through both LM heads without the [tokens, V] logits (Liger's
    ``LigerFusedLinearJSDLoss``, hidden states first; the semantics in the module docstring).

    student_hidden [*, Hs], student_weight [V, Hs], student_bias [V] (one dtype); teacher_hidden
    [*, Ht], teacher_weight [V, Ht], teacher_bias [V] (one dtype, possibly another); target [*]
    class indices or None (every token counts, no hard loss). ``weight_hard_loss`` weighs the
    cross-entropy of the student's logits against ``target``, ``weight_soft_loss`` the generalized
    JSD of softmax(student / temperature) and softmax(teacher / temperature); both are means over
    the tokens whose target is not ``ignore_index`` (a target outside [0, V) is an error even when
    ``weight_hard_loss`` is 0). ``beta`` in [0, 1]: 0 the forward KL(teacher || student), 1 the
    reverse KL(student || teacher). ``chunk_size`` and ``accum_dtype`` as in
    :func:`onepass.ops.linear_cross_entropy`. Returns a float32 scalar. Only the student's tensors
    receive gradients; they are computed in the forward (all three student GEMMs run there), so a
    second backward through the same graph raises.
    """
    _check(student_hidden, student_weight, teacher_hidden, teacher_weight, target, student_bias, teacher_bias,
           weight_hard_loss, weight_soft_loss, beta, ignore_index, temperature, chunk_size, accum_dtype)
    options = (float(weight_hard_loss), float(weight_soft_loss), float(beta), ignore_index, float(temperature))
    if not use_triton(student_hidden):
        return reference.linear_jsd_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, target,
                                         student_bias, teacher_bias, *options).float()
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and student_hidden.requires_grad, grad_on and student_weight.requires_grad,
             grad_on and student_bias is not None and student_bias.requires_grad)
    loss, *_ = _jsd_fwd(student_hidden, student_weight, teacher_hidden.detach(), teacher_weight.detach(), target,
                        student_bias, teacher_bias.detach() if teacher_bias is not None else None, *options, *needs,
                        chunk_size or 0, student_weight.dtype if accum_dtype is None else accum_dtype)
    return loss
