"""``linear_cross_entropy(..., memory="low")``: the LM head and its loss at the memory of the
gradients themselves, for a fourth matmul.

The default path (linear_cross_entropy.py) keeps a float32 [V, H] accumulator for dW across
token chunks; here nothing of [V, H] size exists but dW itself. Tokens go in groups of
``GROUP_TOKENS`` and the vocabulary in blocks of ``VOCAB_BLOCK``:

  forward  for each group, for each block: z = x W_b^T (+ b_b) into a [G, V_b] buffer, and
           ``_fold_block_kernel`` folds it into each row's running max, sum of exp, logit sum,
           target logit and argmax (cross_entropy.py's ``_fold``); then the loss rows and the
           lse from those stats. One matmul; saved for backward: the lse (4 bytes a token).
  backward for each group, for each block: z again, ``_block_grad_kernel`` writes dL/dz over
           it (cross_entropy.py's ``_write_grad``, from the saved lse), dx_g += dz W_b into a
           float32 [G, H] accumulator, dW_b += dz^T x_g straight into dW (in its dtype).

So 4 T H V x 2 flops (the default's three matmuls and the recomputed logits), and beyond the
inputs and gradients only a [G, V_b] buffer, a float32 [G, H] accumulator and [T] floats.
The price of not holding a float32 dW: each block of dW is a sum of T / G group GEMMs
rounded to the weight's dtype at every add (each GEMM sums its G tokens in float32), i.e.
T / G roundings, where the default rounds once (error against a float32 reference: measured
in tests/ops/test_linear_cross_entropy.py's GPU test and the benchmark notes).

Sizes: the dW add reads and writes V_b H elements of 2 bytes for 2 G V_b H flops (G / 2 flop
a byte: G >= 512 keeps it under the matmul on Hopper), the dx add reads and writes G H floats
for 2 G V_b H flops (V_b / 4 flop a byte: V_b >= 2048); larger G means fewer roundings of dW
and larger buffers. G = 2048, V_b = 4096: at H = 4096, 16 MiB of buffer and 32 MiB of
accumulator, which keeps the peak at Liger's (benchmarks/results/h100-80gb-hbm3/lm_head.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from onepass.ops.cross_entropy import _capped, _fold, _write_grad, count_targets, reduce_loss
from onepass.ops.dispatch import first_order_only, flat, launch, row_settings, triton_op
from onepass.ops.gemm import accumulate_mm

GROUP_TOKENS = 2048
VOCAB_BLOCK = 4096


@triton.jit
def _fold_block_kernel(z_ptr, t_ptr, m_ptr, s_ptr, zsum_ptr, zt_ptr, arg_ptr, nan_ptr, row_stride, n_cols, col0,
                       softcap, HAS_SOFTCAP: tl.constexpr, WRITE_PRED: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """Fold one row's logits of vocabulary columns [col0, col0 + n_cols) into its running stats."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * row_stride
    m = tl.load(m_ptr + row)
    s = tl.load(s_ptr + row)
    z_sum = tl.load(zsum_ptr + row)
    arg = tl.load(arg_ptr + row)
    first_nan = tl.load(nan_ptr + row)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        ok = c < n_cols
        m, s, z_sum, arg, first_nan = _fold(tl.load(z_row + c, mask=ok, other=0.0), col0 + c, ok, m, s, z_sum, arg,
                                            first_nan, softcap, HAS_SOFTCAP, WRITE_PRED, HAS_SMOOTHING)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(zsum_ptr + row, z_sum)
    tl.store(arg_ptr + row, arg)
    tl.store(nan_ptr + row, first_nan)
    t = tl.load(t_ptr + row).to(tl.int64) - col0
    if (t >= 0) & (t < n_cols):
        tl.store(zt_ptr + row, _capped(tl.load(z_row + t).to(tl.float32), softcap, HAS_SOFTCAP))


