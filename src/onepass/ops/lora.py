"""lora_linear: a linear layer with a LoRA adapter, as one node whose only kernels are GEMMs.

    y = x W^T + b + s (x_a A^T) B^T      x [*, K], W [N, K], b [N], A [r, K], B [N, r],
                                          x_a = dropout(x) (x itself without dropout)

PEFT's ``lora.Linear`` runs the base GEMM, the adapter's two GEMMs, then ``* s`` and ``+``
as separate kernels: with T tokens, besides the GEMMs' operand reads, [T, N] crosses HBM 7
times in forward (the base output's write, B's output write, the scale's read and write,
the add's two reads and its write); backward adds a scale of dy ([T, N] read and write) and
the sum of the two input gradients ([T, K]: the adapter's write, two reads, one write).

Here the scale rides on the GEMMs' alpha and both sums on cuBLAS's epilogue (``addmm_``,
beta = 1: the output's current values are added in fp32, rounded once):

    forward   t = x_a A^T                   [T, r]   reads x_a
              y = s t B^T (+ b)             [T, N]   written once (a rank-r GEMM: memory-bound)
              y += x W^T                             the base GEMM reads y in its epilogue
    backward  dt = s dy B                   [T, r]   reads dy
              dx = dt A;  dx += dy W                 (with dropout, dx_a = dt A apart)
              dA = dt^T x_a,  dB = s dy^T t,  dW = dy^T x,  db = sum over T of dy

so [T, N] crosses HBM 3 times in forward (write, epilogue read, write) and [T, K] 3 times in
backward beyond the GEMMs' operand reads, in 3 + 5 launches (with a frozen base), plus A's and
B's casts when they are not in x's dtype. The rank-r GEMM goes first, so the epilogue that
reads y is the big GEMM's, which overlaps it with its math (faster than the other order; the
numbers are in CHANGELOG.md, the op's current times in benchmarks/results/h200/lora.md).

The adapter runs in x's dtype with fp32 accumulation (A and B cast to it: [r, K] and [N, r]
copies); its gradients are written in A's and B's own dtypes by the GEMMs themselves (fp32
adapters on a bf16 base are PEFT's default). PEFT instead upcasts x for the adapter's path
when the dtypes differ; the difference is t rounded to x's dtype. Dropout on the adapter's
input is F.dropout (the random stream PEFT's ``lora_dropout`` draws from), applied outside
the node: x_a is then a tensor of its own, and autograd adds its gradient to x's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from onepass import reference
from onepass.ops.dispatch import (
    as_rows,
    autocast_inputs,
    check_float,
    check_linear,
    check_probability,
    check_same_device,
    eager_autograd,
    first_order_only,
    is_number,
    registered_outputs,
    route,
    triton_op,
    use_triton,
)
from onepass.ops.gemm import accumulate_mm


def _mm_as(dtype: torch.dtype, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """alpha * a @ b written in ``dtype`` by the GEMM itself."""
    return accumulate_mm(torch.empty(a.shape[0], b.shape[1], dtype=dtype, device=a.device), a, b, 0, alpha)


def lora_fwd_launch(x, weight, bias, lora_a, lora_b, scaling, lora_x):
    """(y, t, a, b): the output, the adapter's rank-r activation t = x_a A^T, and A and B in
    x's dtype (themselves when already in it): all three kept for backward, which then
    recasts nothing."""
    x2 = as_rows(x)
    a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)
    t = as_rows(lora_x if lora_x is not None else x) @ a.t()
    y = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    # y = bias + s t B^T (the scale applied in fp32 by the GEMM), then the base GEMM adds into it
    torch.addmm(bias if bias is not None else y, t, b.t(), beta=int(bias is not None), alpha=scaling, out=y)
    y.addmm_(x2, weight.t())
    return y.view(*x.shape[:-1], weight.shape[0]), t, a, b


def lora_bwd_launch(dy, x, weight, a, b, t, lora_x, scaling, a_dtype, b_dtype, need_dx, need_dw, need_dbias,
                     need_da, need_db, need_dx_a, dx_into=None):
    """(dx, dW, d_bias, dA, dB, dx_a), None where not needed, dA and dB in ``a_dtype`` and
    ``b_dtype``; x may be None when neither dW nor (without a separate adapter input) dA is.
    ``dx_into`` ([tokens, K]): dx is added into it by the GEMMs (several layers reading one x)."""
    dy2 = as_rows(dy)
    x2 = as_rows(x) if x is not None else None
    x_a2 = as_rows(lora_x) if lora_x is not None else x2
    in_shape = (*dy.shape[:-1], weight.shape[1])
    need_dt = need_da or need_dx_a or (need_dx and lora_x is None)
    dt = _mm_as(dy.dtype, dy2, b, alpha=scaling) if need_dt else None  # s dy B
    dx = None
    if need_dx:
        if lora_x is None:
            dx = dt @ a if dx_into is None else dx_into.addmm_(dt, a)
            dx.addmm_(dy2, weight)
        else:
            dx = dy2 @ weight if dx_into is None else dx_into.addmm_(dy2, weight)
        dx = dx.view(in_shape)
    return (dx,
            dy2.t() @ x2 if need_dw else None,
            dy2.sum(0) if need_dbias else None,
            _mm_as(a_dtype, dt.t(), x_a2) if need_da else None,
            _mm_as(b_dtype, dy2.t(), t, alpha=scaling) if need_db else None,
            (dt @ a).view(in_shape) if need_dx_a else None)


@triton_op("onepass::lora_linear_fwd", mutates_args=())
def _lora_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora_a: Tensor, lora_b: Tensor, scaling: float,
              lora_x: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    y, t, a, b = lora_fwd_launch(x, weight, bias, lora_a, lora_b, scaling, lora_x)
    # outputs may not alias inputs: factors already in x's dtype are copied
    return y, t, a if a is not lora_a else a.clone(), b if b is not lora_b else b.clone()


@triton_op("onepass::lora_linear_bwd", mutates_args=())
def _lora_bwd(dy: Tensor, x: Optional[Tensor], weight: Tensor, a: Tensor, b: Tensor, t: Tensor,
              lora_x: Optional[Tensor], scaling: float, a_dtype: torch.dtype, b_dtype: torch.dtype, need_dx: bool,
              need_dw: bool, need_dbias: bool, need_da: bool, need_db: bool, need_dx_a: bool
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dW, d_bias, dA, dB, dx_a), each empty where not needed."""
    return registered_outputs(lora_bwd_launch(dy, x, weight, a, b, t, lora_x, scaling, a_dtype, b_dtype, need_dx,
                                               need_dw, need_dbias, need_da, need_db, need_dx_a), dy)