@triton.jit
def _block_grad_kernel(z_ptr, t_ptr, lse_ptr, scale_ptr, row_stride, scale_stride, n_cols, col0, n_vocab,
                       label_smoothing, z_loss, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr):
    """dL/dz over one row's logits of columns [col0, col0 + n_cols); ``scale`` is 0 on ignored rows."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * row_stride
    scale = tl.load(scale_ptr + row * scale_stride)
    lse = tl.load(lse_ptr + row)
    p_coef = scale * (1.0 + 2.0 * z_loss * lse)
    smooth = scale * label_smoothing / n_vocab
    hit = scale * (1.0 - label_smoothing)
    a_t = (tl.load(t_ptr + row) - col0).to(tl.int32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        ok = c < n_cols
        _write_grad(tl.load(z_row + c, mask=ok, other=0.0), c, z_row + c, ok, a_t, lse, p_coef, smooth, hit, softcap,
                    HAS_SOFTCAP)


def _blocks(n_tokens: int, n_vocab: int):
    return ([(s, min(s + GROUP_TOKENS, n_tokens)) for s in range(0, n_tokens, GROUP_TOKENS)],
            [(v, min(v + VOCAB_BLOCK, n_vocab)) for v in range(0, n_vocab, VOCAB_BLOCK)])


def _logits(buf: Tensor, h: Tensor, weight: Tensor, bias: Tensor | None, v0: int, v1: int) -> Tensor:
    z = buf[: h.shape[0], : v1 - v0]
    if bias is None:
        torch.mm(h, weight[v0:v1].t(), out=z)
    else:
        torch.addmm(bias[v0:v1], h, weight[v0:v1].t(), out=z)
    return z


# opaque: Inductor gave wrong results on an H100 (CHANGELOG)
@triton_op("onepass::linear_cross_entropy_low_fwd", traced=False)
def _low_fwd(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], ignore_index: int,
             label_smoothing: float, z_loss: float, softcap: Optional[float], return_pred: bool
             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token (loss rows, lse) in float32, the argmax if asked, and count_targets' counts."""
    n_vocab, n_hidden = weight.shape
    h2, t = hidden.reshape(-1, n_hidden), flat(target)
    n, dev = t.numel(), hidden.device
    counts = count_targets(t, n_vocab, ignore_index)  # raises (CPU) or asserts (GPU) on a target outside [0, V)
    m = torch.full((n,), -3.0e38, dtype=torch.float32, device=dev)
    s, z_sum, z_t = (torch.zeros(n, dtype=torch.float32, device=dev) for _ in range(3))
    arg = torch.zeros(n, dtype=torch.int32, device=dev)
    first_nan = torch.full((n,), 2**31 - 1, dtype=torch.int32, device=dev)
    groups, blocks = _blocks(n, n_vocab)
    buf = torch.empty((min(n, GROUP_TOKENS), min(n_vocab, VOCAB_BLOCK)), dtype=hidden.dtype, device=dev)
    for g0, g1 in groups:
        for v0, v1 in blocks:
            z = _logits(buf, h2[g0:g1], weight, bias, v0, v1)
            block, num_warps = row_settings(v1 - v0)
            launch(_fold_block_kernel, (g1 - g0,), z, t[g0:g1], m[g0:g1], s[g0:g1], z_sum[g0:g1], z_t[g0:g1],
                   arg[g0:g1], first_nan[g0:g1], z.stride(0), v1 - v0, v0, softcap or 1.0,
                   HAS_SOFTCAP=softcap is not None, WRITE_PRED=return_pred, HAS_SMOOTHING=label_smoothing > 0,
                   BLOCK_N=block, num_warps=num_warps)
    lse = torch.where(s == 0, float("-inf"), m + torch.log(torch.where(s == 0, 1.0, s)))
    loss = lse - (1.0 - label_smoothing) * z_t - label_smoothing * z_sum / n_vocab + z_loss * lse * lse
    loss = torch.where(t != ignore_index, loss, 0.0)
    pred = torch.where(first_nan < 2**31 - 1, first_nan, arg).long() if return_pred else arg.new_empty(0).long()
    return loss, lse, pred, counts