def _setup_context(ctx, inputs, output):
    x, weight, bias, lora_a, lora_b, scaling, lora_x = inputs
    _, t, a, b = output
    # x is needed for dW, and for dA when it is the adapter's input too; else not kept
    # (with dropout and a frozen base, PEFT keeps only the dropped copy as well)
    keep_x = ctx.needs_input_grad[1] or lora_x is None
    ctx.save_for_backward(x if keep_x else None, weight, a, b, t, lora_x)
    ctx.scaling, ctx.has_bias, ctx.dtypes = scaling, bias is not None, (lora_a.dtype, lora_b.dtype)


def _backward(ctx, dy, *_):
    first_order_only("lora_linear")
    x, weight, a, b, t, lora_x = ctx.saved_tensors
    n = ctx.needs_input_grad  # x, weight, bias, lora_a, lora_b, scaling, lora_x
    needs = (n[0], n[1], n[2] and ctx.has_bias, n[3], n[4], n[6] and lora_x is not None)
    grads = route(_lora_bwd, lora_bwd_launch, dy)(dy, x, weight, a, b, t, lora_x, ctx.scaling, *ctx.dtypes, *needs)
    dx, dw, dbias, da, db, dx_a = (g if need else None for g, need in zip(grads, needs))
    return dx, dw, dbias, da, db, None, dx_a


_lora_fwd.register_autograd(_backward, setup_context=_setup_context)
_lora_fwd_eager = eager_autograd(lora_fwd_launch, _setup_context, _backward, returns=1)


def _check(x, weight, lora_a, lora_b, scaling, bias, dropout_p):
    check_float("lora_a", lora_a)
    check_float("lora_b", lora_b)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the features)")
    check_linear("x", x, "weight", weight, "bias", bias)
    k, n = x.shape[-1], weight.shape[0]
    if lora_a.dim() != 2 or lora_a.shape[0] < 1 or lora_a.shape[1] != k:
        raise ValueError(f"lora_a must be [rank, {k}] with rank >= 1, got {tuple(lora_a.shape)}")
    rank = lora_a.shape[0]
    if lora_b.dim() != 2 or lora_b.shape != (n, rank):
        raise ValueError(f"lora_b must be [{n}, {rank}] (weight's out_features, lora_a's rank), "
                         f"got {tuple(lora_b.shape)}")
    if not is_number(scaling):
        bad_value = isinstance(scaling, float)  # nan or inf: a number, but not a usable one
        raise (ValueError if bad_value else TypeError)(f"scaling must be a finite number, got {scaling!r}")
    check_probability("dropout_p", dropout_p)
    check_same_device(x=x, weight=weight, lora_a=lora_a, lora_b=lora_b, bias=bias)