# opaque: Inductor gave wrong results on an H100 (CHANGELOG)
@triton_op("onepass::linear_cross_entropy_low_bwd", traced=False)
def _low_bwd(scale: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], lse: Tensor,
             label_smoothing: float, z_loss: float, softcap: Optional[float], need_dh: bool, need_dw: bool,
             need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(d hidden, d weight, d bias) for d loss_row = ``scale`` (a float32 scalar or one a token, 0 on ignored ones)."""
    n_vocab, n_hidden = weight.shape
    h2, t = hidden.reshape(-1, n_hidden), flat(target)
    n, dev = t.numel(), hidden.device
    d_hidden = torch.empty((n, n_hidden), dtype=hidden.dtype, device=dev) if need_dh else None
    d_weight = (torch.empty if n else torch.zeros)(weight.shape, dtype=weight.dtype, device=dev) if need_dw else None
    d_bias = torch.zeros(n_vocab, dtype=torch.float32, device=dev) if need_db else None
    groups, blocks = _blocks(n, n_vocab)
    buf = torch.empty((min(n, GROUP_TOKENS), min(n_vocab, VOCAB_BLOCK)), dtype=hidden.dtype, device=dev)
    dh_acc = torch.empty((min(n, GROUP_TOKENS), n_hidden), dtype=torch.float32, device=dev) if need_dh else None
    for g0, g1 in groups:
        h_g = h2[g0:g1]
        for v0, v1 in blocks:
            z = _logits(buf, h_g, weight, bias, v0, v1)
            block, num_warps = row_settings(v1 - v0)
            scale_g = scale[g0:g1] if scale.dim() else scale
            launch(_block_grad_kernel, (g1 - g0,), z, t[g0:g1], lse[g0:g1], scale_g, z.stride(0),
                   scale_g.stride(0) if scale_g.dim() else 0, v1 - v0, v0, n_vocab, label_smoothing, z_loss,
                   softcap or 1.0, HAS_SOFTCAP=softcap is not None, BLOCK_N=block, num_warps=num_warps)
            if need_dh:
                accumulate_mm(dh_acc[: g1 - g0], z, weight[v0:v1], beta=int(v0 > 0))
            if need_dw:
                accumulate_mm(d_weight[v0:v1], z.t(), h_g, beta=int(g0 > 0))
            if need_db:
                d_bias[v0:v1] += z.sum(0, dtype=torch.float32)
        if need_dh:
            d_hidden[g0:g1] = dh_acc[: g1 - g0]
    return (d_hidden.view(hidden.shape) if need_dh else hidden.new_empty(0),
            d_weight if need_dw else hidden.new_empty(0),
            d_bias.to(bias.dtype) if need_db else hidden.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, _ = inputs
    _, lse, pred, counts = output
    ctx.mark_non_differentiable(lse, pred, counts)
    ctx.save_for_backward(hidden, weight, target, bias, lse)
    ctx.options = (ignore_index, label_smoothing, z_loss, softcap)
    ctx.needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)


def _backward(ctx, d_loss_rows, _dlse, _dpred, _dcounts):
    first_order_only("linear_cross_entropy")
    hidden, weight, target, bias, lse = ctx.saved_tensors
    ignore_index, label_smoothing, z_loss, softcap = ctx.options
    scale = torch.where(flat(target) != ignore_index, d_loss_rows.float(), 0.0)
    d_hidden, d_weight, d_bias = _low_bwd(scale, hidden, weight, target, bias, lse, label_smoothing, z_loss, softcap,
                                          *ctx.needs)
    return ((d_hidden if ctx.needs[0] else None), (d_weight if ctx.needs[1] else None), None,
            (d_bias if ctx.needs[2] else None), None, None, None, None, None)


_low_fwd.register_autograd(_backward, setup_context=_setup_context)


def low_memory_loss(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int,
                    reduction: str, label_smoothing: float, z_loss: float, softcap: float | None, return_pred: bool,
                    loss_dtype: torch.dtype):
    """(loss, lse, pred) of linear_cross_entropy's memory="low" (the checks done by the caller)."""
    rows, lse, pred, counts = _low_fwd(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap,
                                       return_pred)
    loss = reduce_loss(rows, counts, reduction, target.shape, loss_dtype)
    return loss, lse.view(target.shape), pred.view(target.shape) if return_pred else pred