def lora_linear(x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float = 1.0,
                bias: Tensor | None = None, *, dropout_p: float = 0.0, training: bool = True) -> Tensor:
    """``F.linear(x, weight, bias) + scaling * F.linear(F.linear(dropout(x), lora_a), lora_b)``,
    PEFT's LoRA linear, as one node whose only kernels are GEMMs (see the module docstring).

    x [*, K]; weight [N, K] and bias [N] in x's dtype; lora_a [r, K] and lora_b [N, r] in any
    float dtype (used in x's dtype, their gradients returned in their own). ``dropout_p``
    drops the adapter's input only, as F.dropout(x, dropout_p, training). Under autocast, x,
    weight and bias are cast to autocast's dtype first, as F.linear casts them.
    """
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None:
            check_float(name, t)
    x, (weight, bias) = autocast_inputs(x, [weight, bias])
    _check(x, weight, lora_a, lora_b, scaling, bias, dropout_p)
    with torch.autocast(x.device.type, enabled=False):
        if not use_triton(x):
            return reference.lora_linear(x, weight, lora_a, lora_b, scaling, bias, dropout_p, training)
        lora_x = F.dropout(x, dropout_p, training) if dropout_p > 0 and training else None
        op = route(_lora_fwd, lora_fwd_launch, x, weight, bias, lora_a, lora_b, lora_x, autograd=_lora_fwd_eager)
        return op(x, weight, bias, lora_a, lora_b, float(scaling), lora_x)[0]


class _SharedInputAdapters(torch.autograd.Function):
    """lora_linear(x, ...) for several LoRA linears reading one x (q/k/v, gate/up) as one
    node, from x, the scalings and (weight, bias, lora_a, lora_b, x_a) per layer (x_a: the
    layer's dropped input, None without dropout): backward adds their input gradients inside
    its GEMMs instead of autograd's add kernels (as ``projections.linears`` does for plain
    linears; a dropped input's gradient is returned on its own, through its dropout), and one
    Python node stands for them all."""

    @staticmethod
    def forward(ctx, x, scalings, *params):
        outs, saved, ctx.meta = [], [x], []
        for i, scaling in enumerate(scalings):
            weight, bias, lora_a, lora_b, x_a = params[5 * i:5 * i + 5]
            y, t, a, b = lora_fwd_launch(x, weight, bias, lora_a, lora_b, scaling, x_a)
            outs.append(y)
            saved += [weight, a, b, t, x_a]
            ctx.meta.append((bias is not None, lora_a.dtype, lora_b.dtype))
        ctx.save_for_backward(*saved)
        ctx.scalings = scalings
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        first_order_only("LoRA shared node")
        x, *saved = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx, grads = None, []
        for i, (dy, scaling, (has_bias, a_dtype, b_dtype)) in enumerate(zip(dys, ctx.scalings, ctx.meta)):
            weight, a, b, t, x_a = saved[5 * i:5 * i + 5]
            n = needs[2 + 5 * i:7 + 5 * i]  # weight, bias, lora_a, lora_b, x_a
            g = lora_bwd_launch(dy, x, weight, a, b, t, x_a, scaling, a_dtype, b_dtype, needs[0], n[0],
                                          n[1] and has_bias, n[2], n[3], n[4] and x_a is not None, dx_into=dx)
            dx = g[0].view(-1, x.shape[-1]) if needs[0] else None
            grads += [g[1], g[2] if has_bias else None, g[3], g[4], g[5]]
        return (dx.view(x.shape) if dx is not None else None), None, *grads


def lora_linears(x: Tensor, scalings: tuple[float, ...], params: list[Tensor | None]) -> tuple[Tensor, ...]:
    """``lora_linear`` of one input ``x`` through several layers as one node: ``params`` holds
    (weight, bias, lora_a, lora_b, x_a) per layer (x_a: the layer's dropped input, None without
    dropout), ``scalings`` one scaling each. For onepass's patched PEFT layers (the caller
    checks them); the launches are ``lora_linear``'s."""
    return _SharedInputAdapters.apply(x, scalings, *params)
